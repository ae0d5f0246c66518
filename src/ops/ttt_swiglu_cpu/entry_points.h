// Internal entry points of the fused CPU ViT³ / T⁵ / DiT⁵ kernels (dispatched from the public ops when
// impl == Impl::Fused; see docs/perf_vit3_t5.md). Same shapes and semantics as the reference
// functions they replace. float32 and bfloat16 run fused (bfloat16 converted to float32 on entry,
// results cast back); other dtypes are handled by the caller (reference path).
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/ops/t5_ttt.h"

namespace linvis::ops::fused_detail {

// Empty when the fused kernels take this tensor (a CPU float32 or bfloat16 tensor), else why not.
std::string fused_unsupported(const torch::Tensor& t);

torch::Tensor vit3_swiglu_branch_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const torch::Tensor& w1, const torch::Tensor& w2, double scale);
torch::Tensor vit3_dwconv_branch_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const torch::Tensor& w3, double scale);
// vit3_ttt_mix without RoPE: one function of qkv (reads q/k/v in place, one output buffer, one
// dqkv buffer in backward). Shapes as ops::vit3_ttt_mix.
torch::Tensor vit3_ttt_mix_fused(const torch::Tensor& qkv, const torch::Tensor& w1, const torch::Tensor& w2,
                                 const torch::Tensor& w3, int64_t num_heads, int64_t height, int64_t width);
// ops::Vit3TttInBands' passes on float32 sums (B, h, d, d) / (B, 9, d); shapes and meaning as the reference's
// (src/ops/vit3_ttt/reference.h). The step returns W1', W2' and the taps (B, 9, d) apply takes.
void vit3_bands_accumulate_fused(const torch::Tensor& kv, int64_t offset, int64_t rows, int64_t num_heads,
                                 int64_t tokens, const torch::Tensor& w1, const torch::Tensor& w2, torch::Tensor& g1,
                                 torch::Tensor& g2, torch::Tensor& g3);
std::vector<torch::Tensor> vit3_bands_step_fused(const torch::Tensor& w1, const torch::Tensor& w2,
                                                 const torch::Tensor& w3, const torch::Tensor& g1,
                                                 const torch::Tensor& g2, const torch::Tensor& g3);
torch::Tensor vit3_bands_apply_fused(const torch::Tensor& q, int64_t offset, int64_t rows, int64_t num_heads,
                                     const std::vector<torch::Tensor>& updated);
// apply_rope_2d in place on float32 x (B, H, W, C) with unit channel stride; rotations float32 contiguous.
void rope_2d_in_place(const torch::Tensor& x, const torch::Tensor& rotations);
torch::Tensor t5_ttt_attention_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const T5TttParams& params, int64_t num_heads, int64_t height, int64_t width);

// t5_ttt_attention on qkv.chunk(3, -1), with the qkv gradient written as one buffer.
torch::Tensor t5_ttt_attention_qkv_fused(const torch::Tensor& qkv, const T5TttParams& params, int64_t num_heads,
                                         int64_t height, int64_t width);

// ops::dit5_ttt_attention (DiT⁵'s TTT branch) on float32 / bfloat16 CPU tensors; q, k, v with unit channel stride
// are read in place (the chunks of the model's qkv).
torch::Tensor dit5_ttt_attention_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const Dit5TttParams& params, int64_t num_heads, int64_t height, int64_t width);

// Token block (rows of one (sample, head)) processed at a time; scratch is O(block * d) per task.
constexpr int64_t kTokenBlock = 256;

}  // namespace linvis::ops::fused_detail
