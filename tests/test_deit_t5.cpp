// DeiT and T5 models (include/linvis/models/deit_t5.h; spec vit3_t5_official.md B2, B5, B6).
#include <cmath>
#include <iostream>
#include <set>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/nn/common.h"
#include "linvis/nn/vit.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/deit_t5.h"
#include "linvis/models/registry.h"
#include "support/testing.h"

using namespace linvis::models;
using linvis::testing::all_close;

namespace {

// PatchEmbed::tokens (the convolution as one product of the gathered patches) gives the convolution's map as
// row-major tokens, on a non-square grid, in float64 to rounding and in float32 within the products' rounding, and
// the same gradients for the images and the kernel.
TEST(PatchEmbed, TokensAreTheConvolutionsMapAsTokens) {
    torch::manual_seed(0);
    linvis::nn::PatchEmbed embed(3, 24, 8);
    for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
        embed->to(dtype);
        const torch::Tensor images = torch::randn({2, 3, 48, 80}, dtype).requires_grad_();
        const torch::Tensor tokens = embed->tokens(images);
        ASSERT_EQ(tokens.sizes(), (std::vector<int64_t>{2, 6 * 10, 24}));
        EXPECT_TRUE(tokens.is_contiguous());
        const torch::Tensor map = torch::conv2d(images, embed->proj->weight, embed->proj->bias, 8);
        const torch::Tensor expected = map.flatten(2).transpose(1, 2);
        const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
        EXPECT_TRUE(torch::allclose(tokens, expected, tol, tol)) << dtype << ": max error "
                                                                 << (tokens - expected).abs().max().item<double>();
        const torch::Tensor grad = torch::randn_like(tokens);
        const auto got = torch::autograd::grad({tokens}, {images, embed->proj->weight}, {grad});
        const auto want = torch::autograd::grad({expected}, {images, embed->proj->weight}, {grad});
        for (size_t i = 0; i < got.size(); ++i)
            EXPECT_TRUE(torch::allclose(got[i], want[i], tol, tol)) << dtype << ": gradient " << i;
    }
    EXPECT_THROW(embed->tokens(torch::randn({1, 3, 48, 84}, torch::kFloat32)), linvis::Error);
    EXPECT_THROW(embed->tokens(torch::randn({1, 4, 48, 80}, torch::kFloat32)), linvis::Error);
}

const auto kF64 = torch::TensorOptions().dtype(torch::kFloat64);

// Parameter count of a timm-style ViT written out by hand: patch conv, [class token], positions,
// depth x (2 LayerNorms, qkv, proj, fc1, fc2), final norm, head.
int64_t vit_params(int64_t D, int64_t depth, int64_t tokens, bool cls, int64_t extra_per_block = 0) {
    const int64_t patch = 3 * 16 * 16 * D + D;
    const int64_t block = 4 * D + (3 * D * D + 3 * D) + (D * D + D) + (4 * D * D + 4 * D) + (4 * D * D + D);
    return patch + (cls ? D : 0) + (tokens + (cls ? 1 : 0)) * D + depth * (block + extra_per_block) + 2 * D +
           (1000 * D + 1000);
}

ModelConfig small_config() {
    ModelConfig c;
    c.set("depth", int64_t{2}).set("embed_dim", int64_t{48}).set("num_heads", int64_t{3});
    c.set("img_size", int64_t{32}).set("patch_size", int64_t{8}).set("num_classes", int64_t{10});
    return c;
}

// Full-size default models are built once per process (building deit_base takes seconds) and
// only read by the tests that share them.
ModelPtr shared_model(const std::string& name) {
    static std::map<std::string, ModelPtr> cache;
    auto it = cache.find(name);
    if (it == cache.end()) it = cache.emplace(name, create_model(name)).first;
    return it->second;
}

double gmacs_at_224(const std::string& name) {
    auto model = shared_model(name);
    model->eval();
    torch::NoGradGuard no_grad;
    torch::manual_seed(0);
    auto x = torch::randn({1, 3, 224, 224});
    linvis::flops::Counter counter;
    model->forward(x);
    return counter.gflops();
}

// 1-D resampling matrix (out x in) of PyTorch's bicubic interpolation, align_corners false,
// written from the kernel definitions: plain (Keys a = -0.75, taps clamped to the border) or
// antialiased (a = -0.5, support 2*max(scale, 1), taps outside dropped, weights renormalised).
torch::Tensor bicubic_matrix(int64_t in, int64_t out, bool antialias) {
    auto cubic = [](double x, double a) {
        x = std::abs(x);
        if (x <= 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
        if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
        return 0.0;
    };
    auto m = torch::zeros({out, in}, kF64);
    const double scale = static_cast<double>(in) / static_cast<double>(out);
    for (int64_t i = 0; i < out; ++i) {
        if (!antialias) {
            const double src = scale * (i + 0.5) - 0.5;
            const double x0 = std::floor(src), t = src - x0;
            for (int64_t tap = -1; tap <= 2; ++tap) {
                const int64_t j = std::min<int64_t>(std::max<int64_t>(static_cast<int64_t>(x0) + tap, 0), in - 1);
                m[i][j] += cubic(t - tap, -0.75);
            }
        } else {
            const double support = scale >= 1 ? 2 * scale : 2.0, inv = scale >= 1 ? 1 / scale : 1.0;
            const double center = scale * (i + 0.5);
            const int64_t lo = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
            const int64_t hi = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in);
            double total = 0;
            for (int64_t j = lo; j < hi; ++j) total += cubic((j - center + 0.5) * inv, -0.5);
            for (int64_t j = lo; j < hi; ++j) m[i][j] = cubic((j - center + 0.5) * inv, -0.5) / total;
        }
    }
    return m;
}

// Hand resize of pos_embed (1, P + h*w, D) to (1, P + H*W, D).
torch::Tensor hand_resample(const torch::Tensor& pos, int64_t prefix, int64_t h, int64_t w, int64_t H, int64_t W,
                            bool aa) {
    const int64_t D = pos.size(2);
    auto grid = pos[0].narrow(0, prefix, h * w).reshape({h, w, D}).permute({2, 0, 1});  // (D, h, w)
    auto out = torch::matmul(torch::matmul(bicubic_matrix(h, H, aa), grid), bicubic_matrix(w, W, aa).t());
    auto tokens = out.permute({1, 2, 0}).reshape({1, H * W, D});
    return torch::cat({pos.narrow(1, 0, prefix), tokens}, 1);
}

}  // namespace

// The ViT init's truncated normal has the moments of N(0, std^2) cut at the bounds, whichever way it samples: at
// +-1.5 std (87 % of the mass inside: draws outside are drawn again), at +-0.5 std (38 %: inverse CDF) and at the
// ViT init's +-100 std. A clamp instead of new draws would pile mass on the bounds and widen the spread.
TEST(Deit, TruncatedNormalInitHasTheTruncatedMoments) {
    torch::manual_seed(11);
    const double std = 0.02;
    for (const double cut : {1.5, 0.5, 100.0}) {
        torch::Tensor t = torch::empty({400000});
        linvis::nn::trunc_normal_(t, std, -cut * std, cut * std);
        EXPECT_GE(t.min().item<double>(), -cut * std) << cut;
        EXPECT_LE(t.max().item<double>(), cut * std) << cut;
        // Variance of a standard normal cut at +-c: 1 - 2 c phi(c) / (2 Phi(c) - 1).
        const double phi = std::exp(-cut * cut / 2) / std::sqrt(2 * M_PI);
        const double mass = std::erf(cut / std::sqrt(2.0));
        const double expected_std = std * std::sqrt(1 - 2 * cut * phi / mass);
        EXPECT_NEAR(t.mean().item<double>(), 0.0, 0.01 * std) << cut;
        EXPECT_NEAR(t.std().item<double>(), expected_std, 0.005 * expected_std) << cut;
        const double at_bounds = (t.abs() >= cut * std * (1 - 1e-6)).sum().item<double>();
        EXPECT_LT(at_bounds, 5) << cut;
    }
}

TEST(Deit, ParameterCount) {
    // timm values (deit_{tiny,small,base}_patch16_224), recomputed by hand in vit_params.
    EXPECT_EQ(vit_params(192, 12, 196, true), 5717416);
    EXPECT_EQ(vit_params(384, 12, 196, true), 22050664);
    EXPECT_EQ(vit_params(768, 12, 196, true), 86567656);
    EXPECT_EQ(count_parameters(*shared_model("deit_tiny")), 5717416);
    EXPECT_EQ(count_parameters(*shared_model("deit_small")), 22050664);
    EXPECT_EQ(count_parameters(*shared_model("deit_base")), 86567656);
}

TEST(T5, ParameterCount) {
    // Per block T5 adds w1, w2, w3 (3 h d^2 = 3 D^2 / h) and two depthwise 3x3 convs with bias (20 D).
    auto t5_extra = [](int64_t D, int64_t h) { return 3 * D * D / h + 2 * (9 * D + D); };
    EXPECT_EQ(vit_params(192, 12, 196, false, t5_extra(192, 3)), 6205480);
    const int64_t tiny = count_parameters(*shared_model("t5_tiny"));
    const int64_t small = count_parameters(*shared_model("t5_small"));
    std::cout << "[measure] t5_tiny " << tiny << " parameters, t5_small " << small << "\n";
    EXPECT_EQ(tiny, 6205480);
    EXPECT_EQ(small, vit_params(384, 12, 196, false, t5_extra(384, 6)));
    EXPECT_EQ(small, 23026792);
}

TEST(T5, StateDictNamesMatchOfficial) {
    // Spec B6: 235 entries in this order (module's own parameters before its children).
    std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
        {"pos_embed", {1, 196, 192}}, {"patch_embed.proj.weight", {192, 3, 16, 16}}, {"patch_embed.proj.bias", {192}}};
    for (int i = 0; i < 12; ++i) {
        const std::string p = "blocks." + std::to_string(i) + ".";
        std::vector<std::pair<std::string, std::vector<int64_t>>> block = {
            {"norm1.weight", {192}}, {"norm1.bias", {192}}, {"attn.w1", {1, 3, 64, 64}}, {"attn.w2", {1, 3, 64, 64}},
            {"attn.w3", {1, 3, 64, 64}}, {"attn.qkv.weight", {576, 192}}, {"attn.qkv.bias", {576}},
            {"attn.proj.weight", {192, 192}}, {"attn.proj.bias", {192}}, {"attn.q_conv2d.weight", {192, 1, 3, 3}},
            {"attn.q_conv2d.bias", {192}}, {"attn.k_conv2d.weight", {192, 1, 3, 3}}, {"attn.k_conv2d.bias", {192}},
            {"norm2.weight", {192}}, {"norm2.bias", {192}}, {"mlp.fc1.weight", {768, 192}}, {"mlp.fc1.bias", {768}},
            {"mlp.fc2.weight", {192, 768}}, {"mlp.fc2.bias", {192}}};
        for (auto& [name, shape] : block) expected.push_back({p + name, shape});
    }
    expected.push_back({"norm.weight", {192}});
    expected.push_back({"norm.bias", {192}});
    expected.push_back({"head.weight", {1000, 192}});
    expected.push_back({"head.bias", {1000}});
    ASSERT_EQ(expected.size(), 235u);
    auto model = shared_model("t5_tiny");
    auto params = model->named_parameters(true);
    ASSERT_EQ(params.size(), expected.size());
    EXPECT_EQ(model->named_buffers(true).size(), 0u);
    size_t i = 0;
    for (const auto& item : params) {
        EXPECT_EQ(item.key(), expected[i].first) << "entry " << i;
        EXPECT_EQ(item.value().sizes(), torch::IntArrayRef(expected[i].second)) << item.key();
        ++i;
    }
    // DeiT keeps timm's order: class token and positions first.
    auto deit = shared_model("deit_tiny")->named_parameters(true);
    EXPECT_EQ(deit[0].key(), "cls_token");
    EXPECT_EQ(deit[1].key(), "pos_embed");
    EXPECT_EQ(deit[1].value().sizes(), torch::IntArrayRef({1, 197, 192}));
    EXPECT_EQ(deit[2].key(), "patch_embed.proj.weight");
    EXPECT_EQ(deit.size(), 1u + 1 + 2 + 12 * 12 + 2 + 2);
}

TEST(T5, InheritsEveryDeitTensor) {
    auto deit = shared_model("deit_tiny");
    auto t5 = shared_model("t5_tiny");
    std::map<std::string, std::vector<int64_t>> deit_shapes, t5_shapes;
    for (const auto& p : deit->named_parameters(true)) deit_shapes[p.key()] = p.value().sizes().vec();
    for (const auto& p : t5->named_parameters(true)) t5_shapes[p.key()] = p.value().sizes().vec();
    // Every DeiT tensor except the class token has a T5 target of the same name; all shapes agree
    // except pos_embed (197 vs 196 positions), which the official inheritance skips (B5).
    for (const auto& [name, shape] : deit_shapes) {
        if (name == "cls_token") {
            EXPECT_FALSE(t5_shapes.count(name));
            continue;
        }
        ASSERT_TRUE(t5_shapes.count(name)) << name;
        if (name == "pos_embed")
            EXPECT_NE(t5_shapes[name], shape);
        else
            EXPECT_EQ(t5_shapes[name], shape) << name;
    }
    // New parameters = T5 names absent from DeiT = exactly the B5 list.
    std::set<std::string> new_names;
    for (const auto& [name, shape] : t5_shapes)
        if (!deit_shapes.count(name)) new_names.insert(name);
    std::set<std::string> b5;
    for (int i = 0; i < 12; ++i)
        for (const char* s : {"w1", "w2", "w3", "q_conv2d.weight", "q_conv2d.bias", "k_conv2d.weight", "k_conv2d.bias"})
            b5.insert("blocks." + std::to_string(i) + ".attn." + s);
    EXPECT_EQ(new_names, b5);
    auto listed = t5_new_parameter_names(*t5);
    EXPECT_EQ(std::set<std::string>(listed.begin(), listed.end()), b5);
    EXPECT_EQ(listed.size(), 84u);
    EXPECT_EQ(listed.front(), "blocks.0.attn.w1");
    EXPECT_THROW(t5_new_parameter_names(*deit), linvis::Error);
    EXPECT_EQ(kT5NewParamsLrMultiplier, 20.0);
}

TEST(Deit, Gflops224) {
    // Papers: DeiT-Ti 1.3G / 1.2G / 1.25G (seeds 000, 001, 004), DeiT-S 4.6G, DeiT-B 17.6G
    // (one FLOP per multiply-add, fvcore-style). timm lists 1.26 / 4.61 / 17.58 GMACs.
    const double tiny = gmacs_at_224("deit_tiny"), small = gmacs_at_224("deit_small"), base = gmacs_at_224("deit_base");
    std::cout << "[measure] GMACs at 224: deit_tiny " << tiny << ", deit_small " << small << ", deit_base " << base << "\n";
    EXPECT_NEAR(tiny, 1.26, 0.05 * 1.26);
    EXPECT_NEAR(small, 4.6, 0.05 * 4.6);
    EXPECT_NEAR(base, 17.6, 0.05 * 17.6);
    // Exact count for tiny: patch conv + 12 x (qkv, q k^T, attn v, proj, fc1, fc2) + head.
    const int64_t N = 197, D = 192;
    const int64_t block = N * D * 3 * D + 2 * N * N * D + N * D * D + 2 * N * D * 4 * D;
    EXPECT_NEAR(tiny, (196 * 768 * D + 12 * block + D * 1000) * 1e-9, 1e-12);
}

TEST(T5, Gflops224) {
    // Paper Table 4: T5-T 1.34G, T5-S 4.77G.
    const double tiny = gmacs_at_224("t5_tiny"), small = gmacs_at_224("t5_small");
    std::cout << "[measure] GMACs at 224: t5_tiny " << tiny << ", t5_small " << small << "\n";
    EXPECT_NEAR(tiny, 1.34, 0.05 * 1.34);
    EXPECT_NEAR(small, 4.77, 0.05 * 4.77);
}

TEST(Deit, ResolutionChange) {
    torch::manual_seed(30);
    // Upsampling 3x3 -> 5x5 and downsampling 6x6 -> 4x4 against the hand-written kernels.
    auto pos = torch::randn({1, 1 + 9, 4}, kF64);
    for (bool aa : {true, false}) {
        auto got = linvis::nn::resample_abs_pos_embed(pos, {5, 5}, {0, 0}, 1, aa);
        ASSERT_EQ(got.sizes(), torch::IntArrayRef({1, 26, 4}));
        EXPECT_TRUE(all_close(got, hand_resample(pos, 1, 3, 3, 5, 5, aa), 1e-12, 1e-12)) << "antialias " << aa;
        EXPECT_TRUE(got.narrow(1, 0, 1).equal(pos.narrow(1, 0, 1)));  // class-token position kept
    }
    EXPECT_GT((linvis::nn::resample_abs_pos_embed(pos, {5, 5}, {0, 0}, 1, true) - linvis::nn::resample_abs_pos_embed(pos, {5, 5}, {0, 0}, 1, false))
                  .abs().max().item<double>(), 1e-3);
    auto big = torch::randn({1, 36, 3}, kF64);
    for (bool aa : {true, false})
        EXPECT_TRUE(all_close(linvis::nn::resample_abs_pos_embed(big, {4, 4}, {0, 0}, 0, aa), hand_resample(big, 0, 6, 6, 4, 4, aa),
                              1e-12, 1e-12)) << "antialias " << aa;
    EXPECT_TRUE(all_close(linvis::nn::resample_abs_pos_embed(big, {3, 5}, {6, 6}, 0), hand_resample(big, 0, 6, 6, 3, 5, true), 1e-12,
                          1e-12));
    EXPECT_TRUE(linvis::nn::resample_abs_pos_embed(pos, {3, 3}, {0, 0}, 1).equal(pos));
    EXPECT_THROW(linvis::nn::resample_abs_pos_embed(torch::randn({1, 11, 4}), {5, 5}, {0, 0}, 1), linvis::Error);

    // Models: a checkpoint at 32 px (4x4 grid) loaded into models built for 48 px (6x6 grid).
    for (const std::string name : {"deit_tiny", "t5_tiny"}) {
        auto small_cfg = small_config();
        auto source = create_model(name, small_cfg);
        auto target_cfg = small_config();
        target_cfg.set("img_size", int64_t{48});
        auto target = create_model(name, target_cfg);
        const int64_t prefix = name == "deit_tiny" ? 1 : 0;
        torch::NoGradGuard no_grad;
        auto target_params = target->named_parameters(true);
        for (const auto& item : source->named_parameters(true)) {
            auto adapted = target->adapt_checkpoint_tensor(item.key(), item.value());
            ASSERT_EQ(adapted.sizes(), target_params[item.key()].sizes()) << name << " " << item.key();
            target_params[item.key()].copy_(adapted);
        }
        auto old_pos = source->named_parameters(true)["pos_embed"].to(torch::kFloat64);
        auto new_pos = target_params["pos_embed"];
        EXPECT_EQ(new_pos.sizes(), torch::IntArrayRef({1, prefix + 36, 48}));
        EXPECT_TRUE(all_close(new_pos, hand_resample(old_pos, prefix, 4, 4, 6, 6, true), 1e-5, 1e-6)) << name;
        target->eval();
        EXPECT_EQ(target->forward(torch::randn({2, 3, 48, 48})).sizes(), torch::IntArrayRef({2, 10}));
        EXPECT_THROW(target->forward(torch::randn({2, 3, 32, 32})), linvis::Error);
    }
    // A DeiT pos_embed (class token + 16) offered to T5 is left as is (official T5 skips it).
    auto t5 = create_model("t5_tiny", small_config());
    auto deit_pos = torch::randn({1, 17, 48});
    EXPECT_TRUE(t5->adapt_checkpoint_tensor("pos_embed", deit_pos).equal(deit_pos));
}

namespace {
void forward_backward_runs(const std::string& name) {
    torch::manual_seed(31);
    auto config = small_config();
    config.set("drop_path_rate", 0.1);
    auto model = create_model(name, config);
    model->train();
    auto x = torch::randn({2, 3, 32, 32});
    auto out = model->forward(x);
    ASSERT_EQ(out.sizes(), torch::IntArrayRef({2, 10}));
    out.pow(2).mean().backward();
    for (const auto& p : model->named_parameters(true)) {
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        EXPECT_TRUE(torch::isfinite(p.value().grad()).all().item<bool>()) << p.key();
    }
    EXPECT_GT(model->named_parameters(true)["blocks.0.attn.qkv.weight"].grad().abs().sum().item<double>(), 0.0);
    // Intermediates: raw block outputs, patch tokens only; the last one normalised = forward_features.
    model->eval();
    torch::NoGradGuard no_grad;
    auto inter = model->forward_intermediates(x, {0, -1});
    ASSERT_EQ(inter.size(), 2u);
    EXPECT_EQ(inter[0].sizes(), torch::IntArrayRef({2, 16, 48}));
    auto features = model->forward_features(x);
    const int64_t prefix = features.size(1) - 16;
    EXPECT_EQ(prefix, name.rfind("deit", 0) == 0 ? 1 : 0);
    auto norm_w = model->named_parameters(true)["norm.weight"], norm_b = model->named_parameters(true)["norm.bias"];
    EXPECT_TRUE(all_close(torch::layer_norm(inter[1], {48}, norm_w, norm_b, 1e-6), features.narrow(1, prefix, 16), 1e-5,
                          1e-5));
    EXPECT_EQ(model->forward_head(features, true).sizes(), torch::IntArrayRef({2, 48}));
    EXPECT_THROW(model->forward_intermediates(x, {2}), linvis::Error);
    EXPECT_EQ(model->num_features(), 48);
    EXPECT_EQ(model->num_classes(), 10);
}

void batch_independence(const std::string& name) {
    torch::manual_seed(32);
    auto model = create_model(name, small_config());
    model->to(torch::kFloat64);
    model->eval();
    torch::NoGradGuard no_grad;
    auto x = torch::randn({3, 3, 32, 32}, kF64);
    auto full = model->forward(x);
    for (int64_t b = 0; b < 3; ++b)
        EXPECT_TRUE(all_close(full.narrow(0, b, 1), model->forward(x.narrow(0, b, 1)), 1e-12, 1e-12)) << b;
}
}  // namespace

TEST(Deit, ForwardBackwardRuns) { forward_backward_runs("deit_tiny"); }
TEST(T5, ForwardBackwardRuns) { forward_backward_runs("t5_tiny"); }
TEST(Deit, BatchIndependence) { batch_independence("deit_small"); }
TEST(T5, BatchIndependence) { batch_independence("t5_small"); }

TEST(Deit, OptionsAreChecked) {
    ModelConfig typo;
    typo.set("dept", int64_t{2});
    EXPECT_THROW(create_model("deit_tiny", typo), linvis::Error);
    ModelConfig bad_heads;
    bad_heads.set("embed_dim", int64_t{50}).set("num_heads", int64_t{3});
    EXPECT_THROW(create_model("t5_tiny", bad_heads), linvis::Error);
    auto fused = small_config();
    fused.set("impl", std::string("fused"));
    auto model = create_model("t5_tiny", fused);  // fused kernels: tests/test_vit3_t5_fused.cpp
    EXPECT_EQ(model->forward(torch::randn({1, 3, 32, 32})).size(0), 1);
    fused.set("impl", std::string("bogus"));
    EXPECT_THROW(create_model("t5_tiny", fused), linvis::Error);
    auto headless = small_config();
    headless.set("num_classes", int64_t{0});
    EXPECT_EQ(create_model("deit_tiny", headless)->forward(torch::randn({1, 3, 32, 32})).sizes(),
              torch::IntArrayRef({1, 48}));
}
