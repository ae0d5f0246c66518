// Image files in and out: JPEG, PNG and BMP decoding into RGB uint8 tensors, PNG/BMP/JPEG
// encoding (for pictures such as heat maps and plots), and a procedural demo image.
//
// JPEG is decoded by libjpeg-turbo with its default (accurate) settings, the decoder Pillow uses,
// so the pixels are Pillow's bit for bit; PNG and BMP by Debian's stb_image (libstb). Before a
// decoder sees the bytes, the container is checked so that damaged files fail loudly instead of
// decoding to a partly black picture (stb fills missing data with zeros): the magic bytes must say
// JPEG, PNG or BMP; a PNG must reach its IEND chunk with correct CRCs; a JPEG must reach its EOI
// marker, and its scans must not end before the image is complete; an uncompressed BMP must hold
// all the pixel rows its header announces. Every failure throws linvis::Error naming the file (or
// the buffer's name) and the reason, the decoder's own reason when the decoder fails.
//
// Colour conversion follows PIL's Image.convert("RGB"), which timm's loader applies:
// grayscale is replicated into the three channels, an alpha channel is dropped (not
// composited), palette images are expanded, CMYK JPEGs are converted with Pillow's formula
// (inverted inks when the file has an Adobe marker). 16-bit PNGs are reduced to 8 bits by stb
// (high byte).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace linvis::io {

enum class ImageFormat { Jpeg, Png, Bmp };

// "JPEG", "PNG", "BMP".
const char* image_format_name(ImageFormat format);

// Largest decoded image accepted (width * height), so that a forged header cannot make
// the decoder allocate more than a few GiB: 2^28 pixels (e.g. 16384 x 16384).
constexpr int64_t kMaxImagePixels = int64_t(1) << 28;

// Reads and decodes an image file. Returns uint8 (H, W, 3) RGB, contiguous.
// Throws linvis::Error "<path>: <reason>" when the file is missing, unreadable, empty,
// not JPEG/PNG/BMP, truncated or corrupt, or when its header announces more than `max_pixels`
// pixels (1..kMaxImagePixels). The default admits a 16384 x 16384 image, which a progressive
// JPEG decodes through about 9 bytes per pixel (2.4 GB); a file of a few kB can announce that
// much (an arithmetic-coded JPEG decodes even a nearly empty scan), so a caller decoding
// untrusted files within a memory budget passes a lower limit, as Pillow's MAX_IMAGE_PIXELS.
torch::Tensor read_image(const std::string& path, int64_t max_pixels = kMaxImagePixels);

// Throws "<name>: the pixel limit must be 1..kMaxImagePixels, got N" unless max_pixels is in that range.
void check_pixel_limit(int64_t max_pixels, const std::string& name);

// Decodes an image held in memory; `name` (a file name, URL, "<buffer>") is used in errors.
torch::Tensor decode_image(const uint8_t* data, size_t size, const std::string& name = "<buffer>",
                           int64_t max_pixels = kMaxImagePixels);
torch::Tensor decode_image(const std::vector<uint8_t>& bytes, const std::string& name = "<buffer>",
                           int64_t max_pixels = kMaxImagePixels);

// The format told by the first bytes, or throws "<name>: not a JPEG, PNG or BMP file".
ImageFormat sniff_image_format(const uint8_t* data, size_t size, const std::string& name = "<buffer>");

// Encodes uint8 pixels, shaped (H, W) grayscale or (H, W, C) with C = 1 (gray), 2 (gray+alpha,
// PNG only), 3 (RGB) or 4 (RGBA, PNG only). Float tensors are not accepted: convert with
// to_uint8_image first. `jpeg_quality` is 1..100 (JPEG only).
std::vector<uint8_t> encode_image(const torch::Tensor& image, ImageFormat format, int jpeg_quality = 95);

// Encodes (as above) and writes to `path`; the format is taken from the extension
// (.png, .bmp, .jpg/.jpeg, case-insensitive). Throws naming the path if it cannot be written.
void write_image(const std::string& path, const torch::Tensor& image, int jpeg_quality = 95);

// PNG shortcut for pictures (heat maps, plots): write_image with PNG regardless of extension.
void write_png(const std::string& path, const torch::Tensor& image);

// Converts a float image with values in [0, 1] to uint8 (x * 255, rounded half to even, clamped):
// (H, W) stays (H, W); (C, H, W) with C = 1..4 (LibTorch's layout) becomes (H, W, C) for encode_image.
torch::Tensor to_uint8_image(const torch::Tensor& image);

// A deterministic procedural RGB picture (uint8 (height, width, 3)) so that demos and tests
// run without any file: a colour gradient, a checkerboard quadrant, concentric rings and a few
// solid shapes, computed with integer arithmetic only, so identical on every platform.
torch::Tensor demo_image(int64_t height = 256, int64_t width = 320);

}  // namespace linvis::io
