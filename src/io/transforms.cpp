// Evaluation transforms (timm/torchvision semantics, see the header).
#include "linvis/io/transforms.h"

#include <algorithm>
#include <cmath>

#include <ATen/Parallel.h>

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

namespace {

double pil_filter(Interpolation interpolation, double x) {
    x = std::abs(x);
    if (interpolation == Interpolation::Bilinear) return x < 1.0 ? 1.0 - x : 0.0;
    constexpr double a = -0.5;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
    if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
    return 0.0;
}

// Fixed-point taps of one output pixel along one axis.
struct PilTaps {
    int64_t first = 0;
    std::vector<int32_t> weights;
};

constexpr int kPilPrecisionBits = 32 - 8 - 2;

std::vector<PilTaps> pil_taps(int64_t in_size, int64_t out_size, Interpolation interpolation) {
    const double support_base = interpolation == Interpolation::Bilinear ? 1.0 : 2.0;
    const double scale = double(in_size) / double(out_size);
    const double filter_scale = std::max(scale, 1.0);
    const double support = support_base * filter_scale;
    std::vector<PilTaps> taps(static_cast<size_t>(out_size));
    std::vector<double> k;
    for (int64_t i = 0; i < out_size; ++i) {
        const double center = (double(i) + 0.5) * scale;
        const double inverse = 1.0 / filter_scale;
        int64_t lo = int64_t(center - support + 0.5);  // truncation toward zero, as C's (int)
        if (lo < 0) lo = 0;
        int64_t hi = int64_t(center + support + 0.5);
        if (hi > in_size) hi = in_size;
        k.assign(size_t(std::max<int64_t>(hi - lo, 0)), 0.0);
        double total = 0.0;
        for (size_t j = 0; j < k.size(); ++j) {
            k[j] = pil_filter(interpolation, (double(j) + double(lo) - center + 0.5) * inverse);
            total += k[j];
        }
        auto& t = taps[size_t(i)];
        t.first = lo;
        for (double w : k) {
            const double normalised = total != 0.0 ? w / total : w;
            const double fixed = normalised * double(1 << kPilPrecisionBits);
            t.weights.push_back(int32_t(normalised < 0 ? -0.5 + fixed : 0.5 + fixed));
        }
    }
    return taps;
}

uint8_t pil_clip(int64_t sum) {
    const int64_t v = sum >> kPilPrecisionBits;  // arithmetic shift: floor, as PIL's int >> on gcc
    return uint8_t(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// One separable pass along `axis` (0: rows / height, 1: columns / width) of a (H, W, C) uint8 image.
torch::Tensor pil_pass(const torch::Tensor& in, int axis, int64_t out_size, Interpolation interpolation) {
    const int64_t h = in.size(0), w = in.size(1), c = in.size(2);
    const int64_t in_size = axis == 0 ? h : w;
    const auto taps = pil_taps(in_size, out_size, interpolation);
    torch::Tensor out = torch::empty(axis == 0 ? std::vector<int64_t>{out_size, w, c} : std::vector<int64_t>{h, out_size, c},
                                     torch::kUInt8);
    const uint8_t* src = in.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    const int64_t rounding = int64_t(1) << (kPilPrecisionBits - 1);
    if (axis == 1) {
        at::parallel_for(0, h, 16, [&](int64_t begin, int64_t end) {
            for (int64_t y = begin; y < end; ++y)
                for (int64_t x = 0; x < out_size; ++x) {
                    const auto& t = taps[size_t(x)];
                    for (int64_t ch = 0; ch < c; ++ch) {
                        int64_t sum = rounding;
                        for (size_t j = 0; j < t.weights.size(); ++j)
                            sum += int64_t(src[(y * w + t.first + int64_t(j)) * c + ch]) * t.weights[j];
                        dst[(y * out_size + x) * c + ch] = pil_clip(sum);
                    }
                }
        });
    } else {
        at::parallel_for(0, out_size, 16, [&](int64_t begin, int64_t end) {
            for (int64_t y = begin; y < end; ++y) {
                const auto& t = taps[size_t(y)];
                for (int64_t x = 0; x < w; ++x)
                    for (int64_t ch = 0; ch < c; ++ch) {
                        int64_t sum = rounding;
                        for (size_t j = 0; j < t.weights.size(); ++j)
                            sum += int64_t(src[((t.first + int64_t(j)) * w + x) * c + ch]) * t.weights[j];
                        dst[(y * w + x) * c + ch] = pil_clip(sum);
                    }
            }
        });
    }
    return out;
}

torch::Tensor pil_nearest(const torch::Tensor& in, int64_t height, int64_t width) {
    const int64_t h = in.size(0), w = in.size(1);
    const auto source_indices = [](int64_t in_size, int64_t out_size) {
        // PIL walks the source coordinate by repeated addition (its affine transform loop), and the
        // accumulated rounding decides exact .0 boundaries: (i + 0.5) * scale computed directly
        // picks a different pixel there (e.g. 400 -> 298, i = 74).
        const double scale = double(in_size) / double(out_size);
        std::vector<int64_t> idx(static_cast<size_t>(out_size));
        double coordinate = 0.5 * scale;
        for (int64_t i = 0; i < out_size; ++i, coordinate += scale)
            idx[size_t(i)] = std::min<int64_t>(int64_t(coordinate), in_size - 1);
        return idx;
    };
    const auto rows = torch::tensor(source_indices(h, height), torch::kInt64);
    const auto cols = torch::tensor(source_indices(w, width), torch::kInt64);
    return in.index_select(0, rows).index_select(1, cols).contiguous();
}

}  // namespace

torch::Tensor resize_pil(const torch::Tensor& image_hwc, int64_t height, int64_t width, Interpolation interpolation) {
    LINVIS_CHECK(image_hwc.scalar_type() == torch::kUInt8 && image_hwc.dim() == 3, "resize_pil: expected uint8 (H, W, C), got ",
                 image_hwc.scalar_type(), " ", shape_string(image_hwc.sizes()));
    LINVIS_CHECK(height > 0 && width > 0, "resize_pil: output size must be positive, got ", height, "x", width);
    LINVIS_CHECK(image_hwc.size(0) > 0 && image_hwc.size(1) > 0 && image_hwc.size(2) > 0, "resize_pil: empty input ",
                 shape_string(image_hwc.sizes()));
    if (image_hwc.size(0) == height && image_hwc.size(1) == width) return image_hwc;
    torch::Tensor x = image_hwc.to(torch::kCPU).contiguous();
    if (interpolation == Interpolation::Nearest) return pil_nearest(x, height, width);
    if (x.size(1) != width) x = pil_pass(x, 1, width, interpolation);
    if (x.size(0) != height) x = pil_pass(x, 0, height, interpolation);
    return x;
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
    LINVIS_CHECK((mean.size() == 3 || mean.size() == 1) && std.size() == mean.size(),
                 "EvalTransform: mean and std need 3 values (RGB) or 1 (grey), got ", mean.size(), " and ", std.size());
    for (double s : std) LINVIS_CHECK(s > 0, "EvalTransform: std values must be positive, got ", s);
}

torch::Tensor EvalTransform::operator()(const torch::Tensor& image_hwc) const {
    validate();
    LINVIS_CHECK(image_hwc.scalar_type() == torch::kUInt8 && image_hwc.dim() == 3 && image_hwc.size(2) == 3,
                 "EvalTransform: expected uint8 (H, W, 3), got ", image_hwc.scalar_type(), " ",
                 shape_string(image_hwc.sizes()));
    const bool grey = mean.size() == 1;
    // A grey model sees PIL's convert('L') of the image (ITU-R 601-2 luma, PIL's integer rounding), kept
    // in three equal channels through the resize; a grey image passes unchanged.
    const torch::Tensor source = grey ? [&] {
        const torch::Tensor rgb = image_hwc.to(torch::kInt32);
        const torch::Tensor luma = (rgb.select(2, 0) * 19595 + rgb.select(2, 1) * 38470 + rgb.select(2, 2) * 7471 + 0x8000)
                                       .div(65536, "floor")
                                       .to(torch::kUInt8);
        return luma.unsqueeze(2).expand({-1, -1, 3}).contiguous();
    }() : image_hwc;
    torch::Tensor chw;
    if (kernel == ResizeKernel::Pil) {
        const auto [height, width] = shorter_side_size(source.size(0), source.size(1), effective_resize_size());
        chw = resize_pil(source, height, width, interpolation).permute({2, 0, 1});
    } else {
        chw = source.permute({2, 0, 1});
        if (!quantize_after_resize) chw = chw.to(torch::kFloat32);
        chw = resize_shorter_side(chw, effective_resize_size(), interpolation, antialias);
    }
    chw = center_crop(chw, crop_size, crop_size);
    if (grey) chw = chw.narrow(0, 0, 1);
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
