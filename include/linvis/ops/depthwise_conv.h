// Depthwise convolutions on token-major (channels-last) tensors: the 3x3 positional / local convs
// of Vision-TTT (dwconv), ViT3, H-ViT3 and DiT3 (cpe, H-ViT3's Mlp dwc) and ViL (conv + SiLU), and
// Vision-TTT's causal depthwise Conv1d (conv_q / conv_k).
//
// Impl::Reference is what the models computed before: the tokens viewed as a (B, C, H, W) /
// (B, C, T) map, LibTorch's grouped convolution (flops::conv2d / torch::conv1d) with autograd, and
// the epilogue as tensor ops. Impl::Fused is a CPU kernel that reads the tokens in place (any token
// stride: a chunk of a wider projection is read without a copy) and writes a contiguous result, with
// its own backward (grad x, weight, bias; partial sums added in a fixed order, so the result does not
// depend on the thread count). It computes float32 and float64 in their own dtype and bfloat16 in
// float32 (one rounding of the result). Impl::Auto runs it for float32 and bfloat16 CPU tensors on the
// vectorised code paths and the reference otherwise (float64, other devices); Impl::Fused on another
// device or dtype is an error. docs/ops.md has the measurements.
// FLOPs: B*H*W*C*9 and B*T*C*k multiply-adds (the convolution's count, as flops::conv2d).
#pragma once

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

// What is applied to the convolution c = conv(x) + bias.
enum class DwEpilogue {
    None,      // out = c
    Residual,  // out = x + c
    Silu,      // out = silu(c)
};

// x (B, H*W, C): tokens of a row-major height x width grid, unit channel stride, any batch / token
// stride. weight (C, 1, 3, 3) (a Conv2d with groups = C, padding 1, stride 1), bias (C) or undefined.
// Returns a contiguous (B, H*W, C) tensor in x's dtype.
torch::Tensor depthwise_conv2d_tokens(const torch::Tensor& x, int64_t height, int64_t width,
                                      const torch::Tensor& weight, const torch::Tensor& bias,
                                      DwEpilogue epilogue = DwEpilogue::None, Impl impl = Impl::Auto);

// Causal depthwise convolution along the tokens: x (B, T, C) with unit channel stride, weight (C, 1, k)
// for any k >= 1, bias (C) or undefined:
//   out[b, t, c] = bias[c] + sum_{s<k} weight[c, 0, s] * x[b, t - (k-1) + s, c]   (x[b, <0, c] = 0),
// i.e. a Conv1d with padding k-1 whose first T outputs are kept. Returns a contiguous (B, T, C).
torch::Tensor causal_depthwise_conv1d_tokens(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias, Impl impl = Impl::Auto);

// The same convolution split into `heads` groups of C / heads channels: a (B, heads, T, C / heads) tensor,
// out[b, h, t, j] = causal_depthwise_conv1d_tokens(...)[b, t, h * C / heads + j]. Outside autograd the fused
// path writes it head-major (each head's tokens contiguous), the layout in which the TTT-Linear scan reads a
// head's rows fastest; in a graph, and on the reference path, it is the permuted view of the (B, T, C) result.
torch::Tensor causal_depthwise_conv1d_heads(const torch::Tensor& x, const torch::Tensor& weight,
                                            const torch::Tensor& bias, int64_t heads, Impl impl = Impl::Auto);

}  // namespace linvis::ops
