// Fused CPU depthwise convolutions on tokens (internal). Public entry points:
// linvis::ops::depthwise_conv2d_tokens / causal_depthwise_conv1d_tokens with Impl::Fused
// (include/linvis/ops/depthwise_conv.h). CPU float32 / float64 / bfloat16 (in float32) tensors of one
// dtype (the caller checks with depthwise_conv_unsupported); shapes are checked by the caller.
#pragma once

#include <string>

#include <torch/torch.h>

#include "linvis/ops/depthwise_conv.h"

namespace linvis::ops::cpu {

// Empty when the fused kernels take these tensors, else why not.
std::string depthwise_conv_unsupported(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

// Autograd-capable when a gradient is needed (x, weight, bias), a plain kernel call otherwise.
torch::Tensor depthwise_conv2d_tokens_fused(const torch::Tensor& x, int64_t height, int64_t width,
                                            const torch::Tensor& weight, const torch::Tensor& bias,
                                            DwEpilogue epilogue);
torch::Tensor causal_depthwise_conv1d_tokens_fused(const torch::Tensor& x, const torch::Tensor& weight,
                                                   const torch::Tensor& bias);
// The same with the output in heads, head-major (ops::causal_depthwise_conv1d_heads); without autograd: the caller
// takes the token form in a graph.
torch::Tensor causal_depthwise_conv1d_heads_fused(const torch::Tensor& x, const torch::Tensor& weight,
                                                  const torch::Tensor& bias, int64_t heads);

}  // namespace linvis::ops::cpu
