// libFuzzer target for the image decoding path (src/io/image.cpp): format sniffing, the PNG
// chunk/CRC walk, the JPEG marker walk, the BMP row check, then libjpeg-turbo or stb_image.
// Properties: only linvis::Error escapes; an accepted image is uint8 (H, W, 3), contiguous,
// H * W within the pixel limit passed, and the whole pixel buffer is readable (its first and last bytes under
// ASan).
// The limit is 2^22 pixels, not the library's 2^28: a JPEG of under 4 kB announcing 250 million pixels took
// 2.3 GB, over the 2.5 GB budget under ASan (a fuzz finding). Such a file can be valid: an arithmetic-coded JPEG
// decodes a nearly empty scan (regression_jpeg_arithmetic_16000px_bomb.jpg, 2.3 kB, decodes to 16000 x 16000 in
// 2.4 GB and 4 s). Every check but the size of the allocations is the same below the limit.
#include <cstdint>

#include <torch/torch.h>

#include "fuzz_util.h"
#include "linvis/core/error.h"
#include "linvis/io/image.h"

using namespace linvis;

namespace {
constexpr int64_t kFuzzMaxPixels = int64_t(1) << 22;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    torch::set_num_threads(1);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    torch::Tensor image;
    try {
        image = io::decode_image(data, size, "fuzz-input", kFuzzMaxPixels);
    } catch (const Error&) {
        return 0;
    }
    if (image.dim() != 3 || image.size(2) != 3 || image.scalar_type() != torch::kUInt8 || !image.is_contiguous())
        fuzz::violated("fuzz_image", "decoded image is not contiguous uint8 (H, W, 3)");
    if (image.size(0) <= 0 || image.size(1) <= 0 || image.size(0) * image.size(1) > kFuzzMaxPixels)
        fuzz::violated("fuzz_image", "decoded image has an impossible size");
    // The pixels are one allocation: its first and last bytes readable (ASan) means all of it is. Reading every
    // pixel (image.sum() widened them to an int64 copy, 8x the image) ran an accepted 250 MB image out of memory.
    const uint8_t* pixel = image.data_ptr<uint8_t>();
    volatile uint8_t ends = pixel[0] ^ pixel[image.numel() - 1];
    (void)ends;
    return 0;
}
