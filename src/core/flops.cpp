#include "linvis/core/flops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <cstdlib>
#include <cstring>

#include "core/onednn_calls.h"
#include "core/onednn_matmul.h"
#include "linvis/core/error.h"
#include "linvis/core/precision.h"

namespace linvis::flops {
namespace {
thread_local Counter* active_counter = nullptr;

// A float32 copy of t (undefined stays undefined: an absent bias).
torch::Tensor f32(const torch::Tensor& t) { return t.defined() ? t.to(torch::kFloat32) : t; }

// Runs `product` on float32 copies of reduced-precision CPU operands when LibTorch would otherwise
// accumulate in bf16/f16 (see linvis/core/precision.h), and rounds the result once to their dtype.
template <typename Product>
torch::Tensor accumulate_in_f32(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias,
                                Product&& product) {
    if (!precision::product_needs_f32(a)) return product(a, b, bias);
    return product(f32(a), f32(b), f32(bias)).to(a.scalar_type());
}

bool torch_gemm_forced() {
    const char* value = std::getenv("LINVIS_GEMM");
    return value != nullptr && std::strcmp(value, "torch") == 0;
}

// Which library computes a linear product.
enum class Backend { Torch, Sgemm, Bf16 };

torch::Tensor onednn_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias,
                        onednn::Activation activation = onednn::Activation::None);

// A bf16 product as float32 sgemm on widened copies of the operands, the activation in float32, one rounding.
torch::Tensor bf16_on_widened_sgemm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias,
                                    onednn::Activation activation) {
    return onednn_mm(f32(a), f32(b), f32(bias), activation).to(torch::kBFloat16);
}

// Whether oneDNN's bf16 matmul primitive computes a ViT-T-sized bf16 product faster than its float32 sgemm
// on widened copies, measured once per process: (1024 x 192) . (192 x 768), the MLP of a ViT-T at 512 px,
// best of 5 alternations after a warm-up of each (about 20 ms). The operands are filled without the random
// generator, so the choice leaves every seeded sequence as it was.
bool bf16_matmul_measured_faster() {
    if (!onednn::bf16_matmul_available()) return false;
    torch::NoGradGuard no_grad;
    const torch::Tensor a = torch::linspace(-1.0, 1.0, 1024 * 192).reshape({1024, 192}).to(torch::kBFloat16);
    const torch::Tensor b = torch::linspace(1.0, -1.0, 192 * 768).reshape({192, 768}).to(torch::kBFloat16);
    torch::Tensor c = torch::empty({1024, 768}, a.options());
    const auto seconds = [](const auto& product) {
        const auto start = std::chrono::steady_clock::now();
        const bool ran = product();
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        return ran ? elapsed : std::numeric_limits<double>::infinity();
    };
    const auto primitive = [&] { return onednn::matmul(a, b, torch::Tensor(), c, onednn::Activation::None); };
    const auto widened = [&] {
        return bf16_on_widened_sgemm(a, b, torch::Tensor(), onednn::Activation::None).defined();
    };
    seconds(primitive);
    seconds(widened);
    double best_primitive = std::numeric_limits<double>::infinity(), best_widened = best_primitive;
    for (int i = 0; i < 5; ++i) {
        best_primitive = std::min(best_primitive, seconds(primitive));
        best_widened = std::min(best_widened, seconds(widened));
    }
    return best_primitive < best_widened;
}

// How bf16 products run on oneDNN: its bf16 matmul primitive (float32 accumulation, one rounding) or float32
// sgemm on widened copies of the operands (the same float32 accumulation and one rounding), whichever is faster
// on this CPU (bf16_matmul_measured_faster). The two differ by CPU, not by ISA: on the 2-core AVX-512 Xeon
// (Sapphire Rapids class, AVX512-BF16, AMX not exposed) the primitive's brg:avx512_core_bf16 kernel ran at 88
// against 175 GFLOP/s for float32 (one thread), sgemm on widened operands at 135; on the 2-core Zen 4 EPYC
// (AVX512-BF16) the same kernel ran at 266-391 GFLOP/s on two threads against 183-208 for float32 and 142-190
// for sgemm on widened operands. Their sums run in different orders, so a bf16 output may differ in its last bit
// between processes that chose differently (the bf16 tests bound both routes). LINVIS_BF16_GEMM=matmul or =sgemm
// (read on every call) picks one, for comparisons and tests.
bool bf16_on_matmul_primitive() {
    const char* value = std::getenv("LINVIS_BF16_GEMM");
    if (value == nullptr || *value == '\0') {
        static const bool faster = bf16_matmul_measured_faster();
        return faster;
    }
    LINVIS_CHECK(std::strcmp(value, "matmul") == 0 || std::strcmp(value, "sgemm") == 0,
                 "LINVIS_BF16_GEMM: expected matmul or sgemm, got '", value, "'");
    return std::strcmp(value, "matmul") == 0 && onednn::bf16_matmul_available();
}

// oneDNN's sgemm takes every float32 CPU product. It opens an OpenMP region per call: with passive
// OpenMP workers the wake-up cost more than oneDNN gained on a 224-px ViT-T's products, with the CLI's
// short spin (runtime::restart_with_runtime_environment) it wins at every size (docs/performance.md). bf16 CPU products
// go to oneDNN as well (bf16_on_matmul_primitive says how), LibTorch's 1.13 bf16 linear being slower still.
Backend backend(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    const auto on_cpu = [](const torch::Tensor& t, torch::ScalarType type) {
        return t.scalar_type() == type && t.device().is_cpu() && !t.is_sparse() && !t.is_mkldnn();
    };
    if (weight.dim() != 2 || x.dim() < 1 || x.size(-1) != weight.size(1)) return Backend::Torch;
    if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0))) return Backend::Torch;
    // Empty products (no rows or K = 0) stay with LibTorch, which defines them (zeros plus bias).
    if (x.numel() == 0 || weight.numel() == 0 || torch_gemm_forced() || !onednn::unusable_reason().empty())
        return Backend::Torch;
    for (torch::ScalarType type : {torch::kFloat32, torch::kBFloat16}) {
        if (!on_cpu(x, type) || !on_cpu(weight, type) || (bias.defined() && !on_cpu(bias, type))) continue;
        return type == torch::kFloat32 ? Backend::Sgemm : Backend::Bf16;
    }
    return Backend::Torch;
}

bool takes_onednn(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    return backend(x, weight, bias) != Backend::Torch;
}

// Row-major C (M x N) = op(A) . op(B) [+ C when accumulate] through oneDNN (op = transpose for 'T'); lda/ldb are
// the stored rows' lengths.
void sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
           int64_t ldb, float* C, bool accumulate = false) {
    const dnnl_status_t status =
        dnnl_sgemm(transa, transb, M, N, K, 1.0f, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C, N);
    LINVIS_CHECK(status == dnnl_success, "linear: oneDNN sgemm failed with status ", static_cast<int>(status), " for (",
                 M, " x ", K, ") . (", K, " x ", N, ")");
}

// A 2-D float32 operand as sgemm reads it. Rows of unit column stride are 'N' with the row stride as ld, columns
// of unit row stride are 'T' with the column stride as ld: a narrowed or transposed operand (a slice of a wider
// weight) is read in place; any other layout is copied.
struct SgemmOperand {
    torch::Tensor t;
    char trans;
    int64_t ld;
};
SgemmOperand sgemm_operand(const torch::Tensor& t) {
    const int64_t rows = t.size(0), cols = t.size(1);
    if (t.is_contiguous()) return {t, 'N', std::max<int64_t>(cols, 1)};
    if (t.stride(1) == 1 && t.stride(0) >= cols) return {t, 'N', std::max<int64_t>(t.stride(0), 1)};
    if (t.stride(0) == 1 && t.stride(1) >= rows) return {t, 'T', std::max<int64_t>(t.stride(1), 1)};
    return {t.contiguous(), 'N', std::max<int64_t>(cols, 1)};
}

// Whether autograd records a product of these operands.
bool records_graph(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    return torch::GradMode::is_enabled() &&
           (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
}

using onednn::Activation;

// `activation` applied in place to y, a product onednn_mm has just computed.
torch::Tensor activate(torch::Tensor y, Activation activation) {
    if (activation == Activation::None) return y;
    if (activation == Activation::Relu) return y.relu_();
    return torch::gelu_(y, activation == Activation::GeluTanh ? "tanh" : "none");
}

// A float32 product with at most this many output columns (and at least kNarrowMinRows rows) runs as its transpose,
// C^T = b^T . a^T: oneDNN's matmul primitive pads N to a vector of 16 columns and its sgemm packs the tall operand,
// while the transposed product streams a once. Vision-TTT's learning-rate gates (192 -> 3, on 196-16384 tokens) ran
// 1.47-2.5x faster, and 1.5-5x for N = 1 to 3 with K = 192 and 1152 on up to 65536 rows; from N = 4 on the transposed
// form lost on inputs beyond the caches (Zen 4, docs/performance.md, "Narrow products as their transpose").
constexpr int64_t kNarrowMaxColumns = 3;
constexpr int64_t kNarrowMinRows = 16;

// The narrow case of onednn_mm: C^T (N x M) from sgemm, then transposed back with the bias added in the same pass.
torch::Tensor narrow_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias,
                        Activation activation) {
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    const SgemmOperand Bt = sgemm_operand(b.t());
    const SgemmOperand At = sgemm_operand(a.t());
    const torch::Tensor ct = torch::empty({N, M}, a.options());
    sgemm(Bt.trans, At.trans, N, M, K, Bt.t.data_ptr<float>(), Bt.ld, At.t.data_ptr<float>(), At.ld,
          ct.data_ptr<float>());
    torch::Tensor c = torch::empty({M, N}, a.options());
    const torch::Tensor row = bias.defined() ? bias.contiguous() : torch::zeros({N}, a.options());
    const float* src = ct.data_ptr<float>();
    const float* add = row.data_ptr<float>();
    float* dst = c.data_ptr<float>();
    at::parallel_for(0, M, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
            for (int64_t j = 0; j < N; ++j) dst[i * N + j] = src[j * M + i] + add[j];
    });
    return activate(c, activation);
}

// a (M x K) . b (K x N) [+ bias], then `activation`, for 2-D CPU tensors of one dtype through oneDNN. float32:
// a narrow product as its transpose (narrow_mm); else with a bias or an activation its matmul primitive, which
// applies them to each tile of the product while it is in cache (1-32 % faster than sgemm and a pass over the
// output for ViT-T's products, docs/performance.md), a plain product its sgemm (as fast, and faster on the
// backward's transposed operands); sgemm and a pass where the primitive has no kernel. bf16: the matmul primitive
// where bf16_on_matmul_primitive() and the primitive has a kernel for the case, else sgemm on float32 copies.
torch::Tensor onednn_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias,
                        Activation activation) {
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    if (a.scalar_type() == torch::kBFloat16) {
        if (bf16_on_matmul_primitive()) {
            torch::Tensor c = torch::empty({M, N}, a.options());
            if (onednn::matmul(a, b, bias, c, activation)) return c;
        }
        return bf16_on_widened_sgemm(a, b, bias, activation);
    }
    if (N <= kNarrowMaxColumns && M >= kNarrowMinRows) return narrow_mm(a, b, bias, activation);
    if (bias.defined() || activation != Activation::None) {
        torch::Tensor c = torch::empty({M, N}, a.options());
        if (onednn::matmul(a, b, bias, c, activation)) return c;
    }
    const SgemmOperand A = sgemm_operand(a);
    const SgemmOperand B = sgemm_operand(b);
    torch::Tensor c = torch::empty({M, N}, a.options());
    if (bias.defined()) {
        // The bias rows first and the product accumulated onto them (beta = 1): the GEMM adds the bias while
        // each tile of C is in cache, instead of a separate pass over C afterwards.
        const torch::Tensor row = bias.contiguous();
        const float* src = row.data_ptr<float>();
        float* dst = c.data_ptr<float>();
        at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) std::memcpy(dst + i * N, src, sizeof(float) * N);
        });
    }
    sgemm(A.trans, B.trans, M, N, K, A.t.data_ptr<float>(), A.ld, B.t.data_ptr<float>(), B.ld, c.data_ptr<float>(),
          bias.defined());
    return activate(c, activation);
}

// x (..., K) . w^T (w: N x K) + b, then `activation`, no graph.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                            Activation activation = Activation::None) {
    const int64_t K = x.size(-1), N = weight.size(0), M = x.numel() / K;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = N;
    return onednn_mm(x.reshape({M, K}), weight.t(), bias, activation).view(shape);
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
        LinearGradients g = flops::linear_backward(grads[0], saved[0], saved[1],
                                            {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)});
        return {g.dx, g.dweight, g.dbias};
    }
};
}  // namespace

Counter::Counter() : parent_(active_counter) { active_counter = this; }

Uncounted::Uncounted() : saved_(active_counter) { active_counter = nullptr; }

Uncounted::~Uncounted() { active_counter = saved_; }

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
        if (!records_graph(x, weight, bias)) return onednn_linear(x, weight, bias);
        // Function::apply needs defined inputs: an empty tensor stands for "no bias".
        return OnednnLinear::apply(x, weight, bias.defined() ? bias : torch::empty({0}, x.options()));
    }
    return accumulate_in_f32(x, weight, bias, [](const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& c) {
        return torch::nn::functional::linear(a, w, c);
    });
}

torch::Tensor linear_add_(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                          const torch::Tensor& bias) {
    // bf16 onto bf16 on the matmul primitive (where bf16 products take it): out + the product in float32, rounded
    // once, where out.add_(linear(...)) rounds the product and then the sum.
    const Backend route = backend(x, weight, bias);
    const bool bf16 = route == Backend::Bf16 && out.scalar_type() == torch::kBFloat16 && bf16_on_matmul_primitive();
    const bool in_place = ((route == Backend::Sgemm && out.scalar_type() == torch::kFloat32) || bf16) &&
                          !records_graph(x, weight, bias) && !records_graph(out, weight, bias) &&
                          out.device().is_cpu() && out.is_contiguous() && out.dim() == x.dim() &&
                          out.sizes().slice(0, out.dim() - 1) == x.sizes().slice(0, x.dim() - 1) &&
                          out.size(-1) == weight.size(0) && !out.storage().is_alias_of(x.storage()) &&
                          !out.storage().is_alias_of(weight.storage()) &&
                          !(bias.defined() && out.storage().is_alias_of(bias.storage()));
    if (!in_place) return out.add_(flops::linear(x, weight, bias));
    const int64_t K = x.size(-1), N = weight.size(0), M = x.numel() / K;
    if (counting()) add(M * N * K);
    const torch::Tensor a = x.reshape({M, K});
    if (bias.defined() || bf16) {
        // The matmul primitive adds out and the bias to each tile of the product (its sum post-op).
        torch::Tensor c = out.view({M, N});
        if (onednn::matmul(a, weight.t(), bias, c, Activation::None, /*accumulate=*/true)) return out;
        torch::Tensor product;  // no kernel for this case: a fresh product, counted above
        {
            const Uncounted uncounted;
            product = flops::linear(x, weight, bias);
        }
        return out.add_(product);
    }
    const SgemmOperand A = sgemm_operand(a);
    const SgemmOperand B = sgemm_operand(weight.t());
    sgemm(A.trans, B.trans, M, N, K, A.t.data_ptr<float>(), A.ld, B.t.data_ptr<float>(), B.ld, out.data_ptr<float>(),
          /*accumulate=*/true);
    return out;
}

LinearGradients linear_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& weight,
                                std::array<bool, 3> needs) {
    const int64_t K = x.size(-1), N = weight.size(0), M = x.numel() / K;
    const torch::Tensor g = dy.reshape({M, N}).contiguous();
    LinearGradients out;
    // oneDNN's products where linear() takes the operands and the backward builds no graph; LibTorch's
    // differentiable ones otherwise, so a double backward stays exact.
    const bool onednn = !torch::GradMode::is_enabled() && takes_onednn(x, weight, {}) && g.scalar_type() == x.scalar_type();
    const auto mm = [&](const torch::Tensor& a, const torch::Tensor& b) { return onednn ? onednn_mm(a, b, {}) : a.matmul(b); };
    if (needs[0]) out.dx = mm(g, weight).view(x.sizes());
    if (needs[1]) out.dweight = mm(g.t(), x.reshape({M, K}));
    if (needs[2]) out.dbias = g.sum(0);
    return out;
}

namespace {
// activation(linear(x, weight, bias)): in a graph LibTorch's activation of linear(); outside one on oneDNN inside the
// product (the matmul primitive's epilogue), on LibTorch's products in place on the fresh result.
torch::Tensor linear_activated(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                               Activation activation) {
    if (records_graph(x, weight, bias)) {
        const torch::Tensor y = linear(x, weight, bias);
        if (activation == Activation::Relu) return torch::relu(y);
        return torch::gelu(y, activation == Activation::GeluTanh ? "tanh" : "none");
    }
    if (backend(x, weight, bias) == Backend::Torch) {
        // A reduced-precision product activated in its own dtype would be rounded twice: on the CPU the activation
        // acts on the float32 product and the result is rounded once, as on oneDNN.
        if (!x.device().is_cpu() || precision::accumulation_dtype(x) == x.scalar_type())
            return activate(linear(x, weight, bias), activation);
        return activate(linear(f32(x), f32(weight), f32(bias)), activation).to(x.scalar_type());
    }
    if (counting()) add(x.numel() / x.size(-1) * weight.size(0) * weight.size(1));
    return onednn_linear(x, weight, bias, activation);
}
}  // namespace

torch::Tensor linear_gelu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          const std::string& approximate) {
    LINVIS_CHECK(approximate == "none" || approximate == "tanh", "linear_gelu: approximate: expected none or tanh, got '",
                 approximate, "'");
    return linear_activated(x, weight, bias, approximate == "tanh" ? Activation::GeluTanh : Activation::GeluErf);
}

torch::Tensor linear_relu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    return linear_activated(x, weight, bias, Activation::Relu);
}

int64_t packed_weight_bytes() { return static_cast<int64_t>(onednn::packed_weight_bytes()); }
void release_packed_weights() { onednn::release_packed_weights(); }

WeightsInTraining::WeightsInTraining() { ++onednn::weights_in_training_depth(); }

WeightsInTraining::~WeightsInTraining() { --onednn::weights_in_training_depth(); }

bool linear_takes_onednn(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    return takes_onednn(x, weight, bias);
}

std::string onednn_unusable_reason() { return onednn::unusable_reason(); }

std::string linear_backend() {
    if (torch_gemm_forced()) return "LibTorch";
    if (!onednn::load_error().empty()) return "LibTorch (oneDNN: " + onednn::load_error() + ")";
    const dnnl_version_t* v = dnnl_version();
    const std::string onednn =
        "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
    const std::string& unusable = onednn::unusable_reason();
    if (!unusable.empty()) return "LibTorch (" + onednn + " fails here: " + unusable + ")";
    std::string name = onednn + " sgemm";
    name += bf16_on_matmul_primitive() ? ", bf16 matmul (" + onednn::bf16_matmul_implementation() + ")"
                                       : ", bf16 on sgemm (float32 copies)";
    return name;
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
