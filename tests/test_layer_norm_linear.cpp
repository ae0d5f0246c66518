// ops::layer_norm_linear and ops::modulated_layer_norm_linear (include/linvis/ops/layer_norm.h) and
// nn::NormedInput: a LayerNorm's (or DiT's adaLN's) products as one autograd node that keeps the norm's input, not
// its output. Outputs and every gradient against the reference (the norm then the products, LibTorch's graph) on
// every SIMD target; double backward; what the graph keeps; the FLOP count; bad shapes; NormedInput's paths (plain
// input, Reference, bf16).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/nn/common.h"
#include "linvis/ops/layer_norm.h"
#include "support/heap.h"
#include "support/simd_targets.h"
#include "support/testing.h"

namespace layer_norm_linear_test {

using linvis::ops::Impl;
using linvis::ops::NormedProduct;
using linvis::testing::for_each_simd_target;
using linvis::testing::heap_bytes_in_use;
using linvis::testing::kHeapNoiseBytes;
using linvis::testing::SimdTarget;

constexpr double kEps = 1e-6;

// x, the LayerNorm's weight and bias (either may be absent) and three products: with a bias, without, and one left
// out of the FLOP count (Vittt's learning-rate gate). modulated: DiT's adaLN instead, weight and bias standing for
// each sample's shift and scale (B, C).
struct Problem {
    torch::Tensor x, weight, bias;
    std::vector<NormedProduct> products;
    bool modulated = false;
};

Problem make_problem(bool affine, int64_t rows, int64_t C) {
    Problem p;
    p.x = torch::randn({2, rows, C}) * 1.5 + 0.3;
    if (affine) {
        p.weight = torch::randn({C}) * 0.5 + 1.0;
        p.bias = torch::randn({C}) * 0.3;
    }
    p.products = {{torch::randn({40, C}) * 0.1, torch::randn({40})},
                  {torch::randn({16, C}) * 0.1, {}},
                  {torch::randn({3, C}) * 0.1, torch::randn({3}), /*counted=*/false}};
    return p;
}

Problem make_modulated_problem(int64_t rows, int64_t C) {
    Problem p = make_problem(false, rows, C);
    p.weight = torch::randn({2, C}) * 0.4;  // shift
    p.bias = torch::randn({2, C}) * 0.4;    // scale
    p.modulated = true;
    return p;
}

// The problem's products under `impl`: layer_norm_linear, or modulated_layer_norm_linear.
std::vector<torch::Tensor> apply(const Problem& p, const torch::Tensor& x, const torch::Tensor& first,
                                 const torch::Tensor& second, const std::vector<NormedProduct>& products, Impl impl) {
    if (p.modulated) return linvis::ops::modulated_layer_norm_linear(x, first, second, kEps, products, impl);
    return linvis::ops::layer_norm_linear(x, first, second, kEps, products, impl);
}

// Every leaf of the problem as a fresh tensor that requires a gradient, in a flat list: x, weight, bias, then each
// product's weight and bias (undefined ones stay undefined).
std::vector<torch::Tensor> leaves(const Problem& p) {
    auto leaf = [](const torch::Tensor& t) { return t.defined() ? t.clone().requires_grad_(true) : torch::Tensor(); };
    std::vector<torch::Tensor> all{leaf(p.x), leaf(p.weight), leaf(p.bias)};
    for (const NormedProduct& product : p.products) {
        all.push_back(leaf(product.weight));
        all.push_back(leaf(product.bias));
    }
    return all;
}

struct Outcome {
    std::vector<torch::Tensor> outputs, grads;
    std::string node;  // the first output's grad_fn
};

Outcome run(const Problem& p, Impl impl) {
    std::vector<torch::Tensor> l = leaves(p);
    std::vector<NormedProduct> products;
    for (size_t i = 0; i < p.products.size(); ++i)
        products.push_back({l[3 + 2 * i], l[4 + 2 * i], p.products[i].counted});
    Outcome r;
    r.outputs = apply(p, l[0], l[1], l[2], products, impl);
    r.node = r.outputs[0].grad_fn() ? r.outputs[0].grad_fn()->name() : "";
    torch::Tensor loss = torch::zeros({});
    for (size_t i = 0; i < r.outputs.size(); ++i) loss = loss + (r.outputs[i] * torch::sin(r.outputs[i] + static_cast<double>(i))).sum();
    loss.backward();
    for (const torch::Tensor& t : l) r.grads.push_back(t.defined() ? t.grad() : torch::Tensor());
    return r;
}

// Largest difference over the largest reference value: the fused LayerNorm's statistics differ from LibTorch's by
// a few float32 roundings of a 48-term sum (about 1e-6 relative), which the products carry on.
void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i].defined(), want[i].defined()) << what << " tensor " << i;
        if (!want[i].defined()) continue;
        ASSERT_EQ(got[i].sizes(), want[i].sizes()) << what << " tensor " << i;
        const double scale = want[i].abs().max().item<double>();
        const double err = (got[i] - want[i]).abs().max().item<double>();
        EXPECT_LE(err, 2e-5 * scale) << what << " tensor " << i << " (max |value| " << scale << ")";
    }
}

TEST(LayerNormLinear, ForwardAndGradientsMatchTheReferenceOnEveryTarget) {
    for (const char* norm : {"affine", "no affine", "modulated"}) {
        const std::string kind = norm;
        torch::manual_seed(kind == "affine" ? 21 : kind == "modulated" ? 20 : 22);
        const Problem p =
            kind == "modulated" ? make_modulated_problem(197, 48) : make_problem(kind == "affine", 197, 48);
        const Outcome ref = run(p, Impl::Reference);
        EXPECT_EQ(ref.node.find("NormedProducts"), std::string::npos) << ref.node;
        for_each_simd_target([&](const SimdTarget& t) {
            for (Impl impl : {Impl::Auto, Impl::Fused}) {
                const std::string what = kind + " " + t.env + " " + linvis::ops::impl_name(impl);
                const Outcome got = run(p, impl);
                expect_close(got.outputs, ref.outputs, what + " outputs");
                expect_close(got.grads, ref.grads, what + " gradients");
                // Fused always takes the node; Auto wherever the SIMD layer is vectorised, as layer_norm.
                const bool node = impl == Impl::Fused || t.target != linvis::ops::simd::Target::Scalar;
                EXPECT_EQ(got.node.find("NormedProducts") != std::string::npos, node) << what << ": " << got.node;
            }
        });
    }
}

TEST(LayerNormLinear, OnlyTheGradientsAskedForAreComputed) {
    // x alone requires a gradient (frozen weights) and one output is unused: the node gives dx from the others.
    torch::manual_seed(23);
    const Problem p = make_problem(true, 9, 12);
    torch::Tensor x = p.x.clone().requires_grad_(true), x_ref = p.x.clone().requires_grad_(true);
    const auto y = linvis::ops::layer_norm_linear(x, p.weight, p.bias, kEps, p.products, Impl::Fused);
    const auto y_ref = linvis::ops::layer_norm_linear(x_ref, p.weight, p.bias, kEps, p.products, Impl::Reference);
    (y[0].sum() + y[2].pow(2).sum()).backward();  // the second product unused
    (y_ref[0].sum() + y_ref[2].pow(2).sum()).backward();
    EXPECT_TRUE(linvis::testing::all_close(x.grad(), x_ref.grad(), 1e-4, 1e-5));
}

TEST(LayerNormLinear, DoubleBackwardMatchesTheReference) {
    for (bool modulated : {false, true}) {
        torch::manual_seed(24);
        const Problem p = modulated ? make_modulated_problem(7, 12) : make_problem(true, 7, 12);
        auto second = [&](Impl impl) {
            std::vector<torch::Tensor> l = leaves(p);
            const std::vector<NormedProduct> products{{l[3], l[4]}, {l[5], {}}};
            const auto y = apply(p, l[0], l[1], l[2], products, impl);
            const auto g =
                torch::autograd::grad({y[0].pow(2).sum() + y[1].pow(3).sum()}, {l[0], l[1], l[3]}, {}, true, true);
            (g[0].pow(2).sum() + g[1].pow(2).sum() + g[2].pow(2).sum()).backward();
            return std::vector<torch::Tensor>{g[0].detach(), l[0].grad(), l[1].grad(), l[2].grad(), l[3].grad(),
                                              l[5].grad()};
        };
        const auto ref = second(Impl::Reference), got = second(Impl::Fused);
        for (size_t i = 0; i < ref.size(); ++i) {
            const double scale = ref[i].abs().max().item<double>();
            EXPECT_LE((got[i] - ref[i]).abs().max().item<double>(), 1e-4 * scale)
                << (modulated ? "modulated" : "affine") << " tensor " << i;
        }
    }
}

TEST(LayerNormLinear, TheGraphKeepsTheInputButNotItsNormalisedCopy) {
    // A ViT-T block at 1024 px: 4096 tokens of 192 (3 MiB per token-width tensor), qkv 576 wide (9 MiB).
    torch::manual_seed(25);
    const int64_t T = 4096, C = 192, N = 576, normed_bytes = T * C * 4, out_bytes = T * N * 4;
    {   // The measurement sees tensors at all (a malloc that mallinfo2 does not describe would show nothing).
        const int64_t before = heap_bytes_in_use();
        torch::Tensor probe = torch::empty({T, C});
        ASSERT_GE(heap_bytes_in_use() - before, normed_bytes - kHeapNoiseBytes);
    }
    torch::Tensor x = torch::randn({T, C}, torch::requires_grad());
    torch::Tensor w = torch::ones({C}, torch::requires_grad()), b = torch::zeros({C}, torch::requires_grad());
    const std::vector<NormedProduct> products{{(torch::randn({N, C}) * 0.02).requires_grad_(true),
                                               torch::zeros({N}, torch::requires_grad())}};
    auto kept = [&](Impl impl) {
        const int64_t before = heap_bytes_in_use();
        const std::vector<torch::Tensor> y = linvis::ops::layer_norm_linear(x, w, b, kEps, products, impl);
        return heap_bytes_in_use() - before;
    };
    const int64_t reference = kept(Impl::Reference), fused = kept(Impl::Fused);
    // Both keep the output; the reference also the normalised x, the node only per-row statistics (8 bytes a row).
    EXPECT_GE(reference, out_bytes + normed_bytes);
    EXPECT_LT(fused, out_bytes + normed_bytes / 4);
}

TEST(ModulatedLayerNormLinear, TheGraphKeepsTheInputButNotItsModulatedCopy) {
    // dit_s2's fc1 at latent side 64, batch 2: 1024 tokens of 384 (3 MiB per token-width tensor), 1536 wide.
    torch::manual_seed(28);
    const int64_t B = 2, T = 1024, C = 384, N = 1536, width_bytes = B * T * C * 4, out_bytes = B * T * N * 4;
    const torch::Tensor x = torch::randn({B, T, C}, torch::requires_grad());
    // shift and scale as DiT has them: column chunks of one (B, 6C) product.
    const std::vector<torch::Tensor> m = (torch::randn({B, 6 * C}) * 0.4).requires_grad_(true).chunk(6, 1);
    const std::vector<NormedProduct> products{{(torch::randn({N, C}) * 0.02).requires_grad_(true),
                                               torch::zeros({N}, torch::requires_grad())}};
    auto kept = [&](Impl impl) {
        const int64_t before = heap_bytes_in_use();
        const std::vector<torch::Tensor> y =
            linvis::ops::modulated_layer_norm_linear(x, m[0], m[1], kEps, products, impl);
        return heap_bytes_in_use() - before;
    };
    const int64_t reference = kept(Impl::Reference), fused = kept(Impl::Fused);
    // Both keep the output; the reference also the normalised and the modulated x, the node per-row statistics.
    EXPECT_GE(reference, out_bytes + 2 * width_bytes);
    EXPECT_LT(fused, out_bytes + width_bytes / 4);
}

TEST(LayerNormLinear, CountsTheFlopsOfTheCountedProductsOnly) {
    torch::manual_seed(26);
    const Problem p = make_problem(true, 5, 8);  // 2 x 5 rows; products 40, 16 and (uncounted) 3 wide
    for (bool graph : {false, true}) {
        torch::Tensor x = p.x.clone().requires_grad_(graph);
        linvis::flops::Counter counter;
        linvis::ops::layer_norm_linear(x, p.weight, p.bias, kEps, p.products, Impl::Fused);
        EXPECT_EQ(counter.macs(), 2 * 5 * 8 * (40 + 16)) << (graph ? "graph" : "no graph");
    }
}

TEST(LayerNormLinear, BadShapesNameTheProduct) {
    const torch::Tensor x = torch::randn({4, 8});
    try {
        linvis::ops::layer_norm_linear(x, {}, {}, kEps, {{torch::randn({3, 8}), {}}, {torch::randn({3, 7}), {}}});
        FAIL() << "no error";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("product 1: weight: expected (N, 8)"), std::string::npos) << e.what();
    }
    EXPECT_THROW(linvis::ops::layer_norm_linear(x, {}, {}, kEps, {{torch::randn({3, 8}), torch::randn({4})}}),
                 linvis::Error);
}

TEST(NormedInput, ProductsEqualLayerNormThenLinearOnEveryPath) {
    torch::manual_seed(27);
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({24}).eps(1e-6));
    torch::nn::Linear fc(24, 10);
    {
        torch::NoGradGuard no_grad;
        norm->weight.normal_(1.0, 0.3);
        norm->bias.normal_(0.0, 0.3);
    }
    const torch::Tensor x0 = torch::randn({3, 11, 24});
    const torch::Tensor want = torch::nn::functional::linear(
        torch::layer_norm(x0, {24}, norm->weight, norm->bias, 1e-6), fc->weight, fc->bias);
    for (Impl impl : {Impl::Reference, Impl::Auto}) {
        for (bool grad_mode : {false, true}) {
            torch::AutoGradMode mode(grad_mode);
            const linvis::nn::NormedInput in(norm, x0);
            EXPECT_EQ(in.records_graph(), grad_mode) << "the LayerNorm's parameters require gradients";
            EXPECT_TRUE(linvis::testing::all_close(in.linear(fc, impl), want, 1e-5, 1e-5))
                << linvis::ops::impl_name(impl) << (grad_mode ? " graph" : "");
            EXPECT_TRUE(linvis::testing::all_close(in.value(), torch::layer_norm(x0, {24}, norm->weight, norm->bias, 1e-6),
                                                   1e-5, 1e-5));
        }
    }
    // A plain input: the products of x itself.
    const linvis::nn::NormedInput plain(x0);
    EXPECT_TRUE(linvis::testing::all_close(plain.linear(fc, Impl::Auto),
                                           torch::nn::functional::linear(x0, fc->weight, fc->bias), 1e-6, 1e-6));
    EXPECT_TRUE(plain.value().is_same(x0));
    // bf16: normalised in float32 and rounded once (nn::layer_norm), then the bf16 product.
    torch::NoGradGuard no_grad;
    torch::nn::LayerNorm norm16(torch::nn::LayerNormOptions({24}).eps(1e-6));
    torch::nn::Linear fc16(24, 10);
    norm16->to(torch::kBFloat16);
    fc16->to(torch::kBFloat16);
    const torch::Tensor x16 = x0.to(torch::kBFloat16);
    const torch::Tensor y16 = linvis::nn::NormedInput(norm16, x16).linear(fc16, Impl::Auto);
    ASSERT_EQ(y16.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(y16.equal(linvis::flops::linear(linvis::nn::layer_norm(norm16, x16), fc16->weight, fc16->bias)));
}

TEST(NormedInput, ModulatedProductsEqualTheOfficialModulateThenLinearOnEveryPath) {
    torch::manual_seed(29);
    torch::nn::Linear fc(24, 10);
    const torch::Tensor x0 = torch::randn({3, 11, 24});
    const std::vector<torch::Tensor> m = (torch::randn({3, 6 * 24}) * 0.4).chunk(6, 1);
    const torch::Tensor modulated =
        torch::layer_norm(x0, {24}, {}, {}, 1e-6) * (1 + m[1].unsqueeze(1)) + m[0].unsqueeze(1);
    const torch::Tensor want = torch::nn::functional::linear(modulated, fc->weight, fc->bias);
    for (Impl impl : {Impl::Reference, Impl::Auto}) {
        for (bool grad_mode : {false, true}) {
            torch::AutoGradMode mode(grad_mode);
            const auto in = linvis::nn::NormedInput::modulated(x0, m[0], m[1], 1e-6);
            EXPECT_FALSE(in.records_graph()) << "no operand requires a gradient";
            const torch::Tensor y = in.linear(fc, impl);
            EXPECT_TRUE(linvis::testing::all_close(y, want, 1e-5, 1e-5)) << linvis::ops::impl_name(impl);
            EXPECT_TRUE(linvis::testing::all_close(in.value(impl), modulated, 1e-5, 1e-5));
            EXPECT_EQ(y.requires_grad(), grad_mode) << "fc's parameters require gradients";
        }
    }
    const torch::Tensor shift = m[0].detach().requires_grad_(true);
    EXPECT_TRUE(linvis::nn::NormedInput::modulated(x0, shift, m[1], 1e-6).records_graph()) << "shift requires grad";
    // bf16: modulated in float32 and rounded once (nn::modulated_layer_norm), then the bf16 product.
    torch::NoGradGuard no_grad;
    torch::nn::Linear fc16(24, 10);
    fc16->to(torch::kBFloat16);
    const torch::Tensor x16 = x0.to(torch::kBFloat16);
    const torch::Tensor shift16 = m[0].to(torch::kBFloat16), scale16 = m[1].to(torch::kBFloat16);
    const torch::Tensor y16 = linvis::nn::NormedInput::modulated(x16, shift16, scale16, 1e-6).linear(fc16, Impl::Auto);
    ASSERT_EQ(y16.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(y16.equal(linvis::flops::linear(
        linvis::nn::modulated_layer_norm(x16, shift16, scale16, 1e-6, Impl::Auto), fc16->weight, fc16->bias)));
}

}  // namespace layer_norm_linear_test
