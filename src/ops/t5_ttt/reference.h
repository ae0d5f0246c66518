// Reference T5 and DiT5 TTT attentions (internal; the public linvis::ops::t5_ttt_attention and dit5_ttt_attention
// check the inputs and choose between these and the fused CPU kernels).
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include "linvis/ops/t5_ttt.h"

namespace linvis::ops::reference {

torch::Tensor t5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const T5TttParams& params, int64_t num_heads, int64_t height, int64_t width);
torch::Tensor dit5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const Dit5TttParams& params, int64_t num_heads, int64_t height, int64_t width);

}  // namespace linvis::ops::reference
