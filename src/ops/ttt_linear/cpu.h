// Fused CPU TTT-Linear (internal; the public entry is ops::ttt_linear with impl = Impl::Fused).
// Algorithm, memory and tolerances: docs/perf_ttt_linear.md.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/ttt_linear.h"

namespace linvis::ops::cpu {

// Runs the fused mini-batch scan for the ResidualLayerNorm inner model (causal or not; RoPE is
// applied beforehand with the reference ttt_rope; dual_form is ignored: dual and primal are the
// same function). Same arguments and result as ops::ttt_linear. With gradients enabled it is a
// torch::autograd::Function that saves the inputs and a (W, b) checkpoint every
// options.checkpoint_every mini-batches, and recomputes the rest in its backward. grad_norms
// are returned detached. The scan runs the SIMD target ops::fused_kernel_target() names
// (LINVIS_SIMD / LINVIS_FORCE_SCALAR lower it; ops/simd/simd.h).
TttLinearResult ttt_linear_fused(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                                 const torch::Tensor& lr, const torch::Tensor& tau, const torch::Tensor& w0,
                                 const torch::Tensor& b0, const torch::Tensor& ln_weight, const torch::Tensor& ln_bias,
                                 const TttLinearOptions& options);

}  // namespace linvis::ops::cpu
