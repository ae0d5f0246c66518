#include "linvis/core/runtime.h"

#include <dlfcn.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <strings.h>
#include <fstream>
#include <string>
#include <thread>

#include <torch/torch.h>
#include <torch/version.h>

#include "linvis/core/tensor_arena.h"

namespace linvis::runtime {
namespace {

// OpenBLAS entry points, looked up at run time: LibTorch links libblas.so.3, and which
// library answers depends on Debian's alternatives (OpenBLAS or the reference BLAS).
using openblas_config_fn = char* (*)();
using openblas_get_threads_fn = int (*)();
using openblas_set_threads_fn = void (*)(int);
using openblas_parallel_fn = int (*)();

template <typename Fn>
Fn find_symbol(const char* name) {
    return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

std::string describe_blas(bool& optimized) {
    auto config = find_symbol<openblas_config_fn>("openblas_get_config");
    auto corename = find_symbol<openblas_config_fn>("openblas_get_corename");
    auto parallel = find_symbol<openblas_parallel_fn>("openblas_get_parallel");
    if (config != nullptr) {
        optimized = true;
        std::string text = std::string("OpenBLAS (") + config();
        if (corename != nullptr) text += std::string(", kernels: ") + corename();
        if (parallel != nullptr) {
            const int mode = parallel();
            text += mode == 0 ? ", sequential" : mode == 1 ? ", pthreads" : ", OpenMP";
        }
        return text + ")";
    }
    if (dlsym(RTLD_DEFAULT, "bli_info_get_version_str") != nullptr) {
        optimized = true;
        return "BLIS";
    }
    if (dlsym(RTLD_DEFAULT, "mkl_get_max_threads") != nullptr) {
        optimized = true;
        return "Intel MKL";
    }
    optimized = false;
    return "reference BLAS (about 25x slower matrix products: install libopenblas0-pthread)";
}

}  // namespace

SimdLevel detect_simd() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
        if (__builtin_cpu_supports("avx512bf16")) return SimdLevel::Avx512Bf16;
#endif
        return SimdLevel::Avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::Avx2;
    return SimdLevel::Scalar;
}

const char* simd_name(SimdLevel level) {
    switch (level) {
        case SimdLevel::Avx512Bf16: return "AVX-512 (with BF16)";
        case SimdLevel::Avx512: return "AVX-512";
        case SimdLevel::Avx2: return "AVX2+FMA";
        case SimdLevel::Scalar: return "scalar";
    }
    return "scalar";
}

std::string openblas_coretype_override() {
    auto corename = find_symbol<openblas_config_fn>("openblas_get_corename");
    if (corename == nullptr || std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
    const char* core = corename();
    if (core == nullptr || strcasecmp(core, "prescott") != 0) return "";
    __builtin_cpu_init();
    // The widest kernels the CPU runs: AVX-512 (F, BW, VL, DQ: SkylakeX; with BF16: Cooperlake, which
    // adds the bf16 GEMM), else AVX2 + FMA (Haswell).
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (avx512) return __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? "Haswell" : "";
}

bool set_blas_threads(int threads) {
    auto setter = find_symbol<openblas_set_threads_fn>("openblas_set_num_threads");
    if (setter == nullptr) return false;
    setter(threads);
    return true;
}

int blas_threads() {
    auto getter = find_symbol<openblas_get_threads_fn>("openblas_get_num_threads");
    // A pip torch's MKL (linked into libtorch_cpu) exports its own count; LibTorch sets it with its own.
    if (getter == nullptr) getter = find_symbol<openblas_get_threads_fn>("mkl_get_max_threads");
    return getter != nullptr ? getter() : -1;
}

double busy_cores(int window_ms) {
    // Sum of the non-idle and idle jiffies of the "cpu" line (all cores), twice.
    const auto sample = [](long long& busy, long long& total) {
        std::ifstream stat("/proc/stat");
        std::string cpu;
        long long user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
        if (!(stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal) || cpu != "cpu")
            return false;
        busy = user + nice + system + irq + softirq + steal;
        total = busy + idle + iowait;
        return true;
    };
    long long busy0 = 0, total0 = 0, busy1 = 0, total1 = 0;
    if (!sample(busy0, total0)) return -1.0;
    std::this_thread::sleep_for(std::chrono::milliseconds(window_ms));
    if (!sample(busy1, total1) || total1 <= total0) return -1.0;
    const double cores = static_cast<double>(std::max(1u, std::thread::hardware_concurrency()));
    return cores * static_cast<double>(busy1 - busy0) / static_cast<double>(total1 - total0);
}

namespace {

// gperftools' tcmalloc answers malloc when its malloc is the process's malloc (it defines malloc as an
// alias of tc_malloc); a library merely loaded beside another allocator does not count.
using tc_version_fn = const char* (*)(int*, int*, const char**);
bool tcmalloc_answers() {
    void* tc_malloc = dlsym(RTLD_DEFAULT, "tc_malloc");
    return tc_malloc != nullptr && tc_malloc == dlsym(RTLD_DEFAULT, "malloc");
}

// The user chose malloc's behaviour through glibc's environment.
bool user_malloc_settings() {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    return std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr || std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
           (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr);
}

}  // namespace

void release_free_memory() {
    tensor_arena::release_free();
    if (tcmalloc_answers()) {
        if (auto release = find_symbol<void (*)()>("MallocExtension_ReleaseFreeMemory")) release();
        return;
    }
#ifdef __GLIBC__
    malloc_trim(0);
#endif
}

std::string malloc_policy() {
    if (tcmalloc_answers()) {
        auto version = find_symbol<tc_version_fn>("tc_version");
        if (version == nullptr) return "tcmalloc";
        return std::string("tcmalloc (") + version(nullptr, nullptr, nullptr) + ")";
    }
    const char* mmap_threshold = std::getenv("MALLOC_MMAP_THRESHOLD_");
    const char* trim_threshold = std::getenv("MALLOC_TRIM_THRESHOLD_");
    if (mmap_threshold != nullptr && trim_threshold != nullptr && std::strcmp(mmap_threshold, kMallocKeepBytes) == 0 &&
        std::strcmp(trim_threshold, kMallocKeepBytes) == 0)
        return "keep freed memory";
    return user_malloc_settings() ? "set by the user" : "default";
}

void restart_with_runtime_environment(char** argv) {
    if (std::getenv("LINVIS_NO_REEXEC") != nullptr) return;
    const std::string coretype = openblas_coretype_override();
    const bool user_policy = std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr;
    const bool tcmalloc = tcmalloc_answers();
#ifdef __GLIBC__
    const bool set_malloc = !tcmalloc && !user_malloc_settings();
#else
    const bool set_malloc = false;
#endif
    const bool set_tcmalloc = tcmalloc && std::getenv(kTcmallocReportVariable) == nullptr;
    if (user_policy && coretype.empty() && !set_malloc && !set_tcmalloc) return;
    if (set_malloc) {
        setenv("MALLOC_MMAP_THRESHOLD_", kMallocKeepBytes, 1);
        setenv("MALLOC_TRIM_THRESHOLD_", kMallocKeepBytes, 1);
    }
    if (set_tcmalloc) setenv(kTcmallocReportVariable, kTcmallocReportBytes, 1);
    if (!user_policy) {
        // Other processes keeping half the cores busy or more: workers must not spin (see kOpenmpSpinCount).
        const double cores = static_cast<double>(std::max(1u, std::thread::hardware_concurrency()));
        const double busy = busy_cores(kLoadWindowMs);
        if (busy >= 0.5 * cores) setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
        else setenv("GOMP_SPINCOUNT", kOpenmpSpinCount, 1);
    }
    if (!coretype.empty()) setenv("OPENBLAS_CORETYPE", coretype.c_str(), 1);
    setenv("LINVIS_NO_REEXEC", "1", 1);
    execv("/proc/self/exe", argv);
    // execv only returns on failure: carry on with the default policy.
}

std::string openmp_wait_policy() {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    if (policy != nullptr && strcasecmp(policy, "passive") == 0) return "passive";
    if (policy != nullptr && strcasecmp(policy, "active") == 0) return "active";
    const char* spin = std::getenv("GOMP_SPINCOUNT");
    if (spin != nullptr && *spin != '\0') return std::string("spin ") + spin;
    return "default";
}

void configure_threads(int threads) {
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    at::set_num_threads(threads);
    set_blas_threads(threads);
}

Info query() {
    Info info;
    info.linvis_version = LINVIS_VERSION;
    info.torch_version = TORCH_VERSION;
    info.blas = describe_blas(info.blas_is_optimized);
    info.torch_threads = at::get_num_threads();
    info.blas_threads = blas_threads();
    info.simd = detect_simd();
    info.cuda_available = torch::cuda::is_available();
    info.cuda_devices = info.cuda_available ? static_cast<int>(torch::cuda::device_count()) : 0;
    return info;
}

}  // namespace linvis::runtime
