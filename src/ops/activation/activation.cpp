// linvis::ops::gelu_ / silu_mul_ (include/linvis/ops/activation.h): the references (LibTorch) and the fused
// passes (the SIMD layer's gelu_erf, gelu_tanh and silu_mul, parallel over blocks of elements) side by side,
// and the choice between them.
#include "linvis/ops/activation.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <string>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/records_graph.h"
#include "ops/simd/simd.h"

namespace linvis::ops {
namespace {

const char* gelu_approximate(GeluForm form) { return form == GeluForm::Tanh ? "tanh" : "none"; }

// Empty when the fused passes take t, else why not.
std::string unsupported(const char* name, const torch::Tensor& t) {
    if (!t.device().is_cpu()) return std::string(name) + " is on " + t.device().str() + ", the kernel is CPU only";
    if (t.scalar_type() != torch::kFloat32 && t.scalar_type() != torch::kBFloat16)
        return std::string(name) + " is " + c10::toString(t.scalar_type()) + ", the kernel takes float32 or bfloat16";
    if (!t.is_contiguous()) return std::string(name) + " is not contiguous";
    return "";
}

// Empty when the fused passes take both operands (each supported, one dtype), else why not.
std::string unsupported_pair(const char* name_a, const torch::Tensor& a, const char* name_b, const torch::Tensor& b) {
    std::string why = unsupported(name_a, a);
    if (why.empty()) why = unsupported(name_b, b);
    if (why.empty() && a.scalar_type() != b.scalar_type())
        why = std::string(name_a) + " is " + c10::toString(a.scalar_type()) + " and " + name_b + " " +
              c10::toString(b.scalar_type()) + ", the kernel takes one dtype";
    return why;
}

// Auto: the vectorised targets; the portable target runs the reference. The tanh form (3.2-3.7x; bf16 6.7-7.4x)
// and silu * up (1.3-1.5x; bf16 2.9-3.1x) win at every size measured. The erf form depends on the target:
// - AVX-512 (Xeon, 2 threads, with Highway's Exp before exp_clamped): LibTorch's GELU is vectorised; the pass won
//   up to a few hundred thousand elements ((196, 768): 61 against 110 us) and was 5-10 % slower beyond ((4096,
//   768): 1.52 against 1.45 ms); bf16 the same (a tie at (196, 768), the pass 0.78-0.94x from (1024, 768) up).
// - AVX2 (Zen 3 EPYC, 2 threads): the pass wins at every size from 2^16 to 12.6 M elements, float32 0.51-0.55
//   ns per element against LibTorch's 0.58-0.82, and bf16 0.66-0.73 against 3.4-3.6 (LibTorch's bf16 GELU is
//   4-5x slower than its float32 one there). docs/results/simd_exp_ab_2026-11-28.txt.
constexpr int64_t kGeluErfFusedMaxElementsAvx512 = int64_t{1} << 18;

bool fused_is_faster(GeluForm form, int64_t numel) {
    const simd::Target target = simd::active_target();
    if (target == simd::Target::Scalar) return false;
    return form == GeluForm::Tanh || target == simd::Target::Avx2 || numel <= kGeluErfFusedMaxElementsAvx512;
}
bool silu_mul_fused_is_faster() { return simd::vectorised(); }

// Blocks of 16 Ki elements: a 2-core split of a (196, 768) hidden layer, and no task shorter than a few
// microseconds.
constexpr int64_t kGrain = int64_t{1} << 14;

// y[0, n) = pass(x, z) with the kernels' elementwise signature, on float32 as it is and on bfloat16 through
// float32 chunks (simd::bf16_through_float: the same float32 operations, one rounding at the end). The
// arrays are offset views of contiguous tensors of the one dtype; z may be null.
template <typename Pass>
void elementwise(const simd::Kernels& k, const torch::Tensor& x, const void* z, const torch::Tensor& y,
                 int64_t offset, int64_t z_offset, int64_t n, Pass pass) {
    if (x.scalar_type() == torch::kBFloat16) {
        auto bits = [](const void* p) { return static_cast<const uint16_t*>(p); };
        simd::bf16_through_float(k, bits(x.data_ptr()) + offset, z ? bits(z) + z_offset : nullptr,
                                 static_cast<uint16_t*>(y.data_ptr()) + offset, n, pass);
        return;
    }
    pass(x.data_ptr<float>() + offset, z ? static_cast<const float*>(z) + z_offset : nullptr,
         y.data_ptr<float>() + offset, n);
}

// out = GELU(x) over contiguous float32 or bfloat16 (out may be x).
void gelu_pass(const torch::Tensor& x, const torch::Tensor& out, GeluForm form) {
    const simd::Kernels& k = simd::kernels();
    const auto pass = form == GeluForm::Tanh ? k.gelu_tanh : k.gelu_erf;
    at::parallel_for(0, x.numel(), kGrain,
                     [&](int64_t b, int64_t e) { elementwise(k, x, nullptr, out, b, 0, e - b, pass); });
}

// out = silu(gate) * up over contiguous float32 or bfloat16 (out may be gate or up).
void silu_mul_pass(const torch::Tensor& gate, const torch::Tensor& up, const torch::Tensor& out) {
    const simd::Kernels& k = simd::kernels();
    at::parallel_for(0, gate.numel(), kGrain,
                     [&](int64_t b, int64_t e) { elementwise(k, gate, up.data_ptr(), out, b, b, e - b, k.silu_mul); });
}

// In a graph: the fused pass forward, LibTorch's derivative backward.
class FusedGelu : public torch::autograd::Function<FusedGelu> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, bool tanh_form) {
        ctx->save_for_backward({x});
        ctx->saved_data["tanh"] = tanh_form;
        torch::Tensor y = torch::empty_like(x);
        gelu_pass(x, y, tanh_form ? GeluForm::Tanh : GeluForm::Erf);
        return y;
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::tensor_list grads) {
        const GeluForm form = ctx->saved_data["tanh"].toBool() ? GeluForm::Tanh : GeluForm::Erf;
        return {torch::gelu_backward(grads[0], ctx->get_saved_variables()[0], gelu_approximate(form)), {}};
    }
};

class FusedSiluMul : public torch::autograd::Function<FusedSiluMul> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate,
                                 const torch::Tensor& up) {
        ctx->save_for_backward({gate, up});
        torch::Tensor y = torch::empty_like(gate);
        silu_mul_pass(gate, up, y);
        return y;
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::tensor_list grads) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor& gate = saved[0];
        const torch::Tensor& up = saved[1];
        torch::Tensor d_gate, d_up;
        if (ctx->needs_input_grad(0)) d_gate = torch::silu_backward(grads[0] * up, gate);
        if (ctx->needs_input_grad(1)) d_up = grads[0] * torch::silu(gate);
        return {d_gate, d_up};
    }
};

// GELU(h) into a new tensor (h untouched), the fused pass where gelu_'s rule under `impl` takes it.
torch::Tensor gelu_of(const torch::Tensor& h, GeluForm form, Impl impl) {
    if (!use_fused(impl, "gelu_linear", unsupported("h", h), fused_is_faster(form, h.numel())))
        return torch::gelu(h, gelu_approximate(form));
    torch::Tensor a = torch::empty_like(h);
    gelu_pass(h, a, form);
    return a;
}

// silu(gate) * up into a new tensor, likewise.
torch::Tensor silu_mul_of(const torch::Tensor& gate, const torch::Tensor& up, Impl impl) {
    if (!use_fused(impl, "gated_linear", unsupported_pair("gate", gate, "value", up), silu_mul_fused_is_faster()))
        return torch::silu(gate) * up;
    torch::Tensor a = torch::empty_like(gate);
    silu_mul_pass(gate, up, a);
    return a;
}

torch::Tensor defined_or_empty(const torch::Tensor& t, const torch::Tensor& like) {
    return t.defined() ? t : torch::empty({0}, like.options());
}
torch::Tensor undefined_if_empty(const torch::Tensor& t) { return t.numel() > 0 ? t : torch::Tensor(); }

// linear(GELU(h)) as one node that keeps h and the weight, not GELU(h): the backward computes GELU(h) again for
// the weight's gradient. Under a backward that builds a graph (double backward) every step is LibTorch's
// differentiable op.
class GeluLinear : public torch::autograd::Function<GeluLinear> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& h,
                                 const torch::Tensor& weight, const torch::Tensor& bias, bool tanh_form,
                                 int64_t impl) {
        ctx->save_for_backward({h, weight});
        ctx->saved_data["tanh"] = tanh_form;
        ctx->saved_data["impl"] = impl;
        const GeluForm form = tanh_form ? GeluForm::Tanh : GeluForm::Erf;
        return flops::linear(gelu_of(h, form, static_cast<Impl>(impl)), weight, undefined_if_empty(bias));
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::tensor_list grads) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor& h = saved[0];
        const GeluForm form = ctx->saved_data["tanh"].toBool() ? GeluForm::Tanh : GeluForm::Erf;
        const Impl impl = torch::GradMode::is_enabled() ? Impl::Reference
                                                        : static_cast<Impl>(ctx->saved_data["impl"].toInt());
        const flops::LinearGradients g = flops::linear_backward(
            grads[0], gelu_of(h, form, impl), saved[1],
            {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)});
        torch::Tensor dh;
        if (ctx->needs_input_grad(0)) dh = torch::gelu_backward(g.dx, h, gelu_approximate(form));
        return {dh, g.dweight, g.dbias, {}, {}};
    }
};

// act(gate) * value into a new tensor: silu * value in one fused pass, GELU (tanh) then the product.
torch::Tensor gated_of(const torch::Tensor& gate, const torch::Tensor& value, GateActivation act, Impl impl) {
    if (act == GateActivation::GeluTanh) return gelu_of(gate, GeluForm::Tanh, impl).mul_(value);
    return silu_mul_of(gate, value, impl);
}

// linear(act(gate) * value) as one node that keeps gate, value and the weight, not their product.
class GatedLinear : public torch::autograd::Function<GatedLinear> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate,
                                 const torch::Tensor& value, const torch::Tensor& weight, const torch::Tensor& bias,
                                 int64_t act, int64_t impl) {
        ctx->save_for_backward({gate, value, weight});
        ctx->saved_data["act"] = act;
        ctx->saved_data["impl"] = impl;
        return flops::linear(gated_of(gate, value, static_cast<GateActivation>(act), static_cast<Impl>(impl)), weight,
                             undefined_if_empty(bias));
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::tensor_list grads) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor &gate = saved[0], &value = saved[1];
        const auto act = static_cast<GateActivation>(ctx->saved_data["act"].toInt());
        const bool graph = torch::GradMode::is_enabled();
        const Impl impl = graph ? Impl::Reference : static_cast<Impl>(ctx->saved_data["impl"].toInt());
        const bool need_gate = ctx->needs_input_grad(0), need_value = ctx->needs_input_grad(1);
        const flops::LinearGradients g = flops::linear_backward(
            grads[0], gated_of(gate, value, act, impl), saved[2],
            {need_gate || need_value, ctx->needs_input_grad(2), ctx->needs_input_grad(3)});
        torch::Tensor d_gate, d_value;
        if (act == GateActivation::GeluTanh) {
            if (need_gate) d_gate = torch::gelu_backward(g.dx * value, gate, "tanh");
            if (need_value) d_value = g.dx * torch::gelu(gate, "tanh");
        } else {
            // LibTorch 1.13 has no derivative of silu_backward: in a graph its formula, s (1 + g (1 - s)), s = sigmoid(g).
            if (need_gate && graph) {
                const torch::Tensor s = torch::sigmoid(gate);
                d_gate = g.dx * value * s * (1 + gate * (1 - s));
            } else if (need_gate) {
                d_gate = torch::silu_backward(g.dx * value, gate);
            }
            if (need_value) d_value = g.dx * torch::silu(gate);
        }
        return {d_gate, d_value, g.dweight, g.dbias, {}, {}};
    }
};

}  // namespace

torch::Tensor gelu_linear(torch::Tensor h, const torch::Tensor& weight, const torch::Tensor& bias, GeluForm form,
                          Impl impl) {
    // Reference, and any call outside a graph: gelu_ (LibTorch's GELU under Reference, out of place in a graph).
    if (impl == Impl::Reference || !records_graph({h, weight, bias}))
        return flops::linear(gelu_(std::move(h), impl, form), weight, bias);
    return GeluLinear::apply(h, weight, defined_or_empty(bias, h), form == GeluForm::Tanh, static_cast<int64_t>(impl));
}

torch::Tensor gated_linear(torch::Tensor gate, const torch::Tensor& value, const torch::Tensor& weight,
                           const torch::Tensor& bias, GateActivation act, Impl impl) {
    LINVIS_CHECK(gate.sizes() == value.sizes(), "gated_linear: value: expected the shape of gate ",
                 shape_string(gate.sizes()), ", got ", shape_string(value.sizes()));
    if (impl == Impl::Reference || !records_graph({gate, value, weight, bias})) {
        if (act == GateActivation::Silu) return flops::linear(silu_mul_(std::move(gate), value, impl), weight, bias);
        torch::Tensor a = gelu_(std::move(gate), impl, GeluForm::Tanh);
        return flops::linear(records_graph({a, value}) ? a * value : a.mul_(value), weight, bias);
    }
    return GatedLinear::apply(gate, value, weight, defined_or_empty(bias, gate), static_cast<int64_t>(act),
                              static_cast<int64_t>(impl));
}

torch::Tensor gelu_(torch::Tensor x, Impl impl, GeluForm form) {
    if (!use_fused(impl, "gelu_", unsupported("x", x), fused_is_faster(form, x.numel())))
        return records_graph({x}) ? torch::gelu(x, gelu_approximate(form)) : torch::gelu_(x, gelu_approximate(form));
    if (records_graph({x})) return FusedGelu::apply(x, form == GeluForm::Tanh);
    gelu_pass(x, x, form);
    return x;
}

torch::Tensor silu_mul_(torch::Tensor gate, const torch::Tensor& up, Impl impl) {
    LINVIS_CHECK(gate.sizes() == up.sizes(), "silu_mul_: up: expected the shape of gate ", shape_string(gate.sizes()),
                 ", got ", shape_string(up.sizes()));
    const std::string why = unsupported_pair("gate", gate, "up", up);
    const bool graph = records_graph({gate, up});
    if (!use_fused(impl, "silu_mul_", why, silu_mul_fused_is_faster()))
        return graph ? torch::silu(gate) * up : torch::silu_(gate).mul_(up);
    if (graph) return FusedSiluMul::apply(gate, up);
    silu_mul_pass(gate, up, gate);
    return gate;
}

}  // namespace linvis::ops
