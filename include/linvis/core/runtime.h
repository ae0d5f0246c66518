// Facts about the running process that affect speed: which BLAS LibTorch calls,
// how many threads each pool uses, which SIMD level the CPU offers, whether CUDA is there.
#pragma once

#include <string>

namespace linvis::runtime {

enum class SimdLevel { Scalar, Avx2, Avx512, Avx512Bf16 };

struct Info {
    std::string linvis_version;
    std::string torch_version;
    std::string blas;          // e.g. "OpenBLAS 0.3.21 (Haswell kernels, pthreads)" or "reference BLAS (slow)"
    bool blas_is_optimized = false;
    int torch_threads = 1;     // at::get_num_threads()
    int blas_threads = -1;     // OpenBLAS's own pool, -1 when unknown
    SimdLevel simd = SimdLevel::Scalar;
    bool cuda_available = false; // a CUDA device is visible to LibTorch (ops run their LibTorch reference there)
    int cuda_devices = 0;
};

Info query();

// The widest SIMD level this CPU supports, detected at run time (cpuid).
SimdLevel detect_simd();
const char* simd_name(SimdLevel level);

// Sets LibTorch's intra-op (OpenMP) threads and OpenBLAS's own pthread pool to `threads`
// (<= 0: the number of cores). The two pools only coexist if idle OpenMP workers do not spin
// for long: libgomp's default spins ~300k rounds, which starves OpenBLAS's pthreads, while
// OMP_WAIT_POLICY=PASSIVE (no spin) makes every OpenMP region, one per oneDNN product,
// pay a wake-up. The CLI therefore starts the OpenMP runtime with GOMP_SPINCOUNT=30000 (a few
// tens of microseconds, kOpenmpSpinCount) unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT,
// re-executing itself to do so (configure_openmp_wait in cli/main.cpp); measured in
// docs/performance.md (224 px on the 2-core Xeon: 1.5-2x the passive policy).
void configure_threads(int threads);

// The spin count the CLI gives libgomp's idle workers (see configure_threads).
inline constexpr const char* kOpenmpSpinCount = "30000";

// How idle OpenMP workers wait in this process, from its environment: "passive", "active",
// "spin N" (GOMP_SPINCOUNT) or "default" (libgomp's own spin, then sleep).
std::string openmp_wait_policy();

// The OPENBLAS_CORETYPE a process should be started with, or "" when none is needed. A DYNAMIC_ARCH
// OpenBLAS older than the CPU does not recognise it and falls back to its generic "Prescott" (SSE3)
// kernels: Debian 12's OpenBLAS 0.3.21 does so on recent Intel Xeons (Sapphire Rapids), where a 2048^3
// SGEMM then runs at 19.5 GFLOP/s on one thread instead of 79 with the Haswell kernels, and on two
// threads at 190 GFLOP/s with Haswell's against 345-352 with the AVX-512 ones. When the loaded OpenBLAS
// runs Prescott kernels, returns the widest kernels the CPU can run: "Cooperlake" (AVX-512 with BF16),
// "SkylakeX" (AVX-512 F/BW/VL/DQ) or "Haswell" (AVX2 + FMA); "" otherwise. OpenBLAS reads the variable when it loads, so the CLI sets it when it
// restarts itself (see configure_openmp_wait in cli/main.cpp).
std::string openblas_coretype_override();

// Sets OpenBLAS's thread count, when the loaded BLAS is OpenBLAS. Returns false otherwise.
bool set_blas_threads(int threads);
// OpenBLAS's thread count, or -1 when the loaded BLAS is not OpenBLAS.
int blas_threads();

}  // namespace linvis::runtime
