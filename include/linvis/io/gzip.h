// Whole-file gzip reading and writing (zlib), for IDX data sets and anything else stored .gz.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace linvis::io {

// Reads a file and returns its decompressed content. A file that is not gzip is returned as it is
// (zlib's transparent mode), so "x.gz" and its uncompressed copy read the same. Throws
// linvis::Error naming the file when it is missing, unreadable, or a corrupt or truncated gzip stream.
std::vector<uint8_t> read_gzip_file(const std::string& path);

// Writes `bytes` gzip-compressed (zlib level 6) to `path`. Throws naming the path on failure.
void write_gzip_file(const std::string& path, const std::vector<uint8_t>& bytes);

}  // namespace linvis::io
