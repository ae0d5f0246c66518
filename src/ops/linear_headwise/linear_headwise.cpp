// linvis::ops::linear_headwise: input checks, FLOP count and the choice between the reference and
// the fused CPU kernel (include/linvis/ops/linear_headwise.h).
#include "linvis/ops/linear_headwise.h"

#include <string>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/linear_headwise/cpu.h"
#include "ops/linear_headwise/reference.h"

namespace linvis::ops {

torch::Tensor linear_headwise(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                              Impl impl) {
    LINVIS_CHECK(weight.dim() == 3, "linear_headwise: weight: expected (heads, out, in), got shape ",
                 shape_string(weight.sizes()));
    const int64_t heads = weight.size(0), out = weight.size(1), in = weight.size(2);
    LINVIS_CHECK(x.dim() >= 1 && x.size(-1) == heads * in, "linear_headwise: x: expected last dim ", heads * in,
                 " (", heads, " heads x ", in, "), got shape ", shape_string(x.sizes()));
    LINVIS_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == heads * out),
                 "linear_headwise: bias: expected shape [", heads * out, "], got ", shape_string(bias.sizes()));
    flops::add(x.numel() * out);  // N H O I multiply-adds with N H I = numel
    const std::string unsupported =
        !x.device().is_cpu() || !weight.device().is_cpu() ? "CPU tensors only, got " + x.device().str()
        : !x.is_floating_point() || !weight.is_floating_point() ? std::string("floating-point tensors only")
                                                                : std::string();
    // The kernel has no ISA-specific code; it beats the einsum wherever it was measured (docs/ops.md).
    if (use_fused(impl, "linear_headwise", unsupported, /*fused_is_faster=*/true))
        return cpu::linear_headwise_fused(x, weight, bias);
    return reference::linear_headwise(x, weight, bias);
}

}  // namespace linvis::ops
