// The arguments of one fused TTT-Linear scan (cpu.cpp) and the per-target scan functions.
#pragma once

#include <cstdint>

namespace linvis::ops::simd {
struct Kernels;  // ops/simd/simd.h
}  // namespace linvis::ops::simd

namespace linvis::ops::cpu {

// Everything one scan task reads and writes. Big per-token tensors (q, k, v, out and their
// gradients) keep their dtype In and their strides; the small ones (lr, tau, gamma, beta, states,
// parameter gradients) are contiguous in the compute type T (float, or double for float64).
struct ScanArgs {
    int64_t B = 0, nh = 0, T = 0, d = 0, bmax = 0, ckpt_every = 1;
    bool causal = true;
    double eps = 1e-6;
    const void *q = nullptr, *k = nullptr, *v = nullptr;
    int64_t qs[4] = {}, ks[4] = {}, vs[4] = {};
    const void *lr = nullptr, *tau = nullptr, *gamma = nullptr, *beta = nullptr, *w0 = nullptr, *b0 = nullptr;
    void* out = nullptr;
    int64_t outs[4] = {};
    void *final_W = nullptr, *final_b = nullptr, *grad_norms = nullptr, *ckpt = nullptr;
    // Forward only (TttQkConv): q and k computed from the rows of u (B, T, nh * d; strides us) while a mini-batch
    // is loaded, q above and k unused. Taps (conv_k, nh * d) and biases (nh * d) in the compute type.
    const void* u = nullptr;
    int64_t us[3] = {};
    const void *q_taps = nullptr, *q_bias = nullptr, *k_taps = nullptr, *k_bias = nullptr;
    int64_t conv_k = 0;
    // The SIMD layer's kernels of the scan's target (bf16 rounding of the convolutions' outputs).
    const simd::Kernels* kernels = nullptr;
    const void* dout = nullptr;
    int64_t douts[4] = {};
    void *dq = nullptr, *dk = nullptr, *dv = nullptr;
    int64_t dqs[4] = {}, dks[4] = {}, dvs[4] = {};
    void *dlr = nullptr, *dW0 = nullptr, *db0 = nullptr, *dgamma = nullptr, *dbeta = nullptr, *dtau = nullptr;
};

// One SIMD target's scan over tasks (sample, head) in [begin, end), for inputs of float32, float64 and
// bfloat16 (index 0, 1, 2; computed in float, double and float).
using ScanRange = void (*)(const ScanArgs& a, int64_t begin, int64_t end);
struct ScanFns {
    ScanRange forward[3];
    ScanRange backward[3];
};

}  // namespace linvis::ops::cpu
