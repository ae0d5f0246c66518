// Reference T5 / DiT5 TTT attention (see include/linvis/ops/t5_ttt.h and spec B2, B4).
// The op order and the layout chain (reshape/transpose) follow the official code so that the
// same weights give the same numbers.
#include "linvis/ops/t5_ttt.h"

#include <cmath>

#include <ATen/Context.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/t5_ttt/checks.h"
#include "ops/t5_ttt/reference.h"

namespace linvis::ops {
namespace {

using t5_checks::check_shape;
using t5_checks::check_tokens;
using t5_checks::TokenShape;

// (B, h, N, d) -> grid (B, C, H, W), +DWConv residual, -> back to (B, h, N, d), the official chain:
// transpose(1,2).reshape(B,N,C) ; transpose(1,2).reshape(B,C,H,W) ; conv ;
// reshape(B,C,N).transpose(1,2) ; reshape(B,N,h,d).transpose(1,2).
torch::Tensor conv_heads(const torch::Tensor& heads, const torch::Tensor& weight, const torch::Tensor& bias,
                         const TokenShape& s, int64_t height, int64_t width) {
    torch::Tensor flat = heads.transpose(1, 2).reshape({s.B, s.N, s.C});
    torch::Tensor grid = flat.transpose(1, 2).reshape({s.B, s.C, height, width});
    grid = residual_depthwise_conv(grid, weight, bias);
    torch::Tensor tokens = grid.reshape({s.B, s.C, s.N}).transpose(1, 2);
    return tokens.reshape({s.B, s.N, s.h, s.d}).transpose(1, 2);
}

// silu'(z) written as the official code: sig * (1.0 + z * (1.0 - sig)).
torch::Tensor silu_grad(const torch::Tensor& z, const torch::Tensor& sig) { return sig * (1.0 + z * (1.0 - sig)); }

void check_inner(const char* op, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w) {
    LINVIS_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), op, ": k and v must both be (B, h, N, d), got ",
                 shape_string(k.sizes()), " and ", shape_string(v.sizes()));
    LINVIS_CHECK(w.dim() == 4 && w.size(1) == k.size(1) && w.size(2) == k.size(3) && w.size(3) == k.size(3) &&
                     (w.size(0) == 1 || w.size(0) == k.size(0)),
                 op, ": fast weight: expected (1 or B, ", k.size(1), ", ", k.size(3), ", ", k.size(3), "), got ",
                 shape_string(w.sizes()));
}

}  // namespace

torch::Tensor split_heads(const torch::Tensor& x, int64_t num_heads) {
    LINVIS_CHECK(x.dim() == 3 && x.size(2) % num_heads == 0, "split_heads: expected (B, N, C) with C divisible by ",
                 num_heads, ", got ", shape_string(x.sizes()));
    return x.reshape({x.size(0), x.size(1), num_heads, x.size(2) / num_heads}).transpose(1, 2);
}

torch::Tensor merge_heads(const torch::Tensor& x) {
    LINVIS_CHECK(x.dim() == 4, "merge_heads: expected (B, h, N, d), got ", shape_string(x.sizes()));
    return x.transpose(1, 2).reshape({x.size(0), x.size(2), x.size(1) * x.size(3)});
}

torch::Tensor key_instance_norm(const torch::Tensor& k, double eps) {
    LINVIS_CHECK(k.defined() && k.dim() == 3, "key_instance_norm: expected k of shape (B, N, C), got ",
                 shape_or_undefined(k));
    LINVIS_CHECK(eps > 0, "key_instance_norm: eps must be > 0, got ", eps);
    // F.instance_norm(k.transpose(1, 2).unsqueeze(-1), eps=eps): per (b, c) over N, biased variance.
    torch::Tensor x = k.transpose(1, 2).unsqueeze(-1);
    return torch::instance_norm(x, /*weight=*/{}, /*bias=*/{}, /*running_mean=*/{}, /*running_var=*/{},
                                /*use_input_stats=*/true, /*momentum=*/0.1, eps,
                                at::globalContext().userEnabledCuDNN());
}

torch::Tensor key_instance_norm_tokens(const torch::Tensor& k, double eps) {
    return key_instance_norm(k, eps).squeeze(-1).transpose(1, 2);
}

torch::Tensor residual_depthwise_conv(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    LINVIS_CHECK(x.dim() == 4, "residual_depthwise_conv: expected x (B, C, H, W), got ", shape_string(x.sizes()));
    const int64_t C = x.size(1);
    check_shape("residual_depthwise_conv", "weight", weight, {C, 1, 3, 3});
    check_shape("residual_depthwise_conv", "bias", bias, {C});
    return x + flops::conv2d(x, weight, bias, {1, 1}, {1, 1}, {1, 1}, C);
}

SwiGluGradients ttt_swiglu_inner_gradients(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                                           const torch::Tensor& w2, const torch::Tensor& w3, double scale) {
    check_inner("ttt_swiglu_inner_gradients", k, v, w1);
    check_inner("ttt_swiglu_inner_gradients", k, v, w2);
    check_inner("ttt_swiglu_inner_gradients", k, v, w3);
    // forward
    torch::Tensor z1 = flops::matmul(k, w1);
    torch::Tensor z2 = flops::matmul(k, w2);
    torch::Tensor sig = torch::sigmoid(z1);
    torch::Tensor a1 = z1 * sig;
    torch::Tensor a2 = a1 * z2;
    // backward: e = dL/df = -v / N * s
    torch::Tensor e = v.neg() / static_cast<double>(v.size(2)) * scale;
    torch::Tensor da2 = flops::matmul(e, w3.transpose(-2, -1));
    torch::Tensor kt = k.transpose(-2, -1);
    SwiGluGradients g;
    g.g1 = flops::matmul(kt, da2 * z2 * silu_grad(z1, sig));
    g.g2 = flops::matmul(kt, da2 * a1);
    g.g3 = flops::matmul(a2.transpose(-2, -1), e);
    return g;
}

torch::Tensor ttt_swiglu_inner_loss(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                                    const torch::Tensor& w2, const torch::Tensor& w3, double scale) {
    torch::Tensor f = torch::matmul(torch::silu(torch::matmul(k, w1)) * torch::matmul(k, w2), w3);
    return -(scale / static_cast<double>(k.size(2))) * (f * v).sum({-2, -1});
}

torch::Tensor ttt_swiglu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& w1, const torch::Tensor& w2, const torch::Tensor& w3, double scale) {
    LINVIS_CHECK(q.sizes() == k.sizes(), "ttt_swiglu: q and k must have the same shape, got ",
                 shape_string(q.sizes()), " and ", shape_string(k.sizes()));
    SwiGluGradients g = ttt_swiglu_inner_gradients(k, v, w1, w2, w3, scale);
    torch::Tensor w1n = w1 - g.g1, w2n = w2 - g.g2, w3n = w3 - g.g3;
    return flops::matmul(torch::silu(flops::matmul(q, w1n)) * flops::matmul(q, w2n), w3n);
}

MlpGradients ttt_mlp_inner_gradients(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                                     const torch::Tensor& w2, double scale) {
    check_inner("ttt_mlp_inner_gradients", k, v, w1);
    check_inner("ttt_mlp_inner_gradients", k, v, w2);
    torch::Tensor z = flops::matmul(k, w1);
    torch::Tensor sig = torch::sigmoid(z);
    torch::Tensor a = z * sig;
    torch::Tensor y = flops::matmul(a, w2);
    torch::Tensor e = (y - v) / static_cast<double>(v.size(2)) * scale;
    MlpGradients g;
    g.g1 = flops::matmul(k.transpose(-2, -1), flops::matmul(e, w2.transpose(-2, -1)) * silu_grad(z, sig));
    g.g2 = flops::matmul(a.transpose(-2, -1), e);
    return g;
}

torch::Tensor ttt_mlp_inner_loss(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                                 const torch::Tensor& w2, double scale) {
    torch::Tensor y = torch::matmul(torch::silu(torch::matmul(k, w1)), w2);
    return (scale / (2.0 * static_cast<double>(k.size(2)))) * (y - v).pow(2).sum({-2, -1});
}

torch::Tensor ttt_mlp(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                      const torch::Tensor& w2, double scale) {
    LINVIS_CHECK(q.sizes() == k.sizes(), "ttt_mlp: q and k must have the same shape, got ", shape_string(q.sizes()),
                 " and ", shape_string(k.sizes()));
    MlpGradients g = ttt_mlp_inner_gradients(k, v, w1, w2, scale);
    torch::Tensor w1n = w1 - g.g1, w2n = w2 - g.g2;
    return flops::matmul(torch::silu(flops::matmul(q, w1n)), w2n);
}

namespace reference {

torch::Tensor t5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const T5TttParams& p, int64_t num_heads, int64_t height, int64_t width) {
    const TokenShape s{q.size(0), q.size(1), q.size(2), num_heads, q.size(2) / num_heads};
    const double scale = std::pow(static_cast<double>(s.d), -0.5);  // head_dim ** -0.5

    torch::Tensor qh = q.reshape({s.B, s.N, s.h, s.d}).transpose(1, 2);
    torch::Tensor kh = key_instance_norm(k, 1.0).reshape({s.B, s.h, s.d, s.N}).transpose(2, 3);
    torch::Tensor vh = v.reshape({s.B, s.N, s.h, s.d}).transpose(1, 2);
    torch::Tensor q2 = conv_heads(qh, p.q_conv_weight, p.q_conv_bias, s, height, width);
    torch::Tensor k2 = conv_heads(kh, p.k_conv_weight, p.k_conv_bias, s, height, width);
    torch::Tensor x = ttt_swiglu(q2, k2, vh, p.w1, p.w2, p.w3, scale);
    return x.transpose(1, 2).reshape({s.B, s.N, s.C});
}

torch::Tensor dit5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const Dit5TttParams& p, int64_t num_heads, int64_t height, int64_t width) {
    const TokenShape s{q.size(0), q.size(1), q.size(2), num_heads, q.size(2) / num_heads};
    const double scale = std::pow(static_cast<double>(s.d), -0.5);

    torch::Tensor q_t = q * p.qk_scale.select(3, 0) + p.qk_offset.select(3, 0);
    torch::Tensor k_t = k * p.qk_scale.select(3, 1) + p.qk_offset.select(3, 1);
    torch::Tensor qh = q_t.reshape({s.B, s.N, s.h, s.d}).transpose(1, 2);
    torch::Tensor vh = v.reshape({s.B, s.N, s.h, s.d}).transpose(1, 2);
    torch::Tensor kh = key_instance_norm(k_t, 1.0).reshape({s.B, s.h, s.d, s.N}).transpose(2, 3);
    torch::Tensor q2 = conv_heads(qh, p.q_conv_weight, p.q_conv_bias, s, height, width);
    torch::Tensor k2 = conv_heads(kh, p.k_conv_weight, p.k_conv_bias, s, height, width);
    torch::Tensor x = ttt_mlp(q2, k2, vh, p.w1, p.w2, scale);
    return x.transpose(1, 2).reshape({s.B, s.N, s.C});
}

}  // namespace reference

}  // namespace linvis::ops
