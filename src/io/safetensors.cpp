// LibTorch side of the safetensors reader/writer: mmap-backed reading, atomic writing.
#include "linvis/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>

#include "linvis/core/error.h"
#include "linvis/io/atomic_file.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; big-endian hosts would need byte swapping");

namespace linvis::io {
namespace {

struct DTypePair {
    DType st;
    torch::Dtype torch;
};

const DTypePair kTorchDTypes[] = {
    {DType::F64, torch::kDouble}, {DType::F32, torch::kFloat},  {DType::F16, torch::kHalf},
    {DType::BF16, torch::kBFloat16}, {DType::I64, torch::kLong}, {DType::I32, torch::kInt},
    {DType::I16, torch::kShort},  {DType::I8, torch::kChar},    {DType::U8, torch::kByte},
    {DType::BOOL, torch::kBool},
};

std::string errno_text(int error) { return std::strerror(error); }

// Closes a file descriptor on every path out of a scope.
struct FdGuard {
    int fd = -1;
    ~FdGuard() {
        if (fd >= 0) ::close(fd);
    }
};

// Serialises `tensors` through `sink` (called with the prefix, then each tensor's bytes).
void write_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const std::function<void(const void*, size_t)>& sink) {
    std::vector<TensorInfo> infos;
    infos.reserve(tensors.size());
    for (const auto& [name, tensor] : tensors) {
        LINVIS_CHECK(tensor.defined(), "safetensors writer: tensor '", name, "' is undefined");
        TensorInfo info;
        info.name = name;
        info.dtype = dtype_from_torch(tensor.scalar_type(), "tensor '" + name + "'");
        info.shape = tensor.sizes().vec();
        infos.push_back(std::move(info));
    }
    const SafetensorsLayout layout = plan_safetensors_layout(std::move(infos), metadata);
    sink(layout.prefix.data(), layout.prefix.size());
    for (const auto& info : layout.tensors) {
        const torch::Tensor dense = tensors.at(info.name).detach().to(torch::kCPU).contiguous();
        const size_t bytes = static_cast<size_t>(dense.numel()) * dense.element_size();
        LINVIS_CHECK(bytes == info.byte_size(), "safetensors writer: tensor '", info.name, "' has ", bytes,
                     " bytes, expected ", info.byte_size());
        if (bytes > 0) sink(dense.data_ptr(), bytes);
    }
}

}  // namespace

DType dtype_from_torch(torch::Dtype dtype, const std::string& what) {
    for (const auto& pair : kTorchDTypes) {
        if (pair.torch == dtype) return pair.st;
    }
    fail(what, ": dtype ", c10::toString(dtype),
         " cannot be stored (supported: float64, float32, float16, bfloat16, int64, int32, int16, int8, uint8, bool)");
}

torch::Dtype dtype_to_torch(DType dtype, const std::string& what) {
    for (const auto& pair : kTorchDTypes) {
        if (pair.st == dtype) return pair.torch;
    }
    fail(what, ": dtype ", dtype_name(dtype),
         " is valid safetensors but has no LibTorch 1.13 equivalent (supported: F64, F32, F16, BF16, I64, I32, "
         "I16, I8, U8, BOOL)");
}

// ------------------------------------------------------------------ reading

struct SafetensorsFile::Mapping {
    void* address = nullptr;
    size_t size = 0;
    Mapping(void* a, size_t s) : address(a), size(s) {}
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping() {
        if (address != nullptr) ::munmap(address, size);
    }
    const uint8_t* bytes() const { return static_cast<const uint8_t*>(address); }
};

SafetensorsFile::SafetensorsFile(std::string path, std::unique_ptr<Mapping> mapping, SafetensorsHeader header)
    : path_(std::move(path)), mapping_(std::move(mapping)), header_(std::move(header)) {
    for (size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

uint64_t SafetensorsFile::file_size() const { return mapping_ ? mapping_->size : 0; }

SafetensorsFile SafetensorsFile::open(const std::string& path) {
    FdGuard file;
    file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    LINVIS_CHECK(file.fd >= 0, path, ": cannot open: ", errno_text(errno));
    struct stat info {};
    LINVIS_CHECK(::fstat(file.fd, &info) == 0, path, ": cannot stat: ", errno_text(errno));
    LINVIS_CHECK(S_ISREG(info.st_mode), path, ": not a regular file");
    const size_t size = static_cast<size_t>(info.st_size);
    if (size < 8) {
        // Too small to map meaningfully (and mmap rejects 0 bytes): let the parser word the error.
        uint8_t small[8] = {};
        const ssize_t got = ::pread(file.fd, small, size, 0);
        parse_safetensors_header(small, got < 0 ? 0 : static_cast<size_t>(got), path);
        fail(path, ": file is ", size, " bytes, shorter than the 8-byte header length field");
    }
    void* address = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, file.fd, 0);
    LINVIS_CHECK(address != MAP_FAILED, path, ": cannot memory-map ", size, " bytes: ", errno_text(errno));
    auto mapping = std::make_unique<Mapping>(address, size);
    SafetensorsHeader header = parse_safetensors_header(mapping->bytes(), size, path);
    return SafetensorsFile(path, std::move(mapping), std::move(header));
}

std::vector<std::string> SafetensorsFile::names() const {
    std::vector<std::string> out;
    for (const auto& t : header_.tensors) out.push_back(t.name);
    std::sort(out.begin(), out.end());
    return out;
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
    const auto found = index_.find(name);
    LINVIS_CHECK(found != index_.end(), path_, ": no tensor named '", name, "' (the file holds ", header_.tensors.size(),
                 " tensors)");
    const TensorInfo* info = &header_.tensors[found->second];
    const std::string what = path_ + ": tensor '" + name + "'";
    const torch::Dtype dtype = dtype_to_torch(info->dtype, what);
    // Only zero-size tensors can reach here with huge dimensions (the bytes are in the file).
    int64_t nonzero_product = 1;
    for (int64_t d : info->shape) {
        LINVIS_CHECK(d == 0 || !__builtin_mul_overflow(nonzero_product, d, &nonzero_product), what, ": shape ",
                     shape_string(info->shape), " is too large for LibTorch");
    }
    // BOOL bytes are read as uint8 and compared with 0: a byte other than 0/1 in a bool
    // tensor would otherwise be undefined behaviour in LibTorch kernels.
    const torch::Dtype storage_dtype = dtype == torch::kBool ? torch::kByte : dtype;
    torch::Tensor out = torch::empty(info->shape, torch::TensorOptions().dtype(storage_dtype));
    const size_t bytes = static_cast<size_t>(info->byte_size());
    LINVIS_CHECK(static_cast<size_t>(out.numel()) * out.element_size() == bytes, what,
                 ": internal size mismatch");
    if (bytes > 0) {
        std::memcpy(out.data_ptr(), mapping_->bytes() + header_.data_start + info->begin, bytes);
    }
    return dtype == torch::kBool ? out.ne(0) : out;
}

std::map<std::string, torch::Tensor> SafetensorsFile::load_all() const {
    std::map<std::string, torch::Tensor> out;
    for (const auto& t : header_.tensors) out.emplace(t.name, tensor(t.name));
    return out;
}

// ------------------------------------------------------------------ writing

std::string serialize_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
    std::string out;
    write_safetensors(tensors, metadata,
                      [&](const void* data, size_t size) { out.append(static_cast<const char*>(data), size); });
    return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
    write_file_atomically(path, [&](const ByteSink& sink) { write_safetensors(tensors, metadata, sink); });
}

}  // namespace linvis::io
