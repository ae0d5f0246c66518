// ViT³ test-time-training token mixer (spec vit3_t5_official.md A2; paper arXiv 2512.01643).
//
// impl (official op only; linvis/ops/impl.h): the fused CPU kernels (src/ops/vit3_ttt/cpu.cpp,
// docs/perf_vit3_t5.md) take float32 / bfloat16 CPU inputs, with a custom autograd function that
// saves only the inputs and the d x d inner gradients; the mix runs as one kernel without RoPE and as
// its two branch kernels with RoPE (H-ViT³'s layer rotates q1/k1 in place in inference, apply_rope_2d_,
// and then runs the one kernel). Impl::Auto runs them on AVX-512 CPUs; Impl::Fused on another input
// (float64, CUDA) is an error.
//
// Two entry points:
//  * the official op (vit3_ttt_swiglu_branch / vit3_ttt_dwconv_branch / vit3_ttt_mix): one
//    full-batch inner gradient step with lr 1, hand-derived gradients and the official
//    gradient normalisation, non-causal over all N tokens, in the op order of ttt_block.py;
//  * the design space of the paper's study (vit3_ttt_generic): inner model, inner loss, inner
//    learning rate, epochs and sequential mini-batches, with closed-form inner gradients
//    (or autograd with create_graph for cross-checking).
// All functions are plain LibTorch ops: outer gradients flow through them with ordinary
// autograd, and inference needs no autograd. float64 / float32 / bfloat16 on CPU.
// Inner matrix products are counted through linvis::flops.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

// ---------------------------------------------------------------- official op (A2)

// Inner-loss scale of the official block: 9^-0.5 (the "head dim" of a 1-channel 3x3 kernel).
constexpr double kVit3InnerScale = 1.0 / 3.0;

// SwiGLU branch (A2 step 4 and 6): inner model F1(x) = (x W1) * silu(x W2), loss
// L = -(s/N) sum_n <F1(k_n), v_n> per (sample, head), one step W' = W - G / (||G||_col + 1).
// q, k, v: (B, h, N, d); w1, w2: (1 or B, h, d, d). Returns (q W1') * silu(q W2'): (B, h, N, d).
torch::Tensor vit3_ttt_swiglu_branch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& w1, const torch::Tensor& w2,
                                     double scale = kVit3InnerScale, Impl impl = Impl::Auto);

// Depthwise-conv branch (A2 steps 5 and 6): per-sample 3x3 depthwise kernels trained with the
// same loss ('prod' gradient: 9 shifted products, loop dy then dx), normalised by
// ||G||_F(3x3) + 1, then applied to q as one grouped conv (groups B*d, padding 1).
// q, k, v: (B, d, H, W); w3: (d, 1, 3, 3). Returns (B, d, H, W).
torch::Tensor vit3_ttt_dwconv_branch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& w3, double scale = kVit3InnerScale,
                                     Impl impl = Impl::Auto);

// The whole mixer before the output projection (A2 steps 1-6): qkv (B, N, 3C+3d) laid out as
// [q1 | k1 | v1 | q2 | k2 | v2], N = H*W row-major tokens, d = C / num_heads.
// rope_rotations (optional, H-ViT³): (H, W, C/2, 2) cos/sin table applied to q1 and k1 over the
// full C channels before the head split (apply_rope_2d). Returns cat([x1, x2], -1): (B, N, C+d).
torch::Tensor vit3_ttt_mix(const torch::Tensor& qkv, const torch::Tensor& w1, const torch::Tensor& w2,
                           const torch::Tensor& w3, int64_t num_heads, int64_t height, int64_t width,
                           const torch::Tensor& rope_rotations = {}, Impl impl = Impl::Auto);

// H-ViT³ RoPE table (A4): rotations (H, W, C/2, 2), angle of pair p = y*theta_p for p < C/4,
// x*theta_{p-C/4} otherwise, theta_k = 1 / 10000^(k / (C/4)); computed in float32.
torch::Tensor vit3_rope_rotations(int64_t height, int64_t width, int64_t channels, double base = 10000.0);

// Applies the RoPE table to x (B, H, W, C) as a complex multiply of channel pairs (2p, 2p+1).
// The official op upcasts to float32 and returns float32; here float32 and lower precisions are
// computed in float32 and cast back to x's dtype, float64 is computed in float64.
torch::Tensor apply_rope_2d(const torch::Tensor& x, const torch::Tensor& rotations);

// apply_rope_2d written into x itself, for a layer that owns x (H-ViT³'s q1 and k1 inside its fresh qkv product,
// which then needs no rotated copies and goes to vit3_ttt_mix's one fused kernel without RoPE). x (B, H, W, C) may
// be a strided view whose channels are contiguous (a slice of a wider tensor). float32 CPU x with float32
// rotations: one pass per token (the fused form); other dtypes: apply_rope_2d copied back. Not for a tensor
// autograd records.
void apply_rope_2d_(const torch::Tensor& x, const torch::Tensor& rotations);

// vit3_ttt_mix in inference a band of grid rows at a time, for maps whose qkv product (3C + 3d channels per token)
// would be a model's largest tensor (H-ViT³'s first stages at high resolution). The inner step's gradients are sums
// over the tokens, so the caller hands in every band's keys and values first (accumulate, bands in order), then
// each band's queries (apply), and the whole qkv never exists. Results equal vit3_ttt_mix's up to the order of the
// sums. The depthwise branch's 3x3 stencil reads one row above and one below a band: a band [begin, end) comes with
// the rows [first_row(begin), last_row(end)), which include those halo rows where the grid has them. RoPE, if
// any, is the caller's (apply_rope_2d_ on q1 / k1 of the band's rows). Not for tensors autograd records.
// impl: as vit3_ttt_mix's (fused float32 kernels on AVX-512 CPUs, the LibTorch reference elsewhere).
class Vit3TttInBands {
public:
    // w1, w2 (1, h, d, d), w3 (d, 1, 3, 3) as vit3_ttt_mix's; a batch of `batch` maps of height x width tokens.
    Vit3TttInBands(torch::Tensor w1, torch::Tensor w2, torch::Tensor w3, int64_t num_heads, int64_t batch,
                   int64_t height, int64_t width, Impl impl = Impl::Auto);

    static int64_t first_row(int64_t begin) { return begin > 0 ? begin - 1 : 0; }
    int64_t last_row(int64_t end) const { return end < height_ ? end + 1 : height_; }

    // kv (B, last_row(end) - first_row(begin), W, 2C + 2d) laid out [k1 | v1 | k2 | v2]: the band's share of the
    // inner step's sums. Bands come in order, from row 0 to row H.
    void accumulate(const torch::Tensor& kv, int64_t begin, int64_t end);
    // q (B, last_row(end) - first_row(begin), W, C + d) laid out [q1 | q2], after the last band's accumulate ->
    // cat([x1, x2], -1) of the band's tokens: (B, (end - begin) * W, C + d), as vit3_ttt_mix's rows of the band.
    torch::Tensor apply(const torch::Tensor& q, int64_t begin, int64_t end);

private:
    void check_band(const torch::Tensor& t, int64_t channels, int64_t begin, int64_t end, const char* what) const;
    void take_step();

    torch::Tensor w1_, w2_, w3_;
    int64_t num_heads_, head_dim_, batch_, height_, width_;
    Impl impl_;
    bool fused_ = false, stepped_ = false;
    int64_t rows_accumulated_ = 0;
    torch::Tensor g1_, g2_, g3_;  // the inner gradients' raw sums: (B, h, d, d) twice, (B, 9, d)
    std::vector<torch::Tensor> updated_;  // after the step: W1', W2' (B, h, d, d) and the depthwise kernels
};

// ---------------------------------------------------------------- design space (paper Sec. 4)

enum class Vit3InnerModel {
    FC,            // x W                                   weights: W (d, d)
    SiLUFC,        // silu(x W)                             W (d, d)
    GatedFC,       // (x W1) * silu(x W2)   (official F1)   W1, W2 (d, d)
    MLP2,          // silu(x W1) W2, hidden r*d             W1 (d, rd), W2 (rd, d)
    MLP3,          // silu(silu(x W1) W2) W3, hidden r*d    W1 (d, rd), W2 (rd, rd), W3 (rd, d)
    SwiGLU,        // (silu(x W1) * (x W2)) W3, hidden r*d  W1, W2 (d, rd), W3 (rd, d)
    DWConv3x3,     // depthwise 3x3 conv per head           W (d, 3, 3)
    Conv3x3,       // full 3x3 conv per head                W (d_out, d_in, 3, 3)
};

enum class Vit3InnerLoss {
    Dot,       // L = -(s/n) sum_i <v̂_i, v_i>
    MSE,       // L = (s/(2n)) sum_i ||v̂_i - v_i||^2
    RMSE,      // L = sqrt((s/n) sum_i ||v̂_i - v_i||^2)
    MAE,       // L = (s/n) sum_i ||v̂_i - v_i||_1
    SmoothL1,  // L = (s/n) sum_ij l(v̂_ij - v_ij), l = x²/2 (|x|<1) else |x| - 1/2
};

struct Vit3TttOptions {
    Vit3InnerModel model = Vit3InnerModel::GatedFC;
    Vit3InnerLoss loss = Vit3InnerLoss::Dot;
    double hidden_ratio = 1.0;     // r of MLP2 / MLP3 / SwiGLU (hidden width = round(r*d))
    double lr = 1.0;               // inner learning rate
    int64_t epochs = 1;            // passes over the N tokens
    int64_t num_minibatches = 1;   // k sequential mini-batches of (about) N/k tokens per epoch
    double loss_scale = -1.0;      // s in the losses; < 0 means 1/sqrt(d) (paper appendix)
    bool normalize_grad = false;   // official G / (||G|| + 1) (rows of W: dim -2; kernels: 3x3)
    bool use_autograd = false;     // inner gradients by autograd (create_graph) instead of closed form
};

Vit3InnerModel parse_vit3_inner_model(const std::string& name);  // "fc","silu_fc","gated_fc","mlp2","mlp3","swiglu","dwconv","conv"
Vit3InnerLoss parse_vit3_inner_loss(const std::string& name);    // "dot","mse","rmse","mae","smooth_l1"
const char* vit3_inner_model_name(Vit3InnerModel model);
const char* vit3_inner_loss_name(Vit3InnerLoss loss);

// Shapes of the initial inner weights of one layer (without the leading broadcast dim):
// token models (h, d_in, d_out) per matrix; DWConv3x3 (h, d, 3, 3); Conv3x3 (h, d, d, 3, 3).
std::vector<std::vector<int64_t>> vit3_inner_weight_shapes(const Vit3TttOptions& options, int64_t num_heads,
                                                           int64_t head_dim);

// Gradient of the inner loss with respect to the prediction v̂ for n tokens (closed form).
// pred, target: (..., n, d) for token models. `count` is n (the tokens in the mini-batch).
torch::Tensor vit3_inner_loss_grad(const torch::Tensor& pred, const torch::Tensor& target, Vit3InnerLoss loss,
                                   double scale, int64_t count);
// The inner loss itself, summed over (B, h): used by the autograd path and the tests.
torch::Tensor vit3_inner_loss_value(const torch::Tensor& pred, const torch::Tensor& target, Vit3InnerLoss loss,
                                    double scale, int64_t count);

// Gradients of the inner loss (on keys k, values v) with respect to the inner weights, in
// closed form (or by autograd with create_graph when options.use_autograd).
// k, v: (B, h, n, d), n = height * width row-major for conv models; weights as
// vit3_inner_weight_shapes with a leading dim 1 or B; returns per-sample gradients with a
// leading dim B. The loss covers tokens [start, start + length) (length < 0: all): token models
// see only those keys; conv models convolve the whole key image and restrict the loss.
std::vector<torch::Tensor> vit3_inner_gradients(const torch::Tensor& k, const torch::Tensor& v,
                                                const std::vector<torch::Tensor>& weights,
                                                const Vit3TttOptions& options, int64_t height, int64_t width,
                                                int64_t start = 0, int64_t length = -1);

// Applies the inner model with the given weights: x (B, h, n, d) -> (B, h, n, d).
torch::Tensor vit3_inner_forward(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                 const Vit3TttOptions& options, int64_t height, int64_t width);

// The generalised TTT mixer: trains the inner model on (k, v) for `epochs` passes of
// `num_minibatches` sequential mini-batches (contiguous token ranges; for conv models contiguous
// row-major positions) with step W <- W - lr * G (G normalised when normalize_grad), then returns
// the inner model applied to q. q, k, v: (B, h, N, d), N = height * width.
torch::Tensor vit3_ttt_generic(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::vector<torch::Tensor>& weights, const Vit3TttOptions& options,
                               int64_t height, int64_t width);

}  // namespace linvis::ops
