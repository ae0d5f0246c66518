#include "linvis/core/precision.h"

#include <torch/version.h>

// Before 2.1 LibTorch sends a reduced-precision GEMM to oneDNN on some CPUs only (product_needs_f32).
#define LINVIS_TORCH_REDUCED_GEMM_BY_CPU \
    (TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 1))

namespace linvis::precision {
#if LINVIS_TORCH_REDUCED_GEMM_BY_CPU
namespace {

// LibTorch 1.13's condition for sending a bf16 GEMM / convolution to oneDNN
// (mkldnn_bf16_device_check: AVX-512 BW, VL and DQ, and oneDNN compiled in).
bool onednn_takes_bf16() {
    __builtin_cpu_init();
    return at::hasMKLDNN() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
}

}  // namespace
#endif

bool is_reduced(const torch::Tensor& t) {
    return t.defined() && t.device().is_cpu() &&
           (t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf);
}

bool product_needs_f32(const torch::Tensor& t) {
    if (!is_reduced(t)) return false;
#if !LINVIS_TORCH_REDUCED_GEMM_BY_CPU
    return false;
#else
    // f16 never goes to oneDNN in LibTorch 1.13; bf16 does only on AVX-512 CPUs.
    static const bool onednn_bf16 = onednn_takes_bf16();
    return t.scalar_type() == torch::kHalf || !onednn_bf16;
#endif
}

torch::ScalarType accumulation_dtype(const torch::Tensor& t) {
    return is_reduced(t) ? torch::kFloat32 : t.scalar_type();
}

}  // namespace linvis::precision
