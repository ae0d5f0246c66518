// bfloat16 tile products on Intel AMX and their operand layouts (ops/simd/amx.h).
#include "ops/simd/amx.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include <algorithm>
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

bool cpu_has_amx_bf16() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    return amx_bf16 && amx_tile;
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

}  // namespace linvis::ops::simd
