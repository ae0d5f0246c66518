// The fused CPU LayerNorm (see linvis/ops/layer_norm.h). One row of N values at a time: the mean (the
// sum of x - x[0] in 16 partial sums, folded pairwise, plus x[0]), the variance of (x - mean) the same
// way (two passes: no cancellation when the mean is large against the spread), rstd = 1 / sqrt(var + eps), then
// y = (x - mean) * rstd * weight + bias. The row loops are compiled per SIMD target with
// LINVIS_SIMD_CLONES; rows are split into blocks of about 16 Ki values with at::parallel_for.
#include "ops/layer_norm/cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/simd/simd.h"

namespace linvis::ops::cpu {
namespace {

constexpr int64_t kLanes = 16;

// Folds the partial sums pairwise into acc[0].
LINVIS_SIMD_INLINE float fold(float* acc) {
    for (int64_t h = kLanes / 2; h > 0; h /= 2)
#pragma omp simd
        for (int64_t l = 0; l < h; ++l) acc[l] += acc[l + h];
    return acc[0];
}

// sum_i (r[i] - shift), n values.
LINVIS_SIMD_INLINE float row_sum(const float* r, int64_t n, float shift) {
    float acc[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= n; c += kLanes)
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) acc[l] += r[c + l] - shift;
    for (int64_t l = 0; c < n; ++c, ++l) acc[l] += r[c] - shift;
    return fold(acc);
}

// sum_i (r[i] - m)^2, n values.
LINVIS_SIMD_INLINE float row_sum_sq_dev(const float* r, int64_t n, float m) {
    float acc[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= n; c += kLanes)
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) {
            const float d = r[c + l] - m;
            acc[l] += d * d;
        }
    for (int64_t l = 0; c < n; ++c, ++l) {
        const float d = r[c] - m;
        acc[l] += d * d;
    }
    return fold(acc);
}

// Rows [0, rows) of x (row stride ldx) into y (row stride n); weight / bias may be null.
LINVIS_SIMD_INLINE void layer_norm_rows_body(const float* x, int64_t ldx, float* y, int64_t rows, int64_t n,
                                             const float* weight, const float* bias, float eps, float* mean,
                                             float* rstd) {
    const float inv_n = 1.0f / static_cast<float>(n);
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict xr = x + r * ldx;
        float* __restrict yr = y + r * n;
        // The mean as x[0] + mean(x - x[0]): the sum is of deviations, so a row far from 0 (mean 1e3,
        // std 1e-2) loses no more than the rounding of the result to the float32 grid at its mean.
        const float m = xr[0] + row_sum(xr, n, xr[0]) * inv_n;
        const float var = row_sum_sq_dev(xr, n, m) * inv_n;
        const float s = 1.0f / std::sqrt(var + eps);
        mean[r] = m;
        rstd[r] = s;
        if (weight != nullptr && bias != nullptr) {
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) yr[c] = (xr[c] - m) * s * weight[c] + bias[c];
        } else if (weight != nullptr) {
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) yr[c] = (xr[c] - m) * s * weight[c];
        } else if (bias != nullptr) {
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) yr[c] = (xr[c] - m) * s + bias[c];
        } else {
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) yr[c] = (xr[c] - m) * s;
        }
    }
}

LINVIS_SIMD_CLONES(layer_norm_rows,
                   (const float* x, int64_t ldx, float* y, int64_t rows, int64_t n, const float* weight,
                    const float* bias, float eps, float* mean, float* rstd),
                   (x, ldx, y, rows, n, weight, bias, eps, mean, rstd))

// The one stride between consecutive rows of x's leading dims (size-1 dims skipped), or -1 when they do
// not collapse into one.
int64_t row_stride(const torch::Tensor& x) {
    int64_t stride = -1, expected = -1;
    for (int64_t d = x.dim() - 2; d >= 0; --d) {
        if (x.size(d) == 1) continue;
        if (stride < 0) stride = x.stride(d);
        else if (x.stride(d) != expected) return -1;
        expected = x.stride(d) * x.size(d);
    }
    return stride < 0 ? x.size(-1) : stride;
}

std::string affine_unsupported(const char* name, const torch::Tensor& t, int64_t n) {
    if (!t.defined()) return "";
    if (!t.device().is_cpu()) return std::string(name) + " is on " + t.device().str() + ", the kernel is CPU only";
    if (t.scalar_type() != torch::kFloat32)
        return std::string(name) + " is " + c10::toString(t.scalar_type()) + ", the kernel takes float32";
    if (t.dim() != 1 || t.size(0) != n)
        return std::string(name) + " has shape " + c10::str(t.sizes()) + ", the kernel takes (" + std::to_string(n) + ")";
    if (!t.is_contiguous()) return std::string(name) + " is not contiguous";
    return "";
}

// Blocks of about 16 Ki values: a (197, 192) input is two tasks, (4096, 192) is split over the threads.
int64_t rows_per_task(int64_t n) { return std::max<int64_t>(1, ((int64_t{1} << 14) + n - 1) / n); }

// y of x's shape (contiguous), mean and rstd (x.shape[:-1]..., 1).
LayerNormOut empty_out(const torch::Tensor& x) {
    std::vector<int64_t> stat_shape(x.sizes().begin(), x.sizes().end());
    stat_shape.back() = 1;
    return {torch::empty(x.sizes(), x.options()), torch::empty(stat_shape, x.options()),
            torch::empty(stat_shape, x.options())};
}

}  // namespace

std::string layer_norm_unsupported(const torch::Tensor& x, torch::IntArrayRef normalized_shape,
                                   const torch::Tensor& weight, const torch::Tensor& bias) {
    if (!x.device().is_cpu()) return "x is on " + x.device().str() + ", the kernel is CPU only";
    if (x.scalar_type() != torch::kFloat32)
        return std::string("x is ") + c10::toString(x.scalar_type()) + ", the kernel takes float32";
    if (normalized_shape.size() != 1)
        return "normalized_shape " + c10::str(normalized_shape) + " has " + std::to_string(normalized_shape.size()) +
               " dims, the kernel normalises the last dim only";
    if (x.dim() < 1 || x.size(-1) != normalized_shape[0])
        return "x has shape " + c10::str(x.sizes()) + ", normalized_shape " + c10::str(normalized_shape) +
               " is not its last dim";
    if (x.size(-1) == 0) return "x's rows are empty";
    if (x.stride(-1) != 1) return "x's last dim is not contiguous (stride " + std::to_string(x.stride(-1)) + ")";
    if (row_stride(x) < 0) return "x's leading dims (strides " + c10::str(x.strides()) + ") do not share one row stride";
    std::string why = affine_unsupported("weight", weight, x.size(-1));
    if (why.empty()) why = affine_unsupported("bias", bias, x.size(-1));
    return why;
}

LayerNormOut layer_norm_forward(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                double eps) {
    const int64_t n = x.size(-1);
    const int64_t rows = x.numel() / n;
    const int64_t ldx = row_stride(x);
    LayerNormOut out = empty_out(x);
    const float* px = x.data_ptr<float>();
    float* py = out.y.data_ptr<float>();
    float* pm = out.mean.data_ptr<float>();
    float* ps = out.rstd.data_ptr<float>();
    const float* pw = weight.defined() ? weight.data_ptr<float>() : nullptr;
    const float* pb = bias.defined() ? bias.data_ptr<float>() : nullptr;
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
        layer_norm_rows(px + begin * ldx, ldx, py + begin * n, end - begin, n, pw, pb, e, pm + begin, ps + begin);
    });
    return out;
}

LayerNormOut layer_norm_per_sample_affine(const torch::Tensor& x, const torch::Tensor& weight,
                                          const torch::Tensor& bias, double eps) {
    const int64_t n = x.size(-1);
    const int64_t tokens = x.size(1);
    const int64_t rows = x.numel() / n;
    const int64_t ldx = row_stride(x);
    LayerNormOut out = empty_out(x);
    if (rows == 0) return out;
    const float* px = x.data_ptr<float>();
    float* py = out.y.data_ptr<float>();
    float* pm = out.mean.data_ptr<float>();
    float* ps = out.rstd.data_ptr<float>();
    const float* pw = weight.data_ptr<float>();
    const float* pb = bias.data_ptr<float>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
        // A task's rows may span samples: each run of one sample's rows with that sample's affine row.
        for (int64_t r = begin; r < end;) {
            const int64_t sample = r / tokens;
            const int64_t stop = std::min(end, (sample + 1) * tokens);
            layer_norm_rows(px + r * ldx, ldx, py + r * n, stop - r, n, pw + sample * n, pb + sample * n, e, pm + r,
                            ps + r);
            r = stop;
        }
    });
    return out;
}

}  // namespace linvis::ops::cpu
