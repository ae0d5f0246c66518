// Global sequence mixers: softmax attention (the DeiT baseline) and linear attention.
//
// Layout: heads first, q (B, h, N, d), k (B, h, M, d), v (B, h, M, dv); outputs (B, h, N, dv).
// Reference implementations: plain LibTorch ops with autograd; float64, float32 and bfloat16.
// softmax_attention also has a fused flash-style CPU kernel (src/ops/attention/cpu.h: online softmax
// over key tiles, O((N + M) d) memory, FlashAttention-2 backward). Matrix products are counted by
// linvis::flops.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

// softmax((q k^T) * scale [masked]) @ v, per (batch, head), exactly as timm's DeiT Attention:
// the logits are q @ k^T first and then multiplied by `scale` (head_dim ** -0.5 in DeiT).
// `allowed` (optional) is a bool tensor broadcastable to (B, h, N, M); false entries get -inf
// before the softmax. Every query must keep at least one allowed key (checked). The fused kernel
// takes no mask: Impl::Auto then runs the reference, Impl::Fused is an error.
// Impl::Auto runs the fused kernel for CPU floating-point inputs without a mask (docs/ops.md);
// float64 stays float64, bfloat16 / float16 are computed in float32 and rounded once, except bfloat16
// inference on a CPU with AMX: its products run on the AMX tiles with bf16 operands (q * scale and the
// weights rounded to bf16, sums in float32; LINVIS_AMX=off keeps the float32 kernel; docs/ops.md).
// FLOPs: B*h*N*M*(d + dv) multiply-adds.
torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                double scale, const torch::Tensor& allowed = {},
                                Impl impl = Impl::Auto);

// Feature map phi applied to q and k by linear attention.
enum class FeatureMap {
    EluPlusOne,  // elu(x) + 1 > 0 (Katharopoulos et al. 2020; the T5 paper's linear-attention baseline)
    Relu,        // max(x, 0)
    Identity,    // x (only meaningful with normalize = false)
};

struct LinearAttentionOptions {
    FeatureMap feature_map = FeatureMap::EluPlusOne;
    bool causal = false;
    // true: Katharopoulos normalisation, out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps) with
    //   S_i = sum_j phi(k_j) v_j^T and z_i = sum_j phi(k_j) over j <= i (causal) or all j;
    // false: out_i = phi(q_i)^T S_i (no denominator).
    bool normalize = true;
    double eps = 1e-6;
    // Causal only: tokens per chunk. Inside a chunk a masked quadratic product, between chunks
    // a running d x dv state, so time is O(N (c + d) dv) and memory O(N d + (N/c) d dv).
    int64_t chunk_size = 64;
};

// Linear attention, non-causal in O(N d dv) or causal (chunked, see options). Same layout as
// softmax_attention (k and v must have the same token count M; causal needs M == N).
torch::Tensor linear_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const LinearAttentionOptions& options = {}, Impl impl = Impl::Auto);

// phi(x) for a feature map (exposed for tests and for callers that cache phi(k)).
torch::Tensor apply_feature_map(const torch::Tensor& x, FeatureMap map);

}  // namespace linvis::ops
