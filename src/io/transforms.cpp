// Evaluation transforms (timm/torchvision semantics, see the header).
#include "linvis/io/transforms.h"

#include <cmath>

#include "linvis/core/error.h"
#include "linvis/io/image.h"

namespace linvis::io {
namespace {

namespace F = torch::nn::functional;

// Python's round() for a value that is an integer or a half-integer: half to even.
int64_t round_half_even_half(int64_t twice) {
    const int64_t floor_half = twice >= 0 ? twice / 2 : -((-twice + 1) / 2);
    if (twice % 2 == 0) return floor_half;
    return floor_half % 2 == 0 ? floor_half : floor_half + 1;
}

}  // namespace

const char* interpolation_name(Interpolation interpolation) {
    switch (interpolation) {
        case Interpolation::Nearest: return "nearest";
        case Interpolation::Bilinear: return "bilinear";
        case Interpolation::Bicubic: return "bicubic";
    }
    return "?";
}

Interpolation parse_interpolation(const std::string& name) {
    if (name == "nearest") return Interpolation::Nearest;
    if (name == "bilinear") return Interpolation::Bilinear;
    if (name == "bicubic") return Interpolation::Bicubic;
    fail("interpolation: expected nearest, bilinear or bicubic, got '", name, "'");
}

std::pair<int64_t, int64_t> shorter_side_size(int64_t height, int64_t width, int64_t size) {
    LINVIS_CHECK(height > 0 && width > 0, "resize: image size must be positive, got ", height, "x", width);
    LINVIS_CHECK(size > 0, "resize: target size must be positive, got ", size);
    // int(size * long / short) in Python: a float division truncated; exact in integers.
    if (height <= width) return {size, size * width / height};
    return {size * height / width, size};
}

torch::Tensor resize(const torch::Tensor& image, int64_t height, int64_t width, Interpolation interpolation,
                     bool antialias) {
    LINVIS_CHECK(image.dim() == 3 || image.dim() == 4, "resize: expected (C, H, W) or (B, C, H, W), got ",
                 shape_string(image.sizes()));
    LINVIS_CHECK(height > 0 && width > 0, "resize: output size must be positive, got ", height, "x", width);
    LINVIS_CHECK(image.size(-1) > 0 && image.size(-2) > 0, "resize: empty input ", shape_string(image.sizes()));
    if (image.size(-2) == height && image.size(-1) == width) return image;
    const auto dtype = image.scalar_type();
    LINVIS_CHECK(dtype == torch::kUInt8 || image.is_floating_point(), "resize: expected uint8 or float image, got ",
                 dtype);
    const bool compute_in_float32 = dtype != torch::kFloat32 && dtype != torch::kFloat64;
    torch::Tensor x = image.dim() == 3 ? image.unsqueeze(0) : image;
    if (compute_in_float32) x = x.to(torch::kFloat32);
    auto options = F::InterpolateFuncOptions().size(std::vector<int64_t>{height, width});
    switch (interpolation) {
        case Interpolation::Nearest: options.mode(torch::kNearest); break;
        case Interpolation::Bilinear: options.mode(torch::kBilinear).align_corners(false).antialias(antialias); break;
        case Interpolation::Bicubic: options.mode(torch::kBicubic).align_corners(false).antialias(antialias); break;
    }
    torch::Tensor y = F::interpolate(x, options);
    if (dtype == torch::kUInt8) {
        y = y.clamp(0, 255).round().to(torch::kUInt8);
    } else if (compute_in_float32) {
        y = y.to(dtype);
    }
    return image.dim() == 3 ? y.squeeze(0) : y;
}

torch::Tensor resize_shorter_side(const torch::Tensor& image, int64_t size, Interpolation interpolation,
                                  bool antialias) {
    LINVIS_CHECK(image.dim() == 3 || image.dim() == 4, "resize: expected (C, H, W) or (B, C, H, W), got ",
                 shape_string(image.sizes()));
    const auto [height, width] = shorter_side_size(image.size(-2), image.size(-1), size);
    return resize(image, height, width, interpolation, antialias);
}

std::pair<int64_t, int64_t> center_crop_offsets(int64_t height, int64_t width, int64_t crop_height,
                                                int64_t crop_width) {
    return {round_half_even_half(height - crop_height), round_half_even_half(width - crop_width)};
}

torch::Tensor center_crop(const torch::Tensor& image, int64_t crop_height, int64_t crop_width) {
    LINVIS_CHECK(image.dim() >= 2, "center_crop: expected (..., H, W), got ", shape_string(image.sizes()));
    LINVIS_CHECK(crop_height > 0 && crop_width > 0, "center_crop: crop size must be positive, got ", crop_height,
                 "x", crop_width);
    torch::Tensor x = image;
    const int64_t pad_h = std::max<int64_t>(0, crop_height - x.size(-2));
    const int64_t pad_w = std::max<int64_t>(0, crop_width - x.size(-1));
    if (pad_h > 0 || pad_w > 0) {
        // Padding order for the last two dims: (left, right, top, bottom).
        x = F::pad(x, F::PadFuncOptions({pad_w / 2, (pad_w + 1) / 2, pad_h / 2, (pad_h + 1) / 2}));
    }
    const auto [top, left] = center_crop_offsets(x.size(-2), x.size(-1), crop_height, crop_width);
    return x.narrow(-2, top, crop_height).narrow(-1, left, crop_width).contiguous();
}

torch::Tensor normalize(const torch::Tensor& image, const std::vector<double>& mean, const std::vector<double>& std) {
    LINVIS_CHECK(image.is_floating_point(), "normalize: expected a float image, got ", image.scalar_type());
    LINVIS_CHECK(image.dim() == 3 || image.dim() == 4, "normalize: expected (C, H, W) or (B, C, H, W), got ",
                 shape_string(image.sizes()));
    const int64_t channels = image.size(-3);
    LINVIS_CHECK(int64_t(mean.size()) == channels && int64_t(std.size()) == channels, "normalize: image has ",
                 channels, " channels, mean has ", mean.size(), " values, std has ", std.size());
    for (double s : std) LINVIS_CHECK(s > 0, "normalize: std values must be positive, got ", s);
    const auto options = image.options();
    const torch::Tensor m = torch::tensor(mean, torch::kFloat64).to(options).view({channels, 1, 1});
    const torch::Tensor s = torch::tensor(std, torch::kFloat64).to(options).view({channels, 1, 1});
    return (image - m) / s;
}

torch::Tensor to_float_chw(const torch::Tensor& image_hwc) {
    LINVIS_CHECK(image_hwc.scalar_type() == torch::kUInt8 && image_hwc.dim() == 3,
                 "to_float_chw: expected uint8 (H, W, C), got ", image_hwc.scalar_type(), " ",
                 shape_string(image_hwc.sizes()));
    return image_hwc.permute({2, 0, 1}).to(torch::kFloat32).div(255.0);
}

int64_t EvalTransform::effective_resize_size() const {
    if (resize_size > 0) return resize_size;
    return int64_t(std::floor(double(crop_size) / crop_pct));
}

void EvalTransform::validate() const {
    LINVIS_CHECK(crop_size > 0, "EvalTransform: crop_size must be positive, got ", crop_size);
    LINVIS_CHECK(resize_size >= 0, "EvalTransform: resize_size must be positive (or 0 for crop_size / crop_pct), got ",
                 resize_size);
    LINVIS_CHECK(crop_pct > 0 && crop_pct <= 1, "EvalTransform: crop_pct must be in (0, 1], got ", crop_pct);
    LINVIS_CHECK(mean.size() == 3 && std.size() == 3, "EvalTransform: mean and std need 3 values, got ", mean.size(),
                 " and ", std.size());
    for (double s : std) LINVIS_CHECK(s > 0, "EvalTransform: std values must be positive, got ", s);
}

torch::Tensor EvalTransform::operator()(const torch::Tensor& image_hwc) const {
    validate();
    LINVIS_CHECK(image_hwc.scalar_type() == torch::kUInt8 && image_hwc.dim() == 3 && image_hwc.size(2) == 3,
                 "EvalTransform: expected uint8 (H, W, 3), got ", image_hwc.scalar_type(), " ",
                 shape_string(image_hwc.sizes()));
    torch::Tensor chw = image_hwc.permute({2, 0, 1});
    if (!quantize_after_resize) chw = chw.to(torch::kFloat32);
    chw = resize_shorter_side(chw, effective_resize_size(), interpolation, antialias);
    chw = center_crop(chw, crop_size, crop_size);
    // ToTensor: float32 / 255, then Normalize.
    return normalize(chw.to(torch::kFloat32).div(255.0), mean, std);
}

torch::Tensor load_image_batch(const std::vector<std::string>& paths, const EvalTransform& transform) {
    LINVIS_CHECK(!paths.empty(), "load_image_batch: no image paths given");
    std::vector<torch::Tensor> images;
    images.reserve(paths.size());
    for (const auto& path : paths) images.push_back(transform(read_image(path)));
    return torch::stack(images);
}

}  // namespace linvis::io
