// libFuzzer target for the image-folder scanner (src/train/datasets.cpp ImageFolder): the input
// describes a directory tree that is created under a scratch directory, then scanned, and every
// sample is read (decoded or skipped as unreadable).
//
// Input: records until the input ends, each
//   kind (1 byte: %3 == 0 directory, 1 file, 2 symbolic link), name length (1 byte, %48), name,
//   then for a file a 2-byte little-endian content length and the content, for a link a 1-byte
//   target length and the target (relative; a target leaving the scratch tree is dropped).
// Names keep [A-Za-z0-9._-/]; other bytes become '_'; components "." and ".." are dropped.
// Properties: only linvis::Error escapes; the classes are sorted and unique; every sample's label
// indexes a class, its path lies in that class's directory and has an image extension; get_raw
// returns uint8 (H, W, 3) or throws linvis::Error when no file can be read.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <iostream>
#include <sstream>

#include <torch/torch.h>

#include "fuzz_util.h"
#include "linvis/core/error.h"
#include "linvis/train/datasets.h"

namespace fs = std::filesystem;
using namespace linvis;

namespace {

struct Reader {
    const uint8_t* data;
    size_t size, pos = 0;
    bool has(size_t n) const { return n <= size - pos; }
    uint8_t byte() { return has(1) ? data[pos++] : 0; }
    std::string bytes(size_t n) {
        n = std::min(n, size - pos);
        std::string s(reinterpret_cast<const char*>(data + pos), n);
        pos += n;
        return s;
    }
};

// Relative path made of safe components; "" when nothing is left.
std::string clean(const std::string& raw) {
    std::string out, component;
    auto flush = [&] {
        if (!component.empty() && component != "." && component != "..") out += (out.empty() ? "" : "/") + component;
        component.clear();
    };
    for (char c : raw) {
        if (c == '/') {
            flush();
        } else {
            const bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
            component.push_back(ok ? c : '_');
        }
    }
    flush();
    return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    torch::set_num_threads(1);
    static std::ostringstream sink;
    std::cerr.rdbuf(sink.rdbuf());  // the "skipping unreadable image" warnings
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const fs::path scratch = fuzz::scratch_dir("fuzz_image_folder");
    const fs::path root = scratch / "tree";
    fs::remove_all(root);
    fs::create_directories(root);
    Reader in{data, size};
    int records = 0;
    while (in.has(2) && records++ < 64) {
        const int kind = in.byte() % 3;
        const std::string name = clean(in.bytes(in.byte() % 48));
        if (name.empty()) continue;
        const fs::path path = root / name;
        std::error_code ec;
        fs::create_directories(path.parent_path(), ec);
        if (ec) continue;
        if (kind == 0) {
            fs::create_directories(path, ec);
        } else if (kind == 1) {
            const size_t n = size_t(in.byte()) | (size_t(in.byte()) << 8);
            const std::string content = in.bytes(n);
            if (!fs::exists(fs::symlink_status(path, ec))) fuzz::write_scratch_file(path, reinterpret_cast<const uint8_t*>(content.data()), content.size());
        } else {
            const std::string target = in.bytes(in.byte());
            if (target.empty() || target[0] == '/') continue;
            const fs::path resolved = (path.parent_path() / target).lexically_normal();
            const std::string r = resolved.string(), base = root.string();
            if (r.compare(0, base.size(), base) != 0) continue;  // would leave the scratch tree
            fs::create_symlink(target, path, ec);
        }
    }
    std::unique_ptr<train::ImageFolder> folder;
    try {
        folder = std::make_unique<train::ImageFolder>(root.string(), fuzz::kMaxPixels);
    } catch (const Error&) {
        return 0;
    }
    const auto& classes = folder->class_names();
    if (classes.empty() || !std::is_sorted(classes.begin(), classes.end()) ||
        std::adjacent_find(classes.begin(), classes.end()) != classes.end())
        fuzz::violated("fuzz_image_folder", "class names not sorted and unique");
    if (folder->size() <= 0) fuzz::violated("fuzz_image_folder", "a folder with no samples was accepted");
    for (int64_t i = 0; i < folder->size(); ++i) {
        try {
            const train::Example e = folder->get_raw(i);
            if (e.label < 0 || e.label >= folder->num_classes())
                fuzz::violated("fuzz_image_folder", "label out of range");
            if (e.image.dim() != 3 || e.image.size(2) != 3 || e.image.scalar_type() != torch::kUInt8)
                fuzz::violated("fuzz_image_folder", "sample is not uint8 (H, W, 3)");
        } catch (const Error&) {
            break;  // none readable: every later index gives the same answer
        }
    }
    return 0;
}
