// DeiT (timm VisionTransformer, softmax attention) and T5 (DeiT with T5's TTT attention) models.
//
// Registered names (create_model):
//   deit_tiny / deit_small / deit_base: timm deit_{tiny,small,base}_patch16_224. Class token,
//     1 + T absolute positions, qkv Linear with bias, LayerNorm eps 1e-6, exact-GELU MLP ratio 4,
//     forward_head pools the class token (global_pool 'token').
//   t5_tiny / t5_small: the official T5_tiny / T5_small (spec vit3_t5_official.md B2, B6): no class
//     token, T positions, the T5 TTT attention (include/linvis/ops/t5_ttt.h) in place of softmax
//     attention, forward_head averages the tokens.
// Parameter names equal the official state_dict keys (timm names; B6 for T5).
// Options: num_classes (1000), img_size (224), in_chans (3), patch_size (16), embed_dim, depth,
//   num_heads, mlp_ratio (4), drop_path_rate (0; linearly increasing per block as timm),
//   impl (auto), pos_embed_antialias (true; see resample_abs_pos_embed).
// forward_features returns the final normalised tokens: (B, 1 + T, D) for DeiT (class token first,
// as timm), (B, T, D) for T5. forward_intermediates returns the raw (un-normalised) outputs of the
// chosen blocks, patch tokens only (B, T, D), like timm's forward_intermediates(norm=False,
// return_prefix_tokens=False, output_fmt='NLC').
#pragma once

#include <array>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/models/model.h"

namespace linvis::models {

// LR multiplier of T5's newly initialised parameters relative to the base LR in fine-tuning:
// main.py --new-params-lr-multiplier default 20.0 (spec B5; paper Table 8 "New params lr
// multiplier 20x"; the help text of the official script says 10, the default it uses is 20).
inline constexpr double kT5NewParamsLrMultiplier = 20.0;

// Names of the parameters of a T5 model that a DeiT checkpoint does not provide (spec B5,
// main.py's newly_initialized_params): blocks.{i}.attn.w1/w2/w3 and
// blocks.{i}.attn.{q,k}_conv2d.{weight,bias}, in the model's parameter order. pos_embed is not
// listed: the key exists in DeiT (the official code skips it on the shape mismatch 197 vs 196
// and trains it at the base LR). Throws linvis::Error if `model` has no such parameters.
std::vector<std::string> t5_new_parameter_names(const VisionModel& model);


}  // namespace linvis::models
