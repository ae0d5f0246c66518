// How good are a diffusion model's class-conditional samples, measured with a linvis classifier
// (`linvis eval --task diffusion`, docs/generation.md):
//  - a Frechet distance between Gaussians fitted to the classifier's penultimate features
//    (VisionModel::forward_head(forward_features(x), pre_logits=true)) of the samples and of real images.
//    This is FID's formula on the features of a small linvis classifier, NOT Inception FID: its values
//    are not comparable with published FIDs, only with each other (same classifier, same counts);
//  - the classifier's top-1 accuracy on the samples against the labels they were conditioned on.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "linvis/models/model.h"

namespace linvis::train {

// Mean (D,) and covariance (D, D) of features (N, D), in float64. The covariance is the unbiased one
// (divided by N - 1, as numpy.cov in the FID reference code); N >= 2.
struct GaussianStats {
    torch::Tensor mean, cov;
    int64_t count = 0;
};
GaussianStats gaussian_statistics(const torch::Tensor& features);

// |m1 - m2|^2 + tr(S1 + S2 - 2 (S1 S2)^1/2) in float64. The trace of the matrix square root is taken
// stably from the symmetric positive semi-definite matrix sqrt(S1) S2 sqrt(S1), which is similar to
// S1 S2: tr((S1 S2)^1/2) = sum of the square roots of its eigenvalues (negative round-off clamped to 0);
// sqrt(S1) from the eigendecomposition of S1. Symmetric in its arguments up to rounding.
double frechet_distance(const GaussianStats& a, const GaussianStats& b);
// The same from two feature sets (N1, D) and (N2, D).
double frechet_distance(const torch::Tensor& features_a, const torch::Tensor& features_b);

// Diffusion pixels in [-1, 1] (B, C, L, L) -> a classifier's input (B, C, size, size): (x + 1) / 2,
// clamped to [0, 1], resized to `size` as the data pipeline resizes (bicubic, align_corners=false,
// antialiased when shrinking, clamped to [0, 1]; Fashion-MNIST's 28 -> 32 in reverse), then normalised
// with the classifier's per-channel mean / std (one value: the same for every channel).
torch::Tensor diffusion_pixels_to_classifier_input(const torch::Tensor& x, int64_t size, const std::vector<double>& mean,
                                                   const std::vector<double>& std);

// The classifier (eval mode, no gradients) on `inputs` in batches of batch_size: pooled penultimate
// features (N, num_features) and logits (N, num_classes), float32.
struct ClassifierOutputs {
    torch::Tensor features, logits;
};
ClassifierOutputs classifier_outputs(models::VisionModel& classifier, const torch::Tensor& inputs, int64_t batch_size = 256);

// Top-1 accuracy in percent of logits (N, K) against labels (N,): the share of argmax == label.
double top1_accuracy(const torch::Tensor& logits, const torch::Tensor& labels);

}  // namespace linvis::train
