// Reference depthwise convolutions on tokens (internal; public entry: linvis/ops/depthwise_conv.h).
// Plain LibTorch ops with autograd; inputs are checked by the caller. Neither counts FLOPs except
// through flops::conv2d (the caller counts the 1D convolution).
#pragma once

#include <torch/torch.h>

#include "linvis/ops/depthwise_conv.h"

namespace linvis::ops::reference {

// The tokens as a (B, C, H, W) map, flops::conv2d (groups = C, padding 1; counts its FLOPs), back
// to (B, H*W, C), then the epilogue.
torch::Tensor depthwise_conv2d_tokens(const torch::Tensor& x, int64_t height, int64_t width,
                                      const torch::Tensor& weight, const torch::Tensor& bias, DwEpilogue epilogue);

// torch::conv1d on the (B, C, T) view with padding k-1, the first T outputs kept.
torch::Tensor causal_depthwise_conv1d_tokens(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias);

}  // namespace linvis::ops::reference
