// Fused CPU 2-D neighbourhood attention: per query, the Ky*Kx logits, their softmax and the weighted
// sum of the values in one pass over the window, without materialising the gathered (N, K*K, d)
// neighbour tensors of the reference. One portable code path (plain loops the compiler vectorises);
// there is no ISA-specific code, so LINVIS_SIMD / LINVIS_FORCE_SCALAR do not change it.
#include "ops/neighborhood_attention/cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "linvis/core/error.h"

namespace linvis::ops::cpu {
namespace {

// NATTEN get_window_start for dilation 1 (the window is the whole axis when K >= L).
inline int64_t window_start(int64_t i, int64_t length, int64_t kernel) {
    if (kernel >= length) return 0;
    const int64_t half = kernel / 2;
    return std::min(std::max<int64_t>(i - half, 0), length - kernel);
}

struct Geometry {
    int64_t BH, H, W, d, dv, K, Ky, Kx;
};

template <typename T>
void forward_kernel(const T* q, const T* k, const T* v, T* out, T* attn, const Geometry& g, double scale) {
    const int64_t N = g.H * g.W, KK = g.Ky * g.Kx;
    // Parallel over (sample*head, row): no two tasks write the same output.
    at::parallel_for(0, g.BH * g.H, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> logits(KK);
        std::vector<int64_t> index(KK);
        for (int64_t r = begin; r < end; ++r) {
            const int64_t bh = r / g.H, y = r % g.H;
            const T* qb = q + bh * N * g.d;
            const T* kb = k + bh * N * g.d;
            const T* vb = v + bh * N * g.dv;
            const int64_t sy = window_start(y, g.H, g.K);
            for (int64_t x = 0; x < g.W; ++x) {
                const int64_t sx = window_start(x, g.W, g.K);
                const int64_t n = y * g.W + x;
                const T* qr = qb + n * g.d;
                T maxv = -std::numeric_limits<T>::infinity();
                for (int64_t a = 0; a < g.Ky; ++a)
                    for (int64_t b = 0; b < g.Kx; ++b) {
                        const int64_t m = (sy + a) * g.W + (sx + b);
                        const T* kr = kb + m * g.d;
                        T acc = 0;
                        for (int64_t c = 0; c < g.d; ++c) acc += (qr[c] * static_cast<T>(scale)) * kr[c];
                        logits[a * g.Kx + b] = acc;
                        index[a * g.Kx + b] = m;
                        maxv = std::max(maxv, acc);
                    }
                T sum = 0;
                for (int64_t j = 0; j < KK; ++j) {
                    logits[j] = std::exp(logits[j] - maxv);
                    sum += logits[j];
                }
                T* ar = attn + (bh * N + n) * KK;
                for (int64_t j = 0; j < KK; ++j) ar[j] = logits[j] / sum;
                T* orow = out + (bh * N + n) * g.dv;
                std::fill(orow, orow + g.dv, T(0));
                for (int64_t j = 0; j < KK; ++j) {
                    const T w = ar[j];
                    const T* vr = vb + index[j] * g.dv;
                    for (int64_t c = 0; c < g.dv; ++c) orow[c] += w * vr[c];
                }
            }
        }
    });
}

template <typename T>
void backward_kernel(const T* q, const T* k, const T* v, const T* attn, const T* dout, T* dq, T* dk, T* dv,
                     const Geometry& g, double scale) {
    const int64_t N = g.H * g.W, KK = g.Ky * g.Kx;
    const T s = static_cast<T>(scale);
    // Parallel over sample*head: the key / value gradients of one (sample, head) are summed by one task in
    // query order, so the result does not depend on the thread count.
    at::parallel_for(0, g.BH, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> dattn(KK);
        std::vector<int64_t> index(KK);
        for (int64_t bh = begin; bh < end; ++bh) {
            const T* qb = q + bh * N * g.d;
            const T* kb = k + bh * N * g.d;
            const T* vb = v + bh * N * g.dv;
            T* dqb = dq + bh * N * g.d;
            T* dkb = dk + bh * N * g.d;
            T* dvb = dv + bh * N * g.dv;
            std::fill(dkb, dkb + N * g.d, T(0));
            std::fill(dvb, dvb + N * g.dv, T(0));
            for (int64_t y = 0; y < g.H; ++y) {
                const int64_t sy = window_start(y, g.H, g.K);
                for (int64_t x = 0; x < g.W; ++x) {
                    const int64_t sx = window_start(x, g.W, g.K);
                    const int64_t n = y * g.W + x;
                    const T* ar = attn + (bh * N + n) * KK;
                    const T* gr = dout + (bh * N + n) * g.dv;
                    T dot = 0;
                    for (int64_t a = 0; a < g.Ky; ++a)
                        for (int64_t b = 0; b < g.Kx; ++b) {
                            const int64_t j = a * g.Kx + b, m = (sy + a) * g.W + (sx + b);
                            index[j] = m;
                            const T* vr = vb + m * g.dv;
                            T acc = 0;
                            for (int64_t c = 0; c < g.dv; ++c) acc += gr[c] * vr[c];
                            dattn[j] = acc;
                            dot += ar[j] * acc;
                            T* dvr = dvb + m * g.dv;
                            const T w = ar[j];
                            for (int64_t c = 0; c < g.dv; ++c) dvr[c] += w * gr[c];
                        }
                    const T* qr = qb + n * g.d;
                    T* dqr = dqb + n * g.d;
                    std::fill(dqr, dqr + g.d, T(0));
                    for (int64_t j = 0; j < KK; ++j) {
                        const T dl = ar[j] * (dattn[j] - dot) * s;  // d logit, times the scale of q
                        const T* kr = kb + index[j] * g.d;
                        T* dkr = dkb + index[j] * g.d;
                        for (int64_t c = 0; c < g.d; ++c) {
                            dqr[c] += dl * kr[c];
                            dkr[c] += dl * qr[c];
                        }
                    }
                }
            }
        }
    });
}

class NeighborhoodAttentionFunction : public torch::autograd::Function<NeighborhoodAttentionFunction> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, int64_t kernel_size, double scale) {
        const Geometry g = geometry(q, v, kernel_size);
        torch::Tensor out = torch::empty({q.size(0), q.size(1), g.H, g.W, g.dv}, q.options());
        torch::Tensor attn = torch::empty({q.size(0), q.size(1), g.H * g.W, g.Ky * g.Kx}, q.options());
        AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "neighborhood_attention_2d_fused", [&] {
            forward_kernel<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                     out.data_ptr<scalar_t>(), attn.data_ptr<scalar_t>(), g, scale);
        });
        ctx->save_for_backward({q, k, v, attn});
        ctx->saved_data["kernel_size"] = kernel_size;
        ctx->saved_data["scale"] = scale;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &attn = saved[3];
        const int64_t kernel_size = ctx->saved_data["kernel_size"].toInt();
        const double scale = ctx->saved_data["scale"].toDouble();
        const Geometry g = geometry(q, v, kernel_size);
        torch::Tensor dout = grad_outputs[0].to(q.scalar_type()).contiguous();
        torch::Tensor dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v);
        AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "neighborhood_attention_2d_fused_backward", [&] {
            backward_kernel<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                      attn.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(),
                                      dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), g, scale);
        });
        return {dq, dk, dv, torch::Tensor(), torch::Tensor()};
    }

private:
    static Geometry geometry(const torch::Tensor& q, const torch::Tensor& v, int64_t kernel_size) {
        Geometry g;
        g.BH = q.size(0) * q.size(1);
        g.H = q.size(2);
        g.W = q.size(3);
        g.d = q.size(4);
        g.dv = v.size(4);
        g.K = kernel_size;
        g.Ky = std::min(kernel_size, g.H);
        g.Kx = std::min(kernel_size, g.W);
        return g;
    }
};

}  // namespace

torch::Tensor neighborhood_attention_2d_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                              int64_t kernel_size, double scale) {
    const torch::ScalarType type = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    torch::Tensor out = NeighborhoodAttentionFunction::apply(q.to(type).contiguous(), k.to(type).contiguous(),
                                                             v.to(type).contiguous(), kernel_size, scale);
    return out.to(q.scalar_type());
}

}  // namespace linvis::ops::cpu
