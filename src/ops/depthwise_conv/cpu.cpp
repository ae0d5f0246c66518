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
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "linvis/core/error.h"
#include "ops/records_graph.h"
#include "ops/ttt_swiglu_cpu/entry_points.h"
#include "ops/ttt_swiglu_cpu/kernels.h"

namespace linvis::ops::cpu {
namespace {

using fused_detail::GridTasks;
using fused_detail::ImageOf;
using fused_detail::kTokenBlock;
using fused_detail::MutImageOf;
using torch::Tensor;

// ------------------------------------------------------------------ row loops (per SIMD target)
// Written once for float and double; LINVIS_SIMD_CLONES compiles each for every target.

// dst[i*C + c] = (bias ? bias[c] : 0) + (src ? src[i*ss + c] : 0) for n rows of C (float64: float writes its rows
// in the stencil's pass).
template <typename T>
LINVIS_SIMD_INLINE void init_rows_body(T* dst, const T* bias, const T* src, int64_t ss, int64_t n, int64_t C) {
    for (int64_t i = 0; i < n; ++i) {
        T* __restrict o = dst + i * C;
        if (bias != nullptr)
            for (int64_t c = 0; c < C; ++c) o[c] = bias[c];
        else
            for (int64_t c = 0; c < C; ++c) o[c] = T(0);
        if (src != nullptr) {
            const T* __restrict s = src + i * ss;
            for (int64_t c = 0; c < C; ++c) o[c] += s[c];
        }
    }
}

// The sigmoid of the SiLU: the SIMD layer's for float (resolved once per op call), std::exp for double.
template <typename T>
using SigmoidFn = void (*)(const T* z, T* s, int64_t n);
void sigmoid_f64(const double* z, double* s, int64_t n) {
    for (int64_t i = 0; i < n; ++i) s[i] = 1.0 / (1.0 + std::exp(-z[i]));
}
SigmoidFn<float> sigmoid_of(float) { return fused_detail::kernels().sigmoid; }
SigmoidFn<double> sigmoid_of(double) { return sigmoid_f64; }

// The sigmoid goes through a stack buffer of kSpan values at a time.
constexpr int64_t kSpan = 1024;

// out = z * sigmoid(z) over n values (out may be z): the SiLU.
template <typename T>
LINVIS_SIMD_INLINE void silu_body(const T* z, T* out, int64_t n, SigmoidFn<T> sigmoid) {
    T sig[kSpan];
    for (int64_t i0 = 0; i0 < n; i0 += kSpan) {
        const int64_t m = std::min(kSpan, n - i0);
        sigmoid(z + i0, sig, m);
        for (int64_t i = 0; i < m; ++i) out[i0 + i] = z[i0 + i] * sig[i];
    }
}

// dz = g * s (1 + z (1 - s)) with s = sigmoid(z) over n values: the SiLU's backward.
template <typename T>
LINVIS_SIMD_INLINE void silu_grad_body(const T* g, const T* z, T* dz, int64_t n, SigmoidFn<T> sigmoid) {
    T sig[kSpan];
    for (int64_t i0 = 0; i0 < n; i0 += kSpan) {
        const int64_t m = std::min(kSpan, n - i0);
        sigmoid(z + i0, sig, m);
        for (int64_t i = 0; i < m; ++i) {
            const T s = sig[i], zi = z[i0 + i];
            dz[i0 + i] = g[i0 + i] * s * (T(1) + zi * (T(1) - s));
        }
    }
}

// Causal stencil over tokens [t0, t1) of one sample (x rows at x + t*sx, taps k x C):
// out[t] = bias + sum_s taps[s] * x[t - (k-1) + s]  (transpose: out[t] = sum_s taps[s] * x[t + (k-1) - s],
// x[>= T] = 0, no bias: the input gradient). The output's channels come in parts of `part` (which divides C),
// part j of token t at out + j * part_stride + t * part: part = C is the token-major (T, C) layout, part = C / h
// with part_stride = T * part the head-major (h, T, C / h) one.
template <typename T>
LINVIS_SIMD_INLINE void causal_apply_body(const T* x, int64_t sx, int64_t len, const T* taps, int64_t k,
                                          const T* bias, bool transpose, T* out, int64_t t0, int64_t t1, int64_t C,
                                          int64_t part, int64_t part_stride) {
    for (int64_t t = t0; t < t1; ++t)
        for (int64_t c0 = 0; c0 < C; c0 += part) {
            T* __restrict o = out + (c0 / part) * part_stride + t * part;
            if (bias != nullptr)
                for (int64_t c = 0; c < part; ++c) o[c] = bias[c0 + c];
            else
                for (int64_t c = 0; c < part; ++c) o[c] = T(0);
            for (int64_t s = 0; s < k; ++s) {
                const int64_t ts = transpose ? t + (k - 1) - s : t - (k - 1) + s;
                if (ts < 0 || ts >= len) continue;
                const T* __restrict xs = x + ts * sx + c0;
                const T* __restrict w = taps + s * C + c0;
                for (int64_t c = 0; c < part; ++c) o[c] += w[c] * xs[c];
            }
        }
}

// acc[s][c] += sum_{t in [t0, t1)} x[t - (k-1) + s][c] * g[t][c]; acc[k][c] += sum_t g[t][c] (bias).
template <typename T>
LINVIS_SIMD_INLINE void causal_reduce_body(const T* x, int64_t sx, const T* g, int64_t k, T* acc, int64_t t0,
                                           int64_t t1, int64_t C) {
    for (int64_t t = t0; t < t1; ++t) {
        const T* __restrict gv = g + t * C;
        for (int64_t s = 0; s < k; ++s) {
            const int64_t ts = t - (k - 1) + s;
            if (ts < 0) continue;
            const T* __restrict xs = x + ts * sx;
            T* __restrict a = acc + s * C;
            for (int64_t c = 0; c < C; ++c) a[c] += xs[c] * gv[c];
        }
        T* __restrict a = acc + k * C;
        for (int64_t c = 0; c < C; ++c) a[c] += gv[c];
    }
}

// acc[c] += sum of n rows of C (row stride C).
template <typename T>
LINVIS_SIMD_INLINE void sum_rows_body(const T* g, int64_t n, int64_t C, T* acc) {
    for (int64_t i = 0; i < n; ++i) {
        const T* __restrict r = g + i * C;
        for (int64_t c = 0; c < C; ++c) acc[c] += r[c];
    }
}

#define LINVIS_DW_CLONES(T)                                                                                     \
    LINVIS_SIMD_CLONES(silu, (const T* z, T* out, int64_t n, SigmoidFn<T> sigmoid), (z, out, n, sigmoid))       \
    LINVIS_SIMD_CLONES(silu_grad, (const T* g, const T* z, T* dz, int64_t n, SigmoidFn<T> sigmoid),             \
                       (g, z, dz, n, sigmoid))                                                                  \
    LINVIS_SIMD_CLONES(causal_apply,                                                                            \
                       (const T* x, int64_t sx, int64_t len, const T* taps, int64_t k, const T* bias,           \
                        bool transpose, T* out, int64_t t0, int64_t t1, int64_t C, int64_t part,                \
                        int64_t part_stride),                                                                   \
                       (x, sx, len, taps, k, bias, transpose, out, t0, t1, C, part, part_stride))               \
    LINVIS_SIMD_CLONES(causal_reduce,                                                                           \
                       (const T* x, int64_t sx, const T* g, int64_t k, T* acc, int64_t t0, int64_t t1, int64_t C), \
                       (x, sx, g, k, acc, t0, t1, C))                                                           \
    LINVIS_SIMD_CLONES(sum_rows, (const T* g, int64_t n, int64_t C, T* acc), (g, n, C, acc))
LINVIS_DW_CLONES(float)
LINVIS_DW_CLONES(double)
#undef LINVIS_DW_CLONES
LINVIS_SIMD_CLONES(init_rows, (double* dst, const double* bias, const double* src, int64_t ss, int64_t n, int64_t C),
                   (dst, bias, src, ss, n, C))

// ------------------------------------------------------------------ helpers

// (C, 1, k...) weight -> (taps, C) tap-major taps; and back.
template <typename T>
std::vector<T> taps_of(const Tensor& weight) {
    const Tensor w = weight.contiguous();
    const int64_t C = w.size(0), taps = w.numel() / C;
    const T* p = w.data_ptr<T>();
    std::vector<T> out(taps * C);
    // Tap-major writes: the other order's stores, C values apart, fell on a few cache sets at C = 2048 (an H-ViT3
    // MLP's width) and took 38 us a call against 7.
    for (int64_t t = 0; t < taps; ++t)
        for (int64_t c = 0; c < C; ++c) out[t * C + c] = p[c * taps + t];
    return out;
}
template <typename T>
Tensor weight_of(const std::vector<T>& taps, const Tensor& like) {
    Tensor w = torch::empty_like(like, torch::MemoryFormat::Contiguous);
    const int64_t C = w.size(0), n = w.numel() / C;
    T* p = w.data_ptr<T>();
    for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < n; ++t) p[c * n + t] = taps[t * C + c];
    return w;
}

// Sums `count` partial vectors of `len` values in task order.
template <typename T>
std::vector<T> sum_parts(const std::vector<T>& parts, int64_t count, int64_t len) {
    std::vector<T> acc(len, T(0));
    for (int64_t t = 0; t < count; ++t)
        for (int64_t i = 0; i < len; ++i) acc[i] += parts[t * len + i];
    return acc;
}

// Sample b of a (B, H*W, C) token tensor (unit channel stride) as an image.
template <typename T>
ImageOf<T> image_of(const Tensor& t, int64_t b, int64_t H, int64_t W) {
    return {t.data_ptr<T>() + b * t.stride(0), W * t.stride(1), t.stride(1), H, W, t.size(2)};
}
template <typename T>
MutImageOf<T> mut_image_of(const Tensor& t, int64_t b, int64_t H, int64_t W) {
    return {t.data_ptr<T>() + b * t.stride(0), W * t.stride(1), t.stride(1), H, W, t.size(2)};
}

// Parallel tasks over (sample, token blocks) of a (B, T, C) sequence.
struct TokenTasks {
    int64_t B, len, blocks;
    TokenTasks(int64_t B_, int64_t len_) : B(B_), len(len_), blocks((len_ + kTokenBlock - 1) / kTokenBlock) {}
    int64_t count() const { return B * blocks; }
    int64_t sample(int64_t task) const { return task / blocks; }
    int64_t t0(int64_t task) const { return (task % blocks) * kTokenBlock; }
    int64_t t1(int64_t task) const { return std::min(len, t0(task) + kTokenBlock); }
};

// Calls f.template operator()<T> for x's dtype (float32 or float64).
template <typename F>
decltype(auto) dispatch(const Tensor& x, F&& f) {
    if (x.scalar_type() == torch::kFloat64) return f(double{});
    return f(float{});
}

// ------------------------------------------------------------------ 3x3 on the grid

// z (contiguous (B, H*W, C)) = conv(x) + bias (+ x for Residual); out = silu(z) for Silu (out may be z).
// float: one stencil pass writes z, the residual as the centre tap + 1 and the bias as the sum's start; float64:
// the rows start as bias (+ x) and the stencil accumulates onto them.
template <typename T>
void dw2d_forward(const Tensor& x, int64_t H, int64_t W, const T* taps, const T* bias, DwEpilogue epi,
                  const Tensor& z, const Tensor& out) {
    const int64_t B = x.size(0), C = x.size(2);
    const GridTasks g(B, H, W, kTokenBlock);
    const SigmoidFn<T> sigmoid = sigmoid_of(T{});
    constexpr bool kOnePass = std::is_same_v<T, float>;
    std::vector<T> centre_plus_one;
    if constexpr (kOnePass) {
        if (epi == DwEpilogue::Residual) {
            centre_plus_one = fused_detail::residual_taps(taps, C);
            taps = centre_plus_one.data();
        }
    }
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task), y0 = g.y0(task), y1 = g.y1(task), n = (y1 - y0) * W;
            T* zr = z.data_ptr<T>() + (b * H * W + y0 * W) * C;
            if constexpr (kOnePass) {
                fused_detail::stencil_apply(image_of<T>(x, b, H, W), taps, false, mut_image_of<T>(z, b, H, W), y0, y1,
                                            false, bias);
            } else {
                const T* xr = x.data_ptr<T>() + b * x.stride(0) + y0 * W * x.stride(1);
                init_rows(zr, bias, epi == DwEpilogue::Residual ? xr : nullptr, x.stride(1), n, C);
                fused_detail::stencil_apply(image_of<T>(x, b, H, W), taps, false, mut_image_of<T>(z, b, H, W), y0, y1,
                                            true);
            }
            if (epi == DwEpilogue::Silu)
                silu(static_cast<const T*>(zr), out.data_ptr<T>() + (b * H * W + y0 * W) * C, n * C, sigmoid);
        }
    });
}

struct Dw2dGrads {
    Tensor dx, dw, db;
};

// Gradients of dw2d_forward for the output gradient go (contiguous); z the saved pre-activation (Silu).
template <typename T>
Dw2dGrads dw2d_backward(const Tensor& x, int64_t H, int64_t W, const Tensor& weight, DwEpilogue epi,
                        const Tensor& go, const Tensor& z, bool need_dx, bool need_dw) {
    const int64_t B = x.size(0), C = x.size(2);
    const GridTasks g(B, H, W, kTokenBlock);
    const std::vector<T> taps = taps_of<T>(weight);
    Tensor dz = go;
    if (epi == DwEpilogue::Silu) {
        dz = torch::empty_like(go);
        const SigmoidFn<T> sigmoid = sigmoid_of(T{});
        at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
            for (int64_t task = begin; task < end; ++task) {
                const int64_t off = (g.sample(task) * H * W + g.y0(task) * W) * C;
                const int64_t n = (g.y1(task) - g.y0(task)) * W * C;
                silu_grad(static_cast<const T*>(go.data_ptr<T>() + off), static_cast<const T*>(z.data_ptr<T>() + off),
                          dz.data_ptr<T>() + off, n, sigmoid);
            }
        });
    }
    Dw2dGrads r;
    if (need_dx) r.dx = torch::empty({B, H * W, C}, go.options());
    const int64_t len = 10 * C;  // 9 taps + the bias
    std::vector<T> parts(need_dw ? g.count() * len : 0, T(0));
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task), y0 = g.y0(task), y1 = g.y1(task);
            const int64_t off = (b * H * W + y0 * W) * C, n = (y1 - y0) * W;
            if (need_dx) {
                const bool residual = epi == DwEpilogue::Residual;
                if (residual) std::copy(go.data_ptr<T>() + off, go.data_ptr<T>() + off + n * C, r.dx.data_ptr<T>() + off);
                fused_detail::stencil_apply(image_of<T>(dz, b, H, W), taps.data(), true, mut_image_of<T>(r.dx, b, H, W),
                                            y0, y1, residual);
            }
            if (need_dw) {
                T* acc = parts.data() + task * len;
                fused_detail::stencil_reduce(image_of<T>(x, b, H, W), image_of<T>(dz, b, H, W), acc, y0, y1);
                sum_rows(static_cast<const T*>(dz.data_ptr<T>() + off), n, C, acc + 9 * C);
            }
        }
    });
    if (need_dw) {
        std::vector<T> acc = sum_parts(parts, g.count(), len);
        r.dw = weight_of(acc, weight);
        r.db = torch::from_blob(acc.data() + 9 * C, {C}, weight.options()).clone();
    }
    return r;
}

// Forward of either path: a contiguous (B, H*W, C) result; z (the pre-activation) is returned for Silu
// when keep_z, else the output itself.
std::pair<Tensor, Tensor> dw2d_run(const Tensor& x, int64_t H, int64_t W, const Tensor& weight, const Tensor& bias,
                                   DwEpilogue epi, bool keep_z) {
    Tensor z = torch::empty({x.size(0), H * W, x.size(2)}, x.options().memory_format(torch::MemoryFormat::Contiguous));
    Tensor out = epi == DwEpilogue::Silu && keep_z ? torch::empty_like(z) : z;
    dispatch(x, [&](auto zero) {
        using T = decltype(zero);
        const std::vector<T> taps = taps_of<T>(weight);
        const Tensor b = bias.defined() ? bias.contiguous() : Tensor();
        dw2d_forward<T>(x, H, W, taps.data(), b.defined() ? b.data_ptr<T>() : nullptr, epi, z, out);
    });
    return {out, z};
}

class DepthwiseConv2dFunction : public torch::autograd::Function<DepthwiseConv2dFunction> {
public:
    static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                          const Tensor& bias, int64_t H, int64_t W, int64_t epilogue) {
        const auto epi = static_cast<DwEpilogue>(epilogue);
        auto [out, z] = dw2d_run(x, H, W, weight, bias, epi, /*keep_z=*/true);
        ctx->save_for_backward({x, weight, epi == DwEpilogue::Silu ? z : Tensor()});
        ctx->saved_data["H"] = H;
        ctx->saved_data["W"] = W;
        ctx->saved_data["epilogue"] = epilogue;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const Tensor& x = saved[0];
        const int64_t H = ctx->saved_data["H"].toInt(), W = ctx->saved_data["W"].toInt();
        const auto epi = static_cast<DwEpilogue>(ctx->saved_data["epilogue"].toInt());
        const Tensor go = grad_outputs[0].to(x.scalar_type()).contiguous();
        const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
        Dw2dGrads g = dispatch(x, [&](auto zero) {
            return dw2d_backward<decltype(zero)>(x, H, W, saved[1], epi, go, saved[2], need_dx, need_dw);
        });
        if (!ctx->needs_input_grad(1)) g.dw = Tensor();
        if (!ctx->needs_input_grad(2)) g.db = Tensor();
        return {g.dx, g.dw, g.db, Tensor(), Tensor(), Tensor()};
    }
};

// ------------------------------------------------------------------ causal 1D

// heads = 1: a contiguous (B, T, C); heads > 1: a contiguous (B, heads, T, C / heads).
Tensor causal_run(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t heads = 1) {
    const int64_t B = x.size(0), len = x.size(1), C = x.size(2), k = weight.size(2), part = C / heads;
    Tensor out = heads == 1 ? torch::empty({B, len, C}, x.options().memory_format(torch::MemoryFormat::Contiguous))
                            : torch::empty({B, heads, len, part}, x.options());
    dispatch(x, [&](auto zero) {
        using T = decltype(zero);
        const std::vector<T> taps = taps_of<T>(weight);
        const Tensor bc = bias.defined() ? bias.contiguous() : Tensor();
        const T* b = bc.defined() ? bc.data_ptr<T>() : nullptr;
        const TokenTasks g(B, len);
        at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
            for (int64_t task = begin; task < end; ++task) {
                const int64_t s = g.sample(task);
                causal_apply(static_cast<const T*>(x.data_ptr<T>() + s * x.stride(0)), x.stride(1), len,
                             static_cast<const T*>(taps.data()), k, b, false, out.data_ptr<T>() + s * len * C,
                             g.t0(task), g.t1(task), C, part, len * part);
            }
        });
    });
    return out;
}

template <typename T>
std::vector<Tensor> causal_backward(const Tensor& x, const Tensor& weight, const Tensor& go, bool need_dx,
                                    bool need_dw) {
    const int64_t B = x.size(0), len = x.size(1), C = x.size(2), k = weight.size(2);
    const TokenTasks g(B, len);
    const std::vector<T> taps = taps_of<T>(weight);
    Tensor dx = need_dx ? torch::empty({B, len, C}, go.options()) : Tensor();
    const int64_t plen = (k + 1) * C;  // k taps + the bias
    std::vector<T> parts(need_dw ? g.count() * plen : 0, T(0));
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t s = g.sample(task), t0 = g.t0(task), t1 = g.t1(task);
            const T* gs = go.data_ptr<T>() + s * len * C;
            if (need_dx)
                causal_apply(gs, C, len, static_cast<const T*>(taps.data()), k, static_cast<const T*>(nullptr), true,
                             dx.data_ptr<T>() + s * len * C, t0, t1, C, C, 0);
            if (need_dw)
                causal_reduce(static_cast<const T*>(x.data_ptr<T>() + s * x.stride(0)), x.stride(1), gs, k,
                              parts.data() + task * plen, t0, t1, C);
        }
    });
    Tensor dw, db;
    if (need_dw) {
        std::vector<T> acc = sum_parts(parts, g.count(), plen);
        dw = weight_of(acc, weight);
        db = torch::from_blob(acc.data() + k * C, {C}, weight.options()).clone();
    }
    return {dx, dw, db};
}

class CausalConv1dFunction : public torch::autograd::Function<CausalConv1dFunction> {
public:
    static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                          const Tensor& bias) {
        ctx->save_for_backward({x, weight});
        return causal_run(x, weight, bias);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const Tensor& x = saved[0];
        const Tensor go = grad_outputs[0].to(x.scalar_type()).contiguous();
        const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
        std::vector<Tensor> g = dispatch(
            x, [&](auto zero) { return causal_backward<decltype(zero)>(x, saved[1], go, need_dx, need_dw); });
        if (!ctx->needs_input_grad(1)) g[1] = Tensor();
        if (!ctx->needs_input_grad(2)) g[2] = Tensor();
        return g;
    }
};

// x with unit channel stride (a copy only when the channels are strided).
Tensor channels_unit(const Tensor& x) { return x.stride(2) == 1 ? x : x.contiguous(); }

// bfloat16 runs in float32 (converted on entry, the result rounded once); float32 / float64 as they are.
struct Compute {
    torch::ScalarType in;
    bool widened;
    explicit Compute(const Tensor& x) : in(x.scalar_type()), widened(in == torch::kBFloat16) {}
    Tensor operator()(const Tensor& t) const { return widened && t.defined() ? t.to(torch::kFloat32) : t; }
    Tensor back(const Tensor& t) const { return widened ? t.to(in) : t; }
};

}  // namespace

std::string depthwise_conv_unsupported(const Tensor& x, const Tensor& weight, const Tensor& bias) {
    for (const Tensor* t : {&x, &weight, &bias}) {
        if (!t->defined()) continue;
        if (!t->device().is_cpu()) return "CPU tensors only, got " + t->device().str();
        const auto type = t->scalar_type();
        if (type != torch::kFloat32 && type != torch::kFloat64 && type != torch::kBFloat16)
            return std::string("float32, float64 or bfloat16 tensors only, got ") + c10::toString(type);
        if (type != x.scalar_type())
            return std::string("x, weight and bias of one dtype, got x ") + c10::toString(x.scalar_type()) + " and " +
                   c10::toString(type);
    }
    return {};
}

Tensor depthwise_conv2d_tokens_fused(const Tensor& x_in, int64_t height, int64_t width, const Tensor& weight_in,
                                     const Tensor& bias_in, DwEpilogue epilogue) {
    const Compute compute(x_in);
    const Tensor x = channels_unit(compute(x_in)), weight = compute(weight_in), bias = compute(bias_in);
    if (records_graph({x, weight, bias})) {
        // A missing bias is a zero vector: LibTorch 1.13's autograd functions reject undefined inputs.
        const Tensor b = bias.defined() ? bias : torch::zeros({x.size(2)}, weight.options());
        return compute.back(
            DepthwiseConv2dFunction::apply(x, weight, b, height, width, static_cast<int64_t>(epilogue)));
    }
    return compute.back(dw2d_run(x, height, width, weight, bias, epilogue, /*keep_z=*/false).first);
}

Tensor causal_depthwise_conv1d_tokens_fused(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in) {
    const Compute compute(x_in);
    const Tensor x = channels_unit(compute(x_in)), weight = compute(weight_in), bias = compute(bias_in);
    if (records_graph({x, weight, bias})) {
        const Tensor b = bias.defined() ? bias : torch::zeros({x.size(2)}, weight.options());
        return compute.back(CausalConv1dFunction::apply(x, weight, b));
    }
    return compute.back(causal_run(x, weight, bias));
}

Tensor causal_depthwise_conv1d_heads_fused(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in,
                                           int64_t heads) {
    const Compute compute(x_in);
    const Tensor x = channels_unit(compute(x_in)), weight = compute(weight_in), bias = compute(bias_in);
    return compute.back(causal_run(x, weight, bias, heads));
}

}  // namespace linvis::ops::cpu
