// Fused ViT³ / T⁵ building blocks; see kernels.h.
#include "ops/ttt_swiglu_cpu/kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "linvis/ops/impl.h"

#define LINVIS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define LINVIS_INLINE inline __attribute__((always_inline))

namespace linvis::ops::fused_detail {
namespace {

// ---------------------------------------------------------------- portable kernels

void gemm_scalar(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    for (int64_t i = 0; i < M; ++i) {
        float* c = C + i * ldc;
        if (!accumulate) std::fill(c, c + N, 0.0f);
        for (int64_t k = 0; k < K; ++k) {
            const float a = A[i * a_row + k * a_col];
            const float* b = B + k * ldb;
            for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
        }
    }
}

void sigmoid_scalar(const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / (1.0f + std::exp(-x[i]));
}

// The stencil bodies are written once and inlined into a default-target and an AVX-512 wrapper,
// so the compiler vectorises the channel loops for each instruction set.
LINVIS_INLINE void stencil_apply_body(const Image& src, const float* taps, bool transpose, const MutImage& dst,
                                      int64_t y0, int64_t y1, bool accumulate) {
    const int64_t C = src.C, f = transpose ? -1 : 1;
    for (int64_t y = y0; y < y1; ++y)
        for (int64_t x = 0; x < src.W; ++x) {
            float* __restrict o = dst.at(y, x);
            if (!accumulate)
                for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
            for (int64_t dy = -1; dy <= 1; ++dy) {
                const int64_t ys = y + f * dy;
                if (ys < 0 || ys >= src.H) continue;
                for (int64_t dx = -1; dx <= 1; ++dx) {
                    const int64_t xs = x + f * dx;
                    if (xs < 0 || xs >= src.W) continue;
                    const float* __restrict s = src.at(ys, xs);
                    const float* __restrict t = taps + ((dy + 1) * 3 + dx + 1) * C;
                    for (int64_t c = 0; c < C; ++c) o[c] += t[c] * s[c];
                }
            }
        }
}

LINVIS_INLINE void stencil_reduce_body(const Image& a, const Image& b, float* acc, int64_t y0, int64_t y1) {
    const int64_t C = a.C;
    for (int64_t y = y0; y < y1; ++y)
        for (int64_t x = 0; x < a.W; ++x) {
            const float* __restrict bv = b.at(y, x);
            for (int64_t dy = -1; dy <= 1; ++dy) {
                const int64_t ys = y + dy;
                if (ys < 0 || ys >= a.H) continue;
                for (int64_t dx = -1; dx <= 1; ++dx) {
                    const int64_t xs = x + dx;
                    if (xs < 0 || xs >= a.W) continue;
                    const float* __restrict av = a.at(ys, xs);
                    float* __restrict t = acc + ((dy + 1) * 3 + dx + 1) * C;
                    for (int64_t c = 0; c < C; ++c) t[c] += av[c] * bv[c];
                }
            }
        }
}

void stencil_apply_default(const Image& src, const float* taps, bool transpose, const MutImage& dst, int64_t y0,
                           int64_t y1, bool accumulate) {
    stencil_apply_body(src, taps, transpose, dst, y0, y1, accumulate);
}
void stencil_reduce_default(const Image& a, const Image& b, float* acc, int64_t y0, int64_t y1) {
    stencil_reduce_body(a, b, acc, y0, y1);
}

// ---------------------------------------------------------------- AVX-512 kernels

// C rows [0, MR) x 16*NV columns (the last vector masked): MR x NV accumulators of 16 floats.
template <int MR, int NV>
LINVIS_AVX512 LINVIS_INLINE void gemm_block_avx512(int64_t K, const float* A, int64_t a_row, int64_t a_col,
                                                   const float* B, int64_t ldb, float* C, int64_t ldc,
                                                   const __mmask16* mask, bool accumulate) {
    __m512 c[MR][NV];
    _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; ++v) c[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float* b = B + k * ldb;
        __m512 bv[NV];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; ++v) bv[v] = _mm512_maskz_loadu_ps(mask[v], b + 16 * v);
        const float* a = A + k * a_col;
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {
            const __m512 av = _mm512_set1_ps(a[r * a_row]);
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(av, bv[v], c[r][v]);
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; ++v) {
            float* out = C + r * ldc + 16 * v;
            __m512 val = c[r][v];
            if (accumulate) val = _mm512_add_ps(val, _mm512_maskz_loadu_ps(mask[v], out));
            _mm512_mask_storeu_ps(out, mask[v], val);
        }
}

// All M rows for one column panel of NV vectors: MR-row blocks, then 4-row, then single rows.
template <int MR, int NV>
LINVIS_AVX512 void gemm_panel_avx512(int64_t M, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                                     const float* B, int64_t ldb, float* C, int64_t ldc, const __mmask16* mask,
                                     bool accumulate) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR)
        gemm_block_avx512<MR, NV>(K, A + i * a_row, a_row, a_col, B, ldb, C + i * ldc, ldc, mask, accumulate);
    for (; i + 4 <= M; i += 4)
        gemm_block_avx512<4, NV>(K, A + i * a_row, a_row, a_col, B, ldb, C + i * ldc, ldc, mask, accumulate);
    for (; i < M; ++i)
        gemm_block_avx512<1, NV>(K, A + i * a_row, a_row, a_col, B, ldb, C + i * ldc, ldc, mask, accumulate);
}

LINVIS_AVX512 void gemm_avx512(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                               const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    for (int64_t j0 = 0; j0 < N; j0 += 64) {
        const int64_t width = std::min<int64_t>(64, N - j0);
        const int nv = static_cast<int>((width + 15) / 16);
        __mmask16 mask[4];
        for (int v = 0; v < 4; ++v) {
            const int64_t rem = width - 16 * v;
            mask[v] = rem >= 16 ? static_cast<__mmask16>(0xFFFF)
                                : rem <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << rem) - 1u);
        }
        const float* Bj = B + j0;
        float* Cj = C + j0;
        switch (nv) {
            case 4: gemm_panel_avx512<6, 4>(M, K, A, a_row, a_col, Bj, ldb, Cj, ldc, mask, accumulate); break;
            case 3: gemm_panel_avx512<8, 3>(M, K, A, a_row, a_col, Bj, ldb, Cj, ldc, mask, accumulate); break;
            case 2: gemm_panel_avx512<12, 2>(M, K, A, a_row, a_col, Bj, ldb, Cj, ldc, mask, accumulate); break;
            default: gemm_panel_avx512<16, 1>(M, K, A, a_row, a_col, Bj, ldb, Cj, ldc, mask, accumulate); break;
        }
    }
}

// exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial (Cephes expf coefficients),
// scaled by 2^n with scalef. Relative error about 2 ulp on the clamped range.
LINVIS_AVX512 LINVIS_INLINE __m512 exp_avx512(__m512 x) {
    // The maskz forms (all lanes) avoid GCC 12's -Wmaybe-uninitialized on _mm512_undefined_ps.
    const __mmask16 all = 0xFFFF;
    x = _mm512_maskz_min_ps(all, _mm512_maskz_max_ps(all, x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_maskz_roundscale_ps(all, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(all, p, n);
}

LINVIS_AVX512 void sigmoid_avx512(const float* x, float* y, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(x + i)));
        _mm512_storeu_ps(y + i, _mm512_div_ps(one, _mm512_add_ps(one, e)));
    }
    if (i < n) {
        const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_maskz_loadu_ps(m, x + i)));
        _mm512_mask_storeu_ps(y + i, m, _mm512_div_ps(one, _mm512_add_ps(one, e)));
    }
}

LINVIS_AVX512 void stencil_apply_avx512(const Image& src, const float* taps, bool transpose, const MutImage& dst,
                                        int64_t y0, int64_t y1, bool accumulate) {
    stencil_apply_body(src, taps, transpose, dst, y0, y1, accumulate);
}
LINVIS_AVX512 void stencil_reduce_avx512(const Image& a, const Image& b, float* acc, int64_t y0, int64_t y1) {
    stencil_reduce_body(a, b, acc, y0, y1);
}

}  // namespace

const Kernels& kernels() {
    static const Kernels portable{false, gemm_scalar, sigmoid_scalar};
    static const Kernels avx512{true, gemm_avx512, sigmoid_avx512};
    return fused_kernels_use_avx512() ? avx512 : portable;
}

void stencil_apply(const Image& src, const float* taps, bool transpose, const MutImage& dst, int64_t y0, int64_t y1,
                   bool accumulate) {
    if (kernels().avx512)
        stencil_apply_avx512(src, taps, transpose, dst, y0, y1, accumulate);
    else
        stencil_apply_default(src, taps, transpose, dst, y0, y1, accumulate);
}

void stencil_reduce(const Image& a, const Image& b, float* acc, int64_t y0, int64_t y1) {
    if (kernels().avx512)
        stencil_reduce_avx512(a, b, acc, y0, y1);
    else
        stencil_reduce_default(a, b, acc, y0, y1);
}

void normalize_groups(const float* G, int64_t rows, int64_t cols, int64_t ld, bool columns_are_groups, float* out,
                      float* norms) {
    const int64_t groups = columns_are_groups ? cols : rows, len = columns_are_groups ? rows : cols;
    for (int64_t g = 0; g < groups; ++g) {
        auto idx = [&](int64_t i) { return columns_are_groups ? i * ld + g : g * ld + i; };
        double sq = 0.0;
        for (int64_t i = 0; i < len; ++i) sq += static_cast<double>(G[idx(i)]) * G[idx(i)];
        const float nrm = static_cast<float>(std::sqrt(sq));
        norms[g] = nrm;
        const float denom = nrm + 1.0f;
        for (int64_t i = 0; i < len; ++i) out[idx(i)] = G[idx(i)] / denom;
    }
}

void normalize_groups_backward(const float* G, const float* dOut, const float* norms, int64_t rows, int64_t cols,
                               int64_t ld, bool columns_are_groups, float* dG) {
    const int64_t groups = columns_are_groups ? cols : rows, len = columns_are_groups ? rows : cols;
    for (int64_t g = 0; g < groups; ++g) {
        auto idx = [&](int64_t i) { return columns_are_groups ? i * ld + g : g * ld + i; };
        const double nrm = norms[g], denom = nrm + 1.0;
        double dot = 0.0;
        for (int64_t i = 0; i < len; ++i) dot += static_cast<double>(dOut[idx(i)]) * G[idx(i)];
        const double coef = nrm > 0.0 ? dot / (nrm * denom * denom) : 0.0;
        for (int64_t i = 0; i < len; ++i)
            dG[idx(i)] = static_cast<float>(dOut[idx(i)] / denom - coef * G[idx(i)]);
    }
}

void transpose(const float* in, int64_t rows, int64_t cols, int64_t ld, float* out) {
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) out[j * rows + i] = in[i * ld + j];
}

}  // namespace linvis::ops::fused_detail
