// Bytes the process has handed out for data and not taken back, for tests of how much memory an autograd graph
// keeps: glibc malloc's (mallinfo2: its arena's blocks in use plus its mmap'd blocks) and the tensor arena's
// (core/tensor_arena.h, installed by the test program: LibTorch's CPU tensors of 256 KiB and more). A tensor of
// N bytes kept alive shows as about N more. The test binary uses glibc's malloc (tcmalloc is linked into the
// linvis command only).
#pragma once

#include <malloc.h>

#include <cstdint>

#include "linvis/core/flops.h"
#include "linvis/core/tensor_arena.h"

namespace linvis::testing {

// What LibTorch's small objects (tensor headers and the like, freed or made around a measurement) can move the
// count by: a tensor of N bytes made between two readings shows as at least N - kHeapNoiseBytes. (glibc's mmap'd
// blocks used to hide this noise in their page of header; the arena's blocks are exact.)
inline constexpr int64_t kHeapNoiseBytes = 4096;

inline int64_t heap_bytes_in_use() {
    const struct mallinfo2 m = mallinfo2();
    return static_cast<int64_t>(m.uordblks + m.hblkhd + tensor_arena::stats().live_bytes);
}

// What fn's result keeps alive (with an autograd graph: the graph's saved tensors and the result itself), not
// counting the weights fn's inference products packed for oneDNN (a cache of the weights, flops.h).
template <typename Fn>
int64_t bytes_kept_by(Fn&& fn) {
    // packed_weight_bytes() first: it frees the copies of weights that died since (an earlier model's), which
    // would otherwise count as memory fn released.
    const int64_t packed_before = flops::packed_weight_bytes(), before = heap_bytes_in_use();
    const auto kept = fn();
    const int64_t packed_after = flops::packed_weight_bytes();
    return heap_bytes_in_use() - before - (packed_after - packed_before);
}

}  // namespace linvis::testing
