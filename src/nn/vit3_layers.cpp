#include "linvis/nn/common.h"
#include "linvis/nn/batch_norm.h"
#include "linvis/nn/vit3_layers.h"

#include "linvis/core/error.h"
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
                                             const torch::Tensor& rope_rotations) {
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
    torch::Tensor mixed = ops::vit3_ttt_mix(products, w1, w2, w3, num_heads, height, width, rope, impl);
    return flops::linear(mixed, proj->weight, proj->bias);
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

torch::Tensor Vit3ConvLayerImpl::forward(const torch::Tensor& x, bool pad_rows) {
    torch::Tensor y = conv_forward(conv, x, pad_rows);
    // Inference: the norm and the ReLU go into the conv's fresh output instead of two more tensors of its size.
    if (norm && !batch_norm_eval_into(*norm, y)) y = batch_norm(*norm, y);
    if (relu) y = can_overwrite({y}) ? y.relu_() : torch::relu(y);
    return y;
}

}  // namespace linvis::nn
