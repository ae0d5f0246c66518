// Fused CPU T⁵ TTT attention (spec vit3_t5_official.md B2): key instance norm, residual
// depthwise convs on q and k, one inner TTT-SwiGLU step with the dot loss, read-out.
//
// Forward: per (sample, channel) mean/rstd of k (two passes over the tokens); k2 = kn + dwconv(kn),
// q2 = q + dwconv(q) into (B, N, C) scratch; per (sample, head) one pass over token blocks
// accumulating G1, G2, G3 (d x d), then one pass applying (silu(q2 W1') * (q2 W2')) W3'.
// Saved for backward: the inputs, mean/rstd (B, C), G1..G3 (B, h, d, d). The backward recomputes
// kn, k2, q2 and every per-token quantity from them, one block of tokens at a time.
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>

#include "linvis/core/error.h"
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


// W1, W2, W3 in place; the inner step reads W3ᵀ, the backward also W1ᵀ and W2ᵀ.
HeadWeights head_weights(const T5TttParams& p, bool backward) {
    return HeadWeights({p.w1, p.w2, p.w3}, {backward, backward, true}, p.w1.size(-1));
}

// ---- elementwise bodies (compiled for every SIMD target, see LINVIS_SIMD_CLONES)

LINVIS_SIMD_INLINE void inner_elementwise1_body(int64_t T, int64_t d, const float* v, int64_t ldv, float n, float sc,
                                                 const float* __restrict z1, const float* __restrict z2,
                                                 const float* __restrict sg, float* __restrict e,
                                                 float* __restrict a2) {
    for (int64_t t = 0; t < T; ++t) {
        const float* __restrict vr = v + t * ldv;
        for (int64_t j = 0; j < d; ++j) {
            const int64_t i = t * d + j;
            e[i] = (-vr[j] / n) * sc;
            a2[i] = (z1[i] * sg[i]) * z2[i];
        }
    }
}
LINVIS_SIMD_CLONES(inner_elementwise1, (int64_t T, int64_t d, const float* v, int64_t ldv, float n, float sc,
                                       const float* z1, const float* z2, const float* sg, float* e, float* a2),
                  (T, d, v, ldv, n, sc, z1, z2, sg, e, a2))

LINVIS_SIMD_INLINE void inner_elementwise2_body(int64_t count, const float* __restrict z1,
                                                 const float* __restrict z2, const float* __restrict sg,
                                                 const float* __restrict da2, float* __restrict p1,
                                                 float* __restrict p2) {
    for (int64_t i = 0; i < count; ++i) {
        const float sig = sg[i], z = z1[i];
        p1[i] = da2[i] * z2[i] * (sig * (1.0f + z * (1.0f - sig)));
        p2[i] = da2[i] * (z * sig);
    }
}
LINVIS_SIMD_CLONES(inner_elementwise2, (int64_t count, const float* z1, const float* z2, const float* sg,
                                       const float* da2, float* p1, float* p2),
                  (count, z1, z2, sg, da2, p1, p2))

// h = silu(y1) * y2 with silu(y) = y * sigmoid(y).
LINVIS_SIMD_INLINE void gate_body(int64_t count, const float* __restrict y1, const float* __restrict y2,
                                   const float* __restrict sg, float* __restrict h) {
    for (int64_t i = 0; i < count; ++i) h[i] = (y1[i] * sg[i]) * y2[i];
}
LINVIS_SIMD_CLONES(gate, (int64_t count, const float* y1, const float* y2, const float* sg, float* h),
                  (count, y1, y2, sg, h))

LINVIS_SIMD_INLINE void gate_backward_body(int64_t count, const float* __restrict y1, const float* __restrict y2,
                                            const float* __restrict sg, float* __restrict dh,
                                            float* __restrict dy2) {
    for (int64_t i = 0; i < count; ++i) {
        const float sig = sg[i], z = y1[i];
        dy2[i] = dh[i] * (z * sig);
        dh[i] = dh[i] * y2[i] * (sig * (1.0f + z * (1.0f - sig)));  // becomes dy1
    }
}
LINVIS_SIMD_CLONES(gate_backward, (int64_t count, const float* y1, const float* y2, const float* sg, float* dh,
                                  float* dy2),
                  (count, y1, y2, sg, dh, dy2))

LINVIS_SIMD_INLINE void inner_backward_body(int64_t count, const float* __restrict z1, const float* __restrict z2,
                                             const float* __restrict sg, const float* __restrict da2f,
                                             const float* __restrict dp1, const float* __restrict dp2,
                                             const float* __restrict da2, float* __restrict dda2,
                                             float* __restrict dz1, float* __restrict dz2) {
    for (int64_t i = 0; i < count; ++i) {
        const float sig = sg[i], z = z1[i], a1 = z * sig;
        const float D1 = sig * (1.0f + z * (1.0f - sig));
        const float D1p = sig * (1.0f - sig) * (2.0f + z * (1.0f - 2.0f * sig));
        dda2[i] = dp1[i] * z2[i] * D1 + dp2[i] * a1;
        dz2[i] = dp1[i] * da2f[i] * D1 + da2[i] * a1;
        const float da1 = dp2[i] * da2f[i] + da2[i] * z2[i];
        dz1[i] = da1 * D1 + dp1[i] * da2f[i] * z2[i] * D1p;
    }
}
LINVIS_SIMD_CLONES(inner_backward, (int64_t count, const float* z1, const float* z2, const float* sg,
                                   const float* da2f, const float* dp1, const float* dp2, const float* da2,
                                   float* dda2, float* dz1, float* dz2),
                  (count, z1, z2, sg, da2f, dp1, dp2, da2, dda2, dz1, dz2))

// The inner forward + loss gradient for one token block of head hh of sample b.
void inner_block(const Kernels& kr, const Tokens& K2, const Tokens& V, const HeadWeights& hw, int64_t b, int64_t hh,
                 int64_t n0, int64_t T, const Dims& s, float* z1, float* z2, float* sg, float* e, float* a2,
                 float* da2, float* p1, float* p2) {
    const int64_t d = s.d;
    const float* kb = K2.head_row(b, hh, n0, d);
    kr.gemm(T, d, d, kb, K2.sn, 1, hw.w(0, hh), d, z1, d, false);
    kr.gemm(T, d, d, kb, K2.sn, 1, hw.w(1, hh), d, z2, d, false);
    kr.sigmoid(z1, sg, T * d);
    inner_elementwise1(T, d, V.head_row(b, hh, n0, d), V.sn, static_cast<float>(s.N), static_cast<float>(s.scale), z1,
                       z2, sg, e, a2);
    kr.gemm(T, d, d, e, d, 1, hw.wT(2, hh), d, da2, d, false);
    inner_elementwise2(T * d, z1, z2, sg, da2, p1, p2);
}

struct ForwardResult {
    Tensor out, mean, rstd, g;  // g: (3, B, h, d, d)
};

// kr: the kernels whose products the pass runs (simd::inference_kernels: bf16 tile products for bf16 inference).
ForwardResult t5_forward(const Prepared& in, const T5TttParams& p, const Kernels& kr = kernels()) {
    const Dims& s = in.s;
    const int64_t d = s.d, dd = d * d, BH = s.B * s.h, tasks = BH * s.blocks, rtasks = BH * s.groups;
    const Tokens Q = tokens_of(in.q), K = tokens_of(in.k), V = tokens_of(in.v);
    Tensor mean = torch::empty({s.B, s.C}, torch::kFloat32), rstd = torch::empty({s.B, s.C}, torch::kFloat32);
    key_stats(K, s, 1.0, nullptr, mean.data_ptr<float>(), rstd.data_ptr<float>());
    Tensor kn = torch::empty({s.B, s.N, s.C}, torch::kFloat32), k2 = torch::empty_like(kn), q2 = torch::empty_like(kn);
    const Tensor qb = p.q_conv_bias.to(torch::kFloat32).contiguous(), kb = p.k_conv_bias.to(torch::kFloat32).contiguous();
    key_locality(K, mean.data_ptr<float>(), rstd.data_ptr<float>(), taps_of(p.k_conv_weight, s.C),
                 kb.data_ptr<float>(), s, tokens_of(kn), tokens_of(k2));
    query_locality(Q, taps_of(p.q_conv_weight, s.C), qb.data_ptr<float>(), s, tokens_of(q2));
    kn = Tensor();
    const Tokens K2 = tokens_of(k2), Q2 = tokens_of(q2);
    const HeadWeights hw = head_weights(p, false);

    const Scratch pa(rtasks * dd), pb(rtasks * dd), pc(rtasks * dd);  // first block of a group overwrites
    at::parallel_for(0, rtasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(8, s.block, d);
        float* a[8];
        for (int i = 0; i < 8; ++i) a[i] = buf[i];
        for_each_group_block(s, begin, end, [&](int64_t bh, int64_t b, int64_t hh, int64_t part, int64_t n0, int64_t T,
                                                bool acc) {
            inner_block(kr, K2, V, hw, b, hh, n0, T, s, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
            const float* kbk = K2.head_row(b, hh, n0, d);
            kr.gemm(d, d, T, kbk, 1, K2.sn, a[6], d, pa.get() + part * dd, d, acc);
            kr.gemm(d, d, T, kbk, 1, K2.sn, a[7], d, pb.get() + part * dd, d, acc);
            kr.gemm(d, d, T, a[4], 1, d, a[3], d, pc.get() + part * dd, d, acc);
        });
    });
    k2 = Tensor();  // only the read-out (q2) is still needed
    Tensor g = torch::empty({3, s.B, s.h, d, d}, torch::kFloat32);
    const Scratch wn(3 * BH * dd);  // W' = W - G per (sample, head)
    updated_weights({pa.get(), pb.get(), pc.get()}, s.groups, hw, s, wn.get(), g.data_ptr<float>());
    Tensor out = torch::empty({s.B, s.N, s.C}, torch::kFloat32);
    const Tokens O = tokens_of(out);
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(4, s.block, d);
        float *y1 = buf[0], *y2 = buf[1], *sg = buf[2], *hb = buf[3];
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = s.head_of(task), blk = s.block_of(task), b = bh / s.h, hh = bh % s.h;
            const int64_t n0 = blk * s.block, T = std::min(s.block, s.N - n0);
            const float* qr = Q2.head_row(b, hh, n0, d);
            kr.gemm(T, d, d, qr, Q2.sn, 1, wn.get() + bh * dd, d, y1, d, false);
            kr.gemm(T, d, d, qr, Q2.sn, 1, wn.get() + (BH + bh) * dd, d, y2, d, false);
            kr.sigmoid(y1, sg, T * d);
            gate(T * d, y1, y2, sg, hb);
            kr.gemm(T, d, d, hb, d, 1, wn.get() + (2 * BH + bh) * dd, d, O.head_row(b, hh, n0, d), O.sn, false);
        }
    });
    // Inner: z1, z2, da2, G1, G2, G3; read-out: three products; convs 2 x 9 MACs per element.
    flops::add(9 * s.B * s.N * s.C * d + 2 * 9 * s.B * s.N * s.C);
    return {out, mean, rstd, g};
}

// dest: optional {dq, dk, dv} (B, N, C) float destinations with unit channel stride (views of one
// dqkv buffer for the qkv entry point).
std::vector<Tensor> t5_backward(const Prepared& in, const T5TttParams& p, const Tensor& mean, const Tensor& rstd,
                                const Tensor& g, const Tensor& grad, const std::vector<Tensor>& dest = {}) {
    const Dims& s = in.s;
    const int64_t d = s.d, dd = d * d, BH = s.B * s.h, rtasks = BH * s.groups, C = s.C;
    const Tokens Q = tokens_of(in.q), K = tokens_of(in.k), V = tokens_of(in.v), dO = tokens_of(grad);
    // The query side first (q2, read-out backward, q-conv backward), then the key side, so that at
    // most five (B, N, C) float buffers (input-gradient destinations included) are live at once.
    Tensor q2 = torch::empty({s.B, s.N, C}, torch::kFloat32);
    const std::vector<float> qtaps = taps_of(p.q_conv_weight, C), ktaps = taps_of(p.k_conv_weight, C);
    const Tensor qbias = p.q_conv_bias.to(torch::kFloat32).contiguous();
    const Tensor kbias = p.k_conv_bias.to(torch::kFloat32).contiguous();
    query_locality(Q, qtaps, qbias.data_ptr<float>(), s, tokens_of(q2));
    const Tokens Q2 = tokens_of(q2);
    const HeadWeights hw = head_weights(p, true);
    const float* gp = g.data_ptr<float>();
    std::vector<float> wn(3 * BH * dd), wnT(3 * BH * dd);  // W' and W'ᵀ per (sample, head)
    updated_weights({gp, gp + BH * dd, gp + 2 * BH * dd}, 1, hw, s, wn.data(), nullptr, wnT.data());
    const Kernels& kr = kernels();

    // Pass B: read-out backward -> dq2, dW' (per sample, head).
    Tensor dq2 = torch::empty({s.B, s.N, C}, torch::kFloat32);
    const Tokens DQ2 = tokens_of(dq2);
    const Scratch pa(rtasks * dd), pb(rtasks * dd), pc(rtasks * dd);  // first block of a group overwrites
    at::parallel_for(0, rtasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(6, s.block, d);
        float* a[6];
        for (int i = 0; i < 6; ++i) a[i] = buf[i];
        float *y1 = a[0], *y2 = a[1], *sg = a[2], *hbuf = a[3], *dh = a[4], *dy2 = a[5];
        for_each_group_block(s, begin, end, [&](int64_t bh, int64_t b, int64_t hh, int64_t part, int64_t n0, int64_t T,
                                                bool acc) {
            const float* qr = Q2.head_row(b, hh, n0, d);
            const float* gr = dO.head_row(b, hh, n0, d);
            kr.gemm(T, d, d, qr, Q2.sn, 1, wn.data() + bh * dd, d, y1, d, false);
            kr.gemm(T, d, d, qr, Q2.sn, 1, wn.data() + (BH + bh) * dd, d, y2, d, false);
            kr.sigmoid(y1, sg, T * d);
            gate(T * d, y1, y2, sg, hbuf);
            kr.gemm(d, d, T, hbuf, 1, d, gr, dO.sn, pc.get() + part * dd, d, acc);
            kr.gemm(T, d, d, gr, dO.sn, 1, wnT.data() + (2 * BH + bh) * dd, d, dh, d, false);
            gate_backward(T * d, y1, y2, sg, dh, dy2);  // dh becomes dy1
            kr.gemm(d, d, T, qr, 1, Q2.sn, dh, d, pa.get() + part * dd, d, acc);
            kr.gemm(d, d, T, qr, 1, Q2.sn, dy2, d, pb.get() + part * dd, d, acc);
            float* dq = DQ2.head_row(b, hh, n0, d);
            kr.gemm(T, d, d, dh, d, 1, wnT.data() + bh * dd, d, dq, DQ2.sn, false);
            kr.gemm(T, d, d, dy2, d, 1, wnT.data() + (BH + bh) * dd, d, dq, DQ2.sn, true);
        });
    });
    std::vector<float> dwp(3 * BH * dd);  // dW' per (sample, head)
    reduce_partials(pa.get(), BH, s.groups, dd, dwp.data());
    reduce_partials(pb.get(), BH, s.groups, dd, dwp.data() + BH * dd);
    reduce_partials(pc.get(), BH, s.groups, dd, dwp.data() + 2 * BH * dd);
    std::vector<float> dG, dGT;  // dG = -dW', and its transposes
    negated_with_transposes(dwp, 3 * BH, d, dG, dGT);

    q2 = Tensor();

    // q-conv backward right away (frees dq2 before pass C): dq = dq2 + dwconvᵀ(dq2), dqw = corr(q, dq2).
    Tensor dq = dest.empty() ? torch::empty({s.B, s.N, C}, torch::kFloat32) : dest[0];
    const ConvGradients dqconv = residual_conv_backward(Q, DQ2, qtaps, s, tokens_of(dq));
    dq2 = Tensor();

    Tensor kn = torch::empty({s.B, s.N, C}, torch::kFloat32), k2 = torch::empty_like(kn);
    key_locality(K, mean.data_ptr<float>(), rstd.data_ptr<float>(), ktaps, kbias.data_ptr<float>(), s, tokens_of(kn),
                 tokens_of(k2));
    const Tokens KN = tokens_of(kn), K2 = tokens_of(k2);

    // Pass C: inner-step backward -> dk2 (in the dk destination), dv, direct dW.
    Tensor dk2 = dest.empty() ? torch::empty({s.B, s.N, C}, torch::kFloat32) : dest[1];
    Tensor dv = dest.empty() ? torch::empty({s.B, s.N, C}, torch::kFloat32) : dest[2];
    const Tokens DK2 = tokens_of(dk2), DV = tokens_of(dv);
    at::parallel_for(0, rtasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(15, s.block, d);
        float* a[15];
        for (int i = 0; i < 15; ++i) a[i] = buf[i];
        float *z1 = a[0], *z2 = a[1], *sg = a[2], *e = a[3], *a2 = a[4], *da2f = a[5], *p1 = a[6], *p2 = a[7],
              *dp1 = a[8], *dp2 = a[9], *da2 = a[10], *de = a[11], *dda2 = a[12], *dz1 = a[13], *dz2 = a[14];
        const float dv_scale = static_cast<float>(-s.scale / static_cast<double>(s.N));
        for_each_group_block(s, begin, end, [&](int64_t bh, int64_t b, int64_t hh, int64_t part, int64_t n0, int64_t T,
                                                bool acc) {
            inner_block(kr, K2, V, hw, b, hh, n0, T, s, z1, z2, sg, e, a2, da2f, p1, p2);
            const float* kbk = K2.head_row(b, hh, n0, d);
            kr.gemm(T, d, d, kbk, K2.sn, 1, dG.data() + bh * dd, d, dp1, d, false);
            kr.gemm(T, d, d, kbk, K2.sn, 1, dG.data() + (BH + bh) * dd, d, dp2, d, false);
            kr.gemm(T, d, d, e, d, 1, dGT.data() + (2 * BH + bh) * dd, d, da2, d, false);
            kr.gemm(T, d, d, a2, d, 1, dG.data() + (2 * BH + bh) * dd, d, de, d, false);
            inner_backward(T * d, z1, z2, sg, da2f, dp1, dp2, da2, dda2, dz1, dz2);
            kr.gemm(T, d, d, dda2, d, 1, hw.w(2, hh), d, de, d, true);
            scale_rows(T, d, de, dv_scale, DV.head_row(b, hh, n0, d), DV.sn);
            float* dk = DK2.head_row(b, hh, n0, d);
            kr.gemm(T, d, d, p1, d, 1, dGT.data() + bh * dd, d, dk, DK2.sn, false);
            kr.gemm(T, d, d, p2, d, 1, dGT.data() + (BH + bh) * dd, d, dk, DK2.sn, true);
            kr.gemm(T, d, d, dz1, d, 1, hw.wT(0, hh), d, dk, DK2.sn, true);
            kr.gemm(T, d, d, dz2, d, 1, hw.wT(1, hh), d, dk, DK2.sn, true);
            kr.gemm(d, d, T, kbk, 1, K2.sn, dz1, d, pa.get() + part * dd, d, acc);
            kr.gemm(d, d, T, kbk, 1, K2.sn, dz2, d, pb.get() + part * dd, d, acc);
            kr.gemm(d, d, T, dda2, 1, d, e, d, pc.get() + part * dd, d, acc);
        });
    });
    std::vector<float> direct(3 * BH * dd);
    reduce_partials(pa.get(), BH, s.groups, dd, direct.data());
    reduce_partials(pb.get(), BH, s.groups, dd, direct.data() + BH * dd);
    reduce_partials(pc.get(), BH, s.groups, dd, direct.data() + 2 * BH * dd);
    const Tensor dw = weight_gradients(dwp, direct, 3, s);

    // k-conv backward and instance-norm backward: dkn in k2's storage (k2 is dead after pass C), dk over dk2.
    const ConvGradients dkconv = key_side_backward(K, KN, DK2, tokens_of(k2), ktaps, rstd.data_ptr<float>(), s);
    return {dq, dk2, dv, dw[0], dw[1], dw[2], dqconv.weight, dqconv.bias, dkconv.weight, dkconv.bias};
}

class T5AttentionFunction : public torch::autograd::Function<T5AttentionFunction> {
public:
    static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1,
                          const Tensor& w2, const Tensor& w3, const Tensor& qcw, const Tensor& qcb, const Tensor& kcw,
                          const Tensor& kcb, int64_t heads, int64_t H, int64_t W) {
        const T5TttParams p{w1, w2, w3, qcw, qcb, kcw, kcb};
        ForwardResult r = t5_forward(prepare(q, k, v, heads, H, W), p);
        ctx->save_for_backward({q, k, v, w1, w2, w3, qcw, qcb, kcw, kcb, r.mean, r.rstd, r.g});
        ctx->saved_data["heads"] = heads;
        ctx->saved_data["H"] = H;
        ctx->saved_data["W"] = W;
        return r.out.to(q.scalar_type());
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto sv = ctx->get_saved_variables();
        const T5TttParams p{sv[3], sv[4], sv[5], sv[6], sv[7], sv[8], sv[9]};
        const Prepared in = prepare(sv[0], sv[1], sv[2], ctx->saved_data["heads"].toInt(),
                                    ctx->saved_data["H"].toInt(), ctx->saved_data["W"].toInt());
        Tensor grad = grads[0].defined() ? f32_rows(grads[0]) : torch::zeros(sv[0].sizes(), torch::kFloat32);
        auto g = t5_backward(in, p, sv[10], sv[11], sv[12], grad);
        variable_list out;
        for (size_t i = 0; i < 10; ++i) out.push_back(g[i].to(sv[i].scalar_type()));
        out.resize(13);
        return out;
    }
};

// The same attention as one function of qkv (B, N, 3C): q, k, v are read in place and the
// backward writes the three gradients into one dqkv buffer (autograd would otherwise concatenate them).
class T5QkvFunction : public torch::autograd::Function<T5QkvFunction> {
public:
    static Prepared prepare_qkv(const Tensor& qkv, int64_t heads, int64_t H, int64_t W) {
        Tensor x = f32_rows(qkv);
        auto c = x.chunk(3, -1);
        return prepare(c[0], c[1], c[2], heads, H, W);
    }
    static Tensor forward(AutogradContext* ctx, const Tensor& qkv, const Tensor& w1, const Tensor& w2, const Tensor& w3,
                          const Tensor& qcw, const Tensor& qcb, const Tensor& kcw, const Tensor& kcb, int64_t heads,
                          int64_t H, int64_t W) {
        const T5TttParams p{w1, w2, w3, qcw, qcb, kcw, kcb};
        ForwardResult r = t5_forward(prepare_qkv(qkv, heads, H, W), p);
        ctx->save_for_backward({qkv, w1, w2, w3, qcw, qcb, kcw, kcb, r.mean, r.rstd, r.g});
        ctx->saved_data["heads"] = heads;
        ctx->saved_data["H"] = H;
        ctx->saved_data["W"] = W;
        return r.out.to(qkv.scalar_type());
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto sv = ctx->get_saved_variables();
        const T5TttParams p{sv[1], sv[2], sv[3], sv[4], sv[5], sv[6], sv[7]};
        const Prepared in = prepare_qkv(sv[0], ctx->saved_data["heads"].toInt(), ctx->saved_data["H"].toInt(),
                                        ctx->saved_data["W"].toInt());
        const int64_t B = in.s.B, N = in.s.N, C = in.s.C;
        Tensor grad = grads[0].defined() ? f32_rows(grads[0]) : torch::zeros({B, N, C}, torch::kFloat32);
        Tensor dqkv = torch::empty({B, N, 3 * C}, torch::kFloat32);
        auto dest = dqkv.chunk(3, -1);
        auto g = t5_backward(in, p, sv[8], sv[9], sv[10], grad, {dest[0], dest[1], dest[2]});
        variable_list out{dqkv.to(sv[0].scalar_type())};
        for (size_t i = 3; i < 10; ++i) out.push_back(g[i].to(sv[i - 2].scalar_type()));
        out.resize(11);
        return out;
    }
};

}  // namespace

Tensor t5_ttt_attention_qkv_fused(const Tensor& qkv, const T5TttParams& p, int64_t num_heads, int64_t height,
                                  int64_t width) {
    if (records_graph({qkv, p.w1, p.w2, p.w3, p.q_conv_weight, p.q_conv_bias, p.k_conv_weight, p.k_conv_bias}))
        return T5QkvFunction::apply(qkv, p.w1, p.w2, p.w3, p.q_conv_weight, p.q_conv_bias, p.k_conv_weight,
                                    p.k_conv_bias, num_heads, height, width);
    torch::NoGradGuard no_grad;
    const Kernels& kr = simd::inference_kernels(qkv.scalar_type() == torch::kBFloat16);
    return t5_forward(T5QkvFunction::prepare_qkv(qkv, num_heads, height, width), p, kr).out.to(qkv.scalar_type());
}

Tensor t5_ttt_attention_fused(const Tensor& q, const Tensor& k, const Tensor& v, const T5TttParams& p,
                              int64_t num_heads, int64_t height, int64_t width) {
    if (records_graph({q, k, v, p.w1, p.w2, p.w3, p.q_conv_weight, p.q_conv_bias, p.k_conv_weight, p.k_conv_bias}))
        return T5AttentionFunction::apply(q, k, v, p.w1, p.w2, p.w3, p.q_conv_weight, p.q_conv_bias, p.k_conv_weight,
                                          p.k_conv_bias, num_heads, height, width);
    torch::NoGradGuard no_grad;
    const Kernels& kr = simd::inference_kernels(q.scalar_type() == torch::kBFloat16);
    return t5_forward(prepare(q, k, v, num_heads, height, width), p, kr).out.to(q.scalar_type());
}

}  // namespace linvis::ops::fused_detail
