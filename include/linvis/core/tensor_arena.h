// One address range for the CPU tensors of 256 KiB and more, placed first-fit in address order.
//
// Why: a forward pass frees and allocates the same blocks in the same order every time, and the live
// bytes of a pass peak well below what its resident set reaches under a general-purpose malloc.
// hvit3_tiny at 1024 px on the 2-core Zen 4 EPYC: 31 MiB of tensors live at once, but 67-72 MiB of
// activations resident under tcmalloc after the second pass, because tcmalloc's page heap places the same
// blocks differently from pass to pass, among its small objects. First-fit placement in a range of their
// own reaches the same high water in every pass: the range ends each pass as it began, so every pass
// places its blocks where the one before did. Measured with `linvis bench` against tcmalloc alone, in
// alternate processes (docs/performance.md, "The tensor arena"): hvit3_tiny's activations at 1024 px
// 56-58 MiB (71), vit3_tiny's 40 (46-56); at 2048 px 134-135 (161) and 112 (151); the same speed.
//
// Blocks of kMinBlockBytes and more come from the range; smaller ones, and any block the range cannot
// hold, from the allocator that was installed before (LibTorch's default: malloc). Pages are taken from the
// kernel when first written and kept for the next pass; release_free() hands the free ones back.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

namespace linvis::tensor_arena {

// Smaller blocks stay with malloc, which is good at them; from 256 KiB on tcmalloc serves a block from
// its page heap, where the placement differs from pass to pass. (A threshold of 1 MiB left hvit3_tiny and
// deit_tiny 3 MiB more at 1024 px; 64 KiB and 16 KiB changed less than 0.5 MiB.)
inline constexpr std::size_t kMinBlockBytes = std::size_t{256} << 10;
// Sizes are rounded up to whole pages, so a block's pages belong to it alone and release_free() is exact.
inline constexpr std::size_t kPageBytes = 4096;

struct Stats {
    std::size_t reserved_bytes = 0;    // the address range (virtual: only written pages are resident)
    std::size_t high_water_bytes = 0;  // end of the highest block placed since the last release_free() (or the
                                       // start): no page above it is resident
    std::size_t live_bytes = 0;        // blocks allocated and not yet freed (page-rounded)
    std::size_t live_blocks = 0;
    std::size_t peak_live_bytes = 0;   // most live bytes at once since the last release_free() (or the start):
                                       // the high water above it is what placement lost to holes
    std::size_t free_ranges = 0;       // holes below the high water
    std::size_t overflow_blocks = 0;   // requests the range could not hold (served by the previous allocator)
};

// The range and its bookkeeping, thread-safe. Placement: the lowest free range that holds the request;
// a freed block joins its free neighbours.
class Arena {
public:
    // Reserves `reserve_bytes` of address space (rounded up to pages) without committing memory.
    // Throws linvis::Error when the kernel refuses the reservation.
    explicit Arena(std::size_t reserve_bytes);
    ~Arena();
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;

    // A block of at least `bytes` (page-aligned), or nullptr when no free range holds it.
    void* allocate(std::size_t bytes);
    // `block` must come from allocate() on this arena and not be freed yet (else linvis::Error).
    void free(void* block);
    bool contains(const void* pointer) const;

    // Hands the pages of every free range below the high water back to the kernel (madvise DONTNEED);
    // returns the bytes released. The next write to them takes a fresh zeroed page.
    std::size_t release_free();
    Stats stats() const;

private:
    char* base_ = nullptr;
    std::size_t reserved_ = 0;
    mutable std::mutex mutex_;
    std::map<std::size_t, std::size_t> free_;            // offset -> length, address order
    std::unordered_map<std::size_t, std::size_t> live_;  // offset -> length
    std::size_t high_water_ = 0;
    std::size_t live_bytes_ = 0;
    std::size_t peak_live_bytes_ = 0;
    std::size_t overflow_blocks_ = 0;
};

// Makes a process-wide Arena LibTorch's CPU allocator (c10::SetCPUAllocator), reserving the machine's
// physical memory as address space: no pass can use more. Called by the linvis command at start-up;
// LINVIS_TENSOR_ARENA=0 in the environment keeps malloc for everything. Returns whether the arena serves
// allocations after the call; later calls do nothing. Tensors allocated before the call keep their memory.
bool install();
bool installed();
// The installed arena's numbers (all zero when none is installed).
Stats stats();
// release_free() of the installed arena; 0 when none is installed.
std::size_t release_free();

// An uninitialised CPU tensor whose memory comes from malloc, never from the arena: for a long-lived tensor made
// during a pass (a cache such as a conv's folded weights). In the range it would stay where that pass placed it,
// between blocks that come and go, and keep the free ranges around it from joining: hvit3_tiny's folded stem
// weights (one block of 288 KiB) raised its activations at 1024 px by 2.8 MiB. Other devices: at::empty.
at::Tensor empty_outside_arena(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace linvis::tensor_arena
