// LayerNorm over the trailing `normalized_shape` of x, with optional affine weight and bias (undefined
// tensors: none). Reference: torch::layer_norm. Fused: CPU float32, one normalised dim (the last: what
// every model uses), x with a contiguous last dim and one row stride for the leading dims; weight/bias
// float32 contiguous (N) or undefined. Per row a two-pass mean and variance in float32 (16 partial sums
// per pass), then y = (x - mean) * rstd * weight + bias; row loops compiled per SIMD target
// (LINVIS_SIMD_CLONES), parallel over blocks of rows. In a graph, an autograd node whose backward is
// LibTorch's native_layer_norm_backward on the saved per-row mean and rstd (its double backward is
// LibTorch's analytic formula too). LibTorch 1.13 from Debian runs a slow generic build. docs/ops.md.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

torch::Tensor layer_norm(const torch::Tensor& x, torch::IntArrayRef normalized_shape, const torch::Tensor& weight,
                         const torch::Tensor& bias, double eps, Impl impl = Impl::Auto);

}  // namespace linvis::ops
