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
// are returned detached. The AVX-512 kernels run when the CPU has them, unless force_scalar is
// set or the environment variable LINVIS_FORCE_SCALAR is 1 (the portable path).
TttLinearResult ttt_linear_fused(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                                 const torch::Tensor& lr, const torch::Tensor& tau, const torch::Tensor& w0,
                                 const torch::Tensor& b0, const torch::Tensor& ln_weight, const torch::Tensor& ln_bias,
                                 const TttLinearOptions& options, bool force_scalar = false);

// True when the fused kernels would take the AVX-512 path in this process.
bool ttt_linear_fused_uses_avx512();

}  // namespace linvis::ops::cpu
