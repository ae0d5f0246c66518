// Fused CPU ViT³ / T⁵ / DiT⁵ kernels (src/ops/vit3_ttt/cpu.cpp, src/ops/t5_ttt/cpu.cpp and dit5_cpu.cpp)
// against the reference ops: outputs and gradients with respect to every input, float32 / bfloat16 / float64
// (fallback), on every SIMD target the CPU runs
// (AVX-512, AVX2, scalar: LINVIS_SIMD, tests/support/simd_targets.h), and the models with impl=fused
// against impl=reference.
//
// Tolerances. float32: relative L2 error <= 1e-4 and elementwise rtol 1e-3 / atol 1e-5 (scaled).
// Both sides accumulate N-term float32 sums (the d x d inner gradients) in different orders
// (blocked partial sums here, BLAS there) and Highway's sigmoid is within a few ulp of ATen's, so
// per-element differences are ~1e-6 relative; the inner step divides by ||G|| + 1 and the read-out
// multiplies three such factors, which leaves ~1e-5 relative at most in these tests.
// bfloat16: the fused path computes in float32 and rounds once on output; compared with the
// float32 reference on the same (bf16-rounded) inputs the error is the output rounding, 2^-8.
#include <cstdlib>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/models/dit.h"
#include "linvis/models/registry.h"
#include "linvis/ops/t5_ttt.h"
#include "linvis/ops/vit3_ttt.h"
#include "support/simd_targets.h"
#include "support/testing.h"

namespace {

using linvis::ops::Impl;
using torch::Tensor;
using linvis::testing::relative_error;

constexpr double kF32RelTol = 1e-4;
// bf16 inference with the products on the AMX tiles, relative L2 against the float32 kernel on the same inputs: on
// any path to the output at most eight operands are rounded to bf16 (T5: the keys, the loss gradient, the inner
// gradients' two factors, the queries, the updated weights, the gate, and the output itself), each adding a relative
// error of RMS at most u / sqrt(3) = 2.3e-3 (u = 2^-8), about sqrt(8) 2.3e-3 = 6.5e-3 if none cancels; measured
// 2.4e-3 to 4.6e-3 (T5, DiT5, ViT3), 1.7e-3 without the tiles (the output's rounding alone).
constexpr double kBf16TileBound = 1e-2;

using linvis::testing::for_each_simd_target;
using linvis::testing::SimdTarget;

// Runs f on leaf copies of `inputs` (requires_grad), back-propagates a fixed probe, returns
// {output, grad_0, grad_1, ...}.
template <typename F>
std::vector<Tensor> run_with_grads(const std::vector<Tensor>& inputs, const Tensor& probe, F f) {
    std::vector<Tensor> leaves;
    for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
    Tensor out = f(leaves);
    (out * probe).sum().backward();
    std::vector<Tensor> res{out.detach()};
    for (const auto& l : leaves) {
        EXPECT_TRUE(l.grad().defined());
        res.push_back(l.grad().defined() ? l.grad() : torch::zeros_like(l));
    }
    return res;
}

void expect_all_match(const std::vector<Tensor>& fused, const std::vector<Tensor>& ref, double tol,
                      const std::string& what) {
    ASSERT_EQ(fused.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_EQ(fused[i].sizes(), ref[i].sizes()) << what << " tensor " << i;
        EXPECT_EQ(fused[i].scalar_type(), ref[i].scalar_type()) << what << " tensor " << i;
        const double err = relative_error(fused[i], ref[i]);
        EXPECT_LT(err, tol) << what << ": tensor " << i << (i == 0 ? " (output)" : " (gradient)");
        const double scale = ref[i].abs().max().item<double>();
        EXPECT_TRUE(linvis::testing::all_close(fused[i], ref[i], 1e-3, 1e-5 * scale + 1e-12))
            << what << ": tensor " << i;
    }
}

// bf16 inference on the AMX tiles (simd::inference_kernels): the fused TTT mixers' products take their operands rounded
// to bf16 once, as LibTorch's bf16 matmuls hold them, with float32 sums; everything else stays float32. run(x) is
// the op on inputs x, without a graph; x16 holds bf16 inputs. On every AMX path (emulated on any CPU, the tiles on
// one with AMX) the output is checked against the float32 kernel on the same values widened, within `bound`
// (relative L2), and against LINVIS_AMX=off, which it must not equal (the products ran on the tiles).
template <typename F>
void check_bf16_on_the_tiles(const std::vector<Tensor>& x16, F run, double bound, const std::string& what) {
    SCOPED_TRACE(what);
    torch::NoGradGuard no_grad;
    std::vector<Tensor> x32;
    for (const Tensor& t : x16) x32.push_back(t.to(torch::kFloat32));
    const Tensor exact = run(x32);
    Tensor off;
    {
        linvis::testing::ScopedAmx no_tiles("off");
        off = run(x16);
    }
    std::cout << "[measure] " << what << ": bf16 without the tiles, relative L2 error " << relative_error(off, exact)
              << "\n";
    linvis::testing::for_each_amx_path([&](linvis::ops::simd::AmxMode) {
        const Tensor got = run(x16);
        EXPECT_EQ(got.scalar_type(), torch::kBFloat16);
        const double err = relative_error(got, exact);
        std::cout << "[measure] " << what << ": bf16 on the tiles, relative L2 error " << err << "\n";
        EXPECT_LT(err, bound);
        EXPECT_FALSE(torch::equal(got, off)) << "the products did not run on the tiles";
    });
}

// q, k, v as strided (B, h, N, d) views of one (B, N, 3*h*d + pad) buffer, like the model's qkv.
std::vector<Tensor> swiglu_inputs(int64_t B, int64_t h, int64_t N, int64_t d, bool per_sample_w,
                                  torch::Dtype dtype = torch::kFloat32) {
    Tensor qkv = torch::randn({B, N, 3 * h * d + 5}, dtype);
    auto heads = [&](int64_t i) { return qkv.narrow(2, i * h * d, h * d).reshape({B, N, h, d}).transpose(1, 2); };
    const int64_t wb = per_sample_w ? B : 1;
    Tensor w1 = (0.3 * torch::randn({wb, h, d, d})).to(dtype), w2 = (0.3 * torch::randn({wb, h, d, d})).to(dtype);
    return {heads(0), heads(1), heads(2), w1, w2};
}

Tensor swiglu(const std::vector<Tensor>& x, Impl impl) {
    return linvis::ops::vit3_ttt_swiglu_branch(x[0], x[1], x[2], x[3], x[4], linvis::ops::kVit3InnerScale, impl);
}

void check_swiglu(int64_t B, int64_t h, int64_t N, int64_t d, bool per_sample_w, const std::string& what) {
    auto x = swiglu_inputs(B, h, N, d, per_sample_w);
    Tensor probe = torch::randn({B, h, N, d});
    auto ref = run_with_grads(x, probe, [](const std::vector<Tensor>& l) { return swiglu(l, Impl::Reference); });
    auto fused = run_with_grads(x, probe, [](const std::vector<Tensor>& l) { return swiglu(l, Impl::Fused); });
    expect_all_match(fused, ref, kF32RelTol, what);
}

// Every case on every SIMD target this CPU runs (AVX-512, AVX2, scalar).
TEST(Vit3TttFused, SwigluBranchMatchesReference) {
    for_each_simd_target([](const SimdTarget&) {
        torch::manual_seed(0);
        check_swiglu(1, 1, 37, 8, false, "B1 h1 N37 d8");
        check_swiglu(2, 3, 300, 16, false, "B2 h3 N300 d16");           // two token blocks, partial last
        check_swiglu(2, 2, 512, 64, true, "B2 h2 N512 d64 per-sample W");  // exact blocks, d = tiny width
        check_swiglu(1, 2, 257, 20, false, "B1 h2 N257 d20");            // d not a multiple of 16 (or 8)
        check_swiglu(1, 1, 70, 3, false, "B1 h1 N70 d3");                // d below every vector width
    });
}

std::vector<Tensor> dwconv_inputs(int64_t B, int64_t d, int64_t H, int64_t W, torch::Dtype dtype = torch::kFloat32) {
    // (B, H, W, 3d + 1) channels-last buffer viewed as three (B, d, H, W) maps, like vit3_ttt_mix.
    Tensor buf = torch::randn({B, H, W, 3 * d + 1}, dtype);
    auto map = [&](int64_t i) { return buf.narrow(3, i * d, d).permute({0, 3, 1, 2}); };
    return {map(0), map(1), map(2), (0.3 * torch::randn({d, 1, 3, 3})).to(dtype)};
}

Tensor dwconv(const std::vector<Tensor>& x, Impl impl) {
    return linvis::ops::vit3_ttt_dwconv_branch(x[0], x[1], x[2], x[3], linvis::ops::kVit3InnerScale, impl);
}

void check_dwconv(int64_t B, int64_t d, int64_t H, int64_t W, const std::string& what) {
    auto x = dwconv_inputs(B, d, H, W);
    Tensor probe = torch::randn({B, d, H, W});
    auto ref = run_with_grads(x, probe, [](const std::vector<Tensor>& l) { return dwconv(l, Impl::Reference); });
    auto fused = run_with_grads(x, probe, [](const std::vector<Tensor>& l) { return dwconv(l, Impl::Fused); });
    expect_all_match(fused, ref, kF32RelTol, what);
}

TEST(Vit3TttFused, DwconvBranchMatchesReference) {
    for_each_simd_target([](const SimdTarget&) {
        torch::manual_seed(1);
        check_dwconv(1, 8, 5, 7, "B1 d8 5x7");
        check_dwconv(2, 16, 20, 13, "B2 d16 20x13");
        check_dwconv(2, 64, 17, 32, "B2 d64 17x32");
        check_dwconv(1, 3, 1, 1, "1x1 grid");
        check_dwconv(2, 12, 11, 10, "B2 d12 11x10");
        // Contiguous (B, d, H, W) input (the non-channels-last layout is converted on entry).
        torch::manual_seed(2);
        std::vector<Tensor> x{torch::randn({2, 8, 9, 6}), torch::randn({2, 8, 9, 6}), torch::randn({2, 8, 9, 6}),
                              0.3 * torch::randn({8, 1, 3, 3})};
        Tensor probe = torch::randn({2, 8, 9, 6});
        auto ref = run_with_grads(x, probe, [](const std::vector<Tensor>& l) { return dwconv(l, Impl::Reference); });
        auto fused = run_with_grads(x, probe, [](const std::vector<Tensor>& l) { return dwconv(l, Impl::Fused); });
        expect_all_match(fused, ref, kF32RelTol, "contiguous layout");
    });
}

Tensor mix(const std::vector<Tensor>& x, int64_t heads, int64_t H, int64_t W, const Tensor& rope, Impl impl) {
    return linvis::ops::vit3_ttt_mix(x[0], x[1], x[2], x[3], heads, H, W, rope, impl);
}

TEST(Vit3TttFused, MixMatchesReferenceWithAndWithoutRope) {
    torch::manual_seed(3);
    const int64_t B = 2, h = 2, d = 8, C = h * d, H = 6, W = 9;
    std::vector<Tensor> x{torch::randn({B, H * W, 3 * C + 3 * d}), 0.3 * torch::randn({1, h, d, d}),
                          0.3 * torch::randn({1, h, d, d}), 0.3 * torch::randn({d, 1, 3, 3})};
    Tensor probe = torch::randn({B, H * W, C + d});
    for_each_simd_target([&](const SimdTarget&) {
        for (bool with_rope : {false, true}) {
            Tensor rope = with_rope ? linvis::ops::vit3_rope_rotations(H, W, C) : Tensor();
            auto ref = run_with_grads(x, probe, [&](const std::vector<Tensor>& l) {
                return mix(l, h, H, W, rope, Impl::Reference);
            });
            auto fused = run_with_grads(x, probe, [&](const std::vector<Tensor>& l) {
                return mix(l, h, H, W, rope, Impl::Fused);
            });
            expect_all_match(fused, ref, kF32RelTol, with_rope ? "mix with rope" : "mix");
        }
    });
}

// ops::Vit3TttInBands over bands of `rows` rows of x's map (x: qkv, w1, w2, w3 as mix's), the bands' outputs joined.
Tensor mix_in_bands(const std::vector<Tensor>& x, int64_t h, int64_t H, int64_t W, int64_t rows, Impl impl) {
    const int64_t B = x[0].size(0), d = x[3].size(0), C = h * d;
    const Tensor map = x[0].view({B, H, W, 3 * C + 3 * d});
    const Tensor kv = torch::cat({map.narrow(3, C, 2 * C), map.narrow(3, 3 * C + d, 2 * d)}, 3);
    const Tensor q = torch::cat({map.narrow(3, 0, C), map.narrow(3, 3 * C, d)}, 3);
    linvis::ops::Vit3TttInBands bands(x[1], x[2], x[3], h, B, H, W, impl);
    auto with_halo = [&](const Tensor& t, int64_t begin, int64_t end) {
        const int64_t first = bands.first_row(begin);
        return t.narrow(1, first, bands.last_row(end) - first);
    };
    for (int64_t r = 0; r < H; r += rows) {
        const int64_t end = std::min(H, r + rows);
        bands.accumulate(with_halo(kv, r, end), r, end);
    }
    std::vector<Tensor> out;
    for (int64_t r = 0; r < H; r += rows) {
        const int64_t end = std::min(H, r + rows);
        out.push_back(bands.apply(with_halo(q, r, end), r, end));
    }
    return torch::cat(out, 1);
}

// The mix in bands of rows (H-ViT³'s first stages in inference) gives the whole mix's output, fused and reference,
// for every band height, on every SIMD target.
TEST(Vit3TttFused, MixInBandsMatchesTheWholeMix) {
    torch::manual_seed(13);
    const int64_t B = 2, h = 2, d = 8, C = h * d, H = 7, W = 9;
    std::vector<Tensor> x{torch::randn({B, H * W, 3 * C + 3 * d}), 0.3 * torch::randn({1, h, d, d}),
                          0.3 * torch::randn({1, h, d, d}), 0.3 * torch::randn({d, 1, 3, 3})};
    torch::NoGradGuard no_grad;
    const Tensor whole = mix(x, h, H, W, Tensor(), Impl::Reference);
    for_each_simd_target([&](const SimdTarget&) {
        for (const Impl impl : {Impl::Reference, Impl::Fused})
            for (const int64_t rows : {int64_t{1}, int64_t{2}, int64_t{3}, H}) {
                const Tensor banded = mix_in_bands(x, h, H, W, rows, impl);
                ASSERT_EQ(banded.sizes(), whole.sizes());
                EXPECT_LT(relative_error(banded, whole), kF32RelTol)
                    << (impl == Impl::Fused ? "fused" : "reference") << ", bands of " << rows << " rows";
            }
    });
    // float64: the same values to the order of the sums.
    std::vector<Tensor> x64;
    for (const Tensor& t : x) x64.push_back(t.to(torch::kFloat64));
    EXPECT_LT(relative_error(mix_in_bands(x64, h, H, W, 3, Impl::Reference),
                             mix(x64, h, H, W, Tensor(), Impl::Reference)),
              1e-12);
    // bf16 inputs: computed in float32 (fused) or with float32 sums (reference), one rounding of the output more.
    std::vector<Tensor> x16;
    for (const Tensor& t : x) x16.push_back(t.to(torch::kBFloat16));
    for (const Impl impl : {Impl::Reference, Impl::Auto}) {
        const Tensor banded = mix_in_bands(x16, h, H, W, 2, impl);
        EXPECT_EQ(banded.scalar_type(), torch::kBFloat16);
        EXPECT_LT(relative_error(banded.to(torch::kFloat32), mix(x16, h, H, W, Tensor(), impl).to(torch::kFloat32)),
                  2e-2);
    }
}

// Bands come in order, every band's keys before any queries, each with its halo rows.
TEST(Vit3TttFused, MixInBandsRejectsMisuse) {
    const int64_t B = 1, h = 2, d = 8, C = h * d, H = 6, W = 4;
    const Tensor w = 0.3 * torch::randn({1, h, d, d}), w3 = 0.3 * torch::randn({d, 1, 3, 3});
    const Tensor kv = torch::randn({B, 4, W, 2 * C + 2 * d}), q = torch::randn({B, 4, W, C + d});
    torch::NoGradGuard no_grad;
    linvis::ops::Vit3TttInBands bands(w, w, w3, h, B, H, W);
    EXPECT_THROW(bands.accumulate(kv, 3, 5), linvis::Error);            // not the band from row 0
    EXPECT_THROW(bands.accumulate(kv.narrow(1, 0, 3), 0, 3), linvis::Error);  // without its halo row below
    bands.accumulate(kv, 0, 3);                                          // rows 0-3: the band and one halo row
    EXPECT_THROW(bands.apply(q, 1, 3), linvis::Error);                   // rows 3-6 not accumulated yet
    bands.accumulate(kv.narrow(1, 0, 4), 3, 6);
    EXPECT_EQ(bands.apply(q, 1, 3).sizes(), (std::vector<int64_t>{B, 2 * W, C + d}));
    EXPECT_THROW(bands.accumulate(kv, 0, 3), linvis::Error);            // keys after queries
    EXPECT_THROW(bands.apply(q.narrow(3, 0, C), 1, 3), linvis::Error);  // not [q1 | q2]
}

// Every vector target gives the scalar target's result to rounding (LINVIS_FORCE_SCALAR=1 is scalar too).
TEST(Vit3TttFused, AllSimdTargetsAgreeWithScalar) {
    torch::manual_seed(5);
    auto x = swiglu_inputs(1, 2, 400, 64, false);
    auto c = dwconv_inputs(1, 64, 20, 20);
    torch::NoGradGuard no_grad;
    Tensor scalar, scalar_c;
    {
        linvis::testing::ScopedSimd s({"scalar", linvis::ops::simd::Target::Scalar});
        scalar = swiglu(x, Impl::Fused);
        scalar_c = dwconv(c, Impl::Fused);
    }
    setenv("LINVIS_FORCE_SCALAR", "1", 1);
    EXPECT_STREQ(linvis::ops::fused_kernel_target(), "scalar");
    EXPECT_TRUE(torch::equal(swiglu(x, Impl::Fused), scalar));
    unsetenv("LINVIS_FORCE_SCALAR");
    for_each_simd_target([&](const SimdTarget&) {
        EXPECT_LT(relative_error(swiglu(x, Impl::Fused), scalar), 1e-5);
        EXPECT_LT(relative_error(dwconv(c, Impl::Fused), scalar_c), 1e-6);
    });
}

TEST(Vit3TttFused, BFloat16ComputesInFloat32) {
    torch::manual_seed(6);
    auto x = swiglu_inputs(1, 2, 300, 32, false, torch::kBFloat16);
    std::vector<Tensor> xf;
    for (const auto& t : x) xf.push_back(t.to(torch::kFloat32));
    Tensor probe = torch::randn({1, 2, 300, 32});
    auto ref = run_with_grads(xf, probe, [](const std::vector<Tensor>& l) { return swiglu(l, Impl::Reference); });
    auto fused = run_with_grads(x, probe.to(torch::kBFloat16),
                                [](const std::vector<Tensor>& l) { return swiglu(l, Impl::Fused); });
    for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_EQ(fused[i].scalar_type(), torch::kBFloat16);
        // Output: one bf16 rounding; gradients: the bf16 probe and bf16-rounded gradients.
        EXPECT_LT(relative_error(fused[i], ref[i]), 1e-2) << "tensor " << i;
    }
    auto c = dwconv_inputs(1, 16, 9, 11, torch::kBFloat16);
    std::vector<Tensor> cf;
    for (const auto& t : c) cf.push_back(t.to(torch::kFloat32));
    torch::NoGradGuard no_grad;
    EXPECT_LT(relative_error(dwconv(c, Impl::Fused), dwconv(cf, Impl::Reference)), 1e-2);
}

TEST(Vit3TttFused, MixBFloat16WithGradients) {
    torch::manual_seed(15);
    const int64_t B = 1, h = 2, d = 16, C = h * d, H = 8, W = 10;
    std::vector<Tensor> x{torch::randn({B, H * W, 3 * C + 3 * d}).to(torch::kBFloat16),
                          (0.3 * torch::randn({1, h, d, d})).to(torch::kBFloat16),
                          (0.3 * torch::randn({1, h, d, d})).to(torch::kBFloat16),
                          (0.3 * torch::randn({d, 1, 3, 3})).to(torch::kBFloat16)};
    std::vector<Tensor> xf;
    for (const auto& t : x) xf.push_back(t.to(torch::kFloat32));
    Tensor probe = torch::randn({B, H * W, C + d});
    auto ref = run_with_grads(xf, probe, [&](const std::vector<Tensor>& l) {
        return mix(l, h, H, W, Tensor(), Impl::Reference);
    });
    auto fused = run_with_grads(x, probe.to(torch::kBFloat16), [&](const std::vector<Tensor>& l) {
        return mix(l, h, H, W, Tensor(), Impl::Fused);
    });
    for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_EQ(fused[i].scalar_type(), torch::kBFloat16) << "tensor " << i;
        EXPECT_LT(relative_error(fused[i], ref[i]), 1e-2) << "tensor " << i;
    }
}

// float64 has no fused kernel: Auto runs the reference, Fused is an error naming the dtype.
// The mix (its SwiGLU branch's products on the tiles) and the same mix in bands of rows, d = 32 and 16.
TEST(Vit3TttFused, Bfloat16InferenceRunsItsProductsOnTheAmxTiles) {
    torch::manual_seed(16);
    struct Case {
        int64_t B, h, d, H, W;
    };
    for (const Case& c : {Case{1, 2, 32, 16, 16}, Case{2, 3, 16, 9, 14}}) {
        const int64_t C = c.h * c.d;
        const std::vector<Tensor> x{torch::randn({c.B, c.H * c.W, 3 * C + 3 * c.d}).to(torch::kBFloat16),
                                    (0.3 * torch::randn({1, c.h, c.d, c.d})).to(torch::kBFloat16),
                                    (0.3 * torch::randn({1, c.h, c.d, c.d})).to(torch::kBFloat16),
                                    (0.3 * torch::randn({c.d, 1, 3, 3})).to(torch::kBFloat16)};
        const std::string what = "ViT3 mix " + std::to_string(c.H) + "x" + std::to_string(c.W) + " d" +
                                 std::to_string(c.d);
        check_bf16_on_the_tiles(
            x, [&](const std::vector<Tensor>& l) { return mix(l, c.h, c.H, c.W, Tensor(), Impl::Fused); },
            kBf16TileBound, what);
        check_bf16_on_the_tiles(
            x, [&](const std::vector<Tensor>& l) { return mix_in_bands(l, c.h, c.H, c.W, 4, Impl::Fused); },
            kBf16TileBound, what + " in bands of 4 rows");
    }
}

TEST(Vit3TttFused, Float64AutoRunsReferenceFusedRefuses) {
    torch::manual_seed(7);
    auto x = swiglu_inputs(1, 2, 40, 8, false, torch::kFloat64);
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(swiglu(x, Impl::Auto), swiglu(x, Impl::Reference)));
    try {
        swiglu(x, Impl::Fused);
        ADD_FAILURE() << "impl fused accepted float64";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("cannot take this input: float32 or bfloat16 only, got Double"),
                  std::string::npos) << e.what();
    }
}

TEST(Vit3TttFused, InferenceBuildsNoGraph) {
    torch::manual_seed(8);
    auto x = swiglu_inputs(1, 1, 50, 8, false);
    for (auto& t : x) t = t.detach().requires_grad_(true);
    {
        torch::NoGradGuard no_grad;
        EXPECT_FALSE(swiglu(x, Impl::Fused).grad_fn());
    }
    EXPECT_TRUE(swiglu(x, Impl::Fused).grad_fn());
}

TEST(Vit3TttFused, BadShapesThrow) {
    auto x = swiglu_inputs(1, 2, 10, 8, false);
    x[3] = torch::randn({1, 2, 8, 7});
    EXPECT_THROW(swiglu(x, Impl::Fused), linvis::Error);
    auto c = dwconv_inputs(1, 8, 4, 4);
    c[3] = torch::randn({7, 1, 3, 3});
    EXPECT_THROW(dwconv(c, Impl::Fused), linvis::Error);
}

// ---------------------------------------------------------------- models

template <class ModelPtr>
void copy_parameters(const ModelPtr& from, const ModelPtr& to) {
    torch::NoGradGuard no_grad;
    auto dst = to->named_parameters(true);
    for (const auto& item : from->named_parameters(true)) dst[item.key()].copy_(item.value());
    auto dst_buf = to->named_buffers(true);
    for (const auto& item : from->named_buffers(true)) dst_buf[item.key()].copy_(item.value());
}

void check_model(const std::string& name, std::map<std::string, std::string> options, int64_t img) {
    torch::manual_seed(9);
    options["impl"] = "reference";
    auto ref = linvis::models::create_model(name, linvis::models::ModelConfig(options));
    options["impl"] = "fused";
    auto fused = linvis::models::create_model(name, linvis::models::ModelConfig(options));
    copy_parameters(ref, fused);
    ref->eval();
    fused->eval();
    Tensor x = torch::randn({2, 3, img, img});
    Tensor probe;
    std::vector<Tensor> outs;
    for (auto& m : {ref, fused}) {
        Tensor xi = x.clone().requires_grad_(true);
        Tensor logits = m->forward(xi);
        if (!probe.defined()) probe = torch::randn(logits.sizes());
        (logits * probe).sum().backward();
        outs.push_back(logits.detach());
        outs.push_back(xi.grad());
    }
    EXPECT_LT(relative_error(outs[2], outs[0]), kF32RelTol) << name << " logits";
    EXPECT_LT(relative_error(outs[3], outs[1]), kF32RelTol) << name << " input gradient";
    // Parameter gradients of the TTT weights also agree.
    auto pr = ref->named_parameters(true), pf = fused->named_parameters(true);
    int checked = 0;
    for (const auto& item : pr) {
        if (!item.value().grad().defined()) continue;
        EXPECT_LT(relative_error(pf[item.key()].grad(), item.value().grad()), 1e-3) << name << " " << item.key();
        ++checked;
    }
    EXPECT_GT(checked, 0);
}

TEST(Vit3TttFused, Vit3TinyModelMatchesReference) {
    check_model("vit3_tiny", {{"depth", "2"}, {"img_size", "64"}, {"num_classes", "10"}}, 64);
}

TEST(Vit3TttFused, HVit3TinyModelMatchesReference) {
    check_model("hvit3_tiny", {{"depths", "1,1,1,1"}, {"img_size", "64"}, {"num_classes", "10"}}, 64);
}

// ---------------------------------------------------------------- T5

struct T5Case {
    int64_t B, H, W, C, heads;
};

// q, k, v (B, N, C) chunks of one qkv buffer plus the seven parameters.
std::vector<Tensor> t5_inputs(const T5Case& c, torch::Dtype dtype = torch::kFloat32) {
    const int64_t N = c.H * c.W, d = c.C / c.heads;
    Tensor qkv = torch::randn({c.B, N, 3 * c.C}, dtype);
    auto chunks = qkv.chunk(3, -1);
    auto p = [&](std::vector<int64_t> shape, double s) { return (s * torch::randn(shape)).to(dtype); };
    return {chunks[0], chunks[1], chunks[2], p({1, c.heads, d, d}, 0.3), p({1, c.heads, d, d}, 0.3),
            p({1, c.heads, d, d}, 0.3), p({c.C, 1, 3, 3}, 0.3), p({c.C}, 0.3), p({c.C, 1, 3, 3}, 0.3), p({c.C}, 0.3)};
}

Tensor t5(const std::vector<Tensor>& x, const T5Case& c, Impl impl) {
    linvis::ops::T5TttParams p{x[3], x[4], x[5], x[6], x[7], x[8], x[9]};
    return linvis::ops::t5_ttt_attention(x[0], x[1], x[2], p, c.heads, c.H, c.W, impl);
}

void check_t5(const T5Case& c, const std::string& what) {
    auto x = t5_inputs(c);
    Tensor probe = torch::randn({c.B, c.H * c.W, c.C});
    auto ref = run_with_grads(x, probe, [&](const std::vector<Tensor>& l) { return t5(l, c, Impl::Reference); });
    auto fused = run_with_grads(x, probe, [&](const std::vector<Tensor>& l) { return t5(l, c, Impl::Fused); });
    expect_all_match(fused, ref, kF32RelTol, what);
}

TEST(T5TttFused, AttentionMatchesReference) {
    for_each_simd_target([](const SimdTarget&) {
        torch::manual_seed(10);
        // Token blocks: max(2, ceil(N / 256)) of equal length (up to one token); reduction groups of ceil(blocks / 8)
        // blocks.
        check_t5({1, 4, 5, 16, 2}, "B1 4x5 C16 h2");  // N = 20: two blocks of 10
        check_t5({2, 17, 19, 48, 3}, "B2 17x19 C48 h3");  // N = 323: blocks of 162 and 161
        check_t5({1, 16, 32, 128, 2}, "B1 16x32 C128 h2");  // d = 64, N = 512: two exact blocks of 256
        check_t5({2, 3, 1, 12, 1}, "3x1 grid, one head");  // N = 3: blocks of 2 and 1
        check_t5({1, 33, 40, 16, 2}, "B1 33x40 C16 h2");  // N = 1320: 6 blocks of 220, one per group
        check_t5({1, 48, 48, 16, 2}, "B1 48x48 C16 h2");  // N = 2304: 9 blocks in 5 groups (the last of one block)
        check_t5({2, 11, 13, 24, 2}, "B2 11x13 C24 h2");  // d = 12
    });
}

TEST(T5TttFused, QkvEntryMatchesReference) {
    torch::manual_seed(14);
    const T5Case c{2, 9, 14, 32, 2};
    auto x = t5_inputs(c);
    x[0] = torch::randn({c.B, c.H * c.W, 3 * c.C});  // qkv
    x.erase(x.begin() + 1, x.begin() + 3);
    auto run = [&](const std::vector<Tensor>& l, Impl impl) {
        linvis::ops::T5TttParams p{l[1], l[2], l[3], l[4], l[5], l[6], l[7]};
        return linvis::ops::t5_ttt_attention_qkv(l[0], p, c.heads, c.H, c.W, impl);
    };
    Tensor probe = torch::randn({c.B, c.H * c.W, c.C});
    auto ref = run_with_grads(x, probe, [&](const std::vector<Tensor>& l) { return run(l, Impl::Reference); });
    for_each_simd_target([&](const SimdTarget&) {
        auto fused = run_with_grads(x, probe, [&](const std::vector<Tensor>& l) { return run(l, Impl::Fused); });
        expect_all_match(fused, ref, kF32RelTol, "qkv entry");
    });
    auto bad = x;
    bad[0] = torch::randn({c.B, c.H * c.W, 3 * c.C - 1});  // not 3C wide
    EXPECT_THROW(run(bad, Impl::Fused), linvis::Error);
    bad[0] = torch::randn({c.B, c.H * c.W + 1, 3 * c.C});  // N != H*W
    EXPECT_THROW(run(bad, Impl::Fused), linvis::Error);
}

TEST(T5TttFused, BFloat16ComputesInFloat32) {
    torch::manual_seed(12);
    const T5Case c{1, 12, 12, 32, 2};
    auto x = t5_inputs(c, torch::kBFloat16);
    std::vector<Tensor> xf;
    for (const auto& t : x) xf.push_back(t.to(torch::kFloat32));
    Tensor probe = torch::randn({1, 144, 32});
    auto ref = run_with_grads(xf, probe, [&](const std::vector<Tensor>& l) { return t5(l, c, Impl::Reference); });
    auto fused = run_with_grads(x, probe.to(torch::kBFloat16),
                                [&](const std::vector<Tensor>& l) { return t5(l, c, Impl::Fused); });
    for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_EQ(fused[i].scalar_type(), torch::kBFloat16);
        EXPECT_LT(relative_error(fused[i], ref[i]), 1e-2) << "tensor " << i;
    }
}

// check_bf16_on_the_tiles for T5 and DiT5 (inputs(case, dtype), op(inputs, case, impl)): d = 64 in two whole blocks
// of 256 tokens, and d = 16 in blocks of 162 and 161 tokens (products padded to whole tiles).
template <typename Inputs, typename Op>
void check_t5_kind_on_the_tiles(const std::string& name, Inputs inputs, Op op) {
    for (const T5Case& c : {T5Case{1, 16, 32, 128, 2}, T5Case{2, 17, 19, 48, 3}}) {
        check_bf16_on_the_tiles(inputs(c, torch::kBFloat16),
                                [&](const std::vector<Tensor>& x) { return op(x, c, Impl::Fused); }, kBf16TileBound,
                                name + " " + std::to_string(c.H) + "x" + std::to_string(c.W) + " C" +
                                    std::to_string(c.C));
    }
}

TEST(T5TttFused, Bfloat16InferenceRunsItsProductsOnTheAmxTiles) {
    torch::manual_seed(15);
    check_t5_kind_on_the_tiles("T5", t5_inputs, t5);
}

TEST(T5TttFused, Float64FallsBackAndInferenceBuildsNoGraph) {
    torch::manual_seed(13);
    const T5Case c{1, 5, 5, 8, 2};
    auto x = t5_inputs(c, torch::kFloat64);
    {
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(torch::equal(t5(x, c, Impl::Auto), t5(x, c, Impl::Reference)));
        EXPECT_THROW(t5(x, c, Impl::Fused), linvis::Error);  // no float64 kernel, and no silent fallback
    }
    auto y = t5_inputs(c);
    for (auto& t : y) t = t.detach().requires_grad_(true);
    {
        torch::NoGradGuard no_grad;
        EXPECT_FALSE(t5(y, c, Impl::Fused).grad_fn());
    }
    EXPECT_TRUE(t5(y, c, Impl::Fused).grad_fn());
    y[6] = torch::randn({8, 1, 3, 2});
    EXPECT_THROW(t5(y, c, Impl::Fused), linvis::Error);
}

TEST(T5TttFused, T5TinyModelMatchesReference) {
    check_model("t5_tiny", {{"depth", "2"}, {"img_size", "64"}, {"num_classes", "10"}}, 64);
}

// ---------------------------------------------------------------- DiT5's TTT branch

// q, k, v (B, N, C) chunks of one qkv buffer plus the eight parameters (w1, w2, qk_scale_ttt, qk_offset_ttt,
// the q and k convs), the scale around 1 and the offset around 0 so that neither is an identity.
std::vector<Tensor> dit5_inputs(const T5Case& c, torch::Dtype dtype = torch::kFloat32) {
    const int64_t N = c.H * c.W, d = c.C / c.heads;
    Tensor qkv = torch::randn({c.B, N, 3 * c.C}, dtype);
    auto chunks = qkv.chunk(3, -1);
    auto p = [&](std::vector<int64_t> shape, double s) { return (s * torch::randn(shape)).to(dtype); };
    return {chunks[0], chunks[1], chunks[2], p({1, c.heads, d, d}, 0.3), p({1, c.heads, d, d}, 0.3),
            (1.0 + p({1, 1, c.C, 2}, 0.3)).to(dtype), p({1, 1, c.C, 2}, 0.3), p({c.C, 1, 3, 3}, 0.3), p({c.C}, 0.3),
            p({c.C, 1, 3, 3}, 0.3), p({c.C}, 0.3)};
}

Tensor dit5(const std::vector<Tensor>& x, const T5Case& c, Impl impl) {
    linvis::ops::Dit5TttParams p{x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10]};
    return linvis::ops::dit5_ttt_attention(x[0], x[1], x[2], p, c.heads, c.H, c.W, impl);
}

void check_dit5(const T5Case& c, const std::string& what) {
    auto x = dit5_inputs(c);
    Tensor probe = torch::randn({c.B, c.H * c.W, c.C});
    auto ref = run_with_grads(x, probe, [&](const std::vector<Tensor>& l) { return dit5(l, c, Impl::Reference); });
    auto fused = run_with_grads(x, probe, [&](const std::vector<Tensor>& l) { return dit5(l, c, Impl::Fused); });
    expect_all_match(fused, ref, kF32RelTol, what);
}

// Output and the gradients of all eleven inputs (q, k, v, w1, w2, the affine, both convs) on every SIMD target.
TEST(Dit5TttFused, MatchesReference) {
    for_each_simd_target([](const SimdTarget&) {
        torch::manual_seed(20);
        check_dit5({1, 4, 5, 16, 2}, "B1 4x5 C16 h2");    // N = 20: two blocks of 10
        check_dit5({2, 17, 19, 48, 3}, "B2 17x19 C48 h3");  // N = 323: blocks of 162 and 161
        check_dit5({1, 16, 32, 128, 2}, "B1 16x32 C128 h2");  // d = 64, N = 512: two exact blocks of 256
        check_dit5({2, 3, 1, 12, 1}, "3x1 grid, one head");  // N = 3: blocks of 2 and 1
        check_dit5({1, 48, 48, 16, 2}, "B1 48x48 C16 h2");  // N = 2304: 9 blocks in 5 groups (the last of one block)
        check_dit5({2, 11, 13, 24, 2}, "B2 11x13 C24 h2");  // d = 12
    });
}

TEST(Dit5TttFused, BFloat16ComputesInFloat32) {
    torch::manual_seed(21);
    const T5Case c{1, 12, 12, 32, 2};
    auto x = dit5_inputs(c, torch::kBFloat16);
    std::vector<Tensor> xf;
    for (const auto& t : x) xf.push_back(t.to(torch::kFloat32));
    Tensor probe = torch::randn({1, 144, 32});
    auto ref = run_with_grads(xf, probe, [&](const std::vector<Tensor>& l) { return dit5(l, c, Impl::Reference); });
    auto fused = run_with_grads(x, probe.to(torch::kBFloat16),
                                [&](const std::vector<Tensor>& l) { return dit5(l, c, Impl::Fused); });
    for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_EQ(fused[i].scalar_type(), torch::kBFloat16);
        EXPECT_LT(relative_error(fused[i], ref[i]), 1e-2) << "tensor " << i;
    }
}

TEST(Dit5TttFused, Bfloat16InferenceRunsItsProductsOnTheAmxTiles) {
    torch::manual_seed(23);
    check_t5_kind_on_the_tiles("DiT5", dit5_inputs, dit5);
}

TEST(Dit5TttFused, Float64FallsBackAndInferenceBuildsNoGraph) {
    torch::manual_seed(22);
    const T5Case c{1, 5, 5, 8, 2};
    auto x = dit5_inputs(c, torch::kFloat64);
    {
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(torch::equal(dit5(x, c, Impl::Auto), dit5(x, c, Impl::Reference)));
        EXPECT_THROW(dit5(x, c, Impl::Fused), linvis::Error);  // no float64 kernel, and no silent fallback
    }
    auto y = dit5_inputs(c);
    for (auto& t : y) t = t.detach().requires_grad_(true);
    {
        torch::NoGradGuard no_grad;
        EXPECT_FALSE(dit5(y, c, Impl::Fused).grad_fn());
    }
    EXPECT_TRUE(dit5(y, c, Impl::Fused).grad_fn());
    auto bad = y;
    bad[7] = torch::randn({8, 1, 3, 2});  // q conv weight
    EXPECT_THROW(dit5(bad, c, Impl::Fused), linvis::Error);
    bad = y;
    bad[6] = torch::randn({1, 1, 8, 1});  // qk_offset_ttt
    EXPECT_THROW(dit5(bad, c, Impl::Fused), linvis::Error);
}

// A DiT5 (both mixers fused: the token grid 8 x 8 holds the 5 x 5 neighbourhood) against impl=reference: the
// output and the gradients of the input and of every parameter.
TEST(Dit5TttFused, Dit5ModelMatchesReference) {
    torch::manual_seed(23);
    std::map<std::string, std::string> options{
        {"input_size", "16"}, {"hidden_size", "96"}, {"depth", "2"}, {"num_heads", "3"}, {"num_classes", "10"}};
    std::vector<linvis::models::DiffusionModelPtr> models;
    for (const char* impl : {"reference", "fused"}) {
        options["impl"] = impl;
        models.push_back(linvis::models::create_diffusion_model("dit5_s2", linvis::models::ModelConfig(options)));
    }
    {
        torch::NoGradGuard no_grad;  // move every parameter off its initial value (adaLN and the output start at 0)
        for (auto& item : models[0]->named_parameters(true)) item.value().add_(0.05 * torch::randn_like(item.value()));
    }
    copy_parameters(models[0], models[1]);
    Tensor x = torch::randn({2, 4, 16, 16}), t = torch::tensor({3, 700}), y = torch::tensor({1, 7});
    Tensor probe;
    std::vector<Tensor> outs;
    for (auto& m : models) {
        m->eval();  // train mode drops labels at random
        Tensor xi = x.clone().requires_grad_(true);
        Tensor out = m->forward(xi, t, y);
        if (!probe.defined()) probe = torch::randn(out.sizes());
        (out * probe).sum().backward();
        outs.push_back(out.detach());
        outs.push_back(xi.grad());
    }
    EXPECT_LT(relative_error(outs[2], outs[0]), kF32RelTol) << "output";
    EXPECT_LT(relative_error(outs[3], outs[1]), kF32RelTol) << "input gradient";
    auto pr = models[0]->named_parameters(true), pf = models[1]->named_parameters(true);
    int checked = 0;
    for (const auto& item : pr) {
        if (!item.value().grad().defined()) continue;
        EXPECT_LT(relative_error(pf[item.key()].grad(), item.value().grad()), 1e-3) << item.key();
        checked += item.key().find("qk_scale_ttt") != std::string::npos ? 1 : 0;
    }
    EXPECT_EQ(checked, 2);  // both blocks' affine was reached
}

}  // namespace
