// linvis::ops::softmax_attention: input checks, FLOP count and the choice between the reference and the
// fused (flash-style) CPU kernel (include/linvis/ops/attention.h). linear_attention has no fused kernel;
// its entry point is in reference.cpp.
#include "linvis/ops/attention.h"

#include <string>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/attention/checks.h"
#include "ops/attention/cpu.h"
#include "ops/attention/reference.h"

namespace linvis::ops {

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                double scale, const torch::Tensor& allowed, Impl impl) {
    const char* op = "softmax_attention";
    check_qkv(op, q, k, v);
    const std::string unsupported =
        !q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu() ? "CPU tensors only, got " + q.device().str()
        : !q.is_floating_point()                                             ? std::string("floating-point tensors only")
        : allowed.defined() ? std::string("mask 'allowed' is not supported by the fused kernel")
        : k.size(2) == 0    ? std::string("at least one key is needed")
                            : std::string();
    // Faster than the reference at every size measured (deit_tiny 224 to 1024 px, inference and training;
    // docs/ops.md), and it never materialises the (B, h, N, M) weights.
    if (use_fused(impl, op, unsupported, /*fused_is_faster=*/true)) {
        flops::add(q.size(0) * q.size(1) * q.size(2) * k.size(2) * (q.size(3) + v.size(3)));
        return cpu::softmax_attention_fused(q, k, v, scale);
    }
    return reference::softmax_attention(q, k, v, scale, allowed);
}

}  // namespace linvis::ops
