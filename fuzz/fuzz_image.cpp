// libFuzzer target for the image decoding path (src/io/image.cpp): format sniffing, the PNG
// chunk/CRC walk, the JPEG marker walk, the BMP row check, then libjpeg-turbo or stb_image.
// Properties: only linvis::Error escapes; an accepted image is uint8 (H, W, 3), contiguous,
// H * W within the pixel limit passed (fuzz::kMaxPixels, see fuzz_util.h), and the whole pixel buffer is readable
// (its first and last bytes under ASan).
#include <cstdint>

#include <torch/torch.h>

#include "fuzz_util.h"
#include "linvis/core/error.h"
#include "linvis/io/image.h"

using namespace linvis;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    torch::set_num_threads(1);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    torch::Tensor image;
    try {
        image = io::decode_image(data, size, "fuzz-input", fuzz::kMaxPixels);
    } catch (const Error&) {
        return 0;
    }
    if (image.dim() != 3 || image.size(2) != 3 || image.scalar_type() != torch::kUInt8 || !image.is_contiguous())
        fuzz::violated("fuzz_image", "decoded image is not contiguous uint8 (H, W, 3)");
    if (image.size(0) <= 0 || image.size(1) <= 0 || image.size(0) * image.size(1) > fuzz::kMaxPixels)
        fuzz::violated("fuzz_image", "decoded image has an impossible size");
    // The pixels are one allocation: its first and last bytes readable (ASan) means all of it is. Reading every
    // pixel (image.sum() widened them to an int64 copy, 8x the image) ran an accepted 250 MB image out of memory.
    const uint8_t* pixel = image.data_ptr<uint8_t>();
    volatile uint8_t ends = pixel[0] ^ pixel[image.numel() - 1];
    (void)ends;
    return 0;
}
