// Fused CPU chunkwise mLSTM (internal). The public entry point is linvis::ops::mlstm_chunkwise /
// linvis::ops::mlstm with Impl::Fused (include/linvis/ops/mlstm.h); docs/perf_mlstm.md describes
// the algorithm, what is stored and recomputed, and the numbers.
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include "linvis/ops/mlstm.h"

namespace linvis::ops::cpu {

// Same function as mlstm_chunkwise (reference, spec 4.3 with m0 = -inf) for q, k (B, NH, S, DHQK),
// v (B, NH, S, DHV), gates (B, NH, S, 1) or (B, NH, S). Autograd-capable (a custom
// torch::autograd::Function that saves only its inputs and recomputes the chunk states in
// backward). float32 / float64 compute in their own dtype, bfloat16 / float16 in float32.
// The inner products are the SIMD layer's GEMM (ops/simd/simd.h) for the target
// ops::fused_kernel_target() names (LINVIS_SIMD / LINVIS_FORCE_SCALAR lower it).
// q, k, v and the gates are read through their strides (a copy only for a dtype conversion or a non-unit
// stride along D); h is written token-major. With out_norm: mlstm_output_norm(h, *out_norm), applied to
// each row as it is written when autograd records nothing, by LibTorch ops after the kernel otherwise.
torch::Tensor mlstm_chunkwise_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                                    int64_t chunk_size, double eps, const MlstmOutputNorm* out_norm = nullptr);

// Rate (GFLOP/s, 2 per multiply-add) of this kernel's own small products on the chunk shapes of
// the forward (L x L x DHQK, L x DHQK x DHV, L x L x DHV, DHQK x L x DHV), on the calling thread,
// measured for about `seconds`. For the benchmark's GEMM-rate comparison.
double mlstm_fused_gemm_gflops(int64_t L, int64_t DH, int64_t DV, double seconds = 0.5);

}  // namespace linvis::ops::cpu
