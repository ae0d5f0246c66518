// Bytes the process's malloc has handed out and not taken back (glibc's mallinfo2: the arena's blocks in use
// plus its mmap'd blocks), for tests of how much memory an autograd graph keeps. LibTorch's CPU tensors come
// from malloc, so a tensor of N bytes kept alive shows as about N more. The test binary uses glibc's malloc
// (tcmalloc is linked into the linvis command only).
#pragma once

#include <malloc.h>

#include <cstdint>

#include "linvis/core/flops.h"

namespace linvis::testing {

inline int64_t heap_bytes_in_use() {
    const struct mallinfo2 m = mallinfo2();
    return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

// What fn's result keeps alive (with an autograd graph: the graph's saved tensors and the result itself), not
// counting the weights fn's inference products packed for oneDNN (a cache of the weights, flops.h).
template <typename Fn>
int64_t bytes_kept_by(Fn&& fn) {
    const int64_t before = heap_bytes_in_use(), packed_before = flops::packed_weight_bytes();
    const auto kept = fn();
    return heap_bytes_in_use() - before - (flops::packed_weight_bytes() - packed_before);
}

}  // namespace linvis::testing
