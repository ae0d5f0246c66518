// Fused CPU ViT³ TTT branches (spec vit3_t5_official.md A2 steps 4-6, A10): one inner gradient
// step over all N tokens without materialising (B, h, N, d) temporaries.
//
// SwiGLU branch, per (sample, head), tokens in blocks of kTokenBlock:
//   forward  pass 1: Z1 = K W1, Z2 = K W2, E = (-V/N) s  ->  G1 += Kᵀ(E∘silu(Z2)), G2 += Kᵀ(E∘Z1∘silu'(Z2))
//            normalise, W' = W - G/(||G||_col + 1)
//            pass 2: out = (Q W1') ∘ silu(Q W2')
//            Both passes multiply by [W1 | W2] side by side (one product 2d wide, its two halves in each row) and
//            run the gate's elementwise part on those rows in place (the SIMD layer's silu_mul_*rows).
//   backward pass B: recompute Q W', dQ, dW' = Qᵀ dY         (reduction; side by side as the forward)
//            dG = normalisation backward of -dW'
//            pass C: recompute Z = K [W1 | W2], dP = K [dG1 | dG2]; P, dZ, dV over their rows in one pass;
//                    dK = P dGᵀ + dZ Wᵀ (stacked), dW (direct) = Kᵀ dZ      (side by side as the forward)
// Saved for backward: the inputs and the raw inner gradients G1, G2 (B, h, d, d).
// Depthwise branch, per sample on the (H, W) grid, channels contiguous:
//   G = α Σ_grid kpad(shift) v (α = -s/(HW)), normalised over 3x3, W3' = w3 - Ĝ, out = dwconv(q, W3').
// Saved: the inputs and G (B, 9, d).
#include <algorithm>
#include <vector>

#include <ATen/Parallel.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/vit3_ttt.h"
#include "ops/records_graph.h"
#include "ops/simd/amx.h"
#include "ops/ttt_swiglu_cpu/kernels.h"
#include "ops/ttt_swiglu_cpu/entry_points.h"

namespace linvis::ops::fused_detail {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string fused_unsupported(const Tensor& t) {
    if (!t.device().is_cpu()) return "CPU tensors only, got " + t.device().str();
    if (t.scalar_type() != torch::kFloat32 && t.scalar_type() != torch::kBFloat16)
        return std::string("float32 or bfloat16 only, got ") + c10::toString(t.scalar_type());
    return {};
}

namespace {

// float32 with a contiguous last dim (a view when the input already is one).
Tensor f32_rows(const Tensor& t) {
    Tensor x = t.scalar_type() == torch::kFloat32 ? t : t.to(torch::kFloat32);
    if (x.stride(-1) != 1) x = x.contiguous();
    return x;
}

struct Heads {  // (B, h, N, d) with unit channel stride
    float* p;
    int64_t sb, sh, sn;
    float* row(int64_t b, int64_t hh, int64_t n) const { return p + b * sb + hh * sh + n * sn; }
};
Heads heads_of(const Tensor& t) {
    return {const_cast<float*>(t.data_ptr<float>()), t.stride(0), t.stride(1), t.stride(2)};
}

// (B, N, h, d) contiguous float tensor, returned to callers as its (B, h, N, d) transpose.
Tensor new_heads_buffer(int64_t B, int64_t h, int64_t N, int64_t d) {
    return torch::empty({B, N, h, d}, torch::kFloat32).transpose(1, 2);
}

// Copies K rows (stride sn) into nothing: gemm reads them in place. Helper for the weight (1 or B).
const float* weight_of(const Tensor& w, int64_t b, int64_t hh, int64_t h, int64_t d) {
    const int64_t bb = w.size(0) == 1 ? 0 : b;
    return w.data_ptr<float>() + (bb * h + hh) * d * d;
}

// [W1 | W2]: `count` pairs of d x d matrices side by side in rows of 2d, so one product computes both.
std::vector<float> side_by_side(const float* w1, const float* w2, int64_t count, int64_t d) {
    std::vector<float> w(count * 2 * d * d);
    for (int64_t i = 0; i < count * d; ++i) {
        std::copy_n(w1 + i * d, d, w.data() + i * 2 * d);
        std::copy_n(w2 + i * d, d, w.data() + i * 2 * d + d);
    }
    return w;
}

// The inverse: rows of 2d into the two d x d halves.
void split_side_by_side(const float* w, int64_t count, int64_t d, float* w1, float* w2) {
    for (int64_t i = 0; i < count * d; ++i) {
        std::copy_n(w + i * 2 * d, d, w1 + i * d);
        std::copy_n(w + i * 2 * d + d, d, w2 + i * d);
    }
}

struct SwigluDims {
    int64_t B, h, N, d, blocks;
    double scale;
    int64_t loss_tokens = 0;  // the loss's N when the call sees a band of the map's tokens (0: N)
    // The passes' tasks are (sample*head, token block) pairs taken block-major: the heads of one block of tokens
    // run one after another on one thread while the qkv rows they all read are in cache (head-major, each head
    // swept all rows again: vit3_tiny 1.03-1.04x at 512 / 1024 px). A task's d x d partial sums stay at
    // part_of(task) = (sample*head, block), so their fixed-order sum does not depend on the task order.
    int64_t head_of(int64_t task) const { return task % (B * h); }
    int64_t block_of(int64_t task) const { return task / (B * h); }
    int64_t part_of(int64_t task) const { return head_of(task) * blocks + block_of(task); }
};

// Raw inner gradients G1, G2: (B, h, d, d). kr: the kernels whose products the pass runs (simd::inference_kernels).
// Per token block: Z = K [W1 | W2], then [E∘silu(Z2) | E∘Z1∘silu'(Z2)] over Z's rows (silu_mul's backward for
// the upstream gradient E = c V), then Kᵀ of those rows.
void swiglu_gradients(const Kernels& kr, const Heads& K, const Heads& V, const Tensor& w1, const Tensor& w2,
                      const SwigluDims& s, float* g1, float* g2) {
    const int64_t d = s.d, dd = d * d, tasks = s.B * s.h * s.blocks;
    const std::vector<float> w12 = side_by_side(w1.data_ptr<float>(), w2.data_ptr<float>(), w1.size(0) * s.h, d);
    const float c = static_cast<float>(-s.scale / static_cast<double>(s.loss_tokens > 0 ? s.loss_tokens : s.N));
    const Scratch parts(tasks * 2 * dd);  // one d x 2d block per task
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(1, std::min(kTokenBlock, s.N), 2 * d);
        float* z = buf[0];
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = s.head_of(task), blk = s.block_of(task), b = bh / s.h, hh = bh % s.h;
            const int64_t n0 = blk * kTokenBlock, T = std::min(kTokenBlock, s.N - n0), part = s.part_of(task);
            const int64_t pair = w1.size(0) == 1 ? hh : bh;
            const float* kb = K.row(b, hh, n0);
            kr.gemm(T, 2 * d, d, kb, K.sn, 1, w12.data() + pair * 2 * dd, 2 * d, z, 2 * d, false);
            kr.silu_mul_backward_rows(z + d, z, 2 * d, T, d, V.row(b, hh, n0), V.sn, c);
            kr.gemm(d, 2 * d, T, kb, 1, K.sn, z, 2 * d, parts.get() + part * 2 * dd, 2 * d, false);
        }
    });
    std::vector<float> g12(s.B * s.h * 2 * dd);
    reduce_partials(parts.get(), s.B * s.h, s.blocks, 2 * dd, g12.data());
    split_side_by_side(g12.data(), s.B * s.h, d, g1, g2);
}

// W' = W - G/(||G||_col + 1) per (b, head); norms kept for the backward.
void swiglu_updated_weights(const Tensor& w, const float* g, const SwigluDims& s, float* w_new, float* norms) {
    const int64_t d = s.d, dd = d * d;
    std::vector<float> gn(dd);
    for (int64_t b = 0; b < s.B; ++b)
        for (int64_t hh = 0; hh < s.h; ++hh) {
            const int64_t bh = b * s.h + hh;
            normalize_groups(g + bh * dd, d, d, d, /*columns_are_groups=*/true, gn.data(), norms + bh * d);
            const float* wv = weight_of(w, b, hh, s.h, d);
            for (int64_t i = 0; i < dd; ++i) w_new[bh * dd + i] = wv[i] - 1.0f * gn[i];
        }
}

// Pass 2: O = (Q W1') * silu(Q W2') from the updated weights (B, h, d, d), as one product with [W1' | W2'].
void swiglu_readout(const Kernels& kr, const Heads& Q, const float* w1n, const float* w2n, const SwigluDims& s,
                    const Heads& O) {
    const int64_t d = s.d, dd = d * d;
    const std::vector<float> w12 = side_by_side(w1n, w2n, s.B * s.h, d);
    at::parallel_for(0, s.B * s.h * s.blocks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(1, std::min(kTokenBlock, s.N), 2 * d);
        float* y = buf[0];
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = s.head_of(task), blk = s.block_of(task), b = bh / s.h, hh = bh % s.h;
            const int64_t n0 = blk * kTokenBlock, T = std::min(kTokenBlock, s.N - n0);
            kr.gemm(T, 2 * d, d, Q.row(b, hh, n0), Q.sn, 1, w12.data() + bh * 2 * dd, 2 * d, y, 2 * d, false);
            kr.silu_mul_rows(y + d, y, 2 * d, T, d, O.row(b, hh, n0), O.sn);
        }
    });
}

struct SwigluForwardResult {
    Tensor out, g1, g2;
};

// out_heads: optional (B, h, N, d) float destination with unit channel stride (e.g. a view of
// the mixer's output); allocated when undefined. kr: the kernels whose products the pass runs.
SwigluForwardResult swiglu_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1,
                                   const Tensor& w2, double scale, Tensor out_heads = Tensor(),
                                   const Kernels& kr = kernels()) {
    const int64_t B = q.size(0), h = q.size(1), N = q.size(2), d = q.size(3);
    const SwigluDims s{B, h, N, d, (N + kTokenBlock - 1) / kTokenBlock, scale};
    const Heads Q = heads_of(q), K = heads_of(k), V = heads_of(v);
    Tensor g1 = torch::empty({B, h, d, d}, torch::kFloat32), g2 = torch::empty({B, h, d, d}, torch::kFloat32);
    swiglu_gradients(kr, K, V, w1, w2, s, g1.data_ptr<float>(), g2.data_ptr<float>());
    std::vector<float> w1n(B * h * d * d), w2n(B * h * d * d), norms(B * h * d);
    swiglu_updated_weights(w1, g1.data_ptr<float>(), s, w1n.data(), norms.data());
    swiglu_updated_weights(w2, g2.data_ptr<float>(), s, w2n.data(), norms.data());

    Tensor out = out_heads.defined() ? out_heads : new_heads_buffer(B, h, N, d);
    swiglu_readout(kr, Q, w1n.data(), w2n.data(), s, heads_of(out));
    // Inner products (4 of N x d x d per head) and the two read-out products.
    flops::add(6 * B * h * N * d * d);
    return {out, g1, g2};
}

// Returns dq, dk, dv (B, h, N, d) and per-sample dW1, dW2 (B, h, d, d).
// dest: optional {dq, dk, dv} (B, h, N, d) float destinations with unit channel stride.
std::vector<Tensor> swiglu_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1,
                                    const Tensor& w2, const Tensor& g1t, const Tensor& g2t, const Tensor& grad,
                                    double scale, const std::vector<Tensor>& dest = {}) {
    const int64_t B = q.size(0), h = q.size(1), N = q.size(2), d = q.size(3), dd = d * d;
    const SwigluDims s{B, h, N, d, (N + kTokenBlock - 1) / kTokenBlock, scale};
    const Heads Q = heads_of(q), K = heads_of(k), V = heads_of(v), dO = heads_of(grad);
    const float *g1 = g1t.data_ptr<float>(), *g2 = g2t.data_ptr<float>();
    const int64_t BH = B * h, tasks = BH * s.blocks;
    std::vector<float> w1n(BH * dd), w2n(BH * dd), n1(BH * d), n2(BH * d);
    swiglu_updated_weights(w1, g1, s, w1n.data(), n1.data());
    swiglu_updated_weights(w2, g2, s, w2n.data(), n2.data());
    // Transposed weights for the X·Wᵀ products, stacked (2d x d): W1'ᵀ on W2'ᵀ for pass B's dQ, W1ᵀ on W2ᵀ for pass
    // C's dK.
    std::vector<float> wnT(BH * 2 * dd), wT(BH * 2 * dd);
    for (int64_t bh = 0; bh < BH; ++bh) {
        transpose(w1n.data() + bh * dd, d, d, d, wnT.data() + bh * 2 * dd);
        transpose(w2n.data() + bh * dd, d, d, d, wnT.data() + bh * 2 * dd + dd);
        transpose(weight_of(w1, bh / h, bh % h, h, d), d, d, d, wT.data() + bh * 2 * dd);
        transpose(weight_of(w2, bh / h, bh % h, h, d), d, d, d, wT.data() + bh * 2 * dd + dd);
    }
    const std::vector<float> w12n = side_by_side(w1n.data(), w2n.data(), BH, d);
    const Kernels& kr = kernels();

    // Pass B: read-out backward. Y = Q [W1' | W2'], then [dY1 | dY2] over Y's rows (silu_mul's backward), then
    // dW' = Qᵀ [dY1 | dY2] and dQ = [dY1 | dY2] [W1'ᵀ; W2'ᵀ].
    Tensor dq = dest.empty() ? new_heads_buffer(B, h, N, d) : dest[0];
    const Heads dQ = heads_of(dq);
    const Scratch pab(tasks * 2 * dd);
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(1, std::min(kTokenBlock, N), 2 * d);
        float* y = buf[0];
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = s.head_of(task), blk = s.block_of(task), b = bh / h, hh = bh % h, part = s.part_of(task);
            const int64_t n0 = blk * kTokenBlock, T = std::min(kTokenBlock, N - n0);
            const float* qb = Q.row(b, hh, n0);
            kr.gemm(T, 2 * d, d, qb, Q.sn, 1, w12n.data() + bh * 2 * dd, 2 * d, y, 2 * d, false);
            kr.silu_mul_backward_rows(y + d, y, 2 * d, T, d, dO.row(b, hh, n0), dO.sn, 1.0f);
            kr.gemm(d, 2 * d, T, qb, 1, Q.sn, y, 2 * d, pab.get() + part * 2 * dd, 2 * d, false);
            kr.gemm(T, d, 2 * d, y, 2 * d, 1, wnT.data() + bh * 2 * dd, d, dQ.row(b, hh, n0), dQ.sn, false);
        }
    });
    Tensor dw1 = torch::empty({B, h, d, d}, torch::kFloat32), dw2 = torch::empty({B, h, d, d}, torch::kFloat32);
    float *dw1p = dw1.data_ptr<float>(), *dw2p = dw2.data_ptr<float>();
    {  // dW' (the direct path of W - Ĝ)
        std::vector<float> dw12(BH * 2 * dd);
        reduce_partials(pab.get(), BH, s.blocks, 2 * dd, dw12.data());
        split_side_by_side(dw12.data(), BH, d, dw1p, dw2p);
    }
    // dG = the normalisation's backward of -dW'; [dG1 | dG2] side by side, and dG1ᵀ stacked on dG2ᵀ (2d x d).
    std::vector<float> dg1(BH * dd), dg2(BH * dd), dgT(BH * 2 * dd), neg(dd);
    for (int64_t bh = 0; bh < BH; ++bh) {
        for (int64_t i = 0; i < dd; ++i) neg[i] = -dw1p[bh * dd + i];
        normalize_groups_backward(g1 + bh * dd, neg.data(), n1.data() + bh * d, d, d, d, true, dg1.data() + bh * dd);
        for (int64_t i = 0; i < dd; ++i) neg[i] = -dw2p[bh * dd + i];
        normalize_groups_backward(g2 + bh * dd, neg.data(), n2.data() + bh * d, d, d, d, true, dg2.data() + bh * dd);
        transpose(dg1.data() + bh * dd, d, d, d, dgT.data() + bh * 2 * dd);
        transpose(dg2.data() + bh * dd, d, d, d, dgT.data() + bh * 2 * dd + dd);
    }
    const std::vector<float> dg12 = side_by_side(dg1.data(), dg2.data(), BH, d);
    const std::vector<float> w12 = side_by_side(w1.data_ptr<float>(), w2.data_ptr<float>(), w1.size(0) * h, d);

    // Pass C: inner-step backward, side by side as the forward. Z = K [W1 | W2] and dP = K [dG1 | dG2]; over their
    // rows (silu_mul_backward_rows_backward) Z becomes P = [P1 | P2], dP becomes dZ = [dZ1 | dZ2], and dV is written;
    // then dK = P [dG1ᵀ; dG2ᵀ] + dZ [W1ᵀ; W2ᵀ] and the direct dW = Kᵀ dZ (side by side, split after the sum).
    const Scratch pab_direct(tasks * 2 * dd);
    Tensor dk = dest.empty() ? new_heads_buffer(B, h, N, d) : dest[1];
    Tensor dv = dest.empty() ? new_heads_buffer(B, h, N, d) : dest[2];
    const Heads dK = heads_of(dk), dV = heads_of(dv);
    const float c = static_cast<float>(-scale / static_cast<double>(N));
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        const BlockScratch buf(2, std::min(kTokenBlock, N), 2 * d);
        float *z = buf[0], *dp = buf[1];
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = s.head_of(task), blk = s.block_of(task), b = bh / h, hh = bh % h, part = s.part_of(task);
            const int64_t n0 = blk * kTokenBlock, T = std::min(kTokenBlock, N - n0);
            const int64_t pair = w1.size(0) == 1 ? hh : bh;
            const float* kb = K.row(b, hh, n0);
            float* dkb = dK.row(b, hh, n0);
            kr.gemm(T, 2 * d, d, kb, K.sn, 1, w12.data() + pair * 2 * dd, 2 * d, z, 2 * d, false);
            kr.gemm(T, 2 * d, d, kb, K.sn, 1, dg12.data() + bh * 2 * dd, 2 * d, dp, 2 * d, false);
            kr.silu_mul_backward_rows_backward(z, dp, 2 * d, T, d, V.row(b, hh, n0), V.sn, c, dV.row(b, hh, n0), dV.sn);
            kr.gemm(T, d, 2 * d, z, 2 * d, 1, dgT.data() + bh * 2 * dd, d, dkb, dK.sn, false);
            kr.gemm(T, d, 2 * d, dp, 2 * d, 1, wT.data() + bh * 2 * dd, d, dkb, dK.sn, true);
            kr.gemm(d, 2 * d, T, kb, 1, K.sn, dp, 2 * d, pab_direct.get() + part * 2 * dd, 2 * d, false);
        }
    });
    std::vector<float> direct12(BH * 2 * dd), direct1(BH * dd), direct2(BH * dd);
    reduce_partials(pab_direct.get(), BH, s.blocks, 2 * dd, direct12.data());
    split_side_by_side(direct12.data(), BH, d, direct1.data(), direct2.data());
    for (int64_t i = 0; i < BH * dd; ++i) {
        dw1p[i] += direct1[i];
        dw2p[i] += direct2[i];
    }
    return {dq, dk, dv, dw1, dw2};
}

Tensor sum_to_weight(const Tensor& per_sample, const Tensor& w) {
    Tensor g = w.size(0) == 1 && per_sample.size(0) != 1 ? per_sample.sum(0, true) : per_sample;
    return g.to(w.scalar_type());
}

class Vit3SwigluFunction : public torch::autograd::Function<Vit3SwigluFunction> {
public:
    static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1,
                          const Tensor& w2, double scale) {
        Tensor qf = f32_rows(q), kf = f32_rows(k), vf = f32_rows(v);
        Tensor w1f = w1.to(torch::kFloat32).contiguous(), w2f = w2.to(torch::kFloat32).contiguous();
        SwigluForwardResult r = swiglu_forward(qf, kf, vf, w1f, w2f, scale);
        ctx->save_for_backward({q, k, v, w1, w2, r.g1, r.g2});
        ctx->saved_data["scale"] = scale;
        return r.out.to(q.scalar_type());
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &w1 = saved[3], &w2 = saved[4];
        Tensor grad = grads[0].defined() ? f32_rows(grads[0]) : torch::zeros(q.sizes(), torch::kFloat32);
        auto g = swiglu_backward(f32_rows(q), f32_rows(k), f32_rows(v), w1.to(torch::kFloat32).contiguous(),
                                 w2.to(torch::kFloat32).contiguous(), saved[5], saved[6], grad,
                                 ctx->saved_data["scale"].toDouble());
        return {g[0].to(q.scalar_type()), g[1].to(k.scalar_type()), g[2].to(v.scalar_type()), sum_to_weight(g[3], w1),
                sum_to_weight(g[4], w2), Tensor()};
    }
};

// ---------------------------------------------------------------- depthwise-conv branch

// (B, d, H, W) -> channels-last float view (B, H, W, d) with unit channel stride.
Tensor channels_last(const Tensor& t) {
    Tensor x = t.permute({0, 2, 3, 1});
    if (x.scalar_type() != torch::kFloat32) x = x.to(torch::kFloat32);
    if (x.stride(3) != 1) x = x.contiguous();
    return x;
}
Image image_of(const Tensor& cl, int64_t b) {
    return {cl.data_ptr<float>() + b * cl.stride(0), cl.stride(1), cl.stride(2), cl.size(1), cl.size(2), cl.size(3)};
}
MutImage mut_image_of(const Tensor& cl, int64_t b) {
    return {cl.data_ptr<float>() + b * cl.stride(0), cl.stride(1), cl.stride(2), cl.size(1), cl.size(2), cl.size(3)};
}

// acc (B, 9, d) = Σ over the grid of stencil_reduce(a, b), chunk partials summed in fixed order. The grid's rows
// start at row `first` of the images (a band of a map with its halo rows).
void grid_reduce(const Tensor& a, const Tensor& b, const GridTasks& g, int64_t d, float* acc, int64_t first = 0) {
    std::vector<float> parts(g.count() * 9 * d, 0.0f);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task)
            stencil_reduce(image_of(a, g.sample(task)), image_of(b, g.sample(task)), parts.data() + task * 9 * d,
                           first + g.y0(task), first + g.y1(task));
    });
    for (int64_t bb = 0; bb < g.B; ++bb) {
        float* o = acc + bb * 9 * d;
        std::fill(o, o + 9 * d, 0.0f);
        for (int64_t c = 0; c < g.chunks; ++c) {
            const float* p = parts.data() + (bb * g.chunks + c) * 9 * d;
            for (int64_t i = 0; i < 9 * d; ++i) o[i] += p[i];
        }
    }
}

// dst (B, H, W, d) = stencil of src with per-sample taps (B, 9, d); the grid's rows start at row `first`.
void grid_apply(const Tensor& src, const float* taps, bool transpose_taps, const Tensor& dst, const GridTasks& g,
                int64_t d, int64_t first = 0) {
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bb = g.sample(task);
            stencil_apply(image_of(src, bb), taps + bb * 9 * d, transpose_taps, mut_image_of(dst, bb),
                          first + g.y0(task), first + g.y1(task), false);
        }
    });
}

// Updated taps W3' (B, 9, d) from raw G (B, 9, d) and w3 (d, 1, 3, 3); norms (B, d).
void dwconv_updated_taps(const Tensor& w3, const float* G, int64_t B, int64_t d, float* taps, float* norms) {
    const float* w = w3.data_ptr<float>();
    std::vector<float> gn(9 * d);
    for (int64_t b = 0; b < B; ++b) {
        normalize_groups(G + b * 9 * d, 9, d, d, /*columns_are_groups=*/true, gn.data(), norms + b * d);
        for (int64_t t = 0; t < 9; ++t)
            for (int64_t c = 0; c < d; ++c) taps[(b * 9 + t) * d + c] = w[c * 9 + t] - 1.0f * gn[t * d + c];
    }
}

// Depthwise branch forward on channels-last float maps (B, H, W, d); writes out (channels-last,
// unit channel stride) and returns the raw inner gradient G (B, 9, d).
Tensor dwconv_forward_cl(const Tensor& qc, const Tensor& kc, const Tensor& vc, const Tensor& w3f, double scale,
                         const Tensor& out) {
    const int64_t B = qc.size(0), H = qc.size(1), W = qc.size(2), d = qc.size(3);
    const GridTasks g(B, H, W, kTokenBlock);
    Tensor G = torch::empty({B, 9, d}, torch::kFloat32);
    grid_reduce(kc, vc, g, d, G.data_ptr<float>());
    G.mul_(-scale / static_cast<double>(H * W));
    std::vector<float> taps(B * 9 * d), norms(B * d);
    dwconv_updated_taps(w3f, G.data_ptr<float>(), B, d, taps.data(), norms.data());
    grid_apply(qc, taps.data(), false, out, g, d);
    flops::add(2 * 9 * B * d * H * W);
    return G;
}

// Backward of dwconv_forward_cl: writes dq, dk, dv (channels-last destinations), returns dw3 (d, 1, 3, 3).
Tensor dwconv_backward_cl(const Tensor& qc, const Tensor& kc, const Tensor& vc, const Tensor& w3f, const Tensor& G,
                          const Tensor& go, double scale, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
    const int64_t B = qc.size(0), H = qc.size(1), W = qc.size(2), d = qc.size(3);
    const GridTasks g(B, H, W, kTokenBlock);
    std::vector<float> taps(B * 9 * d), norms(B * d);
    dwconv_updated_taps(w3f, G.data_ptr<float>(), B, d, taps.data(), norms.data());
    grid_apply(go, taps.data(), true, dq, g, d);
    std::vector<float> dtaps(B * 9 * d), dG(B * 9 * d), neg(9 * d);
    grid_reduce(qc, go, g, d, dtaps.data());
    const float alpha = static_cast<float>(-scale / static_cast<double>(H * W));
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < 9 * d; ++i) neg[i] = -dtaps[b * 9 * d + i];
        normalize_groups_backward(G.data_ptr<float>() + b * 9 * d, neg.data(), norms.data() + b * d, 9, d, d, true,
                                  dG.data() + b * 9 * d);
        for (int64_t i = 0; i < 9 * d; ++i) dG[b * 9 * d + i] *= alpha;
    }
    // G = α Σ k(shift) v: dk = α·stencilᵀ(v, dG), dv = α·stencil(k, dG).
    grid_apply(vc, dG.data(), true, dk, g, d);
    grid_apply(kc, dG.data(), false, dv, g, d);
    Tensor dw3 = torch::zeros({d, 1, 3, 3}, torch::kFloat32);
    float* dw = dw3.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < 9; ++t)
            for (int64_t c = 0; c < d; ++c) dw[c * 9 + t] += dtaps[(b * 9 + t) * d + c];
    return dw3;
}

class Vit3DwconvFunction : public torch::autograd::Function<Vit3DwconvFunction> {
public:
    // Returns (out (B, d, H, W) in q's dtype, raw G (B, 9, d)).
    static std::pair<Tensor, Tensor> run_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w3,
                                                 double scale) {
        const int64_t B = q.size(0), d = q.size(1), H = q.size(2), W = q.size(3);
        Tensor out = torch::empty({B, H, W, d}, torch::kFloat32);
        Tensor G = dwconv_forward_cl(channels_last(q), channels_last(k), channels_last(v),
                                     w3.to(torch::kFloat32).contiguous(), scale, out);
        return {out.permute({0, 3, 1, 2}).to(q.scalar_type()), G};
    }
    static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w3,
                          double scale) {
        auto r = run_forward(q, k, v, w3, scale);
        ctx->save_for_backward({q, k, v, w3, r.second});
        ctx->saved_data["scale"] = scale;
        return r.first;
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &w3 = saved[3];
        const int64_t B = q.size(0), d = q.size(1), H = q.size(2), W = q.size(3);
        Tensor go = grads[0].defined() ? channels_last(grads[0]) : torch::zeros({B, H, W, d}, torch::kFloat32);
        auto cl = [&] { return torch::empty({B, H, W, d}, torch::kFloat32); };
        Tensor dq = cl(), dk = cl(), dv = cl();
        Tensor dw3 = dwconv_backward_cl(channels_last(q), channels_last(k), channels_last(v),
                                        w3.to(torch::kFloat32).contiguous(), saved[4], go,
                                        ctx->saved_data["scale"].toDouble(), dq, dk, dv);
        auto back = [](const Tensor& t, const Tensor& like) { return t.permute({0, 3, 1, 2}).to(like.scalar_type()); };
        return {back(dq, q), back(dk, k), back(dv, v), dw3.to(w3.scalar_type()), Tensor()};
    }
};

// The whole mixer without RoPE as one function of qkv (B, N, 3C+3d): reads q, k, v in place, writes
// both branches into one (B, N, C+d) output and, in backward, every gradient into one dqkv buffer
// (no split / cat / transpose copies).
struct MixViews {
    Tensor q, k, v;     // (B, h, N, d)
    Tensor qc, kc, vc;  // (B, H, W, d) channels-last
};
MixViews mix_views(const Tensor& t, int64_t h, int64_t H, int64_t W, int64_t first_width) {
    const int64_t B = t.size(0), N = t.size(1), C = first_width, d = C / h;
    // view (never a copy): the same helper builds the write destinations of the backward.
    auto heads = [&](int64_t i) { return t.narrow(2, i * C, C).view({B, N, h, d}).transpose(1, 2); };
    auto map = [&](int64_t i) { return t.narrow(2, 3 * C + i * d, d).view({B, H, W, d}); };
    return {heads(0), heads(1), heads(2), map(0), map(1), map(2)};
}

class Vit3MixFunction : public torch::autograd::Function<Vit3MixFunction> {
public:
    static Tensor run(const Tensor& qkv, const Tensor& w1, const Tensor& w2, const Tensor& w3, int64_t h, int64_t H,
                      int64_t W, Tensor* g1, Tensor* g2, Tensor* G) {
        Tensor x = f32_rows(qkv);
        const int64_t B = x.size(0), N = x.size(1), d = x.size(2) / (3 * (h + 1)), C = h * d;
        const MixViews m = mix_views(x, h, H, W, C);
        Tensor out = torch::empty({B, N, C + d}, torch::kFloat32);
        // Without a graph to record (g1 null), bf16 inference may run its products on the AMX tiles.
        const Kernels& kr = g1 != nullptr ? kernels() : simd::inference_kernels(qkv.scalar_type() == torch::kBFloat16);
        auto r = swiglu_forward(m.q, m.k, m.v, w1.to(torch::kFloat32).contiguous(),
                                w2.to(torch::kFloat32).contiguous(), kVit3InnerScale,
                                out.narrow(2, 0, C).view({B, N, h, d}).transpose(1, 2), kr);
        Tensor Gd = dwconv_forward_cl(m.qc, m.kc, m.vc, w3.to(torch::kFloat32).contiguous(), kVit3InnerScale,
                                      out.narrow(2, C, d).view({B, H, W, d}));
        if (g1 != nullptr) *g1 = r.g1, *g2 = r.g2, *G = Gd;
        return out.to(qkv.scalar_type());
    }
    static Tensor forward(AutogradContext* ctx, const Tensor& qkv, const Tensor& w1, const Tensor& w2,
                          const Tensor& w3, int64_t h, int64_t H, int64_t W) {
        Tensor g1, g2, G;
        Tensor out = run(qkv, w1, w2, w3, h, H, W, &g1, &g2, &G);
        ctx->save_for_backward({qkv, w1, w2, w3, g1, g2, G});
        ctx->saved_data["h"] = h;
        ctx->saved_data["H"] = H;
        ctx->saved_data["W"] = W;
        return out;
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto sv = ctx->get_saved_variables();
        const int64_t h = ctx->saved_data["h"].toInt(), H = ctx->saved_data["H"].toInt(),
                      W = ctx->saved_data["W"].toInt();
        Tensor x = f32_rows(sv[0]);
        const int64_t B = x.size(0), N = x.size(1), d = x.size(2) / (3 * (h + 1)), C = h * d;
        Tensor grad = grads[0].defined() ? f32_rows(grads[0]) : torch::zeros({B, N, C + d}, torch::kFloat32);
        const MixViews m = mix_views(x, h, H, W, C);
        Tensor dqkv = torch::empty({B, N, 3 * C + 3 * d}, torch::kFloat32);
        const MixViews dm = mix_views(dqkv, h, H, W, C);
        auto g = swiglu_backward(m.q, m.k, m.v, sv[1].to(torch::kFloat32).contiguous(),
                                 sv[2].to(torch::kFloat32).contiguous(), sv[4], sv[5],
                                 grad.narrow(2, 0, C).reshape({B, N, h, d}).transpose(1, 2), kVit3InnerScale,
                                 {dm.q, dm.k, dm.v});
        Tensor dw3 = dwconv_backward_cl(m.qc, m.kc, m.vc, sv[3].to(torch::kFloat32).contiguous(), sv[6],
                                        grad.narrow(2, C, d).reshape({B, H, W, d}), kVit3InnerScale, dm.qc, dm.kc,
                                        dm.vc);
        return {dqkv.to(sv[0].scalar_type()), sum_to_weight(g[3], sv[1]), sum_to_weight(g[4], sv[2]),
                dw3.to(sv[3].scalar_type()), Tensor(), Tensor(), Tensor()};
    }
};

}  // namespace

void rope_2d_in_place(const Tensor& x, const Tensor& rotations) {
    const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3);
    float* base = x.data_ptr<float>();
    const float* table = rotations.data_ptr<float>();  // (H, W, C/2, 2): cos, sin per channel pair
    const int64_t sb = x.stride(0), sh = x.stride(1), sw = x.stride(2);
    at::parallel_for(0, B * H * W, 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const int64_t b = t / (H * W), yx = t % (H * W);
            float* p = base + b * sb + (yx / W) * sh + (yx % W) * sw;
            const float* cs = table + yx * C;
            // (a + ib)(c + is), as apply_rope_2d's complex product.
            for (int64_t i = 0; i < C; i += 2) {
                const float a = p[i], ib = p[i + 1], c = cs[i], sn = cs[i + 1];
                p[i] = a * c - ib * sn;
                p[i + 1] = a * sn + ib * c;
            }
        }
    });
}

// ---------------------------------------------------------------- Vit3TttInBands

void vit3_bands_accumulate_fused(const Tensor& kv, int64_t offset, int64_t rows, int64_t h, int64_t tokens,
                                 const Tensor& w1, const Tensor& w2, Tensor& g1, Tensor& g2, Tensor& g3) {
    const Tensor x = f32_rows(kv).contiguous();
    const int64_t B = x.size(0), W = x.size(2), ld = x.size(3), d = ld / (2 * (h + 1)), C = h * d, n = rows * W;
    float* band = x.data_ptr<float>() + offset * W * ld;
    const Heads K{band, x.stride(0), d, ld}, V{band + C, x.stride(0), d, ld};
    const SwigluDims s{B, h, n, d, (n + kTokenBlock - 1) / kTokenBlock, kVit3InnerScale, tokens};
    Tensor p1 = torch::empty_like(g1), p2 = torch::empty_like(g2), p3 = torch::empty_like(g3);
    const Kernels& kr = simd::inference_kernels(kv.scalar_type() == torch::kBFloat16);
    swiglu_gradients(kr, K, V, w1.to(torch::kFloat32).contiguous(), w2.to(torch::kFloat32).contiguous(), s,
                     p1.data_ptr<float>(), p2.data_ptr<float>());
    grid_reduce(x.narrow(3, 2 * C, d), x.narrow(3, 2 * C + d, d), GridTasks(B, rows, W, kTokenBlock), d,
                p3.data_ptr<float>(), offset);
    g1 += p1;
    g2 += p2;
    g3 += p3.mul_(-kVit3InnerScale / static_cast<double>(tokens));
    flops::add(4 * B * h * n * d * d + 9 * B * d * n);
}

std::vector<Tensor> vit3_bands_step_fused(const Tensor& w1, const Tensor& w2, const Tensor& w3, const Tensor& g1,
                                          const Tensor& g2, const Tensor& g3) {
    const int64_t B = g1.size(0), h = g1.size(1), d = g1.size(2);
    const SwigluDims s{B, h, 0, d, 0, kVit3InnerScale};
    Tensor w1n = torch::empty_like(g1), w2n = torch::empty_like(g2), taps = torch::empty_like(g3);
    std::vector<float> norms(B * h * d);
    swiglu_updated_weights(w1.to(torch::kFloat32).contiguous(), g1.data_ptr<float>(), s, w1n.data_ptr<float>(),
                           norms.data());
    swiglu_updated_weights(w2.to(torch::kFloat32).contiguous(), g2.data_ptr<float>(), s, w2n.data_ptr<float>(),
                           norms.data());
    dwconv_updated_taps(w3.to(torch::kFloat32).contiguous(), g3.data_ptr<float>(), B, d, taps.data_ptr<float>(),
                        norms.data());
    return {w1n, w2n, taps};
}

Tensor vit3_bands_apply_fused(const Tensor& q, int64_t offset, int64_t rows, int64_t h,
                              const std::vector<Tensor>& updated) {
    const Tensor x = f32_rows(q).contiguous();
    const int64_t B = x.size(0), R = x.size(1), W = x.size(2), ld = x.size(3), d = ld / (h + 1), C = h * d;
    const int64_t n = rows * W;
    // Output rows as q's, halo rows included (left unwritten), so that the stencil's rows line up with q's.
    Tensor out = torch::empty({B, R, W, ld}, torch::kFloat32);
    const Heads Q{x.data_ptr<float>() + offset * W * ld, x.stride(0), d, ld};
    const Heads O{out.data_ptr<float>() + offset * W * ld, out.stride(0), d, ld};
    const SwigluDims s{B, h, n, d, (n + kTokenBlock - 1) / kTokenBlock, kVit3InnerScale};
    swiglu_readout(simd::inference_kernels(q.scalar_type() == torch::kBFloat16), Q, updated[0].data_ptr<float>(),
                   updated[1].data_ptr<float>(), s, O);
    grid_apply(x.narrow(3, C, d), updated[2].data_ptr<float>(), false, out.narrow(3, C, d),
               GridTasks(B, rows, W, kTokenBlock), d, offset);
    flops::add(2 * B * h * n * d * d + 9 * B * d * n);
    return out.narrow(1, offset, rows).reshape({B, n, ld}).to(q.scalar_type());
}

Tensor vit3_swiglu_branch_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1, const Tensor& w2,
                                double scale) {
    if (records_graph({q, k, v, w1, w2})) return Vit3SwigluFunction::apply(q, k, v, w1, w2, scale);
    torch::NoGradGuard no_grad;
    Tensor w1f = w1.to(torch::kFloat32).contiguous(), w2f = w2.to(torch::kFloat32).contiguous();
    const Kernels& kr = simd::inference_kernels(q.scalar_type() == torch::kBFloat16);
    return swiglu_forward(f32_rows(q), f32_rows(k), f32_rows(v), w1f, w2f, scale, Tensor(), kr).out.to(q.scalar_type());
}

Tensor vit3_dwconv_branch_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w3, double scale) {
    if (records_graph({q, k, v, w3})) return Vit3DwconvFunction::apply(q, k, v, w3, scale);
    torch::NoGradGuard no_grad;
    return Vit3DwconvFunction::run_forward(q, k, v, w3, scale).first;
}

Tensor vit3_ttt_mix_fused(const Tensor& qkv, const Tensor& w1, const Tensor& w2, const Tensor& w3, int64_t num_heads,
                          int64_t height, int64_t width) {
    if (records_graph({qkv, w1, w2, w3})) return Vit3MixFunction::apply(qkv, w1, w2, w3, num_heads, height, width);
    torch::NoGradGuard no_grad;
    return Vit3MixFunction::run(qkv, w1, w2, w3, num_heads, height, width, nullptr, nullptr, nullptr);
}

}  // namespace linvis::ops::fused_detail
