// Whether autograd records an op on these tensors: grad mode is on and one of them (undefined ones skipped)
// requires a gradient. The one test the fused kernels use to choose between their autograd node and a
// plain kernel call (internal to ops).
#pragma once

#include <initializer_list>

#include <torch/torch.h>

namespace linvis::ops {

inline bool records_graph(std::initializer_list<torch::Tensor> tensors) {
    if (!torch::GradMode::is_enabled()) return false;
    for (const torch::Tensor& t : tensors)
        if (t.defined() && t.requires_grad()) return true;
    return false;
}

}  // namespace linvis::ops
