// The one SIMD layer of the fused CPU kernels (private to ops). Built on Google Highway
// (Debian libhwy-dev): the building blocks are written once with Highway ops (gemm-inl.h, compiled
// per target by kernels.cpp) and chosen at run time, per call, from a per-target table.
//
// Targets compiled (hwy_targets.h): Highway's AVX3 ("AVX-512": F, VL, DQ, BW), AVX2 (with FMA,
// BMI2, F16C) and the portable fallback ("scalar": C++ without intrinsics; Highway's EMU128, or its
// one-lane HWY_SCALAR with GCC < 12.3, where Highway 1.0.3 marks EMU128 broken). SSSE3/SSE4 are left out (no
// gain over the portable loops worth their compile time); AVX3_DL/AVX512-BF16 are not targets of
// Highway 1.0.3 (the kernels compute in float32, bfloat16 is converted on entry).
//
// Which target runs: the best the CPU supports, lowered by the environment, read on every call so
// tests switch paths inside one process:
//   LINVIS_SIMD=avx512|avx2|scalar   ask for that target (a target the CPU lacks gives the best one
//                                    it has: avx512 on an AVX2 CPU runs AVX2);
//   LINVIS_FORCE_SCALAR=1            an alias of LINVIS_SIMD=scalar.
// active_target() says which one runs; ops::fused_kernel_target() is its public name.
#pragma once

#include <cstdint>

namespace linvis::ops::simd {

enum class Target { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// "AVX-512", "AVX2" or "scalar".
const char* target_name(Target t);
// Whether this CPU runs the target's code (scalar always).
bool target_supported(Target t);
// The target the next kernel call runs (environment and CPU, see above). An unknown LINVIS_SIMD value
// is a linvis::Error naming the variable, the accepted values and the value found.
Target active_target();
// Whether the active target is a vector one (AVX2 or AVX-512): where the measured fused kernels beat the
// reference (docs/ops.md), so Impl::Auto asks this.
inline bool vectorised() { return active_target() != Target::Scalar; }

// C[i, j] (+)= sum_k A[i*a_row + k*a_col] * B[k*ldb + j], i < M, j < N, k < K (B, C row-major with
// row strides ldb, ldc). a_row/a_col let the same kernel compute A·B (a_col = 1) and Aᵀ·B (a_row = 1).
using GemmF32 = void (*)(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                         const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate);
using GemmF64 = void (*)(int64_t M, int64_t N, int64_t K, const double* A, int64_t a_row, int64_t a_col,
                         const double* B, int64_t ldb, double* C, int64_t ldc, bool accumulate);

// One key tile of the flash-style softmax attention's forward (ops/attention/cpu.cpp), transposed: s holds the
// logits of `keys` keys (rows) for `queries` queries (columns), in column panels of panel_width queries, each
// panel (keys x panel_width, row stride panel_width) panel_stride elements after the previous one. online_softmax_cols
// turns them into e^(s - m_new) and, per query i, updates the running maximum m[i] and normaliser l[i] and rescales
// the accumulated output column o[c * ldo + i] (c < dv) by alpha[i] = e^(m_old - m_new). `first`: the first key
// tile (m, l and o hold nothing yet; o is left as it is). panel_width is a multiple of 16; queries are taken 16
// at a time, so up to the next multiple of 16 past `queries` s, m, l, alpha and o's rows are read and written
// (padding lanes of their own, unused).
// pairs (float only; null: the exponentials are written over s): the exponentials rounded to bf16 (to nearest even)
// as the B operand of an AMX product (simd/amx.h), pairs[(j / 2) * pairs_ld + 2 i + j % 2] for keys j <
// pairs_rows (even; zero for j >= keys), and s keeps the logits. Computed for bf16 (to 7.5e-5 relative, 1/52 of
// the rounding after), and the sums l add these float32 exponentials, so the weights and their sum agree. With
// pairs, m is the exponentials' shift rather than the running maximum: after the first tile, 16 queries keep
// theirs while none of their logits exceeds it by more than 8 (alpha is then 1; the weights stay below e^8), and
// take their new maximum otherwise. O = (sum of weights times values) / l holds either way.
template <typename T>
struct SoftmaxTileCols {
    T* s;
    int64_t keys, queries, panel_width, panel_stride;
    T *m, *l, *alpha, *o;
    int64_t ldo, dv;
    bool first;
    uint16_t* pairs = nullptr;
    int64_t pairs_ld = 0, pairs_rows = 0;
};

// The building blocks of one target.
struct Kernels {
    Target target = Target::Scalar;
    GemmF32 gemm = nullptr;
    GemmF64 gemm_f64 = nullptr;
    // y[i] = 1 / (1 + exp(-x[i])), n elements (x and y may alias).
    void (*sigmoid)(const float* x, float* y, int64_t n) = nullptr;
    // y[i] = GELU(x[i] + bias[i]) (bias may be null: GELU(x[i])), the exact (erf) form to within 1.5e-7 |x| / 2
    // (kernels.cpp); x and y may alias.
    void (*gelu_erf)(const float* x, const float* bias, float* y, int64_t n) = nullptr;
    // The same in the tanh form, with Highway's Tanh.
    void (*gelu_tanh)(const float* x, const float* bias, float* y, int64_t n) = nullptr;
    // y[i] = silu(g[i]) u[i] = g[i] sigmoid(g[i]) u[i]; y may alias g or u.
    void (*silu_mul)(const float* g, const float* u, float* y, int64_t n) = nullptr;
    // The same over rows r < rows of n values, g and u in rows of stride ld (a gate and its input side by side in
    // one product's output), y in rows of stride ldy: y[r*ldy + j] = silu(g[r*ld + j]) u[r*ld + j]; y may alias u.
    void (*silu_mul_rows)(const float* g, const float* u, int64_t ld, int64_t rows, int64_t n, float* y,
                          int64_t ldy) = nullptr;
    // Its backward for the upstream gradient c dy (dy in rows of stride lddy), written over u and g:
    //   u <- c dy silu(g),  g <- c dy u silu'(g),  silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
    void (*silu_mul_backward_rows)(float* g, float* u, int64_t ld, int64_t rows, int64_t n, const float* dy,
                                   int64_t lddy, float c) = nullptr;
    // And the backward of that map (z1, z2, e) -> [e silu(z2) | e z1 silu'(z2)] (ViT3's SwiGLU inner step, whose
    // inner gradient it forms), over rows r < rows of n values: z = [z1 | z2] and the upstream gradient dp = [dp1 |
    // dp2] side by side in rows of stride ld, e = c v (v in rows of stride ldv), s = sigmoid(z2), written in place:
    //   z  <- [e silu(z2) | e z1 silu'(z2)]                              (the map itself, recomputed)
    //   dp <- [dp2 e silu'(z2) | dp1 e silu'(z2) + dp2 e z1 silu''(z2)]  (dz1, dz2)
    //   dv[r*lddv + j] = c (dp1 silu(z2) + dp2 z1 silu'(z2))             (dv = c de)
    // with silu''(g) = s (1 - s) (2 + g (1 - 2 s)).
    void (*silu_mul_backward_rows_backward)(float* z, float* dp, int64_t ld, int64_t rows, int64_t n, const float* v,
                                            int64_t ldv, float c, float* dv, int64_t lddv) = nullptr;
    // y[i] = exp(x[i] - shift) for x[i] - shift <= 88 (kernels.cpp: about 2 ulp; 0 below -87); x and y may alias.
    void (*exp_sub)(const float* x, float shift, float* y, int64_t n) = nullptr;
    // bfloat16 (its bit pattern, as c10::BFloat16 stores it) to and from float32. Widening is exact; narrowing
    // rounds to nearest even and turns NaN into 0x7FC0, as c10::BFloat16 does, so a kernel that computes in
    // float32 and narrows once matches LibTorch's `.to(torch::kBFloat16)` of the same values bit for bit.
    void (*widen_bf16)(const uint16_t* x, float* y, int64_t n) = nullptr;
    void (*narrow_to_bf16)(const float* x, uint16_t* y, int64_t n) = nullptr;
    // One output row of a 3x3 per-channel stencil (a depthwise 3x3 convolution on channels-last rows):
    //   out[x*out_sx + c] = (accumulate ? out[x*out_sx + c] : 0) + (bias ? bias[c] : 0)
    //                       + sum_{r, j < 3} taps[(r*3 + j)*C + c] * rows[r][(x + f*(j-1))*sx + c]
    // for x < W, c < C, f = -1 if flip_x else +1; a null row, or a column outside [0, W), contributes 0.
    // Each output vector is summed in a register over its nine taps and stored once, and each source
    // vector is loaded once per row (a sliding window of three columns). out must not overlap the rows.
    void (*stencil3x3_row)(const float* const* rows, int64_t sx, int64_t W, int64_t C, const float* taps,
                           bool flip_x, const float* bias, float* out, int64_t out_sx, bool accumulate) = nullptr;
    // The 3x3 per-channel correlation of one row b with its neighbourhood in a (the taps' gradient of
    // stencil3x3_row for output gradient b):
    //   acc[(r*3 + j)*C + c] += sum_{x < W} a_rows[r][(x + j - 1)*a_sx + c] * b[x*b_sx + c]
    // with a null row, or a column outside [0, W), contributing 0. The nine sums of a channel vector stay in
    // registers over the row; acc is read and written once per call.
    void (*stencil3x3_reduce_row)(const float* const* a_rows, int64_t a_sx, const float* b, int64_t b_sx, int64_t W,
                                  int64_t C, float* acc) = nullptr;
    // dst[j*ldd + i] = src[i*lds + j] for i < rows, j < cols: blocks of one vector's width square transposed in
    // registers, the edges element by element. dst must not overlap src.
    void (*transpose)(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst, int64_t ldd) = nullptr;
    // One query's window of a neighbourhood attention (ops/neighborhood_attention): rows x cols keys, key (r, j) the
    // n contiguous floats at p + r*sr + j*sc.
    //   window_dots: out[r*cols + j] = sum_{c < n} x[c] key(r, j)[c]  (keys 8 at a time, a register each)
    //   window_sum:  y[c] = sum_{r, j} w[r*cols + j] key(r, j)[c], c < n  (y in registers over the window)
    void (*window_dots)(const float* x, const float* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols, int64_t n,
                        float* out) = nullptr;
    void (*window_sum)(const float* w, const float* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols, int64_t n,
                       float* y) = nullptr;
    // The softmax attention's online softmax over one key tile (SoftmaxTileCols above): the exponentials as
    // 2^((s - m) log2 e), in float by a polynomial to about 2 ulp (kernels.cpp), in double by Highway's Exp.
    void (*online_softmax_cols)(const SoftmaxTileCols<float>& tile) = nullptr;
    void (*online_softmax_cols_f64)(const SoftmaxTileCols<double>& tile) = nullptr;
    // Its backward, per row r < rows of two row-major tiles (row stride ld, n columns): p = e^(s - lse[r]) into s,
    // then p (dp - D[r]) into dp.
    void (*softmax_grad_rows)(float* s, float* dp, int64_t rows, int64_t n, int64_t ld, const float* lse,
                              const float* D) = nullptr;
    void (*softmax_grad_rows_f64)(double* s, double* dp, int64_t rows, int64_t n, int64_t ld, const double* lse,
                                  const double* D) = nullptr;
};

// The kernels of active_target(), or of a given (supported) target.
const Kernels& kernels();
const Kernels& kernels(Target t);

// The GEMM of a kernel table for float or double, so templates over the element type call one name.
inline void gemm(const Kernels& k, int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    k.gemm(M, N, K, A, a_row, a_col, B, ldb, C, ldc, accumulate);
}
inline void gemm(const Kernels& k, int64_t M, int64_t N, int64_t K, const double* A, int64_t a_row, int64_t a_col,
                 const double* B, int64_t ldb, double* C, int64_t ldc, bool accumulate) {
    k.gemm_f64(M, N, K, A, a_row, a_col, B, ldb, C, ldc, accumulate);
}

// The softmax attention's kernels for float or double.
inline void online_softmax_cols(const Kernels& k, const SoftmaxTileCols<float>& t) { k.online_softmax_cols(t); }
inline void online_softmax_cols(const Kernels& k, const SoftmaxTileCols<double>& t) { k.online_softmax_cols_f64(t); }
inline void softmax_grad_rows(const Kernels& k, float* s, float* dp, int64_t rows, int64_t n, int64_t ld,
                              const float* lse, const float* D) {
    k.softmax_grad_rows(s, dp, rows, n, ld, lse, D);
}
inline void softmax_grad_rows(const Kernels& k, double* s, double* dp, int64_t rows, int64_t n, int64_t ld,
                              const double* lse, const double* D) {
    k.softmax_grad_rows_f64(s, dp, rows, n, ld, lse, D);
}

// Where the register-blocked GEMM's accumulators start (gemm-inl.h): C itself (C += A B), zero
// (C = A B), or one row broadcast to every row (C = row + A B).
enum class GemmInit { Accumulate, Zero, Row };

// y = pass(x, z) for n bfloat16 values, computed in float32 through buffers on the stack a chunk at a time
// (each array read or written once, the float32 values in cache, instead of widened copies of whole tensors).
// pass has the kernels' elementwise signature pass(const float* x, const float* z, float* y, int64_t n) with
// y = x allowed; z may be null (pass then gets null); y may alias x or z.
template <typename Pass>
void bf16_through_float(const Kernels& k, const uint16_t* x, const uint16_t* z, uint16_t* y, int64_t n,
                        Pass&& pass) {
    constexpr int64_t kChunk = 512;
    alignas(64) float fx[kChunk];
    alignas(64) float fz[kChunk];
    for (int64_t i = 0; i < n; i += kChunk) {
        const int64_t m = n - i < kChunk ? n - i : kChunk;
        k.widen_bf16(x + i, fx, m);
        if (z != nullptr) k.widen_bf16(z + i, fz, m);
        pass(fx, z != nullptr ? fz : nullptr, fx, m);
        k.narrow_to_bf16(fx, y + i, m);
    }
}

}  // namespace linvis::ops::simd

// Loops that the compiler vectorises by itself (elementwise bodies, stencils, LayerNorm rows) are written
// once as an always-inline body and compiled for the same three targets by LINVIS_SIMD_CLONES: the
// target attributes are Highway's HWY_TARGET_STR for AVX2 and AVX3 (hwy/ops/set_macros-inl.h), and the
// wrapper picks the clone of active_target() on every call.
#define LINVIS_SIMD_INLINE inline __attribute__((always_inline))
#define LINVIS_SIMD_ATTR_AVX2 __attribute__((target("sse2,ssse3,sse4.1,sse4.2,pclmul,aes,avx,avx2,bmi,bmi2,fma,f16c")))
#define LINVIS_SIMD_ATTR_AVX512 \
    __attribute__((target("sse2,ssse3,sse4.1,sse4.2,pclmul,aes,avx,avx2,bmi,bmi2,fma,f16c,avx512f,avx512vl,avx512dq,avx512bw")))
#define LINVIS_SIMD_CLONES(name, PARAMS, ARGS)                                   \
    void name##_scalar PARAMS { name##_body ARGS; }                              \
    LINVIS_SIMD_ATTR_AVX2 void name##_avx2 PARAMS { name##_body ARGS; }          \
    LINVIS_SIMD_ATTR_AVX512 void name##_avx512 PARAMS { name##_body ARGS; }      \
    void name PARAMS {                                                           \
        switch (::linvis::ops::simd::active_target()) {                          \
            case ::linvis::ops::simd::Target::Avx512: name##_avx512 ARGS; break; \
            case ::linvis::ops::simd::Target::Avx2: name##_avx2 ARGS; break;     \
            default: name##_scalar ARGS; break;                                  \
        }                                                                        \
    }
