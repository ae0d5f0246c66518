// The one way linvis writes a file that must never be seen half-written (weights, checkpoints,
// pictures, reports): the bytes go to a new temporary file in the target's directory (created
// with O_EXCL, so concurrent writers never share one), which is fsync-ed, renamed over the target
// and followed by an fsync of the directory so that the rename survives a power cut. If anything
// fails, the temporary file is removed, the target is left exactly as it was, and a linvis::Error
// names the file and the reason.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace linvis::io {

// Receives consecutive pieces of the file's content.
using ByteSink = std::function<void(const void* data, size_t size)>;

// Streams the content through `produce(sink)`.
void write_file_atomically(const std::string& path, const std::function<void(const ByteSink& sink)>& produce);

// Writes `bytes` as the whole content.
void write_file_atomically(const std::string& path, std::string_view bytes);

// For writers that insist on opening a path themselves (LibTorch's serialisation): write(temp_path)
// fills a temporary file that then replaces `path` as above.
void write_file_atomically_via(const std::string& path, const std::function<void(const std::string& temp_path)>& write);

}  // namespace linvis::io
