#include "linvis/nn/batch_norm.h"

#include "linvis/core/error.h"

namespace linvis::nn {
namespace {

CrossProcessSum& sync_sum() {
    static CrossProcessSum sum;
    return sum;
}

}  // namespace

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
    torch::Tensor alpha = torch::sqrt(var + bn.options.eps()).reciprocal_();
    if (weight.defined()) alpha.mul_(weight);
    torch::Tensor beta = -(mean * alpha);
    if (bias.defined()) beta.add_(bias);
    at::addcmul_out(x, beta.view(shape), x, alpha.view(shape));
    return true;
}

}  // namespace linvis::nn
