#include "linvis/nn/common.h"
#include "linvis/nn/vit3_layers.h"

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/vit3_ttt.h"

namespace linvis::nn {

torch::Tensor tokens_to_map(const torch::Tensor& x, int64_t height, int64_t width) {
    LINVIS_CHECK(x.dim() == 3 && x.size(1) == height * width, "tokens_to_map: expected (B, ", height * width,
                 ", C), got ", shape_string(x.sizes()));
    return x.transpose(1, 2).reshape({x.size(0), x.size(2), height, width});
}

torch::Tensor map_to_tokens(const torch::Tensor& x) { return x.flatten(2).transpose(1, 2); }

torch::Tensor linear_forward(const torch::nn::Linear& layer, const torch::Tensor& x) {
    return flops::linear(x, layer->weight, layer->bias);
}

torch::Tensor conv_forward(const torch::nn::Conv2d& layer, const torch::Tensor& x) {
    // The module's own forward (its padding option is a variant whose type differs between
    // LibTorch versions); the multiply-adds are counted as flops::conv2d counts them.
    torch::Tensor out = layer.ptr()->forward(x);
    const auto& w = layer->weight;
    flops::add(out.numel() * w.size(1) * w.size(2) * w.size(3));
    return out;
}

void trunc_normal_(torch::Tensor& t, double std_dev) {
    torch::NoGradGuard no_grad;
    t.normal_(0.0, std_dev).clamp_(-2.0, 2.0);
}

torch::nn::Linear vit_linear(int64_t in, int64_t out, bool bias) {
    torch::nn::Linear layer(torch::nn::LinearOptions(in, out).bias(bias));
    trunc_normal_(layer->weight);
    if (bias) {
        torch::NoGradGuard no_grad;
        layer->bias.zero_();
    }
    return layer;
}

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

torch::Tensor Vit3TttImpl::forward(const torch::Tensor& x, int64_t height, int64_t width,
                                   const torch::Tensor& rope_rotations) {
    LINVIS_CHECK(x.dim() == 3 && x.size(2) == dim && x.size(1) == height * width, "Vit3Ttt: expected x (B, ",
                 height * width, ", ", dim, "), got ", shape_string(x.sizes()));
    torch::Tensor mixed = ops::vit3_ttt_mix(linear_forward(qkv, x), w1, w2, w3, num_heads, height, width,
                                            rope_rotations, impl);
    return linear_forward(proj, mixed);
}

// ---------------------------------------------------------------- Mlp

Vit3MlpImpl::Vit3MlpImpl(int64_t dim, int64_t hidden, bool with_dwc) {
    fc1 = register_module("fc1", vit_linear(dim, hidden));
    if (with_dwc)
        dwc = register_module("dwc", torch::nn::Conv2d(torch::nn::Conv2dOptions(hidden, hidden, 3)
                                                           .padding(1)
                                                           .groups(hidden)
                                                           .bias(true)));
    fc2 = register_module("fc2", vit_linear(hidden, dim));
}

torch::Tensor Vit3MlpImpl::forward(const torch::Tensor& x, int64_t height, int64_t width) {
    torch::Tensor y = torch::gelu(linear_forward(fc1, x));
    if (dwc) {
        y = y + map_to_tokens(conv_forward(dwc, tokens_to_map(y, height, width)));
        y = torch::gelu(y);
    }
    return linear_forward(fc2, y);
}

// ---------------------------------------------------------------- RoPE

Vit3RopeImpl::Vit3RopeImpl(int64_t height, int64_t width, int64_t channels_) : channels(channels_) {
    rotations = register_buffer("rotations", ops::vit3_rope_rotations(height, width, channels));
}

torch::Tensor Vit3RopeImpl::table(int64_t height, int64_t width) const {
    if (rotations.size(0) == height && rotations.size(1) == width) return rotations;
    return ops::vit3_rope_rotations(height, width, channels).to(rotations.device());
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

torch::Tensor Vit3ConvLayerImpl::forward(const torch::Tensor& x) {
    torch::Tensor y = conv_forward(conv, x);
    if (norm) y = norm->forward(y);
    if (relu) y = torch::relu(y);
    return y;
}

}  // namespace linvis::nn
