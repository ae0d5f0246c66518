// Fused CPU depthwise convolutions on tokens (see linvis/ops/depthwise_conv.h). The tokens are read in
// place (channels last, any token stride) and the result is written contiguous, so neither direction
// pays the (B, T, C) <-> (B, C, H, W) layout copies of the reference. The 3x3 stencils are the fused
// ViT3 / T5 kernels' building blocks (ops/ttt_swiglu_cpu/kernels.h: stencil_apply / stencil_reduce);
// the causal 1D stencil and the row loops here are compiled per SIMD target with LINVIS_SIMD_CLONES.
// Parallel over (sample, rows of about kTokenBlock tokens) with at::parallel_for; weight and bias
// gradients are summed per task and the task partials added in task order.
#include "ops/depthwise_conv/cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "linvis/core/error.h"
#include "ops/ttt_swiglu_cpu/entry_points.h"
#include "ops/ttt_swiglu_cpu/kernels.h"

namespace linvis::ops::cpu {
namespace {

using fused_detail::GridTasks;
using fused_detail::Image;
using fused_detail::kTokenBlock;
using fused_detail::MutImage;
using torch::Tensor;

// ------------------------------------------------------------------ row loops (per SIMD target)

// dst[i*C + c] = (bias ? bias[c] : 0) + (src ? src[i*ss + c] : 0) for n rows of C.
LINVIS_SIMD_INLINE void init_rows_body(float* dst, const float* bias, const float* src, int64_t ss, int64_t n,
                                       int64_t C) {
    for (int64_t i = 0; i < n; ++i) {
        float* __restrict o = dst + i * C;
        if (bias != nullptr)
            for (int64_t c = 0; c < C; ++c) o[c] = bias[c];
        else
            for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
        if (src != nullptr) {
            const float* __restrict s = src + i * ss;
            for (int64_t c = 0; c < C; ++c) o[c] += s[c];
        }
    }
}

// out[i] = z[i] * sig[i] (silu with the sigmoid given); out may be z.
LINVIS_SIMD_INLINE void silu_mul_body(const float* z, const float* sig, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = z[i] * sig[i];
}

// dz[i] = g[i] * s (1 + z (1 - s)) with s = sig[i]: the SiLU derivative.
LINVIS_SIMD_INLINE void silu_grad_body(const float* g, const float* z, const float* sig, float* dz, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dz[i] = g[i] * sig[i] * (1.0f + z[i] * (1.0f - sig[i]));
}

// Causal stencil over tokens [t0, t1) of one sample (x rows at x + t*sx, taps k x C, out rows contiguous):
// out[t] = bias + sum_s taps[s] * x[t - (k-1) + s]  (transpose: out[t] = sum_s taps[s] * x[t + (k-1) - s],
// x[>= T] = 0, no bias: the input gradient).
LINVIS_SIMD_INLINE void causal_apply_body(const float* x, int64_t sx, int64_t T, const float* taps, int64_t k,
                                          const float* bias, bool transpose, float* out, int64_t t0, int64_t t1,
                                          int64_t C) {
    for (int64_t t = t0; t < t1; ++t) {
        float* __restrict o = out + t * C;
        if (bias != nullptr)
            for (int64_t c = 0; c < C; ++c) o[c] = bias[c];
        else
            for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
        for (int64_t s = 0; s < k; ++s) {
            const int64_t ts = transpose ? t + (k - 1) - s : t - (k - 1) + s;
            if (ts < 0 || ts >= T) continue;
            const float* __restrict xs = x + ts * sx;
            const float* __restrict w = taps + s * C;
            for (int64_t c = 0; c < C; ++c) o[c] += w[c] * xs[c];
        }
    }
}

// acc[s][c] += sum_{t in [t0, t1)} x[t - (k-1) + s][c] * g[t][c]; acc[k][c] += sum_t g[t][c] (bias).
LINVIS_SIMD_INLINE void causal_reduce_body(const float* x, int64_t sx, const float* g, int64_t k, float* acc,
                                           int64_t t0, int64_t t1, int64_t C) {
    for (int64_t t = t0; t < t1; ++t) {
        const float* __restrict gv = g + t * C;
        for (int64_t s = 0; s < k; ++s) {
            const int64_t ts = t - (k - 1) + s;
            if (ts < 0) continue;
            const float* __restrict xs = x + ts * sx;
            float* __restrict a = acc + s * C;
            for (int64_t c = 0; c < C; ++c) a[c] += xs[c] * gv[c];
        }
        float* __restrict a = acc + k * C;
        for (int64_t c = 0; c < C; ++c) a[c] += gv[c];
    }
}

// acc[c] += sum of n rows of C (row stride C).
LINVIS_SIMD_INLINE void sum_rows_body(const float* g, int64_t n, int64_t C, float* acc) {
    for (int64_t i = 0; i < n; ++i) {
        const float* __restrict r = g + i * C;
        for (int64_t c = 0; c < C; ++c) acc[c] += r[c];
    }
}

LINVIS_SIMD_CLONES(init_rows, (float* dst, const float* bias, const float* src, int64_t ss, int64_t n, int64_t C),
                   (dst, bias, src, ss, n, C))
LINVIS_SIMD_CLONES(silu_mul, (const float* z, const float* sig, float* out, int64_t n), (z, sig, out, n))
LINVIS_SIMD_CLONES(silu_grad, (const float* g, const float* z, const float* sig, float* dz, int64_t n),
                   (g, z, sig, dz, n))
LINVIS_SIMD_CLONES(causal_apply,
                   (const float* x, int64_t sx, int64_t T, const float* taps, int64_t k, const float* bias,
                    bool transpose, float* out, int64_t t0, int64_t t1, int64_t C),
                   (x, sx, T, taps, k, bias, transpose, out, t0, t1, C))
LINVIS_SIMD_CLONES(causal_reduce,
                   (const float* x, int64_t sx, const float* g, int64_t k, float* acc, int64_t t0, int64_t t1,
                    int64_t C),
                   (x, sx, g, k, acc, t0, t1, C))
LINVIS_SIMD_CLONES(sum_rows, (const float* g, int64_t n, int64_t C, float* acc), (g, n, C, acc))

// ------------------------------------------------------------------ helpers

// (C, 1, k...) weight -> (taps, C) tap-major taps; and back.
std::vector<float> taps_of(const Tensor& weight) {
    const Tensor w = weight.contiguous();
    const int64_t C = w.size(0), taps = w.numel() / C;
    const float* p = w.data_ptr<float>();
    std::vector<float> out(taps * C);
    for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < taps; ++t) out[t * C + c] = p[c * taps + t];
    return out;
}
Tensor weight_of(const std::vector<float>& taps, const Tensor& like) {
    Tensor w = torch::empty_like(like, torch::MemoryFormat::Contiguous);
    const int64_t C = w.size(0), n = w.numel() / C;
    float* p = w.data_ptr<float>();
    for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < n; ++t) p[c * n + t] = taps[t * C + c];
    return w;
}

// Sums `count` partial vectors of `len` floats in task order.
std::vector<float> sum_parts(const std::vector<float>& parts, int64_t count, int64_t len) {
    std::vector<float> acc(len, 0.0f);
    for (int64_t t = 0; t < count; ++t)
        for (int64_t i = 0; i < len; ++i) acc[i] += parts[t * len + i];
    return acc;
}

// Sample b of a (B, H*W, C) token tensor (unit channel stride) as an image.
Image image_of(const Tensor& t, int64_t b, int64_t H, int64_t W) {
    return {t.data_ptr<float>() + b * t.stride(0), W * t.stride(1), t.stride(1), H, W, t.size(2)};
}
MutImage mut_image_of(const Tensor& t, int64_t b, int64_t H, int64_t W) {
    return {t.data_ptr<float>() + b * t.stride(0), W * t.stride(1), t.stride(1), H, W, t.size(2)};
}

// Parallel tasks over (sample, token blocks) of a (B, T, C) sequence.
struct TokenTasks {
    int64_t B, T, blocks;
    TokenTasks(int64_t B_, int64_t T_) : B(B_), T(T_), blocks((T_ + kTokenBlock - 1) / kTokenBlock) {}
    int64_t count() const { return B * blocks; }
    int64_t sample(int64_t task) const { return task / blocks; }
    int64_t t0(int64_t task) const { return (task % blocks) * kTokenBlock; }
    int64_t t1(int64_t task) const { return std::min(T, t0(task) + kTokenBlock); }
};

// ------------------------------------------------------------------ 3x3 on the grid

// z (contiguous (B, H*W, C)) = conv(x) + bias (+ x for Residual); out = silu(z) for Silu (out may be z).
void dw2d_forward(const Tensor& x, int64_t H, int64_t W, const float* taps, const float* bias, DwEpilogue epi,
                  const Tensor& z, const Tensor& out) {
    const int64_t B = x.size(0), C = x.size(2);
    const GridTasks g(B, H, W, kTokenBlock);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> sig;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task), y0 = g.y0(task), y1 = g.y1(task), n = (y1 - y0) * W;
            float* zr = z.data_ptr<float>() + (b * H * W + y0 * W) * C;
            const float* xr = x.data_ptr<float>() + b * x.stride(0) + y0 * W * x.stride(1);
            init_rows(zr, bias, epi == DwEpilogue::Residual ? xr : nullptr, x.stride(1), n, C);
            fused_detail::stencil_apply(image_of(x, b, H, W), taps, false, mut_image_of(z, b, H, W), y0, y1, true);
            if (epi == DwEpilogue::Silu) {
                sig.resize(static_cast<size_t>(n * C));
                fused_detail::kernels().sigmoid(zr, sig.data(), n * C);
                silu_mul(zr, sig.data(), out.data_ptr<float>() + (b * H * W + y0 * W) * C, n * C);
            }
        }
    });
}

struct Dw2dGrads {
    Tensor dx, dw, db;
};

// Gradients of dw2d_forward for the output gradient go (contiguous); z the saved pre-activation (Silu).
Dw2dGrads dw2d_backward(const Tensor& x, int64_t H, int64_t W, const Tensor& weight, DwEpilogue epi,
                        const Tensor& go, const Tensor& z, bool need_dx, bool need_dw) {
    const int64_t B = x.size(0), C = x.size(2);
    const GridTasks g(B, H, W, kTokenBlock);
    const std::vector<float> taps = taps_of(weight);
    Tensor dz = go;
    if (epi == DwEpilogue::Silu) {
        dz = torch::empty_like(go);
        at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
            std::vector<float> sig;
            for (int64_t task = begin; task < end; ++task) {
                const int64_t off = (g.sample(task) * H * W + g.y0(task) * W) * C;
                const int64_t n = (g.y1(task) - g.y0(task)) * W * C;
                sig.resize(static_cast<size_t>(n));
                fused_detail::kernels().sigmoid(z.data_ptr<float>() + off, sig.data(), n);
                silu_grad(go.data_ptr<float>() + off, z.data_ptr<float>() + off, sig.data(),
                          dz.data_ptr<float>() + off, n);
            }
        });
    }
    Dw2dGrads r;
    if (need_dx) r.dx = torch::empty({B, H * W, C}, go.options());
    const int64_t len = 10 * C;  // 9 taps + the bias
    std::vector<float> parts(need_dw ? g.count() * len : 0, 0.0f);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task), y0 = g.y0(task), y1 = g.y1(task);
            const int64_t off = (b * H * W + y0 * W) * C, n = (y1 - y0) * W;
            if (need_dx) {
                const bool residual = epi == DwEpilogue::Residual;
                if (residual) std::copy(go.data_ptr<float>() + off, go.data_ptr<float>() + off + n * C,
                                        r.dx.data_ptr<float>() + off);
                fused_detail::stencil_apply(image_of(dz, b, H, W), taps.data(), true, mut_image_of(r.dx, b, H, W), y0,
                                            y1, residual);
            }
            if (need_dw) {
                float* acc = parts.data() + task * len;
                fused_detail::stencil_reduce(image_of(x, b, H, W), image_of(dz, b, H, W), acc, y0, y1);
                sum_rows(dz.data_ptr<float>() + off, n, C, acc + 9 * C);
            }
        }
    });
    if (need_dw) {
        const std::vector<float> acc = sum_parts(parts, g.count(), len);
        r.dw = weight_of(acc, weight);
        r.db = torch::from_blob(const_cast<float*>(acc.data()) + 9 * C, {C}, weight.options()).clone();
    }
    return r;
}

class DepthwiseConv2dFunction : public torch::autograd::Function<DepthwiseConv2dFunction> {
public:
    static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                          const Tensor& bias, int64_t H, int64_t W, int64_t epilogue) {
        const auto epi = static_cast<DwEpilogue>(epilogue);
        const std::vector<float> taps = taps_of(weight);
        Tensor z = torch::empty({x.size(0), H * W, x.size(2)}, x.options().memory_format(torch::MemoryFormat::Contiguous));
        Tensor out = epi == DwEpilogue::Silu ? torch::empty_like(z) : z;
        dw2d_forward(x, H, W, taps.data(), bias.contiguous().data_ptr<float>(), epi, z, out);
        ctx->save_for_backward({x, weight, epi == DwEpilogue::Silu ? z : Tensor()});
        ctx->saved_data["H"] = H;
        ctx->saved_data["W"] = W;
        ctx->saved_data["epilogue"] = epilogue;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const int64_t H = ctx->saved_data["H"].toInt(), W = ctx->saved_data["W"].toInt();
        const auto epi = static_cast<DwEpilogue>(ctx->saved_data["epilogue"].toInt());
        const Tensor go = grad_outputs[0].to(torch::kFloat32).contiguous();
        Dw2dGrads g = dw2d_backward(saved[0], H, W, saved[1], epi, go, saved[2], ctx->needs_input_grad(0),
                                    ctx->needs_input_grad(1) || ctx->needs_input_grad(2));
        if (!ctx->needs_input_grad(1)) g.dw = Tensor();
        if (!ctx->needs_input_grad(2)) g.db = Tensor();
        return {g.dx, g.dw, g.db, Tensor(), Tensor(), Tensor()};
    }
};

// ------------------------------------------------------------------ causal 1D

void causal_forward(const Tensor& x, const float* taps, int64_t k, const float* bias, const Tensor& out) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    const TokenTasks g(B, T);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task);
            causal_apply(x.data_ptr<float>() + b * x.stride(0), x.stride(1), T, taps, k, bias, false,
                         out.data_ptr<float>() + b * T * C, g.t0(task), g.t1(task), C);
        }
    });
}

class CausalConv1dFunction : public torch::autograd::Function<CausalConv1dFunction> {
public:
    static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                          const Tensor& bias) {
        const std::vector<float> taps = taps_of(weight);
        Tensor out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options().memory_format(torch::MemoryFormat::Contiguous));
        causal_forward(x, taps.data(), weight.size(2), bias.contiguous().data_ptr<float>(), out);
        ctx->save_for_backward({x, weight});
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const Tensor& x = saved[0];
        const Tensor& weight = saved[1];
        const Tensor go = grad_outputs[0].to(torch::kFloat32).contiguous();
        const int64_t B = x.size(0), T = x.size(1), C = x.size(2), k = weight.size(2);
        const TokenTasks g(B, T);
        const std::vector<float> taps = taps_of(weight);
        const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
        Tensor dx = need_dx ? torch::empty({B, T, C}, go.options()) : Tensor();
        const int64_t len = (k + 1) * C;  // k taps + the bias
        std::vector<float> parts(need_dw ? g.count() * len : 0, 0.0f);
        at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
            for (int64_t task = begin; task < end; ++task) {
                const int64_t b = g.sample(task), t0 = g.t0(task), t1 = g.t1(task);
                const float* gb = go.data_ptr<float>() + b * T * C;
                if (need_dx) causal_apply(gb, C, T, taps.data(), k, nullptr, true, dx.data_ptr<float>() + b * T * C, t0, t1, C);
                if (need_dw)
                    causal_reduce(x.data_ptr<float>() + b * x.stride(0), x.stride(1), gb, k, parts.data() + task * len,
                                  t0, t1, C);
            }
        });
        Tensor dw, db;
        if (need_dw) {
            const std::vector<float> acc = sum_parts(parts, g.count(), len);
            if (ctx->needs_input_grad(1)) dw = weight_of(acc, weight);
            if (ctx->needs_input_grad(2)) db = torch::from_blob(const_cast<float*>(acc.data()) + k * C, {C}, weight.options()).clone();
        }
        return {dx, dw, db};
    }
};

bool needs_graph(const Tensor& x, const Tensor& weight, const Tensor& bias) {
    return torch::GradMode::is_enabled() &&
           (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
}

// x with unit channel stride (a copy only when the channels are strided).
Tensor channels_unit(const Tensor& x) { return x.stride(2) == 1 ? x : x.contiguous(); }

}  // namespace

std::string depthwise_conv_unsupported(const Tensor& x, const Tensor& weight, const Tensor& bias) {
    for (const Tensor* t : {&x, &weight, &bias}) {
        if (!t->defined()) continue;
        if (!t->device().is_cpu()) return "CPU tensors only, got " + t->device().str();
        if (t->scalar_type() != torch::kFloat32)
            return std::string("float32 tensors only, got ") + c10::toString(t->scalar_type());
    }
    return {};
}

Tensor depthwise_conv2d_tokens_fused(const Tensor& x_in, int64_t height, int64_t width, const Tensor& weight,
                                     const Tensor& bias, DwEpilogue epilogue) {
    const Tensor x = channels_unit(x_in);
    const int64_t C = x.size(2);
    // A missing bias is a zero vector: LibTorch 1.13's autograd functions reject undefined inputs.
    const Tensor b = bias.defined() ? bias : torch::zeros({C}, weight.options());
    if (needs_graph(x, weight, bias))
        return DepthwiseConv2dFunction::apply(x, weight, b, height, width, static_cast<int64_t>(epilogue));
    const std::vector<float> taps = taps_of(weight);
    Tensor out = torch::empty({x.size(0), height * width, C}, x.options().memory_format(torch::MemoryFormat::Contiguous));
    dw2d_forward(x, height, width, taps.data(), bias.defined() ? b.contiguous().data_ptr<float>() : nullptr, epilogue,
                 out, out);
    return out;
}

Tensor causal_depthwise_conv1d_tokens_fused(const Tensor& x_in, const Tensor& weight, const Tensor& bias) {
    const Tensor x = channels_unit(x_in);
    const int64_t C = x.size(2);
    const Tensor b = bias.defined() ? bias : torch::zeros({C}, weight.options());
    if (needs_graph(x, weight, bias)) return CausalConv1dFunction::apply(x, weight, b);
    const std::vector<float> taps = taps_of(weight);
    Tensor out = torch::empty({x.size(0), x.size(1), C}, x.options().memory_format(torch::MemoryFormat::Contiguous));
    causal_forward(x, taps.data(), weight.size(2), bias.defined() ? b.contiguous().data_ptr<float>() : nullptr, out);
    return out;
}

}  // namespace linvis::ops::cpu
