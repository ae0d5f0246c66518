// Interpretability tools of the papers, as maps a person can look at (docs/explain.md).
//
//  * Effective Receptive Field (Vision-TTT section 6, Fig. 7; Luo et al. 2016; the RepLKNet
//    recipe): how strongly each input pixel influences the output at the centre of the grid.
//  * Gradient Magnitude Map (Vision-TTT Eq. 6, Fig. 3/8; spec/vittt.md "Interpretability"): per
//    token, the norm of the inner-loop gradient G_t = d loss_t / dW of one TTT-Linear branch.
//  * Attention maps: exact softmax / linear attention weights, and the implicit attention of a
//    TTT layer, A(i, j) = d o_i / d v_j (T5 paper Eq. 13), reduced to a scalar per key.
//
// Maps come back as float32 CPU tensors; nothing here changes a model's parameters. Functions
// that run a model put it in eval mode for the call and restore its previous mode.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <torch/torch.h>

#include "linvis/models/model.h"
#include "linvis/ops/attention.h"

namespace linvis::tools::explain {

// ------------------------------------------------------------------ Effective Receptive Field

struct ErfOptions {
    // Tokens before the patch grid in forward_features (DeiT's class token: 1). -1: inferred as
    // the smallest p in [0, 8] for which T - p tokens form an h x w grid of square patches that
    // tile the image (H % h == 0, W % w == 0, H / h == W / w).
    int64_t prefix_tokens = -1;
    // s = sum over channels of relu(centre features) (default, as RepLKNet's analysis script), or
    // of the features themselves (false). The plain sum is degenerate after a final LayerNorm:
    // sum_c LN(x)_c = sum_c (gamma_c xhat_c + beta_c) is constant when gamma is (e.g. untrained,
    // gamma = 1), so its gradient vanishes; the rectified sum has no such cancellation.
    bool rectify_features = true;
    // map = sum_c |ds/dx_c| (default) or sum_c relu(ds/dx_c) (true: RepLKNet's script exactly).
    bool rectify_gradient = false;
};

// ERF of `model` over `images` (B, in_chans, H, W), already normalised as the model expects.
// For each image separately (eval mode): the features at the central output position, i.e.
// the token at grid cell (h / 2, w / 2) of forward_features (B, T, D) after skipping the prefix
// tokens, or position (H' / 2, W' / 2) of a hierarchical model's last feature map (B, C, H', W');
// s = their (rectified, see ErfOptions) sum over channels; the gradient ds/dimage by autograd;
// |.| summed over the input channels. Returns the mean over the B images: float32 (H, W), raw (not normalised).
torch::Tensor effective_receptive_field(models::VisionModel& model, const torch::Tensor& images,
                                        const ErfOptions& options = {});

// The display transform of an ERF (or any non-negative map): log10(map / max(map)) clamped below
// at -decades, so 0 is the strongest pixel and -decades means "decades weaker or less". A log
// scale is needed because the gradient falls off by orders of magnitude away from the centre
// (RepLKNet's script shows log10(map + 1) / max instead; with raw values of order 1 or below
// that compresses little, so the relative form is used here). An all-zero map
// gives all -decades. float32, same shape.
torch::Tensor erf_display_map(const torch::Tensor& map, double decades = 3.0);

// ------------------------------------------------------------------ Gradient Magnitude Map

enum class TttBranch { Forth, Back };
TttBranch parse_ttt_branch(const std::string& name);  // "forth" | "back"; throws otherwise
const char* ttt_branch_name(TttBranch branch);

// Gradient Magnitude Map of a Vision-TTT model (registry family "vittt"): `image` (3, H, W) or
// (1, 3, H, W), normalised; `block` in [0, depth) (negative counts from the end). Runs the model
// up to block `block`, applies its DWConv3x3 preprocessing and norm1, then the chosen TTT-Linear
// branch with gradient norms (ops::ttt_linear return_grad_norms): per head, ||G_t||_F with
// G_t = d loss_t / dW1 at the state the token's mini-batch starts from. `head` >= 0 returns
// that head's norm; head = -1 combines the heads as the Frobenius norm of the whole multi-head
// W (nh, d, d): sqrt(sum_h ||G_t^h||^2). The back branch scans the flipped sequence; its
// norms are flipped back, so both directions are in image (row-major) order.
// Returns float32 (h, w), h = H / patch, w = W / patch. Throws for other model families.
torch::Tensor gradient_magnitude_map(models::VisionModel& model, const torch::Tensor& image, int64_t block,
                                     TttBranch branch, int64_t head = -1);

// ------------------------------------------------------------------ attention (explicit and implicit)

// softmax(q k^T * scale) per (sample, head): q (B, h, N, d), k (B, h, M, d) -> (B, h, N, M),
// exactly the weights ops::softmax_attention applies to v.
torch::Tensor softmax_attention_weights(const torch::Tensor& q, const torch::Tensor& k, double scale);

// The weights ops::linear_attention applies to v (same options), as an explicit (B, h, N, M)
// matrix: a_ij = phi(q_i).phi(k_j) / (phi(q_i).sum_{l in S_i} phi(k_l) + eps) with normalize,
// phi(q_i).phi(k_j) without, and a_ij = 0 for j > i when causal (S_i = {l <= i}, else all l).
// So out_i = sum_j a_ij v_j, and each row sums to Z_i / (Z_i + eps), Z_i = phi(q_i).sum phi(k_l).
// O(N M d): for pictures and tests, not for long sequences.
torch::Tensor linear_attention_weights(const torch::Tensor& q, const torch::Tensor& k,
                                       const ops::LinearAttentionOptions& options = {});

// Implicit attention (T5 paper Eq. 13) of any token mixer seen as a function of its values:
// `mixer` maps v (B, h, M, dv) to o (B, h, N, do) and must treat every (sample, head)
// separately (true of attention and of the TTT ops: each head trains its own inner weights).
// Returns, for query token `query`, A(query, j) = ||J_j||_F / sqrt(do) with J_j = d o_query /
// d v_j (do x dv), by `do` reverse-mode passes: (B, h, M) in v's dtype. When J_j = a_j I (softmax
// attention, linear attention, TTT with a linear inner model f(x) = x W: its updates only
// multiply W from the left, so v_j enters o_i as c_ij v_j) this is exactly |a_j|; for nonlinear
// inner models it is the size of the local (linearised) dependence at the given inputs.
torch::Tensor implicit_attention(const std::function<torch::Tensor(const torch::Tensor&)>& mixer,
                                 const torch::Tensor& v, int64_t query);

struct AttentionMap {
    torch::Tensor map;   // (h, w) float32: the query's weights over the patch keys, mean over heads
    std::string method;  // one line saying what was computed
};

// Attention of one query patch (query_y, query_x) of block `block` over all patch keys, for
//   deit_*: the softmax weights of blocks.N.attn (exact; the class-token key is left out);
//   t5_*:   the implicit attention of the T5 TTT attention (Eq. 13 via implicit_attention on
//           ops::t5_ttt_attention with the block's q, k fixed).
// `image` (3, H, W) or (1, 3, H, W) at the model's img_size. Throws for other families.
AttentionMap attention_map(models::VisionModel& model, const torch::Tensor& image, int64_t block, int64_t query_y,
                           int64_t query_x);

}  // namespace linvis::tools::explain
