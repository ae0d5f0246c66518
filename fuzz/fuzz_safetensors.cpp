// libFuzzer target for the safetensors header parser (src/io/safetensors_format.cpp).
//
// Properties checked on every input, beyond "no crash, no sanitizer report":
//   * the parser either returns a header or throws linvis::Error; any other exception
//     escapes and is reported by libFuzzer as a crash;
//   * an accepted header is self-consistent: tensors in offset order tile the data buffer
//     exactly and each byte size equals shape x dtype size;
//   * writer/reader agreement: laying the accepted tensors out again with the writer and
//     parsing the result gives the same names, dtypes, shapes, sizes and metadata.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "linvis/core/error.h"
#include "linvis/io/safetensors_format.h"

using namespace linvis::io;

namespace {

[[noreturn]] void violated(const char* what) {
    std::fprintf(stderr, "fuzz_safetensors: property violated: %s\n", what);
    std::abort();
}

void check_consistent(const SafetensorsHeader& h, size_t size) {
    if (h.data_start != 8 + h.header_length || h.data_start + h.data_length != size) violated("header/data extents");
    uint64_t covered = 0;
    for (const auto& t : h.tensors) {
        if (t.begin != covered || t.end < t.begin || t.end > h.data_length) violated("offsets do not tile");
        uint64_t bits = static_cast<uint64_t>(dtype_bits(t.dtype));
        for (int64_t d : t.shape) {
            if (d < 0) violated("negative dimension accepted");
            if (d != 0 && bits > UINT64_MAX / static_cast<uint64_t>(d)) violated("overflowing shape accepted");
            bits *= static_cast<uint64_t>(d);
        }
        if (bits % 8 != 0 || bits / 8 != t.byte_size()) violated("byte size differs from shape x dtype");
        covered = t.end;
    }
    if (covered != h.data_length) violated("data buffer not fully covered");
}

void check_rewrite(const SafetensorsHeader& h) {
    SafetensorsLayout layout;
    try {
        layout = plan_safetensors_layout(h.tensors, h.metadata);
    } catch (const linvis::Error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        violated("writer refused a header the reader accepted");
    }
    if (layout.data_length != h.data_length) violated("rewritten data length differs");
    std::string bytes = layout.prefix;
    bytes.append(layout.data_length, '\0');
    SafetensorsHeader again;
    try {
        again = parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "rewrite");
    } catch (const linvis::Error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        violated("reader refused the writer's output");
    }
    if (again.header_length % 8 != 0) violated("writer header not padded to 8");
    if (again.metadata != h.metadata || again.tensors.size() != h.tensors.size()) violated("rewrite lost entries");
    for (const auto& t : h.tensors) {
        const TensorInfo* u = again.find(t.name);
        if (u == nullptr || u->dtype != t.dtype || u->shape != t.shape || u->byte_size() != t.byte_size()) {
            violated("rewrite changed a tensor");
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    SafetensorsHeader header;
    try {
        header = parse_safetensors_header(data, size, "fuzz-input");
    } catch (const linvis::Error&) {
        return 0;  // rejected cleanly
    }
    check_consistent(header, size);
    check_rewrite(header);
    return 0;
}
