// Elementwise activations on tensors the caller owns (an MLP's hidden layer, fresh from its product):
//   gelu_      GELU, the exact (erf) form or the tanh form;
//   silu_mul_  silu(gate) * up, SwiGLU's hidden layer.
// Reference: LibTorch (torch::gelu_ / torch::silu and mul; out of place where autograd records an operand).
// Fused: one vectorised pass of the SIMD layer (AVX-512, AVX2 or portable; ops/simd) over contiguous float32
// or bfloat16 CPU tensors (operands of one dtype), parallel over blocks of elements; bfloat16 is widened a chunk
// at a time, computed as float32 and rounded once (the float32 pass's result, rounded, bit for bit); erf as
// torch's vectorised CPU erf evaluates it (Abramowitz-Stegun 7.1.26, |error| <= 1.5e-7), tanh with Highway's,
// exp with the SIMD layer's own (about 2 ulp). In a graph the backward is LibTorch's (gelu_backward,
// silu_backward). Against Debian's LibTorch 1.13 the tanh form is 3.2-3.7x and silu * up 1.3-1.5x faster at every
// size. The erf form: on AVX2 Auto takes the pass at every size (faster than LibTorch's from 2^16 elements up,
// 4-5x in bfloat16); on AVX-512, where LibTorch's erf form is vectorised and was as fast, only up to 2^18 elements,
// where the pass splits better over the threads (float32 and bfloat16 alike). docs/ops.md.
#pragma once

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

enum class GeluForm { Erf, Tanh };

// GELU(x): in place when autograd does not record x (the result is x), else a new tensor with a graph.
torch::Tensor gelu_(torch::Tensor x, Impl impl = Impl::Auto, GeluForm form = GeluForm::Erf);

// silu(gate) * up (same shape): into gate when autograd records neither operand, else a new tensor with a
// graph.
torch::Tensor silu_mul_(torch::Tensor gate, const torch::Tensor& up, Impl impl = Impl::Auto);

// An MLP's activation and its output layer as one op: flops::linear(GELU(h), weight, bias), h being the hidden
// layer before its activation. In a graph (Auto, Fused) one autograd node keeps h and the weight but not GELU(h),
// and its backward computes GELU(h) again for the weight's gradient: one elementwise pass, against a hidden-size
// tensor held for the whole forward (4 of the 17 token-width tensors a ViT-T block keeps for backward).
// Reference: gelu then linear as LibTorch records them (both kept). Outside a graph: gelu_ into h, then the
// product. The activation pass follows gelu_'s rule under `impl`.
torch::Tensor gelu_linear(torch::Tensor h, const torch::Tensor& weight, const torch::Tensor& bias, GeluForm form,
                          Impl impl = Impl::Auto);

enum class GateActivation { Silu, GeluTanh };

// flops::linear(act(gate) * value, weight, bias): SwiGLU's output layer (Silu, value = up), ViL's (Silu) and
// Vittt's gated mixer output (GeluTanh), likewise: in a graph the node keeps gate, value and the weight, not
// act(gate) nor the product. Outside a graph: silu_mul_ into gate (Silu), or gelu_ into gate times value.
torch::Tensor gated_linear(torch::Tensor gate, const torch::Tensor& value, const torch::Tensor& weight,
                           const torch::Tensor& bias, GateActivation act, Impl impl = Impl::Auto);

}  // namespace linvis::ops
