#include "linvis/core/tensor_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <type_traits>

#include <ATen/Functions.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "linvis/core/error.h"

namespace linvis::tensor_arena {

namespace {

std::size_t round_up_to_page(std::size_t bytes) {
    return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
}

}  // namespace

Arena::Arena(std::size_t reserve_bytes) : reserved_(round_up_to_page(reserve_bytes)) {
    LINVIS_CHECK(reserved_ > 0, "tensor arena: cannot reserve 0 bytes");
    // MAP_NORESERVE: address space only; the kernel commits a page when it is first written.
    void* range = mmap(nullptr, reserved_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (range == MAP_FAILED)
        fail("tensor arena: reserving ", reserved_, " bytes of address space failed: ", std::strerror(errno));
    base_ = static_cast<char*>(range);
    free_.emplace(0, reserved_);
}

Arena::~Arena() {
    munmap(base_, reserved_);
}

void* Arena::allocate(std::size_t bytes) {
    const std::size_t size = round_up_to_page(bytes == 0 ? 1 : bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second < size) continue;
        const std::size_t offset = it->first;
        const std::size_t rest = it->second - size;
        free_.erase(it);
        if (rest > 0) free_.emplace(offset + size, rest);
        live_.emplace(offset, size);
        live_bytes_ += size;
        peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
        high_water_ = std::max(high_water_, offset + size);
        return base_ + offset;
    }
    ++overflow_blocks_;
    return nullptr;
}

void Arena::free(void* block) {
    LINVIS_CHECK(contains(block), "tensor arena: freeing ", block, ", which lies outside the arena");
    std::size_t offset = static_cast<std::size_t>(static_cast<char*>(block) - base_);
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = live_.find(offset);
    LINVIS_CHECK(found != live_.end(), "tensor arena: freeing ", block, ", which is not an allocated block");
    std::size_t length = found->second;
    live_.erase(found);
    live_bytes_ -= length;
    // Join the free neighbours, so that a pass that frees everything leaves one range.
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && next->first == offset + length) {
        length += next->second;
        next = free_.erase(next);
    }
    if (next != free_.begin()) {
        const auto previous = std::prev(next);
        if (previous->first + previous->second == offset) {
            offset = previous->first;
            length += previous->second;
            free_.erase(previous);
        }
    }
    free_.emplace(offset, length);
}

bool Arena::contains(const void* pointer) const {
    const char* p = static_cast<const char*>(pointer);
    return p >= base_ && p < base_ + reserved_;
}

std::size_t Arena::release_free() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t released = 0;
    for (const auto& [offset, length] : free_) {
        if (offset >= high_water_) break;
        const std::size_t touched = std::min(length, high_water_ - offset);
        if (madvise(base_ + offset, touched, MADV_DONTNEED) == 0) released += touched;
    }
    // Pages above the highest live block are untouched again.
    std::size_t top = 0;
    for (const auto& [offset, length] : live_) top = std::max(top, offset + length);
    high_water_ = top;
    peak_live_bytes_ = live_bytes_;
    return released;
}

Stats Arena::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    Stats s;
    s.reserved_bytes = reserved_;
    s.high_water_bytes = high_water_;
    s.live_bytes = live_bytes_;
    s.live_blocks = live_.size();
    s.peak_live_bytes = peak_live_bytes_;
    for (const auto& range : free_)
        if (range.first < high_water_) ++s.free_ranges;
    s.overflow_blocks = overflow_blocks_;
    return s;
}

namespace {

// Leaked on purpose: tensors freed during static destruction still return their blocks to it.
Arena* g_arena = nullptr;
c10::Allocator* g_previous = nullptr;
c10::DeleterFnPtr g_previous_raw_deleter = nullptr;

void delete_arena_block(void* block) {
    g_arena->free(block);
}

// For raw_allocate / raw_deallocate users: the block may come from either allocator.
void delete_any_block(void* block) {
    if (g_arena->contains(block)) g_arena->free(block);
    else g_previous_raw_deleter(block);
}

c10::DataPtr allocate_block(std::size_t bytes) {
    if (bytes >= kMinBlockBytes) {
        if (void* block = g_arena->allocate(bytes))
            return {block, block, &delete_arena_block, c10::Device(c10::DeviceType::CPU)};
    }
    return g_previous->allocate(bytes);
}

// LibTorch 2.x made Allocator::allocate non-const and added the pure virtual copy_data (1.13 has neither); the
// signature is detected rather than tied to a version number.
constexpr bool kConstAllocate =
    std::is_same_v<decltype(&c10::Allocator::allocate), c10::DataPtr (c10::Allocator::*)(std::size_t) const>;

template <typename Base>
struct ConstAllocate : Base {
    c10::DataPtr allocate(std::size_t bytes) const override { return allocate_block(bytes); }
};
template <typename Base>
struct MutableAllocate : Base {
    c10::DataPtr allocate(std::size_t bytes) override { return allocate_block(bytes); }
};

struct ArenaAllocator final
    : std::conditional_t<kConstAllocate, ConstAllocate<c10::Allocator>, MutableAllocate<c10::Allocator>> {
    c10::DeleterFnPtr raw_deleter() const override {
        return g_previous_raw_deleter != nullptr ? &delete_any_block : nullptr;
    }
    // An override where LibTorch declares it (2.x), an unused member in 1.13.
    void copy_data(void* destination, const void* source, std::size_t bytes) const {
        std::memcpy(destination, source, bytes);
    }
};

bool install_once() {
    const char* setting = std::getenv("LINVIS_TENSOR_ARENA");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_bytes = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page_bytes <= 0) return false;
    try {
        g_arena = new Arena(static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_bytes));
    } catch (const Error&) {
        return false;  // no address space to spare (e.g. ulimit -v): malloc serves everything
    }
    g_previous = c10::GetCPUAllocator();
    g_previous_raw_deleter = g_previous->raw_deleter();
    static ArenaAllocator allocator;
    // Priority above the default allocator's 0, so a later default registration cannot displace it.
    c10::SetCPUAllocator(&allocator, 1);
    return true;
}

}  // namespace

bool install() {
    static const bool serving = install_once();
    return serving;
}

bool installed() {
    return g_arena != nullptr;
}

Stats stats() {
    return g_arena != nullptr ? g_arena->stats() : Stats{};
}

std::size_t release_free() {
    return g_arena != nullptr ? g_arena->release_free() : 0;
}

at::Tensor empty_outside_arena(at::IntArrayRef sizes, const at::TensorOptions& options) {
    if (g_arena == nullptr || !options.device().is_cpu()) return at::empty(sizes, options);
    std::size_t count = 1;
    for (const int64_t size : sizes) {
        LINVIS_CHECK(size >= 0, "empty_outside_arena: expected sizes >= 0, got ", size);
        count *= static_cast<std::size_t>(size);
    }
    const std::size_t bytes = std::max<std::size_t>(1, count * options.dtype().itemsize());
    void* data = std::malloc(bytes);
    LINVIS_CHECK(data != nullptr, "empty_outside_arena: out of memory for ", bytes, " bytes");
    return at::from_blob(data, sizes, [](void* p) { std::free(p); }, options);
}

}  // namespace linvis::tensor_arena
