// FLOP counting by instrumented primitives, the way fvcore and the papers count:
// one FLOP per multiply-add of a matrix product or convolution; elementwise ops,
// norms and softmax are ignored.
//
// Model code calls the wrappers below instead of the raw LibTorch functions. They
// compute the same result and, while a flops::Counter is alive on this thread, add
// their multiply-adds to it. Counting costs nothing when no Counter is active.
#pragma once

#include <array>

#include <cstdint>
#include <string>

#include <torch/torch.h>

namespace linvis::flops {

// Counts multiply-adds issued on this thread during its lifetime. Counters nest;
// each sees the work done while it is the innermost one and passes it to its parent.
class Counter {
public:
    Counter();
    ~Counter();
    Counter(const Counter&) = delete;
    Counter& operator=(const Counter&) = delete;
    int64_t macs() const { return macs_; }
    double gflops() const { return static_cast<double>(macs_) * 1e-9; }

private:
    friend void add(int64_t);
    int64_t macs_ = 0;
    Counter* parent_ = nullptr;
};

// While alive, the counters made before it on this thread do not see the products issued: work a paper's
// count leaves out (Vittt's learning-rate gate, docs/vittt.md) runs through the fast wrappers below without
// changing the count.
class Uncounted {
public:
    Uncounted();
    ~Uncounted();
    Uncounted(const Uncounted&) = delete;
    Uncounted& operator=(const Uncounted&) = delete;

private:
    Counter* saved_;
};

// Adds `macs` multiply-adds to the active counter, if any.
void add(int64_t macs);
bool counting();

// y = x W^T + b over the last dimension of x. Float32 CPU products run through oneDNN, faster than LibTorch
// 1.13's OpenBLAS call at every size once idle OpenMP workers spin briefly
// (runtime::restart_with_runtime_environment; docs/performance.md): with a bias its matmul primitive, which adds
// the bias to each tile of the product in cache, without one its sgemm. bf16 CPU products run through oneDNN's
// matmul primitive where oneDNN has a bf16 kernel for this CPU (AVX-512; native dot products with AVX512-BF16): float32
// accumulation, bias added to the accumulator, one rounding to bf16; elsewhere LibTorch (widened to float32
// where it would accumulate in bf16, linvis/core/precision.h). In training the backward products go through
// oneDNN too (a backward that builds a graph, for double backward, uses LibTorch's ops). Empty products,
// other dtypes and devices use LibTorch's linear. The environment variable LINVIS_GEMM=torch (read on every
// call) sends all products to LibTorch, for comparisons in one process.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias = {});

// out += x W^T (+ b) in place (a residual stream taking a branch's last product). Outside a graph, for float32
// CPU operands with out contiguous and not sharing memory with x, weight or bias, oneDNN accumulates the product
// onto out while each tile is in cache (without a bias its sgemm with beta = 1, with one its matmul primitive's
// sum post-op), instead of writing a fresh product and adding it in another pass; bf16 operands onto a bf16 out
// likewise on the matmul primitive where bf16 products take it (the sum in float32, rounded once); every other
// case is out.add_(linear(x, weight, bias)). Returns out.
torch::Tensor linear_add_(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                          const torch::Tensor& bias = {});

// The gradients of y = linear(x, weight, bias) from dy (y's shape), each only where `needs` (dx, dweight, dbias)
// asks: dx = dy . W, dW = dy^T . x (over all rows of x), db = dy summed over rows; through oneDNN where linear()
// takes the operands, with LibTorch's differentiable products when grad mode is on (a backward that builds a
// graph). The backward of linear() in a graph, and of the ops that recompute x in their backward (ops::gelu_linear).
struct LinearGradients {
    torch::Tensor dx, dweight, dbias;
};
LinearGradients linear_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& weight,
                                std::array<bool, 3> needs);

// torch::gelu(linear(x, weight, bias), approximate) ("none" or "tanh"). A float32 or bf16 product without a
// graph on oneDNN applies the bias and the GELU to the float32 accumulator inside the product (oneDNN's matmul
// primitive, a tile at a time while it is in cache) and rounds once; every other case is linear() then
// torch::gelu.
torch::Tensor linear_gelu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {},
                          const std::string& approximate = "none");

// torch::relu(linear(x, weight, bias)), the ReLU applied inside the product where linear_gelu applies its GELU.
torch::Tensor linear_relu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

// Float32 and bf16 products on oneDNN's matmul primitive (with a bias, a GELU/ReLU or onto a residual) outside a
// graph read the weight from a copy reordered once into the primitive's own blocked layout, where it has one
// (AVX-512; up to 11 % faster for ViT-T's float32 products, 3-11 % for the tiny models' bf16 passes on AMX,
// docs/performance.md). A copy is kept while its weight's storage is alive and
// redone when the weight changes in place (its version counter). Read in place instead: weights in a live graph
// or under WeightsInTraining (below), inference tensors (no version counter), products of fewer than 16 rows.
// LINVIS_PACKED_WEIGHTS_MIB (read once, default 256) caps the kept copies' total; 0 turns them off.
// packed_weight_bytes() is that total now: weight memory, constant in the image size.
int64_t packed_weight_bytes();
// Frees every packed copy now; the next pass that reads a weight packed copies it again. For a process that keeps
// models alive past their inference (the copies live as long as their weights), or that wants the budget back for
// other models.
void release_packed_weights();

// While alive, this thread's products read their weights in place, never from packed copies: for a training step's
// forward without a graph (nn::checkpoint's), whose weights the optimizer changes after the step. (Inside a graph,
// and in the backward and recomputations of weights in a live graph, nothing is packed anyway.) Nestable.
class WeightsInTraining {
public:
    WeightsInTraining();
    ~WeightsInTraining();
    WeightsInTraining(const WeightsInTraining&) = delete;
    WeightsInTraining& operator=(const WeightsInTraining&) = delete;
};

// Whether linear() hands this product to oneDNN (see above).
bool linear_takes_onednn(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

// Empty when oneDNN computes correct products in this process, otherwise why not (checked once against LibTorch on
// small operands); linear() then takes LibTorch's products throughout. It fails when linvis is linked against a pip
// torch 2.x, whose libtorch_cpu carries a oneDNN of its own that Debian's libdnnl binds part of its set-up to.
std::string onednn_unusable_reason();

// Which library computes the products of linear(): "oneDNN x.y.z sgemm", followed by
// ", bf16 matmul (<oneDNN's kernel>)" where oneDNN has a bf16 kernel, or "LibTorch" (LINVIS_GEMM=torch), or
// "LibTorch (oneDNN x.y.z fails here: <reason>)" (onednn_unusable_reason()).
std::string linear_backend();
// torch::matmul with broadcasting; counts prod(batch) * n * k * m.
torch::Tensor matmul(const torch::Tensor& a, const torch::Tensor& b);
// Convolutions with the functional options of LibTorch; counts
// output elements * (in_channels / groups) * kernel volume.
torch::Tensor conv1d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     int64_t stride, int64_t padding, int64_t dilation, int64_t groups);
torch::Tensor conv2d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     torch::IntArrayRef stride, torch::IntArrayRef padding,
                     torch::IntArrayRef dilation, int64_t groups);

}  // namespace linvis::flops
