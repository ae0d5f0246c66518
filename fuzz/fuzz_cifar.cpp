// libFuzzer target for the CIFAR binary reader (src/train/datasets.cpp read_cifar_file). The first
// input byte picks CIFAR-10 (1 label byte, 10 classes) or CIFAR-100 (2 label bytes, 100 classes),
// the rest is the file.
// Properties: only linvis::Error escapes; an accepted file gives one label in range per 3072
// pixel values, appended after what the vectors held before.
#include <cstdint>

#include "fuzz_util.h"
#include "linvis/core/error.h"
#include "linvis/train/datasets.h"

using namespace linvis;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    static const std::filesystem::path dir = fuzz::scratch_dir("fuzz_cifar");
    const bool hundred = (data[0] & 1) != 0;
    const int label_bytes = hundred ? 2 : 1, classes = hundred ? 100 : 10;
    const std::string path = fuzz::write_scratch_file(dir / "batch.bin", data + 1, size - 1);
    std::vector<uint8_t> images(3072, 7);  // one earlier record, kept as it was
    std::vector<int64_t> labels{3};
    try {
        train::read_cifar_file(path, label_bytes, classes, images, labels);
    } catch (const Error&) {
        return 0;
    }
    if (images.size() != labels.size() * 3072) fuzz::violated("fuzz_cifar", "images and labels disagree");
    if (labels.size() < 2 || images[0] != 7 || labels[0] != 3) fuzz::violated("fuzz_cifar", "earlier record lost");
    for (int64_t label : labels)
        if (label < 0 || label >= classes) fuzz::violated("fuzz_cifar", "label out of range accepted");
    return 0;
}
