// The Highway targets linvis compiles, included before any Highway header by every file of the SIMD
// layer: Highway's default x86 set without SSSE3 and SSE4, i.e. AVX3 ("AVX-512"), AVX2 and the portable
// fallback ("scalar"): EMU128, or HWY_SCALAR (one lane) where Highway marks EMU128 broken (GCC < 12.3,
// e.g. Debian 12's GCC 12.2). See simd.h.
#pragma once

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
