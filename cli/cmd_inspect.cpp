// linvis inspect: what a safetensors file holds, after full validation of its header.
#include <algorithm>
#include <iomanip>
#include <iostream>

#include <nlohmann/json.hpp>

#include "command.h"
#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "options.h"

namespace linvis::cli {
namespace {

struct InspectOptions {
    std::string file;
    std::string format = "text";
};

int run_inspect(int argc, const char* const* argv) {
    InspectOptions o;
    CommandApp app("inspect", "List every tensor of a .safetensors file (dtype, shape, bytes), the total parameter "
                              "count and bytes, and the metadata. The whole header is validated first; a malformed "
                              "file is reported in one line.");
    add_format_option(app, o.format);
    app.add_option("FILE", o.file, "a .safetensors file")->required();
    if (!parse(app, argc, argv)) return 0;
    const std::string& format = o.format;
    const std::string& path = o.file;
    const io::SafetensorsFile file = io::SafetensorsFile::open(path);

    // Name order reads best; offsets are in the JSON output for those who need file order.
    std::vector<io::TensorInfo> entries = file.entries();
    std::sort(entries.begin(), entries.end(),
              [](const io::TensorInfo& a, const io::TensorInfo& b) { return a.name < b.name; });
    uint64_t total_elements = 0, total_bytes = 0;
    for (const auto& t : entries) {
        total_elements += t.numel();
        total_bytes += t.byte_size();
    }

    if (format == "json") {
        nlohmann::json tensors = nlohmann::json::array();
        for (const auto& t : entries) {
            tensors.push_back({{"name", t.name},
                               {"dtype", io::dtype_name(t.dtype)},
                               {"shape", t.shape},
                               {"elements", t.numel()},
                               {"bytes", t.byte_size()},
                               {"data_offsets", {t.begin, t.end}}});
        }
        nlohmann::json out = {{"file", path},
                              {"file_bytes", file.file_size()},
                              {"header_bytes", file.header().header_length},
                              {"tensor_count", entries.size()},
                              {"parameters", total_elements},
                              {"tensor_bytes", total_bytes},
                              {"metadata", file.metadata()},
                              {"tensors", tensors}};
        std::cout << out.dump(2) << "\n";
        return 0;
    }

    size_t name_width = 4, dtype_width = 5, shape_width = 5;
    for (const auto& t : entries) {
        name_width = std::max(name_width, t.name.size());
        dtype_width = std::max(dtype_width, std::string(io::dtype_name(t.dtype)).size());
        shape_width = std::max(shape_width, shape_string(t.shape).size());
    }
    std::cout << "file        " << path << " (" << file.file_size() << " bytes, header " << file.header().header_length
              << " bytes)\n"
              << "tensors     " << entries.size() << "\n"
              << "parameters  " << total_elements << "\n"
              << "bytes       " << total_bytes << "\n"
              << "metadata    " << (file.metadata().empty() ? "(none)" : "") << "\n";
    for (const auto& [key, value] : file.metadata()) std::cout << "  " << key << " = " << value << "\n";
    std::cout << "\n"
              << std::left << std::setw(static_cast<int>(name_width)) << "name" << "  "
              << std::setw(static_cast<int>(dtype_width)) << "dtype" << "  " << std::setw(static_cast<int>(shape_width))
              << "shape" << "  " << std::right << "bytes\n";
    for (const auto& t : entries) {
        std::cout << std::left << std::setw(static_cast<int>(name_width)) << t.name << "  "
                  << std::setw(static_cast<int>(dtype_width)) << io::dtype_name(t.dtype) << "  "
                  << std::setw(static_cast<int>(shape_width)) << shape_string(t.shape) << "  " << std::right
                  << t.byte_size() << "\n";
    }
    return 0;
}

CommandRegistrar registrar("inspect", "list the tensors, dtypes, shapes, sizes and metadata of a .safetensors file",
                           run_inspect);

}  // namespace
}  // namespace linvis::cli
