// Fused CPU 2-D neighbourhood attention: per query, the Ky*Kx logits, their softmax and the weighted sum of the
// values in one pass over the window, without the gathered (N, K*K, d) neighbour tensors of the reference. q, k and
// v are read in place through their strides (DiT5 hands over permuted views of its (B, N, C) projections), and the
// output is written in the (B, H, W, heads, dv) order its caller permutes it back to. The row loops are compiled per
// SIMD target with LINVIS_SIMD_CLONES: dot products in 16 partial sums, the window's exponentials through the SIMD
// layer's exp_sub (float) and the value / gradient updates as vector loops. The attention weights are kept only
// when a graph records the op (its backward needs them).
#include "ops/neighborhood_attention/cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "linvis/core/error.h"
#include "ops/records_graph.h"
#include "ops/simd/simd.h"

namespace linvis::ops::cpu {
namespace {

constexpr int64_t kLanes = 16;

// NATTEN get_window_start for dilation 1 (the window is the whole axis when K >= L).
inline int64_t window_start(int64_t i, int64_t length, int64_t kernel) {
    if (kernel >= length) return 0;
    const int64_t half = kernel / 2;
    return std::min(std::max<int64_t>(i - half, 0), length - kernel);
}

// One (B, heads, H, W, n) operand with a contiguous last dim: element (b, head, y, x, c) at
// p[b*sb + head*sh + y*sy + x*sx + c].
template <typename T>
struct Grid {
    T* p;
    int64_t sb, sh, sy, sx;
    T* at(int64_t b, int64_t head, int64_t y, int64_t x) const { return p + b * sb + head * sh + y * sy + x * sx; }
};

template <typename T>
Grid<T> grid_of(const torch::Tensor& t) {
    return {t.data_ptr<std::remove_const_t<T>>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

struct Geometry {
    int64_t B, heads, H, W, d, dv, K, Ky, Kx;
};

// The window's exponentials exp(x - shift): the SIMD layer's for float, std::exp for double.
template <typename T>
using ExpSubFn = void (*)(const T* x, T shift, T* y, int64_t n);
void exp_sub_f64(const double* x, double shift, double* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i] - shift);
}
ExpSubFn<float> exp_sub_of(float) { return simd::kernels().exp_sub; }
ExpSubFn<double> exp_sub_of(double) { return exp_sub_f64; }

// sum_c a[c] b[c] in kLanes partial sums, folded pairwise.
template <typename T>
LINVIS_SIMD_INLINE T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
    T acc[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= n; c += kLanes)
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[c + l] * b[c + l];
    for (int64_t l = 0; c < n; ++c, ++l) acc[l] += a[c] * b[c];
    for (int64_t h = kLanes / 2; h > 0; h /= 2)
#pragma omp simd
        for (int64_t l = 0; l < h; ++l) acc[l] += acc[l + h];
    return acc[0];
}

// y[c] += w x[c], c < n.
template <typename T>
LINVIS_SIMD_INLINE void axpy(T w, const T* __restrict x, T* __restrict y, int64_t n) {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) y[c] += w * x[c];
}

// The first row and column of query (y, x)'s window; its keys in neighbour order ky*Kx + kx.
struct Window {
    int64_t y0, x0;
};
LINVIS_SIMD_INLINE Window window_of(const Geometry& g, int64_t y, int64_t x) {
    return {window_start(y, g.H, g.K), window_start(x, g.W, g.K)};
}

template <typename T>
struct ForwardRow {
    Geometry g;
    Grid<const T> q, k, v;
    Grid<T> out;
    T* attn;  // (B, heads, N, Ky*Kx) or null
    T scale;
    ExpSubFn<T> exp_sub;
};

// The queries of one grid row y of (b, head); w holds Ky*Kx values.
template <typename T>
LINVIS_SIMD_INLINE void forward_row_body(const ForwardRow<T>& a, int64_t b, int64_t head, int64_t y, T* w) {
    const Geometry& g = a.g;
    const int64_t KK = g.Ky * g.Kx, N = g.H * g.W;
    for (int64_t x = 0; x < g.W; ++x) {
        const Window win = window_of(g, y, x);
        const T* qr = a.q.at(b, head, y, x);
        T maxv = -std::numeric_limits<T>::infinity();
        for (int64_t ky = 0; ky < g.Ky; ++ky)
            for (int64_t kx = 0; kx < g.Kx; ++kx) {
                const T logit = dot(qr, a.k.at(b, head, win.y0 + ky, win.x0 + kx), g.d) * a.scale;
                w[ky * g.Kx + kx] = logit;
                maxv = std::max(maxv, logit);
            }
        a.exp_sub(w, maxv, w, KK);
        T sum = 0;
        for (int64_t j = 0; j < KK; ++j) sum += w[j];
        const T inv = T(1) / sum;
        for (int64_t j = 0; j < KK; ++j) w[j] *= inv;
        if (a.attn != nullptr) std::copy(w, w + KK, a.attn + ((b * g.heads + head) * N + y * g.W + x) * KK);
        T* orow = a.out.at(b, head, y, x);
        std::fill(orow, orow + g.dv, T(0));
        for (int64_t ky = 0; ky < g.Ky; ++ky)
            for (int64_t kx = 0; kx < g.Kx; ++kx)
                axpy(w[ky * g.Kx + kx], a.v.at(b, head, win.y0 + ky, win.x0 + kx), orow, g.dv);
    }
}

template <typename T>
struct BackwardHead {
    Geometry g;
    Grid<const T> q, k, v, dout;
    const T* attn;
    Grid<T> dq, dk, dv;
    T scale;
};

// The gradients of one (b, head): queries in order, so the key and value sums do not depend on the thread count.
// dk and dv must be zero on entry; dattn holds Ky*Kx values.
template <typename T>
LINVIS_SIMD_INLINE void backward_head_body(const BackwardHead<T>& a, int64_t b, int64_t head, T* dattn) {
    const Geometry& g = a.g;
    const int64_t KK = g.Ky * g.Kx, N = g.H * g.W;
    for (int64_t y = 0; y < g.H; ++y)
        for (int64_t x = 0; x < g.W; ++x) {
            const Window win = window_of(g, y, x);
            const T* ar = a.attn + ((b * g.heads + head) * N + y * g.W + x) * KK;
            const T* gr = a.dout.at(b, head, y, x);
            T dot_total = 0;
            for (int64_t ky = 0; ky < g.Ky; ++ky)
                for (int64_t kx = 0; kx < g.Kx; ++kx) {
                    const int64_t j = ky * g.Kx + kx;
                    dattn[j] = dot(gr, a.v.at(b, head, win.y0 + ky, win.x0 + kx), g.dv);
                    dot_total += ar[j] * dattn[j];
                    axpy(ar[j], gr, a.dv.at(b, head, win.y0 + ky, win.x0 + kx), g.dv);
                }
            const T* qr = a.q.at(b, head, y, x);
            T* dqr = a.dq.at(b, head, y, x);
            std::fill(dqr, dqr + g.d, T(0));
            for (int64_t ky = 0; ky < g.Ky; ++ky)
                for (int64_t kx = 0; kx < g.Kx; ++kx) {
                    const int64_t j = ky * g.Kx + kx;
                    const T dl = ar[j] * (dattn[j] - dot_total) * a.scale;  // d logit, times the scale of q
                    axpy(dl, a.k.at(b, head, win.y0 + ky, win.x0 + kx), dqr, g.d);
                    axpy(dl, qr, a.dk.at(b, head, win.y0 + ky, win.x0 + kx), g.d);
                }
        }
}

#define LINVIS_NA_CLONES(T)                                                                                  \
    LINVIS_SIMD_CLONES(forward_row, (const ForwardRow<T>& a, int64_t b, int64_t head, int64_t y, T* w),  \
                       (a, b, head, y, w))                                                               \
    LINVIS_SIMD_CLONES(backward_head, (const BackwardHead<T>& a, int64_t b, int64_t head, T* dattn),     \
                       (a, b, head, dattn))
LINVIS_NA_CLONES(float)
LINVIS_NA_CLONES(double)
#undef LINVIS_NA_CLONES

Geometry geometry_of(const torch::Tensor& q, const torch::Tensor& v, int64_t kernel_size) {
    Geometry g;
    g.B = q.size(0);
    g.heads = q.size(1);
    g.H = q.size(2);
    g.W = q.size(3);
    g.d = q.size(4);
    g.dv = v.size(4);
    g.K = kernel_size;
    g.Ky = std::min(kernel_size, g.H);
    g.Kx = std::min(kernel_size, g.W);
    return g;
}

// (B, heads, H, W, n) with the memory order (B, H, W, heads, n): the order the caller's permute back to
// (B, N, heads * n) makes a view of.
torch::Tensor empty_grid(const Geometry& g, int64_t n, const torch::TensorOptions& options) {
    return torch::empty({g.B, g.H, g.W, g.heads, n}, options).permute({0, 3, 1, 2, 4});
}

// out (and attn when it is defined) of q, k, v of one type T.
template <typename T>
void forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const Geometry& g, double scale,
             const torch::Tensor& out, const torch::Tensor& attn) {
    const ForwardRow<T> args{g,
                             grid_of<const T>(q),
                             grid_of<const T>(k),
                             grid_of<const T>(v),
                             grid_of<T>(out),
                             attn.defined() ? attn.data_ptr<T>() : nullptr,
                             static_cast<T>(scale),
                             exp_sub_of(T())};
    const int64_t KK = g.Ky * g.Kx;
    // Parallel over (sample, head, row): no two tasks write the same output.
    at::parallel_for(0, g.B * g.heads * g.H, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> w(static_cast<size_t>(KK));
        for (int64_t r = begin; r < end; ++r)
            forward_row(args, r / (g.heads * g.H), (r / g.H) % g.heads, r % g.H, w.data());
    });
}

template <typename T>
void backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& attn,
              const torch::Tensor& dout, const Geometry& g, double scale, const torch::Tensor& dq,
              const torch::Tensor& dk, const torch::Tensor& dv) {
    const BackwardHead<T> args{g,
                               grid_of<const T>(q),
                               grid_of<const T>(k),
                               grid_of<const T>(v),
                               grid_of<const T>(dout),
                               attn.data_ptr<T>(),
                               grid_of<T>(dq),
                               grid_of<T>(dk),
                               grid_of<T>(dv),
                               static_cast<T>(scale)};
    const int64_t KK = g.Ky * g.Kx;
    at::parallel_for(0, g.B * g.heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> dattn(static_cast<size_t>(KK));
        for (int64_t bh = begin; bh < end; ++bh) backward_head(args, bh / g.heads, bh % g.heads, dattn.data());
    });
}

// t itself when its last dim is contiguous, else a contiguous copy.
torch::Tensor rows_contiguous(const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

void run_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const Geometry& g,
                 double scale, const torch::Tensor& out, const torch::Tensor& attn) {
    if (q.scalar_type() == torch::kFloat64)
        forward<double>(q, k, v, g, scale, out, attn);
    else
        forward<float>(q, k, v, g, scale, out, attn);
}

class NeighborhoodAttentionFunction : public torch::autograd::Function<NeighborhoodAttentionFunction> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, int64_t kernel_size, double scale) {
        const Geometry g = geometry_of(q, v, kernel_size);
        torch::Tensor out = empty_grid(g, g.dv, q.options());
        torch::Tensor attn = torch::empty({g.B, g.heads, g.H * g.W, g.Ky * g.Kx}, q.options());
        run_forward(q, k, v, g, scale, out, attn);
        ctx->save_for_backward({q, k, v, attn});
        ctx->saved_data["kernel_size"] = kernel_size;
        ctx->saved_data["scale"] = scale;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &attn = saved[3];
        const double scale = ctx->saved_data["scale"].toDouble();
        const Geometry g = geometry_of(q, v, ctx->saved_data["kernel_size"].toInt());
        const torch::Tensor dout = rows_contiguous(grad_outputs[0].to(q.scalar_type()));
        torch::Tensor dq = empty_grid(g, g.d, q.options()), dk = empty_grid(g, g.d, q.options()).zero_(),
                      dv = empty_grid(g, g.dv, q.options()).zero_();
        if (q.scalar_type() == torch::kFloat64)
            cpu::backward<double>(q, k, v, attn, dout, g, scale, dq, dk, dv);
        else
            cpu::backward<float>(q, k, v, attn, dout, g, scale, dq, dk, dv);
        return {dq, dk, dv, torch::Tensor(), torch::Tensor()};
    }
};

}  // namespace

torch::Tensor neighborhood_attention_2d_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                              int64_t kernel_size, double scale) {
    const torch::ScalarType type = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    const torch::Tensor qt = rows_contiguous(q.to(type)), kt = rows_contiguous(k.to(type)),
                        vt = rows_contiguous(v.to(type));
    if (records_graph({q, k, v}))
        return NeighborhoodAttentionFunction::apply(qt, kt, vt, kernel_size, scale).to(q.scalar_type());
    // Outside a graph: no attention weights kept.
    const Geometry g = geometry_of(qt, vt, kernel_size);
    torch::Tensor out = empty_grid(g, g.dv, qt.options());
    run_forward(qt, kt, vt, g, scale, out, torch::Tensor());
    return out.to(q.scalar_type());
}

}  // namespace linvis::ops::cpu
