// Per-target building blocks of the fused kernels, written once with Highway ops (see simd.h).
// Included by files that use hwy/foreach_target.h (after hwy_targets.h): every definition lands in
// linvis::ops::simd::HWY_NAMESPACE, compiled once per target. Highway's re-inclusion guard below
// (the *-inl.h convention) lets the file be included once per target.
#if defined(LINVIS_OPS_SIMD_GEMM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef LINVIS_OPS_SIMD_GEMM_INL_H_
#undef LINVIS_OPS_SIMD_GEMM_INL_H_
#else
#define LINVIS_OPS_SIMD_GEMM_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <hwy/highway.h>

#include "ops/simd/simd.h"

HWY_BEFORE_NAMESPACE();
namespace linvis::ops::simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The simd::Target this namespace is compiled for.
constexpr Target kTarget = HWY_TARGET == HWY_AVX3 ? Target::Avx512 : HWY_TARGET == HWY_AVX2 ? Target::Avx2
                                                                                           : Target::Scalar;

// Stands for a mask that keeps every lane in Vec's load, store and keep: plain instructions instead of masked ones.
struct WholeVector {};

// A full vector of T with the small interface the kernels are written against:
// T, W (lanes), Mask, mask(n) (first n lanes), load(p, mask) (masked-off lanes read 0), store(p, mask)
// (masked-off lanes untouched), set1, zero, keep(mask, v) (zero outside mask), fma(a, b, c) = a*b + c,
// reduce (sum of the lanes), transpose_block (W x W, strided) and + - *. load, store and keep also take
// WholeVector for a mask (see for_each_vector).
template <typename S>
struct Vec {
    using T = S;
    using D = hn::ScalableTag<S>;
    using Mask = hn::Mask<D>;
    static constexpr int W = static_cast<int>(HWY_LANES(S));
    hn::Vec<D> x;

    static HWY_INLINE Mask mask(int n) { return hn::FirstN(D(), static_cast<size_t>(n < 0 ? 0 : n)); }
    static HWY_INLINE Vec load(const S* p, Mask m) { return {hn::MaskedLoad(m, D(), p)}; }
    HWY_INLINE void store(S* p, Mask m) const { hn::BlendedStore(x, m, D(), p); }
    // Whole vectors: plain loads and stores (AVX2's masked ones, vmaskmovps, cost more than plain ones).
    static HWY_INLINE Vec load(const S* p) { return {hn::LoadU(D(), p)}; }
    HWY_INLINE void store(S* p) const { hn::StoreU(x, D(), p); }
    static HWY_INLINE Vec load(const S* p, WholeVector) { return load(p); }
    HWY_INLINE void store(S* p, WholeVector) const { store(p); }
    static HWY_INLINE Vec keep(WholeVector, Vec a) { return a; }
    static HWY_INLINE Vec set1(S s) { return {hn::Set(D(), s)}; }
    static HWY_INLINE Vec zero() { return {hn::Zero(D())}; }
    static HWY_INLINE Vec keep(Mask m, Vec a) { return {hn::IfThenElseZero(m, a.x)}; }
    static HWY_INLINE Vec fma(Vec a, Vec b, Vec c) { return {hn::MulAdd(a.x, b.x, c.x)}; }
    static HWY_INLINE S reduce(Vec a) { return hn::GetLane(hn::SumOfLanes(D(), a.x)); }
    // dst (W x W, row stride ldd) = src (W x W, row stride lds) transposed. float on the vector targets:
    // 4 x 4 sub-blocks in 128-bit registers (32-bit, then 64-bit interleaves); otherwise element by element.
    static HWY_INLINE void transpose_block(const S* src, int64_t lds, S* dst, int64_t ldd) {
#if HWY_TARGET != HWY_SCALAR
        if constexpr (std::is_same_v<S, float> && W % 4 == 0) {
            const hn::Full128<float> d4;
            const hn::Full128<double> d2;
            for (int i = 0; i < W; i += 4)
                for (int j = 0; j < W; j += 4) {
                    const float* s = src + i * lds + j;
                    const auto r0 = hn::LoadU(d4, s), r1 = hn::LoadU(d4, s + lds);
                    const auto r2 = hn::LoadU(d4, s + 2 * lds), r3 = hn::LoadU(d4, s + 3 * lds);
                    // t0 = (r0[0] r1[0] r0[1] r1[1]), t1 = (r0[2] r1[2] r0[3] r1[3]), t2 / t3 likewise of r2, r3.
                    const auto t0 = hn::BitCast(d2, hn::InterleaveLower(d4, r0, r1));
                    const auto t1 = hn::BitCast(d2, hn::InterleaveUpper(d4, r0, r1));
                    const auto t2 = hn::BitCast(d2, hn::InterleaveLower(d4, r2, r3));
                    const auto t3 = hn::BitCast(d2, hn::InterleaveUpper(d4, r2, r3));
                    float* o = dst + j * ldd + i;
                    hn::StoreU(hn::BitCast(d4, hn::InterleaveLower(d2, t0, t2)), d4, o);
                    hn::StoreU(hn::BitCast(d4, hn::InterleaveUpper(d2, t0, t2)), d4, o + ldd);
                    hn::StoreU(hn::BitCast(d4, hn::InterleaveLower(d2, t1, t3)), d4, o + 2 * ldd);
                    hn::StoreU(hn::BitCast(d4, hn::InterleaveUpper(d2, t1, t3)), d4, o + 3 * ldd);
                }
            return;
        }
#endif
        for (int i = 0; i < W; ++i)
            for (int j = 0; j < W; ++j) dst[j * ldd + i] = src[i * lds + j];
    }
    friend HWY_INLINE Vec operator+(Vec a, Vec b) { return {hn::Add(a.x, b.x)}; }
    friend HWY_INLINE Vec operator-(Vec a, Vec b) { return {hn::Sub(a.x, b.x)}; }
    friend HWY_INLINE Vec operator*(Vec a, Vec b) { return {hn::Mul(a.x, b.x)}; }
};

// f(c, m) for c = 0, W, 2W, ... below n: m is WholeVector for the whole vectors and V::Mask for a partial last
// one, so the loads and stores f makes through m are plain wherever they can be. AVX2's masked loads and
// stores (vmaskmovps) are slow: with them on every vector the TTT-Linear scan's LayerNorm rows (d = 64) took
// 2.7-3.8x as long on a Zen 3 EPYC.
template <class V, class F>
HWY_INLINE void for_each_vector(int64_t n, F&& f) {
    int64_t c = 0;
    for (; c + V::W <= n; c += V::W) f(c, WholeVector{});
    if (c < n) f(c, V::mask(static_cast<int>(n - c)));
}

// dst[j*ldd + i] = src[i*lds + j] for i < rows, j < cols: W x W blocks through V::transpose_block, the edges
// element by element (the table's float transpose, and the TTT-Linear scan's float and double ones).
template <class V>
HWY_INLINE void transpose_blocks(const typename V::T* src, int64_t rows, int64_t cols, int64_t lds,
                                 typename V::T* dst, int64_t ldd) {
    constexpr int64_t W = V::W;
    const int64_t rows_full = W > 1 ? rows / W * W : 0, cols_full = W > 1 ? cols / W * W : 0;
    for (int64_t i = 0; i < rows_full; i += W)
        for (int64_t j = 0; j < cols_full; j += W) V::transpose_block(src + i * lds + j, lds, dst + j * ldd + i, ldd);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = i < rows_full ? cols_full : 0; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
}

// ---------------------------------------------------------------- register-blocked GEMM
// C (M x N, row-major, ldc) (+)= A (M x K; A(i, k) = A[i*ars + k*acs]) * B (K x N, row-major, ldb), see
// GemmInit. Column panels of NV vectors; MR rows x NV vectors of accumulators stay in registers over the
// whole K loop (no packing: the fused kernels' products are at most a few hundred wide). The last vector of
// a panel is masked (masked-off lanes are neither read nor written).

// Rows per register tile for NV vectors: MR*NV accumulators + NV B vectors + one broadcast A fit the
// register file (32 vectors on AVX-512, 16 on AVX2 and the portable target).
template <int NV>
constexpr int rows_per_tile() {
    if constexpr (HWY_TARGET == HWY_AVX3) return NV == 4 ? 6 : NV == 3 ? 8 : NV == 2 ? 12 : 16;
    else return NV == 2 ? 6 : 8;
}
// Vectors per column panel: 4 (64 floats) on AVX-512, 2 (16 floats) on AVX2 and the portable target.
constexpr int kPanelVectors = HWY_TARGET == HWY_AVX3 ? 4 : 2;

// kFull: every vector of the panel is whole (mask unused), so B and C move by plain loads and stores.
template <class V, int MR, int NV, bool kFull>
HWY_INLINE void gemm_tile(int64_t K, const typename V::T* A, int64_t ars, int64_t acs, const typename V::T* B,
                          int64_t ldb, typename V::T* C, int64_t ldc, const typename V::Mask* mask, GemmInit init,
                          const typename V::T* row) {
    const auto load = [mask](const typename V::T* p, int v) { return kFull ? V::load(p) : V::load(p, mask[v]); };
    V c[MR][NV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            c[r][v] = init == GemmInit::Accumulate ? load(C + r * ldc + v * V::W, v)
                      : init == GemmInit::Row      ? load(row + v * V::W, v)
                                                   : V::zero();
    for (int64_t k = 0; k < K; ++k) {
        const typename V::T* b = B + k * ldb;
        V bv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) bv[v] = load(b + v * V::W, v);
        const typename V::T* a = A + k * acs;
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const V av = V::set1(a[r * ars]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) c[r][v] = V::fma(av, bv[v], c[r][v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            if constexpr (kFull) c[r][v].store(C + r * ldc + v * V::W);
            else c[r][v].store(C + r * ldc + v * V::W, mask[v]);
        }
}

// gemm_tile of `rows` rows, rows in [kMin, MR], chosen at run time.
template <class V, int NV, bool kFull, int MR, int kMin>
HWY_INLINE void gemm_tile_rows(int rows, int64_t K, const typename V::T* A, int64_t ars, int64_t acs,
                               const typename V::T* B, int64_t ldb, typename V::T* C, int64_t ldc,
                               const typename V::Mask* mask, GemmInit init, const typename V::T* row) {
    if (rows == MR || MR == kMin) return gemm_tile<V, MR, NV, kFull>(K, A, ars, acs, B, ldb, C, ldc, mask, init, row);
    if constexpr (MR > kMin)
        gemm_tile_rows<V, NV, kFull, MR - 1, kMin>(rows, K, A, ars, acs, B, ldb, C, ldc, mask, init, row);
}

// All M rows of one column panel. M >= MR: ceil(M / MR) tiles of as even a height as they can have (MR / 2 to MR
// rows): the remainder of M / MR rows in tiles of 4 and 1 left few accumulators to a tile, whose loads then
// outweighed its multiply-adds (the ViT3 inner step's 32-row products, 64 columns: 6 x 5 + 2 x 1 rows 109
// GFLOP/s on one core of a Xeon, 6 x 6 rows 138). M < MR: tiles of 4 rows, then single rows.
template <class V, int NV, bool kFull>
HWY_NOINLINE void gemm_panel(int64_t M, int64_t K, const typename V::T* A, int64_t ars, int64_t acs,
                             const typename V::T* B, int64_t ldb, typename V::T* C, int64_t ldc,
                             const typename V::Mask* mask, GemmInit init, const typename V::T* row) {
    constexpr int MR = rows_per_tile<NV>();
    int64_t i = 0;
    if (M >= MR) {
        const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, taller = M % tiles;  // `taller` tiles of base + 1
        for (int64_t t = 0; t < tiles; ++t) {
            const int rows = static_cast<int>(base + (t < taller ? 1 : 0));
            gemm_tile_rows<V, NV, kFull, MR, MR / 2>(rows, K, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, mask,
                                                     init, row);
            i += rows;
        }
        return;
    }
    for (; i + 4 <= M; i += 4)
        gemm_tile<V, 4, NV, kFull>(K, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, mask, init, row);
    for (; i < M; ++i) gemm_tile<V, 1, NV, kFull>(K, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, mask, init, row);
}

// The portable target's GEMM: with one-lane vectors, register tiles leave the baseline's vector unit idle,
// so C is built row by row with axpy loops that the compiler vectorises for the baseline ISA (SSE2): 2.5x
// the one-lane tiles (bench_ops mlstm, chunk shapes 64x96x96, 1 thread: 7-9 -> 17-19 GFLOP/s).
template <class V>
void gemm_rows_axpy(int64_t M, int64_t N, int64_t K, const typename V::T* A, int64_t ars, int64_t acs,
                    const typename V::T* B, int64_t ldb, typename V::T* C, int64_t ldc, GemmInit init,
                    const typename V::T* row) {
    using T = typename V::T;
    for (int64_t i = 0; i < M; ++i) {
        T* __restrict c = C + i * ldc;
        if (init == GemmInit::Zero) std::fill(c, c + N, T(0));
        else if (init == GemmInit::Row) std::copy(row, row + N, c);
        for (int64_t k = 0; k < K; ++k) {
            const T a = A[i * ars + k * acs];
            const T* __restrict b = B + k * ldb;
            for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
        }
    }
}

template <class V>
void gemm(int64_t M, int64_t N, int64_t K, const typename V::T* A, int64_t ars, int64_t acs, const typename V::T* B,
          int64_t ldb, typename V::T* C, int64_t ldc, GemmInit init, const typename V::T* row = nullptr) {
    if (M <= 0 || N <= 0) return;
    if constexpr (V::W == 1) {
        gemm_rows_axpy<V>(M, N, K, A, ars, acs, B, ldb, C, ldc, init, row);
        return;
    }
    constexpr int64_t W = V::W, P = kPanelVectors * V::W;
    for (int64_t j0 = 0; j0 < N; j0 += P) {
        const int64_t width = std::min<int64_t>(P, N - j0);
        const int nv = static_cast<int>((width + W - 1) / W);
        typename V::Mask mask[kPanelVectors];
        for (int v = 0; v < kPanelVectors; ++v) mask[v] = V::mask(static_cast<int>(std::min<int64_t>(W, width - v * W)));
        const typename V::T* rj = row != nullptr ? row + j0 : nullptr;
        const typename V::T* Bj = B + j0;
        typename V::T* Cj = C + j0;
        // Panels of whole vectors (every panel of a width that is a multiple of W) skip the masks.
        const bool whole = width % W == 0;
        const auto panel = [&](auto vectors) {
            constexpr int NV = decltype(vectors)::value;
            if (whole) gemm_panel<V, NV, true>(M, K, A, ars, acs, Bj, ldb, Cj, ldc, mask, init, rj);
            else gemm_panel<V, NV, false>(M, K, A, ars, acs, Bj, ldb, Cj, ldc, mask, init, rj);
        };
        if constexpr (kPanelVectors == 4) {
            switch (nv) {
                case 4: panel(std::integral_constant<int, 4>()); break;
                case 3: panel(std::integral_constant<int, 3>()); break;
                case 2: panel(std::integral_constant<int, 2>()); break;
                default: panel(std::integral_constant<int, 1>()); break;
            }
        } else {
            if (nv == 2) panel(std::integral_constant<int, 2>());
            else panel(std::integral_constant<int, 1>());
        }
    }
}

}  // namespace linvis::ops::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // LINVIS_OPS_SIMD_GEMM_INL_H_ toggle
