// Internal building blocks of the fused ViT³ / T⁵ CPU kernels (not a public header).
// All kernels work on float32 with the last (channel) dimension contiguous; other strides are
// passed explicitly so that q, k, v can be read straight out of the qkv projection.
// The products and the sigmoid are the SIMD layer's (ops/simd/simd.h: Highway, one table per target,
// chosen per call by LINVIS_SIMD / LINVIS_FORCE_SCALAR); the loops here are compiled for every target
// with LINVIS_SIMD_CLONES.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops/simd/simd.h"

namespace linvis::ops::fused_detail {

// gemm (C (+)= A·B or Aᵀ·B through strides) and sigmoid of the active target.
using simd::Kernels;
using simd::kernels;

// One image of a (B, H, W, C) channels-last tensor: element (y, x, c) at base[y*sy + x*sx + c].
template <typename T>
struct ImageOf {
    const T* base;
    int64_t sy, sx, H, W, C;
    const T* at(int64_t y, int64_t x) const { return base + y * sy + x * sx; }
};
template <typename T>
struct MutImageOf {
    T* base;
    int64_t sy, sx, H, W, C;
    T* at(int64_t y, int64_t x) const { return base + y * sy + x * sx; }
};
using Image = ImageOf<float>;
using MutImage = MutImageOf<float>;

// Parallel tasks over the token grids of B images of H x W tokens: each task is one sample's rows
// [y0, y1), about token_block tokens but at most a quarter of the image (so that a 224-px image is not one
// task on one core), so a task's partial sums (stencil_reduce) are summed in a fixed order whatever the
// thread count.
struct GridTasks {
    int64_t B, H, rows, chunks;
    GridTasks(int64_t B_, int64_t H_, int64_t W_, int64_t token_block)
        : B(B_), H(H_),
          rows(std::max<int64_t>(1, std::min(token_block / std::max<int64_t>(W_, 1), (H_ + 3) / 4))),
          chunks((H_ + rows - 1) / rows) {}
    int64_t count() const { return B * chunks; }
    int64_t sample(int64_t task) const { return task / chunks; }
    int64_t y0(int64_t task) const { return (task % chunks) * rows; }
    int64_t y1(int64_t task) const { return std::min(H, y0(task) + rows); }
};

// 3x3 per-channel stencil over rows [y0, y1):
//   dst(y, x, c) (+)= sum_{dy,dx in -1..1} taps[(dy+1)*3 + dx+1][c] * src(y + f*dy, x + f*dx, c)
// with f = +1 (cross-correlation, conv2d) or -1 (its transpose), zero outside the image.
// taps: 9 x C (tap-major). accumulate: add to dst instead of overwriting; bias (float only, may be null):
// added to every pixel. dst must not overlap src.
// float and double (the float64 path of ops::depthwise_conv2d_tokens).
void stencil_apply(const Image& src, const float* taps, bool transpose, const MutImage& dst, int64_t y0, int64_t y1,
                   bool accumulate, const float* bias = nullptr);
// The taps (9 x C, tap-major) of x + stencil(x): the centre tap plus one, so that a residual 3x3 conv is one
// stencil_apply pass.
std::vector<float> residual_taps(const float* taps, int64_t C);
void stencil_apply(const ImageOf<double>& src, const double* taps, bool transpose, const MutImageOf<double>& dst,
                   int64_t y0, int64_t y1, bool accumulate);
// acc[tap][c] += sum_{y in [y0,y1), x} a(y + dy, x + dx, c) * b(y, x, c) (zero outside): the 3x3
// per-channel correlation of a with b, i.e. dL/dtaps of stencil_apply(a, ·) for output gradient b.
void stencil_reduce(const Image& a, const Image& b, float* acc, int64_t y0, int64_t y1);
void stencil_reduce(const ImageOf<double>& a, const ImageOf<double>& b, double* acc, int64_t y0, int64_t y1);

// Official gradient normalisation of one matrix G (rows x cols, row-major, row stride ld):
// column j divided by (||G[:, j]||_2 + 1) when columns_are_groups, otherwise each row divided by
// (||G[i, :]||_2 + 1). out = G / (norm + 1); norms (+1 not included) written to `norms`.
void normalize_groups(const float* G, int64_t rows, int64_t cols, int64_t ld, bool columns_are_groups, float* out,
                      float* norms);
// Backward of normalize_groups: dG = dOut/(n+1) - G * <dOut, G>_group / (n (n+1)^2) (0 when n = 0).
void normalize_groups_backward(const float* G, const float* dOut, const float* norms, int64_t rows, int64_t cols,
                               int64_t ld, bool columns_are_groups, float* dG);

// Uninitialised float scratch (a value-initialised std::vector would clear it first: per task of a 224-px
// image that clearing cost more than the products). Every user writes a slot before reading it.
class Scratch {
public:
    explicit Scratch(int64_t count) : data_(new float[static_cast<size_t>(count)]) {}
    float* get() const { return data_.get(); }

private:
    std::unique_ptr<float[]> data_;
};
// `count` slots of rows x d floats each, one per per-token quantity of a block.
class BlockScratch {
public:
    BlockScratch(int count, int64_t rows, int64_t d) : data_(count * rows * d), slot_(rows * d) {}
    float* operator[](int i) const { return data_.get() + i * slot_; }

private:
    Scratch data_;
    int64_t slot_;
};

// out[bh] = sum over the `parts_per_head` consecutive d x d partial sums of head bh, added in task order (the
// result does not depend on the thread count).
void reduce_partials(const float* parts, int64_t bh_count, int64_t parts_per_head, int64_t dd, float* out);

// out[j*rows + i] = in[i*ld + j] for a rows x cols block.
void transpose(const float* in, int64_t rows, int64_t cols, int64_t ld, float* out);

}  // namespace linvis::ops::fused_detail

