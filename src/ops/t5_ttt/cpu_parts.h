// The parts the fused CPU T⁵ (cpu.cpp) and DiT⁵ (dit5_cpu.cpp) TTT attentions share (internal): the token
// layout and task split, the key statistics and normalisation, the residual depthwise convs on q and k, and
// the backward of those convs and of the key norm. Both kernels run one inner TTT step per (sample, head) over
// blocks of tokens between these parts; they differ in the inner model (spec vit3_t5_official.md B2 and
// dit_generation.md §1.4).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "ops/ttt_swiglu_cpu/entry_points.h"
#include "ops/ttt_swiglu_cpu/kernels.h"

namespace linvis::ops::fused_detail::t5_parts {

// float32 with unit channel stride (a copy only when needed).
torch::Tensor f32_rows(const torch::Tensor& t);

// How a head's tokens are split into tasks. Blocks of equal length (up to one token), at most kTokenBlock tokens and
// at least kMinBlocks of them: a tiny model has 3 heads, and 3 tasks on 2 cores leave one core idle a third of the
// time (t5_tiny at 224 px, 2 threads: 2 blocks of 104 tokens ran 4 % faster than 4 of 56, and 2 of 98 another
// 4 % faster than 104 + 92). The d x d partial sums of consecutive blocks
// are reduced in at most kGroupsPerHead groups per head (one task each, added in a fixed order). Both depend on
// N only, so results do not depend on the thread count.
constexpr int64_t kMinBlocks = 2;
constexpr int64_t kGroupsPerHead = 8;

struct Dims {
    int64_t B, N, C, h, d, H, W;
    double scale;
    int64_t block = kTokenBlock;  // tokens per block
    int64_t blocks = 1;           // ceil(N / block)
    int64_t per_group = 1;        // blocks per group
    int64_t groups = 1;           // ceil(blocks / per_group)
    // Tasks are taken token-major, (sample*head) fastest: the heads of one block (or group) of tokens run one
    // after another on one thread while the rows they all read are in cache (as the ViT3 kernel's, see
    // SwigluDims). A reduction task's d x d partial sums stay at part_of(task) = (sample*head, group), so their
    // fixed-order sum does not depend on the task order.
    int64_t head_of(int64_t task) const { return task % (B * h); }
    // A read-out task's block, or a reduction task's group.
    int64_t block_of(int64_t task) const { return task / (B * h); }
    int64_t part_of(int64_t task) const { return head_of(task) * groups + block_of(task); }
    // The blocks [group_begin, group_end) of reduction task `task` (one group of one (sample, head)).
    int64_t group_begin(int64_t task) const { return block_of(task) * per_group; }
    int64_t group_end(int64_t task) const { return std::min(blocks, group_begin(task) + per_group); }
};

// Runs f(bh, b, hh, part, n0, T, acc) for every token block of the reduction tasks [begin, end): the (sample*head)
// bh = (b, hh), the slot `part` of its d x d partial sums, the block's first token n0 and its length T, and whether
// the block adds to the partial sums (acc) or starts them (the first block of its group).
template <class F>
void for_each_group_block(const Dims& s, int64_t begin, int64_t end, F&& f) {
    for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = s.head_of(task), part = s.part_of(task);
        for (int64_t blk = s.group_begin(task); blk < s.group_end(task); ++blk) {
            const int64_t n0 = blk * s.block;
            f(bh, bh / s.h, bh % s.h, part, n0, std::min(s.block, s.N - n0), blk % s.per_group != 0);
        }
    }
}

// A (B, N, C) float tensor with unit channel stride seen as heads / as images.
struct Tokens {
    float* p;
    int64_t sb, sn;
    float* row(int64_t b, int64_t n) const { return p + b * sb + n * sn; }
    float* head_row(int64_t b, int64_t hh, int64_t n, int64_t d) const { return p + b * sb + n * sn + hh * d; }
};
Tokens tokens_of(const torch::Tensor& t);
Image image_of(const Tokens& t, int64_t b, const Dims& s);
MutImage mut_image_of(const Tokens& t, int64_t b, const Dims& s);

// (C, 1, 3, 3) conv weight -> (9, C) taps.
std::vector<float> taps_of(const torch::Tensor& w, int64_t C);

// The inner model's weights, (1, h, d, d) each and shared over the batch: read in place as float32 rows (a copy
// only for another dtype or layout), with the per-head transposes a pass reads. (Copying and transposing every
// weight took 23 us of T5's 320 us forward at 224 px, on one core while the other waited.)
class HeadWeights {
public:
    // transposed[i]: whether the pass reads the transposes of weights[i].
    HeadWeights(const std::vector<torch::Tensor>& weights, const std::vector<bool>& transposed, int64_t d);
    // Head hh of weight i (d x d, row-major), and its transpose (when asked for).
    const float* w(int64_t i, int64_t hh) const { return ptr_[i] + hh * dd_; }
    const float* wT(int64_t i, int64_t hh) const { return transposes_[i].data() + hh * dd_; }

private:
    std::vector<torch::Tensor> rows_;  // keeps the float32 rows alive
    std::vector<const float*> ptr_;
    std::vector<std::vector<float>> transposes_;
    int64_t dd_;
};

// The fast weights after the inner step, W'(i, bh) = W(i, head of bh) - G(i, bh) for every weight i of hw and
// (sample*head) bh, where G(i, bh) is the sum of bh's parts_per_head partial matrices in parts[i] (added in
// their order by reduce_partials, so results do not depend on the thread count). Writes W' into wn, and G
// into g and W'ᵀ into wnT when they are not null; each is (weights, B*h, d, d). In parallel over the matrices:
// serially this took 28 us of T5's 320 us forward at 224 px.
void updated_weights(const std::vector<const float*>& parts, int64_t parts_per_head, const HeadWeights& hw,
                     const Dims& s, float* wn, float* g = nullptr, float* wnT = nullptr);

// The fast weights' gradients of the (sample, head) matrices in the backward:
// dG = -dW' per matrix and its transpose (count d x d matrices each), for the inner step's backward ...
void negated_with_transposes(const std::vector<float>& dw_updated, int64_t count, int64_t d, std::vector<float>& dG,
                             std::vector<float>& dGT);
// ... and the weights' gradients (weights, 1, h, d, d): per weight and head, the sum over the samples of
// dW' (through W' = W - G) and of the inner step's direct gradient, both (weights, B*h, d, d).
torch::Tensor weight_gradients(const std::vector<float>& dw_updated, const std::vector<float>& direct, int64_t weights,
                               const Dims& s);

// The inputs as float32 rows and the task split.
struct Prepared {
    torch::Tensor q, k, v;
    Dims s;
};
Prepared prepare(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads, int64_t H,
                 int64_t W);

// Per (sample, channel) statistics of the key instance norm over the N tokens (biased variance) of the keys
// a*k + o (a = channel_scale[c], 1 when null; the offset cancels): mean of k, and rstd = a / sqrt(a^2 var(k) +
// eps), so that (k - mean) * rstd is the normalised a*k + o. inv_std (may be null) gets 1 / sqrt(a^2 var(k) +
// eps), the norm's own factor, which its backward needs for the gradients of a and o. One pass: the sums of
// e = k - k(first token) and of e^2 in double, var = E[e^2] - E[e]^2; the shift keeps the two terms near the
// variance's size, so the subtraction loses nothing a float result would show.
void key_stats(const Tokens& k, const Dims& s, double eps, const float* channel_scale, float* mean, float* rstd,
               float* inv_std = nullptr);
// q2 = q + dwconv(q) + bias, (B, N, C); also used for the normalised keys. The residual is the stencil's
// centre tap plus one and the bias its starting value, so q2 is written in one pass.
void query_locality(const Tokens& q, const std::vector<float>& qtaps, const float* qbias, const Dims& s,
                    const Tokens& q2);
// kn = (k - mean) * rstd; k2 = kn + dwconv(kn) + bias. All (B, N, C).
void key_locality(const Tokens& k, const float* mean, const float* rstd, const std::vector<float>& ktaps,
                  const float* kbias, const Dims& s, const Tokens& kn, const Tokens& k2);

// dst rows (T x d, row stride ldd) = src (T x d, packed) * factor.
void scale_rows(int64_t T, int64_t d, const float* src, float factor, float* dst, int64_t ldd);

// The gradients of one residual depthwise conv y = x + dwconv(x) + bias.
struct ConvGradients {
    torch::Tensor weight, bias;  // (C, 1, 3, 3), (C)
};
// From dy = DY: dx = dy + dwconvᵀ(dy) into DX, and the conv's weight and bias gradients; x = X is the conv's
// input.
ConvGradients residual_conv_backward(const Tokens& X, const Tokens& DY, const std::vector<float>& taps, const Dims& s,
                                     const Tokens& DX);

// Per-channel sums the key norm's backward adds for a learnt affine a*k + o before the norm (DiT⁵'s
// qk_scale_ttt / qk_offset_ttt): d/da = sum over (b, n) of du * k, d/do = sum of du, du the gradient of a*k + o.
struct AffineGradients {
    std::vector<double> scale, offset;  // (C)
};
// The key side's backward from dk2 (the gradient of k2 = kn + dwconv(kn) + bias, in DK2; kn = KN, k = K, the
// raw keys): dkn = dk2 + dwconvᵀ(dk2) into DKN (scratch), then the instance norm's backward
// dk = rstd * (dkn - mean_n(dkn) - kn * mean_n(dkn * kn)) written over DK2. Returns the conv's gradients. With
// `affine` (and inv_std, the norm's own factor from key_stats, and channel_scale a), also the affine's sums, with
// du = inv_std * (dkn - ...).
ConvGradients key_side_backward(const Tokens& K, const Tokens& KN, const Tokens& DK2, const Tokens& DKN,
                                const std::vector<float>& ktaps, const float* rstd, const Dims& s,
                                const float* inv_std = nullptr, AffineGradients* affine = nullptr);

}  // namespace linvis::ops::fused_detail::t5_parts
