// bfloat16 tile products on Intel AMX and their operand layouts (ops/simd/amx.h).
#include "ops/simd/amx.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "linvis/core/error.h"
#include "ops/simd/simd.h"

namespace linvis::ops::simd {
namespace {

// Linux's request for an extended state component (arch/x86/include/uapi/asm/prctl.h) and the AMX tile data's
// component number (the XSAVE feature bit of TILEDATA).
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureTileData = 18;

// AMX-TILE and AMX-BF16, and AVX512-BF16 for the conversions that round the operands (every AMX CPU so far has it).
bool cpu_has_amx_bf16() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) == 0) return false;
    const bool avx512_bf16 = (a >> 5) & 1u;
    return amx_bf16 && amx_tile && avx512_bf16;
}

float bf16_value(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

// The tiles' configuration (Intel SDM, LDTILECFG): palette 1, every tile 16 rows of 64 bytes (16 float32 or 32
// bf16): tiles 0-3 accumulate a 32 x 32 block of C, 4-5 hold two 16-row slices of A, 6-7 two 16-column slices
// of B.
struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

#define LINVIS_AMX_ATTR __attribute__((target("amx-tile,amx-bf16")))

// C block (16 MB x 16 NB) (+)= A rows (16 MB x K) B columns (K x 16 NB). Tile numbers are immediates, so the
// block shape is a template.
template <int MB, int NB>
LINVIS_AMX_ATTR void tile_block(int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
                                int64_t ldc, bool accumulate) {
    const int64_t sa = lda * 2, sb = ldb * 2, sc = ldc * 4;  // row strides in bytes
    float* const c1 = c + 16 * ldc;
    if (accumulate) {
        _tile_loadd(0, c, sc);
        if constexpr (NB > 1) _tile_loadd(1, c + 16, sc);
        if constexpr (MB > 1) _tile_loadd(2, c1, sc);
        if constexpr (MB > 1 && NB > 1) _tile_loadd(3, c1 + 16, sc);
    } else {
        _tile_zero(0);
        if constexpr (NB > 1) _tile_zero(1);
        if constexpr (MB > 1) _tile_zero(2);
        if constexpr (MB > 1 && NB > 1) _tile_zero(3);
    }
    // Each product issued as soon as its two tiles are loaded, so the loads of the next ones overlap it: 15-20 %
    // faster than four loads then four products (512 x 128 x 64 and 64 x 128 x 512 on a Xeon with AMX).
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t* bk = b + k / 2 * ldb;
        _tile_loadd(4, a + k, sa);
        _tile_loadd(6, bk, sb);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (NB > 1) {
            _tile_loadd(7, bk + 32, sb);
            _tile_dpbf16ps(1, 4, 7);
        }
        if constexpr (MB > 1) {
            _tile_loadd(5, a + 16 * lda + k, sa);
            _tile_dpbf16ps(2, 5, 6);
            if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, sc);
    if constexpr (NB > 1) _tile_stored(1, c + 16, sc);
    if constexpr (MB > 1) _tile_stored(2, c1, sc);
    if constexpr (MB > 1 && NB > 1) _tile_stored(3, c1 + 16, sc);
}

LINVIS_AMX_ATTR void gemm_tiles(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
                                int64_t ldb, float* c, int64_t ldc, bool accumulate) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    // Loaded on every call: oneDNN's AMX kernels on the same thread load their own configuration.
    _tile_loadconfig(&config);
    for (int64_t i = 0; i < M; i += 32) {
        const bool two_rows = M - i >= 32;
        for (int64_t j = 0; j < N; j += 32) {
            const bool two_cols = N - j >= 32;
            const uint16_t* ai = a + i * lda;
            const uint16_t* bj = b + 2 * j;
            float* cij = c + i * ldc + j;
            if (two_rows && two_cols) tile_block<2, 2>(K, ai, lda, bj, ldb, cij, ldc, accumulate);
            else if (two_rows) tile_block<2, 1>(K, ai, lda, bj, ldb, cij, ldc, accumulate);
            else if (two_cols) tile_block<1, 2>(K, ai, lda, bj, ldb, cij, ldc, accumulate);
            else tile_block<1, 1>(K, ai, lda, bj, ldb, cij, ldc, accumulate);
        }
    }
    // Back to the initial state: the tiles' 8 KiB are not saved at every context switch.
    _tile_release();
}

// The tiles' arithmetic in portable C++: per output, float32 sums of products of bf16 values (exact in float32).
void gemm_emulated(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                   float* c, int64_t ldc, bool accumulate) {
    for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
            float sum = accumulate ? c[i * ldc + j] : 0.0f;
            for (int64_t k = 0; k < K; ++k)
                sum += bf16_value(a[i * lda + k]) * bf16_value(b[k / 2 * ldb + 2 * j + k % 2]);
            c[i * ldc + j] = sum;
        }
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Rounding float32 rows to bf16 for the tiles, two ways: on the tiles' own CPUs with AVX512-BF16's conversions
// (VCVTNE2PS2BF16: to nearest even, as c10::BFloat16 rounds; subnormals become zero, as the tile products read
// them anyway), and in portable code through the SIMD layer's narrow_to_bf16 for the emulated path.
#define LINVIS_AMX_ROUND_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// The lanes of a 16-float load that hold one of the `left` elements still to read.
inline __mmask16 first_lanes(int64_t left) {
    return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1u);
}

// The rows of x (rows x n, row stride ldx) rounded to bf16: y[i n_pad + j] = bf16(x[i ldx + j]) for j < n, zero for
// n <= j < n_pad (a multiple of 32).
LINVIS_AMX_ROUND_ATTR void round_rows_native(const float* x, int64_t ldx, int64_t rows, int64_t n, uint16_t* y,
                                             int64_t n_pad) {
    for (int64_t i = 0; i < rows; ++i) {
        const float* const xi = x + i * ldx;
        for (int64_t j = 0; j < n_pad; j += 32) {
            const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(n - j), xi + j);
            const __m512 hi = _mm512_maskz_loadu_ps(first_lanes(n - j - 16), xi + j + 16);
            _mm512_storeu_si512(y + i * n_pad + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        }
    }
}

// Pairs of rows of x (rows x n, row stride ldx) rounded to bf16 as 32-bit words, the even row in the low half:
// out[(k / 2) n_pad + j] = bf16(x[k][j]) | bf16(x[k + 1][j]) << 16, x[rows][.] = 0, zero for n <= j < n_pad (a
// multiple of 16), for k < rows_pad (even). Both rows are rounded into one vector whose 16-bit lanes are then
// interleaved.
LINVIS_AMX_ROUND_ATTR void round_pairs_native(const float* x, int64_t ldx, int64_t rows, int64_t n, uint32_t* out,
                                              int64_t n_pad, int64_t rows_pad) {
    alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                             21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                             11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_load_si512(kInterleave);
    for (int64_t k = 0; k < rows_pad; k += 2) {
        uint32_t* const row = out + k / 2 * n_pad;
        const int64_t n_even = k < rows ? n : 0, n_odd = k + 1 < rows ? n : 0;
        for (int64_t j = 0; j < n_pad; j += 16) {
            const __m512 even = _mm512_maskz_loadu_ps(first_lanes(n_even - j), x + k * ldx + j);
            const __m512 odd = _mm512_maskz_loadu_ps(first_lanes(n_odd - j), x + (k + 1) * ldx + j);
            const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
            _mm512_storeu_si512(row + j, _mm512_permutexvar_epi16(order, both));
        }
    }
}

// The same in portable code (the emulated path).
void round_rows_portable(const Kernels& kern, const float* x, int64_t ldx, int64_t rows, int64_t n, uint16_t* y,
                         int64_t n_pad) {
    for (int64_t i = 0; i < rows; ++i) {
        kern.narrow_to_bf16(x + i * ldx, y + i * n_pad, n);
        std::fill(y + i * n_pad + n, y + (i + 1) * n_pad, uint16_t(0));
    }
}
void round_pairs_portable(const Kernels& kern, const float* x, int64_t ldx, int64_t rows, int64_t n, uint32_t* out,
                          int64_t n_pad, int64_t rows_pad) {
    thread_local std::vector<uint16_t> rounded;
    rounded.resize(static_cast<size_t>(2 * n));
    for (int64_t k = 0; k < rows_pad; k += 2) {
        std::fill(rounded.begin(), rounded.end(), uint16_t(0));
        if (k < rows) kern.narrow_to_bf16(x + k * ldx, rounded.data(), n);
        if (k + 1 < rows) kern.narrow_to_bf16(x + (k + 1) * ldx, rounded.data() + n, n);
        uint32_t* const row = out + k / 2 * n_pad;
        for (int64_t j = 0; j < n; ++j)
            row[j] = static_cast<uint32_t>(rounded[j]) | static_cast<uint32_t>(rounded[n + j]) << 16;
        std::fill(row + n, row + n_pad, 0u);
    }
}

// Rounding on the tiles' CPUs (native) or portably, into the two operand layouts.
struct Rounding {
    const Kernels& kern;
    bool native;
    void rows(const float* x, int64_t ldx, int64_t rows, int64_t n, uint16_t* y, int64_t n_pad) const {
        if (native) round_rows_native(x, ldx, rows, n, y, n_pad);
        else round_rows_portable(kern, x, ldx, rows, n, y, n_pad);
    }
    void pairs(const float* x, int64_t ldx, int64_t rows, int64_t n, uint32_t* out, int64_t n_pad,
               int64_t rows_pad) const {
        if (native) round_pairs_native(x, ldx, rows, n, out, n_pad, rows_pad);
        else round_pairs_portable(kern, x, ldx, rows, n, out, n_pad, rows_pad);
    }
};

// A (M x K, element (i, k) at a[i a_row + k a_col]) rounded to bf16 as rows of K_pad values (zero past K), and zero
// rows from M to M_pad. A column-strided A, the transpose of the row-major K x M matrix X, is X's pairs of rows as
// 32-bit words (round_pairs), transposed as words: half the data a float32 transpose would move.
void pack_rows(const Rounding& round, const float* a, int64_t M, int64_t K, int64_t a_row, int64_t a_col,
               int64_t M_pad, int64_t K_pad, uint16_t* out) {
    if (a_col == 1) {
        round.rows(a, a_row, M, K, out, K_pad);
    } else if (a_row == 1) {
        thread_local std::vector<uint32_t> words;
        const int64_t ld = round_up(M, 16);
        words.resize(static_cast<size_t>(K_pad / 2 * ld));
        round.pairs(a, a_col, K, M, words.data(), ld, K_pad);
        round.kern.transpose(reinterpret_cast<const float*>(words.data()), K_pad / 2, M, ld,
                             reinterpret_cast<float*>(out), K_pad / 2);
    } else {
        thread_local std::vector<float> gathered;
        gathered.resize(static_cast<size_t>(M * K));
        for (int64_t i = 0; i < M; ++i)
            for (int64_t k = 0; k < K; ++k) gathered[i * K + k] = a[i * a_row + k * a_col];
        round.rows(gathered.data(), K, M, K, out, K_pad);
    }
    std::fill(out + M * K_pad, out + M_pad * K_pad, uint16_t(0));
}

// B (K x N, row stride ldb) rounded to bf16 as VNNI pairs: K_pad / 2 rows of N_pad 32-bit words, zero past K and N.
void pack_pairs(const Rounding& round, const float* b, int64_t K, int64_t N, int64_t ldb, int64_t K_pad,
                int64_t N_pad, uint16_t* out) {
    round.pairs(b, ldb, K, N, reinterpret_cast<uint32_t*>(out), N_pad, K_pad);
}

void gemm_tiles_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    gemm_f32_rounded_to_bf16(AmxMode::Tiles, M, N, K, A, a_row, a_col, B, ldb, C, ldc, accumulate);
}
void gemm_emulated_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B,
                       int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    gemm_f32_rounded_to_bf16(AmxMode::Emulated, M, N, K, A, a_row, a_col, B, ldb, C, ldc, accumulate);
}

}  // namespace

// Each row of x times scale, rounded to bf16 by the SIMD layer (as c10::BFloat16 rounds) and zero past K, is a row of
// K_padded / 2 32-bit words, a pair per word with the even column in the low half; the words are then transposed
// (the SIMD layer's transpose moves 32-bit lanes as they are): output row k / 2 holds pair k / 2 of every row of x.
void transpose_pairs_bf16(const uint16_t* x, int64_t N, int64_t K, int64_t ldx, float scale, int64_t K_padded,
                          uint16_t* out, int64_t ldo) {
    const Kernels& kern = kernels();
    thread_local std::vector<uint16_t> rows;
    rows.resize(static_cast<size_t>(N * K_padded));
    const auto times_scale = [scale](const float* a, const float*, float* y, int64_t n) {
        for (int64_t i = 0; i < n; ++i) y[i] = a[i] * scale;
    };
    for (int64_t n = 0; n < N; ++n) {
        uint16_t* const row = rows.data() + n * K_padded;
        bf16_through_float(kern, x + n * ldx, nullptr, row, K, times_scale);
        std::fill(row + K, row + K_padded, uint16_t(0));
    }
    kern.transpose(reinterpret_cast<const float*>(rows.data()), N, K_padded / 2, K_padded / 2,
                   reinterpret_cast<float*>(out), ldo / 2);
}

bool amx_supported() {
    static const bool supported =
        cpu_has_amx_bf16() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
    return supported;
}

AmxMode amx_mode() {
    const char* env = std::getenv("LINVIS_AMX");
    const std::string v = env != nullptr ? env : "";
    if (v == "off") return AmxMode::Off;
    if (v == "emulate") return AmxMode::Emulated;
    if (!v.empty() && v != "auto") fail("LINVIS_AMX: expected 'auto', 'off' or 'emulate', got '", v, "'");
    return amx_supported() && active_target() == Target::Avx512 ? AmxMode::Tiles : AmxMode::Off;
}

const char* amx_mode_name(AmxMode mode) {
    switch (mode) {
        case AmxMode::Tiles: return "AMX tiles";
        case AmxMode::Emulated: return "AMX emulated";
        case AmxMode::Off: break;
    }
    return "off";
}

void gemm_bf16(AmxMode mode, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
               int64_t ldb, float* c, int64_t ldc, bool accumulate) {
    LINVIS_CHECK(M % 16 == 0 && N % 16 == 0 && K % 32 == 0,
                 "simd::gemm_bf16: M and N must be multiples of 16 and K of 32, got ", M, ", ", N, ", ", K);
    LINVIS_CHECK(mode != AmxMode::Off, "simd::gemm_bf16: called with the AMX path off");
    if (mode == AmxMode::Tiles) gemm_tiles(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
    else gemm_emulated(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}

void gemm_f32_rounded_to_bf16(AmxMode mode, int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row,
                              int64_t a_col, const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    if (M == 0 || N == 0) return;
    // The tiles run with the AVX-512 target only (amx_mode), whose table is fetched once rather than per call.
    static const Kernels* const avx512 = target_supported(Target::Avx512) ? &kernels(Target::Avx512) : nullptr;
    const bool native = mode == AmxMode::Tiles;
    const Kernels& kern = native ? *avx512 : kernels();
    const int64_t M_pad = round_up(M, 16), N_pad = round_up(N, 16), K_pad = round_up(std::max<int64_t>(K, 1), 32);
    thread_local std::vector<uint16_t> a_tiles, b_tiles;
    thread_local std::vector<float> c_tiles;
    a_tiles.resize(static_cast<size_t>(M_pad * K_pad));
    b_tiles.resize(static_cast<size_t>(K_pad * N_pad));
    const Rounding round{kern, native};
    pack_rows(round, A, M, K, a_row, a_col, M_pad, K_pad, a_tiles.data());
    pack_pairs(round, B, K, N, ldb, K_pad, N_pad, b_tiles.data());
    if (M == M_pad && N == N_pad) {
        gemm_bf16(mode, M, N, K_pad, a_tiles.data(), K_pad, b_tiles.data(), 2 * N_pad, C, ldc, accumulate);
        return;
    }
    c_tiles.resize(static_cast<size_t>(M_pad * N_pad));
    gemm_bf16(mode, M_pad, N_pad, K_pad, a_tiles.data(), K_pad, b_tiles.data(), 2 * N_pad, c_tiles.data(), N_pad,
              false);
    for (int64_t i = 0; i < M; ++i) {
        const float* const src = c_tiles.data() + i * N_pad;
        float* const dst = C + i * ldc;
        if (accumulate) {
            for (int64_t j = 0; j < N; ++j) dst[j] += src[j];
        } else {
            std::copy(src, src + N, dst);
        }
    }
}

const Kernels& kernels_with_bf16_products(AmxMode mode) {
    LINVIS_CHECK(mode != AmxMode::Off, "simd::kernels_with_bf16_products: called with the AMX path off");
    // [tiles, emulated][target]: the tables of the targets this CPU runs, each with the tile products.
    static const std::array<std::array<Kernels, 3>, 2> tables = [] {
        std::array<std::array<Kernels, 3>, 2> t{};
        for (const Target target : {Target::Scalar, Target::Avx2, Target::Avx512}) {
            if (!target_supported(target)) continue;
            const auto i = static_cast<size_t>(target);
            t[0][i] = t[1][i] = kernels(target);
            t[0][i].gemm = gemm_tiles_f32;
            t[1][i].gemm = gemm_emulated_f32;
        }
        return t;
    }();
    return tables[mode == AmxMode::Tiles ? 0 : 1][static_cast<size_t>(active_target())];
}

const Kernels& inference_kernels(bool bf16_inputs) {
    const AmxMode mode = bf16_inputs ? amx_mode() : AmxMode::Off;
    return mode == AmxMode::Off ? kernels() : kernels_with_bf16_products(mode);
}

}  // namespace linvis::ops::simd
