// The interface every linvis model implements, and the options it is built from.
//
// Conventions follow timm: forward = forward_head(forward_features(x)); forward_features
// returns the final normalised tokens (B, T, D) for plain models or the last feature map
// (B, C, H, W) for hierarchical ones; forward_intermediates returns the outputs of chosen
// blocks (or stages) for dense-prediction heads. Parameter and buffer names equal the
// official PyTorch implementations' state_dict keys, so weights load by name.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace linvis::models {

// key=value model options (from the CLI's --model-kwargs or code) with typed getters.
// Each factory reads the keys it understands; check_all_used() then rejects any key no
// factory read, so a misspelt option is an error instead of being silently ignored.
class ModelConfig {
public:
    ModelConfig() = default;
    explicit ModelConfig(std::map<std::string, std::string> values) : values_(std::move(values)) {}

    ModelConfig& set(const std::string& key, const std::string& value);
    ModelConfig& set(const std::string& key, int64_t value);
    ModelConfig& set(const std::string& key, double value);
    bool has(const std::string& key) const { return values_.count(key) != 0; }

    int64_t get_int(const std::string& key, int64_t default_value) const;
    double get_double(const std::string& key, double default_value) const;
    bool get_bool(const std::string& key, bool default_value) const;  // 1/0/true/false/yes/no
    std::string get_string(const std::string& key, const std::string& default_value) const;
    // Comma-separated integers ("0,1,3"); the default when the key is absent.
    std::vector<int64_t> get_int_list(const std::string& key, const std::vector<int64_t>& default_value) const;

    // Throws linvis::Error naming every key that no getter asked for.
    void check_all_used(const std::string& model_name) const;
    const std::map<std::string, std::string>& values() const { return values_; }

private:
    std::map<std::string, std::string> values_;
    mutable std::set<std::string> used_;
};

// The dense-prediction options every family reads (timm's features_only / out_indices):
// features_only=true builds the model as a feature backbone (no classifier, any input size, the
// family's official backbone layers where it has them); out_indices=i,j,... names the blocks (plain
// models) or stages (hierarchical) it reports, negative ones counting from the end.
struct FeatureOptions {
    bool features_only = false;
    std::vector<int64_t> out_indices;  // as given; empty: the family's default
};
FeatureOptions read_feature_options(const ModelConfig& config);

// What every loadable linvis model shares: weights are loaded into it by name from a checkpoint
// (models/pretrained.h), through these two hooks. VisionModel (classifiers and backbones) and the
// generative models (models/dit.h: diffusion transformers; models/vae.h: the VAE decoder and encoder) derive from it.
class Model : public torch::nn::Module {
public:
    ~Model() override = default;

    // Maps a key of an official raw/training checkpoint to this model's key; an empty string
    // drops the key. The default keeps keys unchanged.
    virtual std::string map_checkpoint_key(const std::string& key) const { return key; }
    // Adapts a loaded tensor whose shape depends on the resolution (absolute position
    // embeddings: bicubic resize; RoPE buffers: recomputed). Returns `value` unchanged by default.
    virtual torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const {
        return value;
    }
    // Whether a training checkpoint holding both 'model' and 'ema' weights loads the EMA by default
    // (the official DiT find_model does; classifiers load 'model' unless --ema is given).
    virtual bool loads_ema_by_default() const { return false; }
};

class VisionModel : public Model {
public:
    ~VisionModel() override = default;

    // images (B, in_chans, H, W) -> logits (B, num_classes).
    virtual torch::Tensor forward(const torch::Tensor& images) {
        return forward_head(forward_features(images), false);
    }
    // Final normalised tokens (B, T, D) before pooling, or the last feature map (B, C, H, W).
    virtual torch::Tensor forward_features(const torch::Tensor& images) = 0;
    // Pooling and classifier; pre_logits=true returns the pooled features (B, D).
    virtual torch::Tensor forward_head(const torch::Tensor& features, bool pre_logits) = 0;
    // Outputs of the blocks (plain models, (B, T, D)) or stages (hierarchical, (B, C, H, W))
    // with the given indices; negative indices count from the end.
    virtual std::vector<torch::Tensor> forward_intermediates(const torch::Tensor& images,
                                                             const std::vector<int64_t>& indices) = 0;

    // ---- Dense features: NCHW maps, one per index, of the blocks (plain models: the patch tokens after
    // the block, before the final norm, as timm's forward_intermediates) or stages (hierarchical: what
    // the official det/seg backbone returns, with its per-stage norm in features_only mode) for images
    // of any size. Sides that are not a multiple of the patch (or stride) are zero-padded at the right
    // and bottom, as the official backbones and timm's dynamic_img_pad do.
    // Every family implements it; the default throws.
    virtual std::vector<torch::Tensor> forward_feature_maps(const torch::Tensor& images,
                                                            const std::vector<int64_t>& indices);
    // The blocks or stages a features_only=true model reports (out_indices resolved to [0, count));
    // empty for a classifier.
    virtual std::vector<int64_t> feature_indices() const { return {}; }

    virtual int64_t num_classes() const = 0;
    virtual int64_t num_features() const = 0;  // width of the pooled features

    // ---- Probing: the forward pass one step at a time, for interpretability tools and feature
    // extraction (with linvis/nn/probe.h for tensors inside a block). forward_features equals
    // embed, then forward_block for every index in order, then the final norm. Plain ViTs implement
    // it; hierarchical models report num_blocks() == 0 and throw from embed.
    struct Embedding {
        torch::Tensor tokens;            // (B, prefix + height * width, D): the input of block 0
        int64_t height = 0, width = 0;   // patch grid
        int64_t prefix = 0;              // class tokens before the grid
    };
    virtual Embedding embed(const torch::Tensor& images);
    virtual int64_t num_blocks() const { return 0; }
    virtual torch::Tensor forward_block(int64_t index, const torch::Tensor& tokens, int64_t height, int64_t width);
};

using ModelPtr = std::shared_ptr<VisionModel>;

}  // namespace linvis::models
