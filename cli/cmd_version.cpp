// linvis version: what this build is and what it runs on.
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "command.h"
#include "linvis/core/flops.h"
#include "linvis/core/runtime.h"
#include "linvis/core/tensor_arena.h"
#include "linvis/ops/impl.h"
#include "options.h"

namespace linvis::cli {
namespace {

struct VersionOptions {
    std::string format = "text";
    int threads = 0;  // configured before reporting
};

int run_version(int argc, const char* const* argv) {
    VersionOptions o;
    CommandApp app("version", "Print the linvis and LibTorch versions, the BLAS LibTorch calls, thread counts, the "
                              "SIMD level of this CPU and CUDA availability.");
    add_format_option(app, o.format);
    add_threads_option(app, o.threads);
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(o.threads);
    const runtime::Info info = runtime::query();
    const char* kernels = ops::fused_kernel_target();  // before any output: a bad LINVIS_SIMD is an error
    const char* matrix_engine = ops::fused_matrix_engine();  // and a bad LINVIS_AMX
    if (o.format == "json") {
        nlohmann::json j = {{"linvis", info.linvis_version},
                            {"libtorch", info.torch_version},
                            {"blas", info.blas},
                            {"blas_optimized", info.blas_is_optimized},
                            {"linear_gemm", flops::linear_backend()},
                            {"torch_threads", info.torch_threads},
                            {"blas_threads", info.blas_threads},
                            {"openmp_wait", runtime::openmp_wait_policy()},
                            {"malloc", runtime::malloc_policy()},
                            {"tensor_arena", tensor_arena::installed()},
                            {"simd", runtime::simd_name(info.simd)},
                            {"fused_kernels", kernels},
                            {"matrix_engine", matrix_engine},
                            {"cuda_available", info.cuda_available},
                            {"cuda_devices", info.cuda_devices}};
        std::cout << j.dump() << "\n";
        return 0;
    }
    std::cout << "linvis     " << info.linvis_version << "\n"
              << "LibTorch   " << info.torch_version << "\n"
              << "BLAS       " << info.blas << "\n"
              << "GEMM       " << flops::linear_backend() << "\n"
              << "threads    " << info.torch_threads << " LibTorch (OpenMP, " << runtime::openmp_wait_policy() << " wait), "
              << (info.blas_threads > 0 ? std::to_string(info.blas_threads) : std::string("?")) << " BLAS\n"
              << "memory     malloc: " << runtime::malloc_policy() << "; tensors of 256 KiB and more: "
              << (tensor_arena::installed() ? "tensor arena (LINVIS_TENSOR_ARENA=0: malloc)" : "malloc") << "\n"
              << "SIMD       " << runtime::simd_name(info.simd) << "\n"
              << "kernels    fused ops run their " << kernels
              << " code; impl auto picks fused or reference per op (docs/ops.md)\n"
              << "matrix     bf16 attention and TTT-mixer products: "
              << (std::string(matrix_engine) == "off" ? std::string("the SIMD code (no AMX, or LINVIS_AMX=off)")
                                                      : std::string(matrix_engine))
              << "\n"
              << "CUDA       "
              << (info.cuda_available
                      ? std::to_string(info.cuda_devices) + " device(s) visible (ops run their LibTorch references there)"
                      : std::string("no device visible"))
              << "\n";
    return 0;
}

CommandRegistrar registrar("version", "print versions, BLAS, threads, SIMD level and CUDA status", run_version);

}  // namespace
}  // namespace linvis::cli
