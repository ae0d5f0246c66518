// GELU, the exact (erf) form, on a tensor the caller owns (the hidden layer of an MLP, fresh from its
// product). Reference: torch::gelu_ (torch::gelu where autograd records). Fused: one vectorised pass
// (AVX-512, AVX2 or portable; ops/simd) evaluating erf as torch's vectorised CPU erf does (Abramowitz
// and Stegun 7.1.26, |error| <= 1.5e-7), for contiguous float32 CPU tensors; in a graph its backward is
// LibTorch's gelu_backward. LibTorch 1.13 from Debian evaluates GELU with libm's scalar erff. docs/ops.md.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

// GELU(x): in place when autograd does not record x (the result is x), else a new tensor with a graph.
torch::Tensor gelu_(torch::Tensor x, Impl impl = Impl::Auto);

}  // namespace linvis::ops
