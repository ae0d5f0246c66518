#include "linvis/nn/batch_norm.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "linvis/core/error.h"
#include "linvis/nn/checkpoint.h"
#include "linvis/nn/common.h"
#include "linvis/nn/vit.h"

namespace linvis::nn {
namespace {

// The norm's output recomputed for a pointwise conv's weight gradient: pixels a slab at a time, about this many bytes.
constexpr int64_t kNormOutputSlabBytes = int64_t{4} << 20;

CrossProcessSum& sync_sum() {
    static CrossProcessSum sum;
    return sum;
}

// The norm's input gradient written over g (N, C, H, W contiguous, the gradient at the norm's output, or at the ReLU's
// with Relu), per channel over its M = N*H*W values with xhat = (x - mean) * invstd and the norm's output z:
// g = 0 where Relu and z <= 0; dbias = sum g; dweight = sum g * xhat; dx = weight * invstd * (g - dbias / M -
// xhat * dweight / M). Fills dweight and dbias (C).
template <typename T, bool Relu>
void batch_norm_backward_into(const torch::Tensor& x, torch::Tensor& g, const torch::Tensor& mean,
                              const torch::Tensor& invstd, const torch::Tensor& weight, const torch::Tensor& bias,
                              torch::Tensor& dweight, torch::Tensor& dbias) {
    constexpr int64_t kBlock = 1024;  // values summed in T (vectorised), each block's sums added in double
    const int64_t N = x.size(0), C = x.size(1), plane = x.size(2) * x.size(3);
    const T* xs = x.data_ptr<T>();
    T* gs = g.data_ptr<T>();
    const T *means = mean.data_ptr<T>(), *invstds = invstd.data_ptr<T>();
    const T *weights = weight.data_ptr<T>(), *biases = bias.data_ptr<T>();
    T *dweights = dweight.data_ptr<T>(), *dbiases = dbias.data_ptr<T>();
    at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
            const T m = means[c], s = invstds[c], w = weights[c], b = biases[c];
            // The ReLU's mask from the output as the forward computed it (x * scale + shift, LibTorch's CPU
            // formula, and batch_norm_output's), so that no value near 0 is masked differently.
            const T scale = w * s, shift = b - m * scale;
            double sum_g = 0.0, sum_gx = 0.0;
            for (int64_t n = 0; n < N; ++n) {
                const T* xp = xs + (n * C + c) * plane;
                T* gp = gs + (n * C + c) * plane;
                for (int64_t i0 = 0; i0 < plane; i0 += kBlock) {
                    const int64_t i1 = std::min(plane, i0 + kBlock);
                    T block_g = 0, block_gx = 0;
#pragma omp simd reduction(+ : block_g, block_gx)
                    for (int64_t i = i0; i < i1; ++i) {
                        const T xhat = (xp[i] - m) * s;
                        // A select, not a branch: the loop stays vectorised.
                        const T gi = Relu && xp[i] * scale + shift <= T(0) ? T(0) : gp[i];
                        gp[i] = gi;
                        block_g += gi;
                        block_gx += gi * xhat;
                    }
                    sum_g += block_g;
                    sum_gx += block_gx;
                }
            }
            const double count = static_cast<double>(N * plane);
            const T mean_g = static_cast<T>(sum_g / count), k = w * s;
            const T xhat_scale = static_cast<T>(sum_gx / count) * s;
            for (int64_t n = 0; n < N; ++n) {
                const T* xp = xs + (n * C + c) * plane;
                T* gp = gs + (n * C + c) * plane;
#pragma omp simd
                for (int64_t i = 0; i < plane; ++i) gp[i] = k * (gp[i] - mean_g - (xp[i] - m) * xhat_scale);
            }
            dweights[c] = static_cast<T>(sum_gx);
            dbiases[c] = static_cast<T>(sum_g);
        }
    });
}

// The norm's output as its forward computed it, x * scale + shift, then the ReLU: `count` values of one channel.
template <typename T>
void batch_norm_output_values(const T* xp, T* yp, int64_t count, T scale, T shift, bool relu) {
    if (relu) {
#pragma omp simd
        for (int64_t i = 0; i < count; ++i) yp[i] = std::max(xp[i] * scale + shift, T(0));
    } else {
#pragma omp simd
        for (int64_t i = 0; i < count; ++i) yp[i] = xp[i] * scale + shift;
    }
}

// The norm's output (the next conv's input) from x (N, C, H, W) and the batch statistics, weight * (x - mean) *
// invstd + bias, then the ReLU, for sample n's pixels [p0, p1), written as (C, p1 - p0) at `out`, per channel in one
// pass.
template <typename T>
void batch_norm_output_into(const torch::Tensor& x, const torch::Tensor& mean, const torch::Tensor& invstd,
                            const torch::Tensor& weight, const torch::Tensor& bias, bool relu, int64_t n, int64_t p0,
                            int64_t p1, T* out) {
    const int64_t C = x.size(1), plane = x.size(2) * x.size(3), count = p1 - p0;
    const T* xs = x.data_ptr<T>() + n * C * plane + p0;
    const T *means = mean.data_ptr<T>(), *invstds = invstd.data_ptr<T>();
    const T *weights = weight.data_ptr<T>(), *biases = bias.data_ptr<T>();
    at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
            const T scale = weights[c] * invstds[c], shift = biases[c] - means[c] * scale;
            batch_norm_output_values(xs + c * plane, out + c * count, count, scale, shift, relu);
        }
    });
}

struct NormConv : torch::CustomClassHolder {
    torch::nn::BatchNorm2d bn{nullptr};
    torch::nn::Conv2d conv{nullptr};
    bool relu = false;
};

// Inputs: x, the norm's weight and bias, the conv's weight and bias (an empty tensor when it has none).
class BatchNormReluConv : public torch::autograd::Function<BatchNormReluConv> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                 const torch::Tensor& /*norm_weight*/, const torch::Tensor& /*norm_bias*/,
                                 const torch::Tensor& /*conv_weight*/, const torch::Tensor& /*conv_bias*/,
                                 c10::intrusive_ptr<NormConv> layers) {
        torch::NoGradGuard no_grad;
        // As BatchNorm2d's forward in training (momentum, or the cumulative average without one), with the batch
        // statistics it computes kept for the backward.
        torch::nn::BatchNorm2dImpl& bn = *layers->bn;
        double momentum = bn.options.momentum().value_or(0.0);
        if (bn.options.track_running_stats() && bn.num_batches_tracked.defined()) {
            bn.num_batches_tracked += 1;
            if (!bn.options.momentum()) momentum = 1.0 / bn.num_batches_tracked.item<double>();
        }
        auto [y, mean, invstd] = at::native_batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                                       /*training=*/true, momentum, bn.options.eps());
        ctx->save_for_backward({x, mean, invstd});
        ctx->saved_data["layers"] = c10::IValue::make_capsule(layers);
        return conv_forward(layers->conv, layers->relu ? y.relu_() : y);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto layers = c10::static_intrusive_pointer_cast<NormConv>(ctx->saved_data["layers"].toCapsule());
        const std::vector<torch::Tensor> saved = ctx->get_saved_variables();
        const torch::Tensor &x = saved[0], &mean = saved[1], &invstd = saved[2];
        const torch::nn::BatchNorm2dImpl& bn = *layers->bn;
        torch::NoGradGuard no_grad;
        const bool into_norm = ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
        ConvGradients g;
        const torch::Tensor weight = bn.weight.contiguous(), bias = bn.bias.contiguous();
        {
            // The norm's output again, for the conv's weight gradient; gone before the norm's backward. A pointwise
            // conv reads it a slab of pixels at a time, so that it never exists whole.
            const int64_t N = x.size(0), C = x.size(1), plane = x.size(2) * x.size(3);
            // Sample n's pixels [p0, p1) written at `out`, (C, p1 - p0).
            const auto output_into = [&](int64_t n, int64_t p0, int64_t p1, torch::Tensor& out, int64_t offset) {
                AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "batch_norm_output", [&] {
                    batch_norm_output_into<scalar_t>(x, mean, invstd, weight, bias, layers->relu, n, p0, p1,
                                                     out.data_ptr<scalar_t>() + offset);
                });
            };
            const std::array<bool, 3> needs{into_norm, ctx->needs_input_grad(3), ctx->needs_input_grad(4)};
            if (is_pointwise(layers->conv)) {
                const auto slab = [&](int64_t n, int64_t p0, int64_t p1) {
                    torch::Tensor y = torch::empty({C, p1 - p0}, x.options());
                    output_into(n, p0, p1, y, 0);
                    return y;
                };
                g = pointwise_conv_backward(layers->conv, grads[0], slab, needs, kNormOutputSlabBytes);
            } else {
                torch::Tensor y = torch::empty_like(x, torch::MemoryFormat::Contiguous);
                for (int64_t n = 0; n < N; ++n) output_into(n, 0, plane, y, n * C * plane);
                g = conv_backward(layers->conv, grads[0], y, needs);
            }
        }
        torch::autograd::variable_list out(6);  // the last: the layers capsule
        out[3] = g.dweight;
        out[4] = g.dbias;
        if (!into_norm) return out;
        torch::Tensor dx = g.dx.contiguous();
        torch::Tensor dweight = torch::empty_like(mean), dbias = torch::empty_like(mean);
        AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "batch_norm_backward_into", [&] {
            const auto into = layers->relu ? batch_norm_backward_into<scalar_t, true>
                                           : batch_norm_backward_into<scalar_t, false>;
            into(x, dx, mean, invstd, weight, bias, dweight, dbias);
        });
        out[0] = ctx->needs_input_grad(0) ? dx : torch::Tensor();
        out[1] = ctx->needs_input_grad(1) ? dweight : torch::Tensor();
        out[2] = ctx->needs_input_grad(2) ? dbias : torch::Tensor();
        return out;
    }
};

}  // namespace

torch::Tensor batch_norm_relu_conv2d(torch::nn::BatchNorm2dImpl& bn, bool relu, const torch::Tensor& x,
                                     const torch::nn::Conv2d& conv) {
    const bool applies = bn.is_training() && !batch_norm_sync_enabled() && x.dim() == 4 && x.is_contiguous() &&
                         (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64) &&
                         bn.weight.defined() && bn.bias.defined() && bn.weight.scalar_type() == x.scalar_type() &&
                         x.numel() > 0;
    const bool graph = !can_overwrite({x, bn.weight, bn.bias, conv->weight, conv->bias});  // a graph records it
    torch::nn::BatchNorm2d norm(std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(bn.shared_from_this()));
    if (!applies || !graph) {
        return recompute_into_conv2d([norm](const torch::Tensor& t) mutable { return batch_norm(*norm, t); }, relu, x,
                                     module_state(*norm), conv);
    }
    auto layers = c10::make_intrusive<NormConv>();
    layers->bn = norm;
    layers->conv = conv;
    layers->relu = relu;
    return BatchNormReluConv::apply(x, bn.weight, bn.bias, conv->weight,
                                    conv->bias.defined() ? conv->bias : torch::empty({0}, x.options()), layers);
}

void set_batch_norm_sync(CrossProcessSum sum) { sync_sum() = std::move(sum); }
bool batch_norm_sync_enabled() { return static_cast<bool>(sync_sum()); }

torch::Tensor synchronised_batch_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                      torch::Tensor& running_mean, torch::Tensor& running_var,
                                      torch::Tensor& num_batches_tracked, double momentum, double eps) {
    const CrossProcessSum& sum = sync_sum();
    LINVIS_CHECK(static_cast<bool>(sum), "synchronised_batch_norm: no cross-process sum installed");
    LINVIS_CHECK(x.dim() >= 2, "batch_norm: expected (N, C, ...), got ", shape_string(x.sizes()));
    const int64_t channels = x.size(1);
    std::vector<int64_t> dims{0}, shape(static_cast<size_t>(x.dim()), 1);
    for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
    shape[1] = channels;
    // Two passes over the global batch (mean, then the centred squares): the same numerics as one
    // process computing the variance of the whole batch, without E[x^2] - E[x]^2 cancellation.
    const torch::Tensor xf = x.to(torch::kFloat32);
    const double local_count = static_cast<double>(x.numel() / channels);
    torch::Tensor count = sum(torch::full({1}, local_count, xf.options()));
    const double n = count.item<double>();
    torch::Tensor mean = sum(xf.sum(dims)) / n;
    torch::Tensor centred = xf - mean.view(shape);
    torch::Tensor var = sum(centred.square().sum(dims)) / n;
    torch::Tensor y = centred * torch::rsqrt(var + eps).view(shape);
    if (weight.defined()) y = y * weight.view(shape);
    if (bias.defined()) y = y + bias.view(shape);
    {
        torch::NoGradGuard no_grad;
        if (running_mean.defined()) running_mean.mul_(1.0 - momentum).add_(mean.detach(), momentum);
        if (running_var.defined())
            running_var.mul_(1.0 - momentum).add_(var.detach() * (n / std::max(n - 1.0, 1.0)), momentum);
        if (num_batches_tracked.defined()) num_batches_tracked.add_(1);
    }
    return y.to(x.scalar_type());
}

bool batch_norm_eval_into(const torch::nn::BatchNorm2dImpl& bn, torch::Tensor& x) {
    const torch::Tensor &mean = bn.running_mean, &var = bn.running_var, &weight = bn.weight, &bias = bn.bias;
    if (bn.is_training() || !mean.defined() || !var.defined() || x.dim() < 2 || x.size(1) != mean.size(0)) return false;
    if (x.scalar_type() != torch::kFloat32 && x.scalar_type() != torch::kFloat64) return false;
    if (mean.scalar_type() != x.scalar_type() || (weight.defined() && weight.scalar_type() != x.scalar_type()))
        return false;
    if (torch::GradMode::is_enabled() && (x.requires_grad() || (weight.defined() && weight.requires_grad()) ||
                                          (bias.defined() && bias.requires_grad())))
        return false;
    torch::NoGradGuard no_grad;
    std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
    shape[1] = x.size(1);
    const BatchNormAffine a = batch_norm_eval_affine(bn, x.scalar_type());
    at::addcmul_out(x, a.beta.view(shape), x, a.alpha.view(shape));
    return true;
}

BatchNormAffine batch_norm_eval_affine(const torch::nn::BatchNorm2dImpl& bn, torch::ScalarType dtype) {
    LINVIS_CHECK(bn.running_mean.defined() && bn.running_var.defined(),
                 "batch_norm_eval_affine: the norm keeps no running statistics");
    torch::NoGradGuard no_grad;
    torch::Tensor alpha = torch::sqrt(bn.running_var.to(dtype) + bn.options.eps()).reciprocal_();
    if (bn.weight.defined()) alpha.mul_(bn.weight.to(dtype));
    torch::Tensor beta = -(bn.running_mean.to(dtype) * alpha);
    if (bn.bias.defined()) beta.add_(bn.bias.to(dtype));
    return {alpha, beta};
}

}  // namespace linvis::nn
