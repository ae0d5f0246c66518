// Evaluation preprocessing as timm builds it for ImageNet models (transforms_imagenet_eval):
//   Resize(shorter side -> resize_size, bicubic) -> CenterCrop(crop_size) -> ToTensor ([0, 1])
//   -> Normalize(mean, std)
// with resize_size = floor(crop_size / crop_pct), crop_pct = 0.875 (224 -> 256).
//
// Two resize implementations are offered (ResizeKernel); details and measurements in docs/data.md:
//  * ResizeKernel::Pil (default for EvalTransform): Pillow's Image.resize reproduced bit for bit
//    (same filter, same 22-bit fixed-point coefficients, horizontal pass first with a uint8
//    intermediate), i.e. exactly what timm's PIL-based evaluation pipeline feeds the model.
//  * ResizeKernel::Torch: torch interpolate(antialias=True) in float, i.e. torchvision's Resize on
//    uint8 tensors.
//
// How the resize relates to the Python pipelines:
//  * timm resizes PIL images: PIL's separable bicubic (Keys cubic, a = -0.5) whose support is
//    widened by the downscale factor (antialiasing), computed in 22-bit fixed point with the
//    intermediate (after the horizontal pass) and the result rounded to uint8.
//  * torchvision's Resize on uint8 tensors (antialias=True) calls
//    torch.nn.functional.interpolate(mode="bicubic", align_corners=False, antialias=True) in
//    float, then clamps to [0, 255] and rounds to uint8.
//  * LibTorch 1.13 has the same operator: torch::nn::functional::interpolate with
//    InterpolateFuncOptions().mode(torch::kBicubic).align_corners(false).antialias(true),
//    dispatching to ATen's _upsample_bicubic2d_aa (the PIL filter, a = -0.5, in float). It exists
//    unchanged in LibTorch 2.x. ResizeKernel::Torch uses it, so it reproduces torchvision's tensor
//    Resize; it differs from PIL by PIL's fixed-point arithmetic and its uint8 intermediate, which
//    clips the overshoot of the horizontal pass (measured: <= 2 levels on smooth/synthetic
//    pictures, up to 21 levels on uniform noise).
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

enum class ResizeKernel {
    Pil,    // Pillow's Image.resize on uint8, bit-exact (timm's evaluation pipeline)
    Torch,  // torch::nn::functional::interpolate (torchvision's Resize on tensors)
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

// Pillow's Image.resize(size, resample) for uint8 (H, W, C) images (any C, channels independent),
// bit for bit: for each output pixel i along an axis of scale s = in / out, the filter (triangle
// for Bilinear, Keys cubic a = -0.5 for Bicubic) is widened by max(s, 1), centred at (i + 0.5) * s,
// sampled at the input pixel centres within its support (clipped to the image), normalised to sum
// 1 and converted to 22-bit fixed point (rounded away from zero); the sum starts at 2^21 and is
// shifted right by 22 and clamped to [0, 255]. Width is resized first into a uint8 image, then
// height; an axis whose size does not change is not filtered. Nearest takes input pixel
// floor(x_i) with x_0 = s / 2, x_{i+1} = x_i + s summed in double, as PIL's NEAREST does. Same size
// returns the input. Verified identical to Pillow 13.0 (docs/data.md).
torch::Tensor resize_pil(const torch::Tensor& image_hwc, int64_t height, int64_t width,
                         Interpolation interpolation = Interpolation::Bicubic);

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
    ResizeKernel kernel = ResizeKernel::Pil;
    // ResizeKernel::Torch only: antialiased filter (as torchvision) or plain interpolation.
    bool antialias = true;
    // ResizeKernel::Torch only: round the resized image to uint8 before scaling to [0, 1], as
    // torchvision's uint8 path does. false keeps the float result (values may overshoot [0, 1]).
    bool quantize_after_resize = true;
    std::vector<double> mean = {0.485, 0.456, 0.406};  // ImageNet (timm IMAGENET_DEFAULT_MEAN)
    std::vector<double> std = {0.229, 0.224, 0.225};   // ImageNet (timm IMAGENET_DEFAULT_STD)

    // The shorter side used: resize_size, or floor(crop_size / crop_pct).
    int64_t effective_resize_size() const;

    // Throws linvis::Error when a parameter is out of range (sizes <= 0, crop_pct not in (0, 1],
    // mean/std not 3 (RGB) or 1 (grey) values, std <= 0).
    void validate() const;

    // uint8 (H, W, 3) RGB (as read_image returns) -> float32 (3, crop_size, crop_size); with one
    // mean/std value, the grey image (PIL's convert('L')) -> (1, crop_size, crop_size).
    torch::Tensor operator()(const torch::Tensor& image_hwc) const;
};

// Reads every file with read_image, applies `transform`, stacks to float32 (B, 3, crop, crop).
// Throws (naming the file) on the first image that cannot be read.
torch::Tensor load_image_batch(const std::vector<std::string>& paths, const EvalTransform& transform = {});

}  // namespace linvis::io
