// Vision-LSTM (VisionLSTM2): parameter counts and key names of the official hub model
// (vil_official.md 2, 3.1), raw checkpoint name mapping (3.2), mLSTM modes, resolution change.
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/vil.h"
#include "linvis/ops/mlstm.h"
#include "support/heap.h"
#include "support/testing.h"

using linvis::models::create_model;
using linvis::models::ModelConfig;
using linvis::models::ModelPtr;
using linvis::testing::all_close;

namespace {

// A small ViL: 2 pairs (4 sub-blocks), D = 32 (I = 64, DH = 16), 8x8 patches.
ModelConfig small_config(int64_t img = 48, const std::string& mode = "parallel", int64_t chunk = 64) {
    ModelConfig c;
    c.set("embed_dim", int64_t{32}).set("depth", int64_t{2}).set("patch_size", int64_t{8}).set("img_size", img);
    c.set("num_classes", int64_t{10}).set("mlstm_mode", mode).set("chunk_size", chunk);
    return c;
}

// The official init has zero gate weights and LN offsets; perturb everything so that every
// parameter influences the output.
void perturb(torch::nn::Module& m, uint64_t seed) {
    torch::manual_seed(seed);
    torch::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.add_(0.2 * torch::randn_like(p));
}

void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
    torch::NoGradGuard no_grad;
    auto dst = to.named_parameters();
    for (const auto& kv : from.named_parameters()) dst[kv.key()].copy_(kv.value());
}

std::string dir_name(int64_t i) { return i % 2 == 0 ? "rowwise_from_top_left" : "rowwise_from_bot_right"; }

// The ViL-T hub key list and shapes of spec 3.1, written out independently of the model code.
std::vector<std::pair<std::string, std::vector<int64_t>>> official_tiny_keys() {
    const int64_t D = 192, I = 384;
    std::vector<std::pair<std::string, std::vector<int64_t>>> keys = {
        {"patch_embed.proj.weight", {D, 3, 16, 16}}, {"patch_embed.proj.bias", {D}}, {"pos_embed.embed", {1, 14, 14, D}}};
    for (int64_t p = 0; p < 12; ++p)
        for (int64_t d = 0; d < 2; ++d) {
            const std::string b = "blocks." + std::to_string(p) + "." + dir_name(d) + ".";
            const std::vector<std::pair<std::string, std::vector<int64_t>>> block = {
                {"norm.weight", {D}},
                {"norm.bias", {D}},
                {"layer.learnable_skip", {I}},
                {"layer.proj_up.weight", {4 * D, D}},
                {"layer.proj_up.bias", {4 * D}},
                {"layer.q_proj.weight", {I / 4, 4, 4}},
                {"layer.q_proj.bias", {I}},
                {"layer.k_proj.weight", {I / 4, 4, 4}},
                {"layer.k_proj.bias", {I}},
                {"layer.v_proj.weight", {I / 4, 4, 4}},
                {"layer.v_proj.bias", {I}},
                {"layer.conv.weight", {I, 1, 3, 3}},
                {"layer.conv.bias", {I}},
                {"layer.mlstm_cell.igate.weight", {4, 3 * I}},
                {"layer.mlstm_cell.igate.bias", {4}},
                {"layer.mlstm_cell.fgate.weight", {4, 3 * I}},
                {"layer.mlstm_cell.fgate.bias", {4}},
                {"layer.mlstm_cell.outnorm.weight", {I}},
                {"layer.mlstm_cell.outnorm.bias", {I}},
                {"layer.proj_down.weight", {D, I}},
                {"layer.proj_down.bias", {D}},
            };
            for (const auto& [name, shape] : block) keys.push_back({b + name, shape});
        }
    keys.push_back({"norm.weight", {D}});
    keys.push_back({"norm.bias", {D}});
    keys.push_back({"legacy_norm.weight", {2 * D}});
    keys.push_back({"legacy_norm.bias", {2 * D}});
    keys.push_back({"head.weight", {1000, 2 * D}});
    keys.push_back({"head.bias", {1000}});
    return keys;
}

// Raw training-checkpoint names (spec 3.2, 24 flat blocks) with the hub name each must map to.
std::vector<std::pair<std::string, std::string>> raw_to_hub(int64_t pairs) {
    std::vector<std::pair<std::string, std::string>> out = {{"patch_embed.proj.weight", "patch_embed.proj.weight"},
                                                            {"patch_embed.proj.bias", "patch_embed.proj.bias"},
                                                            {"pos_embed.embed", "pos_embed.embed"}};
    const std::vector<std::string> layer_params = {
        "learnable_skip", "proj_up.weight", "proj_up.bias", "q_proj.weight", "q_proj.bias", "k_proj.weight",
        "k_proj.bias", "v_proj.weight", "v_proj.bias", "mlstm_cell.igate.weight", "mlstm_cell.igate.bias",
        "mlstm_cell.fgate.weight", "mlstm_cell.fgate.bias", "mlstm_cell.outnorm.weight", "mlstm_cell.outnorm.bias",
        "proj_down.weight", "proj_down.bias"};
    for (int64_t i = 0; i < 2 * pairs; ++i) {
        const std::string raw = "xlstm.blocks." + std::to_string(i) + ".";
        const std::string hub = "blocks." + std::to_string(i / 2) + "." + dir_name(i) + ".";
        for (const char* wb : {"weight", "bias"}) {
            out.push_back({raw + "xlstm_norm." + wb, hub + "norm." + wb});
            out.push_back({raw + "xlstm.conv1d." + wb, hub + "layer.conv." + wb});
        }
        for (const auto& p : layer_params) out.push_back({raw + "xlstm." + p, hub + "layer." + p});
    }
    for (const char* wb : {"weight", "bias"}) {
        out.push_back({std::string("xlstm.post_blocks_norm.") + wb, std::string("norm.") + wb});
        out.push_back({std::string("head.0.") + wb, std::string("legacy_norm.") + wb});
        out.push_back({std::string("head.1.") + wb, std::string("head.") + wb});
    }
    return out;
}

}  // namespace

TEST(Vil, ParameterCounts) {
    torch::manual_seed(100);  // model init draws from the global generator
    // Spec section 2: measured with the official code, equal to the training logs.
    const std::map<std::string, int64_t> expected = {
        {"vil_tiny", 6391528}, {"vil_small", 23398696}, {"vil_base", 89263528}};
    for (const auto& [name, count] : expected) {
        auto model = create_model(name);
        EXPECT_EQ(linvis::models::count_parameters(*model), count) << name;
        EXPECT_EQ(model->named_parameters().size(), 513u) << name;
        EXPECT_EQ(model->named_buffers().size(), 0u) << name;
    }
}

TEST(Vil, StateDictNamesMatchOfficial) {
    torch::manual_seed(100);  // model init draws from the global generator
    auto model = create_model("vil_tiny");
    auto expected = official_tiny_keys();
    auto params = model->named_parameters();
    ASSERT_EQ(params.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
        EXPECT_EQ(params[i].key(), expected[i].first) << "entry " << i;
        EXPECT_EQ(params[i].value().sizes(), torch::IntArrayRef(expected[i].second)) << expected[i].first;
    }
    // The stored LN weights are offsets (zeros at init): the applied weight is 1 + w.
    EXPECT_EQ(params["norm.weight"].abs().sum().item<double>(), 0.0);
    EXPECT_EQ(params["legacy_norm.weight"].sum().item<double>(), 384.0);
}

TEST(Vil, RawCheckpointNamesMap) {
    torch::manual_seed(100);  // model init draws from the global generator
    auto tiny = create_model("vil_tiny");
    auto hub_params = tiny->named_parameters();
    std::set<std::string> mapped;
    for (const auto& [raw, hub] : raw_to_hub(12)) {
        const std::string got = tiny->map_checkpoint_key(raw);
        EXPECT_EQ(got, hub) << raw;
        EXPECT_TRUE(hub_params.contains(got)) << raw << " -> " << got;
        mapped.insert(got);
        EXPECT_EQ(tiny->map_checkpoint_key(hub), hub) << "hub names pass unchanged";
    }
    EXPECT_EQ(mapped.size(), hub_params.size()) << "the mapping covers every hub key exactly once";
    EXPECT_EQ(tiny->map_checkpoint_key("xlstm.blocks.0.xlstm.mlstm_cell.causal_mask"), "");

    // A raw state dict loaded through the mapping reproduces the model.
    auto a = create_model("vil_tiny", small_config());
    perturb(*a, 1);
    auto b = create_model("vil_tiny", small_config());
    auto a_params = a->named_parameters();
    auto b_params = b->named_parameters();
    size_t loaded = 0;
    {
        torch::NoGradGuard no_grad;
        for (const auto& [raw, hub] : raw_to_hub(2)) {
            const std::string key = b->map_checkpoint_key(raw);
            b_params[key].copy_(b->adapt_checkpoint_tensor(key, a_params[hub]));
            ++loaded;
        }
    }
    EXPECT_EQ(loaded, b_params.size());
    a->eval();
    b->eval();
    torch::manual_seed(2);
    auto x = torch::randn({2, 3, 48, 48});
    EXPECT_TRUE(all_close(b->forward(x), a->forward(x), 0, 0));
}

TEST(Vil, ModesAgree) {
    torch::manual_seed(100);  // model init draws from the global generator
    // float64 so that the comparison isolates the algorithms; 36 tokens, chunk sizes 5 (not a divisor) and 12.
    auto ref = create_model("vil_tiny", small_config(48, "parallel"));
    perturb(*ref, 3);
    ref->to(torch::kFloat64);
    ref->eval();
    torch::manual_seed(4);
    auto x = torch::randn({2, 3, 48, 48}, torch::kFloat64);
    torch::NoGradGuard no_grad;
    auto ref_feat = ref->forward_features(x);
    auto ref_logits = ref->forward_head(ref_feat, false);
    for (const auto& [mode, chunk] : std::vector<std::pair<std::string, int64_t>>{
             {"chunkwise", 5}, {"chunkwise", 12}, {"chunkwise", 64}, {"recurrent", 64}}) {
        auto other = create_model("vil_tiny", small_config(48, mode, chunk));
        other->to(torch::kFloat64);
        copy_parameters(*ref, *other);
        other->eval();
        auto feat = other->forward_features(x);
        EXPECT_TRUE(all_close(feat, ref_feat, 1e-9, 1e-10)) << mode << " chunk " << chunk;
        EXPECT_TRUE(all_close(other->forward_head(feat, false), ref_logits, 1e-9, 1e-10)) << mode << " chunk " << chunk;
    }
    // float32: same check at the precision of the model dtype.
    auto ref32 = create_model("vil_tiny", small_config(48, "parallel"));
    auto chunk32 = create_model("vil_tiny", small_config(48, "chunkwise", 5));
    copy_parameters(*ref, *ref32);
    copy_parameters(*ref, *chunk32);
    ref32->eval();
    chunk32->eval();
    auto x32 = x.to(torch::kFloat32);
    EXPECT_TRUE(all_close(chunk32->forward_features(x32), ref32->forward_features(x32), 1e-4, 1e-4));
}

TEST(Vil, ForwardBackwardRuns) {
    torch::manual_seed(100);  // model init draws from the global generator
    auto cfg = small_config(32, "chunkwise", 6);
    cfg.set("drop_path_rate", 0.1);
    auto model = create_model("vil_tiny", cfg);
    perturb(*model, 5);
    model->train();
    torch::manual_seed(6);
    auto x = torch::randn({4, 3, 32, 32});
    auto logits = model->forward(x);
    ASSERT_EQ(logits.sizes(), torch::IntArrayRef({4, 10}));
    logits.pow(2).sum().backward();
    int64_t with_grad = 0;
    for (const auto& kv : model->named_parameters()) {
        ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
        EXPECT_TRUE(torch::isfinite(kv.value().grad()).all().item<bool>()) << kv.key();
        with_grad += kv.value().grad().abs().sum().item<double>() > 0;
    }
    EXPECT_EQ(with_grad, static_cast<int64_t>(model->named_parameters().size()));
    model->eval();
    torch::NoGradGuard no_grad;
    auto feats = model->forward_features(x);
    EXPECT_EQ(feats.sizes(), torch::IntArrayRef({4, 16, 32}));
    EXPECT_EQ(model->forward_head(feats, true).sizes(), torch::IntArrayRef({4, 64}));
    EXPECT_EQ(model->num_features(), 64);
    auto inter = model->forward_intermediates(x, {0, 1, -1});
    ASSERT_EQ(inter.size(), 3u);
    for (const auto& t : inter) EXPECT_EQ(t.sizes(), torch::IntArrayRef({4, 16, 32}));
    // The last sub-block's output, normalised, is forward_features.
    auto norm_w = model->named_parameters()["norm.weight"];
    auto norm_b = model->named_parameters()["norm.bias"];
    EXPECT_TRUE(all_close(linvis::nn::residual_layer_norm(inter[2], norm_w, norm_b, 1e-6), feats, 1e-6, 1e-6));
    EXPECT_THROW(model->forward_intermediates(x, {4}), linvis::Error);
    EXPECT_THROW(create_model("vil_tiny", ModelConfig().set("mlstm_mode", "quadratic")), linvis::Error);
    EXPECT_THROW(create_model("vil_tiny", ModelConfig().set("img_size", int64_t{225})), linvis::Error);
    EXPECT_THROW(create_model("vil_tiny", ModelConfig().set("num_head", int64_t{3})), linvis::Error);
}

TEST(Vil, ResolutionChange) {
    torch::manual_seed(100);  // model init draws from the global generator
    auto at32 = create_model("vil_tiny", small_config(32));
    perturb(*at32, 7);
    auto at48 = create_model("vil_tiny", small_config(48));
    auto src = at32->named_parameters();
    auto dst = at48->named_parameters();
    {
        torch::NoGradGuard no_grad;
        for (const auto& kv : src) dst[kv.key()].copy_(at48->adapt_checkpoint_tensor(kv.key(), kv.value()));
    }
    // The adapted embedding is the bicubic (align_corners=False) resize of the (1, D, 4, 4) grid.
    auto embed = src["pos_embed.embed"].detach();
    auto expected = torch::upsample_bicubic2d(embed.permute({0, 3, 1, 2}), {6, 6}, false).permute({0, 2, 3, 1});
    EXPECT_TRUE(all_close(dst["pos_embed.embed"], expected, 0, 0));
    EXPECT_EQ(dst["pos_embed.embed"].sizes(), torch::IntArrayRef({1, 6, 6, 32}));
    // A constant embedding stays constant under the resize (interpolation weights sum to one).
    auto constant = torch::full({1, 4, 4, 8}, 0.25);
    EXPECT_TRUE(all_close(linvis::nn::resize_pos_embed_2d(constant, 7, 5), torch::full({1, 7, 5, 8}, 0.25), 1e-6, 1e-7));
    // Running the 32-model on 48x48 images (on-the-fly resize) equals the model built for 48.
    at32->eval();
    at48->eval();
    torch::manual_seed(8);
    auto x = torch::randn({2, 3, 48, 48});
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(all_close(at32->forward(x), at48->forward(x), 1e-6, 1e-6));
    // Non-square input: 48x32 -> 6x4 grid, the conv uses the actual grid.
    auto y = at48->forward_features(torch::randn({1, 3, 48, 32}));
    EXPECT_EQ(y.sizes(), torch::IntArrayRef({1, 24, 32}));
    EXPECT_THROW(at48->adapt_checkpoint_tensor("pos_embed.embed", torch::zeros({1, 4, 4, 16})), linvis::Error);
}

TEST(Vil, BatchIndependence) {
    torch::manual_seed(100);  // model init draws from the global generator
    auto model = create_model("vil_tiny", small_config(32));
    perturb(*model, 9);
    model->eval();
    torch::manual_seed(10);
    auto x = torch::randn({3, 3, 32, 32});
    torch::NoGradGuard no_grad;
    auto full = model->forward(x);
    // float32: a batch of 1 and of 3 take different GEMM blockings, so rounding differs (~1e-6 relative);
    // a leak between samples would show at the scale of the logits (~1).
    for (int64_t b = 0; b < 3; ++b)
        EXPECT_TRUE(all_close(model->forward(x.narrow(0, b, 1)), full.narrow(0, b, 1), 1e-4, 1e-5)) << b;
    auto x2 = x.clone();
    x2[0].add_(1.0);
    auto changed = model->forward(x2);
    EXPECT_TRUE(all_close(changed.slice(0, 1), full.slice(0, 1), 1e-4, 1e-5));
    EXPECT_FALSE(torch::allclose(changed[0], full[0]));
}

namespace {

// Independent transcription of spec 1.2-1.10 with different primitives (manual layer norms, a shifted-sum
// depthwise conv, block_diag matrices for the headwise projections); only the mLSTM kernel is shared
// (mlstm_parallel is checked against the spec's closed form in test_mlstm).
torch::Tensor manual_layer_norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps) {
    auto mu = x.mean(-1, true);
    auto var = (x - mu).pow(2).mean(-1, true);  // biased
    return (x - mu) / torch::sqrt(var + eps) * w + b;
}

torch::Tensor manual_vil_layer(torch::OrderedDict<std::string, torch::Tensor>& P, const std::string& pre,
                               torch::Tensor x, int64_t gh, int64_t gw, bool reversed) {
    const int64_t B = x.size(0), S = x.size(1), D = x.size(2), I = 2 * D, NH = 4, DH = I / NH;
    auto p = [&](const std::string& n) { return P[pre + n]; };
    if (reversed) x = x.flip({1});
    auto up = torch::matmul(x, p("proj_up.weight").t()) + p("proj_up.bias");
    auto xm = up.slice(-1, 0, I), z = up.slice(-1, I, 2 * I);
    auto grid = torch::constant_pad_nd(xm.reshape({B, gh, gw, I}), {0, 0, 1, 1, 1, 1});
    auto conv = p("conv.bias").expand({B, gh, gw, I}).clone();
    auto cw = p("conv.weight");
    for (int64_t dy = 0; dy < 3; ++dy)
        for (int64_t dx = 0; dx < 3; ++dx)
            conv = conv + grid.slice(1, dy, dy + gh).slice(2, dx, dx + gw) * cw.select(1, 0).select(1, dy).select(1, dx);
    auto xa = conv.reshape({B, S, I});
    xa = xa * torch::sigmoid(xa);
    auto headwise = [&](const std::string& n, const torch::Tensor& in) {
        auto w = p(n + ".weight");
        std::vector<torch::Tensor> blocks;
        for (int64_t h = 0; h < w.size(0); ++h) blocks.push_back(w[h]);
        return torch::matmul(in, torch::block_diag(blocks).t()) + p(n + ".bias");
    };
    auto q = headwise("q_proj", xa), k = headwise("k_proj", xa), v = headwise("v_proj", xm);
    auto gate_in = torch::cat({q, k, v}, -1);
    auto ig = (torch::matmul(gate_in, p("mlstm_cell.igate.weight").t()) + p("mlstm_cell.igate.bias")).permute({0, 2, 1});
    auto fg = (torch::matmul(gate_in, p("mlstm_cell.fgate.weight").t()) + p("mlstm_cell.fgate.bias")).permute({0, 2, 1});
    auto heads = [&](const torch::Tensor& t) { return t.reshape({B, S, NH, DH}).permute({0, 2, 1, 3}); };
    auto h = linvis::ops::mlstm_parallel(heads(q), heads(k), heads(v), ig, fg);  // (B,NH,S,DH)
    auto mu = h.mean(-1, true);
    auto var = (h - mu).pow(2).mean(-1, true);
    auto hn = ((h - mu) / torch::sqrt(var + 1e-5)).permute({0, 2, 1, 3}).reshape({B, S, I});
    hn = hn * (1.0 + p("mlstm_cell.outnorm.weight")) + p("mlstm_cell.outnorm.bias");
    auto out = (hn + p("learnable_skip") * xa) * (z * torch::sigmoid(z));
    auto y = torch::matmul(out, p("proj_down.weight").t()) + p("proj_down.bias");
    return reversed ? y.flip({1}) : y;
}

}  // namespace

TEST(Vil, MatchesSpecTranscription) {
    torch::manual_seed(100);  // model init draws from the global generator
    auto cfg = small_config(40);  // 5x5 grid
    auto model = create_model("vil_tiny", cfg);
    perturb(*model, 12);
    model->to(torch::kFloat64);
    model->eval();
    auto P = model->named_parameters();
    torch::manual_seed(13);
    auto img = torch::randn({2, 3, 40, 40}, torch::kFloat64);
    torch::NoGradGuard no_grad;
    auto x = torch::conv2d(img, P["patch_embed.proj.weight"], P["patch_embed.proj.bias"], 8).permute({0, 2, 3, 1});
    x = (x + P["pos_embed.embed"]).reshape({2, 25, 32});
    for (int64_t b = 0; b < 4; ++b) {
        const std::string pre = "blocks." + std::to_string(b / 2) + "." + dir_name(b) + ".";
        auto normed = manual_layer_norm(x, 1.0 + P[pre + "norm.weight"], P[pre + "norm.bias"], 1e-5);
        x = x + manual_vil_layer(P, pre + "layer.", normed, 5, 5, b % 2 == 1);
    }
    auto feats = manual_layer_norm(x, 1.0 + P["norm.weight"], P["norm.bias"], 1e-6);
    auto pooled = manual_layer_norm(torch::cat({feats.select(1, 0), feats.select(1, 24)}, 1), P["legacy_norm.weight"],
                                    P["legacy_norm.bias"], 1e-5);
    auto logits = torch::matmul(pooled, P["head.weight"].t()) + P["head.bias"];
    auto got = model->forward_features(img);
    EXPECT_TRUE(all_close(got, feats, 1e-10, 1e-11));
    EXPECT_TRUE(all_close(model->forward_head(got, false), logits, 1e-10, 1e-11));
}

TEST(Vil, Bfloat16Forward) {
    torch::manual_seed(100);  // model init draws from the global generator
    // The whole model in bf16 (weights and activations) against float32 with the same (bf16-rounded) weights.
    auto m32 = create_model("vil_tiny", small_config(48, "chunkwise", 16));
    perturb(*m32, 14);
    m32->to(torch::kBFloat16);
    m32->to(torch::kFloat32);
    auto m16 = create_model("vil_tiny", small_config(48, "chunkwise", 16));
    copy_parameters(*m32, *m16);
    m16->to(torch::kBFloat16);
    m32->eval();
    m16->eval();
    torch::manual_seed(15);
    auto x = torch::randn({2, 3, 48, 48}).to(torch::kBFloat16).to(torch::kFloat32);
    torch::NoGradGuard no_grad;
    auto ref = m32->forward_features(x);
    auto got = m16->forward_features(x.to(torch::kBFloat16));
    EXPECT_EQ(got.scalar_type(), torch::kBFloat16);
    const double err = linvis::testing::relative_error(got, ref);
    std::printf("bf16 model features: relative L2 error %.3g\n", err);
    EXPECT_LT(err, 5e-2);
}

TEST(Vil, FlopsAt224) {
    torch::manual_seed(100);  // model init draws from the global generator
    // Multiply-adds counted by linvis::flops at 224 (parallel mode, full S x S products), checked
    // against the closed form per sub-block: proj_up 4SD^2, conv 9SI, q/k/v 3*4SI, gates 2*3I*4*S,
    // QK^T and CV 2*S^2*I, proj_down SID; plus patch embed and head. Paper Table 1 lists
    // 1.3G / 4.7G / 17.9G, counted with a causal-halved S^2 term (appendix B.2).
    const int64_t S = 196;
    for (const auto& [name, D] : std::vector<std::pair<std::string, int64_t>>{
             {"vil_tiny", 192}, {"vil_small", 384}, {"vil_base", 768}}) {
        const int64_t I = 2 * D;
        const int64_t per_block = 4 * S * D * D + 9 * S * I + 12 * S * I + 24 * S * I + 2 * S * S * I + S * I * D;
        const int64_t expected = 24 * per_block + S * 3 * 256 * D + 2 * D * 1000;
        auto model = create_model(name, ModelConfig().set("mlstm_mode", "parallel"));
        model->eval();
        torch::NoGradGuard no_grad;
        linvis::flops::Counter counter;
        model->forward(torch::randn({1, 3, 224, 224}));
        EXPECT_EQ(counter.macs(), expected) << name;
        std::printf("%s @224: %.4f GMACs\n", name.c_str(), counter.gflops());
        RecordProperty(name + "_gmacs_224", std::to_string(counter.gflops()));
    }
}

namespace {

// A pair of ViL sub-blocks with the mLSTM segments recomputed in the backward or kept.
linvis::nn::VilBlockPair vil_pair(bool recompute, linvis::ops::MlstmMode mode, linvis::ops::Impl impl) {
    linvis::nn::VilBlockPair pair(192, 0.0, mode, linvis::ops::kMlstmDefaultChunkSize, impl);
    for (linvis::nn::VilBlock* sub : {&pair->rowwise_from_top_left, &pair->rowwise_from_bot_right})
        (*sub)->layer->recompute_scans = recompute;
    return pair;
}

}  // namespace

// recompute_scans (the default in a training graph): the same gradients as keeping the cell's intermediates, in
// the chunkwise (fused) and parallel (reference) forms, and the graph keeps far less: per sub-block x_mlstm
// instead of the conv's output, q, k, v, the cell's states and its unnormed output.
TEST(Vil, RecomputedScansGiveTheSameGradientsAndKeepLess) {
    using linvis::ops::Impl;
    using linvis::ops::MlstmMode;
    const int64_t D = 192;
    for (const auto& [mode, impl] :
         {std::pair{MlstmMode::Chunkwise, Impl::Auto}, {MlstmMode::Parallel, Impl::Reference}}) {
        std::vector<torch::Tensor> grads[2];
        for (const bool recompute : {false, true}) {
            torch::manual_seed(51);
            linvis::nn::VilBlockPair pair = vil_pair(recompute, mode, impl);
            torch::manual_seed(52);
            grads[recompute] = linvis::testing::input_and_parameter_grads(
                *pair, torch::randn({2, 64, D}), [&](const torch::Tensor& x) { return pair->forward(x, 8, 8); });
        }
        // The recomputation's own kernels sum in another order: within 1e-5 of each gradient's scale.
        linvis::testing::expect_same_gradients(grads[1], grads[0], 1e-5,
                                               "impl " + std::to_string(static_cast<int>(impl)));
    }
    // What one pair's graph keeps at 1024 tokens (768 KiB per (1, T, D) float32 tensor).
    const int64_t side = 32, unit = side * side * D * 4;
    const torch::Tensor x = torch::randn({1, side * side, D}, torch::requires_grad());
    int64_t kept[2];
    for (const bool recompute : {false, true}) {
        linvis::nn::VilBlockPair pair = vil_pair(recompute, MlstmMode::Chunkwise, Impl::Auto);
        kept[recompute] = linvis::testing::bytes_kept_by([&] { return pair->forward(x, side, side); });
    }
    EXPECT_GE(kept[0] - kept[1], 20 * unit) << "kept " << kept[0] << " bytes without, " << kept[1] << " with";
    // Only a training step recomputes: an eval-mode graph (an explanation's input gradient) keeps as much with
    // recomputation on as without (compared in eval mode: what LibTorch's modules keep differs between the modes).
    int64_t kept_in_eval[2];
    for (const bool recompute : {false, true}) {
        linvis::nn::VilBlockPair evaluated = vil_pair(recompute, MlstmMode::Chunkwise, Impl::Auto);
        evaluated->eval();
        kept_in_eval[recompute] = linvis::testing::bytes_kept_by([&] { return evaluated->forward(x, side, side); });
    }
    EXPECT_GE(kept_in_eval[1], kept_in_eval[0] - unit) << "kept " << kept_in_eval[0] << " bytes without, "
                                                       << kept_in_eval[1] << " with";
}
