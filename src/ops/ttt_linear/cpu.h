// Fused CPU TTT-Linear (internal; the public entry is ops::ttt_linear with impl = Impl::Fused).
// Algorithm, memory and tolerances: docs/perf_ttt_linear.md.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/ttt_linear.h"

namespace linvis::ops::cpu {

// Runs the fused mini-batch scans (ops::ttt_linear_many; taus[i] = tau of scan i, from its
// learnable_token_idx) for the ResidualLayerNorm inner model (causal or not; RoPE is
// applied beforehand with the reference ttt_rope; dual_form is ignored: dual and primal are the
// same function). Without gradients all scans' tasks share one parallel region; with gradients
// enabled each scan is a torch::autograd::Function that saves the inputs and a (W, b) checkpoint every
// options.checkpoint_every mini-batches, and recomputes the rest in its backward. grad_norms
// are returned detached. A scan with qk_conv.u defined (no gradients, no RoPE: ops::ttt_linear_many decides)
// computes its queries and keys from u's rows as it loads each mini-batch. The scan runs the SIMD target
// ops::fused_kernel_target() names (LINVIS_SIMD / LINVIS_FORCE_SCALAR lower it; ops/simd/simd.h).
std::vector<TttLinearResult> ttt_linear_fused_many(const std::vector<TttLinearInputs>& scans,
                                                   const std::vector<torch::Tensor>& taus,
                                                   const TttLinearOptions& options);

}  // namespace linvis::ops::cpu
