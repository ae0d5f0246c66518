// Reference 2-D neighbourhood attention (internal; public entry: linvis::ops::neighborhood_attention_2d).
// Inputs are checked by the caller.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/neighborhood_attention.h"

namespace linvis::ops::reference {

// na2d_av(softmax(na2d_qk(q * scale, k)), v) with plain LibTorch ops (gathers of the neighbours).
torch::Tensor neighborhood_attention_2d(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        int64_t kernel_size, double scale, NatSmallGrid small_grid);

}  // namespace linvis::ops::reference
