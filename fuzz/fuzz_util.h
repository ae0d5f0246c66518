// Shared helpers of the libFuzzer targets that feed readers taking a path: the input goes to a
// per-process temporary file (or directory) under $TMPDIR, which is reused for every input.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace linvis::fuzz {

// The pixel limit the image-decoding targets pass (io::decode_image, train::ImageFolder): 2^22 pixels, not the
// library's 2^28. A JPEG of under 4 kB announcing 250 million pixels took 2.3 GB, over the 2.5 GB budget under
// ASan (a fuzz finding). Such a file can be valid: an arithmetic-coded JPEG decodes a nearly empty scan
// (fuzz/corpus/image/regression_jpeg_arithmetic_16000px_bomb.jpg, 2.3 kB, decodes to 16000 x 16000 in 2.4 GB and
// 4 s). Every check but the size of the allocations is the same below the limit.
constexpr int64_t kMaxPixels = int64_t(1) << 22;

[[noreturn]] inline void violated(const char* target, const std::string& what) {
    std::fprintf(stderr, "%s: property violated: %s\n", target, what.c_str());
    std::abort();
}

inline std::filesystem::path scratch_dir(const char* target) {
    const char* tmp = std::getenv("TMPDIR");
    std::filesystem::path dir = std::filesystem::path(tmp && *tmp ? tmp : "/tmp") /
                                (std::string("linvis_") + target + "_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    return dir;
}

inline std::string write_scratch_file(const std::filesystem::path& path, const uint8_t* data, size_t size) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    out.close();
    if (!out) violated("fuzz", "cannot write the scratch file " + path.string());
    return path.string();
}

}  // namespace linvis::fuzz
