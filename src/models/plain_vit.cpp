// The plain-ViT skeleton (see plain_vit.h).
#include "plain_vit.h"

#include <algorithm>
#include <cmath>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/nn/checkpoint.h"
#include "linvis/nn/common.h"
#include "linvis/nn/vil.h"

namespace linvis::models {

VisionModel::Embedding VisionModel::embed(const torch::Tensor&) {
    fail("this model has no token grid to probe block by block (hierarchical models expose their stages through "
         "forward_intermediates)");
}

std::vector<torch::Tensor> VisionModel::forward_feature_maps(const torch::Tensor&, const std::vector<int64_t>&) {
    fail("this model gives no dense feature maps");
}

torch::Tensor VisionModel::forward_block(int64_t index, const torch::Tensor&, int64_t, int64_t) {
    fail("forward_block: block ", index, " out of range: this model exposes no blocks");
}

PlainVitOptions read_plain_vit_options(const ModelConfig& config, PlainVitOptions o) {
    o.num_classes = config.get_int("num_classes", o.num_classes);
    o.img_size = config.get_int("img_size", o.img_size);
    o.in_chans = config.get_int("in_chans", o.in_chans);
    o.patch_size = config.get_int("patch_size", o.patch_size);
    o.embed_dim = config.get_int("embed_dim", o.embed_dim);
    o.depth = config.get_int("depth", o.depth);
    o.drop_path_rate = config.get_double("drop_path_rate", o.drop_path_rate);
    if (o.pos_embed == PosEmbedKind::Tokens)
        o.pos_embed_antialias = config.get_bool("pos_embed_antialias", o.pos_embed_antialias);
    o.impl = ops::parse_impl(config.get_string("impl", ops::impl_name(o.impl)));
    o.grad_checkpointing = config.get_bool("grad_checkpointing", o.grad_checkpointing);
    o.features = read_feature_options(config);
    if (o.features.features_only) {
        o.num_classes = 0;
        o.fixed_input_size = false;
    }
    const std::string& n = o.name;
    LINVIS_CHECK(o.num_classes >= 0, n, ": num_classes must be >= 0, got ", o.num_classes);
    LINVIS_CHECK(o.in_chans >= 1, n, ": in_chans must be >= 1, got ", o.in_chans);
    LINVIS_CHECK(o.patch_size >= 1 && o.img_size >= o.patch_size && o.img_size % o.patch_size == 0, n,
                 ": img_size must be a positive multiple of patch_size ", o.patch_size, ", got ", o.img_size);
    LINVIS_CHECK(o.depth >= 1, n, ": depth must be >= 1, got ", o.depth);
    LINVIS_CHECK(o.embed_dim >= 1, n, ": embed_dim must be >= 1, got ", o.embed_dim);
    LINVIS_CHECK(o.drop_path_rate >= 0 && o.drop_path_rate < 1, n, ": drop_path_rate must be in [0, 1), got ",
                 o.drop_path_rate);
    return o;
}

nn::TransformerBlockOptions TransformerShape::block(const PlainVitOptions& o, double drop_path, bool cpe) const {
    nn::TransformerBlockOptions b;
    b.dim = o.embed_dim;
    b.mlp_hidden = static_cast<int64_t>(static_cast<double>(o.embed_dim) * mlp_ratio);  // int(dim * mlp_ratio)
    b.drop_path = drop_path;
    b.cpe = cpe;
    b.impl = o.impl;
    return b;
}

TransformerShape read_transformer_shape(const ModelConfig& config, const PlainVitOptions& o, int64_t default_heads) {
    TransformerShape shape;
    shape.num_heads = config.get_int("num_heads", default_heads);
    shape.mlp_ratio = config.get_double("mlp_ratio", shape.mlp_ratio);
    LINVIS_CHECK(shape.num_heads >= 1 && o.embed_dim >= shape.num_heads && o.embed_dim % shape.num_heads == 0, o.name,
                 ": embed_dim ", o.embed_dim, " must be divisible by num_heads ", shape.num_heads);
    LINVIS_CHECK(shape.mlp_ratio > 0, o.name, ": mlp_ratio must be > 0, got ", shape.mlp_ratio);
    return shape;
}

std::shared_ptr<PlainVit> make_transformer_vit(const ModelConfig& config, const PlainVitOptions& defaults,
                                               int64_t default_heads, const MixerFactory& make_mixer, bool cpe) {
    const PlainVitOptions o = read_plain_vit_options(config, defaults);
    const TransformerShape shape = read_transformer_shape(config, o, default_heads);
    return std::make_shared<PlainVit>(o, [&](int64_t, double drop_path) {
        return std::make_shared<nn::TransformerBlockImpl>(shape.block(o, drop_path, cpe),
                                                          make_mixer(o.embed_dim, shape.num_heads, o.impl));
    });
}

std::shared_ptr<PlainVit> make_timm_vit(const ModelConfig& config, const std::string& name, int64_t embed_dim,
                                        int64_t num_heads, bool class_token, const MixerFactory& make_mixer) {
    PlainVitOptions defaults;
    defaults.name = name;
    defaults.embed_dim = embed_dim;
    defaults.class_token = class_token;
    defaults.fixed_input_size = true;
    defaults.pooling = class_token ? Pooling::ClassToken : Pooling::Mean;
    // timm's init: every Linear trunc_normal(.02) with zero bias, as each is built (nn::vit_linear; the head
    // with head_init_std .02).
    return make_transformer_vit(config, defaults, num_heads, make_mixer);
}

PlainVit::PlainVit(const PlainVitOptions& o, const BlockFactory& make_block, torch::nn::AnyModule final_norm)
    : o_(o) {
    const int64_t D = o.embed_dim, prefix = num_prefix_tokens();
    // Parameters of the model itself come first in the state dict, as in timm (cls_token, pos_embed).
    if (o.class_token) cls_token = register_parameter("cls_token", torch::zeros({1, 1, D}));
    if (o.pos_embed == PosEmbedKind::Tokens)
        pos_embed = register_parameter("pos_embed", torch::zeros({1, prefix + grid() * grid(), D}));
    patch_embed = register_module("patch_embed", nn::PatchEmbed(o.in_chans, D, o.patch_size));
    if (o.pos_embed == PosEmbedKind::Grid)
        grid_pos_embed = register_module("pos_embed", nn::GridPosEmbed(grid(), grid(), D));
    blocks = register_module("blocks", torch::nn::ModuleList());
    const std::vector<double> rates = nn::drop_path_rates(o.drop_path_rate, o.depth, o.drop_path_decay);
    for (int64_t i = 0; i < o.depth; ++i) {
        std::shared_ptr<nn::VitBlock> block = make_block(i, rates[static_cast<size_t>(i)]);
        blocks->push_back(block);
        blocks_.push_back(std::move(block));
    }
    if (o.features.features_only) {
        const int64_t taps = sub_blocks();
        std::vector<int64_t> wanted = o.features.out_indices;
        if (wanted.empty()) {
            for (int64_t q = 1; q <= 4; ++q) wanted.push_back(std::max<int64_t>(taps * q / 4 - 1, 0));
            wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
        }
        feature_indices_ = nn::take_indices(taps, wanted, o.name + " out_indices");
    }
    if (final_norm.is_empty())
        final_norm = torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(1e-6)));
    norm = std::move(final_norm);
    register_module("norm", norm.ptr());
    const int64_t features = num_features();
    if (o.pooling == Pooling::Bilateral)
        legacy_norm = register_module("legacy_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({features}).eps(1e-5)));
    if (o.num_classes > 0) head = register_module("head", nn::uninitialised_linear(features, o.num_classes));

    if (cls_token.defined()) nn::trunc_normal_(cls_token, 0.02);
    if (pos_embed.defined()) nn::trunc_normal_(pos_embed, 0.02);
    if (head) {
        nn::trunc_normal_(head->weight, o.head_init_std);
        torch::NoGradGuard no_grad;
        head->bias.zero_();
    }
}

int64_t PlainVit::num_features() const { return o_.pooling == Pooling::Bilateral ? 2 * o_.embed_dim : o_.embed_dim; }

int64_t PlainVit::sub_blocks() const {
    int64_t n = 0;
    for (const auto& block : blocks_) n += block->num_sub_blocks();
    return n;
}

VisionModel::Embedding PlainVit::embed(const torch::Tensor& images) {
    const std::string& n = o_.name;
    LINVIS_CHECK(images.dim() == 4 && images.size(1) == o_.in_chans, n, ": input images: expected (B, ", o_.in_chans,
                 ", H, W), got ", shape_string(images.sizes()));
    if (o_.fixed_input_size)
        LINVIS_CHECK(images.size(2) == o_.img_size && images.size(3) == o_.img_size, n,
                     ": input images: expected shape [B, ", o_.in_chans, ", ", o_.img_size, ", ", o_.img_size,
                     "], got ", shape_string(images.sizes()),
                     " (build the model with img_size=<size> and adapt pos_embed to change the resolution)");
    LINVIS_CHECK(images.size(2) % o_.patch_size == 0 && images.size(3) % o_.patch_size == 0, n, ": input images: ",
                 images.size(2), "x", images.size(3), " is not a multiple of the patch size ", o_.patch_size);
    torch::Tensor x = patch_embed->tokens(images);  // (B, h * w, D), row-major
    Embedding e;
    e.height = images.size(2) / o_.patch_size;
    e.width = images.size(3) / o_.patch_size;
    e.prefix = num_prefix_tokens();
    if (o_.pos_embed == PosEmbedKind::Grid) {
        torch::Tensor grid_tokens = grid_pos_embed->forward(x.view({x.size(0), e.height, e.width, x.size(2)}));
        e.tokens = grid_tokens.reshape({grid_tokens.size(0), e.height * e.width, grid_tokens.size(3)});
        return e;
    }
    if (cls_token.defined()) x = torch::cat({cls_token.expand({x.size(0), -1, -1}), x}, 1);
    if (pos_embed.defined())
        x = x + nn::resample_abs_pos_embed(pos_embed, {e.height, e.width}, {grid(), grid()}, e.prefix,
                                           o_.pos_embed_antialias);
    e.tokens = x;
    return e;
}

torch::Tensor PlainVit::forward_block(int64_t index, const torch::Tensor& tokens, int64_t height, int64_t width) {
    LINVIS_CHECK(index >= 0 && index < num_blocks(), o_.name, ": forward_block: block ", index, " outside [0, ",
                 num_blocks(), ")");
    return blocks_[static_cast<size_t>(index)]->forward(tokens, height, width);
}

torch::Tensor PlainVit::forward_features(const torch::Tensor& images) {
    Embedding e = embed(images);
    torch::Tensor x = std::move(e.tokens);  // not kept alive beside every block's activations
    const int64_t h = e.height, w = e.width;
    for (auto& block : blocks_)
        x = nn::checkpoint_if(
            o_.grad_checkpointing, [block, h, w](const torch::Tensor& t) { return block->forward(t, h, w); }, x);
    // A LayerNorm (the default) normalises bf16 in float32 (nn::layer_norm); other final norms run as given.
    if (auto* ln = norm.ptr()->as<torch::nn::LayerNormImpl>())
        return nn::layer_norm(x, ln->options.normalized_shape(), ln->weight, ln->bias, ln->options.eps());
    return norm.forward(x);
}

torch::Tensor PlainVit::forward_head(const torch::Tensor& features, bool pre_logits) {
    LINVIS_CHECK(features.dim() == 3 && features.size(2) == o_.embed_dim && features.size(1) > num_prefix_tokens(),
                 o_.name, ": forward_head: expected features (B, T, ", o_.embed_dim, "), got ",
                 shape_string(features.sizes()));
    torch::Tensor pooled;
    switch (o_.pooling) {
        case Pooling::ClassToken: pooled = features.select(1, 0); break;
        case Pooling::Mean: pooled = features.mean(1); break;
        case Pooling::Bilateral:
            // bilateral_flatten: the first and last token (top-left and bottom-right patches).
            pooled = legacy_norm->forward(
                torch::cat({features.select(1, 0), features.select(1, features.size(1) - 1)}, 1));
            break;
    }
    if (pre_logits || !head) return pooled;
    return flops::linear(pooled, head->weight, head->bias);
}

std::vector<torch::Tensor> PlainVit::forward_feature_maps(const torch::Tensor& images,
                                                          const std::vector<int64_t>& indices) {
    LINVIS_CHECK(images.dim() == 4, o_.name, ": input images: expected (B, C, H, W), got ",
                 shape_string(images.sizes()));
    const torch::Tensor padded = nn::pad_to_multiple(images, o_.patch_size);
    const int64_t h = padded.size(2) / o_.patch_size, w = padded.size(3) / o_.patch_size;
    std::vector<torch::Tensor> maps = forward_intermediates(padded, indices);
    for (auto& map : maps) map = nn::tokens_to_map(map, h, w);
    return maps;
}

std::vector<torch::Tensor> PlainVit::forward_intermediates(const torch::Tensor& images,
                                                           const std::vector<int64_t>& indices) {
    const std::vector<int64_t> wanted = nn::take_indices(sub_blocks(), indices, o_.name);
    const int64_t last = wanted.empty() ? -1 : *std::max_element(wanted.begin(), wanted.end());
    Embedding e = embed(images);
    torch::Tensor x = std::move(e.tokens);
    std::vector<torch::Tensor> outputs(wanted.size());
    int64_t tap = 0;
    for (auto& block : blocks_) {
        for (int64_t s = 0; s < block->num_sub_blocks() && tap <= last; ++s, ++tap) {
            const int64_t h = e.height, w = e.width;
            x = nn::checkpoint_if(
                o_.grad_checkpointing,
                [block, s, h, w](const torch::Tensor& t) { return block->forward_sub_block(s, t, h, w); }, x);
            for (size_t k = 0; k < wanted.size(); ++k)
                if (wanted[k] == tap) outputs[k] = x.narrow(1, e.prefix, e.height * e.width);
        }
    }
    return outputs;
}

std::string PlainVit::map_checkpoint_key(const std::string& key) const {
    // A headless model (num_classes=0) drops the classifier of a checkpoint.
    if (o_.num_classes == 0 && key.rfind("head.", 0) == 0) return "";
    return key;
}

torch::Tensor PlainVit::adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const {
    if (o_.pos_embed == PosEmbedKind::Grid && key == "pos_embed.embed") {
        const auto& target = grid_pos_embed->embed;
        LINVIS_CHECK(value.dim() == 4 && value.size(0) == 1 && value.size(3) == target.size(3),
                     "pos_embed.embed: expected shape [1, H, W, ", target.size(3), "], got ",
                     shape_string(value.sizes()));
        return nn::resize_pos_embed_2d(value, target.size(1), target.size(2));
    }
    if (o_.pos_embed != PosEmbedKind::Tokens || key != "pos_embed" || !value.defined() || value.dim() != 3 ||
        value.size(0) != 1 || value.size(2) != o_.embed_dim || value.sizes() == pos_embed.sizes())
        return value;
    auto square_side = [](int64_t tokens) {
        if (tokens <= 0) return int64_t{0};
        const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(tokens))));
        return side * side == tokens ? side : int64_t{0};
    };
    const int64_t side = square_side(value.size(1) - num_prefix_tokens());
    if (side == 0) {
        // A square grid with the other prefix layout (e.g. a DeiT pos_embed with a class token offered
        // to T5): left to the loader, which sees the shape mismatch (the official T5 inheritance skips
        // that tensor, spec B5). Anything else cannot be a position embedding of this model.
        LINVIS_CHECK(square_side(value.size(1) - (1 - num_prefix_tokens())) > 0, o_.name,
                     ": checkpoint tensor 'pos_embed': ", value.size(1), " positions are not a square grid",
                     num_prefix_tokens() ? " after the class token" : "");
        return value;
    }
    return nn::resample_abs_pos_embed(value, {grid(), grid()}, {side, side}, num_prefix_tokens(),
                                      o_.pos_embed_antialias);
}

}  // namespace linvis::models
