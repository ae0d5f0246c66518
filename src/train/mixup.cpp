#include "linvis/train/mixup.h"

#include <algorithm>
#include <cmath>

namespace linvis::train {
namespace {

double sample_beta(double alpha, std::mt19937_64& rng) {
    std::gamma_distribution<double> gamma(alpha, 1.0);
    const double x = gamma(rng), y = gamma(rng);
    return x / (x + y);
}

}  // namespace

torch::Tensor smooth_one_hot(const torch::Tensor& labels, int64_t num_classes, double smoothing) {
    const double off = smoothing / static_cast<double>(num_classes);
    torch::Tensor targets = torch::full({labels.size(0), num_classes}, off, torch::kFloat32);
    targets.scatter_(1, labels.view({-1, 1}).to(torch::kLong), 1.0 - smoothing + off);
    return targets;
}

torch::Tensor mix_batch(torch::Tensor& images, const torch::Tensor& labels, int64_t num_classes,
                        const MixupConfig& config, std::mt19937_64& rng) {
    torch::Tensor targets = smooth_one_hot(labels, num_classes, config.label_smoothing);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    const bool enabled = (config.mixup_alpha > 0 || config.cutmix_alpha > 0) && uniform(rng) < config.prob;
    if (!enabled) return targets;
    const bool use_cutmix = config.cutmix_alpha > 0 && (config.mixup_alpha <= 0 || uniform(rng) < config.switch_prob);
    double lam = sample_beta(use_cutmix ? config.cutmix_alpha : config.mixup_alpha, rng);
    torch::NoGradGuard no_grad;
    torch::Tensor flipped = images.flip({0});
    if (use_cutmix) {
        const int64_t h = images.size(2), w = images.size(3);
        const double cut = std::sqrt(1.0 - lam);
        const int64_t cut_h = static_cast<int64_t>(h * cut), cut_w = static_cast<int64_t>(w * cut);
        std::uniform_int_distribution<int64_t> cy_dist(0, h - 1), cx_dist(0, w - 1);
        const int64_t cy = cy_dist(rng), cx = cx_dist(rng);
        const int64_t y0 = std::clamp<int64_t>(cy - cut_h / 2, 0, h), y1 = std::clamp<int64_t>(cy + cut_h / 2, 0, h);
        const int64_t x0 = std::clamp<int64_t>(cx - cut_w / 2, 0, w), x1 = std::clamp<int64_t>(cx + cut_w / 2, 0, w);
        images.index_put_({torch::indexing::Slice(), torch::indexing::Slice(), torch::indexing::Slice(y0, y1),
                           torch::indexing::Slice(x0, x1)},
                          flipped.index({torch::indexing::Slice(), torch::indexing::Slice(),
                                         torch::indexing::Slice(y0, y1), torch::indexing::Slice(x0, x1)}));
        // The label weight is the area actually kept after clipping the box to the image.
        lam = 1.0 - static_cast<double>((y1 - y0) * (x1 - x0)) / static_cast<double>(h * w);
    } else {
        images.mul_(lam).add_(flipped, 1.0 - lam);
    }
    return targets * lam + targets.flip({0}) * (1.0 - lam);
}

torch::Tensor soft_target_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
    return (-targets * torch::log_softmax(logits.to(torch::kFloat32), -1)).sum(-1).mean();
}

}  // namespace linvis::train
