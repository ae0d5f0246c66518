// Fused CPU head-wise linear (internal). Public entry point: linvis::ops::linear_headwise with
// Impl::Fused (include/linvis/ops/linear_headwise.h).
#pragma once

#include <torch/torch.h>

namespace linvis::ops::cpu {

// y[n, h, o] = bias[h O + o] + sum_i x[n, h, i] weight[h, o, i] over the rows n of x viewed as
// (N, H * I); autograd-capable (saves x and weight). Shapes are checked by the caller.
torch::Tensor linear_headwise_fused(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

}  // namespace linvis::ops::cpu
