// Fused CPU head-wise linear: one pass over the rows for the forward and for the input gradient,
// and a pass per group of heads for the weight and bias gradients. No layout copies (x is read in
// its (N, H, I) layout, row n at x + n * ldx, so a chunk of a wider tensor is read in place) and no
// batched GEMM of tiny blocks; see linvis/ops/linear_headwise.h.
#include "ops/linear_headwise/cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "linvis/core/error.h"
#include "ops/records_graph.h"
#include "ops/simd/simd.h"

namespace linvis::ops::cpu {
namespace {

// Rows per parallel task: enough work per task to amortise the scheduling on small inputs.
constexpr int64_t kRowGrain = 64;

// One row: y[h, o] = b[h O + o] + sum_i x[h, i] w[h, o, i], with the weight given transposed per head,
// wt[h, i, o]: the o outputs of a head are then contiguous lanes (x[h, i] broadcast times a row of wt),
// which the compiler vectorises; each output still sums b, then i = 0, 1, ... in order.
template <typename T, int kO, int kI>
inline void forward_row(const T* xr, const T* wt, const T* b, T* yr, int64_t H, int64_t O_, int64_t I_) {
    const int64_t O = kO ? kO : O_, I = kI ? kI : I_;
    for (int64_t h = 0; h < H; ++h) {
        const T* xh = xr + h * I;
        const T* wth = wt + h * I * O;
        T* yh = yr + h * O;
        for (int64_t o = 0; o < O; ++o) yh[o] = b[h * O + o];
        for (int64_t i = 0; i < I; ++i) {
            const T xi = xh[i];
            for (int64_t o = 0; o < O; ++o) yh[o] += xi * wth[i * O + o];
        }
    }
}

// Every row n of x (row stride ldx) into y (rows of H O).
template <typename T, int kO, int kI>
void forward_rows(const T* x, int64_t ldx, const T* wt, const T* b, T* y, int64_t N, int64_t H, int64_t O,
                  int64_t I) {
    at::parallel_for(0, N, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) forward_row<T, kO, kI>(x + n * ldx, wt, b, y + n * H * O, H, O, I);
    });
}

// The same on bfloat16 rows (their bits) with a float32 weight and bias: each row widened, computed in
// float32 as above and rounded once, so the result is the float32 kernel's on the widened x, rounded.
template <int kO, int kI>
void forward_rows_bf16(const uint16_t* x, int64_t ldx, const float* wt, const float* b, uint16_t* y, int64_t N,
                       int64_t H, int64_t O, int64_t I) {
    const simd::Kernels& k = simd::kernels();
    at::parallel_for(0, N, kRowGrain, [&](int64_t begin, int64_t end) {
        std::vector<float> xr(static_cast<size_t>(H * I)), yr(static_cast<size_t>(H * O));
        for (int64_t n = begin; n < end; ++n) {
            k.widen_bf16(x + n * ldx, xr.data(), H * I);
            forward_row<float, kO, kI>(xr.data(), wt, b, yr.data(), H, O, I);
            k.narrow_to_bf16(yr.data(), y + n * H * O, H * O);
        }
    });
}

// dx[n, h, i] = sum_o dy[n, h, o] w[h, o, i]
template <typename T, int kO, int kI>
void input_grad_rows(const T* dy, const T* w, T* dx, int64_t N, int64_t H, int64_t O_, int64_t I_) {
    const int64_t O = kO ? kO : O_, I = kI ? kI : I_;
    at::parallel_for(0, N, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            const T* dyr = dy + n * H * O;
            T* dxr = dx + n * H * I;
            for (int64_t h = 0; h < H; ++h) {
                const T* wh = w + h * O * I;
                T* dxh = dxr + h * I;
                for (int64_t i = 0; i < I; ++i) dxh[i] = T(0);
                for (int64_t o = 0; o < O; ++o) {
                    const T g = dyr[h * O + o];
                    for (int64_t i = 0; i < I; ++i) dxh[i] += g * wh[o * I + i];
                }
            }
        }
    });
}

// dw[h, o, i] = sum_n dy[n, h, o] x[n, h, i];  db[h O + o] = sum_n dy[n, h, o]. Parallel over heads,
// so each task owns its slice of dw / db and sums over all rows in the same order on any thread count.
template <typename T, int kO, int kI>
void weight_grad_heads(const T* dy, const T* x, int64_t ldx, T* dw, T* db, int64_t N, int64_t H, int64_t O_,
                       int64_t I_) {
    const int64_t O = kO ? kO : O_, I = kI ? kI : I_;
    at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
        std::fill(dw + begin * O * I, dw + end * O * I, T(0));
        std::fill(db + begin * O, db + end * O, T(0));
        // Rows outer, this task's blocks inner: x and dy are read a row segment at a time and the
        // task's accumulators stay in cache; each entry still sums over n in ascending order.
        for (int64_t n = 0; n < N; ++n) {
            const T* dyr = dy + n * H * O;
            const T* xr = x + n * ldx;
            for (int64_t h = begin; h < end; ++h) {
                const T* dyh = dyr + h * O;
                const T* xh = xr + h * I;
                T* dwh = dw + h * O * I;
                for (int64_t o = 0; o < O; ++o) {
                    const T g = dyh[o];
                    db[h * O + o] += g;
                    for (int64_t i = 0; i < I; ++i) dwh[o * I + i] += g * xh[i];
                }
            }
        }
    });
}

// Calls kernel<T, 4, 4> for ViL's 4 x 4 blocks (fully unrolled inner loops), kernel<T, 0, 0> otherwise.
#define LINVIS_HEADWISE_CALL(kernel, T, O, I, ...) \
    ((O) == 4 && (I) == 4 ? kernel<T, 4, 4>(__VA_ARGS__) : kernel<T, 0, 0>(__VA_ARGS__))

torch::ScalarType compute_type(const torch::Tensor& x) {
    return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// x as (N, H * I) rows in the compute dtype with unit column stride. reshape keeps a view when the leading
// dims merge into one row stride (a chunk of a wider tensor does); a copy only when they do not.
torch::Tensor rows(const torch::Tensor& x, torch::ScalarType type) {
    torch::Tensor r = x.to(type).reshape({-1, x.size(-1)});
    return r.size(1) <= 1 || r.stride(1) == 1 ? r : r.contiguous();
}

class LinearHeadwiseFunction : public torch::autograd::Function<LinearHeadwiseFunction> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x2d,
                                 const torch::Tensor& weight, const torch::Tensor& bias) {
        ctx->save_for_backward({x2d, weight});
        const int64_t N = x2d.size(0), H = weight.size(0), O = weight.size(1), I = weight.size(2);
        torch::Tensor y = torch::empty({N, H * O}, x2d.options());
        const torch::Tensor wt = weight.transpose(1, 2).contiguous();  // (H, I, O), H * O * I elements
        AT_DISPATCH_FLOATING_TYPES(x2d.scalar_type(), "linear_headwise_fused", [&] {
            LINVIS_HEADWISE_CALL(forward_rows, scalar_t, O, I, x2d.data_ptr<scalar_t>(), x2d.stride(0),
                                 wt.data_ptr<scalar_t>(),
                                 bias.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), N, H, O, I);
        });
        return y;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor& x2d = saved[0];
        const torch::Tensor& weight = saved[1];
        const int64_t N = x2d.size(0), H = weight.size(0), O = weight.size(1), I = weight.size(2);
        torch::Tensor dy = grad_outputs[0].to(x2d.scalar_type()).contiguous();
        torch::Tensor dx, dw, db;
        AT_DISPATCH_FLOATING_TYPES(x2d.scalar_type(), "linear_headwise_fused_backward", [&] {
            if (ctx->needs_input_grad(0)) {
                dx = torch::empty({N, H * I}, x2d.options());
                LINVIS_HEADWISE_CALL(input_grad_rows, scalar_t, O, I, dy.data_ptr<scalar_t>(),
                                     weight.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), N, H, O, I);
            }
            if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
                dw = torch::empty_like(weight);
                db = torch::empty({H * O}, weight.options());
                LINVIS_HEADWISE_CALL(weight_grad_heads, scalar_t, O, I, dy.data_ptr<scalar_t>(),
                                     x2d.data_ptr<scalar_t>(), x2d.stride(0), dw.data_ptr<scalar_t>(),
                                     db.data_ptr<scalar_t>(), N, H, O, I);
            }
        });
        if (!ctx->needs_input_grad(1)) dw = torch::Tensor();
        if (!ctx->needs_input_grad(2)) db = torch::Tensor();
        return {dx, dw, db};
    }
};

}  // namespace

torch::Tensor linear_headwise_fused(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
    LINVIS_CHECK(x.device().is_cpu() && weight.device().is_cpu(),
                 "linear_headwise (fused): only CPU tensors are supported, got ", x.device().str());
    LINVIS_CHECK(x.is_floating_point() && weight.is_floating_point(),
                 "linear_headwise (fused): x and weight must be floating-point");
    const auto type = compute_type(x);
    const torch::Tensor w = weight.to(type).contiguous();
    // A missing bias is a zero vector: LibTorch 1.13's autograd functions reject undefined inputs.
    const torch::Tensor b = bias.defined() ? bias.to(type).contiguous() : torch::zeros({w.size(0) * w.size(1)}, w.options());
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0) * weight.size(1);
    if (x.scalar_type() == torch::kBFloat16 && !records_graph({x, weight, bias})) {
        // bfloat16 outside a graph: widened a row at a time, not as a float32 copy of x and of y.
        const torch::Tensor x2d = rows(x, torch::kBFloat16);
        const int64_t N = x2d.size(0), H = w.size(0), O = w.size(1), I = w.size(2);
        torch::Tensor y = torch::empty({N, H * O}, x2d.options());
        const torch::Tensor wt = w.transpose(1, 2).contiguous();
        auto bits = [](const torch::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); };
        (O == 4 && I == 4 ? forward_rows_bf16<4, 4> : forward_rows_bf16<0, 0>)(
            bits(x2d), x2d.stride(0), wt.data_ptr<float>(), b.data_ptr<float>(), bits(y), N, H, O, I);
        return y.view(shape);
    }
    torch::Tensor y = LinearHeadwiseFunction::apply(rows(x, type), w, b);
    return y.view(shape).to(x.scalar_type());
}

}  // namespace linvis::ops::cpu
