// Reference head-wise linear (the official einsum) and the dispatch to the fused CPU kernel.
#include "linvis/ops/linear_headwise.h"

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "../cpu/linear_headwise_fused.h"

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
    if (impl == Impl::Fused) return cpu::linear_headwise_fused(x, weight, bias);

    std::vector<int64_t> split(x.sizes().begin(), x.sizes().end() - 1);
    std::vector<int64_t> merged = split;
    split.push_back(heads);
    split.push_back(in);
    merged.push_back(heads * out);
    torch::Tensor y = torch::einsum("...hd,hod->...ho", {x.reshape(split), weight}).reshape(merged);
    return bias.defined() ? y + bias : y;
}

}  // namespace linvis::ops
