// Internal building blocks of the fused ViT³ / T⁵ CPU kernels (not a public header).
// All kernels work on float32 with the last (channel) dimension contiguous; other strides are
// passed explicitly so that q, k, v can be read straight out of the qkv projection.
// The AVX-512 versions are compiled with a function-level target attribute and chosen at run time
// (linvis::runtime::detect_simd); LINVIS_FORCE_SCALAR=1 in the environment forces the portable path.
#pragma once

#include <cstdint>

namespace linvis::ops::fused_detail {

struct Kernels {
    bool avx512 = false;
    // C[i, j] (+)= sum_k A[i*a_row + k*a_col] * B[k*ldb + j], i < M, j < N, k < K.
    // a_row/a_col let the same kernel compute A·B (a_col = 1) and Aᵀ·B (a_row = 1).
    void (*gemm)(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool accumulate) = nullptr;
    // y[i] = 1 / (1 + exp(-x[i])), n elements (x and y may alias).
    void (*sigmoid)(const float* x, float* y, int64_t n) = nullptr;
};

// The kernels for this CPU, or the portable ones when LINVIS_FORCE_SCALAR is set to a non-zero value
// (read on every call so tests can switch paths inside one process).
const Kernels& kernels();

// One image of a (B, H, W, C) channels-last tensor: element (y, x, c) at base[y*sy + x*sx + c].
struct Image {
    const float* base;
    int64_t sy, sx, H, W, C;
    const float* at(int64_t y, int64_t x) const { return base + y * sy + x * sx; }
};
struct MutImage {
    float* base;
    int64_t sy, sx, H, W, C;
    float* at(int64_t y, int64_t x) const { return base + y * sy + x * sx; }
};

// 3x3 per-channel stencil over rows [y0, y1):
//   dst(y, x, c) (+)= sum_{dy,dx in -1..1} taps[(dy+1)*3 + dx+1][c] * src(y + f*dy, x + f*dx, c)
// with f = +1 (cross-correlation, conv2d) or -1 (its transpose), zero outside the image.
// taps: 9 x C (tap-major). accumulate: add to dst instead of overwriting.
void stencil_apply(const Image& src, const float* taps, bool transpose, const MutImage& dst, int64_t y0, int64_t y1,
                   bool accumulate);
// acc[tap][c] += sum_{y in [y0,y1), x} a(y + dy, x + dx, c) * b(y, x, c) (zero outside): the 3x3
// per-channel correlation of a with b, i.e. dL/dtaps of stencil_apply(a, ·) for output gradient b.
void stencil_reduce(const Image& a, const Image& b, float* acc, int64_t y0, int64_t y1);

// Official gradient normalisation of one matrix G (rows x cols, row-major, row stride ld):
// column j divided by (||G[:, j]||_2 + 1) when columns_are_groups, otherwise each row divided by
// (||G[i, :]||_2 + 1). out = G / (norm + 1); norms (+1 not included) written to `norms`.
void normalize_groups(const float* G, int64_t rows, int64_t cols, int64_t ld, bool columns_are_groups, float* out,
                      float* norms);
// Backward of normalize_groups: dG = dOut/(n+1) - G * <dOut, G>_group / (n (n+1)^2) (0 when n = 0).
void normalize_groups_backward(const float* G, const float* dOut, const float* norms, int64_t rows, int64_t cols,
                               int64_t ld, bool columns_are_groups, float* dG);

// out[j*rows + i] = in[i*ld + j] for a rows x cols block.
void transpose(const float* in, int64_t rows, int64_t cols, int64_t ld, float* out);

}  // namespace linvis::ops::fused_detail

// Elementwise loops of the fused ops are written once as an always-inline body and compiled twice
// (portable and AVX-512) by LINVIS_FUSED_DUAL; the wrapper picks one per call like kernels().
#define LINVIS_FUSED_INLINE inline __attribute__((always_inline))
#define LINVIS_FUSED_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define LINVIS_FUSED_DUAL(name, PARAMS, ARGS)                                                 \
    void name##_portable PARAMS { name##_body ARGS; }                                         \
    LINVIS_FUSED_AVX512 void name##_avx512 PARAMS { name##_body ARGS; }                       \
    void name PARAMS {                                                                        \
        if (::linvis::ops::fused_detail::kernels().avx512)                                    \
            name##_avx512 ARGS;                                                               \
        else                                                                                  \
            name##_portable ARGS;                                                             \
    }
