// Which implementation of an op runs. Every op has a Reference implementation written in plain
// LibTorch tensor ops with autograd: it defines what is correct and runs on every device (CUDA
// included). Some ops also have a fused CPU kernel, tested against the reference (forward and
// gradients) on every ISA path.
//
//   Impl::Auto       (the default everywhere) the fused kernel when it takes this input and is the
//                    faster path on this CPU (docs/ops.md says which, from measurements), else the
//                    reference.
//   Impl::Reference  always the reference.
//   Impl::Fused      the fused kernel; an input it cannot take (device, dtype, option) is an error
//                    naming the op and the reason - never a silent fallback.
#pragma once

#include <string>

namespace linvis::ops {

enum class Impl { Auto, Reference, Fused };

// "auto" | "reference" | "fused"; throws linvis::Error for anything else.
Impl parse_impl(const std::string& name);
const char* impl_name(Impl impl);

// The one dispatch rule. `unsupported` is empty when the fused kernel of `op` takes this input and
// otherwise says why not; `fused_is_faster` whether it is the faster path on this CPU. Returns true
// when the fused kernel should run; throws for Impl::Fused on an unsupported input.
bool use_fused(Impl impl, const char* op, const std::string& unsupported, bool fused_is_faster);

// The instruction set the fused kernels run in this process, for reports: "AVX-512", "AVX2" or
// "scalar" (portable code). The best this CPU supports unless LINVIS_SIMD=avx512|avx2|scalar asks for
// a lower one (LINVIS_FORCE_SCALAR=1 is an alias of scalar); read on every call, so tests can switch
// paths. docs/ops.md says how the kernels dispatch.
const char* fused_kernel_target();

// Where the fused kernels' bf16 matrix products run besides the SIMD code, for reports: "AMX tiles" (bf16 inference
// of the softmax attention and of the ViT3, T5 and DiT5 TTT mixers on a CPU with AMX, while the SIMD target is
// AVX-512), "AMX emulated"
// (LINVIS_AMX=emulate, for tests) or "off" (no AMX, or LINVIS_AMX=off). Read on every call, as the target is.
const char* fused_matrix_engine();

}  // namespace linvis::ops
