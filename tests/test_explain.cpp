// Interpretability tools (include/linvis/tools/explain.h) and `linvis explain`.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/models/registry.h"
#include "linvis/nn/common.h"
#include "linvis/nn/vittt_block.h"
#include "linvis/ops/attention.h"
#include "linvis/ops/ttt_linear.h"
#include "linvis/tools/explain.h"
#include "linvis/plot/plot.h"
#include "support/cli.h"
#include "support/testing.h"

namespace fs = std::filesystem;
using namespace linvis;
namespace explain = linvis::tools::explain;
using linvis::testing::all_close;

using linvis::testing::run_cli;

namespace {

// A model whose every output token sees only its own 16x16 patch: one Conv2d with
// kernel = stride = 16. Optionally a class token that sees every pixel (the image mean
// through a linear map) is put first, or the output stays a (B, C, h, w) map.
class PatchOnlyModel : public models::VisionModel {
public:
    PatchOnlyModel(bool class_token, bool as_map) : class_token_(class_token), as_map_(as_map) {
        proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 16).stride(16)));
        mix = register_module("mix", torch::nn::Linear(3, 8));
    }
    torch::Tensor forward_features(const torch::Tensor& images) override {
        torch::Tensor map = proj->forward(images);
        if (as_map_) return map;
        torch::Tensor tokens = map.flatten(2).transpose(1, 2);
        if (!class_token_) return tokens;
        torch::Tensor cls = mix->forward(images.mean({2, 3})).unsqueeze(1);
        return torch::cat({cls, tokens}, 1);
    }
    torch::Tensor forward_head(const torch::Tensor& features, bool) override { return features.mean(1); }
    std::vector<torch::Tensor> forward_intermediates(const torch::Tensor&, const std::vector<int64_t>&) override {
        return {};
    }
    int64_t num_classes() const override { return 8; }
    int64_t num_features() const override { return 8; }
    torch::nn::Conv2d proj{nullptr};
    torch::nn::Linear mix{nullptr};

private:
    bool class_token_, as_map_;
};

// Nonzero exactly inside rows/cols [lo, hi) of a 2-D map.
void expect_support_is_square(const torch::Tensor& erf, int64_t lo, int64_t hi) {
    torch::Tensor inside = torch::zeros_like(erf, torch::kBool);
    inside.index_put_({torch::indexing::Slice(lo, hi), torch::indexing::Slice(lo, hi)}, true);
    EXPECT_TRUE((erf.masked_select(inside) > 0).all().item<bool>()) << erf.slice(0, lo, hi).slice(1, lo, hi);
    EXPECT_EQ(erf.masked_select(inside.logical_not()).abs().max().item<float>(), 0.0f);
}

torch::Tensor random_images(int64_t b, int64_t size, uint64_t seed) {
    torch::manual_seed(seed);
    return torch::randn({b, 3, size, size});
}


}  // namespace

// ---------------------------------------------------------------- ERF

TEST(Explain, ErfOfPatchOnlyModelIsTheCentrePatch) {
    torch::manual_seed(0);
    PatchOnlyModel model(false, false);
    // 64x64: a 4x4 grid, centre cell (2, 2) = pixels [32, 48).
    ASSERT_EQ(explain::effective_receptive_field(model, random_images(2, 64, 1)).sizes(),
              (std::vector<int64_t>{64, 64}));
    expect_support_is_square(explain::effective_receptive_field(model, random_images(2, 64, 1)), 32, 48);
    explain::ErfOptions plain_sum;
    plain_sum.rectify_features = false;
    torch::Tensor erf = explain::effective_receptive_field(model, random_images(2, 64, 1), plain_sum);
    expect_support_is_square(erf, 32, 48);
    // The gradient of sum(features) w.r.t. pixel (c, y, x) is sum_o W[o, c, y mod 16, x mod 16]:
    // independent of the image, so the ERF equals sum_c |sum_o W| on the patch.
    torch::Tensor expected = model.proj->weight.sum(0).abs().sum(0).detach();
    EXPECT_TRUE(all_close(erf.slice(0, 32, 48).slice(1, 32, 48), expected, 1e-5, 1e-7))
        << erf.slice(0, 32, 36).slice(1, 32, 36) << expected.slice(0, 0, 4).slice(1, 0, 4);
}

TEST(Explain, ErfSkipsClassTokenAndHandlesFeatureMaps) {
    torch::manual_seed(0);
    PatchOnlyModel with_cls(true, false);
    torch::Tensor erf = explain::effective_receptive_field(with_cls, random_images(1, 80, 2));
    // 80x80: 26 tokens = 1 + a 5x5 grid (26 itself is no grid), centre (2, 2) = pixels [32, 48).
    expect_support_is_square(erf, 32, 48);
    explain::ErfOptions explicit_prefix;
    explicit_prefix.prefix_tokens = 1;
    EXPECT_TRUE(all_close(explain::effective_receptive_field(with_cls, random_images(1, 80, 2), explicit_prefix), erf,
                          0, 0));
    // Taking the class token as a patch (prefix 0 does not fit 26 tokens) is refused.
    explain::ErfOptions wrong_prefix;
    wrong_prefix.prefix_tokens = 0;
    EXPECT_THROW(explain::effective_receptive_field(with_cls, random_images(1, 80, 2), wrong_prefix), Error);

    PatchOnlyModel as_map(false, true);
    expect_support_is_square(explain::effective_receptive_field(as_map, random_images(1, 64, 3)), 32, 48);
    EXPECT_THROW(explain::effective_receptive_field(as_map, torch::randn({3, 64, 64})), Error);
}

TEST(Explain, ErfOfGlobalMixersSpreadsBeyondTheCentrePatch) {
    for (const std::string name : {"vittt_tiny", "deit_tiny"}) {
        torch::manual_seed(0);
        auto model = models::create_model(
            name, models::ModelConfig({{"depth", "2"}, {"img_size", "64"}, {"num_classes", "0"}}));
        model->train();
        torch::Tensor erf = explain::effective_receptive_field(*model, random_images(2, 64, 4));
        EXPECT_TRUE(model->is_training()) << "mode restored";
        ASSERT_EQ(erf.sizes(), (std::vector<int64_t>{64, 64}));
        // Every 16x16 patch, the far corner included, influences the centre token.
        torch::Tensor per_patch = erf.reshape({4, 16, 4, 16}).sum({1, 3});
        EXPECT_TRUE((per_patch > 0).all().item<bool>()) << name << "\n" << per_patch;
        EXPECT_GT(per_patch[2][2].item<float>(), per_patch[0][0].item<float>()) << name;
        // The final LayerNorm (gamma = 1 untrained) makes the plain channel sum constant: no gradient.
        explain::ErfOptions plain_sum;
        plain_sum.rectify_features = false;
        EXPECT_LT(explain::effective_receptive_field(*model, random_images(2, 64, 4), plain_sum).max().item<float>(),
                  1e-3f * erf.max().item<float>())
            << name;
        torch::Tensor shown = explain::erf_display_map(erf, 3.0);
        EXPECT_NEAR(shown.max().item<float>(), 0.0f, 1e-6);
        EXPECT_GE(shown.min().item<float>(), -3.0f);
    }
}

TEST(Explain, ErfDisplayMapIsRelativeLogWithFloor) {
    torch::Tensor map = torch::tensor({4.0f, 0.4f, 0.004f, 0.0f}).view({2, 2});
    EXPECT_TRUE(all_close(explain::erf_display_map(map, 2.0),
                          torch::tensor({0.0f, -1.0f, -2.0f, -2.0f}).view({2, 2}), 1e-6, 1e-6));
    EXPECT_TRUE(all_close(explain::erf_display_map(torch::zeros({3, 3}), 3.0), torch::full({3, 3}, -3.0f), 0, 0));
    EXPECT_THROW(explain::erf_display_map(torch::tensor({1.0f, -1.0f}), 3.0), Error);
}

// ---------------------------------------------------------------- Gradient Magnitude Map

TEST(Explain, GradientMapEqualsTheBranchGradNorms) {
    torch::manual_seed(0);
    // 80x80: 25 tokens, so the last mini-batch (b = 16) is short; 2 heads of 64.
    auto model = models::create_model(
        "vittt_tiny", models::ModelConfig({{"depth", "2"}, {"img_size", "80"}, {"embed_dim", "128"}}));
    model->eval();
    torch::Tensor image = random_images(1, 80, 5)[0];
    torch::NoGradGuard no_grad;
    // The input of block 0 from the parameters; checked against the model's own block outputs.
    auto params = model->named_parameters();
    torch::Tensor y0 = torch::conv2d(image.unsqueeze(0), params["patch_embed.proj.weight"],
                                     params["patch_embed.proj.bias"], {16, 16})
                           .flatten(2)
                           .transpose(1, 2) +
                       params["pos_embed"];
    std::vector<nn::VitttBlock> blocks;
    for (const auto& item : model->named_modules())
        if (item.key() == "blocks.0" || item.key() == "blocks.1")
            blocks.emplace_back(std::dynamic_pointer_cast<nn::VitttBlockImpl>(item.value()));
    ASSERT_EQ(blocks.size(), 2u);
    torch::Tensor y1 = blocks[0]->forward(y0, 5, 5);
    ASSERT_TRUE(all_close(y1, model->forward_intermediates(image.unsqueeze(0), {0})[0], 1e-5, 1e-5));
    const std::vector<torch::Tensor> inputs = {y0, y1};
    for (int64_t b = 0; b < 2; ++b) {
        auto& blk = blocks[b];
        torch::Tensor grid = inputs[b].transpose(1, 2).reshape({1, 128, 5, 5});
        torch::Tensor y = inputs[b] + torch::conv2d(grid, blk->dwconv->weight, blk->dwconv->bias, {1, 1}, {1, 1}, {1, 1},
                                                    128)
                                          .flatten(2)
                                          .transpose(1, 2);
        torch::Tensor x = blk->norm1->forward(y);
        torch::Tensor forth_norms, back_norms;
        blk->forth_branch()->forward(x, &forth_norms);
        blk->back_branch()->forward(torch::flip(x, {1}), &back_norms);
        back_norms = torch::flip(back_norms, {2});  // scan order -> image order
        ASSERT_EQ(forth_norms.sizes(), (std::vector<int64_t>{1, 2, 25}));
        for (auto branch : {explain::TttBranch::Forth, explain::TttBranch::Back}) {
            const torch::Tensor& norms = branch == explain::TttBranch::Forth ? forth_norms : back_norms;
            torch::Tensor all_heads = explain::gradient_magnitude_map(*model, image, b, branch);
            ASSERT_EQ(all_heads.sizes(), (std::vector<int64_t>{5, 5}));
            EXPECT_TRUE(all_close(all_heads, norms[0].pow(2).sum(0).sqrt().reshape({5, 5}), 1e-5, 1e-7))
                << "block " << b << " " << explain::ttt_branch_name(branch);
            for (int64_t head = 0; head < 2; ++head)
                EXPECT_TRUE(all_close(explain::gradient_magnitude_map(*model, image, b, branch, head),
                                      norms[0][head].reshape({5, 5}), 1e-5, 1e-7));
        }
        // The two directions read different states, so their maps differ.
        EXPECT_FALSE(torch::allclose(forth_norms, back_norms));
    }
    EXPECT_TRUE(all_close(explain::gradient_magnitude_map(*model, image, -1, explain::TttBranch::Forth),
                          explain::gradient_magnitude_map(*model, image, 1, explain::TttBranch::Forth), 0, 0));
    EXPECT_THROW(explain::gradient_magnitude_map(*model, image, 2, explain::TttBranch::Forth), Error);
    EXPECT_THROW(explain::gradient_magnitude_map(*model, image, 0, explain::TttBranch::Forth, 2), Error);
    EXPECT_THROW(explain::parse_ttt_branch("left"), Error);
    auto deit = models::create_model("deit_tiny", models::ModelConfig({{"depth", "1"}, {"img_size", "32"}}));
    EXPECT_THROW(explain::gradient_magnitude_map(*deit, torch::zeros({3, 32, 32}), 0, explain::TttBranch::Forth),
                 Error);
}

// ---------------------------------------------------------------- attention

TEST(Explain, LinearAttentionWeightsMatchBruteForce) {
    torch::manual_seed(0);
    torch::Tensor q = torch::randn({2, 3, 7, 5}, torch::kFloat64), k = torch::randn({2, 3, 7, 5}, torch::kFloat64);
    torch::Tensor v = torch::randn({2, 3, 7, 4}, torch::kFloat64);
    for (bool causal : {false, true}) {
        for (bool normalize : {true, false}) {
            ops::LinearAttentionOptions options;
            options.causal = causal;
            options.normalize = normalize;
            options.chunk_size = 3;
            options.feature_map = normalize ? ops::FeatureMap::EluPlusOne : ops::FeatureMap::Relu;
            torch::Tensor a = explain::linear_attention_weights(q, k, options);
            ASSERT_EQ(a.sizes(), (std::vector<int64_t>{2, 3, 7, 7}));
            // The weights reproduce the op: out = A v.
            EXPECT_TRUE(all_close(torch::matmul(a, v), ops::linear_attention(q, k, v, options), 1e-10, 1e-12));
            // Brute force, one (b, h, i, j) at a time, and the row sums Z_i / (Z_i + eps).
            torch::Tensor pq = ops::apply_feature_map(q, options.feature_map);
            torch::Tensor pk = ops::apply_feature_map(k, options.feature_map);
            for (int64_t i = 0; i < 7; ++i) {
                const int64_t last = causal ? i + 1 : 7;
                torch::Tensor z = (pq.select(2, i).unsqueeze(2) * pk.slice(2, 0, last)).sum({2, 3});  // (2, 3)
                for (int64_t j = 0; j < 7; ++j) {
                    torch::Tensor s = (pq.select(2, i) * pk.select(2, j)).sum(-1);
                    torch::Tensor expected = j < last ? (normalize ? s / (z + options.eps) : s) : torch::zeros_like(s);
                    EXPECT_TRUE(all_close(a.select(2, i).select(2, j), expected, 1e-12, 1e-14));
                }
                if (normalize) EXPECT_TRUE(all_close(a.select(2, i).sum(-1), z / (z + options.eps), 1e-12, 1e-14));
            }
            // Eq. 13 by autograd gives the same (non-negative for elu+1) weights.
            if (normalize) {
                auto mixer = [&](const torch::Tensor& values) { return ops::linear_attention(q, k, values, options); };
                for (int64_t query : {0, 4, 6})
                    EXPECT_TRUE(all_close(explain::implicit_attention(mixer, v, query), a.select(2, query), 1e-10,
                                          1e-12));
            }
        }
    }
}

TEST(Explain, ImplicitAttentionOfSoftmaxAttentionIsItsWeights) {
    torch::manual_seed(1);
    torch::Tensor q = torch::randn({1, 2, 6, 4}, torch::kFloat64), k = torch::randn({1, 2, 9, 4}, torch::kFloat64);
    torch::Tensor v = torch::randn({1, 2, 9, 4}, torch::kFloat64);
    torch::Tensor weights = explain::softmax_attention_weights(q, k, 0.5);
    EXPECT_TRUE(all_close(weights.sum(-1), torch::ones({1, 2, 6}, torch::kFloat64), 1e-12, 1e-12));
    EXPECT_TRUE(all_close(torch::matmul(weights, v), ops::softmax_attention(q, k, v, 0.5), 1e-10, 1e-12));
    auto mixer = [&](const torch::Tensor& values) { return ops::softmax_attention(q, k, values, 0.5); };
    for (int64_t query = 0; query < 6; ++query)
        EXPECT_TRUE(all_close(explain::implicit_attention(mixer, v, query), weights.select(2, query), 1e-10, 1e-12));
}

// TTT with a linear inner model f(x) = x W (paper Appendix C): every update multiplies W from the
// left, so d o_i / d v_j = c_ij I exactly and the implicit attention is an attention matrix.
TEST(Explain, TttLinearInnerModelHasExactImplicitAttention) {
    torch::manual_seed(2);
    const int64_t B = 1, nh = 2, T = 10, d = 4;
    auto opts = torch::kFloat64;
    torch::Tensor xq = torch::randn({B, nh, T, d}, opts), xk = torch::randn({B, nh, T, d}, opts) * 0.5;
    torch::Tensor xv = torch::randn({B, nh, T, d}, opts), lr = torch::rand({B, nh, T}, opts) * 0.2;
    torch::Tensor w0 = torch::randn({nh, d, d}, opts) * 0.1;
    ops::TttLinearOptions options;
    options.mini_batch_size = 4;
    options.inner_model = ops::TttInnerModel::Linear;
    options.use_token_coefficient = false;
    auto mixer = [&](const torch::Tensor& values) {
        return ops::ttt_linear(xq, xk, values, lr, {}, w0, {}, {}, {}, options).output;
    };
    const int64_t query = 7;  // second mini-batch: depends on the first through the carried state
    // Full Jacobian d o_query / d v (B, h, do, T, dv) by autograd.
    torch::Tensor values = xv.clone().set_requires_grad(true);
    torch::Tensor out = mixer(values).select(2, query);
    std::vector<torch::Tensor> rows;
    for (int64_t c = 0; c < d; ++c)
        rows.push_back(torch::autograd::grad({out.select(-1, c).sum()}, {values}, {}, true)[0]);
    torch::Tensor jac = torch::stack(rows, 2);  // (B, h, c_out, T, c_in)
    torch::Tensor diag = jac.diagonal(0, 2, 4);  // (B, h, T, d): J[c, c]
    torch::Tensor eye = torch::eye(d, opts).view({1, 1, d, 1, d});
    // Off-diagonal channel entries vanish and the diagonal is constant: J_j = c_j I.
    EXPECT_LT((jac * (1 - eye)).abs().max().item<double>(), 1e-12);
    EXPECT_TRUE(all_close(diag, diag.select(-1, 0).unsqueeze(-1).expand_as(diag), 1e-10, 1e-13));
    // Tokens after the query's causal prefix do not contribute; earlier ones do.
    torch::Tensor c = diag.select(-1, 0);
    EXPECT_EQ(c.slice(2, query + 1).abs().max().item<double>(), 0.0);
    EXPECT_GT(c.slice(2, 0, 4).abs().min().item<double>(), 0.0);
    EXPECT_TRUE(all_close(explain::implicit_attention(mixer, xv, query), c.abs(), 1e-10, 1e-13));
}

TEST(Explain, AttentionMapsOfDeitAndT5) {
    torch::manual_seed(3);
    torch::Tensor image = random_images(1, 64, 6)[0];
    auto deit = models::create_model("deit_tiny", models::ModelConfig({{"depth", "2"}, {"img_size", "64"}}));
    for (int64_t block : {0, 1}) {
        explain::AttentionMap a = explain::attention_map(*deit, image, block, 1, 2);
        ASSERT_EQ(a.map.sizes(), (std::vector<int64_t>{4, 4}));
        // Softmax rows sum to 1 over the class token and the 16 patches; the patches take most of it.
        const double total = a.map.sum().item<double>();
        EXPECT_GT(total, 0.5);
        EXPECT_LE(total, 1.0 + 1e-6);
        EXPECT_TRUE((a.map > 0).all().item<bool>());
    }
    auto t5 = models::create_model("t5_tiny", models::ModelConfig({{"depth", "2"}, {"img_size", "64"}}));
    explain::AttentionMap a = explain::attention_map(*t5, image, -1, 2, 2);
    ASSERT_EQ(a.map.sizes(), (std::vector<int64_t>{4, 4}));
    EXPECT_TRUE(torch::isfinite(a.map).all().item<bool>());
    EXPECT_GT(a.map.max().item<float>(), 0.0f);
    EXPECT_NE(a.method.find("Eq. 13"), std::string::npos);
    EXPECT_THROW(explain::attention_map(*t5, image, 0, 4, 0), Error);
    EXPECT_THROW(explain::attention_map(*t5, random_images(1, 80, 6)[0], 0, 0, 0), Error);
    auto vittt = models::create_model("vittt_tiny", models::ModelConfig({{"depth", "1"}, {"img_size", "64"}}));
    EXPECT_THROW(explain::attention_map(*vittt, image, 0, 0, 0), Error);
}

// ---------------------------------------------------------------- CLI

TEST(Explain, CliWritesPicturesAndRejectsBadOptions) {
    const fs::path dir = fs::temp_directory_path() / ("linvis_test_explain_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    const std::string small = " --img-size 64 --model-kwargs depth=2 --threads 1";
    const std::string png = (dir / "gradmap.png").string(), raw = (dir / "gradmap.safetensors").string();
    auto r = run_cli("explain --model vittt_tiny --what gradmap --block 1 --branch back" + small + " --output " + png +
                     " --save-map " + raw);
    ASSERT_EQ(r.status, 0) << r.output;
    auto picture = plot::load_png(png);
    EXPECT_EQ(picture.width(), 3 * 340);
    EXPECT_EQ(picture.height(), 360);
    EXPECT_TRUE(fs::exists(raw));
    const std::string erf_png = (dir / "erf.png").string();
    r = run_cli("explain --model vittt_tiny,deit_tiny --what erf" + small + " --output " + erf_png);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_EQ(plot::load_png(erf_png).width(), 2 * 340);
    r = run_cli("explain --model t5_tiny --what attention --query 1,2" + small + " --output " +
                (dir / "att.png").string());
    ASSERT_EQ(r.status, 0) << r.output;

    struct Bad {
        std::string args, message;
    };
    const std::vector<Bad> bad = {
        {"--model vittt_tiny --what heat --output x.png", "--what must be erf, gradmap or attention"},
        {"--model vittt_tiny --what gradmap --branch left --output x.png", "'forth' or 'back'"},
        {"--model vittt_tiny --what gradmap --output x.jpg", "--output must name a .png file"},
        {"--model deit_tiny,vittt_tiny --what gradmap --output x.png", "only with --what erf"},
        {"--model deit_tiny --what attention --query 1 --output x.png", "--query must be Y,X"},
        {"--model deit_tiny --what gradmap --output x.png", "not a Vision-TTT block"},
        {"--model nosuch --what erf --output x.png", "unknown model"},
    };
    for (const auto& b : bad) {
        r = run_cli("explain " + b.args + small);
        EXPECT_NE(r.status, 0) << b.args;
        EXPECT_NE(r.output.find(b.message), std::string::npos) << b.args << "\n" << r.output;
        std::string trimmed = r.output;
        while (!trimmed.empty() && trimmed.back() == '\n') trimmed.pop_back();
        EXPECT_EQ(trimmed.find('\n'), std::string::npos) << "one line: " << r.output;
    }
    fs::remove_all(dir);
}
