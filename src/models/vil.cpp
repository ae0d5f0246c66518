// Vision-LSTM v2 (VisionLSTM2, the released vil2-tiny/small/base checkpoints): spec
// vil_official.md sections 1-3. Registered as vil_tiny, vil_small, vil_base.
//
// Model options: num_classes (1000), img_size (224), in_chans (3), patch_size (16),
// embed_dim (192/384/768), depth (12: number of block *pairs*, i.e. 24 mLSTM sub-blocks),
// drop_path_rate (0), mlstm_mode (parallel|chunkwise|recurrent, default parallel = the official
// form with impl=reference, chunkwise otherwise), chunk_size (64), impl (auto | reference | fused;
// auto and fused run the fused chunkwise kernel, and fused rejects mode parallel or recurrent).
#include <cmath>
#include <regex>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/vil.h"
#include "linvis/ops/impl.h"
#include "linvis/ops/mlstm.h"

namespace linvis::models {
namespace {

struct VilOptions {
    int64_t num_classes = 1000;
    int64_t img_size = 224;
    int64_t in_chans = 3;
    int64_t patch_size = 16;
    int64_t embed_dim = 192;
    int64_t depth = 12;
    double drop_path_rate = 0.0;
    ops::MlstmMode mode = ops::MlstmMode::Parallel;
    int64_t chunk_size = ops::kMlstmDefaultChunkSize;
    ops::Impl impl = ops::Impl::Auto;
};

// VitPatchEmbed: a patch_size x patch_size stride conv, key patch_embed.proj.*.
class PatchEmbedImpl : public torch::nn::Module {
public:
    PatchEmbedImpl(int64_t in_chans, int64_t dim, int64_t patch) : patch_size(patch) {
        proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_chans, dim, patch).stride(patch)));
        torch::NoGradGuard no_grad;
        torch::nn::init::xavier_uniform_(proj->weight.view({dim, -1}));
        proj->bias.zero_();
    }
    // (B, C, H, W) -> (B, H/p, W/p, D)
    torch::Tensor forward(const torch::Tensor& x) {
        torch::Tensor y = flops::conv2d(x, proj->weight, proj->bias, {patch_size, patch_size}, {0, 0}, {1, 1}, 1);
        return y.permute({0, 2, 3, 1});
    }
    torch::nn::Conv2d proj{nullptr};
    int64_t patch_size;
};
TORCH_MODULE(PatchEmbed);

// VitPosEmbed2d: learnable (1, h, w, D), bicubically resized on the fly for another grid.
class PosEmbedImpl : public torch::nn::Module {
public:
    PosEmbedImpl(int64_t h, int64_t w, int64_t dim) {
        embed = register_parameter("embed", torch::empty({1, h, w, dim}));
        torch::NoGradGuard no_grad;
        embed.normal_(0.0, 0.02);  // trunc_normal(0.02) with bounds +-2: the truncation is 100 sigma out
    }
    torch::Tensor forward(const torch::Tensor& x) {
        if (x.size(1) == embed.size(1) && x.size(2) == embed.size(2)) return x + embed;
        return x + nn::resize_pos_embed_2d(embed, x.size(1), x.size(2));
    }
    torch::Tensor embed;
};
TORCH_MODULE(PosEmbed);

class VisionLstm2 : public VisionModel {
public:
    explicit VisionLstm2(const VilOptions& o) : opt_(o) {
        LINVIS_CHECK(o.img_size % o.patch_size == 0, "vil: img_size ", o.img_size, " is not a multiple of patch_size ",
                     o.patch_size);
        LINVIS_CHECK(o.embed_dim % 2 == 0 && (2 * o.embed_dim) % 4 == 0 && o.depth > 0 && o.num_classes >= 0,
                     "vil: invalid embed_dim ", o.embed_dim, " / depth ", o.depth, " / num_classes ", o.num_classes);
        const int64_t D = o.embed_dim, grid = o.img_size / o.patch_size;
        patch_embed = register_module("patch_embed", PatchEmbed(o.in_chans, D, o.patch_size));
        pos_embed = register_module("pos_embed", PosEmbed(grid, grid, D));
        blocks = register_module("blocks", torch::nn::ModuleList());
        for (int64_t i = 0; i < o.depth; ++i)
        {
            nn::VilBlockPair pair(D, o.drop_path_rate, o.mode, o.chunk_size, o.impl);
            blocks->push_back(pair);
            pairs_.push_back(pair);
        }
        norm = register_module("norm", nn::ResidualLayerNorm(D, 1e-6));  // hub eps (1.13)
        legacy_norm = register_module("legacy_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({2 * D}).eps(1e-5)));
        if (o.num_classes > 0) {
            head = register_module("head", torch::nn::Linear(2 * D, o.num_classes));
            torch::NoGradGuard no_grad;
            head->weight.normal_(0.0, 2e-5);  // trunc_normal(2e-5): bounds +-2 never bind
            head->bias.zero_();
        }
    }

    torch::Tensor forward_features(const torch::Tensor& images) override {
        int64_t gh = 0, gw = 0;
        torch::Tensor x = embed(images, gh, gw);
        for (auto& pair : pairs_) x = pair->forward(x, gh, gw);
        return norm->forward(x);
    }

    torch::Tensor forward_head(const torch::Tensor& features, bool pre_logits) override {
        LINVIS_CHECK(features.dim() == 3 && features.size(2) == opt_.embed_dim,
                     "vil forward_head: features: expected (B, T, ", opt_.embed_dim, "), got ",
                     shape_string(features.sizes()));
        // bilateral_flatten: first and last token (top-left and bottom-right patches), concatenated.
        torch::Tensor pooled = torch::cat({features.select(1, 0), features.select(1, features.size(1) - 1)}, 1);
        pooled = legacy_norm->forward(pooled);
        if (pre_logits || !head) return pooled;
        return flops::linear(pooled, head->weight, head->bias);
    }

    // Indices count the 2 * depth mLSTM sub-blocks (as the official segmentation config does,
    // e.g. [7, 11, 15, 23]); outputs are the residual stream after that sub-block, (B, T, D).
    std::vector<torch::Tensor> forward_intermediates(const torch::Tensor& images,
                                                     const std::vector<int64_t>& indices) override {
        const int64_t n = 2 * opt_.depth;
        std::vector<int64_t> wanted;
        for (int64_t i : indices) {
            const int64_t j = i < 0 ? i + n : i;
            LINVIS_CHECK(j >= 0 && j < n, "vil forward_intermediates: index ", i, " out of range for ", n, " blocks");
            wanted.push_back(j);
        }
        int64_t gh = 0, gw = 0;
        torch::Tensor x = embed(images, gh, gw);
        std::vector<torch::Tensor> by_block(static_cast<size_t>(n));
        int64_t last = -1;
        for (int64_t j : wanted) last = std::max(last, j);
        for (int64_t b = 0; b <= last; ++b) {
            auto& pair = pairs_[static_cast<size_t>(b / 2)];
            x = (b % 2 == 0 ? pair->rowwise_from_top_left : pair->rowwise_from_bot_right)->forward(x, gh, gw);
            by_block[static_cast<size_t>(b)] = x;
        }
        std::vector<torch::Tensor> out;
        for (int64_t j : wanted) out.push_back(by_block[static_cast<size_t>(j)]);
        return out;
    }

    int64_t num_classes() const override { return opt_.num_classes; }
    int64_t num_features() const override { return 2 * opt_.embed_dim; }

    // Raw training-checkpoint names (3.2) -> hub names; hub names pass unchanged; causal_mask is dropped.
    std::string map_checkpoint_key(const std::string& key) const override {
        static const std::regex block_re(R"(^xlstm\.blocks\.(\d+)\.(xlstm_norm|xlstm)\.(.+)$)");
        std::smatch m;
        if (key.find("causal_mask") != std::string::npos) return "";
        if (std::regex_match(key, m, block_re)) {
            const int64_t i = std::stoll(m[1].str());
            const std::string dir = i % 2 == 0 ? "rowwise_from_top_left" : "rowwise_from_bot_right";
            const std::string prefix = "blocks." + std::to_string(i / 2) + "." + dir + ".";
            if (m[2].str() == "xlstm_norm") return prefix + "norm." + m[3].str();
            std::string rest = m[3].str();
            if (rest.rfind("conv1d.", 0) == 0) rest = "conv." + rest.substr(7);
            return prefix + "layer." + rest;
        }
        if (key.rfind("xlstm.post_blocks_norm.", 0) == 0) return "norm." + key.substr(23);
        if (key.rfind("head.0.", 0) == 0) return "legacy_norm." + key.substr(7);
        if (key.rfind("head.1.", 0) == 0) return "head." + key.substr(7);
        return key;
    }

    torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const override {
        if (key != "pos_embed.embed") return value;
        const auto& target = pos_embed->embed;
        LINVIS_CHECK(value.dim() == 4 && value.size(0) == 1 && value.size(3) == target.size(3),
                     "pos_embed.embed: expected shape [1, H, W, ", target.size(3), "], got ",
                     shape_string(value.sizes()));
        return nn::resize_pos_embed_2d(value, target.size(1), target.size(2));
    }

    PatchEmbed patch_embed{nullptr};
    PosEmbed pos_embed{nullptr};
    torch::nn::ModuleList blocks{nullptr};
    nn::ResidualLayerNorm norm{nullptr};
    torch::nn::LayerNorm legacy_norm{nullptr};
    torch::nn::Linear head{nullptr};

private:
    // Patch embed + position embed + row-major flatten; returns the token grid size.
    torch::Tensor embed(const torch::Tensor& images, int64_t& gh, int64_t& gw) {
        LINVIS_CHECK(images.dim() == 4 && images.size(1) == opt_.in_chans, "vil: images: expected (B, ", opt_.in_chans,
                     ", H, W), got ", shape_string(images.sizes()));
        LINVIS_CHECK(images.size(2) % opt_.patch_size == 0 && images.size(3) % opt_.patch_size == 0,
                     "vil: images: H and W must be multiples of the patch size ", opt_.patch_size, ", got ",
                     shape_string(images.sizes()));
        torch::Tensor x = pos_embed->forward(patch_embed->forward(images));  // (B, h, w, D)
        gh = x.size(1);
        gw = x.size(2);
        return x.reshape({x.size(0), gh * gw, x.size(3)});
    }

    VilOptions opt_;
    std::vector<nn::VilBlockPair> pairs_;
};

ModelPtr create_vil(const ModelConfig& cfg, int64_t embed_dim) {
    VilOptions o;
    o.num_classes = cfg.get_int("num_classes", o.num_classes);
    o.img_size = cfg.get_int("img_size", o.img_size);
    o.in_chans = cfg.get_int("in_chans", o.in_chans);
    o.patch_size = cfg.get_int("patch_size", o.patch_size);
    o.embed_dim = cfg.get_int("embed_dim", embed_dim);
    o.depth = cfg.get_int("depth", o.depth);
    o.drop_path_rate = cfg.get_double("drop_path_rate", o.drop_path_rate);
    o.impl = ops::parse_impl(cfg.get_string("impl", "auto"));
    // The fused kernel is the chunkwise form, so impl auto or fused selects it unless a mode is named.
    o.mode = ops::parse_mlstm_mode(
        cfg.get_string("mlstm_mode", o.impl == ops::Impl::Reference ? "parallel" : "chunkwise"));
    LINVIS_CHECK(o.impl != ops::Impl::Fused || o.mode == ops::MlstmMode::Chunkwise,
                 "vil: impl 'fused' needs mlstm_mode 'chunkwise', got mlstm_mode '", ops::mlstm_mode_name(o.mode),
                 "'");
    o.chunk_size = cfg.get_int("chunk_size", o.chunk_size);
    LINVIS_CHECK(o.chunk_size > 0, "vil: chunk_size: expected > 0, got ", o.chunk_size);
    return std::make_shared<VisionLstm2>(o);
}

const ModelRegistrar kTiny("vil_tiny", "vil", "Vision-LSTM ViL-T (VisionLSTM2, 6.4M params, Alkin et al. 2024)",
                           [](const ModelConfig& c) { return create_vil(c, 192); });
const ModelRegistrar kSmall("vil_small", "vil", "Vision-LSTM ViL-S (VisionLSTM2, 23.4M params, Alkin et al. 2024)",
                            [](const ModelConfig& c) { return create_vil(c, 384); });
const ModelRegistrar kBase("vil_base", "vil", "Vision-LSTM ViL-B (VisionLSTM2, 89.3M params, Alkin et al. 2024)",
                           [](const ModelConfig& c) { return create_vil(c, 768); });

}  // namespace
}  // namespace linvis::models
