// linvis::ops::gelu_ (include/linvis/ops/gelu.h): the reference (LibTorch) and the fused kernel (one
// pass of the SIMD layer's gelu_erf, parallel over blocks of elements) side by side, and the choice.
#include "linvis/ops/gelu.h"

#include <ATen/Parallel.h>

#include <string>

#include "ops/simd/simd.h"

namespace linvis::ops {
namespace {

bool records_graph(const torch::Tensor& x) { return torch::GradMode::is_enabled() && x.requires_grad(); }

torch::Tensor reference_gelu(torch::Tensor x) { return records_graph(x) ? torch::gelu(x) : torch::gelu_(x); }

// Empty when the fused kernel takes x, else why not.
std::string unsupported(const torch::Tensor& x) {
    if (!x.device().is_cpu()) return "x is on " + x.device().str() + ", the kernel is CPU only";
    if (x.scalar_type() != torch::kFloat32)
        return std::string("x is ") + c10::toString(x.scalar_type()) + ", the kernel takes float32";
    if (!x.is_contiguous()) return "x is not contiguous";
    return "";
}

// y = GELU(x) over contiguous float32 (y may be x).
void gelu_pass(const torch::Tensor& x, torch::Tensor& y) {
    const simd::Kernels& k = simd::kernels();
    const float* in = x.data_ptr<float>();
    float* out = y.data_ptr<float>();
    // Blocks of 16 Ki elements: a 2-core split of a (196, 768) hidden layer, and no task smaller than a
    // few microseconds.
    at::parallel_for(0, x.numel(), int64_t{1} << 14,
                     [&](int64_t begin, int64_t end) { k.gelu_erf(in + begin, out + begin, end - begin); });
}

// In a graph: the fused pass forward, LibTorch's gelu_backward (the reference's own derivative) backward.
class FusedGelu : public torch::autograd::Function<FusedGelu> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
        ctx->save_for_backward({x});
        torch::Tensor y = torch::empty_like(x);
        gelu_pass(x, y);
        return y;
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::tensor_list grads) {
        return {torch::gelu_backward(grads[0], ctx->get_saved_variables()[0])};
    }
};

torch::Tensor fused_gelu(torch::Tensor x) {
    if (records_graph(x)) return FusedGelu::apply(x);
    gelu_pass(x, x);
    return x;
}

}  // namespace

torch::Tensor gelu_(torch::Tensor x, Impl impl) {
    // Auto: the vectorised targets (a pass bound by memory, against libm's scalar erff); the portable
    // target runs the reference.
    if (use_fused(impl, "gelu_", unsupported(x), simd::vectorised())) return fused_gelu(std::move(x));
    return reference_gelu(std::move(x));
}

}  // namespace linvis::ops
