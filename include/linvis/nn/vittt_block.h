// Building blocks of Vision-TTT (spec/vittt.md "Block"): one TTT-Linear branch (a scan
// direction) and the Vittt block (DWConv3x3 preprocessing, LN, gate, forth/back TTT-Linear
// branches, o_proj, SwiGLU MLP). Parameter names: docs/vittt.md.
#pragma once

#include <vector>

#include <torch/torch.h>

#include "linvis/ops/ttt_linear.h"

#include "linvis/nn/vit.h"
#include "linvis/ops/impl.h"

namespace linvis::nn {

struct TttBranchOptions {
    int64_t dim = 192;
    int64_t num_heads = 3;            // head dim d = dim / num_heads
    int64_t mini_batch_size = 16;     // b
    int64_t conv_kernel = 4;          // causal depthwise conv_q / conv_k
    double eta_base = 1.0;            // lr = eta_base * sigmoid(x . w_lr + b_lr) / d
    bool learnable_w0 = true;         // false: W1/b1 keep their init (requires_grad = false)
    ops::Impl impl = ops::Impl::Auto;
};

// One TTT-Linear layer over a token sequence in its own scan order (spec/vittt.md step 4,
// ttt_linear_reference.md 2.3-2.7 with share_qk): u = q_proj(x); XQ = conv_q(u),
// XK = conv_k(u) (causal depthwise, left zero pad k-1); XV = v_proj(x); per-token lr gate on
// x; ops::ttt_linear per head (no RoPE); post_norm = LayerNorm(D, eps 1e-6) on the
// concatenated heads. Registration order (= state-dict order): learnable_token_idx,
// learnable_ttt_lr_weight, learnable_ttt_lr_bias, ttt_norm_weight, ttt_norm_bias, W1, b1,
// q_proj, v_proj, conv_q, conv_k, post_norm.
class TttLinearBranchImpl : public torch::nn::Module {
public:
    explicit TttLinearBranchImpl(const TttBranchOptions& options);
    // x: (B, T, D) -> (B, T, D). If grad_norms is given it receives the per-token inner
    // gradient norms ||dloss_t/dW|| (B, nh, T) (the Gradient Magnitude Map of paper section 6).
    torch::Tensor forward(const torch::Tensor& x, torch::Tensor* grad_norms = nullptr);
    // forward in two halves, so that several branches' scans can run in one ops::ttt_linear_many call:
    // the scan's inputs from x, and the branch output (post_norm) from the scan's result. reversed: the inputs
    // of the scan over x's tokens in reverse order (those of flip(x)), each flipped after its product, so a
    // graph keeps x once rather than x and its flipped copy.
    ops::TttLinearInputs scan_inputs(const torch::Tensor& x, bool reversed = false);
    // The products of x the scan inputs come from: q_proj, v_proj and the learning-rate gate's logits (not
    // FLOP-counted), for one NormedInput::linear over the block's norm1 with its other products; then
    // scan_inputs of their results (u, v, lr logits, each (B, T, .)).
    std::vector<ops::NormedProduct> products() const;
    ops::TttLinearInputs scan_inputs(const std::vector<torch::Tensor>& products, bool reversed = false);
    torch::Tensor output(const ops::TttLinearResult& scanned);
    ops::TttLinearOptions scan_options(bool grad_norms) const;
    void reset_parameters();

    const TttBranchOptions& options() const { return options_; }
    torch::Tensor learnable_token_idx, learnable_ttt_lr_weight, learnable_ttt_lr_bias;
    torch::Tensor ttt_norm_weight, ttt_norm_bias, W1, b1;
    torch::nn::Linear q_proj{nullptr}, v_proj{nullptr};
    torch::nn::Conv1d conv_q{nullptr}, conv_k{nullptr};
    torch::nn::LayerNorm post_norm{nullptr};

private:
    // The scan inputs from u = q_proj(x), v = v_proj(x) and the lr logits. XQ and XK are conv_q(u) and conv_k(u),
    // left to the op (ops::TttQkConv): in inference its fused scan computes them from u's rows as it goes.
    ops::TttLinearInputs assemble(torch::Tensor u, torch::Tensor v, const torch::Tensor& lr_logits, bool reversed);
    TttBranchOptions options_;
};
TORCH_MODULE(TttLinearBranch);

// SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases; x the block's normalised input.
class SwiGluMlpImpl : public torch::nn::Module {
public:
    SwiGluMlpImpl(int64_t dim, int64_t hidden, ops::Impl impl = ops::Impl::Auto);
    torch::Tensor forward(const NormedInput& x);
    // residual += forward(x) with down_proj's product accumulated onto residual (flops::linear_add_): for
    // inference, where residual is the caller's own tensor; x may be a normalisation of it. Returns residual.
    torch::Tensor add_to(const torch::Tensor& residual, const NormedInput& x);
    torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

private:
    ops::Impl impl_;  // of silu(gate) * up (ops::silu_mul_)
};
TORCH_MODULE(SwiGluMlp);

struct VitttBlockOptions {
    TttBranchOptions branch;          // dim, heads, mini-batch, ...
    int64_t mlp_hidden = 512;         // SwiGLU hidden = 8 D / 3
    double norm_eps = 1e-6;
    double drop_path = 0.0;           // stochastic depth on both residual branches (training only)
    bool shared_directions = false;   // v1 ("W0^1"): one branch used for both directions
    // In a training step's graph (training mode) both directions' scans (causal convs, TTT-Linear, post_norm)
    // run again in the backward from the products of norm1's output, which the graph keeps instead of each
    // direction's intermediates: eight (B, T, D) tensors less per block for one more scan forward
    // (docs/performance.md).
    bool recompute_scans = true;
};

// Vittt block on (B, T, D) tokens of an h x w grid (row-major):
//   y = y + dwconv(y)                                 (depthwise 3x3, bias, pad 1)
//   x = norm1(y); gate = gelu_tanh(g_proj(x))
//   Z = forth(x) + flip(back(flip(x)))                (v1: the same branch "ttt" twice)
//   y = y + drop_path(o_proj(gate * Z))
//   y = y + drop_path(mlp(norm2(y)))
// Under an nn::Probe it reports "ttt.grad_norms.forth" / "ttt.grad_norms.back" (linvis/nn/probe.h).
class VitttBlockImpl : public VitBlock {
public:
    explicit VitttBlockImpl(const VitttBlockOptions& options);
    torch::Tensor forward(const torch::Tensor& y, int64_t h, int64_t w) override;
    // The two directions' post-normed outputs before the merge, each in raster order (flip
    // undone for back), and optionally their inner gradient norms (B, nh, T) in raster order.
    // x is taken by value: a caller that moves it in lets it go before the scans run.
    std::pair<torch::Tensor, torch::Tensor> mixer_branches(torch::Tensor x, torch::Tensor* norms_forth = nullptr,
                                                           torch::Tensor* norms_back = nullptr);
    void reset_parameters();

    TttLinearBranch& forth_branch() { return options_.shared_directions ? ttt : forth; }
    TttLinearBranch& back_branch() { return options_.shared_directions ? ttt : back; }

    torch::nn::Conv2d dwconv{nullptr};
    torch::nn::LayerNorm norm1{nullptr};
    torch::nn::Linear g_proj{nullptr};
    TttLinearBranch forth{nullptr}, back{nullptr}, ttt{nullptr};  // v2: forth/back; v1: ttt
    torch::nn::Linear o_proj{nullptr};
    torch::nn::LayerNorm norm2{nullptr};
    SwiGluMlp mlp{nullptr};

private:
    torch::Tensor drop_path(const torch::Tensor& x) const;
    // o_proj(gate * Z) from y (see above); with `residual` (inference only) accumulated onto it, which is returned.
    torch::Tensor mixer(const torch::Tensor& y, const torch::Tensor& residual = {});
    // Both directions' scan inputs from x (taken by value: a caller that moves it in lets it go here).
    std::vector<ops::TttLinearInputs> direction_inputs(torch::Tensor x);
    VitttBlockOptions options_;
};
TORCH_MODULE(VitttBlock);


}  // namespace linvis::nn
