// Layer helpers shared by every model family.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>

#include <vector>

#include <torch/torch.h>

#include "linvis/ops/activation.h"
#include "linvis/ops/layer_norm.h"

namespace linvis::nn {

// ops::layer_norm (Impl::Auto: the fused float32 kernel where it takes the input, else torch::layer_norm)
// over the trailing `normalized_shape`; bf16 / f16 CPU inputs are normalised in float32
// (precision::accumulation_dtype) and rounded once to their dtype. LibTorch 1.13's bf16 LayerNorm kernel took
// 19 ms of a deit_tiny 224-px pass against 1.9 ms for float32 (one thread, AVX-512 Xeon; the autograd profiler).
torch::Tensor layer_norm(const torch::Tensor& x, torch::IntArrayRef normalized_shape, const torch::Tensor& weight,
                         const torch::Tensor& bias, double eps);
// The same for a torch::nn::LayerNorm module (its shape, affine parameters and eps).
torch::Tensor layer_norm(const torch::nn::LayerNorm& norm, const torch::Tensor& x);
// DiT's adaLN, ops::modulated_layer_norm under `impl`, with bf16 / f16 normalised in float32 and rounded once as
// layer_norm above.
torch::Tensor modulated_layer_norm(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                                   double eps, ops::Impl impl);

// A pre-norm sub-layer's input: x and the LayerNorm to apply to it first (none: x as it is). The sub-layer takes
// its first products through `linear`: in a graph one ops::layer_norm_linear node, which keeps x (the residual
// stream the block keeps anyway) rather than the normalised copy; outside a graph layer_norm then the products.
// `value` is the normalised tensor itself, for sub-layers that need it (one call: it is computed each time).
// Under Impl::Reference, and for bf16 / f16 (normalised in float32 as layer_norm above), `linear` is `value`
// then the products. Implicitly made from a tensor, so a sub-layer's forward(NormedInput) takes plain inputs too.
class NormedInput {
public:
    NormedInput(torch::Tensor x);  // NOLINT(google-explicit-constructor): a plain input is a NormedInput
    NormedInput(const torch::nn::LayerNorm& norm, torch::Tensor x);
    // An affine LayerNorm given by its parameters (ViL's 1 + weight).
    NormedInput(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps);
    // DiT's adaLN input, modulated_layer_norm below: x (B, N, C), each sample's shift and scale (B, C). In a graph
    // `linear` is one ops::modulated_layer_norm_linear node, which keeps x rather than the modulated copy.
    static NormedInput modulated(torch::Tensor x, torch::Tensor shift, torch::Tensor scale, double eps);

    const torch::Tensor& input() const { return x_; }
    // impl: the modulated norm's (DiT's adaLN follows its model's Impl); a LayerNorm's is nn::layer_norm's.
    torch::Tensor value(ops::Impl impl = ops::Impl::Auto) const;
    // Whether autograd records the products (x or the norm's parameters require a gradient): the case where
    // `linear` keeps less than `value` then the products.
    bool records_graph() const;
    std::vector<torch::Tensor> linear(const std::vector<ops::NormedProduct>& products, ops::Impl impl) const;
    torch::Tensor linear(const torch::nn::Linear& layer, ops::Impl impl) const;
    // The same norm of another input (a band of a layer's tokens).
    NormedInput with_input(torch::Tensor x) const;

private:
    enum class Norm { None, LayerNorm, Modulated };
    torch::Tensor x_;
    torch::Tensor weight_, bias_;  // Norm::LayerNorm's affine parameters (undefined: none)
    torch::Tensor shift_, scale_;  // Norm::Modulated's per-sample rows
    double eps_ = 0.0;
    Norm norm_ = Norm::None;
};

// nn.Linear(in, out) for a layer whose caller sets every parameter right after (each model's own init, or a
// checkpoint): LibTorch's constructor draws kaiming-uniform values, serially in LibTorch 1.13 (0.38 s for
// DeiT-B's 85 M weights), which every linvis model then draws again. Built at size 0 and resized, without
// that draw; the parameters hold NaN until set, so a missed init shows in any output (tested per model).
torch::nn::Linear uninitialised_linear(int64_t in, int64_t out, bool bias = true);

// Stochastic depth (timm DropPath, scale_by_keep): in training, zeroes the whole residual
// branch of each sample with probability `rate` and scales the kept ones by 1 / (1 - rate).
// Identity in evaluation or when rate <= 0. Uses the LibTorch generator (checkpointed by the trainer).
torch::Tensor drop_path(const torch::Tensor& x, double rate, bool training);
// Whether drop_path(x, rate, training) can change x: in training with a positive rate. A layer that writes a
// branch into its residual in place (inference) takes that path only when this is false.
bool drop_path_active(double rate, bool training);

// Whether an operation on `operands` may write into the first of them, a tensor a layer has just
// computed and that nothing else references: true unless an autograd graph would record the operation
// (grad mode on and some operand requires grad). Layers then apply activations, gates and residual sums
// in place in inference and under frozen weights, which saves a temporary of the layer's widest size each
// time (the peak activation memory of a 1024-px model; docs/performance.md). The in-place ops compute the
// same values as the out-of-place ones.
bool can_overwrite(std::initializer_list<torch::Tensor> operands);

// fresh + other, written into `fresh` when can_overwrite({fresh, other}), the shapes and dtypes match and the
// two share no memory.
torch::Tensor add_into(torch::Tensor fresh, const torch::Tensor& other);

// A band of grid rows [begin, end), for layers that run a band at a time in inference (H-ViT³'s first stages at high
// resolution), and the rows [first, last) that a 3x3 stencil over the band reads: one halo row above and one below
// where the grid has them.
struct RowBand {
    int64_t begin, end, first, last;
};
// Bands of equal height (within one row) covering `height` rows, each of about `bytes_per_row` times its rows
// at most `budget` bytes, and at least `min_rows` rows (so that the halo rows stay a small share).
std::vector<RowBand> row_bands(int64_t height, int64_t bytes_per_row, int64_t budget, int64_t min_rows = 8);
// x += branch(x) over tokens x (B, H * W, C) of a grid `width` tokens wide, a band at a time and in place, so that
// the branch's output never exists whole and no second map is made. branch(rows, band) gets x's rows
// [band.first, band.last) as they were before any band was added (the row above a band, already updated, comes from
// a copy kept for it) and returns its output on the band's rows [begin, end): (B, (end - begin) * W, C).
// Bands in order (row_bands). x: a tensor the caller owns, outside any graph.
void add_in_bands_(const torch::Tensor& x, int64_t width, const std::vector<RowBand>& bands,
                   const std::function<torch::Tensor(const torch::Tensor& rows, const RowBand& band)>& branch);

// The Impl of a layer's elementwise passes (ops/activation.h) under its model's Impl: Reference stays the
// reference; Fused, which asks for the fused mixers, leaves the passes to Auto, so float64 models (which the
// mixers' kernels take) still run: the passes take float32 only.
ops::Impl elementwise_impl(ops::Impl model_impl);

// GELU(x w^T + b), the erf or tanh form (ops::GeluForm): outside a graph on oneDNN, unless impl is Reference,
// flops::linear_gelu (bias and GELU applied inside the product, on its float32 accumulator); otherwise float32 as
// the product then ops::gelu_ (the fused pass under `impl`), bf16 / f16 as flops::linear_gelu.
torch::Tensor linear_gelu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          ops::GeluForm form, ops::Impl impl = ops::Impl::Auto);

// fc2(GELU(fc1(x))), the erf or tanh form: outside a graph linear_gelu then fc2; in a graph fc1's product (through
// NormedInput::linear) then ops::gelu_linear, whose node keeps fc1's output and not its GELU (Reference:
// LibTorch's graph, both kept).
torch::Tensor gelu_mlp(const NormedInput& x, const torch::nn::Linear& fc1, const torch::nn::Linear& fc2,
                       ops::GeluForm form, ops::Impl impl = ops::Impl::Auto);

// timm's resample_abs_pos_embed: pos_embed (1, P + Ho*Wo, D) with P prefix (class) tokens ->
// (1, P + Hn*Wn, D). The prefix positions are kept unchanged; the grid part is reshaped to
// (1, D, Ho, Wo), resized with bicubic interpolation (align_corners false) in float32 (float64
// stays float64) and cast back. `antialias` true is timm's default (PIL-style bicubic, a = -0.5,
// support widened when downsampling, taps outside the grid dropped and the weights renormalised);
// false is plain bicubic (a = -0.75, border pixels replicated) as the DeiT repository's
// fine-tuning script and timm 0.4.12's resize_pos_embed do. LibTorch 1.13 and 2.x both provide
// the antialiased kernel, so there is no difference from timm. old_grid {0, 0}: square from the
// token count. Returns pos_embed itself when the grids are equal.
torch::Tensor resample_abs_pos_embed(const torch::Tensor& pos_embed, std::array<int64_t, 2> new_grid,
                                     std::array<int64_t, 2> old_grid, int64_t num_prefix_tokens = 0,
                                     bool antialias = true);

// Bicubic resize of a (1, H, W, D) position embedding to (1, h, w, D), as the official
// interpolate_sincos (F.interpolate bicubic, align_corners False, no antialias).
torch::Tensor resize_pos_embed_2d(const torch::Tensor& embed, int64_t h, int64_t w);

// Zero-pads an image or map (B, C, H, W) at the right and bottom so that both sides are multiples of
// `multiple` (timm's dynamic_img_pad, the official H-ViT3 backbone's Stem and PatchMerging); returns
// x itself when they already are.
torch::Tensor pad_to_multiple(const torch::Tensor& x, int64_t multiple);

}  // namespace linvis::nn
