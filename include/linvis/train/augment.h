// Training augmentations of the DeiT recipe, on float images (C, H, W) with values in [0, 1]
// before normalisation: RandomResizedCrop, horizontal flip, RandAugment
// ("rand-m9-mstd0.5-inc1": 2 ops per image, magnitude 9 out of 10 with Gaussian noise of
// std 0.5, the increasing-severity op variants), and random erasing. Every random choice
// comes from the std::mt19937_64 passed in, so a (seed, epoch, index) stream reproduces it.
#pragma once

#include <array>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace linvis::train {

struct TrainAugmentConfig {
    int64_t img_size = 224;
    double scale_min = 0.08, scale_max = 1.0;            // RandomResizedCrop area fraction
    double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0; // aspect ratio range
    double hflip = 0.5;
    int rand_augment_ops = 2;         // 0 disables RandAugment
    double rand_augment_magnitude = 9.0;
    double rand_augment_magnitude_std = 0.5;
    double random_erase = 0.25;       // probability
    std::array<double, 3> mean{0.485, 0.456, 0.406};
    std::array<double, 3> std{0.229, 0.224, 0.225};
};

// Crop box (top, left, height, width) of RandomResizedCrop for an h x w image (torchvision's
// sampling: 10 attempts, then a centre crop of the clamped aspect ratio).
std::array<int64_t, 4> random_resized_crop_box(int64_t h, int64_t w, const TrainAugmentConfig& config,
                                               std::mt19937_64& rng);

// Names of the RandAugment operations in the order they are drawn from.
const std::vector<std::string>& rand_augment_op_names();
// Applies one named RandAugment op at magnitude m (0..10) to a (3, H, W) image in [0, 1].
torch::Tensor apply_rand_augment_op(const torch::Tensor& image, const std::string& op, double magnitude,
                                    std::mt19937_64& rng);

// The full training transform: crop + resize (bicubic) to img_size, flip, RandAugment,
// normalise, random erasing. Input (3, H, W) float in [0, 1]; output (3, img_size, img_size).
torch::Tensor train_transform(const torch::Tensor& image, const TrainAugmentConfig& config, std::mt19937_64& rng);

}  // namespace linvis::train
