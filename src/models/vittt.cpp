// Vision-TTT (Kong et al., seeds 000/002) as pinned down by spec/vittt.md: patch embedding,
// absolute position embedding (no class token), Vittt blocks, final LayerNorm, mean pool,
// linear head. Registers vittt_tiny / vittt_small / vittt_base. Details: docs/vittt.md.
#include <cmath>

#include "linvis/nn/common.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/vittt_block.h"

namespace linvis::models {
namespace {

struct VitttConfig {
    int64_t num_classes = 1000;
    int64_t img_size = 224;
    int64_t in_chans = 3;
    double drop_path_rate = 0.0;
    int64_t depth = 12;
    int64_t embed_dim = 192;
    int64_t num_heads = 3;
    int64_t patch_size = 16;
    int64_t mini_batch_size = 16;
    bool shared_directions = false;
    bool learnable_w0 = true;
    ops::Impl impl = ops::Impl::Auto;
};

class PatchEmbedImpl : public torch::nn::Module {
public:
    PatchEmbedImpl(int64_t in_chans, int64_t dim, int64_t patch) {
        proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_chans, dim, patch).stride(patch)));
    }
    torch::nn::Conv2d proj{nullptr};
};
TORCH_MODULE(PatchEmbed);

class Vittt : public VisionModel {
public:
    explicit Vittt(const VitttConfig& cfg) : cfg_(cfg) {
        LINVIS_CHECK(cfg.img_size > 0 && cfg.patch_size > 0 && cfg.img_size % cfg.patch_size == 0,
                     "vittt: img_size ", cfg.img_size, " must be a positive multiple of patch_size ", cfg.patch_size);
        LINVIS_CHECK(cfg.depth >= 1, "vittt: depth must be >= 1, got ", cfg.depth);
        LINVIS_CHECK(cfg.num_classes >= 0 && cfg.in_chans >= 1, "vittt: bad num_classes ", cfg.num_classes,
                     " or in_chans ", cfg.in_chans);
        LINVIS_CHECK(cfg.drop_path_rate >= 0.0 && cfg.drop_path_rate < 1.0, "vittt: drop_path_rate must be in [0, 1), got ",
                     cfg.drop_path_rate);
        grid_ = cfg.img_size / cfg.patch_size;
        const int64_t D = cfg.embed_dim;
        patch_embed = register_module("patch_embed", PatchEmbed(cfg.in_chans, D, cfg.patch_size));
        pos_embed = register_parameter("pos_embed", torch::zeros({1, grid_ * grid_, D}));
        blocks = register_module("blocks", torch::nn::ModuleList());
        for (int64_t i = 0; i < cfg.depth; ++i) {
            nn::VitttBlockOptions bo;
            bo.branch.dim = D;
            bo.branch.num_heads = cfg.num_heads;
            bo.branch.mini_batch_size = cfg.mini_batch_size;
            bo.branch.learnable_w0 = cfg.learnable_w0;
            bo.branch.impl = cfg.impl;
            bo.mlp_hidden = 8 * D / 3;
            bo.shared_directions = cfg.shared_directions;
            bo.drop_path = cfg.depth > 1 ? cfg.drop_path_rate * static_cast<double>(i) / static_cast<double>(cfg.depth - 1)
                                         : 0.0;
            blocks->push_back(nn::VitttBlock(bo));
        }
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(1e-6)));
        if (cfg.num_classes > 0) head = register_module("head", torch::nn::Linear(D, cfg.num_classes));
        torch::NoGradGuard no_grad;
        pos_embed.normal_(0.0, 0.02);  // timm trunc_normal_(std=.02): truncation at +-2 is +-100 std
        if (head) {
            head->weight.normal_(0.0, 0.02);
            head->bias.zero_();
        }
    }

    torch::Tensor forward_features(const torch::Tensor& images) override { return norm->forward(run_blocks(images, {})); }

    torch::Tensor forward_head(const torch::Tensor& features, bool pre_logits) override {
        LINVIS_CHECK(features.dim() == 3 && features.size(2) == cfg_.embed_dim, "vittt: features: expected (B, T, ",
                     cfg_.embed_dim, "), got ", shape_string(features.sizes()));
        torch::Tensor pooled = features.mean(1);
        if (pre_logits || !head) return pooled;
        return flops::linear(pooled, head->weight, head->bias);
    }

    std::vector<torch::Tensor> forward_intermediates(const torch::Tensor& images,
                                                     const std::vector<int64_t>& indices) override {
        std::vector<torch::Tensor> out;
        run_blocks(images, indices, &out);
        return out;
    }

    int64_t num_classes() const override { return cfg_.num_classes; }
    int64_t num_features() const override { return cfg_.embed_dim; }

    torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const override {
        if (key != "pos_embed" || value.sizes() == pos_embed.sizes()) return value;
        LINVIS_CHECK(value.dim() == 3 && value.size(0) == 1 && value.size(2) == cfg_.embed_dim,
                     "vittt: checkpoint tensor 'pos_embed': expected [1, N, ", cfg_.embed_dim, "], got ",
                     shape_string(value.sizes()));
        const auto old = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(value.size(1)))));
        LINVIS_CHECK(old * old == value.size(1), "vittt: checkpoint tensor 'pos_embed': ", value.size(1),
                     " tokens is not a square grid");
        return nn::resample_abs_pos_embed(value, {grid_, grid_}, {old, old});
    }

    PatchEmbed patch_embed{nullptr};
    torch::Tensor pos_embed;
    torch::nn::ModuleList blocks{nullptr};
    torch::nn::LayerNorm norm{nullptr};
    torch::nn::Linear head{nullptr};

private:
    // Patch embedding + position embedding + blocks; collects the outputs of `indices`.
    torch::Tensor run_blocks(const torch::Tensor& images, const std::vector<int64_t>& indices,
                             std::vector<torch::Tensor>* collected = nullptr) {
        LINVIS_CHECK(images.dim() == 4 && images.size(1) == cfg_.in_chans, "vittt: images: expected (B, ", cfg_.in_chans,
                     ", H, W), got ", shape_string(images.sizes()));
        LINVIS_CHECK(images.size(2) >= cfg_.patch_size && images.size(3) >= cfg_.patch_size, "vittt: images: ",
                     shape_string(images.sizes()), " is smaller than one ", cfg_.patch_size, "x", cfg_.patch_size,
                     " patch");
        const int64_t depth = static_cast<int64_t>(blocks->size());
        std::vector<int64_t> wanted;
        for (int64_t idx : indices) {
            const int64_t i = idx < 0 ? idx + depth : idx;
            LINVIS_CHECK(i >= 0 && i < depth, "vittt: forward_intermediates: block index ", idx, " out of range for depth ",
                         depth);
            wanted.push_back(i);
        }
        const auto& proj = patch_embed->proj;
        torch::Tensor x = flops::conv2d(images, proj->weight, proj->bias, {cfg_.patch_size, cfg_.patch_size}, {0, 0},
                                        {1, 1}, 1);
        const int64_t h = x.size(2), w = x.size(3);
        x = x.flatten(2).transpose(1, 2);  // (B, T, D), t = y * w + x
        x = x + nn::resample_abs_pos_embed(pos_embed, {h, w}, {grid_, grid_});
        if (collected) collected->assign(wanted.size(), torch::Tensor());
        for (int64_t i = 0; i < depth; ++i) {
            x = blocks[i]->as<nn::VitttBlock>()->forward(x, h, w);
            for (size_t j = 0; j < wanted.size(); ++j)
                if (wanted[j] == i) (*collected)[j] = x;
        }
        return x;
    }

    VitttConfig cfg_;
    int64_t grid_ = 14;
};

ModelPtr create_vittt(const ModelConfig& config, int64_t embed_dim) {
    VitttConfig cfg;
    cfg.num_classes = config.get_int("num_classes", cfg.num_classes);
    cfg.img_size = config.get_int("img_size", cfg.img_size);
    cfg.in_chans = config.get_int("in_chans", cfg.in_chans);
    cfg.drop_path_rate = config.get_double("drop_path_rate", cfg.drop_path_rate);
    cfg.depth = config.get_int("depth", cfg.depth);
    cfg.embed_dim = config.get_int("embed_dim", embed_dim);
    cfg.num_heads = config.get_int("num_heads", std::max<int64_t>(1, cfg.embed_dim / 64));  // head dim 64
    cfg.patch_size = config.get_int("patch_size", cfg.patch_size);
    cfg.mini_batch_size = config.get_int("mini_batch_size", cfg.mini_batch_size);
    cfg.shared_directions = config.get_bool("shared_directions", cfg.shared_directions);
    cfg.learnable_w0 = config.get_bool("learnable_w0", cfg.learnable_w0);
    cfg.impl = ops::parse_impl(config.get_string("impl", "auto"));
    return std::make_shared<Vittt>(cfg);
}

const ModelRegistrar register_tiny("vittt_tiny", "vittt", "Vision-TTT tiny (Kong et al. 2026): D 192, 12 blocks, 3 heads",
                                   [](const ModelConfig& c) { return create_vittt(c, 192); });
const ModelRegistrar register_small("vittt_small", "vittt",
                                    "Vision-TTT small (Kong et al. 2026): D 384, 12 blocks, 6 heads",
                                    [](const ModelConfig& c) { return create_vittt(c, 384); });
const ModelRegistrar register_base("vittt_base", "vittt", "Vision-TTT base (Kong et al. 2026): D 768, 12 blocks, 12 heads",
                                   [](const ModelConfig& c) { return create_vittt(c, 768); });

}  // namespace
}  // namespace linvis::models
