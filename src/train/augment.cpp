#include "linvis/train/augment.h"

#include <cmath>

#include "linvis/core/error.h"

namespace linvis::train {
namespace {

namespace F = torch::nn::functional;
using torch::indexing::Slice;

double uniform(std::mt19937_64& rng, double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
}

// Fill colour of geometric ops: the ImageNet mean pixel, as timm's RandAugment uses.
torch::Tensor fill_colour(const torch::Tensor& image) {
    return torch::tensor({124.0 / 255.0, 116.0 / 255.0, 104.0 / 255.0}, image.options()).view({3, 1, 1});
}

// Applies the affine map taking output pixel coordinates to input coordinates
// (in normalised [-1, 1] units), filling outside with the mean colour.
torch::Tensor affine(const torch::Tensor& image, const std::array<double, 6>& theta) {
    torch::Tensor t = torch::tensor({theta[0], theta[1], theta[2], theta[3], theta[4], theta[5]}, image.options())
                          .view({1, 2, 3});
    auto grid = F::affine_grid(t, {1, image.size(0), image.size(1), image.size(2)}, false);
    torch::Tensor with_mask = torch::cat({image, torch::ones_like(image.slice(0, 0, 1))}, 0).unsqueeze(0);
    torch::Tensor warped = F::grid_sample(with_mask, grid,
                                          F::GridSampleFuncOptions().mode(torch::kBilinear).padding_mode(torch::kZeros)
                                              .align_corners(false))
                               .squeeze(0);
    torch::Tensor mask = warped.slice(0, 3, 4);
    return warped.slice(0, 0, 3) + (1.0 - mask) * fill_colour(image);
}

torch::Tensor grayscale(const torch::Tensor& image) {
    return (0.299 * image[0] + 0.587 * image[1] + 0.114 * image[2]).unsqueeze(0);
}

torch::Tensor blend(const torch::Tensor& a, const torch::Tensor& b, double factor) {
    return (b + factor * (a - b)).clamp(0.0, 1.0);  // factor 1: a; 0: b
}

double signed_level(double value, std::mt19937_64& rng) {
    return std::bernoulli_distribution(0.5)(rng) ? -value : value;
}

torch::Tensor equalize(const torch::Tensor& image) {
    torch::Tensor quantised = (image * 255.0).round().clamp(0, 255).to(torch::kLong);
    std::vector<torch::Tensor> channels;
    for (int64_t c = 0; c < 3; ++c) {
        torch::Tensor q = quantised[c];
        torch::Tensor hist = torch::bincount(q.flatten(), {}, 256).to(torch::kFloat64);
        torch::Tensor cdf = hist.cumsum(0);
        const double total = cdf[-1].item<double>();
        const double first = cdf.masked_select(hist > 0)[0].item<double>();
        if (total - first <= 0) {
            channels.push_back(image[c]);
            continue;
        }
        torch::Tensor lut = ((cdf - first) / (total - first) * 255.0).clamp(0, 255).round() / 255.0;
        channels.push_back(lut.index_select(0, q.flatten()).view_as(q).to(image.scalar_type()));
    }
    return torch::stack(channels);
}

}  // namespace

std::array<int64_t, 4> random_resized_crop_box(int64_t h, int64_t w, const TrainAugmentConfig& config,
                                               std::mt19937_64& rng) {
    const double area = static_cast<double>(h * w);
    const double log_lo = std::log(config.ratio_min), log_hi = std::log(config.ratio_max);
    for (int attempt = 0; attempt < 10; ++attempt) {
        const double target = area * uniform(rng, config.scale_min, config.scale_max);
        const double ratio = std::exp(uniform(rng, log_lo, log_hi));
        const int64_t cw = static_cast<int64_t>(std::round(std::sqrt(target * ratio)));
        const int64_t ch = static_cast<int64_t>(std::round(std::sqrt(target / ratio)));
        if (cw > 0 && ch > 0 && cw <= w && ch <= h) {
            const int64_t top = std::uniform_int_distribution<int64_t>(0, h - ch)(rng);
            const int64_t left = std::uniform_int_distribution<int64_t>(0, w - cw)(rng);
            return {top, left, ch, cw};
        }
    }
    const double ratio = static_cast<double>(w) / static_cast<double>(h);
    int64_t cw = w, ch = h;
    if (ratio < config.ratio_min) ch = static_cast<int64_t>(std::round(w / config.ratio_min));
    else if (ratio > config.ratio_max) cw = static_cast<int64_t>(std::round(h * config.ratio_max));
    return {(h - ch) / 2, (w - cw) / 2, ch, cw};
}

const std::vector<std::string>& rand_augment_op_names() {
    static const std::vector<std::string> names = {
        "AutoContrast", "Equalize",  "Invert",     "Rotate",     "PosterizeIncreasing", "SolarizeIncreasing",
        "SolarizeAdd",  "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing",
        "ShearX",       "ShearY",    "TranslateXRel", "TranslateYRel"};
    return names;
}

torch::Tensor apply_rand_augment_op(const torch::Tensor& image, const std::string& op, double magnitude,
                                    std::mt19937_64& rng) {
    const double m = std::clamp(magnitude, 0.0, 10.0) / 10.0;  // fraction of the maximum strength
    if (op == "AutoContrast") {
        torch::Tensor lo = image.amin({1, 2}, true), hi = image.amax({1, 2}, true);
        torch::Tensor scale = torch::where(hi > lo, 1.0 / (hi - lo), torch::ones_like(hi));
        return torch::where(hi > lo, (image - lo) * scale, image).clamp(0.0, 1.0);
    }
    if (op == "Equalize") return equalize(image);
    if (op == "Invert") return 1.0 - image;
    if (op == "Rotate") {
        const double angle = signed_level(30.0 * m, rng) * M_PI / 180.0;
        const double aspect = static_cast<double>(image.size(1)) / static_cast<double>(image.size(2));
        return affine(image, {std::cos(angle), -std::sin(angle) * aspect, 0.0, std::sin(angle) / aspect,
                              std::cos(angle), 0.0});
    }
    if (op == "PosterizeIncreasing") {
        const int bits = 4 - static_cast<int>(m * 4.0);  // increasing severity: fewer bits kept
        const double levels = std::pow(2.0, std::max(bits, 1));
        return torch::floor(image * 255.0 / (256.0 / levels)) * (256.0 / levels) / 255.0;
    }
    if (op == "SolarizeIncreasing") {
        const double threshold = 1.0 - m;  // increasing severity: lower threshold
        return torch::where(image >= threshold, 1.0 - image, image);
    }
    if (op == "SolarizeAdd") {
        const double add = 110.0 * m / 255.0;
        return torch::where(image < 128.0 / 255.0, (image + add).clamp(0.0, 1.0), image);
    }
    if (op == "ColorIncreasing")
        return blend(image, grayscale(image).expand_as(image), 1.0 + signed_level(0.9 * m, rng));
    if (op == "ContrastIncreasing")
        return blend(image, grayscale(image).mean().expand_as(image), 1.0 + signed_level(0.9 * m, rng));
    if (op == "BrightnessIncreasing")
        return blend(image, torch::zeros_like(image), 1.0 + signed_level(0.9 * m, rng));
    if (op == "SharpnessIncreasing") {
        torch::Tensor kernel = torch::tensor({1.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 1.0}, image.options()) / 13.0;
        torch::Tensor smooth = F::conv2d(F::pad(image.unsqueeze(0), F::PadFuncOptions({1, 1, 1, 1}).mode(torch::kReplicate)),
                                         kernel.view({1, 1, 3, 3}).expand({3, 1, 3, 3}).contiguous(),
                                         F::Conv2dFuncOptions().groups(3))
                                   .squeeze(0);
        return blend(image, smooth, 1.0 + signed_level(0.9 * m, rng));
    }
    if (op == "ShearX") return affine(image, {1.0, signed_level(0.3 * m, rng), 0.0, 0.0, 1.0, 0.0});
    if (op == "ShearY") return affine(image, {1.0, 0.0, 0.0, signed_level(0.3 * m, rng), 1.0, 0.0});
    if (op == "TranslateXRel") return affine(image, {1.0, 0.0, signed_level(0.45 * m, rng) * 2.0, 0.0, 1.0, 0.0});
    if (op == "TranslateYRel") return affine(image, {1.0, 0.0, 0.0, 0.0, 1.0, signed_level(0.45 * m, rng) * 2.0});
    fail("RandAugment: unknown op '", op, "'");
}

torch::Tensor train_transform(const torch::Tensor& image, const TrainAugmentConfig& config, std::mt19937_64& rng) {
    LINVIS_CHECK(image.dim() == 3 && image.size(0) == 3, "train_transform: expected a (3, H, W) image, got ",
                 shape_string(image.sizes()));
    const auto box = random_resized_crop_box(image.size(1), image.size(2), config, rng);
    torch::Tensor crop = image.index({Slice(), Slice(box[0], box[0] + box[2]), Slice(box[1], box[1] + box[3])});
    const auto resize = F::InterpolateFuncOptions()
                            .size(std::vector<int64_t>{config.img_size, config.img_size})
                            .mode(torch::kBicubic)
                            .align_corners(false);
    torch::Tensor out = F::interpolate(crop.unsqueeze(0), resize).squeeze(0).clamp(0.0, 1.0);
    if (std::bernoulli_distribution(config.hflip)(rng)) out = out.flip({2});
    const auto& ops = rand_augment_op_names();
    for (int i = 0; i < config.rand_augment_ops; ++i) {
        const std::string& op = ops[std::uniform_int_distribution<size_t>(0, ops.size() - 1)(rng)];
        double magnitude = config.rand_augment_magnitude;
        if (config.rand_augment_magnitude_std > 0)
            magnitude = std::normal_distribution<double>(magnitude, config.rand_augment_magnitude_std)(rng);
        out = apply_rand_augment_op(out, op, magnitude, rng);
    }
    torch::Tensor mean = torch::tensor({config.mean[0], config.mean[1], config.mean[2]}, out.options()).view({3, 1, 1});
    torch::Tensor std = torch::tensor({config.std[0], config.std[1], config.std[2]}, out.options()).view({3, 1, 1});
    out = (out - mean) / std;
    if (std::bernoulli_distribution(config.random_erase)(rng)) {
        // Random erasing (timm "pixel" mode): a box of 2%-33% of the area filled with N(0, 1) noise.
        const int64_t h = out.size(1), w = out.size(2);
        for (int attempt = 0; attempt < 10; ++attempt) {
            const double target = h * w * uniform(rng, 0.02, 1.0 / 3.0);
            const double ratio = std::exp(uniform(rng, std::log(0.3), std::log(1.0 / 0.3)));
            const int64_t eh = static_cast<int64_t>(std::round(std::sqrt(target * ratio)));
            const int64_t ew = static_cast<int64_t>(std::round(std::sqrt(target / ratio)));
            if (eh < h && ew < w && eh > 0 && ew > 0) {
                const int64_t top = std::uniform_int_distribution<int64_t>(0, h - eh)(rng);
                const int64_t left = std::uniform_int_distribution<int64_t>(0, w - ew)(rng);
                torch::Tensor noise = torch::empty({3, eh, ew}, out.options());
                std::normal_distribution<float> normal(0.0f, 1.0f);
                auto* data = noise.data_ptr<float>();
                for (int64_t k = 0; k < noise.numel(); ++k) data[k] = normal(rng);
                out.index_put_({Slice(), Slice(top, top + eh), Slice(left, left + ew)}, noise);
                break;
            }
        }
    }
    return out;
}

}  // namespace linvis::train
