// Fused CPU softmax attention, flash style (src/ops/attention/cpu.h). The tile products are the SIMD
// layer's register-blocked GEMM (ops/simd/gemm-inl.h through simd::gemm, float or double) and the work between
// them (maxima, exponentials, sums, rescaling) its softmax kernels (simd::online_softmax_cols and
// simd::softmax_grad_rows, Highway code for every target), called on raw pointers: no LibTorch dispatch, no
// BLAS, no allocation per tile.
//
// Forward: per (sample*head, query block) the block's q^T is copied once; per key tile S^T = k_j q^T
// (keys x queries, k as the GEMM's A), the online softmax runs along the queries (contiguous: 16 queries'
// maxima and sums stay in registers over the tile's keys), and O^T += v_j^T P^T. On AVX2, q^T and S^T are
// stored in column panels of 16 queries, the GEMM's panel width, each contiguous (see forward). With one key
// tile (a 224-px image) k and v are read in place, deit's q, k, v views of one qkv tensor are never copied;
// with more, every query block sweeps all keys, so k's rows are copied contiguous and v transposed once per
// call. The copied q^T holds q * scale (as the backward's q, so both compute the same logits), and each
// exponential e^(s - m) is 2^((s - m) log2 e).
// Backward (FlashAttention-2 order, row-major tiles): q * scale, and k, v as transposed key blocks, are laid
// out once per call; tasks are (sample*head, key segment).
//
// Threads: the work is split with at::parallel_for and every tile product runs on the calling thread.
#include "ops/attention/cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "linvis/core/error.h"
#include "ops/simd/amx.h"
#include "ops/simd/simd.h"

namespace linvis::ops::cpu {
namespace {

// Tile sizes (rows = queries, columns = keys); any size is correct. The forward's query blocks split N
// evenly (197 tokens: 2 blocks of 104 and 93, so 3 heads give 2 threads 3 equal tasks each), its key tiles
// split M evenly, and the backward's key blocks each key segment (below). Measured (AVX-512 Xeon, T = 4097,
// 3 heads of 64, `bench_ops attention --threads 1`, CPU time per pass from the difference of two --reps counts,
// because wall times on the shared 2-core machine (load 5-6) varied 2x): forward 128x512 115-116 ms, 64x512
// 112-116, 128x256 116-122, 256x256 110-114, 64x1024 107-115; forward+backward with backward tiles
// 128x256 350-377 ms, 256x256 333, 128x512 373, 64x256 353, 256x128 347: all within the noise (~7 %), so
// the tiles that keep a 197-token image in 2 query blocks and a 256-key tile near the L2 stayed.
constexpr int64_t kForwardQueries = 128;
constexpr int64_t kForwardKeys = 512;
constexpr int64_t kBackwardQueries = 128;
constexpr int64_t kBackwardKeys = 256;

// Queries per column panel of the forward's tiles on AVX2 (the SIMD GEMM's panel width there), and the
// multiple the tiles' row stride is rounded to (simd::online_softmax_cols works on whole vectors of queries).
constexpr int64_t kColumns = 16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The length of the parts when n is split into as few parts of at most max_part as possible, all of that
// length but the last, which is shorter by less than the number of parts (1025, 512: 342, 342 and 341).
int64_t even_part(int64_t n, int64_t max_part) { return n == 0 ? max_part : ceil_div(n, ceil_div(n, max_part)); }

// Query rows per block: at most `max_rows`, the N rows split evenly over the blocks (rounded up to 8), so
// the tasks of a short sequence are of one size (197 tokens: 2 blocks of 104 and 93 rows, not 128 and 69).
int64_t block_rows(int64_t N, int64_t max_rows) {
    if (N == 0) return max_rows;  // no queries: no tasks
    const int64_t blocks = ceil_div(N, max_rows);
    return std::min(max_rows, ceil_div(ceil_div(N, blocks), 8) * 8);
}

// Per-thread scratch that outlives the call (the pool's threads are reused): no allocation per call (a
// fresh tile above glibc's 128 KiB mmap threshold is an mmap/munmap pair per task chunk). Slot s of type T
// holds at least n elements (a few hundred KiB per thread at most, kept); their contents are whatever the
// last use left.
template <typename T>
T* scratch(int slot, int64_t n) {
    thread_local std::vector<T> buffers[3];
    std::vector<T>& b = buffers[slot];
    if (static_cast<int64_t>(b.size()) < n) b.resize(static_cast<size_t>(n));
    return b.data();
}

// x (BH, M, c) as blocks of KB rows transposed, (BH, ceil(M / KB), c, ld), zero past M and past KB in each
// row: the B operand (row-major, ldb = ld) of the backward's S = (q * scale) k^T and dP = dO v^T for key
// block b, contiguous (a tile product's B panel is a few consecutive pages, not c rows M floats apart).
torch::Tensor transposed_blocks(const torch::Tensor& x, int64_t KB, int64_t ld) {
    const int64_t BH = x.size(0), M = x.size(1), c = x.size(2), blocks = ceil_div(M, KB);
    const torch::Tensor padded = blocks * KB == M ? x : torch::constant_pad_nd(x, {0, 0, 0, blocks * KB - M}, 0.0);
    const torch::Tensor t = padded.view({BH, blocks, KB, c}).transpose(2, 3);
    return (ld == KB ? t : torch::constant_pad_nd(t, {0, ld - KB}, 0.0)).contiguous();
}

template <typename T>
T* ptr(const torch::Tensor& t) {
    return t.data_ptr<T>();
}

// A (B, h, T, c) tensor with unit stride along c: where (sample*head) bh starts and the row stride.
template <typename T>
struct Heads {
    const T* base;
    int64_t h, sample_stride, head_stride, row;
    explicit Heads(const torch::Tensor& t)
        : base(t.data_ptr<T>()), h(t.size(1)), sample_stride(t.stride(0)), head_stride(t.stride(1)), row(t.stride(2)) {}
    const T* at(int64_t bh) const { return base + (bh / h) * sample_stride + (bh % h) * head_stride; }
};

// v (B, h, M, dv), any row stride, as v^T (B*h, dv, M) contiguous: the A operand of the forward's
// O^T += v_j^T P^T with its rows along the keys. Read in place, v^T's rows are columns of v (deit: 3C floats
// apart), one cache line and often one page per key; transposed once per call, the tile product ran at
// 116 instead of 84 GFLOP/s on one AVX2 core and 181 instead of 164 on AVX-512 (64 x 128 x 512 tiles).
template <typename T>
torch::Tensor transposed_values(const torch::Tensor& v, const simd::Kernels& kern) {
    const int64_t BH = v.size(0) * v.size(1), M = v.size(2), dv = v.size(3);
    torch::Tensor vt = torch::empty({BH, dv, M}, v.options());
    const Heads<T> V(v);
    T* const dst = ptr<T>(vt);
    constexpr int64_t kRows = 64;  // keys per task: the task's rows of v and columns of v^T stay in cache
    const int64_t chunks = ceil_div(M, kRows);
    at::parallel_for(0, BH * chunks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = task / chunks, r0 = (task % chunks) * kRows, rows = std::min(M, r0 + kRows) - r0;
            const T* src = V.at(bh) + r0 * V.row;
            T* out = dst + bh * dv * M + r0;
            if constexpr (std::is_same_v<T, float>) {
                kern.transpose(src, rows, dv, V.row, out, M);
            } else {
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t c = 0; c < dv; ++c) out[c * M + r] = src[r * V.row + c];
            }
        }
    });
    return vt;
}

// q (B, h, N, d), k (B, h, M, d), v (B, h, M, dv), one floating type T, unit stride along the last dim
// (any other strides: deit's q, k, v are views of one qkv tensor). Writes out (B*h, N, dv) and the row
// logsumexp lse (B*h, N), contiguous. With more than one key tile k's rows are copied contiguous and v
// transposed once (transposed_values), then one parallel region: per (sample*head, query block) the block's
// q^T * scale (d x rows) is copied once, then per key tile S^T = k_j q^T (keys x queries, k as the GEMM's A),
// the online softmax along the queries, and O^T += v_j^T P^T.
template <typename T>
void forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
             const torch::Tensor& out, const torch::Tensor& lse) {
    const int64_t BH = q.size(0) * q.size(1), N = q.size(2), M = k.size(2), d = q.size(3), dv = v.size(3);
    // Key tiles of one length (1025 keys: 3 of 342, not 512, 512 and 1, whose last tile is a rescale pass and
    // two products of one key per query block).
    const int64_t KB = even_part(M, kForwardKeys);
    const int64_t rows_max = block_rows(N, kForwardQueries), blocks = ceil_div(N, rows_max);
    const int64_t QB = ceil_div(rows_max, kColumns) * kColumns;  // the tiles' row stride
    const simd::Target target = simd::active_target();
    const simd::Kernels& kern = simd::kernels(target);
    // More than one key tile: each query block sweeps all keys, so k and v are laid out once for the sweeps, v
    // transposed (transposed_values) and k's rows contiguous (deit's are 3C floats apart: the 512 x 128 x 64
    // product swept over 4096 keys ran 13-15 % faster on contiguous rows, AVX2 and AVX-512). One key tile (a
    // 224-px image): both are read in place, their rows a few hundred KiB apart at most, as the copies and
    // their parallel regions would cost more than they save (measured 0.98-0.99x).
    const bool transpose_v = M > KB;
    const torch::Tensor k_rows = transpose_v ? k.contiguous() : k;
    const Heads<T> Q(q), K(k_rows), V(v);
    const torch::Tensor vt = transpose_v ? transposed_values<T>(v, kern) : torch::Tensor();
    const T* const vt_p = transpose_v ? ptr<T>(vt) : nullptr;
    T *out_p = ptr<T>(out), *lse_p = ptr<T>(lse);
    const T sc = static_cast<T>(scale);
    // q^T and S^T in column panels of PW queries, each contiguous (d x PW and keys x PW), so that a tile
    // product's B panel is read in sequence rather than as rows 4 * QB bytes apart: with QB = 128 those rows
    // share 8 of the L1's 64 sets. On one core of the AVX2 EPYC (Zen 3, tiles 512 x 128 x 64 and 64 x 128 x 512
    // swept over 4096 keys) S^T = k q^T ran at 78 -> 86 GFLOP/s and O^T += v^T P^T at 62 -> 88. AVX2 takes
    // panels of its GEMM's width (16 floats); the other targets keep one panel of the whole block (PW = QB,
    // row-major tiles), not measured with panels.
    const int64_t PW = target == simd::Target::Avx2 ? kColumns : QB;
    const int64_t key_tile = std::min(KB, M), panel = key_tile * PW;
    at::parallel_for(0, BH * blocks, 1, [&](int64_t begin, int64_t end) {
        T* const st = scratch<T>(0, key_tile * QB);
        T* const qt = scratch<T>(1, (d + dv) * QB);
        T* const ot = qt + d * QB;  // O^T, row-major (dv x QB)
        T* const m = scratch<T>(2, 3 * QB);
        T *const l = m + QB, *const alpha = m + 2 * QB;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = task / blocks, i0 = (task % blocks) * rows_max;
            const int64_t rows = std::min(rows_max, N - i0);
            const T* qi = Q.at(bh) + i0 * Q.row;
            for (int64_t r = 0; r < rows; ++r) {
                T* const qr = qt + r / PW * d * PW + r % PW;  // query r's column in its panel
                for (int64_t x = 0; x < d; ++x) qr[x * PW] = qi[r * Q.row + x] * sc;
            }
            const T* kb = K.at(bh);
            // v_j^T as the GEMM's A: rows along the keys in v^T, or v's columns read in place.
            const T* va = transpose_v ? vt_p + bh * dv * M : V.at(bh);
            const int64_t va_row = transpose_v ? M : 1, va_key = transpose_v ? 1 : V.row;
            for (int64_t j0 = 0; j0 < M; j0 += KB) {
                const int64_t cols = std::min(KB, M - j0);
                const bool first = j0 == 0;
                for (int64_t p0 = 0; p0 < rows; p0 += PW)
                    simd::gemm(kern, cols, std::min(PW, rows - p0), d, kb + j0 * K.row, K.row, 1, qt + p0 * d, PW,
                               st + p0 / PW * panel, PW, false);
                simd::online_softmax_cols(kern, simd::SoftmaxTileCols<T>{st, cols, rows, PW, panel, m, l, alpha,
                                                                         ot, QB, dv, first});
                for (int64_t p0 = 0; p0 < rows; p0 += PW)
                    simd::gemm(kern, dv, std::min(PW, rows - p0), cols, va + j0 * va_key, va_row, va_key,
                               st + p0 / PW * panel, PW, ot + p0, QB, /*accumulate=*/!first);
            }
            T* dst = out_p + (bh * N + i0) * dv;
            T* lse_dst = lse_p + bh * N + i0;
            for (int64_t r = 0; r < rows; ++r) {
                const T inv = T(1) / l[r];
                for (int64_t c = 0; c < dv; ++c) dst[r * dv + c] = ot[c * QB + r] * inv;
                lse_dst[r] = m[r] + std::log(l[r]);
            }
        }
    });
}

int64_t round_up(int64_t n, int64_t multiple) { return ceil_div(n, multiple) * multiple; }

// bf16 inference with the products on the AMX tiles (simd::gemm_bf16, mode Tiles or Emulated): the float32
// forward's order - per (sample*head, query block), per key tile S^T = k_j (q scale)^T, the online softmax
// along the queries (the same SIMD kernel), O^T += v_j^T P^T - with bf16 operands and float32 sums: q scale
// rounded to bf16 once per block, P rounded to bf16 per tile, O rounded once at the end. The operands are
// padded with zeros to the tiles' multiples: per call k as (B*h, keys, d) and v^T as (B*h, dv, keys), keys
// padded per tile to 32 and d to 32; per block q^T as VNNI pairs (simd/amx.h), and per tile P^T, which the online
// softmax writes as pairs (SoftmaxTileCols::pairs). Returns out (B, h, N, dv) in bf16; no logsumexp (nothing is
// kept for a backward).
torch::Tensor forward_bf16_tiles(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
                                 simd::AmxMode mode) {
    const int64_t B = q.size(0), H = q.size(1), BH = B * H, N = q.size(2), M = k.size(2), d = q.size(3),
                  dv = v.size(3);
    const int64_t KB = round_up(even_part(M, kForwardKeys), 32), key_tiles = ceil_div(M, KB), M_pad = key_tiles * KB;
    const int64_t d_pad = round_up(d, 32), dv_pad = round_up(dv, 16);
    const int64_t rows_max = block_rows(N, kForwardQueries), blocks = ceil_div(N, rows_max);
    const int64_t QB = round_up(rows_max, 16);
    const auto bf16 = q.options().dtype(torch::kBFloat16);
    const torch::Tensor kp = torch::zeros({B, H, M_pad, d_pad}, bf16), vt = torch::zeros({B, H, dv_pad, M_pad}, bf16);
    kp.narrow(2, 0, M).narrow(3, 0, d).copy_(k);
    vt.narrow(2, 0, dv).narrow(3, 0, M).copy_(v.transpose(2, 3));
    torch::Tensor out = torch::empty({B, H, N, dv}, bf16);
    const simd::Kernels& kern = simd::kernels();
    const Heads<c10::BFloat16> Q(q);
    const auto* const kp_p = reinterpret_cast<const uint16_t*>(kp.data_ptr<c10::BFloat16>());
    const auto* const vt_p = reinterpret_cast<const uint16_t*>(vt.data_ptr<c10::BFloat16>());
    auto* const out_p = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
    at::parallel_for(0, BH * blocks, 1, [&](int64_t begin, int64_t end) {
        float* const st = scratch<float>(0, KB * QB);  // S^T (keys x queries)
        float* const ot = scratch<float>(1, dv_pad * QB + dv);  // O^T (dv_pad x QB), then a row of O
        float* const m = scratch<float>(2, 3 * QB);
        float *const l = m + QB, *const alpha = m + 2 * QB;
        uint16_t* const qv = scratch<uint16_t>(0, d_pad * QB);  // (q scale)^T as VNNI pairs
        uint16_t* const pv = scratch<uint16_t>(1, KB * QB);     // P^T as VNNI pairs
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = task / blocks, i0 = (task % blocks) * rows_max;
            const int64_t rows = std::min(rows_max, N - i0);
            simd::transpose_pairs_bf16(reinterpret_cast<const uint16_t*>(Q.at(bh) + i0 * Q.row), rows, d, Q.row,
                                       static_cast<float>(scale), d_pad, qv, 2 * QB);
            // Queries past `rows` (to QB): zero, so their logits are 0 and every value stays finite.
            for (int64_t x = 0; x < d_pad / 2; ++x)
                std::fill(qv + x * 2 * QB + 2 * rows, qv + (x + 1) * 2 * QB, uint16_t(0));
            const uint16_t* const kb = kp_p + bh * M_pad * d_pad;
            const uint16_t* const vb = vt_p + bh * dv_pad * M_pad;
            for (int64_t j = 0; j < key_tiles; ++j) {
                const int64_t j0 = j * KB, cols = std::min(KB, M - j0);
                const bool first = j == 0;
                simd::gemm_bf16(mode, KB, QB, d_pad, kb + j0 * d_pad, d_pad, qv, 2 * QB, st, QB, false);
                simd::SoftmaxTileCols<float> tile{st, cols, rows, QB, KB * QB, m, l, alpha, ot, QB, dv, first};
                tile.pairs = pv;
                tile.pairs_ld = 2 * QB;
                tile.pairs_rows = KB;
                simd::online_softmax_cols(kern, tile);
                simd::gemm_bf16(mode, dv_pad, QB, KB, vb + j0, M_pad, pv, 2 * QB, ot, QB, /*accumulate=*/!first);
            }
            // O = O^T / l, row by row through a float32 row, rounded once.
            float* const row = ot + dv_pad * QB;
            uint16_t* dst = out_p + (bh * N + i0) * dv;
            for (int64_t r = 0; r < rows; ++r) {
                const float inv = 1.0f / l[r];
                for (int64_t c = 0; c < dv; ++c) row[c] = ot[c * QB + r] * inv;
                kern.narrow_to_bf16(row, dst + r * dv, dv);
            }
        }
    });
    return out;
}

// Key segments per (sample, head) in the backward: enough tasks for a few threads when there are few
// (sample, head) pairs (batch 1, 3 heads: 4 segments, 12 tasks, an even split on 2, 3, 4 or 6 threads),
// one segment otherwise, and never more segments than key tiles of kBackwardKeys (at 197 tokens the dQ
// parts, their sum and the extra parallel regions are not worth the better split). It depends on the shapes only, never on the thread count, so the sums - and the
// gradients - are the same on any number of threads.
constexpr int64_t kBackwardMinTasks = 12;

// Gradients of forward: dq, dk, dv (outputs, same shapes as q, k, v) from dout (BH, N, dv), the forward's
// out and lse. One task per (sample*head, key segment): it owns dK and dV of its keys, and adds its part of
// dQ into its own (N, d) buffer (dq itself when there is one segment); the parts are summed in segment
// order afterwards. dK = dS^T (q * scale) uses the pre-scaled q; dQ = scale dS k is scaled once at the end.
template <typename T>
void backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
              const torch::Tensor& lse, const torch::Tensor& dout, double scale, const torch::Tensor& dq,
              const torch::Tensor& dk, const torch::Tensor& dv) {
    const int64_t BH = q.size(0), N = q.size(1), M = k.size(1), d = q.size(2), dvs = v.size(2);
    const int64_t QB = block_rows(N, kBackwardQueries);
    // Segments of equal length (to one key): ceil(M / segments) keys each, in key blocks of at most
    // kBackwardKeys; the tiles' row stride LD is the block length rounded up to 16 (aligned rows).
    const int64_t segments = std::min(ceil_div(M, kBackwardKeys), std::max<int64_t>(1, ceil_div(kBackwardMinTasks, BH)));
    const int64_t segment_keys = ceil_div(M, segments);
    const int64_t KB = even_part(segment_keys, kBackwardKeys), LD = ceil_div(KB, 16) * 16;
    const int64_t segment_blocks = ceil_div(segment_keys, KB);
    const int64_t key_blocks = ceil_div(M, KB);
    const simd::Kernels& kern = simd::kernels();
    at::NoGradGuard no_grad;
    const torch::Tensor D = (dout * out).sum(-1);  // (BH, N)
    const torch::Tensor qs = q * scale, kt = transposed_blocks(k, KB, LD), vt = transposed_blocks(v, KB, LD);
    // dQ parts (BH, segments, N, d), or dq itself.
    const torch::Tensor dq_parts =
        segments > 1 ? torch::empty({BH, segments, N, d}, q.options()) : dq.unsqueeze(1);
    const T *qs_p = ptr<T>(qs), *k_p = ptr<T>(k), *kt_p = ptr<T>(kt), *vt_p = ptr<T>(vt), *g_p = ptr<T>(dout);
    const T *lse_p = ptr<T>(lse), *D_p = ptr<T>(D);
    T *dq_p = ptr<T>(dq_parts), *dk_p = ptr<T>(dk), *dv_p = ptr<T>(dv);
    at::parallel_for(0, BH * segments, 1, [&](int64_t begin, int64_t end) {
        T* const s_tile = scratch<T>(0, QB * LD);
        T* const dp_tile = scratch<T>(1, QB * LD);
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bh = task / segments, segment = task % segments;
            const int64_t first_block = std::min(key_blocks, segment * segment_blocks);
            const int64_t last_block = std::min(key_blocks, (segment + 1) * segment_blocks);
            const T *qb = qs_p + bh * N * d, *kb = k_p + bh * M * d, *ktb = kt_p + bh * key_blocks * d * LD;
            const T *vtb = vt_p + bh * key_blocks * dvs * LD, *gb = g_p + bh * N * dvs;
            const T *lse_b = lse_p + bh * N, *D_b = D_p + bh * N;
            T* dqb = dq_p + (bh * segments + segment) * N * d;
            T *dkb = dk_p + bh * M * d, *dvb = dv_p + bh * M * dvs;
            const int64_t j_begin = std::min(M, first_block * KB), j_end = std::min(M, last_block * KB);
            std::fill(dqb, dqb + N * d, T(0));
            std::fill(dkb + j_begin * d, dkb + j_end * d, T(0));
            std::fill(dvb + j_begin * dvs, dvb + j_end * dvs, T(0));
            for (int64_t j0 = j_begin; j0 < j_end; j0 += KB) {
                const int64_t cols = std::min(KB, M - j0);
                for (int64_t i0 = 0; i0 < N; i0 += QB) {
                    const int64_t rows = std::min(QB, N - i0);
                    const T *qi = qb + i0 * d, *gi = gb + i0 * dvs;
                    const int64_t b = j0 / KB;
                    simd::gemm(kern, rows, cols, d, qi, d, 1, ktb + b * d * LD, LD, s_tile, LD, false);  // S
                    simd::gemm(kern, rows, cols, dvs, gi, dvs, 1, vtb + b * dvs * LD, LD, dp_tile, LD,
                               false);  // dP
                    simd::softmax_grad_rows(kern, s_tile, dp_tile, rows, cols, LD, lse_b + i0, D_b + i0);
                    // dV += P^T dO, dK += dS^T (q * scale), dQ += dS k (scaled at the end).
                    simd::gemm(kern, cols, dvs, rows, s_tile, 1, LD, gi, dvs, dvb + j0 * dvs, dvs, true);
                    simd::gemm(kern, cols, d, rows, dp_tile, 1, LD, qi, d, dkb + j0 * d, d, true);
                    simd::gemm(kern, rows, d, cols, dp_tile, LD, 1, kb + j0 * d, d, dqb + i0 * d, d, true);
                }
            }
        }
    });
    if (segments > 1) {
        dq.copy_(dq_parts.select(1, 0));
        for (int64_t segment = 1; segment < segments; ++segment) dq.add_(dq_parts.select(1, segment));
    }
    dq.mul_(scale);
}

class SoftmaxAttentionFunction : public torch::autograd::Function<SoftmaxAttentionFunction> {
public:
    // q, k, v: (B, h, N, d), (B, h, M, d), (B, h, M, dv), float32 or float64, unit stride along the last dim.
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, double scale) {
        const int64_t B = q.size(0), H = q.size(1), N = q.size(2);
        torch::Tensor out = torch::empty({B, H, N, v.size(3)}, q.options());
        torch::Tensor lse = torch::empty({B * H, N}, q.options());
        if (q.scalar_type() == torch::kFloat64)
            cpu::forward<double>(q, k, v, scale, out, lse);
        else
            cpu::forward<float>(q, k, v, scale, out, lse);
        ctx->save_for_backward({q, k, v, out, lse});
        ctx->saved_data["scale"] = scale;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor &q4 = saved[0], &k4 = saved[1], &v4 = saved[2], &out4 = saved[3], &lse = saved[4];
        const double scale = ctx->saved_data["scale"].toDouble();
        const int64_t BH = q4.size(0) * q4.size(1), N = q4.size(2), M = k4.size(2);
        auto flat = [&](const torch::Tensor& t, int64_t tokens) {
            return t.reshape({BH, tokens, t.size(3)}).contiguous();
        };
        const torch::Tensor q = flat(q4, N), k = flat(k4, M), v = flat(v4, M), out = flat(out4, N);
        torch::Tensor dout = flat(grad_outputs[0].to(q.scalar_type()), N);
        torch::Tensor dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v);
        if (q.scalar_type() == torch::kFloat64)
            cpu::backward<double>(q, k, v, out, lse, dout, scale, dq, dk, dv);
        else
            cpu::backward<float>(q, k, v, out, lse, dout, scale, dq, dk, dv);
        return {dq.view(q4.sizes()), dk.view(k4.sizes()), dv.view(v4.sizes()), torch::Tensor()};
    }
};

}  // namespace

torch::Tensor softmax_attention_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      double scale) {
    LINVIS_CHECK(k.size(2) >= 1, "softmax_attention: the fused kernel needs at least one key, got k ",
                 shape_string(k.sizes()));
    // bf16 inference on a CPU with AMX: the products on its tiles (forward_bf16_tiles). With a graph to build, the
    // float32 kernel, whose backward has no bf16 form.
    const simd::AmxMode amx = q.scalar_type() == torch::kBFloat16 ? simd::amx_mode() : simd::AmxMode::Off;
    const bool needs_graph =
        torch::autograd::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
    if (amx != simd::AmxMode::Off && !needs_graph) {
        auto unit_last = [](const torch::Tensor& t) { return t.stride(3) == 1 || t.size(3) == 1 ? t : t.contiguous(); };
        return forward_bf16_tiles(unit_last(q), unit_last(k), unit_last(v), scale, amx);
    }
    const torch::ScalarType type = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    // Views are used in place (deit's q, k, v are slices of one qkv tensor); a copy only for another dtype
    // or a last dim that is not contiguous.
    auto prepare = [&](const torch::Tensor& t) {
        const torch::Tensor x = t.scalar_type() == type ? t : t.to(type);
        return x.stride(3) == 1 || x.size(3) == 1 ? x : x.contiguous();
    };
    torch::Tensor out = SoftmaxAttentionFunction::apply(prepare(q), prepare(k), prepare(v), scale);
    return out.to(q.scalar_type());
}

}  // namespace linvis::ops::cpu
