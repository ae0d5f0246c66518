// Hierarchical H-ViT³: hvit3_tiny / hvit3_small / hvit3_base (spec vit3_t5_official.md A4,
// official vittt/models/h_vittt.py). Conv stem (/4), four stages of TTT blocks with 2-D RoPE
// on q1/k1 and a conv MLP, conv patch merging between stages, BatchNorm1d + GAP head.
#include <sstream>

#include "linvis/nn/batch_norm.h"
#include "linvis/nn/common.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/vit3_layers.h"
#include "linvis/ops/vit3_ttt.h"

namespace linvis::models {
namespace {

using torch::Tensor;
namespace lnn = linvis::nn;

class HVit3BlockImpl : public torch::nn::Module {
public:
    HVit3BlockImpl(int64_t dim, int64_t heads, int64_t grid_h, int64_t grid_w, double mlp_ratio, double dpr,
                   ops::Impl impl)
        : drop_path_rate(dpr) {
        // Registration order of the official TTTBlock: cpe, norm1, rope, attn, norm2, mlp.
        cpe = register_module("cpe", torch::nn::Conv2d(torch::nn::Conv2dOptions(dim, dim, 3).padding(1).groups(dim)));
        norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-5)));
        rope = register_module("rope", lnn::Vit3Rope(grid_h, grid_w, dim));
        attn = register_module("attn", lnn::Vit3Ttt(dim, heads, true, impl));
        norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-5)));
        mlp = register_module("mlp", lnn::Mlp(dim, static_cast<int64_t>(dim * mlp_ratio), true));
    }
    Tensor forward(Tensor x, int64_t H, int64_t W) {
        x = x + lnn::map_to_tokens(lnn::conv_forward(cpe, lnn::tokens_to_map(x, H, W)));
        x = x + lnn::drop_path(attn->forward_with_rope(norm1->forward(x), H, W, rope->table(H, W)), drop_path_rate,
                               is_training());
        x = x + lnn::drop_path(mlp->forward(norm2->forward(x), H, W), drop_path_rate, is_training());
        return x;
    }

    double drop_path_rate;
    torch::nn::Conv2d cpe{nullptr};
    torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
    lnn::Vit3Rope rope{nullptr};
    lnn::Vit3Ttt attn{nullptr};
    lnn::Mlp mlp{nullptr};
};
TORCH_MODULE(HVit3Block);

// A Sequential-like holder whose children are named conv.0, conv.1, ... (Stem, PatchMerging).
class ConvStackImpl : public torch::nn::Module {
public:
    ConvStackImpl() { conv = register_module("conv", torch::nn::ModuleList()); }
    Tensor forward(Tensor x) {
        for (const auto& layer : *conv) x = layer->as<lnn::Vit3ConvLayerImpl>()->forward(x);
        return x;
    }
    torch::nn::ModuleList conv{nullptr};
};
TORCH_MODULE(ConvStack);

ConvStack make_stem(int64_t in_chans, int64_t c0) {
    ConvStack stem;
    const int64_t half = c0 / 2;
    stem->conv->push_back(lnn::Vit3ConvLayer(in_chans, half, 3, 2, 1, 1, false, true, true));
    stem->conv->push_back(lnn::Vit3ConvLayer(half, half, 3, 1, 1, 1, false, true, true));
    stem->conv->push_back(lnn::Vit3ConvLayer(half, half, 3, 1, 1, 1, false, true, true));
    stem->conv->push_back(lnn::Vit3ConvLayer(half, 4 * c0, 3, 2, 1, 1, false, true, true));
    stem->conv->push_back(lnn::Vit3ConvLayer(4 * c0, c0, 1, 1, 0, 1, false, true, false));
    return stem;
}

ConvStack make_patch_merging(int64_t dim, int64_t dim_out) {
    ConvStack merge;
    const int64_t hidden = 4 * dim_out;
    merge->conv->push_back(lnn::Vit3ConvLayer(dim, hidden, 1, 1, 0, 1, true, false, true));
    merge->conv->push_back(lnn::Vit3ConvLayer(hidden, hidden, 3, 2, 1, hidden, true, false, true));
    merge->conv->push_back(lnn::Vit3ConvLayer(hidden, dim_out, 1, 1, 0, 1, true, true, false));
    return merge;
}

class BasicLayerImpl : public torch::nn::Module {
public:
    BasicLayerImpl() { blocks = register_module("blocks", torch::nn::ModuleList()); }
    torch::nn::ModuleList blocks{nullptr};
    ConvStack downsample{nullptr};
};
TORCH_MODULE(BasicLayer);

std::vector<int64_t> parse_list(const ModelConfig& config, const std::string& key, const std::vector<int64_t>& dflt) {
    if (!config.has(key)) {
        config.get_string(key, "");
        return dflt;
    }
    std::vector<int64_t> out;
    std::stringstream in(config.get_string(key, ""));
    std::string item;
    while (std::getline(in, item, ',')) {
        try {
            size_t used = 0;
            out.push_back(std::stoll(item, &used));
            if (used != item.size()) throw std::invalid_argument(item);
        } catch (const std::exception&) {
            fail("hvit3: option ", key, ": expected comma-separated integers, got '", config.get_string(key, ""), "'");
        }
    }
    LINVIS_CHECK(out.size() == 4, "hvit3: option ", key, ": expected 4 values (one per stage), got ", out.size());
    return out;
}

// The per-stage shape of a size; every option of the family (read_hvit3_options) on top of it.
struct HVit3Config {
    std::vector<int64_t> dims, depths, heads;
};

struct HVit3Options {
    int64_t num_classes = 1000, img_size = 224, in_chans = 3;
    std::vector<int64_t> dims, depths, heads;  // per stage
    double mlp_ratio = 4.0, drop_path_rate = 0.0;
    ops::Impl impl = ops::Impl::Auto;
};

// The one config style of linvis' families: an options struct read from the ModelConfig over the
// size's defaults, checked here (see read_plain_vit_options for the plain ViTs).
HVit3Options read_hvit3_options(const ModelConfig& config, const HVit3Config& base) {
    HVit3Options o;
    o.num_classes = config.get_int("num_classes", o.num_classes);
    o.img_size = config.get_int("img_size", o.img_size);
    o.in_chans = config.get_int("in_chans", o.in_chans);
    o.dims = parse_list(config, "embed_dims", base.dims);
    o.depths = parse_list(config, "depths", base.depths);
    o.heads = parse_list(config, "num_heads", base.heads);
    o.mlp_ratio = config.get_double("mlp_ratio", o.mlp_ratio);
    o.drop_path_rate = config.get_double("drop_path_rate", o.drop_path_rate);
    o.impl = ops::parse_impl(config.get_string("impl", ops::impl_name(o.impl)));
    LINVIS_CHECK(o.num_classes >= 0 && o.in_chans > 0 && o.img_size >= 32, "hvit3: bad options num_classes=",
                 o.num_classes, " in_chans=", o.in_chans, " img_size=", o.img_size);
    LINVIS_CHECK(o.drop_path_rate >= 0.0 && o.drop_path_rate < 1.0, "hvit3: drop_path_rate must be in [0, 1), got ",
                 o.drop_path_rate);
    for (int s = 0; s < 4; ++s)
        LINVIS_CHECK(o.depths[s] >= 1 && o.dims[s] % 4 == 0 && o.heads[s] >= 1 && o.dims[s] % o.heads[s] == 0,
                     "hvit3: stage ", s, ": need depth >= 1, dim % 4 == 0 and dim % heads == 0, got depth ",
                     o.depths[s], " dim ", o.dims[s], " heads ", o.heads[s]);
    return o;
}

// Output side of a k3/s2/p1 conv.
int64_t half_up(int64_t n) { return (n - 1) / 2 + 1; }

class HVit3Model : public VisionModel {
public:
    explicit HVit3Model(const HVit3Options& o)
        : num_classes_(o.num_classes), img_size_(o.img_size), in_chans_(o.in_chans), dims_(o.dims) {
        const auto& depths = o.depths;
        const auto& heads = o.heads;
        const double mlp_ratio = o.mlp_ratio, dpr = o.drop_path_rate;
        const ops::Impl impl = o.impl;
        patch_embed = register_module("patch_embed", make_stem(in_chans_, dims_[0]));
        layers = register_module("layers", torch::nn::ModuleList());
        int64_t total = 0;
        for (auto d : depths) total += d;
        const std::vector<double> rates = lnn::drop_path_rates(dpr, total);
        int64_t grid = half_up(half_up(img_size_)), block_index = 0;
        for (int s = 0; s < 4; ++s) {
            BasicLayer layer;
            for (int64_t j = 0; j < depths[s]; ++j)
                layer->blocks->push_back(HVit3Block(dims_[s], heads[s], grid, grid, mlp_ratio,
                                                    rates[static_cast<size_t>(block_index++)], impl));
            if (s < 3) layer->downsample = layer->register_module("downsample", make_patch_merging(dims_[s], dims_[s + 1]));
            layers->push_back(layer);
            grid = half_up(grid);
        }
        norm = register_module("norm", torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(dims_[3]).eps(1e-5)));
        if (num_classes_ > 0) head = register_module("head", lnn::vit_linear(dims_[3], num_classes_));
    }

    Tensor forward_features(const Tensor& images) override {
        Tensor x = run(images, {});
        // BatchNorm1d on (B, C, L), returned as the (B, C, H, W) map.
        const auto sizes = x.sizes().vec();
        return lnn::batch_norm(*norm, x.flatten(2)).view(sizes);
    }

    Tensor forward_head(const Tensor& features, bool pre_logits) override {
        LINVIS_CHECK(features.dim() == 4 && features.size(1) == dims_[3], "hvit3 forward_head: expected (B, ",
                     dims_[3], ", H, W), got ", shape_string(features.sizes()));
        Tensor pooled = torch::adaptive_avg_pool1d(features.flatten(2), 1).flatten(1);
        if (pre_logits || !head) return pooled;
        return flops::linear(pooled, head->weight, head->bias);
    }

    std::vector<Tensor> forward_intermediates(const Tensor& images, const std::vector<int64_t>& indices) override {
        const std::vector<int64_t> wanted = lnn::take_indices(4, indices, "hvit3 (stages)");
        std::vector<Tensor> stages;
        run(images, &stages);
        std::vector<Tensor> out;
        for (int64_t j : wanted) out.push_back(stages[j]);
        return out;
    }

    int64_t num_classes() const override { return num_classes_; }
    // Official keys are used as they are; a headless model (num_classes=0) drops the classifier.
    std::string map_checkpoint_key(const std::string& key) const override {
        if (num_classes_ == 0 && key.rfind("head.", 0) == 0) return "";
        return key;
    }
    int64_t num_features() const override { return dims_[3]; }

    // RoPE tables depend on the grid: a checkpoint made at another resolution gets the table
    // recomputed for this model's grid (the det/seg backbone's functional RoPE, same formula).
    Tensor adapt_checkpoint_tensor(const std::string& key, const Tensor& value) const override {
        const std::string suffix = ".rope.rotations";
        if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0)
            return value;
        auto params = named_buffers(true);
        const Tensor* own = params.find(key);
        LINVIS_CHECK(own != nullptr, "hvit3: checkpoint tensor '", key, "' has no matching buffer");
        LINVIS_CHECK(value.dim() == 4 && value.size(2) == own->size(2) && value.size(3) == 2,
                     "hvit3: checkpoint tensor '", key, "': expected shape [H, W, ", own->size(2), ", 2], got ",
                     shape_string(value.sizes()));
        if (value.sizes() == own->sizes()) return value;
        return ops::vit3_rope_rotations(own->size(0), own->size(1), own->size(2) * 2).to(value.dtype());
    }

private:
    // Stem and stages; `stages` (optional) receives every stage's output map (B, C, H, W)
    // before its patch merging. Returns the last stage's map.
    Tensor run(const Tensor& images, std::vector<Tensor>* stages) {
        LINVIS_CHECK(images.dim() == 4 && images.size(1) == in_chans_, "hvit3: expected images (B, ", in_chans_,
                     ", H, W), got ", shape_string(images.sizes()));
        Tensor map = patch_embed->forward(images);
        for (size_t s = 0; s < layers->size(); ++s) {
            auto* layer = layers[s]->as<BasicLayerImpl>();
            const int64_t H = map.size(2), W = map.size(3);
            Tensor x = lnn::map_to_tokens(map);
            for (const auto& block : *layer->blocks) x = block->as<HVit3BlockImpl>()->forward(x, H, W);
            map = lnn::tokens_to_map(x, H, W);
            if (stages) stages->push_back(map);
            if (layer->downsample) map = layer->downsample->forward(map);
        }
        return map;
    }

    int64_t num_classes_, img_size_, in_chans_;
    std::vector<int64_t> dims_;
    ConvStack patch_embed{nullptr};
    torch::nn::ModuleList layers{nullptr};
    torch::nn::BatchNorm1d norm{nullptr};
    torch::nn::Linear head{nullptr};
};

ModelFactory factory(HVit3Config base) {
    return [base](const ModelConfig& config) -> ModelPtr {
        return std::make_shared<HVit3Model>(read_hvit3_options(config, base));
    };
}

const ModelRegistrar reg_tiny("hvit3_tiny", "hvit3", "H-ViT³-T (arXiv 2512.01643): dims 64-512, depths 1-3-9-4; 28.70M params",
                              factory({{64, 128, 320, 512}, {1, 3, 9, 4}, {2, 4, 10, 16}}));
const ModelRegistrar reg_small("hvit3_small", "hvit3",
                               "H-ViT³-S (arXiv 2512.01643): dims 64-512, depths 2-6-18-8; 54.36M params",
                               factory({{64, 128, 320, 512}, {2, 6, 18, 8}, {2, 4, 10, 16}}));
const ModelRegistrar reg_base("hvit3_base", "hvit3",
                              "H-ViT³-B (arXiv 2512.01643): dims 96-640, depths 2-6-18-8; 94.37M params",
                              factory({{96, 192, 448, 640}, {2, 6, 18, 8}, {3, 6, 14, 20}}));

}  // namespace
}  // namespace linvis::models
