// Layers of the ViT³ / H-ViT³ models (spec vit3_t5_official.md A2-A4). Parameter names equal the
// official PyTorch modules' state_dict keys; matrix products and convolutions go through
// linvis::flops so that model FLOPs are counted.
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::nn {

// x (B, N, C) -> x (B, C, H, W) and back, with row-major tokens (n = y*W + x).
torch::Tensor tokens_to_map(const torch::Tensor& x, int64_t height, int64_t width);
torch::Tensor map_to_tokens(const torch::Tensor& x);

// flops-counted forward of LibTorch modules.
torch::Tensor linear_forward(const torch::nn::Linear& layer, const torch::Tensor& x);
torch::Tensor conv_forward(const torch::nn::Conv2d& layer, const torch::Tensor& x);

// timm DropPath: in training, zeroes whole samples with probability `rate` and rescales the rest.

// Linear(in, out) with the ViT init (trunc_normal std .02, bias 0).
torch::nn::Linear vit_linear(int64_t in, int64_t out, bool bias = true);
// Parameter init used for w1/w2/w3: trunc_normal(std .02) with absolute bounds ±2.
void trunc_normal_(torch::Tensor& t, double std_dev = 0.02);

// The official TTT token mixer `TTT(dim, num_heads, qkv_bias)` (A2): qkv Linear(C, 3C+3d),
// w1/w2 (1, h, d, d), w3 (d, 1, 3, 3), proj Linear(C+d, C). forward(x (B, N, C), H, W, rope) -> (B, N, C).
class Vit3TttImpl : public torch::nn::Module {
public:
    Vit3TttImpl(int64_t dim, int64_t num_heads, bool qkv_bias = true, ops::Impl impl = ops::Impl::Auto);
    torch::Tensor forward(const torch::Tensor& x, int64_t height, int64_t width,
                          const torch::Tensor& rope_rotations = {});

    int64_t dim, num_heads, head_dim;
    ops::Impl impl;  // Reference or Fused (passed to ops::vit3_ttt_mix)
    torch::Tensor w1, w2, w3;
    torch::nn::Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(Vit3Ttt);

// timm Mlp: fc1 -> GELU (erf) -> fc2 (dropout 0 in all configs). With `dwc` (H-ViT³ Mlp):
// fc1 -> GELU -> x + dwc(x) -> GELU -> fc2, dwc a depthwise 3x3 conv with bias on the hidden map.
class Vit3MlpImpl : public torch::nn::Module {
public:
    Vit3MlpImpl(int64_t dim, int64_t hidden, bool with_dwc);
    torch::Tensor forward(const torch::Tensor& x, int64_t height = 0, int64_t width = 0);

    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    torch::nn::Conv2d dwc{nullptr};
};
TORCH_MODULE(Vit3Mlp);

// H-ViT³ RoPE holder: persistent buffer `rotations` (H, W, C/2, 2) (A4).
class Vit3RopeImpl : public torch::nn::Module {
public:
    Vit3RopeImpl(int64_t height, int64_t width, int64_t channels);
    // The table for an (H, W) grid: the buffer when it matches, else recomputed.
    torch::Tensor table(int64_t height, int64_t width) const;

    int64_t channels;
    torch::Tensor rotations;
};
TORCH_MODULE(Vit3Rope);

// Conv2d -> optional BatchNorm2d (eps 1e-5) -> optional ReLU (H-ViT³ ConvLayer: keys conv.*, norm.*).
class Vit3ConvLayerImpl : public torch::nn::Module {
public:
    Vit3ConvLayerImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t padding, int64_t groups,
                      bool bias, bool norm, bool relu);
    torch::Tensor forward(const torch::Tensor& x);

    torch::nn::Conv2d conv{nullptr};
    torch::nn::BatchNorm2d norm{nullptr};
    bool relu;
};
TORCH_MODULE(Vit3ConvLayer);

}  // namespace linvis::nn
