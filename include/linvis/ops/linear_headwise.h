// Block-diagonal ("head-wise") linear map of ViL's LinearHeadwiseExpand (spec vil_official.md 1.6
// step 6): the last dimension of x is split into H heads of I features, and head h is mapped by its
// own O x I matrix. x (..., H * I), weight (H, O, I) in the official (head, out, in) layout,
// bias (H * O) or undefined -> (..., H * O).
//
// Impl::Reference is the official einsum "...hd,hod->...ho" plus bias. Impl::Fused is a CPU kernel
// with its own backward: ViL's blocks are 4 x 4, where the einsum becomes a batched GEMM of H tiny
// products plus two layout copies each way, which cost more than the arithmetic (docs/perf_mlstm.md).
// float32 / float64 compute in their own dtype; bfloat16 / float16 in float32, output in x's dtype.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

torch::Tensor linear_headwise(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                              Impl impl = Impl::Auto);

}  // namespace linvis::ops
