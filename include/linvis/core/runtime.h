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
// (<= 0: the number of cores). The two pools only coexist if idle OpenMP workers sleep
// instead of spinning: OMP_WAIT_POLICY=PASSIVE must be in the environment before the
// OpenMP runtime starts, which is why the CLI re-executes itself with it set
// (ensure_passive_openmp). Measured on the 2-core dev machine: a 2048^2 SGEMM runs at
// 108 GFLOP/s with one BLAS thread and 200 GFLOP/s with two.
void configure_threads(int threads);

// True when OMP_WAIT_POLICY is PASSIVE in this process's environment.
bool openmp_is_passive();

// The OPENBLAS_CORETYPE a process should be started with, or "" when none is needed. A DYNAMIC_ARCH
// OpenBLAS older than the CPU does not recognise it and falls back to its generic "Prescott" (SSE3)
// kernels: Debian 12's OpenBLAS 0.3.21 does so on recent Intel Xeons (Sapphire Rapids), where a 2048^3
// SGEMM then runs at 19.5 GFLOP/s on one thread instead of 79 with the Haswell kernels, and on two
// threads at 190 GFLOP/s with Haswell's against 345-352 with the AVX-512 ones. When the loaded OpenBLAS
// runs Prescott kernels, returns the widest kernels the CPU can run: "Cooperlake" (AVX-512 with BF16),
// "SkylakeX" (AVX-512 F/BW/VL/DQ) or "Haswell" (AVX2 + FMA); "" otherwise. OpenBLAS reads the variable when it loads, so the CLI sets it when it
// restarts itself (see ensure_passive_openmp in cli/main.cpp).
std::string openblas_coretype_override();

// Sets OpenBLAS's thread count, when the loaded BLAS is OpenBLAS. Returns false otherwise.
bool set_blas_threads(int threads);
// OpenBLAS's thread count, or -1 when the loaded BLAS is not OpenBLAS.
int blas_threads();

}  // namespace linvis::runtime
