// Vision-TTT models (spec/vittt.md): parameter counts, FLOPs, resolution change, options.
#include <cstdio>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/nn/common.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/vittt_block.h"
#include "support/heap.h"
#include "support/testing.h"

using linvis::models::count_parameters;
using linvis::models::create_model;
using linvis::models::ModelConfig;
using linvis::models::ModelPtr;
using linvis::testing::all_close;

namespace {

ModelPtr small_model(std::map<std::string, std::string> extra = {}) {
    std::map<std::string, std::string> kv = {{"img_size", "80"}, {"depth", "2"}, {"num_classes", "10"}};
    for (auto& [k, v] : extra) kv[k] = v;
    return create_model("vittt_tiny", ModelConfig(kv));
}

// Copies `src`'s parameters into `dst` by name, through dst's adapt_checkpoint_tensor.
void load_state(const ModelPtr& dst, const ModelPtr& src) {
    torch::NoGradGuard no_grad;
    auto theirs = src->named_parameters(true);
    for (auto& p : dst->named_parameters(true)) {
        const torch::Tensor* value = theirs.find(p.key());
        ASSERT_NE(value, nullptr) << p.key();
        p.value().copy_(dst->adapt_checkpoint_tensor(p.key(), *value));
    }
}

}  // namespace

TEST(Vittt, ParameterCounts) {
    struct Expect {
        const char* name;
        bool shared;
        double about_millions;  // spec/vittt.md table; tiny exact
        int64_t exact;          // 0: only "about"
    };
    const Expect expects[] = {{"vittt_tiny", false, 6.98, 6982384}, {"vittt_tiny", true, 5.91, 5908492},
                              {"vittt_small", false, 26.38, 0},      {"vittt_small", true, 22.45, 0},
                              {"vittt_base", false, 102.41, 0},      {"vittt_base", true, 87.41, 0}};
    for (const auto& e : expects) {
        auto model = create_model(e.name, ModelConfig().set("shared_directions", e.shared ? "true" : "false"));
        const int64_t n = count_parameters(*model);
        std::printf("[ params ] %s %s: %lld\n", e.name, e.shared ? "v1 (shared)" : "v2", static_cast<long long>(n));
        if (e.exact) EXPECT_EQ(n, e.exact) << e.name;
        EXPECT_NEAR(n / 1e6, e.about_millions, 0.005 + 1e-9) << e.name << (e.shared ? " v1" : " v2");
        EXPECT_EQ(count_parameters(*model, true), n);
    }
    // W0^0 ablation: W1/b1 stay in the model (same total, same state dict) but are not trained.
    auto frozen = create_model("vittt_tiny", ModelConfig().set("learnable_w0", "false"));
    EXPECT_EQ(count_parameters(*frozen), 6982384);
    EXPECT_EQ(count_parameters(*frozen, true), 6982384 - 12 * 2 * (3 * 64 * 64 + 3 * 64));
    std::printf("[ params ] vittt_tiny W0^0: %lld total, %lld trainable\n",
                static_cast<long long>(count_parameters(*frozen)),
                static_cast<long long>(count_parameters(*frozen, true)));
}

TEST(Vittt, Gflops224) {
    struct Size {
        const char* name;
        int64_t D;
        double paper_gflops;
    };
    for (const Size& s : {Size{"vittt_tiny", 192, 1.44}, Size{"vittt_small", 384, 5.3}, Size{"vittt_base", 768, 20.3}}) {
        auto model = create_model(s.name);
        model->eval();
        torch::NoGradGuard no_grad;
        linvis::flops::Counter counter;
        auto logits = model->forward(torch::randn({1, 3, 224, 224}));
        ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{1, 1000}));
        // The count written out (docs/vittt.md): T = 196, d = 64, mini-batches 12 x 16 + 4.
        const int64_t D = s.D, T = 196, d = 64, nh = D / 64, I = 8 * D / 3, sum_m2 = 12 * 256 + 16;
        const int64_t ttt_inner = nh * (3 * T * d * d + 2 * sum_m2 * d);
        const int64_t branch = 2 * T * D * D + 2 * T * D * 4 + ttt_inner;
        const int64_t block = T * D * 9 + 2 * T * D * D + 2 * branch + 3 * T * D * I;
        const int64_t expected = 12 * block + T * D * 3 * 256 + D * 1000;
        std::printf("[ flops ] %s: %lld MACs = %.4f GMACs (paper %.2f)\n", s.name, static_cast<long long>(counter.macs()),
                    counter.gflops(), s.paper_gflops);
        EXPECT_EQ(counter.macs(), expected) << s.name;
        EXPECT_NEAR(counter.gflops() / s.paper_gflops, 1.0, 0.05) << s.name;
    }
}

TEST(Vittt, ForwardBackwardRuns) {
    torch::manual_seed(1);
    auto model = small_model();  // 5 x 5 grid: T = 25 = 16 + 9 (remainder mini-batch)
    model->train();
    auto images = torch::randn({2, 3, 80, 80});
    auto features = model->forward_features(images);
    ASSERT_EQ(features.sizes(), (std::vector<int64_t>{2, 25, 192}));
    auto pooled = model->forward_head(features, true);
    ASSERT_EQ(pooled.sizes(), (std::vector<int64_t>{2, 192}));
    auto logits = model->forward_head(features, false);
    ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 10}));
    ASSERT_TRUE(torch::isfinite(logits).all().item<bool>());
    logits.logsumexp(1).sum().backward();
    int64_t with_grad = 0;
    for (const auto& p : model->named_parameters()) {
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        ASSERT_TRUE(torch::isfinite(p.value().grad()).all().item<bool>()) << p.key();
        with_grad += p.value().grad().abs().sum().item<double>() > 0;
    }
    EXPECT_EQ(with_grad, static_cast<int64_t>(model->named_parameters().size()));
    auto inter = model->forward_intermediates(images, {0, -1});
    ASSERT_EQ(inter.size(), 2u);
    EXPECT_EQ(inter[1].sizes(), (std::vector<int64_t>{2, 25, 192}));
    model->eval();
    torch::NoGradGuard no_grad;
    // forward_features = norm(last block output).
    auto eval_inter = model->forward_intermediates(images, {1});
    EXPECT_TRUE(all_close(model->forward_features(images),
                          torch::layer_norm(eval_inter[0], {192}, {}, {}, 1e-6) *
                                  model->named_parameters()["norm.weight"] + model->named_parameters()["norm.bias"],
                          1e-5, 1e-5));
    EXPECT_THROW(model->forward_intermediates(images, {2}), linvis::Error);
    EXPECT_THROW(model->forward(torch::randn({1, 4, 80, 80})), linvis::Error);
    EXPECT_THROW(create_model("vittt_tiny", ModelConfig().set("bogus", "1")), linvis::Error);
    EXPECT_THROW(create_model("vittt_tiny", ModelConfig({{"embed_dim", "100"}, {"num_heads", "3"}})), linvis::Error);
}

TEST(Vittt, StateDictNames) {
    auto model = small_model();
    auto params = model->named_parameters();
    std::vector<std::string> block0;
    for (const auto& p : params)
        if (p.key().rfind("blocks.0.", 0) == 0) block0.push_back(p.key().substr(9));
    const std::vector<std::string> branch = {"learnable_token_idx", "learnable_ttt_lr_weight", "learnable_ttt_lr_bias",
                                             "ttt_norm_weight", "ttt_norm_bias", "W1", "b1", "q_proj.weight",
                                             "v_proj.weight", "conv_q.weight", "conv_q.bias", "conv_k.weight",
                                             "conv_k.bias", "post_norm.weight", "post_norm.bias"};
    std::vector<std::string> expected = {"dwconv.weight", "dwconv.bias", "norm1.weight", "norm1.bias", "g_proj.weight"};
    for (const char* dir : {"forth.", "back."})
        for (const auto& n : branch) expected.push_back(dir + n);
    for (const char* n : {"o_proj.weight", "norm2.weight", "norm2.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                          "mlp.down_proj.weight"})
        expected.push_back(n);
    EXPECT_EQ(block0, expected);
    // Own parameters before submodules, as PyTorch's state_dict.
    EXPECT_EQ(params.keys()[0], "pos_embed");
    EXPECT_EQ(params.keys()[1], "patch_embed.proj.weight");
    EXPECT_EQ(params["pos_embed"].sizes(), (std::vector<int64_t>{1, 25, 192}));
    EXPECT_EQ(params["blocks.1.back.W1"].sizes(), (std::vector<int64_t>{3, 64, 64}));
    EXPECT_EQ(params["blocks.1.forth.learnable_ttt_lr_weight"].sizes(), (std::vector<int64_t>{3, 1, 192}));
    EXPECT_EQ(params.keys().back(), "head.bias");
}

TEST(Vittt, ResolutionChange) {
    torch::manual_seed(2);
    auto m224 = create_model("vittt_tiny", ModelConfig().set("depth", int64_t{1}).set("num_classes", int64_t{5}));
    auto m256 = create_model("vittt_tiny", ModelConfig(
                                               {{"depth", "1"}, {"num_classes", "5"}, {"img_size", "256"}}));
    m224->eval();
    m256->eval();
    torch::NoGradGuard no_grad;
    auto images = torch::randn({1, 3, 256, 256});
    auto out224 = m224->forward(images);  // pos_embed resized 14x14 -> 16x16 on the fly
    ASSERT_EQ(out224.sizes(), (std::vector<int64_t>{1, 5}));
    load_state(m256, m224);
    auto pe = m256->named_parameters()["pos_embed"];
    ASSERT_EQ(pe.sizes(), (std::vector<int64_t>{1, 256, 192}));
    EXPECT_TRUE(all_close(m256->forward(images), out224, 1e-5, 1e-6));
    // Bicubic resampling: same size is the identity; a constant embedding stays constant.
    auto src = m224->named_parameters()["pos_embed"];
    EXPECT_TRUE(linvis::nn::resample_abs_pos_embed(src, {14, 14}, {14, 14}).equal(src));
    auto flat = torch::full({1, 196, 4}, 0.7);
    EXPECT_TRUE(all_close(linvis::nn::resample_abs_pos_embed(flat, {16, 16}, {14, 14}), torch::full({1, 256, 4}, 0.7), 1e-5,
                          1e-6));
    // Downsampling (antialiased) back to 224 also loads.
    auto m224b = create_model("vittt_tiny", ModelConfig().set("depth", int64_t{1}).set("num_classes", int64_t{5}));
    load_state(m224b, m256);
    EXPECT_EQ(m224b->named_parameters()["pos_embed"].sizes(), (std::vector<int64_t>{1, 196, 192}));
    EXPECT_THROW(m256->adapt_checkpoint_tensor("pos_embed", torch::zeros({1, 195, 192})), linvis::Error);
}

TEST(Vittt, BatchIndependence) {
    torch::manual_seed(3);
    auto model = small_model();
    model->eval();
    torch::NoGradGuard no_grad;
    auto images = torch::randn({3, 3, 80, 80});
    auto all = model->forward(images);
    for (int64_t i = 0; i < 3; ++i)
        EXPECT_TRUE(all_close(model->forward(images.narrow(0, i, 1)), all.narrow(0, i, 1), 1e-4, 1e-5)) << i;
}

TEST(Vittt, SharedDirectionsUseOneParameterSet) {
    torch::manual_seed(4);
    auto v1 = small_model({{"shared_directions", "true"}});
    auto v2 = small_model();
    int64_t branch_params = 0;
    for (const auto& p : v1->named_parameters()) {
        EXPECT_EQ(p.key().find("forth"), std::string::npos) << p.key();
        EXPECT_EQ(p.key().find("back"), std::string::npos) << p.key();
        if (p.key().rfind("blocks.0.ttt.", 0) == 0) branch_params += p.value().numel();
    }
    EXPECT_GT(branch_params, 0);
    EXPECT_EQ(count_parameters(*v2) - count_parameters(*v1), 2 * branch_params);
    // Block level: both directions run the same branch module.
    linvis::nn::VitttBlockOptions bo;
    bo.shared_directions = true;
    linvis::nn::VitttBlock block(bo);
    EXPECT_EQ(block->forth_branch().ptr(), block->back_branch().ptr());
    torch::NoGradGuard no_grad;
    auto x = torch::randn({2, 20, 192});
    auto [zf, zb] = block->mixer_branches(x);
    EXPECT_TRUE(all_close(zf, block->ttt->forward(x), 1e-6, 1e-6));
    EXPECT_TRUE(all_close(zb, torch::flip(block->ttt->forward(torch::flip(x, {1})), {1}), 1e-6, 1e-6));
    // Separate parameters (v2): the back branch is its own module with its own weights.
    linvis::nn::VitttBlock sep{linvis::nn::VitttBlockOptions()};
    EXPECT_NE(sep->forth_branch().ptr(), sep->back_branch().ptr());
    EXPECT_FALSE(sep->forth->W1.equal(sep->back->W1));
    // The inner gradient norms for the Gradient Magnitude Map come back per direction.
    torch::Tensor nf, nb;
    sep->mixer_branches(x, &nf, &nb);
    EXPECT_EQ(nf.sizes(), (std::vector<int64_t>{2, 3, 20}));
    EXPECT_EQ(nb.sizes(), (std::vector<int64_t>{2, 3, 20}));
}

TEST(Vittt, FrozenW0NotTrained) {
    torch::manual_seed(5);
    auto model = small_model({{"learnable_w0", "false"}});
    model->train();
    auto params = model->named_parameters();
    auto W_before = params["blocks.0.forth.W1"].detach().clone();
    auto b_before = params["blocks.1.back.b1"].detach().clone();
    auto q_before = params["blocks.0.forth.q_proj.weight"].detach().clone();
    EXPECT_FALSE(params["blocks.0.forth.W1"].requires_grad());
    EXPECT_FALSE(params["blocks.1.back.b1"].requires_grad());
    std::vector<torch::Tensor> trainable;
    for (auto& p : model->parameters())
        if (p.requires_grad()) trainable.push_back(p);
    torch::optim::SGD opt(trainable, torch::optim::SGDOptions(0.5));
    auto logits = model->forward(torch::randn({2, 3, 80, 80}));
    logits.logsumexp(1).sum().backward();
    opt.step();
    EXPECT_FALSE(params["blocks.0.forth.W1"].grad().defined());
    EXPECT_TRUE(params["blocks.0.forth.W1"].equal(W_before));
    EXPECT_TRUE(params["blocks.1.back.b1"].equal(b_before));
    EXPECT_FALSE(params["blocks.0.forth.q_proj.weight"].equal(q_before));
    // Control: with learnable_w0 (default) W1 receives a gradient.
    auto learn = small_model();
    learn->forward(torch::randn({2, 3, 80, 80})).logsumexp(1).sum().backward();
    auto g = learn->named_parameters()["blocks.0.forth.W1"].grad();
    ASSERT_TRUE(g.defined());
    EXPECT_GT(g.abs().max().item<double>(), 0.0);
}

TEST(Vittt, Bfloat16ForwardCloseToFloat32) {
    torch::manual_seed(6);
    auto model = small_model();
    model->eval();
    torch::NoGradGuard no_grad;
    auto images = torch::randn({2, 3, 80, 80});
    auto f32 = model->forward_features(images);
    model->to(torch::kBFloat16);
    auto bf16 = model->forward_features(images.to(torch::kBFloat16));
    ASSERT_EQ(bf16.scalar_type(), torch::kBFloat16);
    const double err = linvis::testing::relative_error(bf16, f32);
    std::printf("[ bf16 ] vittt_tiny depth 2 features: relative L2 error %.3e\n", err);
    EXPECT_LT(err, 5e-2);
}

// recompute_scans (the default in a training graph): the same gradients as keeping every scan intermediate, for
// both parameter layouts and both implementations, and the graph keeps six token-width tensors less per block.
TEST(Vittt, RecomputedScansGiveTheSameGradientsAndKeepLess) {
    const int64_t D = 192;
    const auto block_of = [](bool recompute, bool shared, linvis::ops::Impl impl) {
        torch::manual_seed(41);
        linvis::nn::VitttBlockOptions o;
        o.shared_directions = shared;
        o.recompute_scans = recompute;
        o.branch.impl = impl;
        return linvis::nn::VitttBlock(o);
    };
    for (const bool shared : {false, true}) {
        for (const linvis::ops::Impl impl : {linvis::ops::Impl::Auto, linvis::ops::Impl::Reference}) {
            std::vector<torch::Tensor> grads[2];
            for (const bool recompute : {false, true}) {
                linvis::nn::VitttBlock block = block_of(recompute, shared, impl);
                torch::manual_seed(42);
                grads[recompute] = linvis::testing::input_and_parameter_grads(
                    *block, torch::randn({2, 64, D}), [&](const torch::Tensor& y) { return block->forward(y, 8, 8); });
            }
            // The recomputation's own kernels sum in another order: within 1e-5 of each gradient's scale.
            linvis::testing::expect_same_gradients(grads[1], grads[0], 1e-5,
                                                   std::string(shared ? "shared" : "separate") + " impl " +
                                                       std::to_string(static_cast<int>(impl)));
        }
    }
    // What one block's graph keeps at 1024 tokens (768 KiB per (1, T, D) float32 tensor).
    const int64_t side = 32, unit = side * side * D * 4;
    const torch::Tensor y = torch::randn({1, side * side, D}, torch::requires_grad());
    int64_t kept[2];
    for (const bool recompute : {false, true}) {
        linvis::nn::VitttBlock block = block_of(recompute, false, linvis::ops::Impl::Auto);
        kept[recompute] = linvis::testing::bytes_kept_by([&] { return block->forward(y, side, side); });
    }
    // Each direction's u, XQ, XK, XV, scan output and state checkpoints (about one tensor) against its u and v.
    EXPECT_GE(kept[0] - kept[1], 6 * unit) << "kept " << kept[0] << " bytes without, " << kept[1] << " with";
    // Only a training step recomputes: an eval-mode graph (an explanation's input gradient) keeps as much with
    // recomputation on as without (compared in eval mode: what LibTorch's modules keep differs between the modes).
    int64_t kept_in_eval[2];
    for (const bool recompute : {false, true}) {
        linvis::nn::VitttBlock evaluated = block_of(recompute, false, linvis::ops::Impl::Auto);
        evaluated->eval();
        kept_in_eval[recompute] = linvis::testing::bytes_kept_by([&] { return evaluated->forward(y, side, side); });
    }
    EXPECT_GE(kept_in_eval[1], kept_in_eval[0] - unit) << "kept " << kept_in_eval[0] << " bytes without, "
                                                       << kept_in_eval[1] << " with";
}
