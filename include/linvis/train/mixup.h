// Mixup / CutMix with label smoothing (timm's Mixup in "batch" mode) and the soft-target
// cross-entropy they need.
#pragma once

#include <cstdint>
#include <random>

#include <torch/torch.h>

namespace linvis::train {

struct MixupConfig {
    double mixup_alpha = 0.8;   // Beta(alpha, alpha) for mixup; 0 disables
    double cutmix_alpha = 1.0;  // Beta(alpha, alpha) for cutmix; 0 disables
    double prob = 1.0;          // probability of mixing a batch at all
    double switch_prob = 0.5;   // probability of cutmix when both are enabled
    double label_smoothing = 0.1;
};

// One-hot targets with smoothing: (1 - s) on the class plus s / C everywhere.
torch::Tensor smooth_one_hot(const torch::Tensor& labels, int64_t num_classes, double smoothing);

// Mixes `images` (B, C, H, W) in place with their batch-reversed order and returns the soft
// targets (B, num_classes). Randomness comes from `rng` only, so runs are reproducible.
torch::Tensor mix_batch(torch::Tensor& images, const torch::Tensor& labels, int64_t num_classes,
                        const MixupConfig& config, std::mt19937_64& rng);

// Mean over the batch of -sum(target * log_softmax(logits)).
torch::Tensor soft_target_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace linvis::train
