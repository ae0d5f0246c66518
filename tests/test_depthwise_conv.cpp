// The fused depthwise convolutions on tokens (src/ops/depthwise_conv/cpu.cpp) against their reference
// (LibTorch's grouped convolution with autograd): outputs and the gradients of x, weight and bias, the
// float32 kernel against the float64 reference; the three epilogues of the 3x3 conv, with and without
// bias; strided input (a chunk of a wider projection, read without a copy); odd grids (1xN, Nx1, 3x5);
// k = 1..5 for the causal 1D conv; B = 2; on every LINVIS_SIMD target this CPU runs. Also: dispatch
// (Auto, Fused errors on float64 / bfloat16), shape errors, FLOP counts and determinism over thread counts.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/depthwise_conv.h"
#include "support/simd_targets.h"
#include "support/testing.h"

namespace {

using linvis::ops::causal_depthwise_conv1d_tokens;
using linvis::ops::depthwise_conv2d_tokens;
using linvis::ops::DwEpilogue;
using linvis::ops::Impl;
using linvis::testing::all_close;
using torch::Tensor;

const char* name_of(DwEpilogue e) {
    switch (e) {
        case DwEpilogue::None: return "none";
        case DwEpilogue::Residual: return "residual";
        case DwEpilogue::Silu: return "silu";
    }
    return "?";
}

struct Grads {
    Tensor out, dx, dw, db;
};

// out = f(x, w, b) and the gradients of sum(out * probe); x is used as given (a view keeps its strides).
template <typename F>
Grads run(const Tensor& x_base, const Tensor& w0, const Tensor& b0, const Tensor& probe, torch::ScalarType type, F f) {
    Tensor leaf = x_base.to(type).detach().requires_grad_(true);
    Tensor w = w0.to(type).detach().requires_grad_(true);
    Tensor b = b0.defined() ? b0.to(type).detach().requires_grad_(true) : Tensor();
    Tensor out = f(leaf, w, b);
    (out * probe.to(type)).sum().backward();
    return {out.detach(), leaf.grad(), w.grad(), b.defined() ? b.grad() : Tensor()};
}

// The fused kernel against the float64 reference: float32 (rtol 1e-4; weight / bias gradients sum
// over every token, atol 1e-4) or float64 (rtol 1e-10: only the summation order differs).
void expect_close(const Grads& fused, const Grads& ref, const std::string& where_) {
    const bool f64 = fused.out.scalar_type() == torch::kFloat64;
    const std::string where = where_ + (f64 ? " float64" : " float32");
    const double rtol = f64 ? 1e-10 : 1e-4, atol = f64 ? 1e-12 : 1e-5, atol_sum = f64 ? 1e-11 : 1e-4;
    EXPECT_TRUE(fused.out.is_contiguous()) << where;
    EXPECT_TRUE(all_close(fused.out, ref.out, rtol, atol)) << "out " << where;
    EXPECT_TRUE(all_close(fused.dx, ref.dx, rtol, atol)) << "dx " << where;
    EXPECT_TRUE(all_close(fused.dw, ref.dw, rtol, atol_sum)) << "dw " << where;
    ASSERT_EQ(fused.db.defined(), ref.db.defined()) << where;
    if (ref.db.defined()) EXPECT_TRUE(all_close(fused.db, ref.db, rtol, atol_sum)) << "db " << where;
}

struct Grid {
    int64_t H, W;
};
const Grid kGrids[] = {{1, 7}, {6, 1}, {3, 5}, {8, 8}, {20, 19}};

void compare_2d(const Grid& g, int64_t C, DwEpilogue epi, bool with_bias, bool strided) {
    const int64_t B = 2, T = g.H * g.W;
    torch::manual_seed(T * 31 + C);
    // The strided case keeps the view: the leaf is the wide tensor's chunk, as ViL's x_mlstm.
    Tensor wide = torch::randn({B, T, 2 * C + 3}, torch::kFloat64);
    Tensor base = torch::randn({B, T, C}, torch::kFloat64);
    Tensor w = torch::randn({C, 1, 3, 3}, torch::kFloat64) * 0.5, b = with_bias ? torch::randn({C}, torch::kFloat64) : Tensor();
    Tensor probe = torch::randn({B, T, C}, torch::kFloat64);
    auto f = [&](Impl impl) {
        return [&, impl](const Tensor& leaf, const Tensor& wt, const Tensor& bt) {
            return depthwise_conv2d_tokens(leaf, g.H, g.W, wt, bt, epi, impl);
        };
    };
    Grads ref, fused, fused64;
    if (strided) {
        // Gradients w.r.t. the wide tensor: the chunk's gradient lands in its columns, zero elsewhere.
        auto chunked = [&](Impl impl, torch::ScalarType type) {
            return run(wide, w, b, probe, type, [&](const Tensor& leaf, const Tensor& wt, const Tensor& bt) {
                Tensor x = leaf.narrow(2, 1, C);
                EXPECT_FALSE(x.is_contiguous());
                return depthwise_conv2d_tokens(x, g.H, g.W, wt, bt, epi, impl);
            });
        };
        ref = chunked(Impl::Reference, torch::kFloat64);
        fused = chunked(Impl::Fused, torch::kFloat32);
        fused64 = chunked(Impl::Fused, torch::kFloat64);
    } else {
        ref = run(base, w, b, probe, torch::kFloat64, f(Impl::Reference));
        fused = run(base, w, b, probe, torch::kFloat32, f(Impl::Fused));
        fused64 = run(base, w, b, probe, torch::kFloat64, f(Impl::Fused));
    }
    const std::string where = std::to_string(g.H) + "x" + std::to_string(g.W) + " C" + std::to_string(C) + " " +
                              name_of(epi) + (with_bias ? " bias" : " no bias") + (strided ? " strided" : "");
    expect_close(fused, ref, where);
    expect_close(fused64, ref, where);
}

void all_2d_cases() {
    for (const Grid& g : kGrids)
        for (DwEpilogue epi : {DwEpilogue::None, DwEpilogue::Residual, DwEpilogue::Silu})
            for (int64_t C : {5, 37})
                compare_2d(g, C, epi, /*with_bias=*/C == 37, /*strided=*/g.H == 3 || g.H == 20);
    compare_2d({4, 6}, 16, DwEpilogue::Silu, true, true);
    compare_2d({4, 6}, 16, DwEpilogue::Residual, false, true);
}

void compare_1d(int64_t T, int64_t C, int64_t k, bool with_bias, bool strided) {
    const int64_t B = 2;
    torch::manual_seed(T * 131 + C * 7 + k);
    Tensor wide = torch::randn({B, T, 2 * C + 3}, torch::kFloat64);
    Tensor base = torch::randn({B, T, C}, torch::kFloat64);
    Tensor w = torch::randn({C, 1, k}, torch::kFloat64), b = with_bias ? torch::randn({C}, torch::kFloat64) : Tensor();
    Tensor probe = torch::randn({B, T, C}, torch::kFloat64);
    auto go = [&](Impl impl, torch::ScalarType type) {
        return run(strided ? wide : base, w, b, probe, type, [&](const Tensor& leaf, const Tensor& wt, const Tensor& bt) {
            return causal_depthwise_conv1d_tokens(strided ? leaf.narrow(2, 1, C) : leaf, wt, bt, impl);
        });
    };
    const Grads ref = go(Impl::Reference, torch::kFloat64);
    const std::string where = "T" + std::to_string(T) + " C" + std::to_string(C) + " k" + std::to_string(k) +
                              (with_bias ? " bias" : " no bias") + (strided ? " strided" : "");
    expect_close(go(Impl::Fused, torch::kFloat32), ref, where);
    expect_close(go(Impl::Fused, torch::kFloat64), ref, where);
}

void all_1d_cases() {
    for (int64_t k = 1; k <= 5; ++k)
        for (int64_t T : {1, 3, 50, 300}) compare_1d(T, k == 4 ? 48 : 7, k, /*with_bias=*/k != 2, /*strided=*/T == 50);
}

TEST(DepthwiseConv, Conv2dFusedMatchesReferenceOnEveryTarget) {
    linvis::testing::for_each_simd_target([](const linvis::testing::SimdTarget&) { all_2d_cases(); });
}

TEST(DepthwiseConv, CausalConv1dFusedMatchesReferenceOnEveryTarget) {
    linvis::testing::for_each_simd_target([](const linvis::testing::SimdTarget&) { all_1d_cases(); });
}

// The reference itself is LibTorch's convolution: a finite-difference check of its float64 gradients
// anchors what the fused kernel is compared with (small shapes).
TEST(DepthwiseConv, ReferenceGradientsMatchFiniteDifferences) {
    torch::manual_seed(3);
    auto opts = torch::dtype(torch::kFloat64).requires_grad(true);
    Tensor x = torch::randn({2, 6, 3}, opts), w = torch::randn({3, 1, 3, 3}, opts), b = torch::randn({3}, opts);
    EXPECT_TRUE(linvis::testing::gradcheck(
        [](const std::vector<Tensor>& in) {
            return depthwise_conv2d_tokens(in[0], 2, 3, in[1], in[2], DwEpilogue::Silu, Impl::Reference);
        },
        {x, w, b}));
    Tensor w1 = torch::randn({3, 1, 3}, opts);
    EXPECT_TRUE(linvis::testing::gradcheck(
        [](const std::vector<Tensor>& in) { return causal_depthwise_conv1d_tokens(in[0], in[1], in[2], Impl::Reference); },
        {x, w1, b}));
}

// The causal convolution is what Vision-TTT's causal_conv computed: conv1d with padding k-1, first T outputs,
// written out here by its definition.
TEST(DepthwiseConv, CausalConv1dIsTheDefinition) {
    torch::manual_seed(5);
    const int64_t B = 2, T = 9, C = 4, k = 4;
    Tensor x = torch::randn({B, T, C}), w = torch::randn({C, 1, k}), b = torch::randn({C});
    Tensor expected = b.expand({B, T, C}).clone();
    for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < k; ++s) {
            const int64_t ts = t - (k - 1) + s;
            if (ts >= 0) expected.select(1, t).add_(w.select(2, s).squeeze(1) * x.select(1, ts));
        }
    for (Impl impl : {Impl::Reference, Impl::Fused})
        EXPECT_TRUE(all_close(causal_depthwise_conv1d_tokens(x, w, b, impl), expected, 1e-5, 1e-5)) << linvis::ops::impl_name(impl);
}

// Without a graph (inference) the fused kernels take the no-autograd path; same values as with one.
TEST(DepthwiseConv, InferencePathEqualsTrainingPath) {
    torch::manual_seed(6);
    Tensor x = torch::randn({2, 35, 24}), w = torch::randn({24, 1, 3, 3}), b = torch::randn({24});
    Tensor w1 = torch::randn({24, 1, 4});
    for (DwEpilogue epi : {DwEpilogue::None, DwEpilogue::Residual, DwEpilogue::Silu}) {
        Tensor with_graph = depthwise_conv2d_tokens(x, 5, 7, w.clone().requires_grad_(), b, epi, Impl::Fused);
        EXPECT_TRUE(with_graph.requires_grad());
        torch::NoGradGuard no_grad;
        Tensor plain = depthwise_conv2d_tokens(x, 5, 7, w, b, epi, Impl::Fused);
        EXPECT_FALSE(plain.requires_grad());
        EXPECT_TRUE(torch::equal(plain, with_graph.detach())) << name_of(epi);
    }
    Tensor with_graph = causal_depthwise_conv1d_tokens(x, w1.clone().requires_grad_(), b, Impl::Fused);
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(causal_depthwise_conv1d_tokens(x, w1, b, Impl::Fused), with_graph.detach()));
}

// The heads form is the token form's channels split into heads: the same values on every path and target,
// head-major memory on the fused path without a graph (what the TTT-Linear scan reads), and in a graph the
// token form's gradients.
TEST(DepthwiseConv, CausalConv1dInHeadsIsTheTokenFormSplitIntoHeads) {
    using linvis::ops::causal_depthwise_conv1d_heads;
    torch::manual_seed(8);
    const int64_t B = 2, T = 37, C = 24, heads = 3;
    const Tensor x = torch::randn({B, T, C}), w = torch::randn({C, 1, 4}), b = torch::randn({C});
    const Tensor split = causal_depthwise_conv1d_tokens(x, w, b, Impl::Reference).view({B, T, heads, C / heads})
                             .permute({0, 2, 1, 3});
    linvis::testing::for_each_simd_target([&](const linvis::testing::SimdTarget& target) {
        for (Impl impl : {Impl::Reference, Impl::Fused}) {
            torch::NoGradGuard no_grad;
            const Tensor out = causal_depthwise_conv1d_heads(x, w, b, heads, impl);
            EXPECT_EQ(out.sizes(), split.sizes());
            EXPECT_TRUE(all_close(out, split, 1e-5, 1e-5)) << target.env << " " << linvis::ops::impl_name(impl);
            if (impl == Impl::Fused) EXPECT_TRUE(out.is_contiguous()) << target.env;
        }
        const Tensor wg = w.clone().requires_grad_(), xg = x.clone().requires_grad_();
        const Tensor probe = torch::randn({B, heads, T, C / heads});
        (causal_depthwise_conv1d_heads(xg, wg, b, heads, Impl::Fused) * probe).sum().backward();
        const Tensor w2 = w.clone().requires_grad_(), x2 = x.clone().requires_grad_();
        (causal_depthwise_conv1d_tokens(x2, w2, b, Impl::Fused) * probe.permute({0, 2, 1, 3}).reshape({B, T, C}))
            .sum()
            .backward();
        EXPECT_TRUE(all_close(xg.grad(), x2.grad(), 1e-5, 1e-5)) << target.env;
        EXPECT_TRUE(all_close(wg.grad(), w2.grad(), 1e-5, 1e-5)) << target.env;
    });
    EXPECT_THROW(causal_depthwise_conv1d_heads(x, w, b, 5), linvis::Error);
}

// Weight and bias gradients are summed per task and the partials added in task order: the same bits
// on one thread and on two.
TEST(DepthwiseConv, GradientsDoNotDependOnThreadCount) {
    torch::manual_seed(8);
    Tensor x0 = torch::randn({2, 40 * 33, 16}), probe = torch::randn({2, 40 * 33, 16});
    Tensor w0 = torch::randn({16, 1, 3, 3}), b0 = torch::randn({16}), w10 = torch::randn({16, 1, 4});
    const int threads = at::get_num_threads();
    std::vector<std::vector<Tensor>> runs;
    for (int n : {1, 2}) {
        at::set_num_threads(n);
        Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
        Tensor w1 = w10.clone().requires_grad_();
        Tensor out = depthwise_conv2d_tokens(x, 40, 33, w, b, DwEpilogue::Silu, Impl::Fused) +
                     causal_depthwise_conv1d_tokens(x, w1, b, Impl::Fused);
        (out * probe).sum().backward();
        runs.push_back({out.detach(), x.grad(), w.grad(), b.grad(), w1.grad()});
    }
    at::set_num_threads(threads);
    for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_TRUE(torch::equal(runs[0][i], runs[1][i])) << "tensor " << i;
}

// Auto runs the fused kernel on float32 and bfloat16 (vectorised targets); float64 runs the reference.
// Fused takes float64 (its own dtype) and bfloat16 (computed in float32, rounded once); other dtypes
// and mixed dtypes are errors naming the op and the dtypes.
TEST(DepthwiseConv, DtypesUnderAutoAndFused) {
    torch::manual_seed(9);
    Tensor x = torch::randn({2, 12, 8}), w = torch::randn({8, 1, 3, 3}), b = torch::randn({8});
    Tensor w1 = torch::randn({8, 1, 4});
    auto conv2d = [&](torch::ScalarType type, Impl impl) {
        return depthwise_conv2d_tokens(x.to(type), 3, 4, w.to(type), b.to(type), DwEpilogue::Silu, impl);
    };
    auto conv1d = [&](torch::ScalarType type, Impl impl) {
        return causal_depthwise_conv1d_tokens(x.to(type), w1.to(type), b.to(type), impl);
    };
    EXPECT_TRUE(torch::equal(conv2d(torch::kFloat64, Impl::Auto), conv2d(torch::kFloat64, Impl::Reference)));
    EXPECT_TRUE(torch::equal(conv1d(torch::kFloat64, Impl::Auto), conv1d(torch::kFloat64, Impl::Reference)));
    const Impl bf16_auto = linvis::ops::simd::vectorised() ? Impl::Fused : Impl::Reference;
    EXPECT_TRUE(torch::equal(conv2d(torch::kBFloat16, Impl::Auto), conv2d(torch::kBFloat16, bf16_auto)));
    EXPECT_TRUE(torch::equal(conv1d(torch::kBFloat16, Impl::Auto), conv1d(torch::kBFloat16, bf16_auto)));
    // bfloat16 under Fused: the float32 kernel on the same (bf16-representable) values, rounded once.
    x = x.to(torch::kBFloat16).to(torch::kFloat32);
    w = w.to(torch::kBFloat16).to(torch::kFloat32);
    w1 = w1.to(torch::kBFloat16).to(torch::kFloat32);
    b = b.to(torch::kBFloat16).to(torch::kFloat32);
    EXPECT_EQ(conv2d(torch::kBFloat16, Impl::Fused).scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(conv2d(torch::kBFloat16, Impl::Fused), conv2d(torch::kFloat32, Impl::Fused).to(torch::kBFloat16)));
    EXPECT_TRUE(torch::equal(conv1d(torch::kBFloat16, Impl::Fused), conv1d(torch::kFloat32, Impl::Fused).to(torch::kBFloat16)));
    {  // with a graph, the gradient reaches the bfloat16 leaves in bfloat16
        Tensor xb = x.to(torch::kBFloat16).requires_grad_(), wb = w.to(torch::kBFloat16).requires_grad_();
        depthwise_conv2d_tokens(xb, 3, 4, wb, Tensor(), DwEpilogue::Residual, Impl::Fused).sum().backward();
        EXPECT_EQ(xb.grad().scalar_type(), torch::kBFloat16);
        EXPECT_EQ(wb.grad().scalar_type(), torch::kBFloat16);
    }
    for (Impl impl : {Impl::Fused}) {
        try {
            conv2d(torch::kFloat16, impl);
            ADD_FAILURE() << "no error for float16";
        } catch (const linvis::Error& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("depthwise_conv2d_tokens"), std::string::npos) << msg;
            EXPECT_NE(msg.find("Half"), std::string::npos) << msg;
        }
        EXPECT_THROW(conv1d(torch::kFloat16, impl), linvis::Error);
        try {
            causal_depthwise_conv1d_tokens(x, w1.to(torch::kFloat64), Tensor(), impl);
            ADD_FAILURE() << "no error for mixed dtypes";
        } catch (const linvis::Error& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("causal_depthwise_conv1d_tokens"), std::string::npos) << msg;
            EXPECT_NE(msg.find("one dtype"), std::string::npos) << msg;
            EXPECT_NE(msg.find("Double"), std::string::npos) << msg;
        }
    }
}

// Each message names the op, the argument, the expected and the actual shape.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
    try {
        f();
        ADD_FAILURE() << "no error; expected one naming " << parts[0];
    } catch (const linvis::Error& e) {
        const std::string msg = e.what();
        for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    }
}

TEST(DepthwiseConv, WrongShapesAreErrorsNamingExpectedAndActual) {
    Tensor x = torch::randn({2, 12, 8}), w = torch::randn({8, 1, 3, 3}), b = torch::randn({8});
    for (Impl impl : {Impl::Auto, Impl::Reference, Impl::Fused}) {
        expect_error([&] { depthwise_conv2d_tokens(x, 3, 5, w, b, DwEpilogue::None, impl); },
                     {"depthwise_conv2d_tokens", "x", "(B, 15, C)", "[2, 12, 8]"});
        expect_error([&] { depthwise_conv2d_tokens(x, 3, 4, torch::randn({8, 1, 5, 5}), b, DwEpilogue::None, impl); },
                     {"depthwise_conv2d_tokens", "weight", "(8, 1, 3, 3)", "[8, 1, 5, 5]"});
        expect_error([&] { depthwise_conv2d_tokens(x, 3, 4, torch::randn({4, 1, 3, 3}), b, DwEpilogue::None, impl); },
                     {"weight", "(8, 1, 3, 3)", "[4, 1, 3, 3]"});
        expect_error([&] { depthwise_conv2d_tokens(x, 3, 4, w, torch::randn({7}), DwEpilogue::None, impl); },
                     {"depthwise_conv2d_tokens", "bias", "[8]", "[7]"});
        expect_error([&] { depthwise_conv2d_tokens(x.flatten(), 3, 4, w, b, DwEpilogue::None, impl); },
                     {"x", "[192]"});
        expect_error([&] { causal_depthwise_conv1d_tokens(x, torch::randn({8, 4}), b, impl); },
                     {"causal_depthwise_conv1d_tokens", "weight", "(8, 1, k)", "[8, 4]"});
        expect_error([&] { causal_depthwise_conv1d_tokens(x, torch::randn({8, 1, 0}), b, impl); },
                     {"weight", "k >= 1", "[8, 1, 0]"});
        expect_error([&] { causal_depthwise_conv1d_tokens(x, torch::randn({8, 1, 4}), torch::randn({8, 1}), impl); },
                     {"bias", "[8]", "[8, 1]"});
        expect_error([&] { causal_depthwise_conv1d_tokens(x[0], torch::randn({8, 1, 4}), b, impl); },
                     {"x", "(B, T, C)", "[12, 8]"});
    }
}

// FLOPs are the convolutions' multiply-adds whichever implementation runs (what `linvis models` reports).
TEST(DepthwiseConv, FlopsAreCountedTheSameByBothImplementations) {
    Tensor x = torch::randn({2, 12, 8}), w = torch::randn({8, 1, 3, 3}), w1 = torch::randn({8, 1, 4});
    for (Impl impl : {Impl::Reference, Impl::Fused}) {
        linvis::flops::Counter c2;
        depthwise_conv2d_tokens(x, 3, 4, w, Tensor(), DwEpilogue::Residual, impl);
        EXPECT_EQ(c2.macs(), 2 * 12 * 8 * 9) << linvis::ops::impl_name(impl);
        linvis::flops::Counter c1;
        causal_depthwise_conv1d_tokens(x, w1, Tensor(), impl);
        EXPECT_EQ(c1.macs(), 2 * 12 * 8 * 4) << linvis::ops::impl_name(impl);
    }
}

}  // namespace
