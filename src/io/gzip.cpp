#include "linvis/io/gzip.h"

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <zlib.h>

#include "linvis/core/error.h"

namespace linvis::io {

std::vector<uint8_t> read_gzip_file(const std::string& path) {
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    LINVIS_CHECK(std::filesystem::exists(status), path, ": no such file");
    LINVIS_CHECK(!std::filesystem::is_directory(status), path, ": is a directory, expected a file");
    gzFile file = gzopen(path.c_str(), "rb");
    LINVIS_CHECK(file != nullptr, path, ": cannot open: ", std::strerror(errno));
    std::vector<uint8_t> out;
    std::vector<uint8_t> buffer(size_t{1} << 16);
    int got = 0;
    while ((got = gzread(file, buffer.data(), unsigned(buffer.size()))) > 0)
        out.insert(out.end(), buffer.begin(), buffer.begin() + got);
    int error_number = Z_OK;
    const std::string message = got < 0 ? gzerror(file, &error_number) : "";
    const int close_status = gzclose_r(file);
    LINVIS_CHECK(got >= 0, path, ": cannot decompress gzip data: ", message);
    // gzclose_r reports a stream cut off in the middle (Z_BUF_ERROR) even when gzread ended quietly.
    LINVIS_CHECK(close_status == Z_OK, path, ": truncated or corrupt gzip data (zlib status ", close_status, ")");
    return out;
}

void write_gzip_file(const std::string& path, const std::vector<uint8_t>& bytes) {
    gzFile file = gzopen(path.c_str(), "wb6");
    LINVIS_CHECK(file != nullptr, path, ": cannot open for writing: ", std::strerror(errno));
    size_t done = 0;
    while (done < bytes.size()) {
        const unsigned chunk = unsigned(std::min<size_t>(bytes.size() - done, 1u << 30));
        const int wrote = gzwrite(file, bytes.data() + done, chunk);
        if (wrote <= 0) {
            int error_number = Z_OK;
            const std::string message = gzerror(file, &error_number);
            gzclose_w(file);
            fail(path, ": gzip write failed: ", message);
        }
        done += size_t(wrote);
    }
    LINVIS_CHECK(gzclose_w(file) == Z_OK, path, ": gzip write failed when closing: ", std::strerror(errno));
}

}  // namespace linvis::io
