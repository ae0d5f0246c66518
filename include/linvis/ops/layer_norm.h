// LayerNorm over the trailing `normalized_shape` of x, with optional affine weight and bias (undefined
// tensors: none). Reference: torch::layer_norm. Fused: CPU float32, one normalised dim (the last: what
// every model uses), x with a contiguous last dim and one row stride for the leading dims; weight/bias
// float32 contiguous (N) or undefined. Per row a two-pass mean and variance in float32 (16 partial sums
// per pass), then y = (x - mean) * rstd * weight + bias; row loops compiled per SIMD target
// (LINVIS_SIMD_CLONES), parallel over blocks of rows. In a graph, an autograd node whose backward is
// LibTorch's native_layer_norm_backward on the saved per-row mean and rstd (its double backward is
// LibTorch's analytic formula too). LibTorch 1.13 from Debian runs a slow generic build. docs/ops.md.
#pragma once

#include <vector>

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

torch::Tensor layer_norm(const torch::Tensor& x, torch::IntArrayRef normalized_shape, const torch::Tensor& weight,
                         const torch::Tensor& bias, double eps, Impl impl = Impl::Auto);

// One product of a LayerNorm's output: linear(layer_norm(x), weight, bias), bias optional. counted = false
// leaves it out of the FLOP count (flops::Uncounted), as the paper leaves out Vittt's learning-rate gate.
struct NormedProduct {
    torch::Tensor weight;  // (N, C)
    torch::Tensor bias;    // (N) or undefined
    bool counted = true;
};

// One such product of a tensor: flops::linear(x, product.weight, product.bias), counted as product.counted says.
torch::Tensor normed_product(const torch::Tensor& x, const NormedProduct& product);

// The products of one LayerNorm's output over the last dim C of x: [flops::linear(layer_norm(x), p.weight,
// p.bias) for p in products], a pre-norm block's first products (qkv; fc1; Vittt's projections). In a graph
// (Auto on the vectorised targets, Fused) one autograd node keeps x, the per-row mean and rstd, the LayerNorm's
// parameters and the weights, not the normalised x: its backward normalises x again (one pass) for the weights'
// gradients, then runs LibTorch's native_layer_norm_backward on the summed input gradients. A block keeps x
// anyway (the residual stream), so one x-size tensor per LayerNorm is saved. Under a backward that builds a
// graph (double backward) every step is LibTorch's differentiable op. Reference, and inputs the fused LayerNorm
// does not take: layer_norm then the products, as LibTorch records them (both kept). Outside a graph:
// layer_norm under `impl` (one normalised copy, freed after the products), then the products.
std::vector<torch::Tensor> layer_norm_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias, double eps,
                                             const std::vector<NormedProduct>& products, Impl impl = Impl::Auto);

// DiT's adaptive LayerNorm (adaLN): a LayerNorm without affine parameters over the last dim C of x (B, N, C), then
// each sample's scale and shift (B, C): layer_norm(x) * (1 + scale[b]) + shift[b] (facebookresearch/DiT@ed81ce2:
// models.py, modulate). Reference: torch::layer_norm then the official modulate's LibTorch ops. Fused (CPU float32,
// x as the fused LayerNorm takes it): one pass of the LayerNorm kernel with each sample's 1 + scale and shift as its
// affine row, no normalised copy. In a graph one autograd node keeps x, the per-row mean and rstd and scale, where
// the reference's LayerNorm and product keep x and the normalised x as well: its backward normalises x again for
// the scale's gradient and runs LibTorch's native_layer_norm_backward for x's. Auto: fused on the vectorised
// targets.
torch::Tensor modulated_layer_norm(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                                   double eps, Impl impl = Impl::Auto);

// The products of DiT's adaLN output, as layer_norm_linear is of a LayerNorm's: [flops::linear(
// modulated_layer_norm(x, shift, scale), p.weight, p.bias) for p in products] (a DiT block's qkv, its fc1). In a
// graph (Auto on the vectorised targets, Fused) one autograd node keeps x, the per-row mean and rstd, shift, scale
// and the weights, where modulated_layer_norm then the products keep the modulated x as well: its backward
// modulates x again for the weights' gradients. Otherwise modulated_layer_norm under `impl`, then the products.
std::vector<torch::Tensor> modulated_layer_norm_linear(const torch::Tensor& x, const torch::Tensor& shift,
                                                       const torch::Tensor& scale, double eps,
                                                       const std::vector<NormedProduct>& products,
                                                       Impl impl = Impl::Auto);

}  // namespace linvis::ops
