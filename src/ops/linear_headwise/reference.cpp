// Reference head-wise linear: the official einsum.
#include "ops/linear_headwise/reference.h"

#include <vector>

namespace linvis::ops::reference {

torch::Tensor linear_headwise(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    const int64_t heads = weight.size(0), out = weight.size(1), in = weight.size(2);
    std::vector<int64_t> split(x.sizes().begin(), x.sizes().end() - 1);
    std::vector<int64_t> merged = split;
    split.push_back(heads);
    split.push_back(in);
    merged.push_back(heads * out);
    torch::Tensor y = torch::einsum("...hd,hod->...ho", {x.reshape(split), weight}).reshape(merged);
    return bias.defined() ? y + bias : y;
}

}  // namespace linvis::ops::reference
