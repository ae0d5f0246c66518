// Fused CPU 2-D neighbourhood attention: per query, the Ky*Kx logits, their softmax and the weighted sum of the
// values in one pass over the window, without the gathered (N, K*K, d) neighbour tensors of the reference. q, k and
// v are read in place through their strides (DiT5 hands over permuted views of its (B, N, C) projections), and the
// output is written in the (B, H, W, heads, dv) order its caller permutes it back to. In float a query's window goes
// through the SIMD layer's window_dots (its logits, and dout against the values in the backward) and window_sum (the
// output, and dq), which keep their sums in registers; the exponentials through its exp_sub; the scatters into dk
// and dv are vector loops compiled per SIMD target with LINVIS_SIMD_CLONES. The attention weights are kept only
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

// A window's dot products with one vector and its weighted sum of rows (simd.h window_dots / window_sum): the SIMD
// layer's kernels for float, the loops above for double (the float64 path the tests compare against).
template <typename T>
struct WindowFns {
    void (*dots)(const T* x, const T* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols, int64_t n, T* out);
    void (*sum)(const T* w, const T* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols, int64_t n, T* y);
};
void window_dots_f64(const double* x, const double* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols, int64_t n,
                     double* out) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) out[r * cols + j] = dot(x, p + r * sr + j * sc, n);
}
void window_sum_f64(const double* w, const double* p, int64_t sr, int64_t sc, int64_t rows, int64_t cols, int64_t n,
                    double* y) {
    std::fill(y, y + n, 0.0);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) axpy(w[r * cols + j], p + r * sr + j * sc, y, n);
}
WindowFns<float> window_fns_of(float) { return {simd::kernels().window_dots, simd::kernels().window_sum}; }
WindowFns<double> window_fns_of(double) { return {window_dots_f64, window_sum_f64}; }

template <typename T>
struct ForwardArgs {
    Geometry g;
    Grid<const T> q, k, v;
    Grid<T> out;
    T* attn;  // (B, heads, N, Ky*Kx) or null
    T scale;
    ExpSubFn<T> exp_sub;
    WindowFns<T> window;
};

// Queries go in strips of kStripWidth columns, row after row down the strip, and each strip first packs the key and
// value columns its windows cover (kStripWidth + K - 1 of them) for every row, without gaps. In place, one key is
// one head's slice of a token's qkv row: DiT5's keys are 3 C floats apart and a grid row a multiple of 4 KiB further,
// so a window's keys crowd few cache sets and missed in L1 and L2 (a query at a 32-wide grid took 2.2x the time of one
// at a 16-wide grid). Packed, one row of the strip's windows is (kStripWidth + K - 1) x K keys and as many values
// (30 KiB for DiT-S's d = 64, K = 5) in consecutive lines.
constexpr int64_t kStripWidth = 8;

// The columns [x0, x0 + cols) of every row of one (b, head) of a grid, packed as (H, cols, n).
template <typename T>
void pack_columns(const Grid<const T>& grid, int64_t b, int64_t head, int64_t H, int64_t x0, int64_t cols, int64_t n,
                  T* packed) {
    for (int64_t y = 0; y < H; ++y)
        for (int64_t x = 0; x < cols; ++x) {
            // The same column of the next row is asked for a row ahead: the hardware sees no stride to follow.
            if (y + 1 < H)
                for (int64_t c = 0; c < n; c += 64 / sizeof(T)) __builtin_prefetch(grid.at(b, head, y + 1, x0 + x) + c);
            const T* src = grid.at(b, head, y, x0 + x);
            std::copy(src, src + n, packed + (y * cols + x) * n);
        }
}

// The queries of columns [x_begin, x_end) of every grid row of (b, head), their keys and values packed as (H, cols, d)
// and (H, cols, dv) from column x0 on; w holds Ky*Kx values.
template <typename T>
LINVIS_SIMD_INLINE void forward_strip_body(const ForwardArgs<T>& a, int64_t b, int64_t head, int64_t x_begin,
                                           int64_t x_end, const T* keys, const T* values, int64_t x0, int64_t cols,
                                           T* w) {
    const Geometry& g = a.g;
    const int64_t KK = g.Ky * g.Kx, N = g.H * g.W;
    for (int64_t y = 0; y < g.H; ++y)
        for (int64_t x = x_begin; x < x_end; ++x) {
            const Window win = window_of(g, y, x);
            const int64_t first = win.y0 * cols + win.x0 - x0;  // the window's first key in the packed columns
            // Each query is read once, in place: its successor's lines are asked for while this one's window runs.
            const T* next = x + 1 < x_end ? a.q.at(b, head, y, x + 1) : y + 1 < g.H ? a.q.at(b, head, y + 1, x_begin)
                                                                                   : nullptr;
            if (next != nullptr)
                for (int64_t c = 0; c < g.d; c += 64 / sizeof(T)) __builtin_prefetch(next + c);
            a.window.dots(a.q.at(b, head, y, x), keys + first * g.d, cols * g.d, g.d, g.Ky, g.Kx, g.d, w);
            T maxv = -std::numeric_limits<T>::infinity();
            for (int64_t j = 0; j < KK; ++j) {
                w[j] *= a.scale;
                maxv = std::max(maxv, w[j]);
            }
            a.exp_sub(w, maxv, w, KK);
            T sum = 0;
            for (int64_t j = 0; j < KK; ++j) sum += w[j];
            const T inv = T(1) / sum;
            for (int64_t j = 0; j < KK; ++j) w[j] *= inv;
            if (a.attn != nullptr) std::copy(w, w + KK, a.attn + ((b * g.heads + head) * N + y * g.W + x) * KK);
            a.window.sum(w, values + first * g.dv, cols * g.dv, g.dv, g.Ky, g.Kx, g.dv, a.out.at(b, head, y, x));
        }
}

template <typename T>
struct BackwardHead {
    Geometry g;
    Grid<const T> q, k, v, dout;
    const T* attn;
    Grid<T> dq, dk, dv;
    T scale;
    WindowFns<T> window;
};

// The gradients of one (b, head): queries in order, so the key and value sums do not depend on the thread count.
// dk and dv must be zero on entry; dattn holds Ky*Kx values and dlogit as many.
template <typename T>
LINVIS_SIMD_INLINE void backward_head_body(const BackwardHead<T>& a, int64_t b, int64_t head, T* dattn, T* dlogit) {
    const Geometry& g = a.g;
    const int64_t KK = g.Ky * g.Kx, N = g.H * g.W;
    for (int64_t y = 0; y < g.H; ++y)
        for (int64_t x = 0; x < g.W; ++x) {
            const Window win = window_of(g, y, x);
            const T* ar = a.attn + ((b * g.heads + head) * N + y * g.W + x) * KK;
            const T* gr = a.dout.at(b, head, y, x);
            a.window.dots(gr, a.v.at(b, head, win.y0, win.x0), a.v.sy, a.v.sx, g.Ky, g.Kx, g.dv, dattn);
            T dot_total = 0;
            for (int64_t j = 0; j < KK; ++j) dot_total += ar[j] * dattn[j];
            for (int64_t ky = 0; ky < g.Ky; ++ky)
                for (int64_t kx = 0; kx < g.Kx; ++kx)
                    axpy(ar[ky * g.Kx + kx], gr, a.dv.at(b, head, win.y0 + ky, win.x0 + kx), g.dv);
            // d logit, times the scale of q
            for (int64_t j = 0; j < KK; ++j) dlogit[j] = ar[j] * (dattn[j] - dot_total) * a.scale;
            a.window.sum(dlogit, a.k.at(b, head, win.y0, win.x0), a.k.sy, a.k.sx, g.Ky, g.Kx, g.d,
                         a.dq.at(b, head, y, x));
            const T* qr = a.q.at(b, head, y, x);
            for (int64_t ky = 0; ky < g.Ky; ++ky)
                for (int64_t kx = 0; kx < g.Kx; ++kx)
                    axpy(dlogit[ky * g.Kx + kx], qr, a.dk.at(b, head, win.y0 + ky, win.x0 + kx), g.d);
        }
}

#define LINVIS_NA_CLONES(T)                                                                                    \
    LINVIS_SIMD_CLONES(forward_strip,                                                                          \
                       (const ForwardArgs<T>& a, int64_t b, int64_t head, int64_t x_begin, int64_t x_end,        \
                        const T* keys, const T* values, int64_t x0, int64_t cols, T* w),                         \
                       (a, b, head, x_begin, x_end, keys, values, x0, cols, w))                                  \
    LINVIS_SIMD_CLONES(backward_head, (const BackwardHead<T>& a, int64_t b, int64_t head, T* dattn, T* dlogit), \
                       (a, b, head, dattn, dlogit))
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
    const ForwardArgs<T> args{g,
                             grid_of<const T>(q),
                             grid_of<const T>(k),
                             grid_of<const T>(v),
                             grid_of<T>(out),
                             attn.defined() ? attn.data_ptr<T>() : nullptr,
                             static_cast<T>(scale),
                             exp_sub_of(T()),
                             window_fns_of(T())};
    const int64_t KK = g.Ky * g.Kx;
    // Parallel over (sample, head, strip): no two tasks write the same output.
    const int64_t strips = (g.W + kStripWidth - 1) / kStripWidth;
    at::parallel_for(0, g.B * g.heads * strips, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> w(static_cast<size_t>(KK)), keys, values;
        for (int64_t r = begin; r < end; ++r) {
            const int64_t b = r / (g.heads * strips), head = (r / strips) % g.heads;
            const int64_t x_begin = (r % strips) * kStripWidth, x_end = std::min(x_begin + kStripWidth, g.W);
            // The columns the strip's windows cover: from its first query's window to its last one's.
            const int64_t x0 = window_of(g, 0, x_begin).x0, cols = window_of(g, 0, x_end - 1).x0 + g.Kx - x0;
            keys.resize(static_cast<size_t>(g.H * cols * g.d));
            values.resize(static_cast<size_t>(g.H * cols * g.dv));
            pack_columns(args.k, b, head, g.H, x0, cols, g.d, keys.data());
            pack_columns(args.v, b, head, g.H, x0, cols, g.dv, values.data());
            forward_strip(args, b, head, x_begin, x_end, keys.data(), values.data(), x0, cols, w.data());
        }
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
                               static_cast<T>(scale),
                               window_fns_of(T())};
    const int64_t KK = g.Ky * g.Kx;
    at::parallel_for(0, g.B * g.heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> scratch(static_cast<size_t>(2 * KK));
        for (int64_t bh = begin; bh < end; ++bh)
            backward_head(args, bh / g.heads, bh % g.heads, scratch.data(), scratch.data() + KK);
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
