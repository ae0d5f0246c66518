// Reference TTT-Linear scan (internal; public entry: linvis::ops::ttt_linear, which checks the inputs,
// applies RoPE and chooses between this and the fused CPU kernel).
#pragma once

#include <torch/torch.h>

#include "linvis/ops/ttt_linear.h"

namespace linvis::ops::reference {

// The mini-batch scan of spec 2.5-2.7 on checked inputs (RoPE already applied to xq and xk).
TttLinearResult ttt_linear_scan(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                                const torch::Tensor& lr, const torch::Tensor& learnable_token_idx,
                                const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& ln_weight,
                                const torch::Tensor& ln_bias, const TttLinearOptions& options);

}  // namespace linvis::ops::reference
