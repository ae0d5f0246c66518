// Which implementation of an op runs. Every op has a Reference implementation written
// in plain LibTorch tensor ops with autograd: it defines what is correct. Fused CPU
// (and CUDA) implementations are selected with Impl::Fused and are tested against it.
#pragma once

#include <string>

namespace linvis::ops {

enum class Impl { Reference, Fused };

// "reference" | "fused"; throws linvis::Error for anything else.
Impl parse_impl(const std::string& name);
const char* impl_name(Impl impl);

}  // namespace linvis::ops
