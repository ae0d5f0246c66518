// The plain (isotropic) ViT skeleton every non-hierarchical family is built on (internal to
// src/models): patch embedding, optional class token, position embedding, a stack of blocks from a
// family's block factory, final norm, pooling and linear head, with timm's conventions and key names.
// A new family is a block (linvis/nn/vit.h: a Mixer in a TransformerBlock, or its own VitBlock) plus
// a PlainVitOptions and a registration; see docs/architecture.md.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/models/model.h"
#include "linvis/nn/vit.h"
#include "linvis/ops/impl.h"

namespace linvis::models {

enum class PosEmbedKind {
    None,    // ViT3: positions come from the blocks' convolutions
    Tokens,  // timm: parameter pos_embed (1, prefix + h * w, D), resampled bicubically for another grid
    Grid,    // ViL: module pos_embed with parameter embed (1, h, w, D)
};

enum class Pooling {
    ClassToken,  // DeiT: the class token
    Mean,        // T5, Vision-TTT, ViT3: mean over the tokens
    Bilateral,   // ViL: first and last token concatenated, then LayerNorm legacy_norm (2D, eps 1e-5)
};

struct PlainVitOptions {
    std::string name;  // registry name, for messages
    int64_t img_size = 224, patch_size = 16, in_chans = 3, num_classes = 1000;
    int64_t embed_dim = 192, depth = 12;
    double drop_path_rate = 0.0;
    bool drop_path_decay = true;  // linspace(0, rate, depth) as timm; false: rate in every block (ViL)
    bool class_token = false;
    PosEmbedKind pos_embed = PosEmbedKind::Tokens;
    bool pos_embed_antialias = true;  // see nn::resample_abs_pos_embed
    // timm 0.4.12 (DeiT, T5): images must be img_size x img_size (checkpoint loading adapts pos_embed);
    // otherwise any size whose sides are multiples of the patch, the position embedding resampled.
    bool fixed_input_size = false;
    Pooling pooling = Pooling::Mean;
    double head_init_std = 0.02;  // trunc_normal std of head.weight (bias 0)
    ops::Impl impl = ops::Impl::Auto;
    // Activation checkpointing of every block while a graph is recorded (nn::checkpoint; timm's
    // set_grad_checkpointing): training keeps one block's intermediates at a time.
    bool grad_checkpointing = false;
    // features_only: no head, any input size (padded to the patch); out_indices count sub-blocks and
    // default to four evenly spaced ones ending with the last (2, 5, 8, 11 of 12: the ViT UperNet setting).
    FeatureOptions features;
};

// Reads the options every family takes from `config` over the family's `defaults`: num_classes,
// img_size, in_chans, patch_size, embed_dim, depth, drop_path_rate, impl, grad_checkpointing, features_only, out_indices,
// and pos_embed_antialias when the position embedding is Tokens; checks them (errors name the model).
PlainVitOptions read_plain_vit_options(const ModelConfig& config, PlainVitOptions defaults);

// The shape of TransformerBlock families (DeiT, T5, ViT3): num_heads and mlp_ratio (4), read from
// `config` and checked against the width.
struct TransformerShape {
    int64_t num_heads = 3;
    double mlp_ratio = 4.0;
    // Block options for width o.embed_dim: MLP hidden int(D * mlp_ratio) as timm, LayerNorm eps 1e-6.
    nn::TransformerBlockOptions block(const PlainVitOptions& o, double drop_path, bool cpe = false) const;
};
TransformerShape read_transformer_shape(const ModelConfig& config, const PlainVitOptions& o, int64_t default_heads);

class PlainVit;

// Builds the token mixer of one TransformerBlock for width `dim` and `heads` heads.
using MixerFactory = std::function<std::shared_ptr<nn::Mixer>(int64_t dim, int64_t heads, ops::Impl impl)>;

// A TransformerBlock family (DeiT, T5, ViT3): the skeleton with the options read over `defaults`,
// num_heads (default `default_heads`) and mlp_ratio read from `config`, and in every block the mixer of
// `make_mixer`; `cpe` adds ViT3's positional convolution before it.
std::shared_ptr<PlainVit> make_transformer_vit(const ModelConfig& config, const PlainVitOptions& defaults,
                                               int64_t default_heads, const MixerFactory& make_mixer,
                                               bool cpe = false);

// A timm 0.4.12 VisionTransformer around `make_mixer` (DeiT, T5): images of img_size only, the class
// token (pooled) or none (mean pooling), every Linear initialised trunc_normal(.02) with zero bias.
std::shared_ptr<PlainVit> make_timm_vit(const ModelConfig& config, const std::string& name, int64_t embed_dim,
                                        int64_t num_heads, bool class_token, const MixerFactory& make_mixer);

class PlainVit : public VisionModel {
public:
    // Block i with its stochastic-depth rate; registered as blocks.{i}.
    using BlockFactory = std::function<std::shared_ptr<nn::VitBlock>(int64_t index, double drop_path)>;

    // final_norm: the module under key "norm" (default LayerNorm(D, eps 1e-6)), called on (B, T, D).
    PlainVit(const PlainVitOptions& options, const BlockFactory& make_block, torch::nn::AnyModule final_norm = {});

    torch::Tensor forward_features(const torch::Tensor& images) override;
    torch::Tensor forward_head(const torch::Tensor& features, bool pre_logits) override;
    // Indices count sub-blocks (ViL: 2 per block pair, as its official segmentation configs); outputs
    // are the residual stream after them, patch tokens only (B, h * w, D).
    std::vector<torch::Tensor> forward_intermediates(const torch::Tensor& images,
                                                     const std::vector<int64_t>& indices) override;
    // The same taps as (B, D, h, w) maps of the image zero-padded to a multiple of the patch.
    std::vector<torch::Tensor> forward_feature_maps(const torch::Tensor& images,
                                                    const std::vector<int64_t>& indices) override;
    std::vector<int64_t> feature_indices() const override { return feature_indices_; }
    int64_t num_classes() const override { return o_.num_classes; }
    int64_t num_features() const override;
    std::string map_checkpoint_key(const std::string& key) const override;
    torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const override;

    Embedding embed(const torch::Tensor& images) override;
    int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }
    torch::Tensor forward_block(int64_t index, const torch::Tensor& tokens, int64_t height, int64_t width) override;

    const PlainVitOptions& options() const { return o_; }
    int64_t num_prefix_tokens() const { return o_.class_token ? 1 : 0; }

    torch::Tensor cls_token, pos_embed;  // undefined when the options leave them out
    nn::PatchEmbed patch_embed{nullptr};
    nn::GridPosEmbed grid_pos_embed{nullptr};  // registered as pos_embed (PosEmbedKind::Grid)
    torch::nn::ModuleList blocks{nullptr};
    torch::nn::AnyModule norm;
    torch::nn::LayerNorm legacy_norm{nullptr};  // Pooling::Bilateral
    torch::nn::Linear head{nullptr};

private:
    int64_t grid() const { return o_.img_size / o_.patch_size; }
    int64_t sub_blocks() const;

    PlainVitOptions o_;
    std::vector<std::shared_ptr<nn::VitBlock>> blocks_;
    std::vector<int64_t> feature_indices_;
};

}  // namespace linvis::models
