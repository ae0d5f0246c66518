// The parts every ViT-shaped model of linvis shares (timm conventions): the patch embedding, position
// embeddings, the block interface the plain-ViT skeleton (src/models/plain_vit.h) stacks and the
// pre-norm transformer block with a pluggable token mixer, timm's Mlp, block-index selection for
// intermediate features, stochastic-depth rates, the truncated-normal initialiser and the token <->
// map layout helpers. Matrix products and convolutions go through linvis::flops.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/nn/common.h"
#include "linvis/ops/impl.h"

namespace linvis::nn {

// timm trunc_normal_(t, mean 0, std, a, b): N(0, std^2) truncated to the absolute bounds [a, b]. Draws outside
// them drawn again where the bounds hold at least half the mass, inverse-CDF sampling otherwise. In place, without
// autograd.
void trunc_normal_(torch::Tensor t, double std = 0.02, double a = -2.0, double b = 2.0);

// nn.Linear(in, out) with the ViT init: trunc_normal_(std .02) weight, zero bias.
torch::nn::Linear vit_linear(int64_t in, int64_t out, bool bias = true);

// x (B, N, C) -> x (B, C, H, W) and back, with row-major tokens (n = y * W + x).
torch::Tensor tokens_to_map(const torch::Tensor& x, int64_t height, int64_t width);
torch::Tensor map_to_tokens(const torch::Tensor& x);

// Input bytes above which a depthwise conv runs a group of channels at a time (conv_forward, conv_backward).
constexpr int64_t kDepthwiseChunkBytes = int64_t{16} << 20;

// A Conv2d's zero padding as {rows, columns} (above = below, left = right), or nullopt where a dimension's two sides
// differ or the mode is not zeros. Read from the module's resolved padding: the padding option itself is a
// c10::variant in LibTorch 1.13 and a std::variant in LibTorch 2.x.
std::optional<std::array<int64_t, 2>> conv_zero_padding(const torch::nn::Conv2dImpl& conv);

// FLOP-counted forward of a Conv2d module with its own stride, padding, dilation and groups. pad_rows false: no
// padding above and below (a caller running the conv on a band of rows supplies those rows itself). Outside a graph a
// depthwise conv with more than kDepthwiseChunkBytes of input runs a group of channels at a time (as conv_backward).
torch::Tensor conv_forward(const torch::nn::Conv2d& layer, const torch::Tensor& x, bool pad_rows = true);
// The same with the layer's geometry and another weight and bias (e.g. with a BatchNorm folded in).
torch::Tensor conv_forward(const torch::nn::Conv2d& layer, const torch::Tensor& weight, const torch::Tensor& bias,
                           const torch::Tensor& x, bool pad_rows = true);
// The gradients of y = conv_forward(layer, x) from dy (y's shape), each only where `needs` (dx, dweight, dbias) asks:
// LibTorch's convolution backward, without a graph and without recomputing y. A depthwise conv whose input is larger
// than `chunk_bytes` runs a group of channels at a time into one dx: LibTorch 1.13's depthwise backward on oneDNN
// holds its dx twice more (a blocked copy and the dense one), 256 MiB for H-ViT3-T's first patch merging at 1024 px.
struct ConvGradients {
    torch::Tensor dx, dweight, dbias;
};
// A float32 or float64 pointwise conv (1x1, stride 1, no padding or dilation, one group) takes
// pointwise_conv_backward.
ConvGradients conv_backward(const torch::nn::Conv2d& layer, const torch::Tensor& dy, const torch::Tensor& x,
                            std::array<bool, 3> needs, int64_t chunk_bytes = kDepthwiseChunkBytes);

// Whether `layer` is a pointwise conv: 1x1, stride 1, no padding or dilation, one group (a product per pixel).
bool is_pointwise(const torch::nn::Conv2d& layer);
// conv_backward of a pointwise conv as two products per sample on the maps' own channel-major layout, dx written into
// its output directly: dx[n] = W^T dy[n], dW = sum_n dy[n] x[n]^T. LibTorch 1.13's backward (slow_conv2d) holds another
// dx-sized buffer. The conv's input (B, C, H, W) is read a slab of pixels at a time, input_slab(n, p0, p1)
// returning sample n's pixels [p0, p1) as a (C, p1 - p0) tensor, each slab about `slab_bytes`: an input that is
// recomputed from a kept tensor (batch_norm_relu_conv2d's) then never exists whole.
using PixelSlabFn = std::function<torch::Tensor(int64_t n, int64_t p0, int64_t p1)>;
ConvGradients pointwise_conv_backward(const torch::nn::Conv2d& layer, const torch::Tensor& dy,
                                      const PixelSlabFn& input_slab, std::array<bool, 3> needs,
                                      int64_t slab_bytes);

// Stochastic-depth rate of each of `depth` blocks: torch.linspace(0, rate, depth) in float32 as timm
// (decay), or `rate` for every block (ViL's drop_path_decay=False).
std::vector<double> drop_path_rates(double rate, int64_t depth, bool decay = true);

// timm feature_take_indices for explicit indices: each of `indices` in [-count, count) (negative
// counts from the end) mapped to [0, count), in the order given. `what` names the model in errors.
std::vector<int64_t> take_indices(int64_t count, const std::vector<int64_t>& indices, const std::string& what);

// timm PatchEmbed: a patch x patch convolution with stride patch (key proj.*), FLOP-counted.
class PatchEmbedImpl : public torch::nn::Module {
public:
    PatchEmbedImpl(int64_t in_chans, int64_t dim, int64_t patch);
    // images (B, in_chans, H, W) with H, W multiples of the patch -> map (B, dim, H / patch, W / patch).
    torch::Tensor forward(const torch::Tensor& images);
    // The same as tokens (B, H / patch * W / patch, dim), row-major over the patch grid, contiguous: the convolution
    // (stride = kernel) as one product of the patches, gathered by one copy, with the kernel as a matrix. At 1024 px
    // (3 x 192 x 16 x 16, 2 threads, AMX Xeon) 5.0 ms against 6.4-6.8 for the convolution and its tokens' transpose.
    torch::Tensor tokens(const torch::Tensor& images);

    torch::nn::Conv2d proj{nullptr};
    int64_t in_chans, patch;
};
TORCH_MODULE(PatchEmbed);

// ViL's VitPosEmbed2d: a learnable (1, h, w, D) embedding (key embed) added to a (B, h', w', D) grid,
// bicubically resized on the fly when the grid differs (nn::resize_pos_embed_2d).
class GridPosEmbedImpl : public torch::nn::Module {
public:
    GridPosEmbedImpl(int64_t height, int64_t width, int64_t dim);
    torch::Tensor forward(const torch::Tensor& grid);

    torch::Tensor embed;
};
TORCH_MODULE(GridPosEmbed);

// timm Mlp: fc1 -> GELU (erf) -> fc2. With `with_dwc` (H-ViT3): fc1 -> GELU -> x + dwc(x) on the
// hidden map -> GELU -> fc2, dwc a depthwise 3x3 conv with bias (ops::depthwise_conv2d_tokens with `impl`).
class MlpImpl : public torch::nn::Module {
public:
    MlpImpl(int64_t dim, int64_t hidden, bool with_dwc = false, ops::Impl impl = ops::Impl::Auto);
    // x: the block's normalised input (NormedInput: fc1 takes it through layer_norm_linear in a graph).
    torch::Tensor forward(const NormedInput& x, int64_t height = 0, int64_t width = 0);
    // Inference: residual += forward(x, height, width), in place, fc2's product accumulated onto residual in the
    // GEMM (flops::linear_add_); residual is a tensor the caller owns, outside any graph. Returns it.
    torch::Tensor add_to_(const torch::Tensor& residual, const NormedInput& x, int64_t height = 0, int64_t width = 0);
    // Inference with the depthwise conv (H-ViT³'s conv MLP): x.input() += forward(x, ...), in place, a band of grid
    // rows at a time (nn::add_in_bands_), so that the hidden layer (4x the tokens' width, twice around the conv)
    // never exists whole. Each band's hidden rows include one halo row above and below for the 3x3 conv; bands hold
    // about `band_bytes` of hidden layer. Same values as the whole layer's. Returns x.input(), which must be a tensor
    // the caller owns, outside any graph.
    torch::Tensor residual_in_bands_(const NormedInput& x, int64_t height, int64_t width, int64_t band_bytes);

    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    torch::nn::Conv2d dwc{nullptr};
    ops::Impl impl;
    // With the depthwise conv, in a training step's graph: keep fc1's output only and redo GELU, the conv and GELU
    // in fc2's backward (nn::recompute_into_linear), instead of three hidden-width tensors (a third of the memory).
    bool recompute_hidden = false;
    // With recompute_hidden: the forward and that backward a band of grid rows at a time
    // (nn::recompute_into_linear_in_bands), so that the block's backward holds no hidden-width gradient whole: for
    // a step whose peak is one block's backward (grad_checkpointing). Measured 2-5 % slower per step than the whole
    // map at 1024 px (docs/performance.md), so not where every block's graph is alive anyway.
    bool recompute_in_bands = false;
    // The hidden maps of one band then, about: GELU's and the conv's outputs of its rows.
    int64_t recompute_band_bytes = int64_t{16} << 20;
};
TORCH_MODULE(Mlp);

// A block of a plain ViT: tokens (B, T, D) on an height x width patch grid (T = prefix + H * W) in,
// tokens of the same shape out. A block may consist of several sub-blocks with a residual stream
// between them (ViL's pair of mLSTM blocks); forward_intermediates taps after each of them.
class VitBlock : public torch::nn::Module {
public:
    virtual torch::Tensor forward(const torch::Tensor& x, int64_t height, int64_t width) = 0;
    virtual int64_t num_sub_blocks() const { return 1; }
    // Runs sub-block `index` only (forward = all sub-blocks in order).
    virtual torch::Tensor forward_sub_block(int64_t index, const torch::Tensor& x, int64_t height, int64_t width) {
        return forward(x, height, width);
    }
};

// A token mixer: tokens (B, T, D) on an height x width grid -> (B, T, D). What distinguishes the
// families of TransformerBlock models (softmax attention, T5's TTT attention, ViT3's TTT). The block passes
// norm1 and its input as a NormedInput: the mixer's first product (qkv) takes it through NormedInput::linear.
class Mixer : public torch::nn::Module {
public:
    virtual torch::Tensor forward(const NormedInput& x, int64_t height, int64_t width) = 0;
    // Inference: residual += forward(x, height, width), in place; residual is a tensor the caller owns, outside any
    // graph. A mixer whose last step is a product accumulates it onto residual in the GEMM (flops::linear_add_)
    // instead of a fresh output and an add. Returns residual.
    virtual torch::Tensor add_to_(const torch::Tensor& residual, const NormedInput& x, int64_t height, int64_t width) {
        return residual.add_(forward(x, height, width));
    }
};

struct TransformerBlockOptions {
    int64_t dim = 192;
    int64_t mlp_hidden = 768;
    double drop_path = 0.0;
    double norm_eps = 1e-6;
    bool cpe = false;  // ViT3: x + dwconv3x3(x) on the grid before the mixer (key cpe.*)
    ops::Impl impl = ops::Impl::Auto;  // of the cpe (ops::depthwise_conv2d_tokens) and the MLP's elementwise passes
};

// timm's pre-norm Block: x = x + drop_path(attn(norm1(x))); x = x + drop_path(mlp(norm2(x))), with
// ViT3's positional conv first when options.cpe. Keys cpe.*, norm1.*, attn.*, norm2.*, mlp.fc{1,2}.*.
class TransformerBlockImpl : public VitBlock {
public:
    TransformerBlockImpl(const TransformerBlockOptions& options, std::shared_ptr<Mixer> mixer);
    torch::Tensor forward(const torch::Tensor& x, int64_t height, int64_t width) override;

    torch::nn::Conv2d cpe{nullptr};
    torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
    std::shared_ptr<Mixer> attn;
    Mlp mlp{nullptr};

private:
    TransformerBlockOptions options_;
};

}  // namespace linvis::nn
