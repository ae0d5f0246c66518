// Shared building blocks of the DeiT and T5 models (internal to src/models): a timm-style plain
// ViT whose attention module ("mixer") is chosen by the family. See include/linvis/models/deit_t5.h.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/models/model.h"
#include "linvis/ops/impl.h"

namespace linvis::models::deit_t5_detail {

struct PlainVitOptions {
    std::string name;  // registry name, for messages
    int64_t img_size = 224, patch_size = 16, in_chans = 3, num_classes = 1000;
    int64_t embed_dim = 192, depth = 12, num_heads = 3;
    double mlp_ratio = 4.0, drop_path_rate = 0.0;
    bool class_token = true;  // DeiT: class token + token pooling; T5: no class token + mean pooling
    bool pos_embed_antialias = true;
    ops::Impl impl = ops::Impl::Auto;
};

// Reads the common options (see deit_t5.h) from `config` with the family defaults in `defaults`.
PlainVitOptions read_options(const ModelConfig& config, PlainVitOptions defaults);

// timm trunc_normal_(t, mean 0, std, a=-2, b=2): inverse-CDF sampling, absolute bounds.
void trunc_normal_(torch::Tensor t, double std, double a = -2.0, double b = 2.0);

// Token mixer between norm1 and the residual: (B, N, C) tokens on an H x W patch grid
// (N = prefix + H*W; DeiT's softmax attention sees the class token too).
class MixerImpl : public torch::nn::Module {
public:
    virtual torch::Tensor forward(const torch::Tensor& x, int64_t height, int64_t width) = 0;
};
using MixerFactory = std::function<std::shared_ptr<MixerImpl>(const PlainVitOptions&)>;

class MlpImpl : public torch::nn::Module {
public:
    MlpImpl(int64_t dim, int64_t hidden);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

class BlockImpl : public torch::nn::Module {
public:
    BlockImpl(const PlainVitOptions& o, std::shared_ptr<MixerImpl> mixer, double drop_path);
    torch::Tensor forward(const torch::Tensor& x, int64_t height, int64_t width);

private:
    torch::Tensor drop_path(const torch::Tensor& x) const;
    torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
    std::shared_ptr<MixerImpl> attn;
    std::shared_ptr<MlpImpl> mlp;
    double drop_path_rate_;
};

class PatchEmbedImpl : public torch::nn::Module {
public:
    PatchEmbedImpl(const PlainVitOptions& o);
    torch::Tensor forward(const torch::Tensor& images);  // (B, in_chans, H, W) -> (B, T, D)
    torch::nn::Conv2d proj{nullptr};

private:
    PlainVitOptions o_;
};

class PlainVit : public VisionModel {
public:
    PlainVit(const PlainVitOptions& o, const MixerFactory& make_mixer);

    torch::Tensor forward_features(const torch::Tensor& images) override;
    torch::Tensor forward_head(const torch::Tensor& features, bool pre_logits) override;
    std::vector<torch::Tensor> forward_intermediates(const torch::Tensor& images,
                                                     const std::vector<int64_t>& indices) override;
    int64_t num_classes() const override { return o_.num_classes; }
    int64_t num_features() const override { return o_.embed_dim; }
    torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const override;

    const PlainVitOptions& options() const { return o_; }
    int64_t grid() const { return o_.img_size / o_.patch_size; }
    int64_t num_prefix_tokens() const { return o_.class_token ? 1 : 0; }

private:
    torch::Tensor embed(const torch::Tensor& images);  // patch embed + class token + positions

    PlainVitOptions o_;
    torch::Tensor cls_token, pos_embed;
    std::shared_ptr<PatchEmbedImpl> patch_embed;
    torch::nn::ModuleList blocks_list{nullptr};
    std::vector<std::shared_ptr<BlockImpl>> blocks;
    torch::nn::LayerNorm norm{nullptr};
    torch::nn::Linear head{nullptr};
};

}  // namespace linvis::models::deit_t5_detail
