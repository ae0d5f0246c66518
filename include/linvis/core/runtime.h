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
// (<= 0: the number of cores).
void configure_threads(int threads);

// How idle OpenMP workers should wait, chosen before the OpenMP runtime starts (libgomp reads its
// environment once). Every float32 product runs on oneDNN, one OpenMP region each, so the wait decides a
// small image's speed. Measured on the 2-core Xeon (docs/performance.md), images/s of deit_tiny /
// vit3_tiny at 224 px: OMP_WAIT_POLICY=PASSIVE (no spin) 40 / 29, GOMP_SPINCOUNT=300 39-41 / 29,
// 1000 66-67 / 44, 3000 74-80 / 64-66, 30000 80-89 / 66-72 on a quiet machine; but with two other busy
// processes on the two cores a spinning worker burns the time slice of the thread it waits for: there
// 3000 gave 0.5-0.75x and 30000 0.1x of PASSIVE. Hence a short spin (kOpenmpSpinCount) when the cores
// are idle and PASSIVE when other processes keep them busy (busy_cores over kLoadWindowMs).
inline constexpr const char* kOpenmpSpinCount = "3000";
inline constexpr int kLoadWindowMs = 60;

// The linvis command is linked with gperftools' tcmalloc (Debian's libtcmalloc-minimal4; CMake option
// LINVIS_TCMALLOC). It keeps freed memory for reuse, as the glibc setting below does, but reuses it
// across sizes without glibc's heap fragmentation. On the 2-core Zen 4 EPYC at 2048 px, activation
// MiB / images/s: t5_tiny 227 / 0.68 with glibc keeping freed memory, 97 / 0.43 with glibc returning
// every large block (the tensors' own peak), 101 / 0.67 with tcmalloc; vit3_tiny 200 / 0.77, 97 / 0.46,
// 146 / 0.76 (docs/performance.md). The library itself takes whatever allocator its program has.
//
// What glibc's malloc does with freed memory (the linvis command without tcmalloc). By default it hands
// blocks over its (adaptive, at most 32 MiB) mmap threshold back to the kernel and trims the heap's top,
// so every pass of a model at 1024 px and more pages its activations in again: on the 2-core Xeon a
// vil_tiny 1024-px pass took 847k page faults in 5 passes and 795 ms, against 65k and 643 ms with both
// thresholds at kMallocKeepBytes (vittt_tiny 2048 px 2934 -> 2551 ms, deit_tiny 1024 px 1132 -> 1020 ms).
// So without tcmalloc the command starts with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ at
// kMallocKeepBytes: freed memory stays in the process for the next pass, at the price of a fragmented heap
// (at 2048 px about twice the tensors' own peak, above).
inline constexpr const char* kMallocKeepBytes = "4294967296";

// tcmalloc reports every allocation of 1 GiB and more on standard error by default (a softmax
// reference's attention matrix at 2048 px is one); the command raises the threshold unless the user set it.
inline constexpr const char* kTcmallocReportVariable = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD";
inline constexpr const char* kTcmallocReportBytes = "1099511627776";

// "tcmalloc (gperftools X.Y)" when tcmalloc is this process's malloc; otherwise glibc's: "keep freed
// memory" when this process runs with both thresholds at kMallocKeepBytes, "set by the user" when
// MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES's glibc.malloc.* say otherwise,
// "default" when nothing is set.
std::string malloc_policy();

// Hands the memory malloc holds free back to the kernel (tcmalloc's ReleaseFreeMemory, glibc's
// malloc_trim), and the free pages of the tensor arena (core/tensor_arena.h) when one is installed, so that
// a later resident-set peak shows what is allocated after this call.
void release_free_memory();

// Cores kept busy by all processes over a window of `window_ms`, from /proc/stat (-1 when unreadable).
double busy_cores(int window_ms);

// How idle OpenMP workers wait in this process, from its environment: "passive", "active",
// "spin N" (GOMP_SPINCOUNT) or "default" (libgomp's own spin, then sleep).
std::string openmp_wait_policy();

// Restarts the process (execv of /proc/self/exe with the same arguments) once with the environment
// that only takes effect at start-up: the OpenMP wait (above; a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT
// is kept), glibc malloc's thresholds or tcmalloc's report threshold (above; a user's settings are kept)
// and OPENBLAS_CORETYPE (openblas_coretype_override). Child processes inherit the choice.
// Called first thing by the linvis command and bench_ops; LINVIS_NO_REEXEC=1 turns it off. Returns only
// when no restart happens (or execv failed).
void restart_with_runtime_environment(char** argv);

// The OPENBLAS_CORETYPE a process should be started with, or "" when none is needed. A DYNAMIC_ARCH
// OpenBLAS older than the CPU does not recognise it and falls back to its generic "Prescott" (SSE3)
// kernels: Debian 12's OpenBLAS 0.3.21 does so on recent Intel Xeons (Sapphire Rapids), where a 2048^3
// SGEMM then runs at 19.5 GFLOP/s on one thread instead of 79 with the Haswell kernels, and on two
// threads at 190 GFLOP/s with Haswell's against 345-352 with the AVX-512 ones. When the loaded OpenBLAS
// runs Prescott kernels, returns the widest kernels the CPU can run: "Cooperlake" (AVX-512 with BF16),
// "SkylakeX" (AVX-512 F/BW/VL/DQ) or "Haswell" (AVX2 + FMA); "" otherwise. OpenBLAS reads the variable when it loads, so the CLI sets it when it
// restarts itself (restart_with_runtime_environment).
std::string openblas_coretype_override();

// Sets OpenBLAS's thread count, when the loaded BLAS is OpenBLAS. Returns false otherwise.
bool set_blas_threads(int threads);
// OpenBLAS's thread count, or -1 when the loaded BLAS is not OpenBLAS.
int blas_threads();

}  // namespace linvis::runtime
