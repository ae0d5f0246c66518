// libFuzzer target for the IDX reader (src/train/datasets.cpp read_idx_file, through the gzip
// reader src/io/gzip.cpp): gzip-compressed or plain files. The first input byte picks the
// expected number of dimensions (1 or 3, labels or images), the rest is the file.
// Properties: only linvis::Error escapes; an accepted array has the expected number of
// dimensions and exactly as many values as its dimensions multiply to.
#include <cstdint>

#include "fuzz_util.h"
#include "linvis/core/error.h"
#include "linvis/train/datasets.h"

using namespace linvis;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    static const std::filesystem::path dir = fuzz::scratch_dir("fuzz_idx");
    const int ndims = (data[0] & 1) ? 3 : 1;
    const std::string path = fuzz::write_scratch_file(dir / "input-idx", data + 1, size - 1);
    train::IdxArray array;
    try {
        array = train::read_idx_file(path, ndims);
    } catch (const Error&) {
        return 0;
    }
    if (static_cast<int>(array.dims.size()) != ndims) fuzz::violated("fuzz_idx", "wrong number of dimensions");
    uint64_t count = 1;
    for (int64_t d : array.dims) count *= static_cast<uint64_t>(d);
    if (count != array.data.size()) fuzz::violated("fuzz_idx", "value count differs from the dimensions");
    return 0;
}
