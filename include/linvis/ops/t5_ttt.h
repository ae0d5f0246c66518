// T5's TTT attention (Linearizing Vision Transformer with Test-Time Training, ICML 2026) exactly as
// the official code (spec vit3_t5_official.md B2 for classification, B4 for DiT5's TTT branch).
//
// Shapes: tokens (B, N, C) with N = H*W row-major; heads (B, h, N, d), d = C/h, head i owns
// channels [i*d, (i+1)*d). Fast weights (1, h, d, d) (learnable) or (B, h, d, d) (updated).
// Inner loss scale s = d ** -0.5. One full-batch inner step with lr 1 and no gradient clipping;
// gradients are the closed forms of the official code (no autograd inside), so inference needs
// no autograd and outer training back-propagates through them with first-order autograd.
// Every matrix product and convolution is counted through linvis::flops.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

// Key InstanceNorm over tokens (B2 step 3): for each (sample, channel) of k (B, N, C),
// (k - mean_N) / sqrt(var_N + eps) with the biased variance, no affine; computed with the same
// ATen op as F.instance_norm(k.transpose(1, 2).unsqueeze(-1), eps=eps). Returns (B, C, N, 1),
// the layout the official code continues from; see key_instance_norm_tokens for (B, N, C).
torch::Tensor key_instance_norm(const torch::Tensor& k, double eps = 1.0);
torch::Tensor key_instance_norm_tokens(const torch::Tensor& k, double eps = 1.0);

// x + DWConv3x3(x) on the (H, W) grid (B2 steps 5-6): x (B, C, H, W) contiguous, weight
// (C, 1, 3, 3), bias (C), padding 1, groups C. Returns (B, C, H, W).
torch::Tensor residual_depthwise_conv(const torch::Tensor& x, const torch::Tensor& weight,
                                      const torch::Tensor& bias);

// ---- TTT-SwiGLU with the inner-product loss (T5 classification, B2 step 7) ----
// f(x) = (silu(x W1) * (x W2)) W3;  L = -(s/N) sum_n <f(k_n), v_n>  per (sample, head).
struct SwiGluGradients {
    torch::Tensor g1, g2, g3;  // (B, h, d, d)
};
// Closed form, op for op as the official gradient_silu_glu:
//   z1 = k W1, z2 = k W2, sig = sigmoid(z1), a1 = z1*sig, a2 = a1*z2, e = (-v / N) * s,
//   da2 = e W3^T, G1 = k^T (da2*z2*(sig*(1 + z1*(1 - sig)))), G2 = k^T (da2*a1), G3 = a2^T e.
SwiGluGradients ttt_swiglu_inner_gradients(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                                           const torch::Tensor& w2, const torch::Tensor& w3, double scale);
// The inner loss itself, (B, h): for checking the closed form against autograd.
torch::Tensor ttt_swiglu_inner_loss(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                                    const torch::Tensor& w2, const torch::Tensor& w3, double scale);
// One inner step then the read-out (silu(q W1') * (q W2')) W3'. q, k, v (B, h, N, d) -> (B, h, N, d).
torch::Tensor ttt_swiglu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& w1, const torch::Tensor& w2, const torch::Tensor& w3, double scale);

// ---- TTT 2-layer MLP with the L2 loss (DiT5, B4 step 2) ----
// f(x) = silu(x W1) W2;  L = (s/(2N)) sum_n ||f(k_n) - v_n||^2  per (sample, head).
struct MlpGradients {
    torch::Tensor g1, g2;  // (B, h, d, d)
};
// Closed form, op for op as the official gradient():
//   z = k W1, sig = sigmoid(z), a = z*sig, y = a W2, e = ((y - v) / N) * s,
//   G1 = k^T ((e W2^T) * (sig*(1 + z*(1 - sig)))), G2 = a^T e.
MlpGradients ttt_mlp_inner_gradients(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                                     const torch::Tensor& w2, double scale);
torch::Tensor ttt_mlp_inner_loss(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w1,
                                 const torch::Tensor& w2, double scale);
// One inner step then silu(q W1') W2'. q, k, v (B, h, N, d) -> (B, h, N, d).
torch::Tensor ttt_mlp(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& w1, const torch::Tensor& w2, double scale);

// ---- The full mixers between qkv and proj ----
// T5 classification Attention (B2), learnable tensors named as the official state_dict.
struct T5TttParams {
    torch::Tensor w1, w2, w3;                   // (1, h, d, d)
    torch::Tensor q_conv_weight, q_conv_bias;   // (C, 1, 3, 3), (C)
    torch::Tensor k_conv_weight, k_conv_bias;   // (C, 1, 3, 3), (C)
};
// q, k, v: the three (B, N, C) chunks of qkv(x). Steps (B2): heads of q; key instance norm
// (eps 1.0) of k; heads of v; q2 = q + q_conv(q) and k2 = k~ + k_conv(k~) on the (H, W) grid;
// TTT-SwiGLU step on (k2, v) with s = d^-0.5; read-out on q2. Returns (B, N, C) (before proj).
torch::Tensor t5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const T5TttParams& params, int64_t num_heads, int64_t height, int64_t width,
                               Impl impl = Impl::Auto);

// t5_ttt_attention(q, k, v) with q, k, v = qkv.chunk(3, -1), qkv (B, N, 3C) (the model's entry point).
// Identical results; with Impl::Fused (float32 / bfloat16) the whole attention is one autograd
// function of qkv whose backward writes the qkv gradient as one buffer (see docs/perf_vit3_t5.md).
// The fused CPU kernels of t5_ttt_attention / t5_ttt_attention_qkv take float32 and bfloat16 CPU
// tensors; Impl::Auto runs them on AVX-512 CPUs, Impl::Fused on another dtype is an error.
torch::Tensor t5_ttt_attention_qkv(const torch::Tensor& qkv, const T5TttParams& params, int64_t num_heads,
                                   int64_t height, int64_t width, Impl impl = Impl::Auto);

// DiT5 TTT branch of MixedAttention (B4 step 2).
struct Dit5TttParams {
    torch::Tensor w1, w2;                       // (1, h, d, d)
    torch::Tensor qk_scale, qk_offset;          // qk_scale_ttt, qk_offset_ttt: (1, 1, C, 2)
    torch::Tensor q_conv_weight, q_conv_bias;   // (C, 1, 3, 3), (C)
    torch::Tensor k_conv_weight, k_conv_bias;
};
// q_t = q*qk_scale[...,0] + qk_offset[...,0]; k_t = k*qk_scale[...,1] + qk_offset[...,1];
// key instance norm (eps 1.0) of k_t; q2 = q_t + q_conv(q_t); k2 = k~_t + k_conv(k~_t);
// TTT-MLP (L2 loss) step on (k2, v), s = d^-0.5; x_ttt = silu(q2 W1') W2'. Returns (B, N, C).
// The fused CPU kernel takes float32 and bfloat16 CPU tensors (q, k, v read in place when their channels are
// contiguous, as the chunks of qkv are) and never forms the per-head (B, h, N, d) copies, the normalised keys or
// the inner activations whole; Impl::Auto runs it where the SIMD layer has a vector target (AVX2, AVX-512).
torch::Tensor dit5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const Dit5TttParams& params, int64_t num_heads, int64_t height, int64_t width,
                                 Impl impl = Impl::Auto);

// (B, N, C) -> (B, h, N, d) view and back, head i = channels [i*d, (i+1)*d).
torch::Tensor split_heads(const torch::Tensor& x, int64_t num_heads);
torch::Tensor merge_heads(const torch::Tensor& x);

}  // namespace linvis::ops
