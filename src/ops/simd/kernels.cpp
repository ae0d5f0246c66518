// The per-target tables of the SIMD layer and the choice of target (simd.h). Highway compiles this file
// once per target (hwy/foreach_target.h re-includes it); HWY_ONCE holds the target-independent part.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/simd/kernels.cpp"
#include "ops/simd/hwy_targets.h"
// clang-format off
#include <hwy/foreach_target.h>
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>
// clang-format on

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ops/simd/gemm-inl.h"

HWY_BEFORE_NAMESPACE();
namespace linvis::ops::simd::HWY_NAMESPACE {

void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B,
              int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    gemm<Vec<float>>(M, N, K, A, a_row, a_col, B, ldb, C, ldc, accumulate ? GemmInit::Accumulate : GemmInit::Zero);
}

void gemm_f64(int64_t M, int64_t N, int64_t K, const double* A, int64_t a_row, int64_t a_col, const double* B,
              int64_t ldb, double* C, int64_t ldc, bool accumulate) {
    gemm<Vec<double>>(M, N, K, A, a_row, a_col, B, ldb, C, ldc, accumulate ? GemmInit::Accumulate : GemmInit::Zero);
}

using FloatTag = hn::ScalableTag<float>;
using FloatVec = hn::Vec<FloatTag>;

// y[i] = f(in[i]...) over n floats, f taking one whole vector per input array: full vectors, then one masked
// tail whose inactive lanes read 0 and are not stored.
template <class F, class... In>
HWY_INLINE void map_floats(float* y, int64_t n, F f, const In*... in) {
    const FloatTag d;
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    int64_t i = 0;
    for (; i + N <= n; i += N) hn::StoreU(f(d, hn::LoadU(d, in + i)...), d, y + i);
    if (i < n) {
        const auto m = hn::FirstN(d, static_cast<size_t>(n - i));
        hn::BlendedStore(f(d, hn::MaskedLoad(m, d, in + i)...), m, d, y + i);
    }
}

// 2^n from shifted = n + 1.5 * 2^23 (n an integer, |n| <= 127, rounded to nearest by that addition): the sum's bits
// are 0x4B400000 + n, so n + 127 goes into the exponent bits.
HWY_INLINE FloatVec pow2_of_shifted(FloatTag d, FloatVec shifted) {
    const hn::RebindToSigned<FloatTag> di;
    return hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::BitCast(di, shifted), hn::Set(di, 127 - 0x4B400000))));
}

// exp(x): Cody-Waite reduction x = n ln2 + r (n = x log2 e rounded to nearest), a degree-6 polynomial for exp(r)
// (the Cephes expf coefficients) and 2^n written into the exponent bits; about 2 ulp. x is clamped to [-87, 88], so
// n stays in the normal exponents: arguments below -87 (-inf included) give 0 and above 88 exp(88); NaN stays NaN.
// Highway's Exp (1 ulp) spends about twice the instructions on subnormal results and a two-step scaling: on a Zen 3
// core (AVX2) sigmoid took 1.08 ns per float with it and 0.71 with this, the erf GELU 1.48 and 1.17 (768 floats in
// L1, best of 3).
HWY_INLINE FloatVec exp_clamped(FloatTag d, FloatVec x) {
    const auto below = hn::Lt(x, hn::Set(d, -87.0f));
    const auto nan = hn::IsNaN(x);
    const auto c = hn::Min(hn::Max(x, hn::Set(d, -87.0f)), hn::Set(d, 88.0f));
    // n rounded to nearest by adding 1.5 * 2^23 (bits 0x4B400000): the sum's bits are 0x4B400000 + n.
    const auto magic = hn::Set(d, 12582912.0f);
    const auto shifted = hn::MulAdd(c, hn::Set(d, 1.44269504088896341f), magic);
    const auto n = hn::Sub(shifted, magic);
    auto r = hn::NegMulAdd(n, hn::Set(d, 0.693359375f), c);  // ln 2 in two parts: n * 0.693359375 is exact
    r = hn::NegMulAdd(n, hn::Set(d, -2.12194440e-4f), r);
    auto p = hn::Set(d, 1.9875691500e-4f);
    p = hn::MulAdd(p, r, hn::Set(d, 1.3981999507e-3f));
    p = hn::MulAdd(p, r, hn::Set(d, 8.3334519073e-3f));
    p = hn::MulAdd(p, r, hn::Set(d, 4.1665795894e-2f));
    p = hn::MulAdd(p, r, hn::Set(d, 1.6666665459e-1f));
    p = hn::MulAdd(p, r, hn::Set(d, 5.0000001201e-1f));
    p = hn::MulAdd(p, hn::Mul(r, r), hn::Add(r, hn::Set(d, 1.0f)));
    return hn::IfThenElse(nan, x, hn::IfThenZeroElse(below, hn::Mul(p, pow2_of_shifted(d, shifted))));
}

// 2^x: n = round(x) (the 1.5 * 2^23 trick), f = x - n in [-1/2, 1/2], 2^f by its degree-6 Taylor polynomial
// (truncation below 1.2e-7 relative) and 2^n through the exponent bits; exp_clamped's form without its two-constant
// reduction of x / ln 2, for callers whose argument is already x log2 e (the attention's softmax). x is clamped to
// [-126, 127]: arguments below -126 (-inf included) give 2^-126 = 1.2e-38, 0 next to the 1 a softmax column holds.
HWY_INLINE FloatVec exp2_clamped(FloatTag d, FloatVec x) {
    const auto c = hn::Min(hn::Max(x, hn::Set(d, -126.0f)), hn::Set(d, 127.0f));
    const auto magic = hn::Set(d, 12582912.0f);
    const auto shifted = hn::Add(c, magic);
    const auto f = hn::Sub(c, hn::Sub(shifted, magic));
    auto p = hn::Set(d, 1.5403530393381609e-4f);  // ln(2)^k / k!, k = 6 down to 1
    p = hn::MulAdd(p, f, hn::Set(d, 1.3333558146428443e-3f));
    p = hn::MulAdd(p, f, hn::Set(d, 9.6181291076284772e-3f));
    p = hn::MulAdd(p, f, hn::Set(d, 5.5504108664821580e-2f));
    p = hn::MulAdd(p, f, hn::Set(d, 2.4022650695910071e-1f));
    p = hn::MulAdd(p, f, hn::Set(d, 6.9314718055994531e-1f));
    p = hn::MulAdd(p, f, hn::Set(d, 1.0f));
    return hn::Mul(p, pow2_of_shifted(d, shifted));
}

// 2^x for values rounded to bf16 next (the attention's weights for an AMX product): a degree-3 polynomial for 2^f
// on [-1/2, 1/2] fitted for the least largest relative error, 7.5e-5 (float32 evaluation included), 1/52 of bf16's
// unit roundoff 2^-8 (the rounding that follows). Clamped below only (the softmax's shifted logits are at most 0,
// up to rounding).
HWY_INLINE FloatVec exp2_for_bf16(FloatTag d, FloatVec x) {
    const auto c = hn::Max(x, hn::Set(d, -126.0f));
    const auto magic = hn::Set(d, 12582912.0f);
    const auto shifted = hn::Add(c, magic);
    const auto f = hn::Sub(c, hn::Sub(shifted, magic));
    auto p = hn::Set(d, 0.0551716685295105f);
    p = hn::MulAdd(p, f, hn::Set(d, 0.2426111400127411f));
    p = hn::MulAdd(p, f, hn::Set(d, 0.6932609677314758f));
    p = hn::MulAdd(p, f, hn::Set(d, 0.9999280571937561f));
    return hn::Mul(p, pow2_of_shifted(d, shifted));
}

// exp(-x): finite for every number (exp(88) beyond), so a sigmoid built on it is 0 or 1 there, never NaN.
HWY_INLINE FloatVec exp_neg(FloatTag d, FloatVec x) { return exp_clamped(d, hn::Neg(x)); }

// 1 / (1 + exp(-x)).
HWY_INLINE FloatVec sigmoid_vec(FloatTag d, FloatVec x) {
    const auto one = hn::Set(d, 1.0f);
    return hn::Div(one, hn::Add(one, exp_neg(d, x)));
}

// x/2 (1 + erf(x / sqrt 2)) with erf(a) = sign(a) (1 - P(t) exp(-a^2)), t = 1 / (1 + p |a|): Abramowitz and
// Stegun 7.1.26, |error in erf| <= 1.5e-7 (the form torch's vectorised CPU erf evaluates). exp(-a^2) is 0 for
// a^2 > 87, where the term is 0 to float precision.
HWY_INLINE FloatVec gelu_erf_vec(FloatTag d, FloatVec x) {
    const auto half = hn::Set(d, 0.5f), one = hn::Set(d, 1.0f);
    const auto a = hn::Mul(x, hn::Set(d, 0.70710678118654752f));
    const auto t = hn::Div(one, hn::MulAdd(hn::Set(d, 0.3275911f), hn::Abs(a), one));
    auto poly = hn::Set(d, 1.061405429f);
    poly = hn::MulAdd(poly, t, hn::Set(d, -1.453152027f));
    poly = hn::MulAdd(poly, t, hn::Set(d, 1.421413741f));
    poly = hn::MulAdd(poly, t, hn::Set(d, -0.284496736f));
    poly = hn::MulAdd(poly, t, hn::Set(d, 0.254829592f));
    poly = hn::Mul(poly, t);
    const auto e = exp_clamped(d, hn::Neg(hn::Mul(a, a)));
    const auto erf = hn::CopySign(hn::NegMulAdd(poly, e, one), a);  // sign(a) (1 - P(t) exp(-a^2))
    return hn::Mul(hn::Mul(half, x), hn::Add(one, erf));
}

// x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) with Highway's Tanh.
HWY_INLINE FloatVec gelu_tanh_vec(FloatTag d, FloatVec x) {
    const auto inner =
        hn::Mul(hn::Set(d, 0.7978845608028654f), hn::MulAdd(hn::Mul(hn::Set(d, 0.044715f), hn::Mul(x, x)), x, x));
    return hn::Mul(hn::Mul(hn::Set(d, 0.5f), x), hn::Add(hn::Set(d, 1.0f), hn::Tanh(d, inner)));
}

// g sigmoid(g) u.
HWY_INLINE FloatVec silu_mul_vec(FloatTag d, FloatVec g, FloatVec u) {
    return hn::Mul(hn::Div(g, hn::Add(hn::Set(d, 1.0f), exp_neg(d, g))), u);
}

void sigmoid(const float* x, float* y, int64_t n) { map_floats(y, n, sigmoid_vec, x); }
// f(x + bias) over n floats, or f(x) without a bias.
template <class F>
HWY_INLINE void map_biased(const float* x, const float* bias, float* y, int64_t n, F f) {
    if (bias == nullptr) return map_floats(y, n, f, x);
    map_floats(y, n, [f](FloatTag d, FloatVec v, FloatVec b) { return f(d, hn::Add(v, b)); }, x, bias);
}

void gelu_erf(const float* x, const float* bias, float* y, int64_t n) {
    map_biased(x, bias, y, n, [](FloatTag d, FloatVec v) { return gelu_erf_vec(d, v); });
}
void gelu_tanh(const float* x, const float* bias, float* y, int64_t n) {
    map_biased(x, bias, y, n, [](FloatTag d, FloatVec v) { return gelu_tanh_vec(d, v); });
}
void silu_mul(const float* g, const float* u, float* y, int64_t n) { map_floats(y, n, silu_mul_vec, g, u); }
void silu_mul_rows(const float* g, const float* u, int64_t ld, int64_t rows, int64_t n, float* y, int64_t ldy) {
    for (int64_t r = 0; r < rows; ++r) map_floats(y + r * ldy, n, silu_mul_vec, g + r * ld, u + r * ld);
}
// Runs body(j, mask, whole) over the vectors of a row of n floats: whole vectors (whole is std::true_type, mask all
// lanes), then the tail (std::false_type, mask its lanes). load_part / store_part read and write a vector so: plain
// on whole vectors, masked on the tail only (masked loads and stores cost more on AVX2).
template <class Body>
HWY_INLINE void for_row_vectors(FloatTag d, int64_t n, Body body) {
    const int64_t W = static_cast<int64_t>(hn::Lanes(d));
    int64_t j = 0;
    for (; j + W <= n; j += W) body(j, hn::FirstN(d, static_cast<size_t>(W)), std::true_type{});
    if (j < n) body(j, hn::FirstN(d, static_cast<size_t>(n - j)), std::false_type{});
}
template <class M, class Whole>
HWY_INLINE FloatVec load_part(FloatTag d, M m, const float* p, Whole) {
    if constexpr (Whole::value) return hn::LoadU(d, p);
    else return hn::MaskedLoad(m, d, p);
}
template <class M, class Whole>
HWY_INLINE void store_part(FloatVec v, FloatTag d, M m, float* p, Whole) {
    if constexpr (Whole::value) hn::StoreU(v, d, p);
    else hn::BlendedStore(v, m, d, p);
}

void silu_mul_backward_rows(float* g, float* u, int64_t ld, int64_t rows, int64_t n, const float* dy, int64_t lddy,
                            float c) {
    const FloatTag d;
    const auto one = hn::Set(d, 1.0f), cv = hn::Set(d, c);
    for (int64_t r = 0; r < rows; ++r) {
        float* gr = g + r * ld;
        float* ur = u + r * ld;
        const float* er = dy + r * lddy;
        for_row_vectors(d, n, [&](int64_t j, auto m, auto whole) {
            const auto gv = load_part(d, m, gr + j, whole), e = hn::Mul(cv, load_part(d, m, er + j, whole));
            const auto s = sigmoid_vec(d, gv);
            const auto dsilu = hn::Mul(s, hn::MulAdd(gv, hn::Sub(one, s), one));
            const auto dg = hn::Mul(hn::Mul(e, load_part(d, m, ur + j, whole)), dsilu);
            store_part(hn::Mul(e, hn::Mul(gv, s)), d, m, ur + j, whole);
            store_part(dg, d, m, gr + j, whole);
        });
    }
}
void silu_mul_backward_rows_backward(float* z, float* dp, int64_t ld, int64_t rows, int64_t n, const float* v,
                                     int64_t ldv, float c, float* dv, int64_t lddv) {
    const FloatTag d;
    const auto one = hn::Set(d, 1.0f), two = hn::Set(d, 2.0f), cv = hn::Set(d, c);
    for (int64_t r = 0; r < rows; ++r) {
        float* z1r = z + r * ld;
        float* z2r = z1r + n;
        float* dp1r = dp + r * ld;
        float* dp2r = dp1r + n;
        const float* vr = v + r * ldv;
        float* dvr = dv + r * lddv;
        for_row_vectors(d, n, [&](int64_t j, auto m, auto whole) {
            const auto z1 = load_part(d, m, z1r + j, whole), z2 = load_part(d, m, z2r + j, whole);
            const auto dp1 = load_part(d, m, dp1r + j, whole), dp2 = load_part(d, m, dp2r + j, whole);
            const auto e = hn::Mul(cv, load_part(d, m, vr + j, whole));
            const auto s = sigmoid_vec(d, z2), oms = hn::Sub(one, s);
            const auto silu = hn::Mul(z2, s);
            const auto ds = hn::Mul(s, hn::MulAdd(z2, oms, one));                                  // silu'(z2)
            const auto d2s = hn::Mul(hn::Mul(s, oms), hn::MulAdd(z2, hn::NegMulAdd(two, s, one), two));  // silu''(z2)
            const auto z1ds = hn::Mul(z1, ds), eds = hn::Mul(e, ds);
            store_part(hn::Mul(e, silu), d, m, z1r + j, whole);
            store_part(hn::Mul(e, z1ds), d, m, z2r + j, whole);
            store_part(hn::Mul(dp2, eds), d, m, dp1r + j, whole);
            store_part(hn::MulAdd(dp1, eds, hn::Mul(hn::Mul(dp2, e), hn::Mul(z1, d2s))), d, m, dp2r + j, whole);
            store_part(hn::Mul(cv, hn::MulAdd(dp1, silu, hn::Mul(dp2, z1ds))), d, m, dvr + j, whole);
        });
    }
}
void exp_sub(const float* x, float shift, float* y, int64_t n) {
    map_floats(y, n, [shift](FloatTag d, FloatVec v) { return exp_clamped(d, hn::Sub(v, hn::Set(d, shift))); }, x);
}

// Plain loops the compiler vectorises for this target (HWY_BEFORE_NAMESPACE sets its attributes).
void widen_bf16(const uint16_t* in, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
        std::memcpy(out + i, &bits, sizeof bits);
    }
}
// c10::BFloat16's rounding (c10/util/BFloat16.h, round_to_nearest_even): add 0x7FFF plus the lowest kept bit,
// keep the upper half; any NaN becomes the quiet NaN 0x7FC0.
void narrow_to_bf16(const float* in, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, in + i, sizeof bits);
        const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        out[i] = in[i] != in[i] ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
    }
}

// One channel chunk [c0, c0 + lanes) of stencil3x3_row, along the whole row; kFull: a whole vector (plain loads and
// stores), otherwise the first `mask` lanes. Registers: 9 taps, 3 x 3 source columns, the sum (20 on AVX-512).
template <bool kFull>
HWY_INLINE void stencil3x3_chunk(const float* const* rows, int64_t sx, int64_t W, int64_t C, const float* taps,
                                 bool flip_x, const float* bias, float* out, int64_t out_sx, bool accumulate,
                                 int64_t c0, hn::Mask<FloatTag> mask) {
    const FloatTag d;
    const auto load = [&](const float* p) { return kFull ? hn::LoadU(d, p) : hn::MaskedLoad(mask, d, p); };
    FloatVec t[9];
    for (int i = 0; i < 9; ++i) {
        // Flipped along x, source column x - (j - 1) is window column 2 - j: swap taps j and 2 - j.
        const int tap = flip_x ? (i / 3) * 3 + 2 - i % 3 : i;
        t[i] = load(taps + tap * C + c0);
    }
    const FloatVec b = bias != nullptr ? load(bias + c0) : hn::Zero(d);
    const bool live[3] = {rows[0] != nullptr, rows[1] != nullptr, rows[2] != nullptr};
    const auto column = [&](int r, int64_t x) {
        return live[r] && x < W ? load(rows[r] + x * sx + c0) : hn::Zero(d);
    };
    // win[r][j]: row r's source column x + j - 1.
    FloatVec win[3][3];
    for (int r = 0; r < 3; ++r) {
        win[r][0] = hn::Zero(d);
        win[r][1] = column(r, 0);
    }
    for (int64_t x = 0; x < W; ++x) {
        float* o = out + x * out_sx + c0;
        FloatVec acc = accumulate ? hn::Add(load(o), b) : b;
        for (int r = 0; r < 3; ++r) {
            win[r][2] = column(r, x + 1);
            if (!live[r]) continue;
            acc = hn::MulAdd(t[r * 3], win[r][0], acc);
            acc = hn::MulAdd(t[r * 3 + 1], win[r][1], acc);
            acc = hn::MulAdd(t[r * 3 + 2], win[r][2], acc);
            win[r][0] = win[r][1];
            win[r][1] = win[r][2];
        }
        if (kFull) hn::StoreU(acc, d, o);
        else hn::BlendedStore(acc, mask, d, o);
    }
}

void stencil3x3_row(const float* const* rows, int64_t sx, int64_t W, int64_t C, const float* taps, bool flip_x,
                    const float* bias, float* out, int64_t out_sx, bool accumulate) {
    const FloatTag d;
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    int64_t c0 = 0;
    for (; c0 + N <= C; c0 += N)
        stencil3x3_chunk<true>(rows, sx, W, C, taps, flip_x, bias, out, out_sx, accumulate, c0, hn::FirstN(d, N));
    if (c0 < C)
        stencil3x3_chunk<false>(rows, sx, W, C, taps, flip_x, bias, out, out_sx, accumulate, c0,
                                hn::FirstN(d, static_cast<size_t>(C - c0)));
}

// One channel chunk of stencil3x3_reduce_row (kFull and mask as in stencil3x3_chunk). Registers: 9 sums, 3 x 3 source
// columns, b's vector (19 on AVX-512).
template <bool kFull>
HWY_INLINE void stencil3x3_reduce_chunk(const float* const* a_rows, int64_t a_sx, const float* b, int64_t b_sx,
                                        int64_t W, int64_t C, float* acc, int64_t c0, hn::Mask<FloatTag> mask) {
    const FloatTag d;
    const auto load = [&](const float* p) { return kFull ? hn::LoadU(d, p) : hn::MaskedLoad(mask, d, p); };
    const bool live[3] = {a_rows[0] != nullptr, a_rows[1] != nullptr, a_rows[2] != nullptr};
    const auto column = [&](int r, int64_t x) {
        return live[r] && x < W ? load(a_rows[r] + x * a_sx + c0) : hn::Zero(d);
    };
    FloatVec sum[9];
    for (int i = 0; i < 9; ++i) sum[i] = hn::Zero(d);
    FloatVec win[3][3];  // win[r][j]: row r's column x + j - 1
    for (int r = 0; r < 3; ++r) {
        win[r][0] = hn::Zero(d);
        win[r][1] = column(r, 0);
    }
    for (int64_t x = 0; x < W; ++x) {
        const FloatVec bv = load(b + x * b_sx + c0);
        for (int r = 0; r < 3; ++r) {
            win[r][2] = column(r, x + 1);
            if (!live[r]) continue;
            sum[r * 3] = hn::MulAdd(win[r][0], bv, sum[r * 3]);
            sum[r * 3 + 1] = hn::MulAdd(win[r][1], bv, sum[r * 3 + 1]);
            sum[r * 3 + 2] = hn::MulAdd(win[r][2], bv, sum[r * 3 + 2]);
            win[r][0] = win[r][1];
            win[r][1] = win[r][2];
        }
    }
    for (int i = 0; i < 9; ++i) {
        float* t = acc + i * C + c0;
        const FloatVec total = hn::Add(load(t), sum[i]);
        if (kFull) hn::StoreU(total, d, t);
        else hn::BlendedStore(total, mask, d, t);
    }
}

void stencil3x3_reduce_row(const float* const* a_rows, int64_t a_sx, const float* b, int64_t b_sx, int64_t W,
                           int64_t C, float* acc) {
    const FloatTag d;
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    int64_t c0 = 0;
    for (; c0 + N <= C; c0 += N) stencil3x3_reduce_chunk<true>(a_rows, a_sx, b, b_sx, W, C, acc, c0, hn::FirstN(d, N));
    if (c0 < C)
        stencil3x3_reduce_chunk<false>(a_rows, a_sx, b, b_sx, W, C, acc, c0,
                                       hn::FirstN(d, static_cast<size_t>(C - c0)));
}

void transpose(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst, int64_t ldd) {
    transpose_blocks<Vec<float>>(src, rows, cols, lds, dst, ldd);
}

// window_dots for G keys at once: each key's sum in its own register over the channel vectors (G independent chains,
// so the FMA latency is hidden), one horizontal sum per key at the end.
template <int G>
HWY_INLINE void window_dots_group(const float* x, const float* const* keys, int64_t n, float* out) {
    const FloatTag d;
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    FloatVec acc[G];
    for (int g = 0; g < G; ++g) acc[g] = hn::Zero(d);
    int64_t c = 0;
    for (; c + N <= n; c += N) {
        const FloatVec xv = hn::LoadU(d, x + c);
        for (int g = 0; g < G; ++g) acc[g] = hn::MulAdd(xv, hn::LoadU(d, keys[g] + c), acc[g]);
    }
    if (c < n) {
        const auto m = hn::FirstN(d, static_cast<size_t>(n - c));
        const FloatVec xv = hn::MaskedLoad(m, d, x + c);
        for (int g = 0; g < G; ++g) acc[g] = hn::MulAdd(xv, hn::MaskedLoad(m, d, keys[g] + c), acc[g]);
    }
    for (int g = 0; g < G; ++g) out[g] = hn::GetLane(hn::SumOfLanes(d, acc[g]));
}

void window_dots(const float* x, const float* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols, int64_t n,
                 float* out) {
    constexpr int64_t kGroup = 8;
    const float* keys[kGroup];
    const int64_t count = rows * cols;
    int64_t r = 0, col = 0;  // the window position of key j, stepped along (no division per key)
    for (int64_t j = 0; j < count;) {
        // Groups of 8; the last 9-11 keys as two groups of 4-6, not 8 and a short group whose few chains would wait
        // on the FMA latency (DiT5's 25 keys: 8, 8, 5, 4).
        const int64_t left = count - j;
        const int64_t g = left >= 12 || left <= 8 ? std::min<int64_t>(left, kGroup) : (left + 1) / 2;
        for (int64_t i = 0; i < g; ++i) {
            keys[i] = p + r * sr + col * sc;
            if (++col == cols) col = 0, ++r;
        }
        switch (g) {
            case 8: window_dots_group<8>(x, keys, n, out + j); break;
            case 7: window_dots_group<7>(x, keys, n, out + j); break;
            case 6: window_dots_group<6>(x, keys, n, out + j); break;
            case 5: window_dots_group<5>(x, keys, n, out + j); break;
            case 4: window_dots_group<4>(x, keys, n, out + j); break;
            case 3: window_dots_group<3>(x, keys, n, out + j); break;
            case 2: window_dots_group<2>(x, keys, n, out + j); break;
            default: window_dots_group<1>(x, keys, n, out + j); break;
        }
        j += g;
    }
}

// window_sum over U channel vectors from c0 (kFull: whole vectors; otherwise U = 1 and the first `mask` lanes): the
// U partial outputs stay in registers over the whole window and are stored once.
template <int U, bool kFull>
HWY_INLINE void window_sum_block(const float* w, const float* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols,
                                 int64_t c0, hn::Mask<FloatTag> mask, float* y) {
    const FloatTag d;
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    FloatVec acc[U];
    for (int u = 0; u < U; ++u) acc[u] = hn::Zero(d);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) {
            const FloatVec wv = hn::Set(d, w[r * cols + j]);
            const float* key = p + r * sr + j * sc + c0;
            for (int u = 0; u < U; ++u)
                acc[u] = hn::MulAdd(wv, kFull ? hn::LoadU(d, key + u * N) : hn::MaskedLoad(mask, d, key), acc[u]);
        }
    for (int u = 0; u < U; ++u) {
        if (kFull) hn::StoreU(acc[u], d, y + c0 + u * N);
        else hn::BlendedStore(acc[u], mask, d, y + c0);
    }
}

void window_sum(const float* w, const float* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols, int64_t n,
                float* y) {
    const FloatTag d;
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    const auto all = hn::FirstN(d, static_cast<size_t>(N));
    int64_t c0 = 0;
    for (; c0 + 8 * N <= n; c0 += 8 * N) window_sum_block<8, true>(w, p, sr, sc, rows, cols, c0, all, y);
    if (c0 + 4 * N <= n) window_sum_block<4, true>(w, p, sr, sc, rows, cols, c0, all, y), c0 += 4 * N;
    if (c0 + 2 * N <= n) window_sum_block<2, true>(w, p, sr, sc, rows, cols, c0, all, y), c0 += 2 * N;
    if (c0 + N <= n) window_sum_block<1, true>(w, p, sr, sc, rows, cols, c0, all, y), c0 += N;
    if (c0 < n)
        window_sum_block<1, false>(w, p, sr, sc, rows, cols, c0, hn::FirstN(d, static_cast<size_t>(n - c0)), y);
}

// The exponentials of the attention's softmax per element type: float by the polynomials above, double by
// Highway's Exp (1 ulp), its argument kept above -745, where e^x is 0 in double.
using DoubleTag = hn::ScalableTag<double>;
HWY_INLINE FloatVec softmax_exp(FloatTag d, FloatVec x) { return exp_clamped(d, x); }
HWY_INLINE FloatVec softmax_exp2(FloatTag d, FloatVec x) { return exp2_clamped(d, x); }
HWY_INLINE hn::Vec<DoubleTag> softmax_exp(DoubleTag d, hn::Vec<DoubleTag> x) {
    return hn::Exp(d, hn::Max(x, hn::Set(d, -745.0)));
}
HWY_INLINE hn::Vec<DoubleTag> softmax_exp2(DoubleTag d, hn::Vec<DoubleTag> x) {
    return softmax_exp(d, hn::Mul(x, hn::Set(d, 0.69314718055994531)));
}

// online_softmax_cols's exponentials as bf16 pairs (SoftmaxTileCols::pairs), keys two at a time: 2^(s log2 e -
// m log2 e) in one FMA and exp2_for_bf16, each rounded to nearest even (its float32 bits plus 0x7FFF plus the lowest
// bit kept, the upper half kept), the even key's in the low half of a 32-bit word and the odd key's in the high half,
// so one store writes 16 queries' pairs. The sums add the same float32 exponentials in key order.
template <int64_t G>
HWY_INLINE void exponentials_as_pairs(const SoftmaxTileCols<float>& t, const float* sp, int64_t i0,
                                      const FloatVec* m_new, FloatVec* sum, FloatVec* seen) {
    const FloatTag d;
    const hn::RebindToUnsigned<FloatTag> du;
    constexpr int64_t N = static_cast<int64_t>(hn::MaxLanes(FloatTag()));
    const FloatVec log2e = hn::Set(d, 1.4426950408889634f);
    const auto half = hn::Set(du, 0x7FFFu), one = hn::Set(du, 1u), high = hn::Set(du, 0xFFFF0000u);
    const auto rounded = [&](FloatVec e) {
        const auto bits = hn::BitCast(du, e);
        return hn::Add(bits, hn::Add(half, hn::And(hn::ShiftRight<16>(bits), one)));
    };
    const int64_t n = t.keys, pw = t.panel_width;
    FloatVec m_log2e[G];
    for (int64_t g = 0; g < G; ++g) {
        m_log2e[g] = hn::Mul(m_new[g], log2e);
        seen[g] = hn::Set(d, -std::numeric_limits<float>::infinity());
    }
    for (int64_t j = 0; j < t.pairs_rows; j += 2) {
        uint32_t* const words = reinterpret_cast<uint32_t*>(t.pairs + j / 2 * t.pairs_ld) + i0;
        for (int64_t g = 0; g < G; ++g) {
            FloatVec e0 = hn::Zero(d), e1 = hn::Zero(d);
            if (j < n) {
                const FloatVec s0 = hn::LoadU(d, sp + j * pw + g * N);
                seen[g] = hn::Max(seen[g], s0);
                e0 = exp2_for_bf16(d, hn::MulSub(s0, log2e, m_log2e[g]));
                sum[g] = hn::Add(sum[g], e0);
            }
            if (j + 1 < n) {
                const FloatVec s1 = hn::LoadU(d, sp + (j + 1) * pw + g * N);
                seen[g] = hn::Max(seen[g], s1);
                e1 = exp2_for_bf16(d, hn::MulSub(s1, log2e, m_log2e[g]));
                sum[g] = hn::Add(sum[g], e1);
            }
            hn::StoreU(hn::Or(hn::ShiftRight<16>(rounded(e0)), hn::And(rounded(e1), high)), du, words + g * N);
        }
    }
}

// The accumulated output's columns times their factors: o[c * ldo + i] *= alpha[i], c < dv, i < queries (whole
// vectors, into the padding lanes).
template <typename T>
HWY_INLINE void rescale_outputs(const SoftmaxTileCols<T>& t) {
    const hn::ScalableTag<T> d;
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    for (int64_t c = 0; c < t.dv; ++c) {
        T* const oc = t.o + c * t.ldo;
        for (int64_t i = 0; i < t.queries; i += N)
            hn::StoreU(hn::Mul(hn::LoadU(d, oc + i), hn::LoadU(d, t.alpha + i)), d, oc + i);
    }
}

// The maxima over a strip's n keys (key j at sp + j * pw, G vectors of queries), in two registers per vector.
template <typename T, int64_t G>
HWY_INLINE void strip_maxima(const T* sp, int64_t n, int64_t pw, hn::Vec<hn::ScalableTag<T>>* out) {
    const hn::ScalableTag<T> d;
    using V = hn::Vec<decltype(d)>;
    constexpr int64_t N = static_cast<int64_t>(hn::MaxLanes(hn::ScalableTag<T>()));
    V mx[G], mx2[G];
    for (int64_t g = 0; g < G; ++g) mx[g] = mx2[g] = hn::LoadU(d, sp + g * N);
    int64_t j = 1;
    for (; j + 2 <= n; j += 2)
        for (int64_t g = 0; g < G; ++g) {
            mx[g] = hn::Max(mx[g], hn::LoadU(d, sp + j * pw + g * N));
            mx2[g] = hn::Max(mx2[g], hn::LoadU(d, sp + (j + 1) * pw + g * N));
        }
    if (j < n)
        for (int64_t g = 0; g < G; ++g) mx[g] = hn::Max(mx[g], hn::LoadU(d, sp + j * pw + g * N));
    for (int64_t g = 0; g < G; ++g) out[g] = hn::Max(mx[g], mx2[g]);
}

// The pairs form of online_softmax_cols (SoftmaxTileCols::pairs). After the first tile a strip keeps its shift m
// while none of its logits exceeds it by more than kLazyShift: its exponentials are then at most e^8, far inside
// float's and bf16's range, the pass over the strip for its maxima is saved (a quarter of this kernel's time in a
// bf16 DeiT at 1024 px, perf), alpha is 1 and the output is not rescaled. The maxima are taken during the
// exponentials; a strip whose logits exceed the shift by more is computed again, shifted by its new maximum.
constexpr float kLazyShift = 8.0f;

void online_softmax_pairs(const SoftmaxTileCols<float>& t) {
    const FloatTag d;
    constexpr int64_t N = static_cast<int64_t>(hn::MaxLanes(FloatTag()));
    constexpr int64_t G = N >= 16 ? 1 : 16 / N;  // vectors per group of 16 queries
    const FloatVec log2e = hn::Set(d, 1.4426950408889634f), one = hn::Set(d, 1.0f);
    bool rescaled = false;
    for (int64_t i0 = 0; i0 < t.queries; i0 += G * N) {
        const float* const sp = t.s + i0 / t.panel_width * t.panel_stride + i0 % t.panel_width;
        FloatVec shift[G], sum[G], seen[G];
        bool have_maxima = false;
        if (!t.first) {
            for (int64_t g = 0; g < G; ++g) {
                shift[g] = hn::LoadU(d, t.m + i0 + g * N);
                sum[g] = hn::Zero(d);
            }
            exponentials_as_pairs<G>(t, sp, i0, shift, sum, seen);
            bool within = true;
            for (int64_t g = 0; g < G; ++g)
                within = within && hn::AllTrue(d, hn::Le(seen[g], hn::Add(shift[g], hn::Set(d, kLazyShift))));
            if (within) {
                for (int64_t g = 0; g < G; ++g) {
                    float* const li = t.l + i0 + g * N;
                    hn::StoreU(one, d, t.alpha + i0 + g * N);
                    hn::StoreU(hn::Add(hn::LoadU(d, li), sum[g]), d, li);
                }
                continue;
            }
            have_maxima = true;  // seen holds the strip's maxima
        }
        if (!have_maxima) strip_maxima<float, G>(sp, t.keys, t.panel_width, seen);
        for (int64_t g = 0; g < G; ++g) {
            float* const mi = t.m + i0 + g * N;
            const FloatVec m_old = hn::LoadU(d, mi);
            shift[g] = t.first ? seen[g] : hn::Max(seen[g], m_old);
            hn::StoreU(shift[g], d, mi);
            hn::StoreU(t.first ? hn::Zero(d) : softmax_exp2(d, hn::Mul(hn::Sub(m_old, shift[g]), log2e)), d,
                       t.alpha + i0 + g * N);
            sum[g] = hn::Zero(d);
        }
        exponentials_as_pairs<G>(t, sp, i0, shift, sum, seen);
        for (int64_t g = 0; g < G; ++g) {
            float* const li = t.l + i0 + g * N;
            hn::StoreU(t.first ? sum[g] : hn::MulAdd(hn::LoadU(d, li), hn::LoadU(d, t.alpha + i0 + g * N), sum[g]),
                       d, li);
        }
        rescaled = rescaled || !t.first;
    }
    if (rescaled) rescale_outputs(t);
}

// simd.h's online_softmax_cols, 16 queries (a 64-byte line of floats) at a time: their maxima over the tile's keys,
// then the exponentials and their sums, the 16 queries' maxima and sums in registers. A group of 16 floats over
// 512 keys is 32 KiB, about the L1, so taking one vector of 8 (AVX2) at a time would read each line from the L2
// four times instead of twice. The maxima are kept in two registers per vector (one would wait on each max's
// latency on AVX-512, one vector per group). e^x is computed as 2^(x log2 e): the rounding of x log2 e costs
// |x| 6e-8 relative, below 1.2e-6 for the exponentials that count next to the maximum's 1 (x > -20).
template <typename T>
HWY_INLINE void online_softmax_cols_t(const SoftmaxTileCols<T>& t) {
    const hn::ScalableTag<T> d;
    using V = hn::Vec<decltype(d)>;
    constexpr int64_t N = static_cast<int64_t>(hn::MaxLanes(hn::ScalableTag<T>()));
    constexpr int64_t G = N >= 16 ? 1 : 16 / N;  // vectors per group of 16 queries
    const int64_t n = t.keys, pw = t.panel_width;
    const V log2e = hn::Set(d, T(1.4426950408889634));
    for (int64_t i0 = 0; i0 < t.queries; i0 += G * N) {
        T* const sp = t.s + i0 / pw * t.panel_stride + i0 % pw;  // key j of these queries: sp + j * pw
        V mx_all_g[G];
        strip_maxima<T, G>(sp, n, pw, mx_all_g);
        V m_new[G], sum[G];
        for (int64_t g = 0; g < G; ++g) {
            T* const mi = t.m + i0 + g * N;
            const V mx_all = mx_all_g[g];
            const V m_old = hn::LoadU(d, mi);
            m_new[g] = t.first ? mx_all : hn::Max(mx_all, m_old);
            hn::StoreU(m_new[g], d, mi);
            hn::StoreU(t.first ? hn::Zero(d) : softmax_exp2(d, hn::Mul(hn::Sub(m_old, m_new[g]), log2e)), d,
                       t.alpha + i0 + g * N);
            sum[g] = hn::Zero(d);
        }
        const auto exponentials_over_s = [&] {
            for (int64_t jj = 0; jj < n; ++jj)
                for (int64_t g = 0; g < G; ++g) {
                    T* const p = sp + jj * pw + g * N;
                    const V e = softmax_exp2(d, hn::Mul(hn::Sub(hn::LoadU(d, p), m_new[g]), log2e));
                    hn::StoreU(e, d, p);
                    sum[g] = hn::Add(sum[g], e);
                }
        };
        exponentials_over_s();
        for (int64_t g = 0; g < G; ++g) {
            T* const li = t.l + i0 + g * N;
            hn::StoreU(t.first ? sum[g] : hn::MulAdd(hn::LoadU(d, li), hn::LoadU(d, t.alpha + i0 + g * N), sum[g]),
                       d, li);
        }
    }
    if (!t.first) rescale_outputs(t);
}

// simd.h's softmax_grad_rows: full vectors, then one masked tail per row.
template <typename T>
HWY_INLINE void softmax_grad_rows_t(T* s, T* dp, int64_t rows, int64_t n, int64_t ld, const T* lse, const T* D) {
    const hn::ScalableTag<T> d;
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    for (int64_t r = 0; r < rows; ++r) {
        T* const sr = s + r * ld;
        T* const dr = dp + r * ld;
        const auto lr = hn::Set(d, lse[r]), Dr = hn::Set(d, D[r]);
        int64_t j = 0;
        for (; j + N <= n; j += N) {
            const auto p = softmax_exp(d, hn::Sub(hn::LoadU(d, sr + j), lr));
            hn::StoreU(p, d, sr + j);
            hn::StoreU(hn::Mul(p, hn::Sub(hn::LoadU(d, dr + j), Dr)), d, dr + j);
        }
        if (j < n) {
            const auto mask = hn::FirstN(d, static_cast<size_t>(n - j));
            const auto p = softmax_exp(d, hn::Sub(hn::MaskedLoad(mask, d, sr + j), lr));
            hn::BlendedStore(p, mask, d, sr + j);
            hn::BlendedStore(hn::Mul(p, hn::Sub(hn::MaskedLoad(mask, d, dr + j), Dr)), mask, d, dr + j);
        }
    }
}

void online_softmax_cols_f32(const SoftmaxTileCols<float>& t) {
    if (t.pairs != nullptr) online_softmax_pairs(t);
    else online_softmax_cols_t(t);
}
void online_softmax_cols_f64(const SoftmaxTileCols<double>& t) { online_softmax_cols_t(t); }
void softmax_grad_rows_f32(float* s, float* dp, int64_t rows, int64_t n, int64_t ld, const float* lse,
                           const float* D) {
    softmax_grad_rows_t(s, dp, rows, n, ld, lse, D);
}
void softmax_grad_rows_f64(double* s, double* dp, int64_t rows, int64_t n, int64_t ld, const double* lse,
                           const double* D) {
    softmax_grad_rows_t(s, dp, rows, n, ld, lse, D);
}

const Kernels& table() {
    static const Kernels k{kTarget,        gemm_f32,       gemm_f64,   sigmoid,   gelu_erf,
                           gelu_tanh,      silu_mul,       silu_mul_rows, silu_mul_backward_rows,
                           silu_mul_backward_rows_backward,
                           exp_sub,        widen_bf16,     narrow_to_bf16,
                           stencil3x3_row, stencil3x3_reduce_row, transpose, window_dots, window_sum,
                           online_softmax_cols_f32, online_softmax_cols_f64, softmax_grad_rows_f32,
                           softmax_grad_rows_f64};
    return k;
}

}  // namespace linvis::ops::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <string>

#include "linvis/core/error.h"
#include "ops/simd/per_target.h"

namespace linvis::ops::simd {

const char* target_name(Target t) {
    switch (t) {
        case Target::Avx512: return "AVX-512";
        case Target::Avx2: return "AVX2";
        case Target::Scalar: return "scalar";
    }
    return "scalar";
}

bool target_supported(Target t) {
    static const int64_t supported = hwy::SupportedTargets();
    switch (t) {
        case Target::Avx512: return (HWY_TARGETS & HWY_AVX3) != 0 && (supported & HWY_AVX3) != 0;
        case Target::Avx2: return (HWY_TARGETS & HWY_AVX2) != 0 && (supported & HWY_AVX2) != 0;
        case Target::Scalar: return true;
    }
    return false;
}

Target active_target() {
    Target want = Target::Avx512;
    const char* force = std::getenv("LINVIS_FORCE_SCALAR");
    const char* env = std::getenv("LINVIS_SIMD");
    if (force != nullptr && *force != '\0' && std::strcmp(force, "0") != 0) {
        want = Target::Scalar;
    } else if (env != nullptr && *env != '\0') {
        const std::string v = env;
        if (v == "avx512") want = Target::Avx512;
        else if (v == "avx2") want = Target::Avx2;
        else if (v == "scalar") want = Target::Scalar;
        else fail("LINVIS_SIMD: expected 'avx512', 'avx2' or 'scalar', got '", v, "'");
    }
    // The best supported target at or below the request.
    while (!target_supported(want)) want = static_cast<Target>(static_cast<int>(want) - 1);
    return want;
}

const Kernels& kernels(Target t) {
    LINVIS_CHECK(target_supported(t), "simd::kernels: target ", target_name(t), " is not supported by this CPU");
    LINVIS_SIMD_PER_TARGET(t, table)
}

const Kernels& kernels() { return kernels(active_target()); }

}  // namespace linvis::ops::simd
#endif  // HWY_ONCE
