// ops::layer_norm (include/linvis/ops/layer_norm.h): the fused kernel against torch::layer_norm on every SIMD
// target this CPU runs (row lengths around the 16 partial sums, row counts around the parallel blocks, with
// and without weight / bias, rows with a large offset); gradients in a graph; the dispatch (dtype, shapes,
// layouts the kernel does not take); nn::layer_norm goes through it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "linvis/core/error.h"
#include "linvis/nn/common.h"
#include "linvis/ops/layer_norm.h"
#include "support/heap.h"
#include "support/simd_targets.h"

namespace {

using linvis::ops::Impl;
using linvis::testing::for_each_simd_target;
using linvis::testing::SimdTarget;

constexpr double kEps = 1e-5;
constexpr double kU = 5.96e-8;  // float32 unit roundoff, 2^-24

// Growth of the float32 sums over a row of n: the fused kernel's 16 partial sums take ceil(n/16) additions
// each and 4 to fold; doubled for LibTorch's own summation and its x*rstd - mean*rstd form.
double growth(int64_t n) { return 2.0 * (static_cast<double>((n + 15) / 16) + 8.0); }

// Tolerance of fused vs reference (f32), per element: the mean carries an error of about u K mean|x|
// (the sum's growth K; mean|x|, not |mean|, bounds a sum's error), seen through rstd and the weight; rstd about u K relative; then the roundings of
// the affine step. Both sides are within this of the exact result, so their difference within twice it.
torch::Tensor tolerance(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                        const torch::Tensor& y_ref) {
    const int64_t n = x.size(-1);
    const torch::Tensor x64 = x.to(torch::kFloat64);
    const torch::Tensor mu = x64.mean(-1, true);
    const torch::Tensor rstd = torch::rsqrt(x64.var(-1, false, true) + kEps);
    const torch::Tensor w = weight.defined() ? weight.to(torch::kFloat64).abs() : torch::ones({n}, torch::kFloat64);
    const torch::Tensor b = bias.defined() ? bias.to(torch::kFloat64).abs() : torch::zeros({n}, torch::kFloat64);
    const double k = growth(n);
    return 2.0 * (kU * k * (w * rstd * (x64.abs().mean(-1, true) + (x64 - mu).abs()) + y_ref.to(torch::kFloat64).abs()) + 2 * kU * b) +
           1e-30;
}

struct Affine {
    bool weight, bias;
};

// Where the error is worst against its tolerance: the element's x, fused and reference values, and its row's
// float64 mean and std.
std::string worst_of(const torch::Tensor& x, const torch::Tensor& fused, const torch::Tensor& ref,
                     const torch::Tensor& ratio) {
    const int64_t i = ratio.argmax().item<int64_t>(), n = x.size(-1);
    const torch::Tensor row = x.reshape({-1, n})[i / n].to(torch::kFloat64);
    return "x " + std::to_string(x.reshape(-1)[i].item<double>()) + " fused " +
           std::to_string(fused.reshape(-1)[i].item<double>()) + " reference " +
           std::to_string(ref.reshape(-1)[i].item<double>()) + " row mean " + std::to_string(row.mean().item<double>()) +
           " std " + std::to_string(row.std(false).item<double>());
}

void expect_forward_matches(const torch::Tensor& x, const Affine& a, const std::string& what) {
    const int64_t n = x.size(-1);
    const torch::Tensor w = a.weight ? torch::randn({n}) * 0.5 + 1.0 : torch::Tensor();
    const torch::Tensor b = a.bias ? torch::randn({n}) * 0.3 : torch::Tensor();
    const torch::Tensor ref = torch::layer_norm(x, {n}, w, b, kEps);
    const torch::Tensor fused = linvis::ops::layer_norm(x, {n}, w, b, kEps, Impl::Fused);
    ASSERT_EQ(fused.sizes(), x.sizes()) << what;
    const torch::Tensor err = (fused.to(torch::kFloat64) - ref.to(torch::kFloat64)).abs();
    const torch::Tensor tol = tolerance(x, w, b, ref);
    EXPECT_TRUE(torch::all(err <= tol).item<bool>())
        << what << ": max error " << err.max().item<double>() << ", worst error/tolerance "
        << (err / tol).max().item<double>() << " at " << worst_of(x, fused, ref, err / tol);
    EXPECT_FALSE(torch::any(torch::isnan(fused)).item<bool>()) << what;
}

TEST(LayerNormOp, FusedMatchesReferenceOnEveryTarget) {
    for_each_simd_target([](const SimdTarget& t) {
        torch::manual_seed(11);
        for (int64_t n : {1, 7, 16, 33, 192, 768})
            for (int64_t rows : {1, 3, 197, 4097})
                for (const Affine a : {Affine{true, true}, Affine{false, false}, Affine{true, false}, Affine{false, true}}) {
                    // Large rows only with the full affine form, to keep the test short.
                    if (rows * n > 200000 && !(a.weight && a.bias)) continue;
                    const std::string what = std::string(t.env) + " rows " + std::to_string(rows) + " n " +
                                             std::to_string(n) + " weight " + std::to_string(a.weight) + " bias " +
                                             std::to_string(a.bias);
                    expect_forward_matches(torch::randn({rows, n}) * 2.0 + 0.5, a, what);
                    // A large offset against the spread (mean 1e3, std 1e-2): a one-pass E[x^2] - E[x]^2 in
                    // float32 loses every digit of the variance here.
                    expect_forward_matches(torch::randn({rows, n}) * 1e-2 + 1e3, a, what + " offset 1e3");
                }
    });
}

TEST(LayerNormOp, LargeOffsetRowsMatchFloat64) {
    // Mean 1e3, std 1e-2 per row: against the LayerNorm of the same float32 inputs in float64, the fused
    // output is within what the float32 grid at the mean allows (ulp(1e3) = 6.1e-5 on a mean that the
    // shifted sum gets to about half an ulp, times rstd ~ 95) plus 1e-4 relative from the variance.
    torch::manual_seed(12);
    for (int64_t n : {7, 192, 768}) {
        const torch::Tensor x = torch::randn({64, n}) * 1e-2 + 1e3;
        const torch::Tensor y = linvis::ops::layer_norm(x, {n}, {}, {}, kEps, Impl::Fused).to(torch::kFloat64);
        const torch::Tensor x64 = x.to(torch::kFloat64);
        const torch::Tensor rstd = torch::rsqrt(x64.var(-1, false, true) + kEps);
        const torch::Tensor y64 = (x64 - x64.mean(-1, true)) * rstd;
        const torch::Tensor tol = rstd * 6.1e-5 + 1e-4 * y64.abs();
        const torch::Tensor err = (y - y64).abs();
        EXPECT_TRUE(torch::all(err <= tol).item<bool>()) << "n " << n << ": worst error/tolerance "
                                                         << (err / tol).max().item<double>();
    }
}

TEST(LayerNormOp, RowStridedAndBatchedInputs) {
    torch::manual_seed(13);
    // Rows 400 apart (a slice of the last dim), and a (2, 197, 192) batch.
    const torch::Tensor wide = torch::randn({197, 400});
    expect_forward_matches(wide.narrow(1, 8, 192), Affine{true, true}, "row stride 400");
    expect_forward_matches(torch::randn({2, 197, 192}), Affine{true, true}, "batch (2, 197, 192)");
    // Leading dims that collapse into one row stride with a size-1 dim between them.
    expect_forward_matches(torch::randn({3, 1, 5, 33}), Affine{true, false}, "(3, 1, 5, 33)");
}

// Gradients of x, weight and bias through the fused node vs torch::layer_norm's autograd.
TEST(LayerNormOp, GradientsMatchReference) {
    for_each_simd_target([](const SimdTarget& t) {
        torch::manual_seed(14);
        for (int64_t n : {7, 33, 192})
            for (int64_t rows : {3, 197})
                for (const Affine a : {Affine{true, true}, Affine{false, false}, Affine{true, false}}) {
                    const std::string what = std::string(t.env) + " rows " + std::to_string(rows) + " n " +
                                             std::to_string(n) + " weight " + std::to_string(a.weight);
                    const torch::Tensor x0 = torch::randn({rows, n}) * 1.5 + 0.3;
                    const torch::Tensor w0 = a.weight ? torch::randn({n}) * 0.5 + 1.0 : torch::Tensor();
                    const torch::Tensor b0 = a.bias ? torch::randn({n}) * 0.3 : torch::Tensor();
                    const torch::Tensor g = torch::randn({rows, n});
                    auto run = [&](bool fused) {
                        torch::Tensor x = x0.clone().requires_grad_(true);
                        torch::Tensor w = w0.defined() ? w0.clone().requires_grad_(true) : torch::Tensor();
                        torch::Tensor b = b0.defined() ? b0.clone().requires_grad_(true) : torch::Tensor();
                        torch::Tensor y = fused ? linvis::ops::layer_norm(x, {n}, w, b, kEps, Impl::Fused)
                                                : torch::layer_norm(x, {n}, w, b, kEps);
                        if (fused) {
                            EXPECT_NE(y.grad_fn()->name().find("FusedLayerNorm"), std::string::npos)
                                << what << ": " << y.grad_fn()->name();
                        }
                        (y * g).sum().backward();
                        return std::vector<torch::Tensor>{x.grad(), w.defined() ? w.grad() : torch::Tensor(),
                                                          b.defined() ? b.grad() : torch::Tensor()};
                    };
                    const auto ref = run(false);
                    const auto fused = run(true);
                    // The same backward (native_layer_norm_backward) on a mean and rstd that differ by the
                    // forward's sum errors (about u K relative, K = growth(n)); the weight and bias
                    // gradients sum over the rows (growth in rows).
                    const char* names[] = {"x", "weight", "bias"};
                    for (int i = 0; i < 3; ++i) {
                        ASSERT_EQ(fused[i].defined(), ref[i].defined()) << what << " " << names[i];
                        if (!ref[i].defined()) continue;
                        const double scale = ref[i].abs().max().item<double>();
                        const double tol = 4 * kU * (growth(n) + static_cast<double>(rows)) * scale;
                        const double err = (fused[i] - ref[i]).abs().max().item<double>();
                        EXPECT_LE(err, tol) << what << " d" << names[i] << " (max |grad| " << scale << ")";
                    }
                }
    });
}

TEST(LayerNormOp, DoubleBackwardMatchesReference) {
    // create_graph: the fused node's backward is native_layer_norm_backward, whose own derivative is
    // LibTorch's analytic double backward on the saved mean and rstd.
    torch::manual_seed(15);
    const torch::Tensor x0 = torch::randn({5, 33});
    const torch::Tensor w0 = torch::randn({33});
    auto run = [&](Impl impl) {
        torch::Tensor x = x0.clone().requires_grad_(true);
        torch::Tensor w = w0.clone().requires_grad_(true);
        torch::Tensor y = linvis::ops::layer_norm(x, {33}, w, {}, kEps, impl);
        torch::Tensor gx = torch::autograd::grad({(y * y * y).sum()}, {x}, {}, true, true)[0];
        gx.pow(2).sum().backward();
        return std::vector<torch::Tensor>{gx.detach(), x.grad(), w.grad()};
    };
    const auto ref = run(Impl::Reference);
    const auto fused = run(Impl::Fused);
    for (int i = 0; i < 3; ++i) {
        const double scale = ref[i].abs().max().item<double>();
        EXPECT_LE((fused[i] - ref[i]).abs().max().item<double>(), 1e-4 * scale) << i;
    }
}

TEST(LayerNormOp, InputsTheKernelDoesNotTakeRunTheReferenceUnderAuto) {
    torch::manual_seed(16);
    const torch::Tensor x = torch::randn({6, 4, 8});
    const torch::Tensor w = torch::randn({8}), b = torch::randn({8});
    struct Case {
        torch::Tensor x;
        std::vector<int64_t> shape;
        torch::Tensor w, b;
        const char* reason;  // a part of the Fused error
    };
    const std::vector<Case> cases = {
        {x.to(torch::kFloat64), {8}, w.to(torch::kFloat64), b.to(torch::kFloat64), "Double"},
        {x, {4, 8}, torch::randn({4, 8}), torch::randn({4, 8}), "the kernel normalises the last dim only"},
        {x.transpose(1, 2), {4}, torch::randn({4}), torch::randn({4}), "last dim is not contiguous"},
        {x.transpose(0, 1), {8}, w, b, "do not share one row stride"},
        {x, {8}, torch::randn({16}).slice(0, 0, 16, 2), b, "weight is not contiguous"},
        {x, {8}, w, torch::randn({16}).slice(0, 0, 16, 2), "bias is not contiguous"},
    };
    for (const Case& c : cases) {
        const torch::Tensor expected = torch::layer_norm(c.x, c.shape, c.w, c.b, kEps);
        const torch::Tensor got = linvis::ops::layer_norm(c.x, c.shape, c.w, c.b, kEps, Impl::Auto);
        EXPECT_TRUE(torch::equal(got, expected)) << c.reason;
        try {
            linvis::ops::layer_norm(c.x, c.shape, c.w, c.b, kEps, Impl::Fused);
            ADD_FAILURE() << "Fused took an input it should not: " << c.reason;
        } catch (const linvis::Error& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("layer_norm"), std::string::npos) << msg;
            EXPECT_NE(msg.find(c.reason), std::string::npos) << msg;
        }
    }
}

TEST(LayerNormOp, AutoIsFusedOnVectorTargetsAndReferenceOnScalar) {
    torch::manual_seed(17);
    const torch::Tensor x = torch::randn({197, 192}) * 3 + 1;
    const torch::Tensor w = torch::randn({192}), b = torch::randn({192});
    for_each_simd_target([&](const SimdTarget& t) {
        const torch::Tensor got = linvis::ops::layer_norm(x, {192}, w, b, kEps, Impl::Auto);
        const torch::Tensor same =
            linvis::ops::layer_norm(x, {192}, w, b, kEps, linvis::ops::simd::vectorised() ? Impl::Fused : Impl::Reference);
        EXPECT_TRUE(torch::equal(got, same)) << t.env;
        // nn::layer_norm (every model's LayerNorm) is ops::layer_norm under Auto; in a graph its node is the
        // fused one on the vector targets.
        EXPECT_TRUE(torch::equal(linvis::nn::layer_norm(x, {192}, w, b, kEps), same)) << t.env;
        const torch::Tensor leaf = x.clone().requires_grad_(true);
        const std::string node = linvis::nn::layer_norm(leaf, {192}, w, b, kEps).grad_fn()->name();
        EXPECT_EQ(node.find("FusedLayerNorm") != std::string::npos, linvis::ops::simd::vectorised()) << t.env << node;
    });
}

TEST(LayerNormOp, Bfloat16IsNormalisedInFloat32) {
    torch::manual_seed(18);
    const torch::Tensor x = (torch::randn({197, 192}) * 2).to(torch::kBFloat16);
    const torch::Tensor w = torch::randn({192}).to(torch::kBFloat16), b = torch::randn({192}).to(torch::kBFloat16);
    const torch::Tensor y = linvis::nn::layer_norm(x, {192}, w, b, kEps);
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
    const torch::Tensor expected =
        torch::layer_norm(x.to(torch::kFloat32), {192}, w.to(torch::kFloat32), b.to(torch::kFloat32), kEps);
    // One bf16 rounding of the float32 result (2^-8 relative) plus the float32 differences.
    EXPECT_TRUE(torch::allclose(y.to(torch::kFloat32), expected, 4e-3, 1e-4));
}

// ---------------------------------------------------------------- modulated_layer_norm (DiT's adaLN)

// shift and scale (B, C) as DiT's blocks have them: two of the six column chunks of one (B, 6C) product, so each
// is a strided view; scale around 0 (1 + scale the weight), shift a few tenths, different per sample.
struct Modulation {
    torch::Tensor shift, scale;
};

Modulation modulation_of(int64_t B, int64_t C) {
    const std::vector<torch::Tensor> m = (torch::randn({B, 6 * C}) * 0.4).chunk(6, 1);
    return {m[0], m[1]};
}

torch::Tensor official_modulate(const torch::Tensor& x, const Modulation& m) {
    return torch::layer_norm(x, {x.size(2)}, {}, {}, kEps) * (1 + m.scale.unsqueeze(1)) + m.shift.unsqueeze(1);
}

TEST(ModulatedLayerNorm, FusedMatchesTheOfficialModulateOnEveryTarget) {
    for_each_simd_target([](const SimdTarget& t) {
        torch::manual_seed(21);
        // (2, 256, 384): dit_s2 at L = 32; (3, 7, 33): samples of 7 rows, so one task's rows span three samples.
        for (const auto& shape : std::vector<std::vector<int64_t>>{{2, 256, 384}, {3, 7, 33}, {1, 1, 16}, {4, 5, 7}}) {
            const int64_t B = shape[0], C = shape[2];
            const torch::Tensor x = torch::randn(shape) * 2.0 + 0.5;
            const Modulation m = modulation_of(B, C);
            const torch::Tensor ref = official_modulate(x, m);
            const torch::Tensor fused = linvis::ops::modulated_layer_norm(x, m.shift, m.scale, kEps, Impl::Fused);
            ASSERT_EQ(fused.sizes(), x.sizes());
            for (int64_t b = 0; b < B; ++b) {
                // Per sample a LayerNorm with weight 1 + scale[b] and bias shift[b]: the LayerNorm's tolerance.
                const torch::Tensor err = (fused[b].to(torch::kFloat64) - ref[b].to(torch::kFloat64)).abs();
                const torch::Tensor tol = tolerance(x[b], 1 + m.scale[b], m.shift[b], ref[b]);
                EXPECT_TRUE(torch::all(err <= tol).item<bool>())
                    << t.env << " shape " << c10::str(x.sizes()) << " sample " << b << ": worst error/tolerance "
                    << (err / tol).max().item<double>();
            }
        }
    });
}

TEST(ModulatedLayerNorm, GradientsMatchTheOfficialModulate) {
    for_each_simd_target([](const SimdTarget& t) {
        torch::manual_seed(22);
        const int64_t B = 3, N = 11, C = 33;
        const torch::Tensor x0 = torch::randn({B, N, C}) * 1.5 + 0.3;
        const Modulation m0 = modulation_of(B, C);
        const torch::Tensor g = torch::randn({B, N, C});
        auto run = [&](Impl impl) {
            torch::Tensor x = x0.clone().requires_grad_(true);
            torch::Tensor shift = m0.shift.clone().requires_grad_(true), scale = m0.scale.clone().requires_grad_(true);
            torch::Tensor y = linvis::ops::modulated_layer_norm(x, shift, scale, kEps, impl);
            if (impl == Impl::Fused) {
                EXPECT_NE(y.grad_fn()->name().find("ModulatedLayerNorm"), std::string::npos) << y.grad_fn()->name();
            }
            (y * g).sum().backward();
            return std::vector<torch::Tensor>{x.grad(), shift.grad(), scale.grad()};
        };
        const auto ref = run(Impl::Reference);
        const auto fused = run(Impl::Fused);
        const char* names[] = {"x", "shift", "scale"};
        for (int i = 0; i < 3; ++i) {
            ASSERT_TRUE(fused[i].defined()) << names[i];
            // The LayerNorm gradients' bound, the shift and scale ones summed over a sample's N rows.
            const double tol = 4 * kU * (growth(C) + static_cast<double>(N)) * ref[i].abs().max().item<double>();
            EXPECT_LE((fused[i] - ref[i]).abs().max().item<double>(), tol) << t.env << " d" << names[i];
        }
    });
}

TEST(ModulatedLayerNorm, DoubleBackwardMatchesTheOfficialModulate) {
    // create_graph: the node's backward is then LibTorch's differentiable LayerNorm and native_layer_norm_backward.
    torch::manual_seed(24);
    const torch::Tensor x0 = torch::randn({2, 5, 33});
    const Modulation m0 = modulation_of(2, 33);
    auto run = [&](Impl impl) {
        torch::Tensor x = x0.clone().requires_grad_(true), scale = m0.scale.clone().requires_grad_(true);
        torch::Tensor y = linvis::ops::modulated_layer_norm(x, m0.shift, scale, kEps, impl);
        const auto g = torch::autograd::grad({(y * y * y).sum()}, {x, scale}, {}, true, true);
        (g[0].pow(2).sum() + g[1].pow(2).sum()).backward();
        return std::vector<torch::Tensor>{g[0].detach(), g[1].detach(), x.grad(), scale.grad()};
    };
    const auto ref = run(Impl::Reference);
    const auto fused = run(Impl::Fused);
    for (size_t i = 0; i < ref.size(); ++i) {
        const double scale = ref[i].abs().max().item<double>();
        EXPECT_LE((fused[i] - ref[i]).abs().max().item<double>(), 1e-4 * scale) << i;
    }
}

TEST(ModulatedLayerNorm, TheGraphKeepsTheInputButNotItsNormalisedCopy) {
    // dit_s2's batch of 2 at latent side 64: 1024 tokens of 384 (3 MiB per token-width tensor).
    torch::manual_seed(25);
    const int64_t B = 2, N = 1024, C = 384, width_bytes = B * N * C * 4;
    {  // The measurement sees tensors at all (a malloc that mallinfo2 does not describe would show nothing).
        const int64_t before = linvis::testing::heap_bytes_in_use();
        torch::Tensor probe = torch::empty({B, N, C});
        ASSERT_GE(linvis::testing::heap_bytes_in_use() - before, width_bytes - linvis::testing::kHeapNoiseBytes);
    }
    const torch::Tensor x = torch::randn({B, N, C}, torch::requires_grad());
    const Modulation m = modulation_of(B, C);
    const torch::Tensor shift = m.shift.detach().requires_grad_(true), scale = m.scale.detach().requires_grad_(true);
    auto kept = [&](Impl impl) {
        const int64_t before = linvis::testing::heap_bytes_in_use();
        const torch::Tensor y = linvis::ops::modulated_layer_norm(x, shift, scale, kEps, impl);
        return linvis::testing::heap_bytes_in_use() - before;
    };
    const int64_t reference = kept(Impl::Reference), fused = kept(Impl::Fused);
    // Both keep the output; the reference also the normalised x, the node only per-row statistics (8 bytes a row).
    EXPECT_GE(reference, 2 * width_bytes);
    EXPECT_LT(fused, width_bytes + width_bytes / 4);
}

TEST(ModulatedLayerNorm, AutoIsFusedOnVectorTargetsAndTheReferenceElsewhere) {
    torch::manual_seed(23);
    const torch::Tensor x = torch::randn({2, 9, 24}) * 3 + 1;
    const Modulation m = modulation_of(2, 24);
    for_each_simd_target([&](const SimdTarget& t) {
        const Impl expected = linvis::ops::simd::vectorised() ? Impl::Fused : Impl::Reference;
        EXPECT_TRUE(torch::equal(linvis::ops::modulated_layer_norm(x, m.shift, m.scale, kEps, Impl::Auto),
                                 linvis::ops::modulated_layer_norm(x, m.shift, m.scale, kEps, expected)))
            << t.env;
    });
    // Inputs the kernel does not take: the official ops under Auto, an error naming the reason under Fused.
    struct Case {
        torch::Tensor x;
        Modulation m;
        const char* reason;
    };
    const std::vector<Case> cases = {
        {x.to(torch::kFloat64), {m.shift.to(torch::kFloat64), m.scale.to(torch::kFloat64)}, "Double"},
        {x.transpose(1, 2).contiguous().transpose(1, 2), m, "last dim is not contiguous"},
        {x, {m.shift.to(torch::kFloat64), m.scale}, "shift is Double"},
    };
    for (const Case& c : cases) {
        const torch::Tensor expected = official_modulate(c.x, c.m);
        EXPECT_TRUE(torch::allclose(linvis::ops::modulated_layer_norm(c.x, c.m.shift, c.m.scale, kEps, Impl::Auto),
                                    expected))
            << c.reason;
        try {
            linvis::ops::modulated_layer_norm(c.x, c.m.shift, c.m.scale, kEps, Impl::Fused);
            ADD_FAILURE() << "Fused took an input it should not: " << c.reason;
        } catch (const linvis::Error& e) {
            EXPECT_NE(std::string(e.what()).find(c.reason), std::string::npos) << e.what();
        }
    }
}

TEST(ModulatedLayerNorm, BadShapesNameTheTensor) {
    const torch::Tensor x = torch::randn({2, 9, 24});
    const auto message = [&](const torch::Tensor& xx, const torch::Tensor& shift, const torch::Tensor& scale) {
        try {
            linvis::ops::modulated_layer_norm(xx, shift, scale, kEps);
        } catch (const linvis::Error& e) {
            return std::string(e.what());
        }
        return std::string("no error");
    };
    EXPECT_NE(message(x, torch::randn({2, 24}), torch::randn({3, 24})).find("scale: expected (2, 24), got [3, 24]"),
              std::string::npos);
    EXPECT_NE(message(x, torch::randn({2, 23}), torch::randn({2, 24})).find("shift: expected (2, 24)"),
              std::string::npos);
    EXPECT_NE(message(torch::randn({9, 24}), torch::randn({2, 24}), torch::randn({2, 24}))
                  .find("x: expected (B, N, C)"),
              std::string::npos);
}

}  // namespace
