#include "linvis/core/flops.h"

namespace linvis::flops {
namespace {
thread_local Counter* active_counter = nullptr;
}

Counter::Counter() : parent_(active_counter) { active_counter = this; }

Counter::~Counter() {
    active_counter = parent_;
    if (parent_ != nullptr) parent_->macs_ += macs_;
}

void add(int64_t macs) {
    if (active_counter != nullptr) active_counter->macs_ += macs;
}

bool counting() { return active_counter != nullptr; }

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    if (counting()) add(x.numel() / x.size(-1) * weight.size(0) * weight.size(1));
    return torch::nn::functional::linear(x, weight, bias);
}

torch::Tensor matmul(const torch::Tensor& a, const torch::Tensor& b) {
    torch::Tensor out = torch::matmul(a, b);
    if (counting()) {
        const int64_t inner = a.dim() == 1 ? a.size(0) : a.size(-1);
        add(out.numel() * inner);
    }
    return out;
}

torch::Tensor conv1d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     int64_t stride, int64_t padding, int64_t dilation, int64_t groups) {
    torch::Tensor out = torch::conv1d(x, weight, bias, stride, padding, dilation, groups);
    if (counting()) add(out.numel() * weight.size(1) * weight.size(2));
    return out;
}

torch::Tensor conv2d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     torch::IntArrayRef stride, torch::IntArrayRef padding,
                     torch::IntArrayRef dilation, int64_t groups) {
    torch::Tensor out = torch::conv2d(x, weight, bias, stride, padding, dilation, groups);
    if (counting()) add(out.numel() * weight.size(1) * weight.size(2) * weight.size(3));
    return out;
}

}  // namespace linvis::flops
