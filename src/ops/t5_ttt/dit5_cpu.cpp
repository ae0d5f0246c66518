// Fused CPU DiT⁵ TTT branch (spec dit_generation.md §1.4 step 2): per-channel scale and offset of q and k,
// key instance norm (eps 1.0), residual depthwise convs on q and k, one inner TTT-MLP step
// f(x) = silu(x W1) W2 with the L2 loss, read-out silu(q2 W1') W2'.
//
// Forward: q_t = q * a_q + o_q into (B, N, C) scratch; per (sample, channel) statistics of k, with the scale a_k
// folded into the norm's factor (the offset cancels); q2 = q_t + dwconv(q_t), k2 = kn + dwconv(kn); per (sample,
// head) one pass over token blocks accumulating G1 = k2ᵀ P and G2 = aᵀ e (d x d), then one pass applying
// silu(q2 W1') W2' with W' = W - G. Saved for backward: the inputs, the key statistics (B, C) and G1, G2
// (B, h, d, d); the backward recomputes every per-token quantity from them, one block of tokens at a time.
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>

#include "linvis/core/flops.h"
#include "ops/records_graph.h"
#include "ops/simd/amx.h"
#include "ops/t5_ttt/cpu_parts.h"
#include "ops/ttt_swiglu_cpu/entry_points.h"
#include "ops/ttt_swiglu_cpu/kernels.h"

namespace linvis::ops::fused_detail {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using namespace t5_parts;

// ---- elementwise bodies (compiled for every SIMD target, see LINVIS_SIMD_CLONES)

// dst[n, c] = src[n, c] * scale[c] + offset[c] over `count` rows.
LINVIS_SIMD_INLINE void affine_rows_body(const float* src, int64_t count, int64_t lds, int64_t C,
                                         const float* __restrict scale, const float* __restrict offset, float* dst,
                                         int64_t ldd) {
    for (int64_t n = 0; n < count; ++n) {
        const float* __restrict r = src + n * lds;
        float* __restrict o = dst + n * ldd;
        for (int64_t c = 0; c < C; ++c) o[c] = r[c] * scale[c] + offset[c];
    }
}
LINVIS_SIMD_CLONES(affine_rows,
                   (const float* src, int64_t count, int64_t lds, int64_t C, const float* scale, const float* offset,
                    float* dst, int64_t ldd),
                   (src, count, lds, C, scale, offset, dst, ldd))

// a = silu(z) = z * sigmoid(z), from sg = sigmoid(z).
LINVIS_SIMD_INLINE void silu_of_body(int64_t count, const float* __restrict z, const float* __restrict sg,
                                     float* __restrict a) {
    for (int64_t i = 0; i < count; ++i) a[i] = z[i] * sg[i];
}
LINVIS_SIMD_CLONES(silu_of, (int64_t count, const float* z, const float* sg, float* a), (count, z, sg, a))

// e = ((y - v) / n) * sc in place over y (T x d, packed), v rows with stride ldv: the L2 loss's gradient.
LINVIS_SIMD_INLINE void loss_gradient_body(int64_t T, int64_t d, const float* v, int64_t ldv, float n, float sc,
                                           float* __restrict e) {
    for (int64_t t = 0; t < T; ++t) {
        const float* __restrict vr = v + t * ldv;
        for (int64_t j = 0; j < d; ++j) e[t * d + j] = ((e[t * d + j] - vr[j]) / n) * sc;
    }
}
LINVIS_SIMD_CLONES(loss_gradient, (int64_t T, int64_t d, const float* v, int64_t ldv, float n, float sc, float* e),
                   (T, d, v, ldv, n, sc, e))

// g *= silu'(z), silu'(z) = sg * (1 + z * (1 - sg)) as the official code writes it (in place over g).
LINVIS_SIMD_INLINE void times_silu_grad_body(int64_t count, const float* __restrict z, const float* __restrict sg,
                                             float* __restrict g) {
    for (int64_t i = 0; i < count; ++i) g[i] = g[i] * (sg[i] * (1.0f + z[i] * (1.0f - sg[i])));
}
LINVIS_SIMD_CLONES(times_silu_grad, (int64_t count, const float* z, const float* sg, float* g), (count, z, sg, g))

// The backward of p = da * silu'(z) from dp: dda = dp * silu'(z) (over dp) and dzp = dp * da * silu''(z),
// silu''(z) = sg (1 - sg) (2 + z (1 - 2 sg)).
LINVIS_SIMD_INLINE void silu_grad_backward_body(int64_t count, const float* __restrict z, const float* __restrict sg,
                                                const float* __restrict da, float* __restrict dp,
                                                float* __restrict dzp) {
    for (int64_t i = 0; i < count; ++i) {
        const float s = sg[i], x = z[i];
        const float d1 = s * (1.0f + x * (1.0f - s)), d2 = s * (1.0f - s) * (2.0f + x * (1.0f - 2.0f * s));
        dzp[i] = dp[i] * da[i] * d2;
        dp[i] = dp[i] * d1;
    }
}
LINVIS_SIMD_CLONES(silu_grad_backward, (int64_t count, const float* z, const float* sg, const float* da, float* dp,
                                        float* dzp),
                   (count, z, sg, da, dp, dzp))

// dy = (de * sc) / n: the gradient of y (and minus that of v) through e = ((y - v) / n) * sc.
LINVIS_SIMD_INLINE void loss_gradient_backward_body(int64_t count, const float* __restrict de, float n, float sc,
                                                    float* __restrict dy) {
    for (int64_t i = 0; i < count; ++i) dy[i] = (de[i] * sc) / n;
}
LINVIS_SIMD_CLONES(loss_gradient_backward, (int64_t count, const float* de, float n, float sc, float* dy),
                   (count, de, n, sc, dy))

// dz = da * silu'(z) + dzp in place over da.
LINVIS_SIMD_INLINE void silu_backward_plus_body(int64_t count, const float* __restrict z, const float* __restrict sg,
                                                const float* __restrict dzp, float* __restrict da) {
    for (int64_t i = 0; i < count; ++i) da[i] = da[i] * (sg[i] * (1.0f + z[i] * (1.0f - sg[i]))) + dzp[i];
}
LINVIS_SIMD_CLONES(silu_backward_plus, (int64_t count, const float* z, const float* sg, const float* dzp, float* da),
                   (count, z, sg, dzp, da))

// W1 and W2 in place; the inner step reads W2ᵀ, the backward also W1ᵀ.
HeadWeights head_weights(const Dit5TttParams& p, bool backward) {
    return HeadWeights({p.w1, p.w2}, {backward, true}, p.w1.size(-1));
}

// The (C) scale and offset of q (column 0) or k (column 1) of qk_scale_ttt / qk_offset_ttt (1, 1, C, 2).
std::vector<float> affine_column(const Tensor& t, int64_t column) {
    Tensor c = t.select(3, column).reshape({-1}).to(torch::kFloat32).contiguous();
    return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// q_t = q * scale + offset, (B, N, C).
Tensor affine_queries(const Tokens& Q, const std::vector<float>& scale, const std::vector<float>& offset,
                      const Dims& s) {
    Tensor qt = torch::empty({s.B, s.N, s.C}, torch::kFloat32);
    const Tokens QT = tokens_of(qt);
    const GridTasks g(s.B, s.H, s.W, kTokenBlock);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task), n0 = g.y0(task) * s.W;
            affine_rows(Q.row(b, n0), g.y1(task) * s.W - n0, Q.sn, s.C, scale.data(), offset.data(), QT.row(b, n0),
                        QT.sn);
        }
    });
    return qt;
}

// The inner forward and loss gradient for one token block of head hh of sample b: z = k2 W1, sg = sigmoid(z),
// a = silu(z), e = ((a W2 - v) / N) * s, da = e W2ᵀ, p = da * silu'(z).
void inner_block(const Kernels& kr, const Tokens& K2, const Tokens& V, const HeadWeights& hw, int64_t b, int64_t hh,
                 int64_t n0, int64_t T, const Dims& s, float* z, float* sg, float* a, float* e, float* da, float* p) {
    const int64_t d = s.d;
    kr.gemm(T, d, d, K2.head_row(b, hh, n0, d), K2.sn, 1, hw.w(0, hh), d, z, d, false);
    kr.sigmoid(z, sg, T * d);
    silu_of(T * d, z, sg, a);
    kr.gemm(T, d, d, a, d, 1, hw.w(1, hh), d, e, d, false);
    loss_gradient(T, d, V.head_row(b, hh, n0, d), V.sn, static_cast<float>(s.N), static_cast<float>(s.scale), e);
    kr.gemm(T, d, d, e, d, 1, hw.wT(1, hh), d, da, d, false);
    std::copy(da, da + T * d, p);
    times_silu_grad(T * d, z, sg, p);
}

struct ForwardResult {
    Tensor out, mean, rstd, inv_std, g;  // g: (2, B, h, d, d)
};

// kr: the kernels whose products the pass runs (simd::inference_kernels: bf16 tile products for bf16 inference).
ForwardResult dit5_forward(const Prepared& in, const Dit5TttParams& p, const Kernels& kr = kernels()) {
    const Dims& s = in.s;
    const int64_t d = s.d, dd = d * d, BH = s.B * s.h, tasks = BH * s.blocks, rtasks = BH * s.groups;
    const Tokens Q = tokens_of(in.q), K = tokens_of(in.k), V = tokens_of(in.v);
    const std::vector<float> k_scale = affine_column(p.qk_scale, 1);
    Tensor mean = torch::empty({s.B, s.C}, torch::kFloat32), rstd = torch::empty_like(mean);
    Tensor inv_std = torch::empty_like(mean);
    key_stats(K, s, 1.0, k_scale.data(), mean.data_ptr<float>(), rstd.data_ptr<float>(), inv_std.data_ptr<float>());
    Tensor kn = torch::empty({s.B, s.N, s.C}, torch::kFloat32), k2 = torch::empty_like(kn);
    const Tensor kb = p.k_conv_bias.to(torch::kFloat32).contiguous();
    key_locality(K, mean.data_ptr<float>(), rstd.data_ptr<float>(), taps_of(p.k_conv_weight, s.C),
                 kb.data_ptr<float>(), s, tokens_of(kn), tokens_of(k2));
    kn = Tensor();
    const HeadWeights hw = head_weights(p, false);
    const Tokens K2 = tokens_of(k2);

    const Scratch pa(rtasks * dd), pb(rtasks * dd);  // first block of a group overwrites
    at::parallel_for(0, rtasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(6, s.block, d);
        float *z = buf[0], *sg = buf[1], *a = buf[2], *e = buf[3], *da = buf[4], *pp = buf[5];
        for_each_group_block(s, begin, end, [&](int64_t bh, int64_t b, int64_t hh, int64_t part, int64_t n0, int64_t T,
                                                bool acc) {
            inner_block(kr, K2, V, hw, b, hh, n0, T, s, z, sg, a, e, da, pp);
            kr.gemm(d, d, T, K2.head_row(b, hh, n0, d), 1, K2.sn, pp, d, pa.get() + part * dd, d, acc);
            kr.gemm(d, d, T, a, 1, d, e, d, pb.get() + part * dd, d, acc);
        });
    });
    k2 = Tensor();
    Tensor g = torch::empty({2, s.B, s.h, d, d}, torch::kFloat32);
    const Scratch wn(2 * BH * dd);  // W' = W - G per (sample, head)
    updated_weights({pa.get(), pb.get()}, s.groups, hw, s, wn.get(), g.data_ptr<float>());

    // q2 = q_t + dwconv(q_t) (q_t freed once q2 is written), then the read-out silu(q2 W1') W2'.
    Tensor q2 = torch::empty({s.B, s.N, s.C}, torch::kFloat32);
    {
        const Tensor qt = affine_queries(Q, affine_column(p.qk_scale, 0), affine_column(p.qk_offset, 0), s);
        const Tensor qb = p.q_conv_bias.to(torch::kFloat32).contiguous();
        query_locality(tokens_of(qt), taps_of(p.q_conv_weight, s.C), qb.data_ptr<float>(), s, tokens_of(q2));
    }
    const Tokens Q2 = tokens_of(q2);
    Tensor out = torch::empty({s.B, s.N, s.C}, torch::kFloat32);
    const Tokens O = tokens_of(out);
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(3, s.block, d);
        float *y1 = buf[0], *sg = buf[1], *h = buf[2];
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = s.head_of(task), blk = s.block_of(task), b = bh / s.h, hh = bh % s.h;
            const int64_t n0 = blk * s.block, T = std::min(s.block, s.N - n0);
            kr.gemm(T, d, d, Q2.head_row(b, hh, n0, d), Q2.sn, 1, wn.get() + bh * dd, d, y1, d, false);
            kr.sigmoid(y1, sg, T * d);
            silu_of(T * d, y1, sg, h);
            kr.gemm(T, d, d, h, d, 1, wn.get() + (BH + bh) * dd, d, O.head_row(b, hh, n0, d), O.sn, false);
        }
    });
    // Inner: z, y, da, G1, G2; read-out: two products; convs 2 x 9 MACs per element.
    flops::add(7 * s.B * s.N * s.C * d + 2 * 9 * s.B * s.N * s.C);
    return {out, mean, rstd, inv_std, g};
}

// Per-channel sums of the affine's gradients over (b, n): scale_sum[c] += dx * x, offset_sum[c] += dx, for
// y = x * a + o with dy = DY; DY is then scaled to dx = dy * a in place.
void affine_backward(const Tokens& X, const Tokens& DY, const std::vector<float>& scale, const Dims& s,
                     AffineGradients& sums) {
    const int64_t C = s.C;
    const GridTasks g(s.B, s.H, s.W, kTokenBlock);
    std::vector<double> parts(g.count() * 2 * C, 0.0);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task);
            double* r = parts.data() + task * 2 * C;
            for (int64_t n = g.y0(task) * s.W; n < g.y1(task) * s.W; ++n) {
                const float* x = X.row(b, n);
                float* dy = DY.row(b, n);
                for (int64_t c = 0; c < C; ++c) {
                    r[c] += static_cast<double>(dy[c]) * x[c];
                    r[C + c] += dy[c];
                    dy[c] *= scale[c];
                }
            }
        }
    });
    sums.scale.assign(C, 0.0);
    sums.offset.assign(C, 0.0);
    for (int64_t task = 0; task < g.count(); ++task)  // task order: the same result for any thread count
        for (int64_t c = 0; c < C; ++c) {
            sums.scale[c] += parts[task * 2 * C + c];
            sums.offset[c] += parts[task * 2 * C + C + c];
        }
}

// The gradients of every input, in the order q, k, v, w1, w2, qk_scale, qk_offset, q conv (weight, bias), k conv.
std::vector<Tensor> dit5_backward(const Prepared& in, const Dit5TttParams& p, const Tensor& mean, const Tensor& rstd,
                                  const Tensor& inv_std, const Tensor& g, const Tensor& grad) {
    const Dims& s = in.s;
    const int64_t d = s.d, dd = d * d, BH = s.B * s.h, rtasks = BH * s.groups, C = s.C;
    const Tokens Q = tokens_of(in.q), K = tokens_of(in.k), V = tokens_of(in.v), dO = tokens_of(grad);
    const std::vector<float> q_scale = affine_column(p.qk_scale, 0), k_scale = affine_column(p.qk_scale, 1);
    const std::vector<float> qtaps = taps_of(p.q_conv_weight, C), ktaps = taps_of(p.k_conv_weight, C);
    const Tensor qbias = p.q_conv_bias.to(torch::kFloat32).contiguous();
    const Tensor kbias = p.k_conv_bias.to(torch::kFloat32).contiguous();
    // The query side first (q_t, q2, read-out backward, q-conv backward), then the key side.
    const Tensor qt = affine_queries(Q, q_scale, affine_column(p.qk_offset, 0), s);
    Tensor q2 = torch::empty({s.B, s.N, C}, torch::kFloat32);
    query_locality(tokens_of(qt), qtaps, qbias.data_ptr<float>(), s, tokens_of(q2));
    const Tokens Q2 = tokens_of(q2);
    const HeadWeights hw = head_weights(p, true);
    const float* gp = g.data_ptr<float>();
    std::vector<float> wn(2 * BH * dd), wnT(2 * BH * dd);  // W' and W'ᵀ per (sample, head)
    updated_weights({gp, gp + BH * dd}, 1, hw, s, wn.data(), nullptr, wnT.data());
    const Kernels& kr = kernels();

    // Pass B: read-out backward -> dq2, dW' (per sample, head).
    Tensor dq2 = torch::empty({s.B, s.N, C}, torch::kFloat32);
    const Tokens DQ2 = tokens_of(dq2);
    const Scratch pa(rtasks * dd), pb(rtasks * dd);  // first block of a group overwrites
    at::parallel_for(0, rtasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(4, s.block, d);
        float *y1 = buf[0], *sg = buf[1], *h = buf[2], *dh = buf[3];
        for_each_group_block(s, begin, end, [&](int64_t bh, int64_t b, int64_t hh, int64_t part, int64_t n0, int64_t T,
                                                bool acc) {
            const float* qr = Q2.head_row(b, hh, n0, d);
            const float* gr = dO.head_row(b, hh, n0, d);
            kr.gemm(T, d, d, qr, Q2.sn, 1, wn.data() + bh * dd, d, y1, d, false);
            kr.sigmoid(y1, sg, T * d);
            silu_of(T * d, y1, sg, h);
            kr.gemm(d, d, T, h, 1, d, gr, dO.sn, pb.get() + part * dd, d, acc);
            kr.gemm(T, d, d, gr, dO.sn, 1, wnT.data() + (BH + bh) * dd, d, dh, d, false);
            times_silu_grad(T * d, y1, sg, dh);  // dh becomes dy1
            kr.gemm(d, d, T, qr, 1, Q2.sn, dh, d, pa.get() + part * dd, d, acc);
            kr.gemm(T, d, d, dh, d, 1, wnT.data() + bh * dd, d, DQ2.head_row(b, hh, n0, d), DQ2.sn, false);
        });
    });
    std::vector<float> dwp(2 * BH * dd);  // dW' per (sample, head)
    reduce_partials(pa.get(), BH, s.groups, dd, dwp.data());
    reduce_partials(pb.get(), BH, s.groups, dd, dwp.data() + BH * dd);
    std::vector<float> dG, dGT;  // dG = -dW', and its transposes
    negated_with_transposes(dwp, 2 * BH, d, dG, dGT);
    q2 = Tensor();

    // q-conv backward (dq_t into dq), then the q affine: d(scale) and d(offset) sums, dq = dq_t * scale.
    Tensor dq = torch::empty({s.B, s.N, C}, torch::kFloat32);
    const ConvGradients dqconv = residual_conv_backward(tokens_of(qt), DQ2, qtaps, s, tokens_of(dq));
    dq2 = Tensor();
    AffineGradients q_affine;
    affine_backward(Q, tokens_of(dq), q_scale, s, q_affine);

    Tensor kn = torch::empty({s.B, s.N, C}, torch::kFloat32), k2 = torch::empty_like(kn);
    key_locality(K, mean.data_ptr<float>(), rstd.data_ptr<float>(), ktaps, kbias.data_ptr<float>(), s, tokens_of(kn),
                 tokens_of(k2));
    const Tokens KN = tokens_of(kn), K2 = tokens_of(k2);

    // Pass C: inner-step backward -> dk2 (into dk), dv, direct dW.
    Tensor dk = torch::empty({s.B, s.N, C}, torch::kFloat32), dv = torch::empty({s.B, s.N, C}, torch::kFloat32);
    const Tokens DK2 = tokens_of(dk), DV = tokens_of(dv);
    at::parallel_for(0, rtasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(11, s.block, d);
        float *z = buf[0], *sg = buf[1], *a = buf[2], *e = buf[3], *da = buf[4], *pp = buf[5], *dp = buf[6],
              *dzp = buf[7], *de = buf[8], *dy = buf[9], *dz = buf[10];
        const float n = static_cast<float>(s.N), sc = static_cast<float>(s.scale);
        for_each_group_block(s, begin, end, [&](int64_t bh, int64_t b, int64_t hh, int64_t part, int64_t n0, int64_t T,
                                                bool acc) {
            const float* kbk = K2.head_row(b, hh, n0, d);
            inner_block(kr, K2, V, hw, b, hh, n0, T, s, z, sg, a, e, da, pp);
            // G1 = k2ᵀ p: dp = k2 dG1, then p = da * silu'(z) backwards (dp becomes d(da)).
            kr.gemm(T, d, d, kbk, K2.sn, 1, dG.data() + bh * dd, d, dp, d, false);
            silu_grad_backward(T * d, z, sg, da, dp, dzp);
            // G2 = aᵀ e and da = e W2ᵀ: de = a dG2 + d(da) W2; then e = ((y - v) / N) s: dy = de s / N, dv = -dy.
            kr.gemm(T, d, d, a, d, 1, dG.data() + (BH + bh) * dd, d, de, d, false);
            kr.gemm(T, d, d, dp, d, 1, hw.w(1, hh), d, de, d, true);
            loss_gradient_backward(T * d, de, n, sc, dy);
            scale_rows(T, d, dy, -1.0f, DV.head_row(b, hh, n0, d), DV.sn);
            // da' = e dG2ᵀ + dy W2ᵀ (a feeds G2 and y = a W2), then dz = da' silu'(z) + dzp.
            kr.gemm(T, d, d, e, d, 1, dGT.data() + (BH + bh) * dd, d, dz, d, false);
            kr.gemm(T, d, d, dy, d, 1, hw.wT(1, hh), d, dz, d, true);
            silu_backward_plus(T * d, z, sg, dzp, dz);
            // dk2 = p dG1ᵀ + dz W1ᵀ.
            float* dkr = DK2.head_row(b, hh, n0, d);
            kr.gemm(T, d, d, pp, d, 1, dGT.data() + bh * dd, d, dkr, DK2.sn, false);
            kr.gemm(T, d, d, dz, d, 1, hw.wT(0, hh), d, dkr, DK2.sn, true);
            // dW1 += k2ᵀ dz; dW2 += d(da)ᵀ e + aᵀ dy.
            kr.gemm(d, d, T, kbk, 1, K2.sn, dz, d, pa.get() + part * dd, d, acc);
            kr.gemm(d, d, T, dp, 1, d, e, d, pb.get() + part * dd, d, acc);
            kr.gemm(d, d, T, a, 1, d, dy, d, pb.get() + part * dd, d, true);
        });
    });
    std::vector<float> direct(2 * BH * dd);
    reduce_partials(pa.get(), BH, s.groups, dd, direct.data());
    reduce_partials(pb.get(), BH, s.groups, dd, direct.data() + BH * dd);
    const Tensor dw = weight_gradients(dwp, direct, 2, s);

    // k-conv backward and instance-norm backward (dkn in k2's storage, dead after pass C), with the k affine's sums;
    // dk (the gradient of the raw keys) over dk2.
    AffineGradients k_affine;
    const ConvGradients dkconv =
        key_side_backward(K, KN, DK2, tokens_of(k2), ktaps, rstd.data_ptr<float>(), s, inv_std.data_ptr<float>(),
                          &k_affine);
    Tensor dscale = torch::empty({1, 1, C, 2}, torch::kFloat32), doffset = torch::empty({1, 1, C, 2}, torch::kFloat32);
    float *ds = dscale.data_ptr<float>(), *doff = doffset.data_ptr<float>();  // (c, q or k) pairs
    for (int64_t c = 0; c < C; ++c) {
        ds[2 * c] = static_cast<float>(q_affine.scale[c]);
        ds[2 * c + 1] = static_cast<float>(k_affine.scale[c]);
        doff[2 * c] = static_cast<float>(q_affine.offset[c]);
        doff[2 * c + 1] = static_cast<float>(k_affine.offset[c]);
    }
    return {dq, dk, dv, dw[0], dw[1], dscale, doffset, dqconv.weight, dqconv.bias, dkconv.weight, dkconv.bias};
}

// Tensors in the order dit5_backward returns their gradients.
std::vector<Tensor> inputs_of(const Tensor& q, const Tensor& k, const Tensor& v, const Dit5TttParams& p) {
    return {q, k, v, p.w1, p.w2, p.qk_scale, p.qk_offset, p.q_conv_weight, p.q_conv_bias, p.k_conv_weight,
            p.k_conv_bias};
}

class Dit5TttFunction : public torch::autograd::Function<Dit5TttFunction> {
public:
    static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1,
                          const Tensor& w2, const Tensor& qk_scale, const Tensor& qk_offset, const Tensor& qcw,
                          const Tensor& qcb, const Tensor& kcw, const Tensor& kcb, int64_t heads, int64_t H,
                          int64_t W) {
        const Dit5TttParams p{w1, w2, qk_scale, qk_offset, qcw, qcb, kcw, kcb};
        ForwardResult r = dit5_forward(prepare(q, k, v, heads, H, W), p);
        std::vector<Tensor> saved = inputs_of(q, k, v, p);
        for (const Tensor& t : {r.mean, r.rstd, r.inv_std, r.g}) saved.push_back(t);
        ctx->save_for_backward(saved);
        ctx->saved_data["heads"] = heads;
        ctx->saved_data["H"] = H;
        ctx->saved_data["W"] = W;
        return r.out.to(q.scalar_type());
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto sv = ctx->get_saved_variables();
        const Dit5TttParams p{sv[3], sv[4], sv[5], sv[6], sv[7], sv[8], sv[9], sv[10]};
        const Prepared in = prepare(sv[0], sv[1], sv[2], ctx->saved_data["heads"].toInt(),
                                    ctx->saved_data["H"].toInt(), ctx->saved_data["W"].toInt());
        Tensor grad = grads[0].defined() ? f32_rows(grads[0]) : torch::zeros(sv[0].sizes(), torch::kFloat32);
        std::vector<Tensor> g = dit5_backward(in, p, sv[11], sv[12], sv[13], sv[14], grad);
        variable_list out;
        for (size_t i = 0; i < g.size(); ++i) out.push_back(g[i].to(sv[i].scalar_type()));
        out.resize(14);  // heads, H, W
        return out;
    }
};

}  // namespace

Tensor dit5_ttt_attention_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Dit5TttParams& p,
                                int64_t num_heads, int64_t height, int64_t width) {
    if (records_graph({q, k, v, p.w1, p.w2, p.qk_scale, p.qk_offset, p.q_conv_weight, p.q_conv_bias, p.k_conv_weight,
                       p.k_conv_bias}))
        return Dit5TttFunction::apply(q, k, v, p.w1, p.w2, p.qk_scale, p.qk_offset, p.q_conv_weight, p.q_conv_bias,
                                      p.k_conv_weight, p.k_conv_bias, num_heads, height, width);
    torch::NoGradGuard no_grad;
    const Kernels& kr = simd::inference_kernels(q.scalar_type() == torch::kBFloat16);
    return dit5_forward(prepare(q, k, v, num_heads, height, width), p, kr).out.to(q.scalar_type());
}

}  // namespace linvis::ops::fused_detail
