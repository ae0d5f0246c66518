// bfloat16 tile products on Intel AMX (private to ops): C (float32) (+)= A B with A and B in bfloat16, on the
// tile registers of CPUs with AMX-TILE and AMX-BF16 (Xeon Sapphire Rapids and later), which Linux grants a process
// on request (arch_prctl ARCH_REQ_XCOMP_PERM). A tile instruction multiplies 16 x 32 by 32 x 16 bf16 values, 8192
// multiply-adds, where an AVX-512 FMA does 16: the products of a bf16 softmax attention, whose (queries x keys)
// logits never leave the kernel, run there instead of as float32 GEMMs (ops/attention/cpu.cpp). Highway has no
// matrix-engine operations, so the tile code is x86 intrinsics in amx.cpp, the SIMD layer's one such file.
//
// Which path runs, read on every call (as LINVIS_SIMD is):
//   Tiles     the AMX instructions: this CPU has AMX-TILE and AMX-BF16, Linux grants their state, LINVIS_AMX is
//             unset or "auto", and the SIMD target is AVX-512 (LINVIS_SIMD=avx2|scalar turns the tiles off with
//             the rest of the AVX-512 code);
//   Emulated  LINVIS_AMX=emulate: the same products computed by portable C++ with the tiles' arithmetic (float32
//             sums of exact bf16 products), so tests run every caller's tile code on any CPU (slowly);
//   Off       otherwise, or LINVIS_AMX=off: callers take their float32 path.
// An unknown LINVIS_AMX value is a linvis::Error naming the variable, the accepted values and the value found.
#pragma once

#include <cstdint>

namespace linvis::ops::simd {

enum class AmxMode { Off, Tiles, Emulated };

// Whether this CPU has AMX-TILE and AMX-BF16 and Linux grants this process their state (asked once).
bool amx_supported();
// The path the next tile product takes (above).
AmxMode amx_mode();
// "AMX tiles", "AMX emulated" or "off".
const char* amx_mode_name(AmxMode mode);

// C (M x N, row stride ldc) = A B, or C += A B with accumulate, for mode Tiles or Emulated. A: bf16 bit patterns
// (as c10::BFloat16 stores them), row-major M x K, row stride lda. B: the K x N bf16 matrix as VNNI pairs, the
// tiles' layout: K / 2 rows of N pairs, B[k][n] at b[(k / 2) * ldb + 2 n + k % 2], row stride ldb >= 2 N.
// M and N multiples of 16, K a multiple of 32 (callers pad with zeros). Sums are float32 (subnormal bf16 inputs
// and float32 results count as zero on the tiles, as the instruction defines).
void gemm_bf16(AmxMode mode, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
               int64_t ldb, float* c, int64_t ldc, bool accumulate);

// The transpose of x (N x K bf16, row stride ldx) times scale, rounded to bf16, as VNNI pairs (the B operand
// of gemm_bf16 for the product with x^T): out[(k / 2) * ldo + 2 n + k % 2] = bf16(scale x[n][k]) for n < N,
// k < K_padded (even), zero for k >= K. Pairs of one row of x are one 32-bit word of the output.
void transpose_pairs_bf16(const uint16_t* x, int64_t N, int64_t K, int64_t ldx, float scale, int64_t K_padded,
                          uint16_t* out, int64_t ldo);

}  // namespace linvis::ops::simd
