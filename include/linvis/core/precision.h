// Numerics of reduced-precision (bf16 / f16) tensors on the CPU.
//
// LibTorch before 2.1 accumulates bf16 and f16 CPU matrix products (matmul, linear, convolution
// through its GEMM) in the 16-bit type itself, rounding after every multiply-add, unless oneDNN
// takes the product - and LibTorch 1.13 hands bf16 to oneDNN only on CPUs with AVX-512 BW/VL/DQ
// (pytorch/pytorch issue 83863, fixed by pull request 96074 in 2.1). On an AVX2-only CPU a
// 200-term bf16 dot product then loses most of its bits, and results depend on the ISA. linvis
// keeps every reduced-precision product of its own ops in float32 accumulation: where LibTorch
// would not, the operands are widened to float32 and the result rounded once to the input dtype,
// which is what oneDNN computes.
#pragma once

#include <torch/torch.h>

namespace linvis::precision {

// True for bf16 / f16 tensors on the CPU.
bool is_reduced(const torch::Tensor& t);

// True when a matrix product or convolution of CPU tensors of t's dtype, run by LibTorch as is,
// would accumulate in less than float32 on this machine and this LibTorch.
bool product_needs_f32(const torch::Tensor& t);

// The dtype in which to accumulate and normalise values of t's dtype: float32 for bf16 / f16,
// t's own dtype otherwise.
torch::ScalarType accumulation_dtype(const torch::Tensor& t);

}  // namespace linvis::precision
