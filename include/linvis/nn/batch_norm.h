// BatchNorm whose training statistics can span several processes (synchronised BatchNorm).
//
// Models call nn::batch_norm(bn, x) instead of bn->forward(x). With no cross-process sum installed
// (one process, or evaluation) it is torch's batch_norm. While training with a sum installed
// (the distributed trainer installs one, linvis/train/distributed.h), the batch mean and variance are
// those of the global batch: per-channel sums are added over all processes by a differentiable
// all-reduce, so the gradients are those of one process holding the whole batch.
#pragma once

#include <functional>

#include <torch/torch.h>

namespace linvis::nn {

// Sums a tensor over all processes, differentiably (its backward sums the gradients over all processes).
using CrossProcessSum = std::function<torch::Tensor(const torch::Tensor&)>;

// Installs (or with an empty function removes) the process-wide sum used by batch_norm while training.
void set_batch_norm_sync(CrossProcessSum sum);
bool batch_norm_sync_enabled();

// Training-mode BatchNorm over dimension 1 of x (N, C, ...) with the statistics of the global batch
// (the installed sum must be set); running statistics are updated as torch does (momentum,
// unbiased variance).
torch::Tensor synchronised_batch_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                      torch::Tensor& running_mean, torch::Tensor& running_var,
                                      torch::Tensor& num_batches_tracked, double momentum, double eps);

// bn->forward(x), or synchronised_batch_norm while training with a cross-process sum installed.
template <typename BatchNormImpl>
torch::Tensor batch_norm(BatchNormImpl& bn, const torch::Tensor& x) {
    if (!bn.is_training() || !batch_norm_sync_enabled()) return bn.forward(x);
    return synchronised_batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked,
                                   bn.options.momentum().value_or(0.1), bn.options.eps());
}

// Eval-mode BatchNorm written into x, for inference on a fresh tensor that nothing else reads (a conv's output):
// x * alpha + beta per channel with alpha = weight / sqrt(running_var + eps) and beta = bias - running_mean * alpha,
// the terms LibTorch's CPU inference kernel computes, in one pass and without a second tensor of x's size. Returns
// false, leaving x as it was, where that does not apply: training mode, no running statistics, a graph being
// recorded through x or the parameters, or x not float32 / float64 of the parameters' dtype.
bool batch_norm_eval_into(const torch::nn::BatchNorm2dImpl& bn, torch::Tensor& x);
// Those per-channel terms, alpha and beta (C), computed in `dtype` from the norm's running statistics (which it
// must have) and its affine parameters where defined; also what a conv with the norm folded in needs.
struct BatchNormAffine {
    torch::Tensor alpha, beta;
};
BatchNormAffine batch_norm_eval_affine(const torch::nn::BatchNorm2dImpl& bn, torch::ScalarType dtype);

// conv_forward(conv, [relu](batch_norm(bn, x))) for a BatchNorm2d between two convs in a training step, as one graph
// node that keeps x (the first conv's output, contiguous) and the batch's per-channel mean and 1/std, and no map
// derived from x. Its backward recomputes the norm's output once (the conv's input, for its weight gradient), takes
// the conv's gradients (nn::conv_backward), then in two passes per channel masks the ReLU's gradient and writes the
// norm's input gradient into the same map, LibTorch's formula with double sums: no map-sized temporary, where
// LibTorch's ReLU and BatchNorm backward allocate three. The forward is bn's own (running statistics updated once).
// The same values and gradients as the three modules. Where it does not apply (bn in eval mode, a cross-process sum
// installed, x not float32 / float64 or not 4-D), nn::recompute_into_conv2d with bn's forward.
torch::Tensor batch_norm_relu_conv2d(torch::nn::BatchNorm2dImpl& bn, bool relu, const torch::Tensor& x,
                                     const torch::nn::Conv2d& conv);

}  // namespace linvis::nn
