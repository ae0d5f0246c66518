// Matrix products through oneDNN's matmul primitive (private to core; flops::linear uses it).
//
// oneDNN 2.6's C API has a float32 gemm (dnnl_sgemm) without epilogue and no bf16 gemm; its matmul primitive takes
// bf16 or float32 operands, accumulates in float32 and rounds the result once (to bf16 or float32), optionally with
// a bias and a GELU or ReLU applied to the float32 accumulator while each tile of the result is in cache. A primitive
// is created once per shape and layout and kept in a process-wide cache (thread-safe, least recently used entries
// dropped past a bound); the engine is created once per process, a stream once per thread.
#pragma once

#include <string>

#include <torch/torch.h>

namespace linvis::onednn {

// Activation applied to the float32 accumulator before the one rounding.
enum class Activation { None, GeluErf, GeluTanh, Relu };

// Empty when oneDNN computes correct products in this process, otherwise why not. Checked once, on first use: libdnnl
// loaded (core/onednn_api.h), then a float32 sgemm and a float32 matmul primitive with bias and GELU (its weights
// packed) on small operands, against LibTorch. Where it is not empty every product is LibTorch's.
const std::string& unusable_reason();

// Whether this CPU and oneDNN build have a non-reference bf16 matmul (AVX-512 oneDNN kernels; with
// AVX512-BF16 native dot products). Queried once by creating a small primitive.
bool bf16_matmul_available();

// out (M x N, contiguous, bf16 or float32) = [out +] a (M x K) . b (K x N) [+ bias (N)], then `activation`; a and b
// both bf16 or both float32, bias bf16 or float32, any of them row- or column-major (other layouts are copied).
// accumulate: out's values are added to each tile of the product in cache (oneDNN's sum post-op; a residual
// stream taking a branch's last product). Returns false without touching `out` when oneDNN has no non-reference
// implementation for this case (bf16 operands: when bf16_matmul_available() is false).
bool matmul(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias, torch::Tensor& out,
            Activation activation = Activation::None, bool accumulate = false);

// The implementation oneDNN picked for the small probe product ("brg:avx512_core_bf16", ...), or "none".
std::string bf16_matmul_implementation();

// Bytes of the float32 weights kept reordered into oneDNN's layout for inference (onednn_matmul.cpp, "packed
// weights"); copies of freed weights are not counted.
size_t packed_weight_bytes();
void release_packed_weights();

// Nesting depth of flops::WeightsInTraining on this thread: while positive, no weight is packed.
int& weights_in_training_depth();

// Number of primitives in the cache (for tests).
size_t cached_primitives();

}  // namespace linvis::onednn
