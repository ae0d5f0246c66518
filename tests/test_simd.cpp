// The SIMD layer of the fused kernels (src/ops/simd): the register-blocked GEMM, the sigmoid, exp and 3x3 stencil
// row of every target this CPU runs against LibTorch, silu_mul's rows and backward and the attention's softmax
// kernels against their definition, and the choice of target through LINVIS_SIMD / LINVIS_FORCE_SCALAR.
// The GEMM cases have odd M, N, K (rows below a tile's height in tiles of 4 and 1, rows above it split into tiles of
// even heights, column tails of every mask width) and C with a guard band beyond column N that must stay untouched:
// a wrong tail mask fails them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "linvis/core/error.h"
#include "linvis/ops/impl.h"
#include "support/simd_targets.h"

namespace {

namespace simd = linvis::ops::simd;
using linvis::testing::for_each_simd_target;
using linvis::testing::SimdTarget;

template <typename T>
void check_gemm(const simd::Kernels& k, int64_t M, int64_t N, int64_t K, bool transposed_a, bool accumulate) {
    constexpr auto dtype = std::is_same_v<T, float> ? torch::kFloat32 : torch::kFloat64;
    const std::string what = "M" + std::to_string(M) + " N" + std::to_string(N) + " K" + std::to_string(K) +
                             (transposed_a ? " A^T" : " A") + (accumulate ? " +=" : " =");
    const int64_t pad = 7, ldb = N + 3, ldc = N + pad;
    // A stored as (M, K) or, for Aᵀ·B, as (K, M).
    torch::Tensor a_store = transposed_a ? torch::randn({K, M}, dtype) : torch::randn({M, K}, dtype);
    torch::Tensor A = transposed_a ? a_store.t() : a_store;
    // B inside a wider buffer whose extra columns hold NaN (a product must never read them into C[:, :N]).
    torch::Tensor b_buf = torch::full({K, ldb}, std::numeric_limits<double>::quiet_NaN(), dtype);
    b_buf.narrow(1, 0, N).copy_(torch::randn({K, N}, dtype));
    const double sentinel = 12345.0;
    torch::Tensor c_buf = torch::full({M, ldc}, sentinel, dtype);
    torch::Tensor c0 = torch::randn({M, N}, dtype);
    c_buf.narrow(1, 0, N).copy_(c0);
    const T* a = a_store.template data_ptr<T>();
    const int64_t a_row = transposed_a ? 1 : K, a_col = transposed_a ? M : 1;
    if constexpr (std::is_same_v<T, float>)
        k.gemm(M, N, K, a, a_row, a_col, b_buf.data_ptr<float>(), ldb, c_buf.data_ptr<float>(), ldc, accumulate);
    else
        k.gemm_f64(M, N, K, a, a_row, a_col, b_buf.data_ptr<double>(), ldb, c_buf.data_ptr<double>(), ldc, accumulate);
    torch::Tensor expected = torch::matmul(A.to(torch::kFloat64), b_buf.narrow(1, 0, N).to(torch::kFloat64));
    if (accumulate) expected += c0.to(torch::kFloat64);
    const double tol = (std::is_same_v<T, float> ? 1e-5 : 1e-12) * std::sqrt(static_cast<double>(K) + 1.0);
    torch::Tensor got = c_buf.narrow(1, 0, N).to(torch::kFloat64);
    EXPECT_TRUE(torch::allclose(got, expected, tol, tol)) << what << ": max error "
                                                          << (got - expected).abs().max().item<double>();
    EXPECT_TRUE(torch::all(c_buf.narrow(1, N, pad) == sentinel).item<bool>()) << what << ": wrote beyond column N";
}

TEST(SimdLayer, GemmMatchesMatmulOnEveryTarget) {
    torch::manual_seed(0);
    for_each_simd_target([](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        EXPECT_EQ(k.target, t.target);
        for (int64_t M : {1, 3, 5, 13, 17, 30, 32, 45})
            for (int64_t N : {1, 3, 7, 8, 15, 16, 17, 32, 33, 48, 64, 65, 100})
                for (int64_t K : {0, 1, 6, 19})
                    for (bool transposed : {false, true})
                        for (bool accumulate : {false, true}) check_gemm<float>(k, M, N, K, transposed, accumulate);
        for (int64_t N : {1, 5, 9, 31})
            for (bool transposed : {false, true}) check_gemm<double>(k, 11, N, 7, transposed, true);
        // The active-target table is the same one.
        EXPECT_EQ(&simd::kernels(), &k);
    });
}

TEST(SimdLayer, SigmoidMatchesTorchOnEveryTarget) {
    torch::manual_seed(1);
    for_each_simd_target([](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        for (int64_t n : {0, 1, 3, 8, 15, 16, 17, 40, 129}) {
            torch::Tensor x = 6.0 * torch::randn({n + 4});
            if (n >= 3) {
                x[0] = 100.0f;
                x[1] = -100.0f;
                x[2] = 0.0f;
            }
            torch::Tensor y = torch::full({n + 4}, 7.0f);
            k.sigmoid(x.data_ptr<float>(), y.data_ptr<float>(), n);
            torch::Tensor expected = torch::sigmoid(x.narrow(0, 0, n));
            EXPECT_TRUE(torch::allclose(y.narrow(0, 0, n), expected, 1e-6, 1e-7)) << "n = " << n;
            EXPECT_TRUE(torch::all(y.narrow(0, n, 4) == 7.0f).item<bool>()) << "n = " << n << ": wrote beyond n";
        }
    });
}

// silu_mul over strided rows and its backward in place, against float64 of the definitions: two rows of n values
// side by side in one buffer (the layout of one product's output, [u | g] per row), a guard column after them that
// must stay untouched, and y / dy in rows of their own strides.
TEST(SimdLayer, SiluMulRowsAndBackwardMatchTheDefinitionOnEveryTarget) {
    torch::manual_seed(3);
    for_each_simd_target([](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        for (int64_t n : {1, 7, 16, 17, 32, 40}) {
            const int64_t rows = 5, ld = 2 * n + 1, ldy = n + 3;
            const std::string what = std::string(t.env) + ", n = " + std::to_string(n);
            torch::Tensor buf = 4.0 * torch::randn({rows, ld});
            buf[0][n] = 100.0f;  // gates far out on both sides: silu saturates without NaN
            buf[1][n] = -100.0f;
            const torch::Tensor u = buf.narrow(1, 0, n).to(torch::kFloat64);
            const torch::Tensor g = buf.narrow(1, n, n).to(torch::kFloat64);
            const torch::Tensor s = torch::sigmoid(g);

            torch::Tensor y = torch::full({rows, ldy}, 7.0f);
            k.silu_mul_rows(buf.data_ptr<float>() + n, buf.data_ptr<float>(), ld, rows, n, y.data_ptr<float>(), ldy);
            const torch::Tensor expected = g * s * u;
            EXPECT_TRUE(torch::allclose(y.narrow(1, 0, n).to(torch::kFloat64), expected, 1e-6, 1e-6)) << what;
            EXPECT_TRUE(torch::all(y.narrow(1, n, ldy - n) == 7.0f).item<bool>()) << what << ": y written past n";

            const float c = -0.37f;
            const torch::Tensor dy = torch::randn({rows, ldy});
            torch::Tensor out = buf.clone();
            k.silu_mul_backward_rows(out.data_ptr<float>() + n, out.data_ptr<float>(), ld, rows, n,
                                     dy.data_ptr<float>(), ldy, c);
            const torch::Tensor e = c * dy.narrow(1, 0, n).to(torch::kFloat64);
            const torch::Tensor du = e * g * s, dg = e * u * s * (1.0 + g * (1.0 - s));
            EXPECT_TRUE(torch::allclose(out.narrow(1, 0, n).to(torch::kFloat64), du, 1e-6, 1e-6)) << what << ": du";
            EXPECT_TRUE(torch::allclose(out.narrow(1, n, n).to(torch::kFloat64), dg, 1e-6, 1e-6)) << what << ": dg";
            EXPECT_TRUE(torch::equal(out.narrow(1, 2 * n, 1), buf.narrow(1, 2 * n, 1))) << what << ": guard written";
        }
    });
}

// The backward of silu_mul_backward_rows' map (z1, z2, e = c v) -> [e silu(z2) | e z1 silu'(z2)] (ViT3's inner step),
// against float64 autograd of that map: the map recomputed into z, [dz1 | dz2] into dp, dv in rows of its own
// stride; guard columns after each row stay untouched.
TEST(SimdLayer, SiluMulBackwardRowsBackwardIsTheMapsGradientOnEveryTarget) {
    torch::manual_seed(4);
    for_each_simd_target([](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        for (int64_t n : {1, 7, 16, 17, 32, 40}) {
            const int64_t rows = 5, ld = 2 * n + 1, ldv = n + 2, lddv = n + 3;
            const std::string what = std::string(t.env) + ", n = " + std::to_string(n);
            const float c = -0.37f;
            const torch::Tensor z = 3.0 * torch::randn({rows, ld}), dp = torch::randn({rows, ld});
            const torch::Tensor v = torch::randn({rows, ldv});
            z[0][n] = 60.0f;  // gates far out on both sides: the sigmoid saturates without NaN
            z[1][n] = -60.0f;

            const auto f64 = [](const torch::Tensor& x) { return x.to(torch::kFloat64).detach().requires_grad_(); };
            const torch::Tensor z1 = f64(z.narrow(1, 0, n)), z2 = f64(z.narrow(1, n, n)), v64 = f64(v.narrow(1, 0, n));
            const torch::Tensor e = c * v64, s = torch::sigmoid(z2);
            const torch::Tensor p1 = e * z2 * s, p2 = e * z1 * s * (1.0 + z2 * (1.0 - s));
            const torch::Tensor dp1 = dp.narrow(1, 0, n).to(torch::kFloat64);
            const torch::Tensor dp2 = dp.narrow(1, n, n).to(torch::kFloat64);
            const auto grads = torch::autograd::grad({(p1 * dp1 + p2 * dp2).sum()}, {z1, z2, v64});

            torch::Tensor zo = z.clone(), dpo = dp.clone(), dv = torch::full({rows, lddv}, 7.0f);
            k.silu_mul_backward_rows_backward(zo.data_ptr<float>(), dpo.data_ptr<float>(), ld, rows, n,
                                              v.data_ptr<float>(), ldv, c, dv.data_ptr<float>(), lddv);
            const auto close = [](const torch::Tensor& got, const torch::Tensor& want) {
                return torch::allclose(got.to(torch::kFloat64), want.detach(), 1e-5, 1e-5);
            };
            EXPECT_TRUE(close(zo.narrow(1, 0, n), p1)) << what << ": p1";
            EXPECT_TRUE(close(zo.narrow(1, n, n), p2)) << what << ": p2";
            EXPECT_TRUE(close(dpo.narrow(1, 0, n), grads[0])) << what << ": dz1";
            EXPECT_TRUE(close(dpo.narrow(1, n, n), grads[1])) << what << ": dz2";
            EXPECT_TRUE(close(dv.narrow(1, 0, n), grads[2])) << what << ": dv";
            EXPECT_TRUE(torch::equal(zo.narrow(1, 2 * n, 1), z.narrow(1, 2 * n, 1))) << what << ": z's guard written";
            EXPECT_TRUE(torch::equal(dpo.narrow(1, 2 * n, 1), dp.narrow(1, 2 * n, 1))) << what << ": dp's guard";
            EXPECT_TRUE(torch::all(dv.narrow(1, n, lddv - n) == 7.0f).item<bool>()) << what << ": dv written past n";
        }
    });
}

// exp(x - shift) as the mLSTM's stabilised gates use it: arguments from 0 down to far below float's range (where
// the result is 0 or subnormal), in place, a shift of 0 and a large one.
TEST(SimdLayer, ExpSubMatchesTorchOnEveryTarget) {
    torch::manual_seed(2);
    for_each_simd_target([](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        for (const float shift : {0.0f, 37.5f}) {
            for (int64_t n : {0, 1, 3, 8, 15, 16, 17, 40, 129}) {
                torch::Tensor x = shift - 20.0 * torch::rand({n + 4});
                if (n >= 3) {
                    x[0] = shift;  // exp(0) = 1
                    x[1] = shift - 200.0f;  // below float's range: 0
                    x[2] = shift + 3.0f;
                }
                torch::Tensor y = x.clone();
                y.narrow(0, n, 4).fill_(7.0f);
                k.exp_sub(y.data_ptr<float>(), shift, y.data_ptr<float>(), n);  // in place
                torch::Tensor expected = torch::exp(x.narrow(0, 0, n).to(torch::kFloat64) - shift).to(torch::kFloat32);
                EXPECT_TRUE(torch::allclose(y.narrow(0, 0, n), expected, 1e-6, 1e-30))
                    << "n = " << n << ", shift " << shift << ", max error "
                    << (y.narrow(0, 0, n) - expected).abs().max().item<float>();
                EXPECT_TRUE(torch::all(y.narrow(0, n, 4) == 7.0f).item<bool>()) << "n = " << n << ": wrote beyond n";
            }
        }
    });
}

// The exponential's edges (kernels.cpp, exp_clamped) through the three kernels built on it: 0 below -87 and for -inf,
// exp(88) for anything above, NaN kept; the sigmoid saturates at +-inf, GELU(+inf) = inf, NaN stays NaN; exp(0) = 1.
TEST(SimdLayer, ExponentialEdgesOnEveryTarget) {
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    for_each_simd_target([&](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        // Enough values for a whole vector and a masked tail on every target.
        const std::vector<float> x = {-inf, -200.0f, -87.5f, -86.9f, -20.0f, 0.0f, 1.0f, 87.9f, 88.0f, 95.0f, inf, nan,
                                      0.5f, -0.5f, 3.0f, -3.0f, 10.0f, -10.0f, 2.0f};
        const int64_t n = static_cast<int64_t>(x.size());
        std::vector<float> e(x.size()), s(x.size()), g(x.size());
        k.exp_sub(x.data(), 0.0f, e.data(), n);
        k.sigmoid(x.data(), s.data(), n);
        k.gelu_erf(x.data(), nullptr, g.data(), n);
        for (int64_t i = 0; i < n; ++i) {
            const float v = x[static_cast<size_t>(i)];
            const size_t j = static_cast<size_t>(i);
            const std::string at = std::string(t.env) + " x = " + std::to_string(v);
            if (std::isnan(v)) {
                EXPECT_TRUE(std::isnan(e[j]) && std::isnan(s[j]) && std::isnan(g[j])) << at;
                continue;
            }
            const double expected_exp = v < -87.0f ? 0.0 : std::exp(std::min(static_cast<double>(v), 88.0));
            EXPECT_NEAR(e[j], expected_exp, 3e-7 * expected_exp) << at;
            EXPECT_NEAR(s[j], 1.0 / (1.0 + std::exp(-static_cast<double>(v))), 1e-7) << at;
            EXPECT_FALSE(std::isnan(s[j])) << at;
            // GELU(-inf) is -inf * 0 in x/2 (1 + erf): NaN, as LibTorch's formula gives; not asserted.
            if (v == inf) EXPECT_EQ(g[j], inf) << at;
            else if (v != -inf)
                EXPECT_NEAR(g[j], 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))),
                            2e-7 * std::max(1.0, std::abs(static_cast<double>(v)))) << at;
        }
        EXPECT_EQ(e[5], 1.0f) << t.env << ": exp(0)";
    });
}

// One row of the 3x3 depthwise stencil against LibTorch's conv2d (float64) of a three-row image. `live` says which
// source rows exist (bit r: row r; a missing one is the image's top or bottom edge). Source and output rows sit
// inside wider buffers whose extra columns hold NaN (never to be read) or a sentinel (never to be written).
void check_stencil_row(const simd::Kernels& k, int64_t C, int64_t W, int live, bool flip, bool bias_and_accumulate) {
    const std::string what = "C" + std::to_string(C) + " W" + std::to_string(W) + " rows " + std::to_string(live) +
                             (flip ? " flipped" : "") + (bias_and_accumulate ? " bias +=" : "");
    const int64_t sx = C + 3, osx = C + 2;
    torch::Tensor src = torch::full({3, W, sx}, std::nan(""));
    torch::Tensor img = torch::randn({3, W, C});
    src.narrow(2, 0, C).copy_(img);
    torch::Tensor taps = torch::randn({9, C}), bias = torch::randn({C});
    torch::Tensor out = torch::full({W, osx}, 12345.0f), start = torch::randn({W, C});
    if (bias_and_accumulate) out.narrow(1, 0, C).copy_(start);
    const float* rows[3];
    for (int r = 0; r < 3; ++r) {
        const bool present = (live >> r & 1) != 0;
        rows[r] = present ? src[r].data_ptr<float>() : nullptr;
        if (!present) img[r].zero_();
    }
    const float* bias_or_null = bias_and_accumulate ? bias.data_ptr<float>() : nullptr;
    k.stencil3x3_row(rows, sx, W, C, taps.data_ptr<float>(), flip, bias_or_null, out.data_ptr<float>(), osx,
                     bias_and_accumulate);
    // conv2d is a cross-correlation; flipped, tap (r, j) meets column x - (j - 1).
    torch::Tensor w = taps.to(torch::kFloat64).t().reshape({C, 1, 3, 3});
    if (flip) w = w.flip({3});
    torch::Tensor x = img.to(torch::kFloat64).permute({2, 0, 1}).unsqueeze(0);
    torch::Tensor expected = torch::conv2d(x, w, torch::Tensor(), 1, std::vector<int64_t>{0, 1}, 1, C);
    expected = expected.squeeze(0).squeeze(1).t();  // (W, C)
    if (bias_and_accumulate) expected += bias.to(torch::kFloat64) + start.to(torch::kFloat64);
    const torch::Tensor got = out.narrow(1, 0, C).to(torch::kFloat64);
    EXPECT_TRUE(torch::allclose(got, expected, 1e-5, 1e-5))
        << what << ": max error " << (got - expected).abs().max().item<double>();
    EXPECT_TRUE(torch::all(out.narrow(1, C, 2) == 12345.0f).item<bool>()) << what << ": wrote beyond C";
}

// check(kernels, C, W, live) on every target for channel counts with and without a vector tail, widths down to 1
// and every combination of missing rows.
template <class Check>
void for_each_stencil_case(Check check) {
    for_each_simd_target([&](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        for (const int64_t C : {1, 7, 16, 24, 40})
            for (const int64_t W : {1, 2, 5})
                for (int live = 1; live < 8; ++live) check(k, C, W, live);
    });
}

// Each case also with taps flipped along x (the transposed convolution) and with a bias and accumulation.
// The attention's online softmax over two key tiles (simd.h, SoftmaxTileCols): 21 queries in panels of 16 (the
// second panel 11 queries and 5 of padding), 7 keys then 5, the second tile's logits raised by 5 for every third
// query so that its running maximum rises there and stays elsewhere. Against the definition in double from the same
// inputs; the space after each panel and past the next multiple of 16 in m, l and alpha is a guard band.
template <typename T>
void check_online_softmax_cols(const simd::Kernels& k, const std::string& target) {
    const int64_t Q = 21, pw = 16, panels = 2, dv = 3, ldo = 32, guard = 3, width = panels * pw;
    const T sentinel = T(7);
    std::mt19937 rng(11);
    std::normal_distribution<double> normal;
    std::vector<T> m(width + guard, sentinel), l(width + guard, sentinel), alpha(width + guard, sentinel);
    std::vector<T> o(dv * ldo);
    for (auto& x : o) x = static_cast<T>(normal(rng));
    const std::vector<T> o_before = o;
    std::vector<double> m_ref(Q), l_ref(Q);
    for (const int64_t keys : {7, 5}) {
        const bool first = keys == 7;
        const int64_t stride = keys * pw + guard;
        std::vector<T> tile(panels * stride, sentinel);
        for (int64_t p = 0; p < panels; ++p)
            for (int64_t j = 0; j < keys; ++j)
                for (int64_t c = 0; c < pw; ++c)
                    tile[p * stride + j * pw + c] =
                        static_cast<T>(3 * normal(rng) + (!first && (p * pw + c) % 3 == 0 ? 5.0 : 0.0));
        const std::vector<T> logits = tile;
        const std::vector<T> o_old = o;
        simd::online_softmax_cols(k, simd::SoftmaxTileCols<T>{tile.data(), keys, Q, pw, stride, m.data(), l.data(),
                                                              alpha.data(), o.data(), ldo, dv, first});
        const double tol = std::is_same_v<T, float> ? 5e-6 : 1e-12;
        for (int64_t i = 0; i < Q; ++i) {
            const std::string at = target + " keys " + std::to_string(keys) + " query " + std::to_string(i);
            const auto at_key = [&](int64_t j) { return (i / pw) * stride + j * pw + i % pw; };
            double mx = -INFINITY;
            for (int64_t j = 0; j < keys; ++j) mx = std::max(mx, static_cast<double>(logits[at_key(j)]));
            const double m_new = first ? mx : std::max(mx, m_ref[i]);
            const double a = first ? 0.0 : std::exp(m_ref[i] - m_new);
            double sum = 0;
            for (int64_t j = 0; j < keys; ++j) {
                const double e = std::exp(static_cast<double>(logits[at_key(j)]) - m_new);
                sum += e;
                EXPECT_NEAR(tile[at_key(j)], e, tol * std::max(1.0, e)) << at << " key " << j;
            }
            l_ref[i] = first ? sum : l_ref[i] * a + sum;
            m_ref[i] = m_new;
            EXPECT_NEAR(m[i], m_new, tol * std::abs(m_new)) << at;
            EXPECT_NEAR(l[i], l_ref[i], tol * l_ref[i]) << at;
            if (!first) EXPECT_NEAR(alpha[i], a, tol) << at;
            for (int64_t c = 0; c < dv; ++c) {
                const double want = first ? o_old[c * ldo + i] : o_old[c * ldo + i] * a;
                EXPECT_NEAR(o[c * ldo + i], want, tol * std::max(1.0, std::abs(want))) << at << " o row " << c;
            }
        }
        for (int64_t p = 0; p < panels; ++p)
            for (int64_t g = 0; g < guard; ++g)
                EXPECT_EQ(tile[p * stride + keys * pw + g], sentinel) << target << ": wrote past panel " << p;
        for (int64_t g = width; g < width + guard; ++g) {
            EXPECT_EQ(m[g], sentinel) << target << ": m written past 32";
            EXPECT_EQ(l[g], sentinel) << target << ": l written past 32";
            EXPECT_EQ(alpha[g], sentinel) << target << ": alpha written past 32";
        }
    }
    EXPECT_NE(o, o_before) << target << ": the second tile rescaled nothing";
}

TEST(SimdLayer, OnlineSoftmaxColsMatchesTheDefinitionOnEveryTarget) {
    for_each_simd_target([](const SimdTarget& t) {
        check_online_softmax_cols<float>(simd::kernels(t.target), std::string(t.env) + " float");
        check_online_softmax_cols<double>(simd::kernels(t.target), std::string(t.env) + " double");
    });
}

// The same kernel writing its exponentials as bf16 pairs for an AMX product (SoftmaxTileCols::pairs), against its
// float path from the same state. The logits stay in s. The pairs path's shift m_p may differ from the float path's
// maximum m_f, so its weights, sums and rescaled outputs are the float path's times e^(m_f - m_p): the sums within
// 8e-5 (its exponentials' 7.5e-5), the outputs within float32 roundoff, the pairs within 2^-8 (bf16's unit roundoff)
// more; key j of query i at (j / 2) pairs_ld + 2 i + j % 2, zero for the keys past the tile (7 keys, 10 rows of pairs);
// a guard band after each row of pairs stays. A first tile (the shift is the maximum), then a following one where
// queries 0-15 meet logits far above their shift (m = -20: the new maximum, the float path's bits) and queries 16-31
// stay within 8 of theirs (m = 10: the shift kept, alpha 1, the output not rescaled).
TEST(SimdLayer, OnlineSoftmaxColsWritesBf16PairsOnEveryTarget) {
    for_each_simd_target([](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        const int64_t Q = 21, pw = 16, panels = 2, keys = 7, stride = keys * pw, dv = 3, ldo = 32, width = 32;
        const int64_t pairs_rows = 10, pairs_ld = 2 * width + 4;
        for (const bool first : {true, false}) {
            SCOPED_TRACE(first ? "first tile" : "second tile");
            std::mt19937 rng(first ? 13 : 14);
            std::normal_distribution<float> normal;
            std::vector<float> logits(panels * stride), m(width), l(width), o(dv * ldo);
            for (auto& x : logits) x = 3 * normal(rng);
            for (int64_t i = 0; i < width; ++i) m[i] = i < 16 ? -20.0f : 10.0f, l[i] = 1 + std::abs(normal(rng));
            for (auto& x : o) x = normal(rng);
            std::vector<float> s_float = logits, m_float = m, l_float = l, alpha_float(width), o_float = o;
            simd::online_softmax_cols(k, simd::SoftmaxTileCols<float>{s_float.data(), keys, Q, pw, stride,
                                                                      m_float.data(), l_float.data(),
                                                                      alpha_float.data(), o_float.data(), ldo, dv,
                                                                      first});
            const std::vector<float> m_old = m;
            std::vector<float> s_pairs = logits, alpha(width);
            std::vector<uint16_t> pairs(pairs_rows / 2 * pairs_ld, 0xABCD);
            simd::SoftmaxTileCols<float> tile{s_pairs.data(), keys, Q,  pw,        stride, m.data(), l.data(),
                                              alpha.data(),   o.data(), ldo, dv, first};
            tile.pairs = pairs.data();
            tile.pairs_ld = pairs_ld;
            tile.pairs_rows = pairs_rows;
            simd::online_softmax_cols(k, tile);
            EXPECT_EQ(s_pairs, logits) << t.env << ": the logits were overwritten";
            for (int64_t i = 0; i < Q; ++i) {
                const std::string at = std::string(t.env) + " query " + std::to_string(i);
                const bool kept = !first && i >= 16;
                EXPECT_EQ(m[i], kept ? m_old[i] : m_float[i]) << at;
                if (!first) EXPECT_EQ(alpha[i], kept ? 1.0f : alpha_float[i]) << at;
                const double scale = std::exp(static_cast<double>(m_float[i]) - m[i]);
                EXPECT_NEAR(l[i], l_float[i] * scale, 8e-5 * l_float[i] * scale) << at;
                for (int64_t c = 0; c < dv; ++c) {
                    const double want = o_float[c * ldo + i] * scale;
                    EXPECT_NEAR(o[c * ldo + i], want, 1e-6 * std::max(1.0, std::abs(want))) << at << " o row " << c;
                }
                for (int64_t j = 0; j < pairs_rows; ++j) {
                    const double e = j < keys ? s_float[(i / pw) * stride + j * pw + i % pw] * scale : 0.0;
                    const float p = c10::BFloat16(pairs[j / 2 * pairs_ld + 2 * i + j % 2], c10::BFloat16::from_bits());
                    EXPECT_NEAR(p, e, (std::exp2(-8) + 8e-5) * e) << at << " key " << j;
                }
            }
            for (int64_t r = 0; r < pairs_rows / 2; ++r)
                for (int64_t g = 2 * width; g < pairs_ld; ++g)
                    EXPECT_EQ(pairs[r * pairs_ld + g], 0xABCD) << t.env << ": wrote past row " << r << " of the pairs";
        }
    });
}

// The attention backward's rows: p = e^(s - lse) into s and p (dp - D) into dp, row lengths of every tail width,
// a guard band after each row. The expected values start from the same rounded differences as the kernel.
template <typename T>
void check_softmax_grad_rows(const simd::Kernels& k, const std::string& target) {
    std::mt19937 rng(12);
    std::normal_distribution<double> normal;
    const T sentinel = T(7);
    for (const int64_t n : {1, 3, 8, 13, 16, 19, 33}) {
        const int64_t rows = 3, guard = 5, ld = n + guard;
        std::vector<T> s(rows * ld, sentinel), dp(rows * ld, sentinel), lse(rows), D(rows);
        for (int64_t r = 0; r < rows; ++r) {
            lse[r] = static_cast<T>(4 + normal(rng));
            D[r] = static_cast<T>(normal(rng));
            for (int64_t j = 0; j < n; ++j) {
                s[r * ld + j] = static_cast<T>(3 * normal(rng));
                dp[r * ld + j] = static_cast<T>(normal(rng));
            }
        }
        const std::vector<T> s0 = s, dp0 = dp;
        simd::softmax_grad_rows(k, s.data(), dp.data(), rows, n, ld, lse.data(), D.data());
        const double tol = std::is_same_v<T, float> ? 1e-6 : 1e-13;
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < n; ++j) {
                const std::string at = target + " n " + std::to_string(n) + " row " + std::to_string(r) + " col " +
                                       std::to_string(j);
                const T x = s0[r * ld + j] - lse[r];
                const double p = std::exp(static_cast<double>(x));
                const double ds = p * static_cast<double>(static_cast<T>(dp0[r * ld + j] - D[r]));
                EXPECT_NEAR(s[r * ld + j], p, tol * p) << at;
                EXPECT_NEAR(dp[r * ld + j], ds, tol * std::abs(ds) + 1e-30) << at;
            }
            for (int64_t g = n; g < ld; ++g) {
                EXPECT_EQ(s[r * ld + g], sentinel) << target << " n " << n << ": s written past the row";
                EXPECT_EQ(dp[r * ld + g], sentinel) << target << " n " << n << ": dp written past the row";
            }
        }
    }
}

TEST(SimdLayer, SoftmaxGradRowsMatchesTheDefinitionOnEveryTarget) {
    for_each_simd_target([](const SimdTarget& t) {
        check_softmax_grad_rows<float>(simd::kernels(t.target), std::string(t.env) + " float");
        check_softmax_grad_rows<double>(simd::kernels(t.target), std::string(t.env) + " double");
    });
}

TEST(SimdLayer, Stencil3x3RowMatchesConv2dOnEveryTarget) {
    torch::manual_seed(5);
    for_each_stencil_case([](const simd::Kernels& k, int64_t C, int64_t W, int live) {
        for (const bool flip : {false, true})
            for (const bool bias_and_accumulate : {false, true})
                check_stencil_row(k, C, W, live, flip, bias_and_accumulate);
    });
}

// The stencil row's tap gradient: acc (9, C) += the correlation of row b with a's three rows, against a float64 sum
// of the definition; rows missing as above, acc starting from random values, a sentinel after it.
void check_stencil_reduce_row(const simd::Kernels& k, int64_t C, int64_t W, int live) {
    const std::string what = "C" + std::to_string(C) + " W" + std::to_string(W) + " rows " + std::to_string(live);
    const int64_t a_sx = C + 3, b_sx = C + 1;
    torch::Tensor a = torch::full({3, W, a_sx}, std::nan(""));
    a.narrow(2, 0, C).copy_(torch::randn({3, W, C}));
    torch::Tensor b = torch::full({W, b_sx}, std::nan(""));
    b.narrow(1, 0, C).copy_(torch::randn({W, C}));
    // acc is (9, C) row-major with 4 sentinel floats after it.
    torch::Tensor acc = torch::full({9 * C + 4}, 12345.0f), start = torch::randn({9, C});
    acc.narrow(0, 0, 9 * C).copy_(start.reshape({9 * C}));
    const float* rows[3];
    for (int r = 0; r < 3; ++r) rows[r] = (live >> r & 1) != 0 ? a[r].data_ptr<float>() : nullptr;
    k.stencil3x3_reduce_row(rows, a_sx, b.data_ptr<float>(), b_sx, W, C, acc.data_ptr<float>());
    torch::Tensor expected = start.to(torch::kFloat64).clone();
    const torch::Tensor a64 = a.narrow(2, 0, C).to(torch::kFloat64), b64 = b.narrow(1, 0, C).to(torch::kFloat64);
    for (int r = 0; r < 3; ++r) {
        if ((live >> r & 1) == 0) continue;
        for (int j = 0; j < 3; ++j)
            for (int64_t x = 0; x < W; ++x) {
                const int64_t xs = x + j - 1;
                if (xs >= 0 && xs < W) expected[r * 3 + j] += a64[r][xs] * b64[x];
            }
    }
    const torch::Tensor got = acc.narrow(0, 0, 9 * C).reshape({9, C}).to(torch::kFloat64);
    EXPECT_TRUE(torch::allclose(got, expected, 1e-5, 1e-5))
        << what << ": max error " << (got - expected).abs().max().item<double>();
    EXPECT_TRUE(torch::all(acc.narrow(0, 9 * C, 4) == 12345.0f).item<bool>()) << what << ": wrote beyond acc";
}

TEST(SimdLayer, Stencil3x3ReduceRowMatchesTheDefinitionOnEveryTarget) {
    torch::manual_seed(6);
    for_each_stencil_case(check_stencil_reduce_row);
}

// The transpose against LibTorch's: square blocks of every target's width, ragged edges in both directions,
// strided source rows and destination rows, and nothing written outside the destination's cols x rows.
TEST(SimdLayer, TransposeMatchesLibTorchOnEveryTarget) {
    torch::manual_seed(8);
    for_each_simd_target([&](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {16, 16}, {17, 33}, {64, 64},
                                         {70, 19}, {8, 48}}) {
            const int64_t lds = cols + 3, ldd = rows + 5;
            const torch::Tensor src = torch::randn({rows, lds});
            torch::Tensor dst = torch::full({cols, ldd}, 12345.0f);
            k.transpose(src.data_ptr<float>(), rows, cols, lds, dst.data_ptr<float>(), ldd);
            const std::string what = std::string(t.env) + " " + std::to_string(rows) + " x " + std::to_string(cols);
            EXPECT_TRUE(torch::equal(dst.narrow(1, 0, rows), src.narrow(1, 0, cols).t())) << what;
            EXPECT_TRUE(torch::all(dst.narrow(1, rows, ldd - rows) == 12345.0f).item<bool>()) << what << ": wrote past";
        }
    });
}

// bfloat16 <-> float32 against LibTorch's conversion, bit for bit but NaN's payload: random values of every magnitude, and the
// cases the rounding rule decides (ties to even both ways, a carry into the exponent, the largest float that
// rounds to infinity, subnormals, signed zeros, infinities, NaNs of either sign and payload).
TEST(SimdLayer, Bf16ConversionsMatchLibTorchOnEveryTarget) {
    torch::manual_seed(3);
    std::vector<uint32_t> special = {0x00000000u, 0x80000000u, 0x3F808000u, 0x3F818000u, 0x3F80C000u, 0x3F7FFFFFu,
                                     0x7F7FFFFFu, 0x7F7F8000u, 0x00000001u, 0x807FFFFFu, 0x7F800000u, 0xFF800000u,
                                     0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0x3FFF8000u, 0xBF808000u};
    torch::Tensor bits = torch::randint(0, int64_t{1} << 32, {4099}, torch::kInt64);
    for (size_t i = 0; i < special.size(); ++i) bits[static_cast<int64_t>(i)] = static_cast<int64_t>(special[i]);
    // The low 32 bits of each int64 as one float32 (little-endian x86).
    const torch::Tensor x =
        bits.to(torch::kInt32, /*non_blocking=*/false, /*copy=*/false).contiguous().view(torch::kFloat32);
    const torch::Tensor expected = x.to(torch::kBFloat16);
    for_each_simd_target([&](const SimdTarget& t) {
        const simd::Kernels& k = simd::kernels(t.target);
        for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, x.numel()}) {
            torch::Tensor narrowed = torch::full({x.numel()}, 7.0, torch::kBFloat16);
            k.narrow_to_bf16(x.data_ptr<float>(), static_cast<uint16_t*>(narrowed.data_ptr()), n);
            // NaN's bit pattern is LibTorch's choice per code path (0x7FC0 in c10::BFloat16, 0xFFFF in its
            // vectorised copy): NaN must stay NaN, everything else match bit for bit.
            const torch::Tensor nan = torch::isnan(x.narrow(0, 0, n));
            const torch::Tensor got = narrowed.narrow(0, 0, n);
            EXPECT_TRUE(torch::equal(got.view(torch::kInt16).masked_fill(nan, 0),
                                     expected.narrow(0, 0, n).view(torch::kInt16).masked_fill(nan, 0)))
                << "narrow, n = " << n;
            EXPECT_TRUE(torch::equal(torch::isnan(got), nan)) << "narrow, NaN, n = " << n;
            EXPECT_TRUE(torch::all(narrowed.narrow(0, n, x.numel() - n) == 7.0).item<bool>()) << "wrote beyond n = " << n;
            torch::Tensor widened = torch::zeros({n});
            k.widen_bf16(static_cast<const uint16_t*>(expected.data_ptr()), widened.data_ptr<float>(), n);
            EXPECT_TRUE(torch::equal(widened.view(torch::kInt32), expected.narrow(0, 0, n).to(torch::kFloat32).view(torch::kInt32)))
                << "widen, n = " << n;
        }
    });
}

TEST(SimdLayer, EnvironmentSelectsTheTarget) {
    const bool has_avx2 = simd::target_supported(simd::Target::Avx2);
    const bool has_avx512 = simd::target_supported(simd::Target::Avx512);
    const std::string best = has_avx512 ? "AVX-512" : has_avx2 ? "AVX2" : "scalar";
    unsetenv("LINVIS_FORCE_SCALAR");
    unsetenv("LINVIS_SIMD");
    EXPECT_EQ(std::string(linvis::ops::fused_kernel_target()), best);
    setenv("LINVIS_SIMD", "scalar", 1);
    EXPECT_STREQ(linvis::ops::fused_kernel_target(), "scalar");
    // A target the CPU lacks gives the best one it has at or below the request.
    setenv("LINVIS_SIMD", "avx2", 1);
    EXPECT_STREQ(linvis::ops::fused_kernel_target(), has_avx2 ? "AVX2" : "scalar");
    setenv("LINVIS_SIMD", "avx512", 1);
    EXPECT_EQ(std::string(linvis::ops::fused_kernel_target()), best);
    // LINVIS_FORCE_SCALAR=1 is an alias of scalar and wins; "0" means unset.
    setenv("LINVIS_FORCE_SCALAR", "1", 1);
    EXPECT_STREQ(linvis::ops::fused_kernel_target(), "scalar");
    EXPECT_EQ(simd::kernels().target, simd::Target::Scalar);
    setenv("LINVIS_FORCE_SCALAR", "0", 1);
    EXPECT_EQ(std::string(linvis::ops::fused_kernel_target()), best);
    unsetenv("LINVIS_FORCE_SCALAR");
    setenv("LINVIS_SIMD", "sse9", 1);
    try {
        linvis::ops::fused_kernel_target();
        ADD_FAILURE() << "LINVIS_SIMD=sse9 was accepted";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("LINVIS_SIMD"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("sse9"), std::string::npos) << e.what();
    }
    unsetenv("LINVIS_SIMD");
}

// The AMX tile product (simd/amx.h), emulated on every CPU and on the tiles where the CPU has them: C = A B and
// C += A B for bf16 A and B against the float64 product of the same bf16 values, for every block the tiles take
// (32 x 32, and 16-row and 16-column edges), with row strides wider than the matrices; C's columns past N hold a
// sentinel that must stay. Float32 sums of K exact products: |error| <= K 2^-24 (|C0| + sum |a b|), below 1e-5 of
// it for K <= 96.
TEST(Amx, GemmBf16MatchesFloat64Products) {
    linvis::testing::for_each_amx_path([](simd::AmxMode mode) {
        struct Case {
            int64_t M, N, K;
        };
        for (const Case c : {Case{16, 16, 32}, Case{32, 32, 64}, Case{48, 80, 96}, Case{64, 16, 32}})
            for (const bool accumulate : {false, true}) {
                SCOPED_TRACE("M" + std::to_string(c.M) + " N" + std::to_string(c.N) + " K" + std::to_string(c.K) +
                             (accumulate ? " +=" : " ="));
                torch::manual_seed(c.M + c.N + c.K);
                const int64_t lda = c.K + 32, ldb = 2 * c.N + 32, ldc = c.N + 16;
                const torch::Tensor a_buf = torch::randn({c.M, lda}).to(torch::kBFloat16);
                const torch::Tensor a = a_buf.narrow(1, 0, c.K);
                const torch::Tensor b = torch::randn({c.K, c.N}).to(torch::kBFloat16);
                std::vector<uint16_t> b_pairs(static_cast<size_t>(c.K / 2 * ldb), 0);
                const c10::BFloat16* b_values = b.data_ptr<c10::BFloat16>();
                for (int64_t kk = 0; kk < c.K; ++kk)
                    for (int64_t n = 0; n < c.N; ++n) b_pairs[kk / 2 * ldb + 2 * n + kk % 2] = b_values[kk * c.N + n].x;
                const float sentinel = 12345.0f;
                const torch::Tensor c0 = torch::randn({c.M, c.N});
                torch::Tensor c_buf = torch::full({c.M, ldc}, sentinel);
                c_buf.narrow(1, 0, c.N).copy_(c0);
                const auto* a_bits = reinterpret_cast<const uint16_t*>(a_buf.data_ptr<c10::BFloat16>());
                simd::gemm_bf16(mode, c.M, c.N, c.K, a_bits, lda, b_pairs.data(), ldb, c_buf.data_ptr<float>(), ldc,
                                accumulate);
                const torch::Tensor ad = a.to(torch::kFloat64), bd = b.to(torch::kFloat64);
                const torch::Tensor c0d =
                    accumulate ? c0.to(torch::kFloat64) : torch::zeros({c.M, c.N}, torch::kFloat64);
                const torch::Tensor expected = c0d + ad.matmul(bd);
                const torch::Tensor bound = 1e-5 * (c0d.abs() + ad.abs().matmul(bd.abs()));
                const torch::Tensor got = c_buf.narrow(1, 0, c.N).to(torch::kFloat64);
                EXPECT_TRUE((got - expected).abs().le(bound).all().item<bool>())
                    << "max error " << (got - expected).abs().max().item<double>();
                EXPECT_TRUE(c_buf.narrow(1, c.N, ldc - c.N).eq(sentinel).all().item<bool>());
            }
    });
}

// Float32 operands rounded to bf16 and multiplied on the tiles (the TTT mixers' bf16 inference), on every SIMD target
// and AMX path: C (+)= bf16(A) bf16(B) with float32 sums, against float64 products of LibTorch's roundings, for A in
// rows, transposed (a_row 1, the inner gradients' K^T) and with both strides, shapes that are and are not whole
// tiles, wider B and C rows; C past its N columns stays as it was. Row 0 of A starts with ties, which round to even.
TEST(Amx, RoundedFloat32ProductsMatchFloat64OfTheRoundedOperands) {
    enum class Layout { Rows, Transposed, Strided };
    struct Case {
        int64_t M, N, K;
        Layout layout;
    };
    const Case cases[] = {{16, 16, 32, Layout::Rows},       {256, 32, 32, Layout::Rows},
                          {37, 12, 45, Layout::Rows},       {64, 64, 256, Layout::Transposed},
                          {12, 20, 98, Layout::Transposed}, {5, 7, 3, Layout::Strided},
                          {3, 17, 1, Layout::Rows}};
    for_each_simd_target([&](const SimdTarget&) {
        linvis::testing::for_each_amx_path([&](simd::AmxMode mode) {
            for (const Case& c : cases)
                for (const bool accumulate : {false, true}) {
                    SCOPED_TRACE("M" + std::to_string(c.M) + " N" + std::to_string(c.N) + " K" + std::to_string(c.K) +
                                 " layout " + std::to_string(static_cast<int>(c.layout)) + (accumulate ? " +=" : " ="));
                    torch::manual_seed(c.M * 7 + c.N + c.K);
                    torch::Tensor a = torch::randn({c.M, c.K});
                    if (c.K >= 2) {
                        a[0][0] = 1.0f + 3.0f * 0x1p-8f;  // halfway between 1 + 2^-7 and 1 + 2^-6: the even one
                        a[0][1] = -(1.0f + 0x1p-8f);      // halfway between -1 and -(1 + 2^-7): -1
                    }
                    // A's storage: rows (a_row = K + 3), its transpose (a_col = M + 5), or every element 2 apart.
                    torch::Tensor storage;
                    int64_t a_row = 0, a_col = 0;
                    if (c.layout == Layout::Rows) {
                        storage = torch::zeros({c.M, c.K + 3});
                        storage.narrow(1, 0, c.K).copy_(a);
                        a_row = c.K + 3, a_col = 1;
                    } else if (c.layout == Layout::Transposed) {
                        storage = torch::zeros({c.K, c.M + 5});
                        storage.narrow(1, 0, c.M).copy_(a.t());
                        a_row = 1, a_col = c.M + 5;
                    } else {
                        storage = torch::zeros({c.M, 2 * c.K});
                        storage.narrow(1, 0, 2 * c.K).view({c.M, c.K, 2}).select(2, 0).copy_(a);
                        a_row = 2 * c.K, a_col = 2;
                    }
                    const int64_t ldb = c.N + 3, ldc = c.N + 5;
                    const torch::Tensor b_buf = torch::randn({c.K, ldb});
                    const torch::Tensor b = b_buf.narrow(1, 0, c.N);
                    const float sentinel = 12345.0f;
                    const torch::Tensor c0 = torch::randn({c.M, c.N});
                    torch::Tensor c_buf = torch::full({c.M, ldc}, sentinel);
                    c_buf.narrow(1, 0, c.N).copy_(c0);
                    simd::gemm_f32_rounded_to_bf16(mode, c.M, c.N, c.K, storage.data_ptr<float>(), a_row, a_col,
                                                   b_buf.data_ptr<float>(), ldb, c_buf.data_ptr<float>(), ldc,
                                                   accumulate);
                    auto rounded = [](const torch::Tensor& t) {
                        return t.to(torch::kBFloat16).to(torch::kFloat64);
                    };
                    const torch::Tensor ad = rounded(a), bd = rounded(b);
                    const torch::Tensor c0d =
                        accumulate ? c0.to(torch::kFloat64) : torch::zeros({c.M, c.N}, torch::kFloat64);
                    // float32 sums of K + 1 terms: at most (K + 1) 2^-24 of the sum of their magnitudes each way.
                    const torch::Tensor bound =
                        static_cast<double>(c.K + 2) * 0x1p-24 * (c0d.abs() + ad.abs().matmul(bd.abs()));
                    const torch::Tensor got = c_buf.narrow(1, 0, c.N).to(torch::kFloat64);
                    const torch::Tensor error = (got - (c0d + ad.matmul(bd))).abs();
                    EXPECT_TRUE(error.le(bound).all().item<bool>()) << "max error " << error.max().item<double>();
                    EXPECT_TRUE(c_buf.narrow(1, c.N, ldc - c.N).eq(sentinel).all().item<bool>());
                }
        });
    });
}

// The layout of q^T for the tiles on every SIMD target: transpose_pairs_bf16 scales, rounds to nearest even as
// LibTorch's .to(kBFloat16) does (row 0 holds ties: 1 and -1 times 1 + 2^-8 round to 1 and -1), puts element (k, n)
// of the transpose at (k / 2) ldo + 2 n + k % 2, zeroes the padding past K and leaves the rest of each row alone.
TEST(Amx, TransposedPairsRoundAsLibTorch) {
    for_each_simd_target([](const SimdTarget& t) {
        const float scale = 1.0f + 0x1p-8f;
        torch::manual_seed(4);
        // 6 rows of 9 bf16 values (an odd count: the last pair is half padding) in a buffer 12 wide, K padded to 32.
        torch::Tensor x_buf = torch::randn({6, 12});
        x_buf[0][0] = 1.0f;
        x_buf[0][1] = -1.0f;
        x_buf = x_buf.to(torch::kBFloat16);
        const torch::Tensor scaled = (x_buf.narrow(1, 0, 9).to(torch::kFloat32) * scale).to(torch::kBFloat16);
        const c10::BFloat16* want = scaled.contiguous().data_ptr<c10::BFloat16>();
        EXPECT_EQ(want[0].x, c10::BFloat16(1.0f).x);
        const int64_t ldo = 2 * 6 + 4;
        std::vector<uint16_t> out(16 * ldo, 0xFFFF);
        simd::transpose_pairs_bf16(reinterpret_cast<const uint16_t*>(x_buf.data_ptr<c10::BFloat16>()), 6, 9, 12,
                                   scale, 32, out.data(), ldo);
        for (int64_t k = 0; k < 32; ++k)
            for (int64_t n = 0; n < 6; ++n)
                EXPECT_EQ(out[k / 2 * ldo + 2 * n + k % 2], k < 9 ? want[n * 9 + k].x : 0)
                    << t.env << " k " << k << ", n " << n;
        for (int64_t p = 0; p < 16; ++p)
            for (int64_t g = 12; g < ldo; ++g) EXPECT_EQ(out[p * ldo + g], 0xFFFF) << t.env << ": wrote past row " << p;
    });
}

// LINVIS_AMX: "off" turns the tiles off, "emulate" asks for the emulation, anything else but "auto" is an error
// naming the variable and the value.
TEST(Amx, EnvironmentSelectsThePath) {
    {
        linvis::testing::ScopedAmx off("off");
        EXPECT_EQ(simd::amx_mode(), simd::AmxMode::Off);
    }
    {
        linvis::testing::ScopedAmx emulate("emulate");
        EXPECT_EQ(simd::amx_mode(), simd::AmxMode::Emulated);
    }
    linvis::testing::ScopedAmx bogus("tmm9");
    try {
        simd::amx_mode();
        ADD_FAILURE() << "LINVIS_AMX=tmm9 was accepted";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("LINVIS_AMX"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("tmm9"), std::string::npos) << e.what();
    }
}

}  // namespace
