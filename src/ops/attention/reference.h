// Reference softmax attention (internal; public entry: linvis::ops::softmax_attention, which chooses
// between this and the fused CPU kernel of src/ops/attention/cpu.h). Inputs are checked by the caller.
#pragma once

#include <torch/torch.h>

namespace linvis::ops::reference {

// (q @ k^T) * scale, masked with `allowed` (optional), softmax over keys, @ v: plain LibTorch ops with
// autograd, materialising the (B, h, N, M) weights. bf16 / f16 computed in float32.
torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                double scale, const torch::Tensor& allowed);

}  // namespace linvis::ops::reference
