// 2-D neighborhood attention with NATTEN's semantics (Hassani et al. 2023; NATTEN 0.17.5, the
// version the DiT5 code uses), and DiT5's 0.5/0.5 mix of TTT and neighborhood attention.
//
// Layout is NATTEN's heads-first one: q, k, v (B, h, H, W, d). Dilation 1 only (all that
// T5/DiT5 use). Windows are clamped, not zero-padded: along each axis of length L the query at
// index i attends to the K positions start(i) .. start(i)+K-1 with
//   start(i) = min(max(i - K/2, 0), L - K)
// (NATTEN's get_window_start for dilation 1), so near a border the window is shifted inward and
// always holds K*K keys. Neighbour n of a query is (start_y + n / K, start_x + n % K).
// No relative position bias: DiT5's MixedAttention calls na2d_qk without rpb (spec B4).
// When K > L on an axis NATTEN refuses the input; what the window is then is a NatSmallGrid choice
// (the whole axis by default, so K >= max(H, W) gives global softmax attention).
#pragma once

#include <torch/torch.h>

#include "linvis/ops/impl.h"
#include "linvis/ops/t5_ttt.h"

namespace linvis::ops {

// The window on a grid with an axis shorter than the kernel, which NATTEN rejects. On grids at least
// K x K both choices are NATTEN's windows.
enum class NatSmallGrid {
    // The window covers the whole short axis (the limit of clamping): Ky = min(K, H), Kx = min(K, W).
    WholeAxis,
    // What the pure-PyTorch NATTEN stand-in behind ../shared/fixtures/generation computes: the clamp formula
    // taken literally (start = L - K, negative), all K*K neighbours, each looked up by its flat index
    // (sy + a)*W + (sx + b) in the flattened grid, a negative index wrapping around it as PyTorch indexing
    // does (so a window may reach into the previous row). It reproduces the DiT5 fixtures at a 4x4 grid to
    // 7e-7 where WholeAxis is 3e-3 off. An index below -H*W (grids of 2 x 2 and smaller) is an error.
    FlatWrap,
};

// First window position along an axis (see above); kernel_size odd and >= 1. For K > L: 0 under
// WholeAxis, L - K under FlatWrap.
int64_t natten_window_start(int64_t index, int64_t length, int64_t kernel_size,
                            NatSmallGrid small_grid = NatSmallGrid::WholeAxis);

// (H*W, Ky*Kx) int64 table: flat key index (y*W + x) of every neighbour of every query.
// Ky = min(K, H), Kx = min(K, W) under WholeAxis; K, K under FlatWrap.
torch::Tensor neighborhood_indices(int64_t height, int64_t width, int64_t kernel_size,
                                   NatSmallGrid small_grid = NatSmallGrid::WholeAxis);

// (H*W, H*W) bool: true where key j is in query i's window (for brute-force comparisons).
torch::Tensor neighborhood_mask(int64_t height, int64_t width, int64_t kernel_size);

// NATTEN na2d_qk: q (B, h, H, W, d), k same -> logits (B, h, H, W, Ky*Kx), q . k per neighbour.
torch::Tensor na2d_qk(const torch::Tensor& q, const torch::Tensor& k, int64_t kernel_size,
                      NatSmallGrid small_grid = NatSmallGrid::WholeAxis);
// NATTEN na2d_av: attn (B, h, H, W, Ky*Kx), v (B, h, H, W, dv) -> (B, h, H, W, dv).
torch::Tensor na2d_av(const torch::Tensor& attn, const torch::Tensor& v, int64_t kernel_size,
                      NatSmallGrid small_grid = NatSmallGrid::WholeAxis);

// DiT5's NA branch: na2d_av(softmax(na2d_qk(q * scale, k)), v). Shapes as above.
// FLOPs: B*h*H*W*Ky*Kx*(d + dv). The fused kernel takes FlatWrap only on grids of at least K x K.
torch::Tensor neighborhood_attention_2d(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        int64_t kernel_size, double scale,
                                        NatSmallGrid small_grid = NatSmallGrid::WholeAxis, Impl impl = Impl::Auto);

// DiT5 MixedAttention (spec B4) between qkv and proj. q, k, v: (B, N, C) tokens (raw chunks of
// the shared qkv projection), N = height*width row-major. Returns 0.5*x_na + 0.5*x_ttt (B, N, C):
//   x_ttt = dit5_ttt_attention(q, k, v, ...) and
//   x_na  = neighborhood attention of the raw q, k, v (no affine, norm or conv), scale d^-0.5,
//           heads reshaped as (B, h, H, W, d), output back to (B, N, C).
torch::Tensor dit5_mixed_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const Dit5TttParams& params, int64_t num_heads, int64_t height,
                                   int64_t width, int64_t kernel_size = 5,
                                   NatSmallGrid small_grid = NatSmallGrid::WholeAxis, Impl impl = Impl::Auto);

}  // namespace linvis::ops
