// bfloat16 tile products on Intel AMX (private to ops): C (float32) (+)= A B with A and B in bfloat16, on the
// tile registers of CPUs with AMX-TILE and AMX-BF16 (Xeon Sapphire Rapids and later), which Linux grants a process
// on request (arch_prctl ARCH_REQ_XCOMP_PERM). A tile instruction multiplies 16 x 32 by 32 x 16 bf16 values, 8192
// multiply-adds, where an AVX-512 FMA does 16: the products of a bf16 softmax attention, whose (queries x keys)
// logits never leave the kernel, run there instead of as float32 GEMMs (ops/attention/cpu.cpp), and so do the
// float32 products of the ViT3, T5 and DiT5 TTT mixers in bf16 inference, their operands rounded to bf16 on the way
// (gemm_f32_rounded_to_bf16, inference_kernels). Highway has no matrix-engine operations (nor bf16 conversions in
// Debian's 1.0.3), so the tile code is x86 intrinsics in amx.cpp, the SIMD layer's one such file.
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

struct Kernels;  // simd.h

enum class AmxMode { Off, Tiles, Emulated };

// Whether this CPU has AMX-TILE, AMX-BF16 and AVX512-BF16 and Linux grants this process the tiles' state (asked once).
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

// C (M x N, row stride ldc) = A B, or C += A B with accumulate, for float32 operands rounded to bf16 (to nearest
// even, as c10::BFloat16 rounds) and multiplied on the tiles (mode Tiles or Emulated) with float32 sums: simd::gemm's
// operands and strides (A[i a_row + k a_col], B row-major with row stride ldb), any M, N, K. The operands are
// copied into per-thread buffers in the tiles' layouts, zero-padded to whole tiles; C is written in place when M and
// N are multiples of 16, otherwise through a padded buffer.
void gemm_f32_rounded_to_bf16(AmxMode mode, int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row,
                              int64_t a_col, const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate);

// The kernels of the active SIMD target with `gemm` replaced by gemm_f32_rounded_to_bf16 in `mode` (Tiles or
// Emulated): the float32 kernels of the TTT mixers (ViT3, T5) run their products on the tiles with this table.
const Kernels& kernels_with_bf16_products(AmxMode mode);

// The kernels a fused forward without a graph runs for inputs of this dtype: kernels_with_bf16_products(amx_mode())
// for bfloat16 inputs when the tiles (or their emulation) are on, otherwise kernels(). Each product's operands
// are then rounded to bf16 once, as LibTorch's bf16 matmuls hold them; the graph-recording forward (and with it
// every backward) keeps the float32 products.
const Kernels& inference_kernels(bool bf16_inputs);

}  // namespace linvis::ops::simd
