#include <atomic>
#include <memory>

#include "linvis/nn/common.h"
#include "linvis/nn/batch_norm.h"
#include "linvis/nn/checkpoint.h"
#include "linvis/nn/vit3_layers.h"

#include "linvis/core/error.h"
#include "linvis/core/tensor_arena.h"
#include "linvis/core/flops.h"
#include "linvis/ops/vit3_ttt.h"

namespace linvis::nn {

// ---------------------------------------------------------------- TTT

Vit3TttImpl::Vit3TttImpl(int64_t dim_, int64_t num_heads_, bool qkv_bias, ops::Impl impl_)
    : dim(dim_), num_heads(num_heads_), head_dim(dim_ / num_heads_), impl(impl_) {
    LINVIS_CHECK(num_heads > 0 && dim % num_heads == 0, "Vit3Ttt: dim ", dim, " is not divisible by num_heads ",
                 num_heads);
    // Own parameters first, as in the official module's state_dict.
    w1 = register_parameter("w1", torch::empty({1, num_heads, head_dim, head_dim}));
    w2 = register_parameter("w2", torch::empty({1, num_heads, head_dim, head_dim}));
    w3 = register_parameter("w3", torch::empty({head_dim, 1, 3, 3}));
    trunc_normal_(w1);
    trunc_normal_(w2);
    trunc_normal_(w3);
    qkv = register_module("qkv", vit_linear(dim, 3 * dim + 3 * head_dim, qkv_bias));
    proj = register_module("proj", vit_linear(dim + head_dim, dim));
}

torch::Tensor Vit3TttImpl::forward_with_rope(const NormedInput& in, int64_t height, int64_t width,
                                             const torch::Tensor& rope_rotations, const torch::Tensor& residual) {
    const torch::Tensor& x = in.input();
    LINVIS_CHECK(x.dim() == 3 && x.size(2) == dim && x.size(1) == height * width, "Vit3Ttt: expected x (B, ",
                 height * width, ", ", dim, "), got ", shape_string(x.sizes()));
    torch::Tensor products = in.linear(qkv, elementwise_impl(impl));
    torch::Tensor rope = rope_rotations;
    // Inference: RoPE rotates q1 and k1 inside the fresh product, so there are no rotated copies, and the mix runs
    // as its one fused kernel (which has no RoPE of its own). The reference keeps the composed form.
    if (rope.defined() && impl != ops::Impl::Reference && can_overwrite({products}) && products.is_contiguous() &&
        products.scalar_type() == torch::kFloat32 && rope.scalar_type() == torch::kFloat32) {
        for (int64_t part = 0; part < 2; ++part)
            ops::apply_rope_2d_(products.narrow(-1, part * dim, dim).view({x.size(0), height, width, dim}), rope);
        rope = torch::Tensor();
    }
    if (recompute_mix && is_training() && products.requires_grad() && torch::GradMode::is_enabled()) {
        const int64_t heads = num_heads, H = height, W = width;
        const ops::Impl mix_impl = impl;
        const auto mix = [heads, H, W, rope, mix_impl](const std::vector<torch::Tensor>& in) {
            return ops::vit3_ttt_mix(in[0], in[1], in[2], in[3], heads, H, W, rope, mix_impl);
        };
        torch::Tensor out = recompute_into_linear(mix, {products, w1, w2, w3}, proj->weight, proj->bias);
        return residual.defined() ? residual.add_(out) : out;
    }
    torch::Tensor mixed = ops::vit3_ttt_mix(products, w1, w2, w3, num_heads, height, width, rope, impl);
    if (residual.defined()) return flops::linear_add_(residual, mixed, proj->weight, proj->bias);
    return flops::linear(mixed, proj->weight, proj->bias);
}

torch::Tensor Vit3TttImpl::residual_in_bands_(const NormedInput& in, int64_t height, int64_t width,
                                              const torch::Tensor& rope, int64_t band_bytes) {
    const torch::Tensor& x = in.input();
    LINVIS_CHECK(x.dim() == 3 && x.size(2) == dim && x.size(1) == height * width, "Vit3Ttt: expected x (B, ",
                 height * width, ", ", dim, "), got ", shape_string(x.sizes()));
    const int64_t B = x.size(0), C = dim, d = head_dim, W = width;
    // qkv's rows [q1 | k1 | v1 | q2 | k2 | v2] regrouped: the keys and values of pass 1, the queries of pass 2.
    auto rows_of = [&](const torch::Tensor& t, int64_t a, int64_t a_len, int64_t b, int64_t b_len) {
        return t.defined() ? torch::cat({t.narrow(0, a, a_len), t.narrow(0, b, b_len)}) : t;
    };
    // Products counted once below as the whole layer's: a band's halo rows are repeats.
    const ops::NormedProduct kv_product{rows_of(qkv->weight, C, 2 * C, 3 * C + d, 2 * d),
                                       rows_of(qkv->bias, C, 2 * C, 3 * C + d, 2 * d), false};
    const ops::NormedProduct q_product{rows_of(qkv->weight, 0, C, 3 * C, d), rows_of(qkv->bias, 0, C, 3 * C, d),
                                       false};
    if (flops::counting()) flops::add(B * height * width * C * (3 * C + 3 * d));
    const ops::Impl passes = elementwise_impl(impl);
    // The band's products (of x's rows [first, last)) as (B, rows, W, channels), RoPE on the first C (q1 or k1).
    auto band_products = [&](const torch::Tensor& rows, const RowBand& band, const ops::NormedProduct& product) {
        torch::Tensor p = in.with_input(rows).linear({product}, passes)[0];
        p = p.view({B, band.last - band.first, W, p.size(-1)});
        if (rope.defined()) ops::apply_rope_2d_(p.narrow(-1, 0, C), rope.narrow(0, band.first, band.last - band.first));
        return p;
    };
    const auto bands = row_bands(height, W * (2 * C + 2 * d) * x.element_size() * B, band_bytes);
    ops::Vit3TttInBands mix(w1, w2, w3, num_heads, B, height, width, impl);
    for (const RowBand& band : bands) {
        const torch::Tensor rows = x.narrow(1, band.first * W, (band.last - band.first) * W);
        mix.accumulate(band_products(rows, band, kv_product), band.begin, band.end);
    }
    add_in_bands_(x, W, bands, [&](const torch::Tensor& rows, const RowBand& band) {
        return flops::linear(mix.apply(band_products(rows, band, q_product), band.begin, band.end), proj->weight,
                             proj->bias);
    });
    return x;
}

// ---------------------------------------------------------------- RoPE

Vit3RopeImpl::Vit3RopeImpl(int64_t height, int64_t width, int64_t channels_) : channels(channels_) {
    rotations = register_buffer("rotations", ops::vit3_rope_rotations(height, width, channels));
}

torch::Tensor Vit3RopeImpl::table(int64_t height, int64_t width) const {
    if (rotations.size(0) == height && rotations.size(1) == width) return rotations;
    std::lock_guard<std::mutex> lock(other_grid_mutex_);
    if (!other_grid_.defined() || other_grid_.size(0) != height || other_grid_.size(1) != width ||
        other_grid_.device() != rotations.device())
        other_grid_ = ops::vit3_rope_rotations(height, width, channels).to(rotations.device());
    return other_grid_;
}

// ---------------------------------------------------------------- ConvLayer

Vit3ConvLayerImpl::Vit3ConvLayerImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t padding,
                                     int64_t groups, bool bias, bool with_norm, bool relu_)
    : relu(relu_) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel)
                                                         .stride(stride)
                                                         .padding(padding)
                                                         .groups(groups)
                                                         .bias(bias)));
    if (with_norm) norm = register_module("norm", torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(out).eps(1e-5)));
}

std::shared_ptr<const Vit3ConvLayerImpl::FoldedConv> Vit3ConvLayerImpl::folded_conv(const torch::Tensor& x) {
    if (is_training() || !norm || norm->is_training() || conv->weight.numel() > kMaxFoldedWeights) return nullptr;
    const torch::Tensor &w = conv->weight, &b = conv->bias, &mean = norm->running_mean, &var = norm->running_var;
    const torch::Tensor &gamma = norm->weight, &beta = norm->bias;
    if (!mean.defined() || !var.defined() || !w.is_floating_point() || w.scalar_type() != x.scalar_type()) return nullptr;
    const std::vector<const torch::Tensor*> made_from{&w, &b, &mean, &var, &gamma, &beta};
    for (const torch::Tensor* t : made_from)
        if (t->defined() && !can_overwrite({*t})) return nullptr;  // a graph would need the norm's own gradients
    if (!can_overwrite({x})) return nullptr;
    std::vector<std::pair<const void*, int64_t>> key;
    for (const torch::Tensor* t : made_from)
        key.emplace_back(t->defined() ? t->data_ptr() : nullptr, t->defined() ? t->_version() : -1);
    std::shared_ptr<const FoldedConv> kept = std::atomic_load(&folded_);
    if (kept && kept->made_from == key) return kept;
    // Normal tensors even under c10::InferenceMode: an inference tensor has no version counter, so the products
    // would not keep the folded weight packed (onednn::matmul), and a later graph could not use it.
    const c10::InferenceMode normal_tensors(false);
    torch::NoGradGuard no_grad;
    // conv(x, W) alpha + beta = conv(x, W alpha) + b alpha + beta, in float64.
    const BatchNormAffine a = batch_norm_eval_affine(*norm, torch::kFloat64);
    std::vector<int64_t> per_channel(static_cast<size_t>(w.dim()), 1);
    per_channel[0] = w.size(0);
    // Kept across passes: outside the tensor arena, whose free ranges a block made mid-pass would split.
    torch::Tensor weight = tensor_arena::empty_outside_arena(w.sizes(), w.options());
    torch::Tensor bias = tensor_arena::empty_outside_arena(a.beta.sizes(), w.options());
    weight.copy_(w.to(torch::kFloat64) * a.alpha.view(per_channel));
    bias.copy_(b.defined() ? b.to(torch::kFloat64) * a.alpha + a.beta : a.beta);
    auto folded = std::make_shared<const FoldedConv>(FoldedConv{weight, bias, std::move(key)});
    std::atomic_store(&folded_, folded);
    return folded;
}

torch::Tensor Vit3ConvLayerImpl::forward(const torch::Tensor& x, bool pad_rows) {
    const std::shared_ptr<const FoldedConv> folded = folded_conv(x);
    const torch::Tensor& weight = folded ? folded->weight : conv->weight;
    const torch::Tensor& bias = folded ? folded->bias : conv->bias;
    const auto rectified = [this](torch::Tensor y) {
        return !relu ? y : can_overwrite({y}) ? y.relu_() : torch::relu(y);
    };
    // Eval mode only: a training step's checkpointed forward (no graph) must match its recomputation (LibTorch's conv).
    const bool product = !is_training() && is_pointwise(conv) && x.dim() == 4 && x.device().is_cpu() &&
                         x.is_contiguous(at::MemoryFormat::ChannelsLast) && can_overwrite({x, weight}) &&
                         (!bias.defined() || can_overwrite({bias}));
    if (!product) {
        torch::Tensor y = conv_forward(conv, weight, bias, x, pad_rows);
        return folded ? rectified(std::move(y)) : post(std::move(y));
    }
    // In inference, a 1x1 conv on a channels-last map (a patch merging's input: the blocks' tokens seen as a map)
    // is one product over its pixels, (B H W, C_in) x (C_in, C_out), on oneDNN with the bias, and a ReLU not preceded
    // by a norm (or after a folded one), applied to each tile; the result is channels-last again. LibTorch 1.13 runs
    // this conv in another layout and returns a channels-first map (docs/performance.md, "H-ViT³ against its torch
    // peer, and its pointwise convs as products").
    const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), out = weight.size(0);
    const torch::Tensor pixels = x.permute({0, 2, 3, 1}).reshape({B * H * W, C});  // a view
    const torch::Tensor matrix = weight.view({out, C});
    const bool relu_in_product = relu && (!norm || folded);
    torch::Tensor y = relu_in_product ? flops::linear_relu(pixels, matrix, bias) : flops::linear(pixels, matrix, bias);
    y = y.view({B, H, W, out}).permute({0, 3, 1, 2});
    return relu_in_product || folded ? y : post(std::move(y));
}

torch::Tensor Vit3ConvLayerImpl::post(torch::Tensor y) {
    // Inference: the norm and the ReLU go into the conv's fresh output instead of two more tensors of its size.
    if (norm && !batch_norm_eval_into(*norm, y)) y = batch_norm(*norm, y);
    if (relu) y = can_overwrite({y}) ? y.relu_() : torch::relu(y);
    return y;
}

}  // namespace linvis::nn
