// ops::gelu_, ops::silu_mul_, ops::gelu_linear and ops::gated_linear
// (include/linvis/ops/activation.h): the fused passes on every SIMD target this CPU runs against the exact
// function computed in float64, in place and with tails of every length; in a graph, LibTorch's gradients under
// every Impl; the dispatch (dtype, layout); the linear ops' gradients against the reference and what their graph
// keeps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "linvis/core/error.h"
#include "linvis/ops/activation.h"
#include "support/heap.h"
#include "support/simd_targets.h"
#include "support/testing.h"

namespace {

using linvis::ops::GeluForm;
using linvis::ops::Impl;
using linvis::testing::for_each_simd_target;
using linvis::testing::SimdTarget;

// The exact GELU of float32 inputs, in float64.
torch::Tensor exact_gelu(const torch::Tensor& x) { return torch::gelu(x.to(torch::kFloat64)); }

// Bound of the fused result: erf within 1.5e-7 (Abramowitz-Stegun 7.1.26) plus the float32 roundings of its
// evaluation (the polynomial, the exponential and 1 - P e: terms up to 1, about ten units of 6e-8 in all),
// scaled by |x| / 2, plus two roundings of the result. Seen: 4.7e-7 at x = 3.19, where the bound is 1.6e-6.
torch::Tensor bound(const torch::Tensor& x, const torch::Tensor& y) {
    const torch::Tensor ax = x.to(torch::kFloat64).abs();
    return ax * 0.5 * (1.5e-7 + 10 * 6e-8) + y.abs() * 2 * 6e-8 + 1e-30;
}

TEST(Activation, FusedMatchesExactGeluOnEveryTargetInPlace) {
    for_each_simd_target([](const SimdTarget&) {
        torch::manual_seed(3);
        // Lengths around the vector widths and the parallel block (16 Ki elements), values up to +-12
        // (exp(-a^2) underflows past |a| ~ 9.4) and exact zeros.
        for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{16}, int64_t{33}, int64_t{16384 + 5}, int64_t{197 * 771}}) {
            torch::Tensor x = torch::randn({n}) * 4;
            if (n > 3) {
                x[0] = 12.0f;
                x[1] = -12.0f;
                x[2] = 0.0f;
            }
            const torch::Tensor expected = exact_gelu(x);
            torch::Tensor y = x.clone();
            torch::Tensor out = linvis::ops::gelu_(y, Impl::Fused);
            EXPECT_TRUE(out.is_same(y)) << "n = " << n << ": not in place";
            const torch::Tensor err = (out.to(torch::kFloat64) - expected).abs();
            EXPECT_TRUE(torch::all(err <= bound(x, expected)).item<bool>())
                << "n = " << n << ": max error " << err.max().item<double>();
            EXPECT_FALSE(torch::any(torch::isnan(out)).item<bool>()) << "n = " << n;
        }
    });
}

// The reference is LibTorch's GELU, whose own error differs by version: LibTorch 2.15's AVX-512 erf GELU is 1.1e-6
// off float64 near x = -3.49 (GELU -8e-4), 1.13's within 1e-6; the absolute tolerance 2e-6 covers both.
TEST(Activation, AutoMatchesReferenceAndKeepsTheGraph) {
    torch::manual_seed(4);
    const torch::Tensor x = torch::randn({197, 768}) * 3;
    torch::Tensor reference = linvis::ops::gelu_(x.clone(), Impl::Reference);
    torch::Tensor automatic = linvis::ops::gelu_(x.clone(), Impl::Auto);
    EXPECT_TRUE(torch::allclose(automatic, reference, 1e-6, 2e-6));
    // Where autograd records x, every Impl gives a new tensor with torch::gelu's gradient.
    for (Impl impl : {Impl::Auto, Impl::Reference, Impl::Fused}) {
        torch::Tensor leaf = x.clone().requires_grad_(true);
        torch::Tensor y = linvis::ops::gelu_(leaf * 1.0, impl);
        EXPECT_TRUE(torch::allclose(y, torch::gelu(x), 1e-6, 2e-6)) << linvis::ops::impl_name(impl);
        (y * y).sum().backward();
        torch::Tensor leaf2 = x.clone().requires_grad_(true);
        torch::Tensor y2 = torch::gelu(leaf2);
        (y2 * y2).sum().backward();
        EXPECT_TRUE(torch::allclose(leaf.grad(), leaf2.grad(), 1e-5, 1e-6)) << linvis::ops::impl_name(impl);
    }
}

TEST(Activation, InputsTheKernelDoesNotTakeRunTheReferenceUnderAuto) {
    torch::manual_seed(5);
    const torch::Tensor x = torch::randn({64, 48});
    // Not contiguous: a transposed view; float64.
    for (const torch::Tensor& t : {x.t(), x.to(torch::kFloat64)}) {
        const torch::Tensor expected = torch::gelu(t);
        EXPECT_TRUE(torch::allclose(linvis::ops::gelu_(t.clone(), Impl::Auto).to(torch::kFloat64),
                                    expected.to(torch::kFloat64), 1e-6, 1e-7));
        EXPECT_THROW(linvis::ops::gelu_(t.clone(), Impl::Fused), linvis::Error);
    }
}

// Which path Auto takes for the erf form of a tensor beyond AVX-512's limit of 2^18 elements: the pass on AVX2
// (faster there at every size), LibTorch's GELU on AVX-512 (docs/ops.md), in float32 and bfloat16. The two paths
// differ in the last bit of some float32 values, so bitwise equality names the path. In bfloat16 both round the
// float32 result once, and a last-bit difference survives only where it straddles a rounding boundary: random
// inputs gave none on a Zen 4 EPYC, so the bfloat16 input holds every bfloat16 value in [-16, 16] (about 33,000),
// repeated.
TEST(Activation, AutoPathForALargeErfGeluFollowsTheTarget) {
    torch::manual_seed(6);
    const torch::Tensor patterns = torch::arange(-32768, 32768, torch::kInt32).to(torch::kInt16).view(torch::kBFloat16);
    const torch::Tensor every_bf16 = patterns.masked_select(patterns.to(torch::kFloat32).abs() <= 16);
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
        const int64_t n = 683 * 768;  // 524,544 elements
        const torch::Tensor x = dtype == torch::kFloat32
                                    ? torch::randn({n}) * 3
                                    : every_bf16.repeat({n / every_bf16.numel() + 1}).narrow(0, 0, n);
        for_each_simd_target([&](const SimdTarget& t) {
            if (t.target == linvis::ops::simd::Target::Scalar) return;
            const std::string what = std::string(t.env) + " " + c10::toString(dtype);
            const torch::Tensor automatic = linvis::ops::gelu_(x.clone(), Impl::Auto);
            const torch::Tensor fused = linvis::ops::gelu_(x.clone(), Impl::Fused);
            const torch::Tensor reference = linvis::ops::gelu_(x.clone(), Impl::Reference);
            ASSERT_FALSE(torch::equal(fused, reference)) << what << ": the paths agree bit for bit";
            const bool pass_expected = t.target == linvis::ops::simd::Target::Avx2;
            EXPECT_TRUE(torch::equal(automatic, pass_expected ? fused : reference)) << what;
        });
    }
}

// bfloat16: the float32 pass on the widened values, rounded once, bit for bit, on every target; sizes across
// the 512-value chunks of the widening (and the 16 Ki blocks of the threads).
// Under Auto the vectorised targets take the pass; mixed dtypes run the reference under Auto and are an error
// under Fused; in a graph the gradient reaches the bfloat16 leaves.
TEST(Activation, Bfloat16IsTheFloat32PassRoundedOnceOnEveryTarget) {
    for_each_simd_target([](const SimdTarget& t) {
        torch::manual_seed(9);
        for (int64_t n : {int64_t{1}, int64_t{511}, int64_t{513}, int64_t{16384 + 700}}) {
            const torch::Tensor x = (torch::randn({n}) * 4).to(torch::kBFloat16);
            const torch::Tensor u = torch::randn({n}).to(torch::kBFloat16);
            const torch::Tensor xf = x.to(torch::kFloat32), uf = u.to(torch::kFloat32);
            for (GeluForm form : {GeluForm::Erf, GeluForm::Tanh}) {
                torch::Tensor y = linvis::ops::gelu_(x.clone(), Impl::Fused, form);
                EXPECT_TRUE(torch::equal(y, linvis::ops::gelu_(xf.clone(), Impl::Fused, form).to(torch::kBFloat16)))
                    << t.env << ", gelu, n = " << n;
            }
            torch::Tensor s = linvis::ops::silu_mul_(x.clone(), u, Impl::Fused);
            EXPECT_EQ(s.scalar_type(), torch::kBFloat16);
            EXPECT_TRUE(torch::equal(s, linvis::ops::silu_mul_(xf.clone(), uf, Impl::Fused).to(torch::kBFloat16)))
                << t.env << ", silu_mul, n = " << n;
            const bool vectorised = t.target != linvis::ops::simd::Target::Scalar;
            EXPECT_TRUE(torch::equal(linvis::ops::silu_mul_(x.clone(), u, Impl::Auto), vectorised ? s : torch::silu(x) * u))
                << t.env << ", silu_mul under Auto, n = " << n;
        }
    });
    const torch::Tensor g = torch::randn({64, 48}).to(torch::kBFloat16), u = torch::randn({64, 48});
    EXPECT_THROW(linvis::ops::silu_mul_(g.clone(), u, Impl::Fused), linvis::Error);
    EXPECT_TRUE(torch::equal(linvis::ops::silu_mul_(g.clone(), u, Impl::Auto), torch::silu(g).mul_(u)));
    torch::Tensor leaf = g.clone().requires_grad_(true);
    linvis::ops::silu_mul_(leaf * 1.0, g, Impl::Fused).sum().backward();
    EXPECT_EQ(leaf.grad().scalar_type(), torch::kBFloat16);
}

// The tanh form and silu(g) * u: within a few float32 roundings of the float64 functions (Highway's Tanh and
// Exp are within a few units in the last place; the products add a rounding each).
TEST(Activation, GeluTanhAndSiluMulMatchFloat64OnEveryTarget) {
    for_each_simd_target([](const SimdTarget&) {
        torch::manual_seed(6);
        for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16384 + 3}, int64_t{197 * 513}}) {
            torch::Tensor x = torch::randn({n}) * 4;
            torch::Tensor u = torch::randn({n}) * 2;
            if (n > 3) {
                x[0] = 100.0f;
                x[1] = -100.0f;
                x[2] = 0.0f;
            }
            const torch::Tensor x64 = x.to(torch::kFloat64), u64 = u.to(torch::kFloat64);
            const torch::Tensor tanh_expected = torch::gelu(x64, "tanh");
            torch::Tensor g = linvis::ops::gelu_(x.clone(), Impl::Fused, GeluForm::Tanh);
            torch::Tensor err = (g.to(torch::kFloat64) - tanh_expected).abs();
            EXPECT_TRUE(torch::all(err <= x64.abs() * 6e-7 + 1e-30).item<bool>())
                << "gelu tanh, n = " << n << ": max error " << err.max().item<double>();
            const torch::Tensor silu_expected = torch::silu(x64) * u64;
            torch::Tensor gate = x.clone();
            torch::Tensor s = linvis::ops::silu_mul_(gate, u, Impl::Fused);
            EXPECT_TRUE(s.is_same(gate)) << "silu_mul_, n = " << n << ": not into gate";
            err = (s.to(torch::kFloat64) - silu_expected).abs();
            EXPECT_TRUE(torch::all(err <= (x64 * u64).abs() * 6e-7 + 1e-30).item<bool>())
                << "silu_mul, n = " << n << ": max error " << err.max().item<double>();
            EXPECT_FALSE(torch::any(torch::isnan(g)).item<bool>() || torch::any(torch::isnan(s)).item<bool>());
        }
    });
}

TEST(Activation, SiluMulGradientsUnderEveryImpl) {
    torch::manual_seed(7);
    const torch::Tensor g0 = torch::randn({197, 64}) * 3, u0 = torch::randn({197, 64});
    torch::Tensor g_ref = g0.clone().requires_grad_(true), u_ref = u0.clone().requires_grad_(true);
    torch::Tensor y_ref = torch::silu(g_ref) * u_ref;
    (y_ref * y_ref).sum().backward();
    for (Impl impl : {Impl::Auto, Impl::Reference, Impl::Fused}) {
        torch::Tensor g = g0.clone().requires_grad_(true), u = u0.clone().requires_grad_(true);
        torch::Tensor y = linvis::ops::silu_mul_(g * 1.0, u * 1.0, impl);
        EXPECT_TRUE(torch::allclose(y, y_ref, 1e-5, 1e-6)) << linvis::ops::impl_name(impl);
        (y * y).sum().backward();
        EXPECT_TRUE(torch::allclose(g.grad(), g_ref.grad(), 1e-5, 1e-6)) << linvis::ops::impl_name(impl);
        EXPECT_TRUE(torch::allclose(u.grad(), u_ref.grad(), 1e-5, 1e-6)) << linvis::ops::impl_name(impl);
    }
    // Only one operand needing a gradient; shapes that differ are an error naming both.
    torch::Tensor u = u0.clone().requires_grad_(true);
    linvis::ops::silu_mul_(g0.clone(), u * 1.0, Impl::Fused).sum().backward();
    EXPECT_TRUE(torch::allclose(u.grad(), torch::silu(g0), 1e-5, 1e-6));
    EXPECT_THROW(linvis::ops::silu_mul_(g0.clone(), u0.narrow(0, 0, 5), Impl::Auto), linvis::Error);
}

TEST(Activation, GeluTanhGradientInAGraph) {
    torch::manual_seed(8);
    const torch::Tensor x = torch::randn({33, 65}) * 3;
    torch::Tensor a = x.clone().requires_grad_(true), b = x.clone().requires_grad_(true);
    linvis::ops::gelu_(a * 1.0, Impl::Fused, GeluForm::Tanh).pow(2).sum().backward();
    torch::gelu(b, "tanh").pow(2).sum().backward();
    EXPECT_TRUE(torch::allclose(a.grad(), b.grad(), 1e-5, 1e-6));
}

}  // namespace

// ---- ops::gelu_linear and ops::gated_linear: an activation and the linear layer after it as one op.

namespace activation_linear {

using linvis::ops::GateActivation;
using linvis::ops::GeluForm;
using linvis::ops::Impl;
using linvis::testing::for_each_simd_target;
using linvis::testing::SimdTarget;

using linvis::testing::heap_bytes_in_use;
using linvis::testing::kHeapNoiseBytes;

struct Grads {
    torch::Tensor y, dh, du, dw, db;
};

// y = op(h [, u]) and the gradients of sum(y * r) for a fixed r, every input a leaf.
template <typename Op>
Grads run(const torch::Tensor& h0, const torch::Tensor& u0, const torch::Tensor& w0, const torch::Tensor& b0, Op op) {
    torch::manual_seed(11);
    torch::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    torch::Tensor u = u0.defined() ? u0.clone().requires_grad_(true) : torch::Tensor();
    torch::Tensor b = b0.defined() ? b0.clone().requires_grad_(true) : torch::Tensor();
    torch::Tensor y = op(h * 1.0, u.defined() ? u * 1.0 : u, w, b);
    (y * torch::randn(y.sizes()).to(y.scalar_type())).sum().backward();
    return {y.detach(), h.grad(), u.defined() ? u.grad() : u, w.grad(), b.defined() ? b.grad() : b};
}

// atol is relative to each tensor's largest value (at least 1): the products and the weight's gradient (a sum over
// 394 rows, values up to about 100) sum terms of both signs in another order on each path, and a cancelled sum
// keeps the absolute error of its terms (2.9e-5 against LibTorch 2.15's MKL products).
void expect_close(const Grads& a, const Grads& e, double rtol, double atol, const std::string& what) {
    const auto close = [&](const torch::Tensor& got, const torch::Tensor& want) {
        const double scale = std::max(1.0, want.abs().max().item<double>());
        return linvis::testing::all_close(got, want, rtol, atol * scale);
    };
    EXPECT_TRUE(close(a.y, e.y)) << what << ": output";
    EXPECT_TRUE(close(a.dh, e.dh)) << what << ": d gate / h";
    EXPECT_TRUE(close(a.dw, e.dw)) << what << ": d weight";
    if (e.du.defined()) EXPECT_TRUE(close(a.du, e.du)) << what << ": d up";
    if (e.db.defined()) EXPECT_TRUE(close(a.db, e.db)) << what << ": d bias";
}

TEST(ActivationLinear, ForwardAndGradientsMatchTheReferenceOnEveryTarget) {
    torch::manual_seed(12);
    // 197 rows (a ViT's tokens and a tail), hidden 96 -> 40 outputs.
    const torch::Tensor h = torch::randn({2, 197, 96}) * 2, u = torch::randn({2, 197, 96});
    const torch::Tensor w = torch::randn({40, 96}) * 0.1, b = torch::randn({40});
    for (GeluForm form : {GeluForm::Erf, GeluForm::Tanh}) {
        for (const torch::Tensor& bias : {b, torch::Tensor()}) {
            auto gelu = [&](Impl impl) {
                return [=](const torch::Tensor& x, const torch::Tensor&, const torch::Tensor& wt, const torch::Tensor& bt) {
                    return linvis::ops::gelu_linear(x, wt, bt, form, impl);
                };
            };
            const Grads ref = run(h, {}, w, bias, gelu(Impl::Reference));
            for_each_simd_target([&](const SimdTarget& t) {
                for (Impl impl : {Impl::Auto, Impl::Fused})
                    expect_close(run(h, {}, w, bias, gelu(impl)), ref, 1e-5, 1e-5,
                                 std::string("gelu_linear ") + (form == GeluForm::Tanh ? "tanh " : "erf ") +
                                     (bias.defined() ? "bias " : "no bias ") + t.env + " " + linvis::ops::impl_name(impl));
            });
        }
    }
    auto gated = [](Impl impl, GateActivation act) {
        return [=](const torch::Tensor& g, const torch::Tensor& up, const torch::Tensor& wt, const torch::Tensor& bt) {
            return linvis::ops::gated_linear(g, up, wt, bt, act, impl);
        };
    };
    for (GateActivation act : {GateActivation::Silu, GateActivation::GeluTanh}) {
        const Grads ref = run(h, u, w, b, gated(Impl::Reference, act));
        for_each_simd_target([&](const SimdTarget& t) {
            for (Impl impl : {Impl::Auto, Impl::Fused})
                expect_close(run(h, u, w, b, gated(impl, act)), ref, 1e-5, 1e-5,
                             std::string("gated_linear ") + (act == GateActivation::Silu ? "silu " : "gelu tanh ") +
                                 t.env + " " + linvis::ops::impl_name(impl));
        });
    }
    const auto swiglu = [&](Impl impl) { return gated(impl, GateActivation::Silu); };
    const Grads ref = run(h, u, w, b, swiglu(Impl::Reference));
    // bf16: the same op in bf16 against the float32 reference. Operands, hidden layer, products and gradients are
    // each rounded to bf16 (2^-8 relative) a few times on every path, and sums of terms of both signs (the
    // weight's gradient over 394 rows) cancel, so the bound is relative to each tensor's largest value: 3e-2.
    const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
    Grads low = run(bf(h), bf(u), bf(w), bf(b), swiglu(Impl::Auto));
    const std::pair<torch::Tensor*, const torch::Tensor*> pairs[] = {
        {&low.y, &ref.y}, {&low.dh, &ref.dh}, {&low.du, &ref.du}, {&low.dw, &ref.dw}, {&low.db, &ref.db}};
    for (const auto& [got, want] : pairs) {
        ASSERT_EQ(got->scalar_type(), torch::kBFloat16);
        const double scale = want->abs().max().item<double>();
        EXPECT_TRUE(linvis::testing::all_close(got->to(torch::kFloat32), *want, 0.0, 3e-2 * scale))
            << "gated_linear (silu) bf16";
    }
}

TEST(ActivationLinear, OutsideAGraphTheActivationGoesIntoTheHiddenLayer) {
    torch::manual_seed(13);
    const torch::Tensor h = torch::randn({64, 48}), w = torch::randn({16, 48}), b = torch::randn({16});
    torch::Tensor hidden = h.clone();
    const torch::Tensor y = linvis::ops::gelu_linear(hidden, w, b, GeluForm::Erf, Impl::Fused);
    EXPECT_TRUE(linvis::testing::all_close(hidden, torch::gelu(h), 1e-6, 1e-6)) << "not in place";
    EXPECT_TRUE(linvis::testing::all_close(y, torch::addmm(b, torch::gelu(h), w.t()), 1e-5, 1e-5));
    EXPECT_THROW(linvis::ops::gated_linear(h.clone(), h.narrow(0, 0, 5), w, b, GateActivation::Silu), linvis::Error);
}

TEST(ActivationLinear, DoubleBackwardMatchesTheReference) {
    torch::manual_seed(14);
    const torch::Tensor h0 = torch::randn({9, 12}), u0 = torch::randn({9, 12}), w0 = torch::randn({5, 12});
    auto second = [&](bool swiglu, Impl impl) {
        torch::Tensor h = h0.clone().requires_grad_(true), u = u0.clone().requires_grad_(true);
        torch::Tensor w = w0.clone().requires_grad_(true);
        torch::Tensor y = swiglu ? linvis::ops::gated_linear(h * 1.0, u * 1.0, w, {}, GateActivation::Silu, impl)
                                 : linvis::ops::gelu_linear(h * 1.0, w, {}, GeluForm::Tanh, impl);
        const auto g = torch::autograd::grad({y.pow(2).sum()}, {h, w}, {}, true, true);
        (g[0].pow(2).sum() + g[1].pow(2).sum()).backward();
        return std::make_pair(h.grad(), w.grad());
    };
    for (bool swiglu : {false, true}) {
        const auto ref = second(swiglu, Impl::Reference), got = second(swiglu, Impl::Fused);
        EXPECT_TRUE(linvis::testing::all_close(got.first, ref.first, 1e-4, 1e-5)) << (swiglu ? "silu_mul" : "gelu");
        EXPECT_TRUE(linvis::testing::all_close(got.second, ref.second, 1e-4, 1e-5)) << (swiglu ? "silu_mul" : "gelu");
    }
}

// Bytes the graph of y = op(hidden...) keeps beyond its inputs (which exist before the call).
template <typename Op>
int64_t bytes_kept(Op op) {
    const int64_t before = heap_bytes_in_use();
    torch::Tensor y = op();
    return heap_bytes_in_use() - before;
}

TEST(ActivationLinear, TheGraphKeepsTheHiddenLayerButNotItsActivation) {
    // A ViT-T MLP at 1024 px: 4096 tokens, hidden 768 (12 MiB per hidden-size tensor), output 192 (3 MiB).
    torch::manual_seed(15);
    const int64_t T = 4096, H = 768, D = 192, hidden_bytes = T * H * 4, out_bytes = T * D * 4;
    torch::Tensor x = torch::randn({T, H}, torch::requires_grad());
    torch::Tensor w = (torch::randn({D, H}) * 0.02).requires_grad_(true), b = torch::zeros({D}, torch::requires_grad());
    {   // The measurement sees tensors at all (a malloc that mallinfo2 does not describe would show nothing).
        const int64_t before = heap_bytes_in_use();
        torch::Tensor probe = torch::empty({T, H});
        ASSERT_GE(heap_bytes_in_use() - before, hidden_bytes - kHeapNoiseBytes);
    }
    for (bool swiglu : {false, true}) {
        torch::Tensor h = x * 1.0, u = x * 0.5;
        auto op = [&](Impl impl) {
            return [&, impl] {
                return swiglu ? linvis::ops::gated_linear(h, u, w, b, GateActivation::Silu, impl)
                              : linvis::ops::gelu_linear(h, w, b, GeluForm::Erf, impl);
            };
        };
        const int64_t reference = bytes_kept(op(Impl::Reference)), fused = bytes_kept(op(Impl::Auto));
        const char* what = swiglu ? "gated_linear" : "gelu_linear";
        // The reference keeps the activation (hidden size) and the output; the fused node only the output.
        EXPECT_GE(reference, hidden_bytes + out_bytes) << what;
        EXPECT_LT(fused, out_bytes + hidden_bytes / 4) << what;
    }
}

}  // namespace activation_linear
