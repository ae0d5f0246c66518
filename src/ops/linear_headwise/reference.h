// Reference head-wise linear (internal; public entry: linvis::ops::linear_headwise). Inputs are checked
// by the caller.
#pragma once

#include <torch/torch.h>

namespace linvis::ops::reference {

// The official einsum "...hd,hod->...ho" plus bias.
torch::Tensor linear_headwise(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

}  // namespace linvis::ops::reference
