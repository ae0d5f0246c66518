// The fused flash-style softmax attention (src/ops/attention/cpu.cpp) against the reference
// (src/ops/attention/reference.cpp: q k^T, softmax, @ v with autograd): outputs and the gradients of q, k
// and v in float64, float32 and bfloat16; N != M, token counts that are not multiples of the tiles (at most
// 128 queries x 512 keys forward, 128 x 256 backward, query blocks and key tiles split evenly): 1, 3, 5, 7, 65,
// 129, 197, 257, 300, 513, 1025, one key (its own test); head dims 8, 16, 32, 64, 72 and dv != d;
// several samples and heads; q, k, v as strided views of one qkv tensor (deit's layout); large logits and a
// running maximum that rises and falls between key tiles (the online softmax's rescaling); float32 on every SIMD
// target the CPU runs (LINVIS_SIMD=avx512|avx2|scalar: the SIMD layer's softmax kernels); the same bits on 1 and
// 2 threads.
//
// Not checked here: that the fused forward keeps no (N, M) tensor for the backward. LibTorch's C++ API does
// not expose a custom Function's saved variables, so the check would need a private hook; the forward saves
// q, k, v, out and the (B*h, N) logsumexp (src/ops/attention/cpu.cpp), and the memory is measured by
// `linvis bench` (docs/ops.md).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include <ATen/Parallel.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/dit.h"
#include "linvis/models/registry.h"
#include "linvis/ops/attention.h"
#include "support/simd_targets.h"
#include "support/testing.h"

namespace {

using linvis::ops::Impl;
using linvis::ops::softmax_attention;
using linvis::testing::all_close;

struct Shape {
    int64_t B, h, N, M, d, dv;
};

std::string name(const Shape& s, torch::ScalarType type) {
    return "B" + std::to_string(s.B) + " h" + std::to_string(s.h) + " N" + std::to_string(s.N) + " M" +
           std::to_string(s.M) + " d" + std::to_string(s.d) + " dv" + std::to_string(s.dv) + " " +
           std::string(c10::toString(type));
}

// Output and gradients (q, k, v) of sum(out * probe) for one implementation.
std::vector<torch::Tensor> run(const torch::Tensor& q0, const torch::Tensor& k0, const torch::Tensor& v0,
                               const torch::Tensor& probe, double scale, Impl impl) {
    torch::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    torch::Tensor out = softmax_attention(q, k, v, scale, {}, impl);
    (out * probe).sum().backward();
    return {out.detach(), q.grad(), k.grad(), v.grad()};
}

struct Inputs {
    torch::Tensor q, k, v, probe;
};

Inputs make_inputs(const Shape& s, torch::ScalarType type, double magnitude = 1.0) {
    torch::manual_seed(s.N * 1000 + s.M + s.d);
    auto o = torch::TensorOptions().dtype(type);
    return {(torch::randn({s.B, s.h, s.N, s.d}) * magnitude).to(type),
            (torch::randn({s.B, s.h, s.M, s.d}) * magnitude).to(type), torch::randn({s.B, s.h, s.M, s.dv}, o),
            torch::randn({s.B, s.h, s.N, s.dv}, o)};
}

const char* kNames[] = {"out", "dq", "dk", "dv"};

// Elementwise |fused - reference| <= atol + rtol |reference|, the atol relative to the largest |reference|.
void compare(const Shape& s, torch::ScalarType type, double rtol, double atol_rel, double magnitude = 1.0) {
    const Inputs in = make_inputs(s, type, magnitude);
    const double scale = std::pow(static_cast<double>(s.d), -0.5);
    const auto ref = run(in.q, in.k, in.v, in.probe, scale, Impl::Reference);
    const auto fused = run(in.q, in.k, in.v, in.probe, scale, Impl::Fused);
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(fused[i].scalar_type(), type) << kNames[i] << " " << name(s, type);
        const double atol = atol_rel * ref[i].abs().max().item<double>();
        EXPECT_TRUE(all_close(fused[i], ref[i], rtol, atol)) << kNames[i] << " " << name(s, type);
    }
}

const Shape kShapes[] = {
    {1, 3, 197, 197, 64, 64},  // deit_tiny at 224 px
    {2, 2, 1, 5, 32, 32},      // one query
    {1, 2, 513, 300, 72, 72},  // N != M, neither a multiple of a tile, head dim 72
    {2, 3, 65, 257, 32, 48},   // dv != d, one query past a tile, one key past a tile
    {1, 1, 300, 513, 64, 64},  // more keys than queries
    {3, 2, 64, 128, 64, 64},   // exact tiles
    {1, 3, 3, 5, 8, 8},        // odd token counts below every tile and below one GEMM register tile
    {1, 1, 129, 1025, 64, 64},  // 2 uneven query blocks; forward key tiles of 342, 342 and 341 keys,
                                // 5 backward key segments (summed dQ parts)
};

void all_shapes_f32() {
    // float32: the fused kernel and the reference round differently (tile-wise sums, a 2-ulp exp): a few
    // float32 unit roundoffs (6e-8) times the number of terms of a sum, far below 1e-4.
    for (const Shape& s : kShapes) compare(s, torch::kFloat32, 1e-4, 1e-5);
}

TEST(AttentionFused, MatchesReferenceFloat64) {
    // float64 runs Highway's Exp (1 ulp) and the double GEMM: the two paths differ in the order of the sums and by
    // a few double roundoffs in each exponential.
    for (const Shape& s : kShapes) compare(s, torch::kFloat64, 1e-10, 1e-12);
}

TEST(AttentionFused, MatchesReferenceFloat32EveryTarget) {
    linvis::testing::for_each_simd_target([](const linvis::testing::SimdTarget&) {
        all_shapes_f32();
        compare({1, 2, 197, 197, 64, 64}, torch::kFloat64, 1e-10, 1e-12);
    });
}

// q, k and v as deit takes them: strided views of one qkv product (B, N, 3, h, d), rows 3 h d floats apart,
// with more keys than one forward tile (so the forward reads v through its transposed copy) and with fewer
// (v read in place), on every SIMD target, forward and gradients against the reference.
TEST(AttentionFused, ViewsOfOneQkvTensor) {
    linvis::testing::for_each_simd_target([](const linvis::testing::SimdTarget& target) {
        for (const int64_t tokens : {197, 600}) {
            for (const torch::ScalarType type : {torch::kFloat32, torch::kFloat64}) {
                torch::manual_seed(tokens);
                const torch::Tensor qkv = torch::randn({2, tokens, 3, 3, 32}, torch::TensorOptions().dtype(type));
                const torch::Tensor probe = torch::randn({2, 3, tokens, 32}, torch::TensorOptions().dtype(type));
                const auto fused = [&](Impl impl) {
                    torch::Tensor x = qkv.clone().requires_grad_();
                    const torch::Tensor heads = x.permute({2, 0, 3, 1, 4});  // (3, B, h, N, d), views
                    const torch::Tensor out = softmax_attention(heads[0], heads[1], heads[2], 0.2, {}, impl);
                    (out * probe).sum().backward();
                    return std::vector<torch::Tensor>{out.detach(), x.grad()};
                };
                EXPECT_GT(qkv.permute({2, 0, 3, 1, 4})[2].stride(2), 32);  // v's rows are strided
                const auto ref = fused(Impl::Reference), got = fused(Impl::Fused);
                const double tol = type == torch::kFloat32 ? 1e-5 : 1e-12;
                for (int i = 0; i < 2; ++i)
                    EXPECT_TRUE(all_close(got[i], ref[i], tol * 10, tol * ref[i].abs().max().item<double>()))
                        << (i == 0 ? "out" : "dqkv") << " " << tokens << " tokens " << c10::toString(type) << " "
                        << target.env;
            }
        }
    });
}

// One key: every weight is 1, so the output is v's row for every query, dv is the probe summed over the
// queries, and dq, dk are 0 up to rounding (dS = P (dP - D) with D = dP); not in kShapes, whose tolerance is
// relative to the largest |reference|, which is rounding noise here.
TEST(AttentionFused, OneKey) {
    for (const torch::ScalarType type : {torch::kFloat32, torch::kFloat64}) {
        const Inputs in = make_inputs({1, 2, 7, 1, 16, 16}, type);
        const auto fused = run(in.q, in.k, in.v, in.probe, 0.25, Impl::Fused);
        const double tol = type == torch::kFloat32 ? 1e-5 : 1e-12;
        EXPECT_TRUE(all_close(fused[0], in.v.expand({1, 2, 7, 16}), tol, tol));
        EXPECT_TRUE(all_close(fused[3], in.probe.sum(2, /*keepdim=*/true), tol, tol));
        EXPECT_LT(fused[1].abs().max().item<double>(), tol);
        EXPECT_LT(fused[2].abs().max().item<double>(), tol);
    }
}

// No queries: an empty output and gradients of the inputs' shapes (zeros for k and v).
TEST(AttentionFused, NoQueries) {
    auto q = torch::randn({1, 2, 0, 8}).requires_grad_(), k = torch::randn({1, 2, 5, 8}).requires_grad_(),
         v = torch::randn({1, 2, 5, 8}).requires_grad_();
    const torch::Tensor out = softmax_attention(q, k, v, 0.5, {}, Impl::Fused);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 2, 0, 8}));
    out.sum().backward();
    EXPECT_EQ(q.grad().sizes(), q.sizes());
    EXPECT_TRUE(torch::equal(k.grad(), torch::zeros_like(k)));
    EXPECT_TRUE(torch::equal(v.grad(), torch::zeros_like(v)));
}

// Logits up to a few hundred: every row's maximum moves between key tiles, so the accumulator is rescaled
// many times; exp of large negative differences must give 0, not NaN.
TEST(AttentionFused, LargeLogitsStable) {
    compare({1, 2, 197, 600, 64, 64}, torch::kFloat32, 1e-4, 1e-5, /*magnitude=*/6.0);
    compare({1, 2, 197, 600, 64, 64}, torch::kFloat64, 1e-10, 1e-12, /*magnitude=*/6.0);
}

// The keys of the second of three key tiles have logits about 100 above the others' (q's entries are positive, those
// keys' entries are shifted by 14): the running maximum rises by about 100 in the second tile, where the first
// tile's sums are rescaled by about e^-100 (0 in float), and the third tile's own maximum is about 100 below the
// running one. A kernel that took a tile's own maximum as the running one would rescale by about e^100, beyond
// float's range, and misplace the logsumexp that the backward recomputes the probabilities from.
TEST(AttentionFused, RunningMaximumRisesAndFallsBetweenKeyTiles) {
    for (const auto type : {torch::kFloat32, torch::kFloat64}) {
        torch::manual_seed(5);
        const int64_t M = 1100;  // forward key tiles of 367, 367 and 366 keys
        const torch::Tensor q = (torch::randn({1, 2, 37, 16}).abs() + 1).to(type);
        torch::Tensor k = torch::randn({1, 2, M, 16});
        k.narrow(2, 367, 367).add_(14.0);
        k = k.to(type);
        const torch::Tensor v = torch::randn({1, 2, M, 8}).to(type), probe = torch::randn({1, 2, 37, 8}).to(type);
        const auto ref = run(q, k, v, probe, 0.25, Impl::Reference);
        const auto fused = run(q, k, v, probe, 0.25, Impl::Fused);
        const double rtol = type == torch::kFloat32 ? 1e-4 : 1e-10, atol_rel = type == torch::kFloat32 ? 1e-5 : 1e-12;
        for (int i = 0; i < 4; ++i) {
            const double atol = atol_rel * ref[i].abs().max().item<double>();
            EXPECT_TRUE(all_close(fused[i], ref[i], rtol, atol)) << kNames[i] << " " << c10::toString(type);
        }
    }
}

// bfloat16: both paths compute in float32 from the same bf16 inputs and round once to bf16 at the end (the
// output; each gradient is rounded once when it leaves the float32 kernel). Two float32 values that differ
// by a few float32 roundoffs round to the same or to adjacent bf16 numbers, and adjacent bf16 numbers are
// at most 2^-7 apart relative to either (8 significant bits). So |fused - ref| <= 2^-7 |ref|, plus, for
// elements that are sums with cancellation, the float32 difference itself: 1e-4 of the largest |ref|.
TEST(AttentionFused, MatchesReferenceBfloat16) {
    for (const Shape& s : {Shape{1, 3, 197, 197, 64, 64}, Shape{2, 2, 65, 257, 32, 48}, Shape{1, 2, 513, 300, 72, 72}})
        compare(s, torch::kBFloat16, 1.0 / 128, 1e-4);
}

// bf16 inference with the products on the AMX tiles (ops/attention/cpu.cpp: forward_bf16_tiles), emulated on every
// CPU and on the tiles where the CPU has them, against the float32 kernel on the same bf16 inputs (LINVIS_AMX=off),
// which rounds its output only. The tiles' path rounds three times more (bf16's unit roundoff is 2^-8):
// - q scale to bf16: exact for the power-of-two scales here (d = 64, 8, 32); otherwise each logit moves by at most
//   delta = 2^-8 scale max sum_f |q_f k_f|, and a weight relative to the others by at most a factor e^(2 delta);
// - each weight P to bf16, a relative 2^-8, while the normaliser sums the float32 weights: O moves by at most
//   2^-8 max |v|; the weights' exponentials are computed to 7.5e-5 relative, in the weights and their sum alike,
//   which moves O by at most 1.5e-4 max |v|;
// - O to bf16 once, as the float32 kernel does: two values that differ by the above round at most 2^-7 |O| further
//   apart (adjacent bf16 numbers).
// So |tiles - f32| <= 2^-7 |f32| + max |v| (2^-8 + 1.5e-4 + e^(2 delta) - 1), plus 1e-4 max |f32| for sums in
// another order. Shapes: deit's, N != M past the tiles with head dim 72 (padded to 96), dv != d, three key tiles
// (with logits of a few tens too), one query, d = 8; q, k, v as views of one qkv tensor. And the float64 error of
// deit's shape as SoftmaxAttention.Bfloat16WithinTolerance bounds the float32 kernel's: relative L2 below 2^-8.
TEST(AttentionFused, Bfloat16OnTheAmxTilesMatchesTheFloat32Kernel) {
    linvis::testing::for_each_amx_path([](linvis::ops::simd::AmxMode) {
        torch::NoGradGuard no_grad;
        // The last case's q and k are 3 times larger: logits of a few tens, so the maxima of later key tiles exceed
        // the exponentials' shift by more than 8 (the online softmax then takes the new maximum; otherwise it keeps
        // the shift).
        const Shape shapes[] = {{1, 3, 197, 197, 64, 64}, {1, 2, 513, 300, 72, 72}, {2, 3, 65, 257, 32, 48},
                                {1, 1, 129, 1025, 64, 64}, {2, 2, 1, 5, 32, 32},     {1, 3, 3, 5, 8, 8},
                                {1, 2, 129, 1025, 64, 64}};
        for (const Shape& s : shapes) {
            SCOPED_TRACE(name(s, torch::kBFloat16));
            const Inputs in = make_inputs(s, torch::kBFloat16, s.h == 2 && s.M == 1025 ? 3.0 : 1.0);
            const double scale = std::pow(static_cast<double>(s.d), -0.5);
            const torch::Tensor tiles = softmax_attention(in.q, in.k, in.v, scale, {}, Impl::Fused);
            torch::Tensor f32;
            {
                linvis::testing::ScopedAmx off("off");
                f32 = softmax_attention(in.q, in.k, in.v, scale, {}, Impl::Fused);
            }
            ASSERT_EQ(tiles.scalar_type(), torch::kBFloat16);
            ASSERT_EQ(tiles.sizes(), f32.sizes());
            const torch::Tensor q_abs = in.q.to(torch::kFloat64).abs(), k_abs = in.k.to(torch::kFloat64).abs();
            const double qk = q_abs.matmul(k_abs.transpose(2, 3)).max().item<double>();
            const bool exact_scale = std::exp2(std::round(std::log2(scale))) == scale;
            const double delta = exact_scale ? 0.0 : std::exp2(-8) * scale * qk;
            const double v_max = in.v.abs().max().item<double>(), f32_max = f32.abs().max().item<double>();
            const double atol = v_max * (std::exp2(-8) + 1.5e-4 + std::expm1(2 * delta)) + 1e-4 * f32_max;
            const double worst = (tiles.to(torch::kFloat32) - f32.to(torch::kFloat32)).abs().max().item<double>();
            EXPECT_TRUE(all_close(tiles, f32, 1.0 / 128, atol)) << "max |tiles - f32| " << worst << ", atol " << atol;
            if (s.N == 197) {
                const torch::Tensor exact = softmax_attention(in.q.to(torch::kFloat64), in.k.to(torch::kFloat64),
                                                              in.v.to(torch::kFloat64), scale, {}, Impl::Reference);
                const double err = linvis::testing::relative_error(tiles, exact);
                std::cout << "[measure] softmax attention bf16 on AMX tiles rel err " << err << "\n";
                EXPECT_LT(err, 1.0 / 256);
            }
        }
        // deit's layout: views of one qkv tensor, rows 3 h d values apart.
        torch::manual_seed(11);
        const torch::Tensor qkv = torch::randn({2, 600, 3, 3, 32}).to(torch::kBFloat16);
        const torch::Tensor heads = qkv.permute({2, 0, 3, 1, 4});
        const torch::Tensor tiles = softmax_attention(heads[0], heads[1], heads[2], 0.25, {}, Impl::Fused);
        linvis::testing::ScopedAmx off("off");
        const torch::Tensor f32 = softmax_attention(heads[0], heads[1], heads[2], 0.25, {}, Impl::Fused);
        const double v_max = heads[2].abs().max().item<double>();
        const double atol = v_max * (std::exp2(-8) + 1.5e-4) + 1e-4 * f32.abs().max().item<double>();
        EXPECT_TRUE(all_close(tiles, f32, 1.0 / 128, atol));
    });
}

// A rise of the running maximum by about 100 in the second key tile (as RunningMaximumRisesAndFallsBetweenKeyTiles) on
// the AMX tiles' bf16 inference, whose online softmax keeps the previous tile's shift while the logits stay within
// 8 of it: here it must take the new maximum, or its exponentials overflow. Against the float32 kernel on the same
// bf16 inputs, with the bound of Bfloat16OnTheAmxTilesMatchesTheFloat32Kernel (a power-of-two scale).
TEST(AttentionFused, Bfloat16OnTheAmxTilesWhenTheMaximumRisesBetweenKeyTiles) {
    linvis::testing::for_each_amx_path([](linvis::ops::simd::AmxMode) {
        torch::NoGradGuard no_grad;
        torch::manual_seed(5);
        const int64_t M = 1100;  // key tiles of 384, 384 and 332 keys (367 rounded up to the tiles' 32)
        const torch::Tensor q = (torch::randn({1, 2, 37, 16}).abs() + 1).to(torch::kBFloat16);
        torch::Tensor k = torch::randn({1, 2, M, 16});
        k.narrow(2, 400, 300).add_(14.0);  // inside the second tile
        k = k.to(torch::kBFloat16);
        const torch::Tensor v = torch::randn({1, 2, M, 8}).to(torch::kBFloat16);
        const torch::Tensor tiles = softmax_attention(q, k, v, 0.25, {}, Impl::Fused);
        linvis::testing::ScopedAmx off("off");
        const torch::Tensor f32 = softmax_attention(q, k, v, 0.25, {}, Impl::Fused);
        const double atol =
            v.abs().max().item<double>() * (std::exp2(-8) + 1.5e-4) + 1e-4 * f32.abs().max().item<double>();
        EXPECT_TRUE(all_close(tiles, f32, 1.0 / 128, atol));
    });
}

// With a graph to build, bf16 runs the float32 kernel (its backward has no bf16 form) whatever LINVIS_AMX says:
// the same bits as with the tiles off, and gradients.
TEST(AttentionFused, Bfloat16WithAGraphRunsTheFloat32Kernel) {
    const Inputs in = make_inputs({1, 2, 65, 100, 32, 32}, torch::kBFloat16);
    std::vector<torch::Tensor> emulated;
    {
        linvis::testing::ScopedAmx emulate("emulate");
        emulated = run(in.q, in.k, in.v, in.probe, 0.25, Impl::Fused);
    }
    linvis::testing::ScopedAmx off("off");
    const auto f32 = run(in.q, in.k, in.v, in.probe, 0.25, Impl::Fused);
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(torch::equal(emulated[i], f32[i])) << kNames[i];
}

// The fused path in float64 against finite differences (independent of the reference).
TEST(AttentionFused, Gradcheck) {
    torch::manual_seed(3);
    const auto o = torch::TensorOptions().dtype(torch::kFloat64);
    auto q = torch::randn({1, 2, 5, 3}, o).requires_grad_(), k = torch::randn({1, 2, 7, 3}, o).requires_grad_(),
         v = torch::randn({1, 2, 7, 2}, o).requires_grad_();
    EXPECT_TRUE(linvis::testing::gradcheck(
        [](const std::vector<torch::Tensor>& in) { return softmax_attention(in[0], in[1], in[2], 0.7, {}, Impl::Fused); },
        {q, k, v}));
}

// Forward and backward give the same bits on one thread and on two (tasks own their rows and their
// (sample, head)).
TEST(AttentionFused, SameBitsOnOneAndTwoThreads) {
    const Shape s{2, 3, 197, 300, 64, 64};
    const Inputs in = make_inputs(s, torch::kFloat32);
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    const auto one = run(in.q, in.k, in.v, in.probe, 0.125, Impl::Fused);
    at::set_num_threads(2);
    const auto two = run(in.q, in.k, in.v, in.probe, 0.125, Impl::Fused);
    at::set_num_threads(threads);
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << kNames[i];
}

// The mask is not supported by the fused kernel: Impl::Fused names the reason, Impl::Auto runs the reference.
TEST(AttentionFused, MaskRunsTheReferenceUnderAuto) {
    torch::manual_seed(5);
    auto q = torch::randn({1, 2, 9, 8}), k = torch::randn({1, 2, 11, 8}), v = torch::randn({1, 2, 11, 8});
    auto mask = torch::rand({9, 11}) > 0.5;
    mask.select(1, 0).fill_(true);
    try {
        softmax_attention(q, k, v, 0.3, mask, Impl::Fused);
        ADD_FAILURE() << "Impl::Fused with a mask did not throw";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("mask"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(softmax_attention(q, k, v, 0.3, mask), softmax_attention(q, k, v, 0.3, mask, Impl::Reference)));
    // The mask matters (so the line above compares masked attention, not plain).
    EXPECT_GT((softmax_attention(q, k, v, 0.3, mask) - softmax_attention(q, k, v, 0.3, {}, Impl::Fused)).abs().max().item<double>(),
              1e-3);
    EXPECT_THROW(softmax_attention(q.to(torch::kInt32), k.to(torch::kInt32), v.to(torch::kInt32), 0.3, {}, Impl::Fused),
                 linvis::Error);
}

TEST(AttentionFused, CountsTheSameFlops) {
    auto q = torch::randn({2, 3, 10, 4}), k = torch::randn({2, 3, 12, 4}), v = torch::randn({2, 3, 12, 5});
    for (const Impl impl : {Impl::Reference, Impl::Fused}) {
        linvis::flops::Counter counter;
        softmax_attention(q, k, v, 0.5, {}, impl);
        EXPECT_EQ(counter.macs(), 2 * 3 * 10 * 12 * (4 + 5)) << linvis::ops::impl_name(impl);
    }
}


// DiT's softmax mixer takes the model's `impl` (DeiT's did already): impl=reference and impl=fused give the
// same output up to float32 rounding, and not the same bits (so the two runs took different paths).
TEST(AttentionFused, DitFollowsTheModelImpl) {
    using linvis::models::ModelConfig;
    auto make = [](const std::string& impl) {
        return linvis::models::create_diffusion_model(
            "dit_s4", ModelConfig({{"input_size", "16"}, {"depth", "1"}, {"impl", impl}}));
    };
    auto reference = make("reference"), fused = make("fused");
    torch::manual_seed(7);
    // Random weights: the adaLN-zero initialisation would make every output exactly 0.
    linvis::testing::share_random_weights(*reference, *fused);
    reference->eval();
    fused->eval();
    torch::NoGradGuard no_grad;
    const torch::Tensor x = torch::randn({2, 4, 16, 16}), t = torch::tensor({0, 999}), y = torch::tensor({3, 1000});
    const torch::Tensor a = reference->forward(x, t, y), b = fused->forward(x, t, y);
    EXPECT_GT(a.abs().max().item<double>(), 1e-3);
    EXPECT_TRUE(all_close(b, a, 1e-4, 1e-5 * a.abs().max().item<double>()));
    EXPECT_FALSE(torch::equal(a, b));
}

}  // namespace
