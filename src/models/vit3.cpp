// Plain (isotropic) ViT³: vit3_tiny / vit3_small / vit3_base (spec vit3_t5_official.md A3,
// official vittt/models/vittt.py). timm-0.4.12 ViT with the TTT mixer and a depthwise CPE per
// block; no cls token and no absolute position embedding, so any input size whose sides are
// multiples of the patch size works without adapting weights.
#include <cmath>

#include "linvis/nn/common.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/vit3_layers.h"

namespace linvis::models {
namespace {

using torch::Tensor;
namespace lnn = linvis::nn;

class Vit3BlockImpl : public torch::nn::Module {
public:
    Vit3BlockImpl(int64_t dim, int64_t heads, double mlp_ratio, double drop_path_rate, ops::Impl impl)
        : drop_path_rate(drop_path_rate) {
        cpe = register_module("cpe", torch::nn::Conv2d(torch::nn::Conv2dOptions(dim, dim, 3).padding(1).groups(dim)));
        norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-6)));
        attn = register_module("attn", lnn::Vit3Ttt(dim, heads, true, impl));
        norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-6)));
        mlp = register_module("mlp", lnn::Vit3Mlp(dim, static_cast<int64_t>(dim * mlp_ratio), false));
    }
    Tensor forward(Tensor x, int64_t height, int64_t width) {
        x = x + lnn::map_to_tokens(lnn::conv_forward(cpe, lnn::tokens_to_map(x, height, width)));
        x = x + lnn::drop_path(attn->forward(norm1->forward(x), height, width), drop_path_rate, is_training());
        x = x + lnn::drop_path(mlp->forward(norm2->forward(x)), drop_path_rate, is_training());
        return x;
    }

    double drop_path_rate;
    torch::nn::Conv2d cpe{nullptr};
    torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
    lnn::Vit3Ttt attn{nullptr};
    lnn::Vit3Mlp mlp{nullptr};
};
TORCH_MODULE(Vit3Block);

class PatchEmbedImpl : public torch::nn::Module {
public:
    PatchEmbedImpl(int64_t in_chans, int64_t dim, int64_t patch) {
        proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_chans, dim, patch).stride(patch)));
    }
    torch::nn::Conv2d proj{nullptr};
};
TORCH_MODULE(PatchEmbed);

struct Vit3Config {
    int64_t embed_dim, depth, num_heads;
};

class Vit3Model : public VisionModel {
public:
    Vit3Model(const Vit3Config& base, const ModelConfig& config) {
        num_classes_ = config.get_int("num_classes", 1000);
        img_size_ = config.get_int("img_size", 224);
        in_chans_ = config.get_int("in_chans", 3);
        patch_ = config.get_int("patch_size", 16);
        dim_ = config.get_int("embed_dim", base.embed_dim);
        const int64_t depth = config.get_int("depth", base.depth);
        const int64_t heads = config.get_int("num_heads", base.num_heads);
        const double mlp_ratio = config.get_double("mlp_ratio", 4.0);
        const double dpr = config.get_double("drop_path_rate", 0.0);
        const ops::Impl impl = ops::parse_impl(config.get_string("impl", "auto"));
        LINVIS_CHECK(num_classes_ >= 0 && in_chans_ > 0 && patch_ > 0 && depth > 0 && dim_ > 0,
                     "vit3: bad options num_classes=", num_classes_, " in_chans=", in_chans_, " patch_size=", patch_,
                     " depth=", depth, " embed_dim=", dim_);
        LINVIS_CHECK(img_size_ % patch_ == 0, "vit3: img_size ", img_size_, " is not a multiple of patch_size ", patch_);
        LINVIS_CHECK(dpr >= 0.0 && dpr < 1.0, "vit3: drop_path_rate must be in [0, 1), got ", dpr);

        patch_embed = register_module("patch_embed", PatchEmbed(in_chans_, dim_, patch_));
        blocks = register_module("blocks", torch::nn::ModuleList());
        // Stochastic depth rises linearly over the blocks, as torch.linspace(0, rate, depth).
        Tensor rates = torch::linspace(0.0, dpr, depth);
        for (int64_t i = 0; i < depth; ++i)
            blocks->push_back(Vit3Block(dim_, heads, mlp_ratio, rates[i].item<double>(), impl));
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim_}).eps(1e-6)));
        if (num_classes_ > 0) head = register_module("head", lnn::vit_linear(dim_, num_classes_));
    }

    Tensor forward_features(const Tensor& images) override {
        int64_t H = 0, W = 0;
        Tensor x = embed(images, H, W);
        for (const auto& block : *blocks) x = block->as<Vit3BlockImpl>()->forward(x, H, W);
        return norm->forward(x);
    }

    Tensor forward_head(const Tensor& features, bool pre_logits) override {
        LINVIS_CHECK(features.dim() == 3 && features.size(2) == dim_, "vit3 forward_head: expected (B, T, ", dim_,
                     "), got ", shape_string(features.sizes()));
        Tensor pooled = features.mean(1);
        if (pre_logits || !head) return pooled;
        return lnn::linear_forward(head, pooled);
    }

    std::vector<Tensor> forward_intermediates(const Tensor& images, const std::vector<int64_t>& indices) override {
        const int64_t depth = static_cast<int64_t>(blocks->size());
        std::vector<int64_t> wanted;
        for (int64_t i : indices) {
            const int64_t j = i < 0 ? i + depth : i;
            LINVIS_CHECK(j >= 0 && j < depth, "vit3 forward_intermediates: block index ", i, " outside [-", depth,
                         ", ", depth, ")");
            wanted.push_back(j);
        }
        int64_t H = 0, W = 0;
        Tensor x = embed(images, H, W);
        std::vector<Tensor> outputs(wanted.size());
        for (int64_t b = 0; b < depth; ++b) {
            x = blocks[b]->as<Vit3BlockImpl>()->forward(x, H, W);
            for (size_t k = 0; k < wanted.size(); ++k)
                if (wanted[k] == b) outputs[k] = x;
        }
        return outputs;
    }

    int64_t num_classes() const override { return num_classes_; }
    // Official keys are used as they are; a headless model (num_classes=0) drops the classifier.
    std::string map_checkpoint_key(const std::string& key) const override {
        if (num_classes_ == 0 && key.rfind("head.", 0) == 0) return "";
        return key;
    }
    int64_t num_features() const override { return dim_; }

private:
    Tensor embed(const Tensor& images, int64_t& H, int64_t& W) {
        LINVIS_CHECK(images.dim() == 4 && images.size(1) == in_chans_, "vit3: expected images (B, ", in_chans_,
                     ", H, W), got ", shape_string(images.sizes()));
        LINVIS_CHECK(images.size(2) % patch_ == 0 && images.size(3) % patch_ == 0, "vit3: image size ",
                     images.size(2), "x", images.size(3), " is not a multiple of patch_size ", patch_);
        Tensor x = lnn::conv_forward(patch_embed->proj, images);
        H = x.size(2);
        W = x.size(3);
        return lnn::map_to_tokens(x);
    }

    int64_t num_classes_, img_size_, in_chans_, patch_, dim_;
    PatchEmbed patch_embed{nullptr};
    torch::nn::ModuleList blocks{nullptr};
    torch::nn::LayerNorm norm{nullptr};
    torch::nn::Linear head{nullptr};
};

ModelFactory factory(Vit3Config base) {
    return [base](const ModelConfig& config) -> ModelPtr { return std::make_shared<Vit3Model>(base, config); };
}

const ModelRegistrar reg_tiny("vit3_tiny", "vit3", "ViT³-T (arXiv 2512.01643): 192 wide, 12 blocks, 6 heads; 6.15M params",
                              factory({192, 12, 6}));
const ModelRegistrar reg_small("vit3_small", "vit3",
                               "ViT³-S (arXiv 2512.01643): 384 wide, 12 blocks, 6 heads; 23.80M params",
                               factory({384, 12, 6}));
const ModelRegistrar reg_base("vit3_base", "vit3",
                              "ViT³-B (arXiv 2512.01643): 768 wide, 12 blocks, 12 heads; 90.06M params",
                              factory({768, 12, 12}));

}  // namespace
}  // namespace linvis::models
