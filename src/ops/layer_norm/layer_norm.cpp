// linvis::ops::layer_norm (include/linvis/ops/layer_norm.h): the reference (torch::layer_norm), the fused
// kernel (ops/layer_norm/cpu.cpp) with its autograd node, and the choice.
#include "linvis/ops/layer_norm.h"

#include <algorithm>
#include <array>
#include <optional>
#include <string>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
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

// The gradients of DiT's adaLN, layer_norm(x) * (1 + scale[b]) + shift[b], for the gradient g of its output, from
// x, the saved per-row mean and rstd and scale: {dx, dshift, dscale}, each only where `need` asks for it. dscale
// needs the normalised x again: the fused kernel's own values, or LibTorch's differentiable LayerNorm under a
// backward that builds a graph.
std::array<torch::Tensor, 3> modulated_backward(const torch::Tensor& g, const torch::Tensor& x,
                                                const torch::Tensor& mean, const torch::Tensor& rstd,
                                                const torch::Tensor& scale, double eps, std::array<bool, 3> need) {
    const int64_t C = x.size(2);
    torch::Tensor dx, dshift, dscale;
    if (need[1]) dshift = g.sum(1);
    if (need[2]) {
        const torch::Tensor normed = torch::GradMode::is_enabled() ? torch::layer_norm(x, {C}, {}, {}, eps)
                                                                   : cpu::layer_norm_forward(x, {}, {}, eps).y;
        dscale = (g * normed).sum(1);
    }
    if (need[0])
        dx = std::get<0>(torch::native_layer_norm_backward(g * (1 + scale.unsqueeze(1)), x, {C}, mean, rstd,
                                                           c10::nullopt, c10::nullopt, {true, false, false}));
    return {dx, dshift, dscale};
}

// The LayerNorm of a normed-products node: one affine row shared by every row (a pre-norm block's LayerNorm,
// layer_norm_linear) or each sample's own (DiT's adaLN, modulated_layer_norm_linear).
enum class NormAffine : int64_t { Shared = 0, PerSample = 1 };

// The products of a LayerNorm's output as one node (layer_norm_linear, modulated_layer_norm_linear). Its inputs
// are one flat list: x, the LayerNorm's two affine tensors (Shared: weight and bias; PerSample: shift and scale),
// then each product's weight and bias, an absent one an empty placeholder (Function::apply takes defined tensors
// only; `present` says which are real). It keeps x, mean, rstd and the affine tensors, not the normalised x.
class NormedProducts : public torch::autograd::Function<NormedProducts> {
public:
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::TensorList tensors,
                                                  std::vector<int64_t> present, std::vector<int64_t> counted,
                                                  double eps, int64_t affine) {
        const auto real = [&](size_t i) { return present[i] != 0 ? tensors[i] : torch::Tensor(); };
        const torch::Tensor &x = tensors[0], first = real(1), second = real(2);
        cpu::LayerNormOut normed = normalise(x, first, second, eps, static_cast<NormAffine>(affine));
        torch::autograd::variable_list outputs;
        torch::autograd::variable_list saved{x, normed.mean, normed.rstd, first, second};
        for (size_t p = 0; p < counted.size(); ++p) {
            const size_t at = 3 + 2 * p;
            outputs.push_back(normed_product(normed.y, {tensors[at], real(at + 1), counted[p] != 0}));
            saved.push_back(tensors[at]);
        }
        ctx->save_for_backward(saved);
        ctx->saved_data["present"] = present;
        ctx->saved_data["eps"] = eps;
        ctx->saved_data["affine"] = affine;
        return outputs;
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor &x = saved[0], &mean = saved[1], &rstd = saved[2], &first = saved[3], &second = saved[4];
        const std::vector<int64_t> present = ctx->saved_data["present"].toIntVector();
        const double eps = ctx->saved_data["eps"].toDouble();
        const auto affine = static_cast<NormAffine>(ctx->saved_data["affine"].toInt());
        const size_t products = saved.size() - 5;
        const bool graph = torch::GradMode::is_enabled();
        const std::array<bool, 3> need{ctx->needs_input_grad(0), first.defined() && ctx->needs_input_grad(1),
                                       second.defined() && ctx->needs_input_grad(2)};
        const bool need_normed_grad = need[0] || need[1] || need[2];
        // The normalised x again: the fused kernel's own values (the forward's, bit for bit), or under a graph
        // LibTorch's ops, differentiable in x and the affine tensors.
        const torch::Tensor normed = graph ? normalise_differentiably(x, first, second, eps, affine)
                                           : normalise(x, first, second, eps, affine).y;
        torch::autograd::variable_list result(3 + 2 * products + 4);
        torch::Tensor d_normed;
        for (size_t p = 0; p < products; ++p) {
            const size_t at = 3 + 2 * p;
            if (!grads[p].defined()) continue;
            const bool need_bias = present[at + 1] != 0 && ctx->needs_input_grad(at + 1);
            flops::LinearGradients g = flops::linear_backward(
                grads[p], normed, saved[5 + p], {need_normed_grad, ctx->needs_input_grad(at), need_bias});
            result[at] = g.dweight;
            result[at + 1] = g.dbias;
            if (!g.dx.defined()) continue;
            if (!d_normed.defined())
                d_normed = g.dx;
            else
                d_normed = graph ? d_normed + g.dx : d_normed.add_(g.dx);
        }
        if (!need_normed_grad || !d_normed.defined()) return result;
        if (affine == NormAffine::PerSample) {
            std::array<torch::Tensor, 3> d = modulated_backward(d_normed, x, mean, rstd, second, eps, need);
            std::copy(d.begin(), d.end(), result.begin());
            return result;
        }
        const auto optional = [](const torch::Tensor& t) {
            return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
        };
        auto [dx, dw, db] = torch::native_layer_norm_backward(d_normed, x, {x.size(-1)}, mean, rstd, optional(first),
                                                              optional(second), need);
        result[0] = dx;
        result[1] = dw;
        result[2] = db;
        return result;
    }

private:
    // The fused kernel: Shared, first and second are the weight and bias; PerSample, the shift and scale.
    static cpu::LayerNormOut normalise(const torch::Tensor& x, const torch::Tensor& first,
                                       const torch::Tensor& second, double eps, NormAffine affine) {
        if (affine == NormAffine::Shared) return cpu::layer_norm_forward(x, first, second, eps);
        return cpu::layer_norm_per_sample_affine(x, (1 + second).contiguous(), first.contiguous(), eps);
    }
    static torch::Tensor normalise_differentiably(const torch::Tensor& x, const torch::Tensor& first,
                                                  const torch::Tensor& second, double eps, NormAffine affine) {
        if (affine == NormAffine::Shared) return torch::layer_norm(x, {x.size(-1)}, first, second, eps);
        return torch::layer_norm(x, {x.size(-1)}, {}, {}, eps) * (1 + second.unsqueeze(1)) + first.unsqueeze(1);
    }
};

// DiT's adaLN in a graph (modulated_layer_norm): the forward is the fused kernel with each sample's 1 + scale and
// shift as its affine row, saving x, the per-row mean and rstd and scale, not the normalised x; the backward is
// modulated_backward.
class ModulatedLayerNorm : public torch::autograd::Function<ModulatedLayerNorm> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                 const torch::Tensor& shift, const torch::Tensor& scale, double eps) {
        cpu::LayerNormOut out =
            cpu::layer_norm_per_sample_affine(x, (1 + scale).contiguous(), shift.contiguous(), eps);
        ctx->save_for_backward({x, out.mean, out.rstd, scale});
        ctx->saved_data["eps"] = eps;
        return out.y;
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        std::array<torch::Tensor, 3> d =
            modulated_backward(grads[0], saved[0], saved[1], saved[2], saved[3], ctx->saved_data["eps"].toDouble(),
                               {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)});
        return {d[0], d[1], d[2], torch::Tensor()};
    }
};

// The checks both modulated entry points make: x (B, N, C), shift and scale (B, C). Returns why the fused kernel
// does not take them (empty: it does).
std::string modulated_unsupported(const char* op, const torch::Tensor& x, const torch::Tensor& shift,
                                  const torch::Tensor& scale) {
    LINVIS_CHECK(x.dim() == 3, op, ": x: expected (B, N, C), got ", shape_string(x.sizes()));
    const int64_t B = x.size(0), C = x.size(2);
    std::string unsupported = cpu::layer_norm_unsupported(x, {C}, {}, {});
    const auto check_row_parameters = [&](const char* name, const torch::Tensor& t) {
        LINVIS_CHECK(t.defined() && t.dim() == 2 && t.size(0) == B && t.size(1) == C, op, ": ", name,
                     ": expected (", B, ", ", C, "), got ",
                     shape_or_undefined(t));
        if (unsupported.empty() && (!t.device().is_cpu() || t.scalar_type() != torch::kFloat32))
            unsupported = std::string(name) + " is " + c10::toString(t.scalar_type()) + " on " + t.device().str() +
                          ", the kernel takes float32 on the CPU";
    };
    check_row_parameters("shift", shift);
    check_row_parameters("scale", scale);
    return unsupported;
}

// Each product's checks (layer_norm_linear's and modulated_layer_norm_linear's), and whether any records a graph.
bool check_products(const char* op, int64_t C, const std::vector<NormedProduct>& products) {
    bool graph = false;
    for (size_t p = 0; p < products.size(); ++p) {
        const NormedProduct& product = products[p];
        LINVIS_CHECK(product.weight.defined() && product.weight.dim() == 2 && product.weight.size(1) == C, op,
                     ": product ", p, ": weight: expected (N, ", C, "), got ",
                     shape_or_undefined(product.weight));
        LINVIS_CHECK(!product.bias.defined() ||
                         (product.bias.dim() == 1 && product.bias.size(0) == product.weight.size(0)),
                     op, ": product ", p, ": bias: expected (", product.weight.size(0), "), got ",
                     shape_string(product.bias.sizes()));
        graph = graph || records_graph({product.weight, product.bias});
    }
    return graph;
}

// The products of a normalised tensor, each as flops::linear.
std::vector<torch::Tensor> products_of(const torch::Tensor& normed, const std::vector<NormedProduct>& products) {
    std::vector<torch::Tensor> out;
    for (const NormedProduct& product : products) out.push_back(normed_product(normed, product));
    return out;
}

// NormedProducts::apply over x, the two affine tensors and the products.
std::vector<torch::Tensor> apply_normed_products(const torch::Tensor& x, const torch::Tensor& first,
                                                 const torch::Tensor& second, double eps,
                                                 const std::vector<NormedProduct>& products, NormAffine affine) {
    const torch::Tensor empty = torch::empty({0}, x.options());
    std::vector<torch::Tensor> tensors{x, first.defined() ? first : empty, second.defined() ? second : empty};
    std::vector<int64_t> present{1, first.defined(), second.defined()}, counted;
    for (const NormedProduct& product : products) {
        tensors.push_back(product.weight);
        tensors.push_back(product.bias.defined() ? product.bias : empty);
        present.push_back(1);
        present.push_back(product.bias.defined());
        counted.push_back(product.counted);
    }
    return NormedProducts::apply(torch::TensorList(tensors), present, counted, eps, static_cast<int64_t>(affine));
}

}  // namespace

torch::Tensor normed_product(const torch::Tensor& x, const NormedProduct& product) {
    std::optional<flops::Uncounted> uncounted;
    if (!product.counted) uncounted.emplace();
    return flops::linear(x, product.weight, product.bias);
}

std::vector<torch::Tensor> layer_norm_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias, double eps,
                                             const std::vector<NormedProduct>& products, Impl impl) {
    LINVIS_CHECK(x.dim() >= 1, "layer_norm_linear: x: expected at least one dimension, got a scalar");
    const int64_t C = x.size(-1);
    const bool graph = check_products("layer_norm_linear", C, products) || records_graph({x, weight, bias});
    if (!graph || !use_fused(impl, "layer_norm_linear", cpu::layer_norm_unsupported(x, {C}, weight, bias),
                             simd::vectorised()))
        return products_of(layer_norm(x, {C}, weight, bias, eps, impl), products);
    return apply_normed_products(x, weight, bias, eps, products, NormAffine::Shared);
}

std::vector<torch::Tensor> modulated_layer_norm_linear(const torch::Tensor& x, const torch::Tensor& shift,
                                                       const torch::Tensor& scale, double eps,
                                                       const std::vector<NormedProduct>& products, Impl impl) {
    const std::string unsupported = modulated_unsupported("modulated_layer_norm_linear", x, shift, scale);
    const bool graph =
        check_products("modulated_layer_norm_linear", x.size(2), products) || records_graph({x, shift, scale});
    if (!graph || !use_fused(impl, "modulated_layer_norm_linear", unsupported, simd::vectorised()))
        return products_of(modulated_layer_norm(x, shift, scale, eps, impl), products);
    return apply_normed_products(x, shift, scale, eps, products, NormAffine::PerSample);
}

torch::Tensor layer_norm(const torch::Tensor& x, torch::IntArrayRef normalized_shape, const torch::Tensor& weight,
                         const torch::Tensor& bias, double eps, Impl impl) {
    // Auto: the vectorised targets (docs/ops.md); the portable target runs the reference.
    if (use_fused(impl, "layer_norm", cpu::layer_norm_unsupported(x, normalized_shape, weight, bias),
                  simd::vectorised()))
        return fused_layer_norm(x, weight, bias, eps);
    return torch::layer_norm(x, normalized_shape, weight, bias, eps);
}

torch::Tensor modulated_layer_norm(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                                   double eps, Impl impl) {
    const std::string unsupported = modulated_unsupported("modulated_layer_norm", x, shift, scale);
    if (!use_fused(impl, "modulated_layer_norm", unsupported, simd::vectorised()))
        return torch::layer_norm(x, {x.size(2)}, {}, {}, eps) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
    if (records_graph({x, shift, scale})) return ModulatedLayerNorm::apply(x, shift, scale, eps);
    return cpu::layer_norm_per_sample_affine(x, (1 + scale).contiguous(), shift.contiguous(), eps).y;
}

}  // namespace linvis::ops
