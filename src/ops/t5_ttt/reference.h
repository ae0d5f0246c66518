// Reference T5 TTT attention (internal; the public linvis::ops::t5_ttt_attention checks the inputs and
// chooses between this and the fused CPU kernel).
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include "linvis/ops/t5_ttt.h"

namespace linvis::ops::reference {

torch::Tensor t5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const T5TttParams& params, int64_t num_heads, int64_t height, int64_t width);

}  // namespace linvis::ops::reference
