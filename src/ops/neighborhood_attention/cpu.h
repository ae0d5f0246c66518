// Fused CPU 2-D neighbourhood attention (internal). Public entry point: linvis::ops::neighborhood_attention_2d
// with Impl::Fused / Impl::Auto (include/linvis/ops/neighborhood_attention.h).
#pragma once

#include <torch/torch.h>

namespace linvis::ops::cpu {

// q, k (B, h, H, W, d), v (B, h, H, W, dv) on the CPU, float32 / float64 / bfloat16 (computed in float32), any
// strides with a contiguous last dim (read in place); clamped K x K windows as natten_window_start. The output is
// (B, h, H, W, dv) laid out in memory as (B, H, W, h, dv). In a graph it saves q, k, v and the attention weights
// (B, h, H*W, Ky*Kx); the backward accumulates the key / value gradients per (sample, head), so it is deterministic
// on any thread count. Outside a graph no weights are kept. Shapes are checked by the caller.
torch::Tensor neighborhood_attention_2d_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                              int64_t kernel_size, double scale);

}  // namespace linvis::ops::cpu
