// Layers of the ViT³ / H-ViT³ models (spec vit3_t5_official.md A2-A4) beyond the shared ViT parts of
// linvis/nn/vit.h. Parameter names equal the official PyTorch modules' state_dict keys; matrix
// products and convolutions go through linvis::flops so that model FLOPs are counted.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "linvis/nn/vit.h"
#include "linvis/ops/impl.h"

namespace linvis::nn {

// The official TTT token mixer `TTT(dim, num_heads, qkv_bias)` (A2): qkv Linear(C, 3C+3d),
// w1/w2 (1, h, d, d), w3 (d, 1, 3, 3), proj Linear(C+d, C). x (B, N, C) on an H x W grid -> (B, N, C);
// H-ViT3 passes its RoPE table to forward_with_rope.
class Vit3TttImpl : public Mixer {
public:
    Vit3TttImpl(int64_t dim, int64_t num_heads, bool qkv_bias = true, ops::Impl impl = ops::Impl::Auto);
    torch::Tensor forward(const NormedInput& x, int64_t height, int64_t width) override {
        return forward_with_rope(x, height, width, {});
    }
    torch::Tensor add_to_(const torch::Tensor& residual, const NormedInput& x, int64_t height, int64_t width) override {
        return forward_with_rope(x, height, width, {}, residual);
    }
    // With `residual` (inference, see Mixer::add_to_): residual += the output, proj's product accumulated onto it.
    torch::Tensor forward_with_rope(const NormedInput& x, int64_t height, int64_t width,
                                    const torch::Tensor& rope_rotations, const torch::Tensor& residual = {});
    // Inference: x.input() += forward_with_rope(x, ...), in place, a band of grid rows at a time
    // (ops::Vit3TttInBands; nn::add_in_bands_), so that neither the qkv product nor the mix's output exists whole:
    // the bands' keys and values in a first pass, their queries, the mix and the projection in a second. Bands hold
    // about `band_bytes` of products. Same values as the whole layer's up to the order of the inner step's sums.
    // Returns x.input(), which must be a tensor the caller owns, outside any graph.
    torch::Tensor residual_in_bands_(const NormedInput& x, int64_t height, int64_t width,
                                     const torch::Tensor& rope_rotations, int64_t band_bytes);

    int64_t dim, num_heads, head_dim;
    ops::Impl impl;  // passed to ops::vit3_ttt_mix
    // In a training step's graph: keep the qkv product only and redo RoPE and the mix in proj's backward
    // (nn::recompute_into_linear) instead of keeping the rotated q1 / k1, the mix's saved tensors and its output.
    bool recompute_mix = false;
    torch::Tensor w1, w2, w3;
    torch::nn::Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(Vit3Ttt);

// H-ViT³ RoPE holder: persistent buffer `rotations` (H, W, C/2, 2) (A4). The table depends on the grid and the
// width only, so the blocks of a stage share one holder: the model keeps one table per stage, and every block
// still lists it under its own state_dict key, as the official model does (io::load_state_dict checks that keys
// sharing a buffer get equal values).
class Vit3RopeImpl : public torch::nn::Module {
public:
    Vit3RopeImpl(int64_t height, int64_t width, int64_t channels);
    // The table for an (H, W) grid: the buffer when it matches, else computed for that grid and kept for the next
    // call (the other blocks of the stage, the next image of that size).
    torch::Tensor table(int64_t height, int64_t width) const;

    int64_t channels;
    torch::Tensor rotations;

private:
    mutable std::mutex other_grid_mutex_;  // forward may run on several threads
    mutable torch::Tensor other_grid_;      // the last table computed for a grid other than the buffer's
};
TORCH_MODULE(Vit3Rope);

// Conv2d -> optional BatchNorm2d (eps 1e-5) -> optional ReLU (H-ViT³ ConvLayer: keys conv.*, norm.*).
class Vit3ConvLayerImpl : public torch::nn::Module {
public:
    Vit3ConvLayerImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t padding, int64_t groups,
                      bool bias, bool norm, bool relu);
    // pad_rows false: the conv without its padding above and below (nn::conv_forward), for a band of rows. In eval mode
    // outside a graph a pointwise conv on a channels-last CPU map is a product over the pixels (flops::linear /
    // linear_relu) and returns a channels-last map, and a norm whose conv weight has at most kMaxFoldedWeights
    // elements is folded into the conv (see folded_conv).
    torch::Tensor forward(const torch::Tensor& x, bool pad_rows = true);
    // What follows the conv: the norm and the ReLU, each where the layer has it (forward = post(conv(x))).
    torch::Tensor post(torch::Tensor conv_output);

    torch::nn::Conv2d conv{nullptr};
    torch::nn::BatchNorm2d norm{nullptr};
    bool relu;

    // Inference folds the eval-mode norm into the conv: W a and (b - mean) a + beta per output channel, a = gamma /
    // sqrt(var + eps), so that no pass over the conv's output applies it. Only for weights of at most this many
    // elements, as the folded weights are a copy kept beside the module's: H-ViT³-T's stem (0.4 MiB in all, on its
    // largest maps), not its patch mergings' last convs (up to 4 MiB each, on maps smaller than their weights).
    static constexpr int64_t kMaxFoldedWeights = int64_t{1} << 17;

private:
    struct FoldedConv {
        torch::Tensor weight, bias;
        std::vector<std::pair<const void*, int64_t>> made_from;  // data and version of the six tensors
    };
    // The folded weight and bias for an input x, made on first use and again after any of the conv's or the norm's
    // tensors changed (a new tensor, or an in-place update such as load_state_dict's copy_); null where the norm is
    // not folded (training, a graph, no norm, a larger weight). Forward may run on several threads.
    std::shared_ptr<const FoldedConv> folded_conv(const torch::Tensor& x);
    std::shared_ptr<const FoldedConv> folded_;
};
TORCH_MODULE(Vit3ConvLayer);

}  // namespace linvis::nn
