// The fused CPU LayerNorm kernel (internal; public entry point linvis::ops::layer_norm with
// Impl::Fused, include/linvis/ops/layer_norm.h).
#pragma once

#include <cstdint>
#include <string>

#include <torch/torch.h>

namespace linvis::ops::cpu {

// Empty when the fused kernel takes these tensors, else why not.
std::string layer_norm_unsupported(const torch::Tensor& x, torch::IntArrayRef normalized_shape,
                                   const torch::Tensor& weight, const torch::Tensor& bias);

struct LayerNormOut {
    torch::Tensor y;     // x's shape, contiguous
    torch::Tensor mean;  // (x.shape[:-1]..., 1), as torch::native_layer_norm returns it
    torch::Tensor rstd;  // same shape
};

// The forward pass over a supported input (layer_norm_unsupported empty); mean and rstd are computed
// in any case (8 bytes per row).
LayerNormOut layer_norm_forward(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                double eps);

// y[b, n] = layer_norm(x[b, n]) * weight[b] + bias[b] over the last dim C: x (B, N, C) that the kernel takes
// without affine parameters (layer_norm_unsupported empty), weight and bias (B, C) float32 contiguous, each sample's
// rows with its own affine row (DiT's modulation, ops::modulated_layer_norm). y is contiguous; mean and rstd as
// layer_norm_forward's.
LayerNormOut layer_norm_per_sample_affine(const torch::Tensor& x, const torch::Tensor& weight,
                                          const torch::Tensor& bias, double eps);

}  // namespace linvis::ops::cpu
