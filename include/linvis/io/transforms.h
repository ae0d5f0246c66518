// Evaluation preprocessing as timm builds it for ImageNet models (transforms_imagenet_eval):
//   Resize(shorter side -> resize_size, bicubic) -> CenterCrop(crop_size) -> ToTensor ([0, 1])
//   -> Normalize(mean, std)
// with resize_size = floor(crop_size / crop_pct), crop_pct = 0.875 (224 -> 256).
//
// How the resize relates to the Python pipelines (details in docs/data.md):
//  * timm resizes PIL images: PIL's separable bicubic (Keys cubic, a = -0.5) whose support is
//    widened by the downscale factor (antialiasing), computed in 22-bit fixed point with the
//    intermediate (after the horizontal pass) and the result rounded to uint8.
//  * torchvision's Resize on uint8 tensors (antialias=True) calls
//    torch.nn.functional.interpolate(mode="bicubic", align_corners=False, antialias=True) in
//    float, then clamps to [0, 255] and rounds to uint8.
//  * LibTorch 1.13 has the same operator: torch::nn::functional::interpolate with
//    InterpolateFuncOptions().mode(torch::kBicubic).align_corners(false).antialias(true),
//    dispatching to ATen's _upsample_bicubic2d_aa (the PIL filter, a = -0.5, in float). It exists
//    unchanged in LibTorch 2.x. linvis uses it, so it reproduces torchvision's tensor Resize, and
//    matches PIL up to PIL's fixed-point and intermediate rounding (a few uint8 levels at edges).
//  * Plain bicubic (antialias=false) is the a = -0.75 interpolating cubic without widening:
//    it aliases when downscaling and is not what either pipeline uses for evaluation.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace linvis::io {

enum class Interpolation {
    Nearest,   // torch "nearest" (floor of the source coordinate), like torchvision's tensor Resize
    Bilinear,  // triangle filter; with antialias it is PIL's BILINEAR
    Bicubic,   // Keys cubic; with antialias it is PIL's BICUBIC (a = -0.5)
};

const char* interpolation_name(Interpolation interpolation);
// Parses "nearest", "bilinear", "bicubic" (throws linvis::Error otherwise).
Interpolation parse_interpolation(const std::string& name);

// torchvision's size rule for Resize(int): the shorter side becomes `size`, the longer side
// int(size * long / short) (truncated). Returns (new_height, new_width).
std::pair<int64_t, int64_t> shorter_side_size(int64_t height, int64_t width, int64_t size);

// Resizes (C, H, W) or (B, C, H, W) to (height, width). Float inputs stay float (computed in
// their dtype, bfloat16/half via float32); uint8 inputs are resized in float32, then clamped to
// [0, 255] and rounded half to even back to uint8, exactly as torchvision does for tensors.
// `antialias` is ignored for Nearest. Same size in and out returns the input unchanged.
torch::Tensor resize(const torch::Tensor& image, int64_t height, int64_t width,
                     Interpolation interpolation = Interpolation::Bicubic, bool antialias = true);

// resize() to shorter_side_size(H, W, size).
torch::Tensor resize_shorter_side(const torch::Tensor& image, int64_t size,
                                  Interpolation interpolation = Interpolation::Bicubic, bool antialias = true);

// torchvision's center_crop offsets: top = round((H - crop_h) / 2), left = round((W - crop_w) / 2)
// with Python's round (half to even), e.g. H - crop_h = 33 -> 16, 35 -> 18. Returns (top, left).
std::pair<int64_t, int64_t> center_crop_offsets(int64_t height, int64_t width, int64_t crop_height,
                                                int64_t crop_width);

// Crops the last two dims of (..., H, W) to (crop_height, crop_width) around the centre. A side
// smaller than the crop is first zero-padded by floor(d/2) before and ceil(d/2) after, like
// torchvision. Returns a contiguous tensor.
torch::Tensor center_crop(const torch::Tensor& image, int64_t crop_height, int64_t crop_width);

// (x - mean[c]) / std[c] over the channel dim of float (C, H, W) or (B, C, H, W), in x's dtype.
torch::Tensor normalize(const torch::Tensor& image, const std::vector<double>& mean, const std::vector<double>& std);

// uint8 (H, W, C) -> float32 (C, H, W) in [0, 1] (x / 255), torchvision's ToTensor.
torch::Tensor to_float_chw(const torch::Tensor& image_hwc);

struct EvalTransform {
    int64_t crop_size = 224;
    // Shorter side after resizing; 0 means floor(crop_size / crop_pct) (timm's scale_size).
    int64_t resize_size = 0;
    double crop_pct = 0.875;
    Interpolation interpolation = Interpolation::Bicubic;
    bool antialias = true;
    // Round the resized image to uint8 before scaling to [0, 1], as PIL and torchvision's uint8
    // path do. false keeps the float result (no quantisation, values may overshoot [0, 1]).
    bool quantize_after_resize = true;
    std::vector<double> mean = {0.485, 0.456, 0.406};  // ImageNet (timm IMAGENET_DEFAULT_MEAN)
    std::vector<double> std = {0.229, 0.224, 0.225};   // ImageNet (timm IMAGENET_DEFAULT_STD)

    // The shorter side used: resize_size, or floor(crop_size / crop_pct).
    int64_t effective_resize_size() const;

    // Throws linvis::Error when a parameter is out of range (sizes <= 0, crop_pct not in (0, 1],
    // mean/std not 3 values, std <= 0).
    void validate() const;

    // uint8 (H, W, 3) RGB (as read_image returns) -> float32 (3, crop_size, crop_size).
    torch::Tensor operator()(const torch::Tensor& image_hwc) const;
};

// Reads every file with read_image, applies `transform`, stacks to float32 (B, 3, crop, crop).
// Throws (naming the file) on the first image that cannot be read.
torch::Tensor load_image_batch(const std::vector<std::string>& paths, const EvalTransform& transform = {});

}  // namespace linvis::io
