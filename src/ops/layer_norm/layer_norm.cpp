// linvis::ops::layer_norm (include/linvis/ops/layer_norm.h): the reference (torch::layer_norm), the fused
// kernel (ops/layer_norm/cpu.cpp) with its autograd node, and the choice.
#include "linvis/ops/layer_norm.h"

#include <string>

#include "ops/layer_norm/cpu.h"
#include "ops/records_graph.h"
#include "ops/simd/simd.h"

namespace linvis::ops {
namespace {

// In a graph: the fused kernel forward (saving the per-row mean and rstd), LibTorch's
// native_layer_norm_backward (the reference's own derivative) backward. Function::apply takes defined
// tensors only: an absent weight or bias is an empty placeholder, with has_weight / has_bias false.
class FusedLayerNorm : public torch::autograd::Function<FusedLayerNorm> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                 const torch::Tensor& weight_or_empty, const torch::Tensor& bias_or_empty,
                                 bool has_weight, bool has_bias, double eps) {
        const torch::Tensor weight = has_weight ? weight_or_empty : torch::Tensor();
        const torch::Tensor bias = has_bias ? bias_or_empty : torch::Tensor();
        cpu::LayerNormOut out = cpu::layer_norm_forward(x, weight, bias, eps);
        ctx->save_for_backward({x, out.mean, out.rstd, weight, bias});
        return out.y;
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::tensor_list grads) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor &x = saved[0], &mean = saved[1], &rstd = saved[2], &weight = saved[3], &bias = saved[4];
        const auto optional = [](const torch::Tensor& t) { return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt; };
        const std::array<bool, 3> mask{ctx->needs_input_grad(0), weight.defined() && ctx->needs_input_grad(1),
                                       bias.defined() && ctx->needs_input_grad(2)};
        auto [dx, dw, db] = torch::native_layer_norm_backward(grads[0], x, {x.size(-1)}, mean, rstd, optional(weight),
                                                              optional(bias), mask);
        return {dx, dw, db, torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
};

torch::Tensor fused_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                               double eps) {
    if (records_graph({x, weight, bias})) {
        const torch::Tensor empty = torch::empty({0}, x.options());
        return FusedLayerNorm::apply(x, weight.defined() ? weight : empty, bias.defined() ? bias : empty,
                                     weight.defined(), bias.defined(), eps);
    }
    return cpu::layer_norm_forward(x, weight, bias, eps).y;
}

}  // namespace

torch::Tensor layer_norm(const torch::Tensor& x, torch::IntArrayRef normalized_shape, const torch::Tensor& weight,
                         const torch::Tensor& bias, double eps, Impl impl) {
    // Auto: the vectorised targets (docs/ops.md); the portable target runs the reference.
    if (use_fused(impl, "layer_norm", cpu::layer_norm_unsupported(x, normalized_shape, weight, bias),
                  simd::vectorised()))
        return fused_layer_norm(x, weight, bias, eps);
    return torch::layer_norm(x, normalized_shape, weight, bias, eps);
}

}  // namespace linvis::ops
