// TTT-Linear: the test-time-training sequence mixer of Sun et al. as used by Vision-TTT
// (spec/ttt_linear_reference.md sections 2.4-2.7 and 4; spec/vittt.md). Reference
// implementation in plain LibTorch tensor ops, differentiable by autograd with respect to
// every input. Equations, FLOP and memory accounting: docs/ops_ttt_linear.md.
//
// Per (sample, head) an inner model f is trained on the head's own tokens while they are
// read. Tokens are cut into mini-batches of size b (the last T mod b tokens form one shorter
// mini-batch, never padded). Inside a mini-batch every gradient is taken at the state the
// mini-batch starts from (mini-batch gradient descent), and token i of the mini-batch reads
// the state updated with the gradients of tokens j <= i weighted by eta_ij = tau_i * lr_j
// (causal) or the fully updated state (non-causal). The state after the mini-batch (last row
// of eta) is carried to the next one.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "linvis/ops/impl.h"

namespace linvis::ops {

enum class TttInnerModel {
    // Reference (ttt-lm-pytorch): f(x) = x + LN_h(x W + b), per-head LN with gamma/beta,
    // biased variance, eps; target XV - XK; loss 1/2 ||LN_h(x W + b) - (v - k)||^2.
    ResidualLayerNorm,
    // The paper's Appendix C (Theorems 1 and 2): f(x) = x W, no bias, no LN, no residual;
    // target XV; loss ||x W - v||^2 (no 1/2, so that eta = 1/2 gives linear attention).
    // b0, ln_weight and ln_bias are not used (pass undefined tensors).
    Linear,
};

struct TttLinearOptions {
    int64_t mini_batch_size = 16;   // b
    bool dual_form = true;          // false: primal form (explicit per-token W_i), same math
    bool causal = true;             // false: every token of a mini-batch reads the fully updated state
    bool use_rope = false;          // RoPE on XQ/XK, adjacent pairs, position = t mod b (spec 2.4)
    double rope_theta = 10000.0;
    // tau_i = max(0, 1/(i+1) + learnable_token_idx[i]). false: tau_i = 1 (plain eta, as the
    // paper's theorems state it); learnable_token_idx may then be undefined.
    bool use_token_coefficient = true;
    TttInnerModel inner_model = TttInnerModel::ResidualLayerNorm;
    double eps = 1e-6;              // inner LN eps (biased variance)
    bool return_final_state = false;
    bool return_grad_norms = false;
    // Fused only: (W, b) is checkpointed every this many mini-batches for the backward, which
    // recomputes the states in between (memory ~ T/(b * checkpoint_every) * nh * d^2 values).
    int64_t checkpoint_every = 4;
};

struct TttLinearResult {
    torch::Tensor output;      // (B, nh, T, d): f(XQ_t; state read by token t), before post_norm
    torch::Tensor final_W;     // (B, nh, d, d) state after the last mini-batch (if requested)
    torch::Tensor final_b;     // (B, nh, 1, d) (undefined for TttInnerModel::Linear)
    // (B, nh, T): ||G_t||_F with G_t = d loss_t / dW at the state the token's mini-batch starts
    // from (paper Eq. 6, mini-batch GD): ||k_t|| * ||dloss_t/dz_t|| since G_t = k_t^T g_t.
    torch::Tensor grad_norms;
};

// Runs TTT-Linear over the whole sequence.
//   xq, xk, xv:          (B, nh, T, d) per-head queries / keys / values (after conv_q/conv_k)
//   lr:                  (B, nh, T) per-token per-head learning rate lr_j (already
//                        eta_base * sigmoid(...) / d; see ttt_learning_rate)
//   learnable_token_idx: (b) learned offset of the token coefficient tau (may be undefined
//                        when use_token_coefficient is false)
//   w0:                  (nh, d, d) or (B, nh, d, d) initial inner weight (W1 of the reference)
//   b0:                  (nh, 1, d) or (B, nh, 1, d) initial inner bias (ResidualLayerNorm only)
//   ln_weight, ln_bias:  (nh, d) inner LN gamma / beta (ResidualLayerNorm only)
// Everything is computed in the input dtype (float64, float32 or bfloat16), as the reference.
// While a flops::Counter is active, adds the multiply-adds of the inner products listed in
// docs/ops_ttt_linear.md (per mini-batch and head: 3 M d^2 + 2 M^2 d causal, 3 M d^2 non-causal).
// impl (linvis/ops/impl.h): Reference = plain LibTorch ops with autograd; Fused = the CPU kernel of
// src/ops/ttt_linear/cpu.cpp (docs/perf_ttt_linear.md) for the ResidualLayerNorm inner model on CPU
// tensors (causal or not, RoPE through ttt_rope first, dual_form ignored since dual and primal are the
// same function; grad_norms come back detached). Auto runs the kernel whenever it takes the input;
// Fused with the Linear inner model or non-CPU tensors is an error.
TttLinearResult ttt_linear(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                           const torch::Tensor& lr, const torch::Tensor& learnable_token_idx,
                           const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& ln_weight,
                           const torch::Tensor& ln_bias, const TttLinearOptions& options = TttLinearOptions(),
                           Impl impl = Impl::Auto);

// Vision-TTT's queries and keys as causal depthwise convolutions of one projection u (B, T, nh * d), unit
// channel stride: xq = causal_depthwise_conv1d_heads(u, q_weight, q_bias, nh), xk the same with k_weight, k_bias
// (weights (nh * d, 1, k), biases (nh * d) or undefined; linvis/ops/depthwise_conv.h).
struct TttQkConv {
    torch::Tensor u, q_weight, q_bias, k_weight, k_bias;
};

// The inputs of one scan, as ttt_linear takes them. With qk_conv.u defined, xq and xk are left undefined and
// come from qk_conv: the fused kernel computes a mini-batch's queries and keys from u's rows while it loads them
// (outside autograd, without RoPE), so neither is written to memory; otherwise the op runs the two convolutions
// first (Impl as given) and scans their results.
struct TttLinearInputs {
    torch::Tensor xq, xk, xv, lr, learnable_token_idx, w0, b0, ln_weight, ln_bias;
    TttQkConv qk_conv;
};

// Several independent scans with the same options in one call (Vision-TTT's forward and backward
// directions); results in order, each what ttt_linear returns for its inputs. The scans may differ in
// every size. The fused kernel runs the (scan, sample, head) tasks of all of them in one parallel region,
// forward and (one autograd node for all scans) backward: a scan is serial within a head, so vittt_tiny's
// 3 heads leave one of 2 cores idle for a third of every one-direction call, while 2 x 3 heads fill both.
// Scans of different dtypes run the reference under Impl::Auto (the kernel
// runs one dtype per call); Impl::Fused on them is an error.
std::vector<TttLinearResult> ttt_linear_many(const std::vector<TttLinearInputs>& scans,
                                             const TttLinearOptions& options = TttLinearOptions(),
                                             Impl impl = Impl::Auto);

// Per-token per-head learning rate of spec 2.5: eta_base * sigmoid(x . w_lr[h] + b_lr[h]) / head_dim.
//   x: (B, T, C) the TTT-layer input (not XK); w_lr: (nh, 1, C); b_lr: (nh, 1). Returns (B, nh, T).
// Not FLOP-counted (nh * T * C multiply-adds, neglected like the paper's Appendix B.2).
torch::Tensor ttt_learning_rate(const torch::Tensor& x, const torch::Tensor& w_lr, const torch::Tensor& b_lr,
                                double eta_base, int64_t head_dim);
// The same from its logits x . w_lr^T + b_lr (B, T, nh), computed by the caller (a product of a LayerNorm's output
// with others, ops::layer_norm_linear). Returns (B, nh, T).
torch::Tensor ttt_learning_rate_of_logits(const torch::Tensor& logits, double eta_base, int64_t head_dim);

// tau_i = max(0, 1/(i+1) + learnable_token_idx[i]) for i < length (spec 2.5). Returns (length).
torch::Tensor ttt_token_coefficient(const torch::Tensor& learnable_token_idx, int64_t length);

// Inner per-head LayerNorm of the reference (spec 2.7 step 7): mean, biased variance,
// sqrt(var + eps) then divide, then gamma * x_hat + beta. z: (..., nh, M, d); gamma/beta (nh, d).
torch::Tensor ttt_layer_norm(const torch::Tensor& z, const torch::Tensor& gamma, const torch::Tensor& beta,
                             double eps = 1e-6);

// Closed-form gradient of 1/2 ||ttt_layer_norm(z) - target||^2 with respect to z (spec 2.7
// step 3, "ln_fused_l2_bwd"): (d*gh - sum(gh) - x_hat * sum(gh * x_hat)) / (d * std), gh = gamma * (y - target).
torch::Tensor ttt_layer_norm_l2_grad(const torch::Tensor& z, const torch::Tensor& target, const torch::Tensor& gamma,
                                     const torch::Tensor& beta, double eps = 1e-6);

// RoPE of spec 2.4 on (B, nh, T, d): pairs (2i, 2i+1) rotated by angle (t mod period) * theta^(-2i/d);
// cos/sin computed in float32 and cast to x's dtype, as the reference.
torch::Tensor ttt_rope(const torch::Tensor& x, int64_t period, double theta = 10000.0);

}  // namespace linvis::ops
