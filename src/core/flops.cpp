#include "linvis/core/flops.h"

#include "linvis/core/precision.h"

namespace linvis::flops {
namespace {
thread_local Counter* active_counter = nullptr;

// Runs `product` on float32 copies of reduced-precision CPU operands when LibTorch would otherwise
// accumulate in bf16/f16 (see linvis/core/precision.h), and rounds the result once to their dtype.
template <typename Product>
torch::Tensor accumulate_in_f32(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias,
                                Product&& product) {
    if (!precision::product_needs_f32(a)) return product(a, b, bias);
    const auto f32 = [](const torch::Tensor& t) { return t.defined() ? t.to(torch::kFloat32) : t; };
    return product(f32(a), f32(b), f32(bias)).to(a.scalar_type());
}
}  // namespace

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
    return accumulate_in_f32(x, weight, bias, [](const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& c) {
        return torch::nn::functional::linear(a, w, c);
    });
}

torch::Tensor matmul(const torch::Tensor& a, const torch::Tensor& b) {
    torch::Tensor out = accumulate_in_f32(a, b, {}, [](const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor&) {
        return torch::matmul(x, y);
    });
    if (counting()) {
        const int64_t inner = a.dim() == 1 ? a.size(0) : a.size(-1);
        add(out.numel() * inner);
    }
    return out;
}

torch::Tensor conv1d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     int64_t stride, int64_t padding, int64_t dilation, int64_t groups) {
    torch::Tensor out = accumulate_in_f32(x, weight, bias, [&](const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& c) {
        return torch::conv1d(a, w, c, stride, padding, dilation, groups);
    });
    if (counting()) add(out.numel() * weight.size(1) * weight.size(2));
    return out;
}

torch::Tensor conv2d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     torch::IntArrayRef stride, torch::IntArrayRef padding,
                     torch::IntArrayRef dilation, int64_t groups) {
    torch::Tensor out = accumulate_in_f32(x, weight, bias, [&](const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& c) {
        return torch::conv2d(a, w, c, stride, padding, dilation, groups);
    });
    if (counting()) add(out.numel() * weight.size(1) * weight.size(2) * weight.size(3));
    return out;
}

}  // namespace linvis::flops
