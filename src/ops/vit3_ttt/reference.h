// Reference inner steps of the official ViT3 TTT op (internal; public entries in
// include/linvis/ops/vit3_ttt.h check the inputs and choose between these and the fused CPU kernels).
#pragma once

#include <torch/torch.h>

namespace linvis::ops {

// The shapes apply_rope_2d and apply_rope_2d_ take: x (B, H, W, C), rotations (H, W, C/2, 2); `op` names the caller
// in the error.
void check_rope_shapes(const torch::Tensor& x, const torch::Tensor& rotations, const char* op);

}  // namespace linvis::ops

namespace linvis::ops::reference {

torch::Tensor vit3_ttt_swiglu_branch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& w1, const torch::Tensor& w2, double scale);
torch::Tensor vit3_ttt_dwconv_branch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& w3, double scale);

}  // namespace linvis::ops::reference
