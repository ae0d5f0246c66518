// The one switch from a SIMD target to the function of that target's Highway namespace
// (N_AVX3 / N_AVX2 / the portable N_EMU128 or N_SCALAR). Include it after hwy/highway.h, in a file's
// HWY_ONCE part: HWY_TARGETS is only known once Highway's headers are in. Used by the files that keep
// a table of per-target functions (ops/simd/kernels.cpp, ops/ttt_linear/cpu.cpp).
#pragma once

#include "ops/simd/simd.h"

#if HWY_TARGETS & HWY_AVX3
#define LINVIS_SIMD_CASE_AVX512(FN) \
    case ::linvis::ops::simd::Target::Avx512: return N_AVX3::FN();
#else
#define LINVIS_SIMD_CASE_AVX512(FN)
#endif
#if HWY_TARGETS & HWY_AVX2
#define LINVIS_SIMD_CASE_AVX2(FN) \
    case ::linvis::ops::simd::Target::Avx2: return N_AVX2::FN();
#else
#define LINVIS_SIMD_CASE_AVX2(FN)
#endif
#if HWY_TARGETS & HWY_EMU128
#define LINVIS_SIMD_PORTABLE(FN) return N_EMU128::FN();
#else
#define LINVIS_SIMD_PORTABLE(FN) return N_SCALAR::FN();
#endif

// Returns FN() of target TARGET's namespace (the portable one for a target not compiled in); FN is
// looked up relative to the enclosing namespace, which holds the N_* namespaces.
#define LINVIS_SIMD_PER_TARGET(TARGET, FN) \
    switch (TARGET) {                      \
        LINVIS_SIMD_CASE_AVX512(FN)        \
        LINVIS_SIMD_CASE_AVX2(FN)          \
        default: LINVIS_SIMD_PORTABLE(FN)  \
    }
