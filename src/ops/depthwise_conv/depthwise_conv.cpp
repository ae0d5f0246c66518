// linvis::ops depthwise convolutions on tokens: input checks, FLOP count and the choice between the
// reference and the fused CPU kernel (include/linvis/ops/depthwise_conv.h).
#include "linvis/ops/depthwise_conv.h"

#include <string>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/depthwise_conv/cpu.h"
#include "ops/depthwise_conv/reference.h"
#include "ops/records_graph.h"
#include "ops/simd/simd.h"

namespace linvis::ops {
namespace {

void check_bias(const char* op, const torch::Tensor& bias, int64_t C) {
    LINVIS_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == C), op, ": bias: expected shape [", C,
                 "], got ", shape_string(bias.sizes()));
}

// Auto: float32 and bfloat16 with the vectorised code paths, measured faster than the reference (LibTorch's
// depthwise convolution on a (B, C, H, W) / (B, C, T) view plus the layout copies, and in bfloat16 LibTorch's
// SiLU; docs/ops.md). float64 runs the reference under Auto (the kernel takes it under Fused).
bool fused_is_faster(const torch::Tensor& x) {
    return (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) && simd::vectorised();
}

}  // namespace

torch::Tensor depthwise_conv2d_tokens(const torch::Tensor& x, int64_t height, int64_t width,
                                      const torch::Tensor& weight, const torch::Tensor& bias, DwEpilogue epilogue,
                                      Impl impl) {
    constexpr const char* op = "depthwise_conv2d_tokens";
    LINVIS_CHECK(height >= 1 && width >= 1, op, ": grid: expected height, width >= 1, got ", height, "x", width);
    LINVIS_CHECK(x.dim() == 3 && x.size(1) == height * width, op, ": x: expected (B, ", height * width, ", C) for a ",
                 height, "x", width, " grid, got ", shape_string(x.sizes()));
    const int64_t C = x.size(2);
    LINVIS_CHECK(weight.dim() == 4 && weight.size(0) == C && weight.size(1) == 1 && weight.size(2) == 3 &&
                     weight.size(3) == 3,
                 op, ": weight: expected (", C, ", 1, 3, 3), got ", shape_string(weight.sizes()));
    check_bias(op, bias, C);
    const std::string unsupported = cpu::depthwise_conv_unsupported(x, weight, bias);
    if (use_fused(impl, op, unsupported, fused_is_faster(x))) {
        if (flops::counting()) flops::add(x.size(0) * height * width * C * 9);
        return cpu::depthwise_conv2d_tokens_fused(x, height, width, weight, bias, epilogue);
    }
    return reference::depthwise_conv2d_tokens(x, height, width, weight, bias, epilogue);  // counts in flops::conv2d
}

namespace {

// The checks and FLOPs of both causal forms; true when the fused path runs.
bool causal_uses_fused(const char* op, const torch::Tensor& x, const torch::Tensor& weight,
                       const torch::Tensor& bias, Impl impl) {
    LINVIS_CHECK(x.dim() == 3, op, ": x: expected (B, T, C), got ", shape_string(x.sizes()));
    const int64_t C = x.size(2);
    LINVIS_CHECK(weight.dim() == 3 && weight.size(0) == C && weight.size(1) == 1 && weight.size(2) >= 1, op,
                 ": weight: expected (", C, ", 1, k) with k >= 1, got ", shape_string(weight.sizes()));
    check_bias(op, bias, C);
    if (flops::counting()) flops::add(x.size(0) * x.size(1) * C * weight.size(2));  // the T kept outputs
    return use_fused(impl, op, cpu::depthwise_conv_unsupported(x, weight, bias), fused_is_faster(x));
}

}  // namespace

torch::Tensor causal_depthwise_conv1d_tokens(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias, Impl impl) {
    if (causal_uses_fused("causal_depthwise_conv1d_tokens", x, weight, bias, impl))
        return cpu::causal_depthwise_conv1d_tokens_fused(x, weight, bias);
    return reference::causal_depthwise_conv1d_tokens(x, weight, bias);
}

torch::Tensor causal_depthwise_conv1d_heads(const torch::Tensor& x, const torch::Tensor& weight,
                                            const torch::Tensor& bias, int64_t heads, Impl impl) {
    constexpr const char* op = "causal_depthwise_conv1d_heads";
    const bool fused = causal_uses_fused(op, x, weight, bias, impl);  // checks x, weight and bias first
    LINVIS_CHECK(heads >= 1 && x.size(2) % heads == 0, op, ": heads: expected a positive divisor of the channels of x ",
                 shape_string(x.sizes()), ", got ", heads);
    // Head-major only outside a graph; otherwise the token form's autograd, its result viewed in heads.
    if (fused && !records_graph({x, weight, bias}))
        return cpu::causal_depthwise_conv1d_heads_fused(x, weight, bias, heads);
    const torch::Tensor out = fused ? cpu::causal_depthwise_conv1d_tokens_fused(x, weight, bias)
                                    : reference::causal_depthwise_conv1d_tokens(x, weight, bias);
    return out.view({out.size(0), out.size(1), heads, out.size(2) / heads}).permute({0, 2, 1, 3});
}

}  // namespace linvis::ops
