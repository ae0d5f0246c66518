#include "linvis/core/flops.h"

#include <oneapi/dnnl/dnnl.h>

#include <cstdlib>
#include <cstring>

#include "linvis/core/error.h"
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

bool torch_gemm_forced() {
    const char* value = std::getenv("LINVIS_GEMM");
    return value != nullptr && std::strcmp(value, "torch") == 0;
}

// oneDNN's sgemm takes every float32 CPU product. It opens an OpenMP region per call: with passive
// OpenMP workers the wake-up cost more than oneDNN gained on a 224-px ViT-T's products, with the CLI's
// short spin (runtime::configure_threads) it wins at every size (docs/performance.md).
bool takes_onednn(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    const auto f32_cpu = [](const torch::Tensor& t) {
        return t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && !t.is_sparse() && !t.is_mkldnn();
    };
    if (!f32_cpu(x) || !f32_cpu(weight) || weight.dim() != 2 || x.dim() < 1 || x.size(-1) != weight.size(1)) return false;
    if (bias.defined() && (!f32_cpu(bias) || bias.dim() != 1 || bias.size(0) != weight.size(0))) return false;
    // Empty products (no rows or K = 0) stay with LibTorch, which defines them (zeros plus bias).
    return x.numel() > 0 && weight.numel() > 0 && !torch_gemm_forced();
}

// Row-major C (M x N) = op(A) . op(B) through oneDNN (op = transpose for 'T'); lda/ldb are the stored rows' lengths.
void sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
           int64_t ldb, float* C) {
    const dnnl_status_t status = dnnl_sgemm(transa, transb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N);
    LINVIS_CHECK(status == dnnl_success, "linear: oneDNN sgemm failed with status ", static_cast<int>(status), " for (",
                 M, " x ", K, ") . (", K, " x ", N, ")");
}

// x (..., K) . w^T (w: N x K) + b, no graph.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    const int64_t K = x.size(-1), N = weight.size(0), M = x.numel() / K;
    const torch::Tensor a = x.contiguous(), w = weight.contiguous();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = N;
    torch::Tensor y = torch::empty({M, N}, x.options());
    sgemm('N', 'T', M, N, K, a.data_ptr<float>(), K, w.data_ptr<float>(), K, y.data_ptr<float>());
    if (bias.defined()) y.add_(bias);
    return y.view(shape);
}

// The same product inside an autograd graph: dx = g . w, dw = g^T . x, db = sum of g over rows, each through
// oneDNN. A backward that itself builds a graph (create_graph, double backward) uses LibTorch's
// differentiable ops instead, so higher derivatives stay exact.
class OnednnLinear : public torch::autograd::Function<OnednnLinear> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                 const torch::Tensor& weight, const torch::Tensor& bias) {
        ctx->save_for_backward({x, weight});
        return onednn_linear(x, weight, bias.numel() > 0 ? bias : torch::Tensor());
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::tensor_list grads) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor& x = saved[0];
        const torch::Tensor& weight = saved[1];
        const int64_t K = x.size(-1), N = weight.size(0), M = x.numel() / K;
        const torch::Tensor g = grads[0].reshape({M, N}).contiguous();
        torch::Tensor dx, dw, db;
        if (torch::GradMode::is_enabled()) {
            if (ctx->needs_input_grad(0)) dx = g.matmul(weight).view(x.sizes());
            if (ctx->needs_input_grad(1)) dw = g.t().matmul(x.reshape({M, K}));
        } else {
            if (ctx->needs_input_grad(0)) {
                const torch::Tensor w = weight.contiguous();
                dx = torch::empty({M, K}, g.options());
                sgemm('N', 'N', M, K, N, g.data_ptr<float>(), N, w.data_ptr<float>(), K, dx.data_ptr<float>());
                dx = dx.view(x.sizes());
            }
            if (ctx->needs_input_grad(1)) {
                const torch::Tensor a = x.contiguous();
                dw = torch::empty({N, K}, g.options());
                sgemm('T', 'N', N, K, M, g.data_ptr<float>(), N, a.data_ptr<float>(), K, dw.data_ptr<float>());
            }
        }
        if (ctx->needs_input_grad(2)) db = g.sum(0);
        return {dx, dw, db};
    }
};
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
    if (takes_onednn(x, weight, bias)) {
        const bool graph = torch::GradMode::is_enabled() &&
                           (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
        if (!graph) return onednn_linear(x, weight, bias);
        // Function::apply needs defined inputs: an empty tensor stands for "no bias".
        return OnednnLinear::apply(x, weight, bias.defined() ? bias : torch::empty({0}, x.options()));
    }
    return accumulate_in_f32(x, weight, bias, [](const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& c) {
        return torch::nn::functional::linear(a, w, c);
    });
}

bool linear_takes_onednn(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    return takes_onednn(x, weight, bias);
}

std::string linear_backend() {
    if (torch_gemm_forced()) return "LibTorch";
    const dnnl_version_t* v = dnnl_version();
    return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
           " sgemm";
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
