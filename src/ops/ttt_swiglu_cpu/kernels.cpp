// Fused ViT³ / T⁵ building blocks; see kernels.h.
#include "ops/ttt_swiglu_cpu/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace linvis::ops::fused_detail {
namespace {

// The float64 stencil and its reduction are written once and compiled for every target by LINVIS_SIMD_CLONES, so
// the compiler vectorises the channel loops for each instruction set.
template <typename T>
LINVIS_SIMD_INLINE void stencil_apply_body(const ImageOf<T>& src, const T* taps, bool transpose,
                                           const MutImageOf<T>& dst, int64_t y0, int64_t y1, bool accumulate) {
    const int64_t C = src.C, f = transpose ? -1 : 1;
    for (int64_t y = y0; y < y1; ++y)
        for (int64_t x = 0; x < src.W; ++x) {
            T* __restrict o = dst.at(y, x);
            if (!accumulate)
                for (int64_t c = 0; c < C; ++c) o[c] = T(0);
            for (int64_t dy = -1; dy <= 1; ++dy) {
                const int64_t ys = y + f * dy;
                if (ys < 0 || ys >= src.H) continue;
                for (int64_t dx = -1; dx <= 1; ++dx) {
                    const int64_t xs = x + f * dx;
                    if (xs < 0 || xs >= src.W) continue;
                    const T* __restrict s = src.at(ys, xs);
                    const T* __restrict t = taps + ((dy + 1) * 3 + dx + 1) * C;
                    for (int64_t c = 0; c < C; ++c) o[c] += t[c] * s[c];
                }
            }
        }
}

template <typename T>
LINVIS_SIMD_INLINE void stencil_reduce_body(const ImageOf<T>& a, const ImageOf<T>& b, T* acc, int64_t y0, int64_t y1) {
    const int64_t C = a.C;
    for (int64_t y = y0; y < y1; ++y)
        for (int64_t x = 0; x < a.W; ++x) {
            const T* __restrict bv = b.at(y, x);
            for (int64_t dy = -1; dy <= 1; ++dy) {
                const int64_t ys = y + dy;
                if (ys < 0 || ys >= a.H) continue;
                for (int64_t dx = -1; dx <= 1; ++dx) {
                    const int64_t xs = x + dx;
                    if (xs < 0 || xs >= a.W) continue;
                    const T* __restrict av = a.at(ys, xs);
                    T* __restrict t = acc + ((dy + 1) * 3 + dx + 1) * C;
                    for (int64_t c = 0; c < C; ++c) t[c] += av[c] * bv[c];
                }
            }
        }
}

}  // namespace

std::vector<float> residual_taps(const float* taps, int64_t C) {
    std::vector<float> out(taps, taps + 9 * C);
    for (int64_t c = 0; c < C; ++c) out[4 * C + c] += 1.0f;
    return out;
}

// float: one register-blocked row kernel of the SIMD layer per output row.
void stencil_apply(const Image& src, const float* taps, bool transpose, const MutImage& dst, int64_t y0, int64_t y1,
                   bool accumulate, const float* bias) {
    const simd::Kernels& k = simd::kernels();
    const int64_t f = transpose ? -1 : 1;
    for (int64_t y = y0; y < y1; ++y) {
        const float* rows[3];
        for (int64_t r = 0; r < 3; ++r) {
            const int64_t ys = y + f * (r - 1);
            rows[r] = ys >= 0 && ys < src.H ? src.at(ys, 0) : nullptr;
        }
        k.stencil3x3_row(rows, src.sx, src.W, src.C, taps, transpose, bias, dst.at(y, 0), dst.sx, accumulate);
    }
}
// float: the SIMD layer's register-blocked row reduction per row of b.
void stencil_reduce(const Image& a, const Image& b, float* acc, int64_t y0, int64_t y1) {
    const simd::Kernels& k = simd::kernels();
    for (int64_t y = y0; y < y1; ++y) {
        const float* rows[3];
        for (int64_t r = 0; r < 3; ++r) {
            const int64_t ys = y + r - 1;
            rows[r] = ys >= 0 && ys < a.H ? a.at(ys, 0) : nullptr;
        }
        k.stencil3x3_reduce_row(rows, a.sx, b.at(y, 0), b.sx, a.W, a.C, acc);
    }
}
LINVIS_SIMD_CLONES(stencil_apply,
                   (const ImageOf<double>& src, const double* taps, bool transpose, const MutImageOf<double>& dst,
                    int64_t y0, int64_t y1, bool accumulate),
                   (src, taps, transpose, dst, y0, y1, accumulate))
LINVIS_SIMD_CLONES(stencil_reduce,
                   (const ImageOf<double>& a, const ImageOf<double>& b, double* acc, int64_t y0, int64_t y1),
                   (a, b, acc, y0, y1))

// Both walk G in memory order, row by row, with one double accumulator per group: each group's terms are still
// added in index order (the same sums as a loop over one group at a time), but the column groups no longer make a
// strided chain of dependent adds. Serial in ViT³'s forward, the column-at-a-time loop took a tenth of the mixer's
// time at 224 px.
namespace {

LINVIS_SIMD_INLINE void group_normalise_body(const float* G, int64_t rows, int64_t cols, int64_t ld,
                                              bool columns_are_groups, float* out, float* norms,
                                              double* __restrict sq, float* __restrict denom) {
    const int64_t groups = columns_are_groups ? cols : rows;
    for (int64_t g = 0; g < groups; ++g) sq[g] = 0.0;
    for (int64_t i = 0; i < rows; ++i) {
        const float* __restrict r = G + i * ld;
        if (columns_are_groups) {
            for (int64_t j = 0; j < cols; ++j) sq[j] += static_cast<double>(r[j]) * r[j];
        } else {
            for (int64_t j = 0; j < cols; ++j) sq[i] += static_cast<double>(r[j]) * r[j];
        }
    }
    for (int64_t g = 0; g < groups; ++g) {
        norms[g] = static_cast<float>(std::sqrt(sq[g]));
        denom[g] = norms[g] + 1.0f;
    }
    for (int64_t i = 0; i < rows; ++i) {
        const float* __restrict r = G + i * ld;
        float* __restrict o = out + i * ld;
        if (columns_are_groups) {
            for (int64_t j = 0; j < cols; ++j) o[j] = r[j] / denom[j];
        } else {
            for (int64_t j = 0; j < cols; ++j) o[j] = r[j] / denom[i];
        }
    }
}
LINVIS_SIMD_CLONES(group_normalise,
                   (const float* G, int64_t rows, int64_t cols, int64_t ld, bool columns_are_groups, float* out,
                    float* norms, double* sq, float* denom),
                   (G, rows, cols, ld, columns_are_groups, out, norms, sq, denom))

LINVIS_SIMD_INLINE void group_normalise_backward_body(const float* G, const float* dOut, const float* norms,
                                                       int64_t rows, int64_t cols, int64_t ld, bool columns_are_groups,
                                                       float* dG, double* __restrict dot, double* __restrict coef) {
    const int64_t groups = columns_are_groups ? cols : rows;
    for (int64_t g = 0; g < groups; ++g) dot[g] = 0.0;
    for (int64_t i = 0; i < rows; ++i) {
        const float* __restrict r = G + i * ld;
        const float* __restrict dr = dOut + i * ld;
        if (columns_are_groups) {
            for (int64_t j = 0; j < cols; ++j) dot[j] += static_cast<double>(dr[j]) * r[j];
        } else {
            for (int64_t j = 0; j < cols; ++j) dot[i] += static_cast<double>(dr[j]) * r[j];
        }
    }
    for (int64_t g = 0; g < groups; ++g) {
        const double nrm = norms[g], denom = nrm + 1.0;
        coef[g] = nrm > 0.0 ? dot[g] / (nrm * denom * denom) : 0.0;
    }
    for (int64_t i = 0; i < rows; ++i) {
        const float* __restrict r = G + i * ld;
        const float* __restrict dr = dOut + i * ld;
        float* __restrict o = dG + i * ld;
        for (int64_t j = 0; j < cols; ++j) {
            const int64_t g = columns_are_groups ? j : i;
            const double denom = static_cast<double>(norms[g]) + 1.0;
            o[j] = static_cast<float>(dr[j] / denom - coef[g] * r[j]);
        }
    }
}
LINVIS_SIMD_CLONES(group_normalise_backward,
                   (const float* G, const float* dOut, const float* norms, int64_t rows, int64_t cols, int64_t ld,
                    bool columns_are_groups, float* dG, double* dot, double* coef),
                   (G, dOut, norms, rows, cols, ld, columns_are_groups, dG, dot, coef))

}  // namespace

void normalize_groups(const float* G, int64_t rows, int64_t cols, int64_t ld, bool columns_are_groups, float* out,
                      float* norms) {
    const int64_t groups = columns_are_groups ? cols : rows;
    std::vector<double> sq(groups);
    std::vector<float> denom(groups);
    group_normalise(G, rows, cols, ld, columns_are_groups, out, norms, sq.data(), denom.data());
}

void normalize_groups_backward(const float* G, const float* dOut, const float* norms, int64_t rows, int64_t cols,
                               int64_t ld, bool columns_are_groups, float* dG) {
    const int64_t groups = columns_are_groups ? cols : rows;
    std::vector<double> dot(groups), coef(groups);
    group_normalise_backward(G, dOut, norms, rows, cols, ld, columns_are_groups, dG, dot.data(), coef.data());
}

void reduce_partials(const float* parts, int64_t bh_count, int64_t parts_per_head, int64_t dd, float* out) {
    for (int64_t bh = 0; bh < bh_count; ++bh) {
        float* o = out + bh * dd;
        std::fill(o, o + dd, 0.0f);
        for (int64_t part = 0; part < parts_per_head; ++part) {
            const float* p = parts + (bh * parts_per_head + part) * dd;
            for (int64_t i = 0; i < dd; ++i) o[i] += p[i];
        }
    }
}

void transpose(const float* in, int64_t rows, int64_t cols, int64_t ld, float* out) {
    kernels().transpose(in, rows, cols, ld, out, rows);
}

}  // namespace linvis::ops::fused_detail
