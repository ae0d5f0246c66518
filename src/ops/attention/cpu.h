// Fused CPU softmax attention (internal). Public entry point: linvis::ops::softmax_attention with
// Impl::Fused / Impl::Auto (include/linvis/ops/attention.h).
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace linvis::ops::cpu {

// Flash-style softmax((q k^T) * scale) v for q (B, h, N, d), k (B, h, M, d), v (B, h, M, dv) on the CPU,
// M >= 1, no mask; float32 and float64 computed in their own type, bfloat16 / float16 in float32 (the
// output keeps the input dtype), except bfloat16 without a graph to build where simd::amx_mode() is not Off:
// then the products run on the AMX tiles (forward_bf16_tiles in cpu.cpp). Shapes are checked by the caller.
//
// Forward: per (sample*head, block of queries) an online softmax over blocks of keys - the running row
// maximum m and normaliser l, the output accumulator rescaled by exp(m_old - m_new) - so the (N, M)
// weights never exist; memory is the output plus a few (queries x keys) tiles per thread. q, k, v are read
// in place (any strides with a unit stride along the last dim; other dtypes are converted to float32). It
// keeps the per-row logsumexp (B*h*N numbers) for the backward.
// Backward (FlashAttention-2): D = rowsum(dO * O); per (sample*head), for each key block and each query
// block, S and P = exp(S - logsumexp) are recomputed and dV += P^T dO, dS = P * (dO V^T - D),
// dK += scale dS^T Q, dQ += scale dS K. Tasks are (sample*head, key segment), the segments of equal length
// and their count set by the shapes (at least 12 tasks when there are enough keys); each segment's dQ part
// has its own (N, d) buffer and the parts are summed in order, so the gradients do not depend on the
// thread count.
// The tile products are the SIMD layer's register-blocked GEMM (ops/simd), see cpu.cpp.
torch::Tensor softmax_attention_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      double scale);

}  // namespace linvis::ops::cpu
