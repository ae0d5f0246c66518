// The safetensors container format, without LibTorch: dtypes, header parsing with every
// validation check, and the writer's layout (tensor order, offsets, padded JSON header).
//
// This header and src/io/safetensors_format.cpp depend only on the C++ standard library,
// linvis/core/error.h and (privately) nlohmann-json, so the libFuzzer target in fuzz/ can
// build them with clang alone. include/linvis/io/safetensors.h adds the LibTorch side.
//
// File layout (spec: shared/spec/anchors.md part D; docs/io.md):
//   bytes [0, 8)        N, the JSON header length, unsigned 64-bit little-endian
//   bytes [8, 8+N)      UTF-8 JSON object: {"NAME": {"dtype": "F32", "shape": [2, 3],
//                       "data_offsets": [BEGIN, END]}, ..., "__metadata__": {"k": "v"}}
//   bytes [8+N, EOF)    the data buffer; offsets are relative to its start, END is one past
//                       the last byte; tensors are dense, row-major, little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace linvis::io {

// Every dtype string of the reference format. The enumerator order is the reference
// writer's dtype order (it sorts tensors by this order, descending, then by name); do not
// reorder. linvis converts F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL to LibTorch tensors; the
// others parse (so 'linvis inspect' can list any valid file) but cannot be loaded.
enum class DType {
    BOOL,
    F4,
    F6_E2M3,
    F6_E3M2,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    F8_E8M0,
    F8_E4M3FNUZ,
    F8_E5M2FNUZ,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
};

// "F32", "BF16", ... exactly as written in the header.
const char* dtype_name(DType dtype);
// Parses a header dtype string; returns false for a string that is not a safetensors dtype.
bool dtype_from_name(const std::string& name, DType* dtype);
// Bits per element (4 and 6 for the sub-byte float formats, 64 for C64 = 2 x f32).
int dtype_bits(DType dtype);

// The largest header the reader accepts (the reference implementation's limit).
constexpr uint64_t kMaxHeaderBytes = 100000000;

// One tensor of a file, as its header describes it.
struct TensorInfo {
    std::string name;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;  // empty for a scalar; every entry >= 0
    uint64_t begin = 0;          // byte range [begin, end) inside the data buffer
    uint64_t end = 0;

    uint64_t byte_size() const { return end - begin; }
    // Product of the shape (1 for a scalar). Only valid on a validated entry.
    uint64_t numel() const;
};

// A fully validated header.
struct SafetensorsHeader {
    uint64_t header_length = 0;  // N
    uint64_t data_start = 0;     // 8 + N: file offset of the data buffer
    uint64_t data_length = 0;    // bytes in the data buffer (= file size - 8 - N)
    std::vector<TensorInfo> tensors;  // in data-buffer order (ascending offsets)
    std::map<std::string, std::string> metadata;
    bool has_metadata = false;  // the header had a non-null "__metadata__" object

    // The entry named `name`, or nullptr.
    const TensorInfo* find(const std::string& name) const;
};

// Parses and validates the header of a complete safetensors file held in [data, data+size).
// Throws linvis::Error "<source_name>: <problem>" for (in this order):
//   a buffer shorter than 8 bytes; N > kMaxHeaderBytes; N beyond the end of the buffer;
//   a header that does not start with '{' after optional JSON whitespace; invalid JSON
//   (including invalid UTF-8 and nesting deeper than 32 levels); duplicate keys at any level;
//   a root that is not an object; "__metadata__" that is neither an object nor null, or has
//   a non-string value; an entry that is not an object, lacks or adds a field, has a dtype
//   that is not a known string, a shape that is not an array of integers >= 0 (no floats,
//   no negatives, each <= INT64_MAX), data_offsets that are not two integers >= 0 with
//   begin <= end; shape x dtype size that overflows 64 bits, is not a whole number of bytes
//   or differs from END - BEGIN; an END beyond the data buffer (truncated file);
//   offsets that, sorted, do not tile [0, data_length) exactly (gaps, overlaps, trailing bytes).
// Never reads outside [data, data+size) and never throws any other exception type
// (allocation failure aside).
SafetensorsHeader parse_safetensors_header(const uint8_t* data, size_t size, const std::string& source_name);

// What a writer emits before the tensor bytes.
struct SafetensorsLayout {
    std::string prefix;               // 8-byte little-endian N followed by the N-byte header
    std::vector<TensorInfo> tensors;  // in writing order, with their data offsets
    uint64_t data_length = 0;         // total tensor bytes that follow the prefix
};

// Lays out a file the way the reference writer does: tensors sorted by dtype descending in
// DType enumerator order (for linvis' dtypes: I64, F64, F32, I32, BF16, F16, I16, I8, U8,
// BOOL), then by name (byte-wise); offsets packed from 0; compact JSON with "__metadata__"
// first (omitted when `metadata` is empty, keys sorted), then each tensor as
// {"dtype","shape","data_offsets"} in writing order; the JSON padded with spaces to a
// multiple of 8 bytes so that the data buffer starts 8-aligned and every tensor is
// naturally aligned. The begin/end of the given infos are ignored. Throws linvis::Error
// for a duplicate or reserved ("__metadata__") name, a negative dimension, a size overflow,
// invalid UTF-8 in a name or metadata string, or a header beyond kMaxHeaderBytes.
SafetensorsLayout plan_safetensors_layout(std::vector<TensorInfo> tensors,
                                          const std::map<std::string, std::string>& metadata);

}  // namespace linvis::io
