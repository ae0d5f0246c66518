// Reading and writing .safetensors files as LibTorch tensors.
//
// The format itself (layout, dtype strings, every validation check) lives in
// linvis/io/safetensors_format.h; this header maps it onto torch::Tensor:
//   F64 <-> kDouble, F32 <-> kFloat, F16 <-> kHalf, BF16 <-> kBFloat16, I64 <-> kLong,
//   I32 <-> kInt, I16 <-> kShort, I8 <-> kChar, U8 <-> kByte, BOOL <-> kBool.
// Other safetensors dtypes (U16/U32/U64, float8, F4/F6, C64) parse and are listed by
// 'linvis inspect', but tensor() refuses them with an error naming the tensor and dtype.
// The data buffer is little-endian; linvis builds only on little-endian hosts.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/io/safetensors_format.h"

namespace linvis::io {

// The safetensors dtype of a LibTorch dtype; throws linvis::Error naming `what` for any
// dtype outside the ten above.
DType dtype_from_torch(torch::Dtype dtype, const std::string& what);
// The LibTorch dtype of a safetensors dtype; throws naming `what` when LibTorch 1.13 has none.
torch::Dtype dtype_to_torch(DType dtype, const std::string& what);

// A safetensors file opened read-only and memory-mapped. open() validates the whole
// header (parse_safetensors_header) before any tensor is touched; tensors are copied out
// of the mapping into owned CPU tensors, so they stay valid after the file is closed.
// Move-only; the mapping is released by the destructor. Another process truncating the
// file while it is mapped can still raise SIGBUS (the safetensors writers, ours included,
// replace files by rename, which is safe).
class SafetensorsFile {
public:
    // Throws linvis::Error "<path>: <problem>" for an unreadable, malformed or truncated file.
    static SafetensorsFile open(const std::string& path);

    SafetensorsFile(SafetensorsFile&&) noexcept;
    SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
    ~SafetensorsFile();

    const std::string& path() const { return path_; }
    uint64_t file_size() const;
    const SafetensorsHeader& header() const { return header_; }
    // Entries in file (data offset) order.
    const std::vector<TensorInfo>& entries() const { return header_.tensors; }
    const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
    bool contains(const std::string& name) const { return index_.count(name) != 0; }
    std::vector<std::string> names() const;  // sorted

    // A CPU tensor with the entry's dtype and shape holding a copy of its bytes (a BOOL byte
    // other than 0 reads as true). Throws naming the file and key if absent or unsupported.
    torch::Tensor tensor(const std::string& name) const;
    // Every tensor, keyed by name.
    std::map<std::string, torch::Tensor> load_all() const;

private:
    struct Mapping;
    SafetensorsFile(std::string path, std::unique_ptr<Mapping> mapping, SafetensorsHeader header);

    std::string path_;
    std::unique_ptr<Mapping> mapping_;
    SafetensorsHeader header_;
    std::map<std::string, size_t> index_;  // name -> position in header_.tensors
};

// Writes `tensors` (any device; non-contiguous ones are made contiguous, so views and tied
// weights are written as independent copies) and optional string metadata to `path`, laid
// out exactly as plan_safetensors_layout describes (the reference writer's order: dtype
// descending I64, F64, F32, I32, BF16, F16, I16, I8, U8, BOOL, then name). Atomic: writes a
// temporary file in the same directory, fsyncs it, renames it over `path` and fsyncs the
// directory, so readers (and mappings of the old file) never see a partial file.
// Throws linvis::Error naming the tensor (unsupported dtype) or the path (I/O failure).
void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The complete file bytes save_safetensors would write (for tests and in-memory use).
std::string serialize_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                                  const std::map<std::string, std::string>& metadata = {});

}  // namespace linvis::io
