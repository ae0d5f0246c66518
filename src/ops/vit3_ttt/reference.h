// Reference inner steps of the official ViT3 TTT op (internal; public entries in
// include/linvis/ops/vit3_ttt.h check the inputs and choose between these and the fused CPU kernels).
#pragma once

#include <vector>

#include <torch/torch.h>

namespace linvis::ops {

// The shapes apply_rope_2d and apply_rope_2d_ take: x (B, H, W, C), rotations (H, W, C/2, 2); `op` names the caller
// in the error.
void check_rope_shapes(const torch::Tensor& x, const torch::Tensor& rotations, const char* op);

}  // namespace linvis::ops

namespace linvis::ops::reference {

torch::Tensor vit3_ttt_swiglu_branch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& w1, const torch::Tensor& w2, double scale);
torch::Tensor vit3_ttt_dwconv_branch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& w3, double scale);

// Vit3TttInBands' passes (linvis/ops/vit3_ttt.h) on checked inputs. kv / q hold the band's rows with its halo rows;
// the band is their rows [offset, offset + rows). The sums g1, g2 (B, h, d, d) and g3 (B, 9, d) of the inner
// gradients, the loss's -s/N included (N = `tokens`, the whole map's), grow in place. The step returns W1', W2'
// (B, h, d, d) and the per-sample depthwise kernels (B*d, 1, 3, 3) that apply takes.
void vit3_bands_accumulate(const torch::Tensor& kv, int64_t offset, int64_t rows, int64_t num_heads, int64_t tokens,
                           const torch::Tensor& w1, const torch::Tensor& w2, torch::Tensor& g1, torch::Tensor& g2,
                           torch::Tensor& g3);
std::vector<torch::Tensor> vit3_bands_step(const torch::Tensor& w1, const torch::Tensor& w2, const torch::Tensor& w3,
                                           const torch::Tensor& g1, const torch::Tensor& g2, const torch::Tensor& g3);
torch::Tensor vit3_bands_apply(const torch::Tensor& q, int64_t offset, int64_t rows, int64_t num_heads,
                               const std::vector<torch::Tensor>& updated);

}  // namespace linvis::ops::reference
