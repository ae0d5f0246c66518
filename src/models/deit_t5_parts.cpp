// Shared plain-ViT body of DeiT and T5 (see deit_t5_parts.h) and timm's pos-embed resampling.
#include "deit_t5_parts.h"

#include <cmath>
#include <map>

#include "linvis/nn/common.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/deit_t5.h"

namespace linvis::models {

namespace deit_t5_detail {

PlainVitOptions read_options(const ModelConfig& config, PlainVitOptions o) {
    o.num_classes = config.get_int("num_classes", o.num_classes);
    o.img_size = config.get_int("img_size", o.img_size);
    o.in_chans = config.get_int("in_chans", o.in_chans);
    o.patch_size = config.get_int("patch_size", o.patch_size);
    o.embed_dim = config.get_int("embed_dim", o.embed_dim);
    o.depth = config.get_int("depth", o.depth);
    o.num_heads = config.get_int("num_heads", o.num_heads);
    o.mlp_ratio = config.get_double("mlp_ratio", o.mlp_ratio);
    o.drop_path_rate = config.get_double("drop_path_rate", o.drop_path_rate);
    o.pos_embed_antialias = config.get_bool("pos_embed_antialias", o.pos_embed_antialias);
    o.impl = ops::parse_impl(config.get_string("impl", ops::impl_name(o.impl)));
    const std::string& n = o.name;
    LINVIS_CHECK(o.num_classes >= 0, n, ": num_classes must be >= 0, got ", o.num_classes);
    LINVIS_CHECK(o.in_chans >= 1, n, ": in_chans must be >= 1, got ", o.in_chans);
    LINVIS_CHECK(o.patch_size >= 1 && o.img_size >= o.patch_size && o.img_size % o.patch_size == 0, n,
                 ": img_size must be a positive multiple of patch_size ", o.patch_size, ", got ", o.img_size);
    LINVIS_CHECK(o.depth >= 1, n, ": depth must be >= 1, got ", o.depth);
    LINVIS_CHECK(o.num_heads >= 1 && o.embed_dim >= o.num_heads && o.embed_dim % o.num_heads == 0, n,
                 ": embed_dim ", o.embed_dim, " must be divisible by num_heads ", o.num_heads);
    LINVIS_CHECK(o.mlp_ratio > 0, n, ": mlp_ratio must be > 0, got ", o.mlp_ratio);
    LINVIS_CHECK(o.drop_path_rate >= 0 && o.drop_path_rate < 1, n, ": drop_path_rate must be in [0, 1), got ",
                 o.drop_path_rate);
    return o;
}

void trunc_normal_(torch::Tensor t, double std, double a, double b) {
    torch::NoGradGuard no_grad;
    auto cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
    const double lo = cdf(a / std), hi = cdf(b / std);
    t.uniform_(2 * lo - 1, 2 * hi - 1);
    t.erfinv_();
    t.mul_(std * std::sqrt(2.0));
    t.clamp_(a, b);
}

MlpImpl::MlpImpl(int64_t dim, int64_t hidden) {
    fc1 = register_module("fc1", torch::nn::Linear(dim, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, dim));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
    return flops::linear(torch::gelu(flops::linear(x, fc1->weight, fc1->bias)), fc2->weight, fc2->bias);
}

BlockImpl::BlockImpl(const PlainVitOptions& o, std::shared_ptr<MixerImpl> mixer, double drop_path)
    : drop_path_rate_(drop_path) {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.embed_dim}).eps(1e-6)));
    attn = register_module("attn", std::move(mixer));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.embed_dim}).eps(1e-6)));
    // int(dim * mlp_ratio) as timm
    mlp = register_module("mlp", std::make_shared<MlpImpl>(o.embed_dim, static_cast<int64_t>(o.embed_dim * o.mlp_ratio)));
}

torch::Tensor BlockImpl::drop_path(const torch::Tensor& x) const {
    return nn::drop_path(x, drop_path_rate_, is_training());
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, int64_t height, int64_t width) {
    torch::Tensor y = x + drop_path(attn->forward(norm1(x), height, width));
    return y + drop_path(mlp->forward(norm2(y)));
}

PatchEmbedImpl::PatchEmbedImpl(const PlainVitOptions& o) : o_(o) {
    proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_chans, o.embed_dim, o.patch_size)
                                                         .stride(o.patch_size)
                                                         .bias(true)));
}

torch::Tensor PatchEmbedImpl::forward(const torch::Tensor& images) {
    LINVIS_CHECK(images.dim() == 4 && images.size(1) == o_.in_chans && images.size(2) == o_.img_size &&
                     images.size(3) == o_.img_size,
                 o_.name, ": input images: expected shape [B, ", o_.in_chans, ", ", o_.img_size, ", ", o_.img_size,
                 "], got ", shape_string(images.sizes()),
                 " (build the model with img_size=<size> and adapt pos_embed to change the resolution)");
    torch::Tensor x = flops::conv2d(images, proj->weight, proj->bias, {o_.patch_size, o_.patch_size}, {0, 0},
                                    {1, 1}, 1);
    return x.flatten(2).transpose(1, 2);
}

PlainVit::PlainVit(const PlainVitOptions& o, const MixerFactory& make_mixer) : o_(o) {
    const int64_t D = o.embed_dim;
    if (o.class_token) cls_token = register_parameter("cls_token", torch::zeros({1, 1, D}));
    pos_embed = register_parameter("pos_embed", torch::zeros({1, num_prefix_tokens() + grid() * grid(), D}));
    patch_embed = register_module("patch_embed", std::make_shared<PatchEmbedImpl>(o));
    blocks_list = register_module("blocks", torch::nn::ModuleList());
    // Stochastic depth decay rule: linspace(0, rate, depth) in float32 as timm.
    torch::Tensor rates = torch::linspace(0.0, o.drop_path_rate, o.depth);
    for (int64_t i = 0; i < o.depth; ++i) {
        auto block = std::make_shared<BlockImpl>(o, make_mixer(o), rates[i].item<double>());
        blocks_list->push_back(block);
        blocks.push_back(block);
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(1e-6)));
    if (o.num_classes > 0) head = register_module("head", torch::nn::Linear(D, o.num_classes));

    // timm 0.4.12 init (mode ''): positions and class token trunc_normal(.02); every Linear
    // trunc_normal(.02) with zero bias; LayerNorm 1/0; convolutions keep the PyTorch default.
    trunc_normal_(pos_embed, 0.02);
    if (o.class_token) trunc_normal_(cls_token, 0.02);
    torch::NoGradGuard no_grad;
    for (const auto& module : modules(/*include_self=*/false)) {
        if (auto* linear = module->as<torch::nn::Linear>()) {
            trunc_normal_(linear->weight, 0.02);
            if (linear->bias.defined()) linear->bias.zero_();
        }
    }
}

torch::Tensor PlainVit::embed(const torch::Tensor& images) {
    torch::Tensor x = patch_embed->forward(images);
    if (o_.class_token) x = torch::cat({cls_token.expand({x.size(0), -1, -1}), x}, 1);
    return x + pos_embed;
}

torch::Tensor PlainVit::forward_features(const torch::Tensor& images) {
    torch::Tensor x = embed(images);
    for (auto& block : blocks) x = block->forward(x, grid(), grid());
    return norm(x);
}

torch::Tensor PlainVit::forward_head(const torch::Tensor& features, bool pre_logits) {
    LINVIS_CHECK(features.dim() == 3 && features.size(2) == o_.embed_dim &&
                     features.size(1) == num_prefix_tokens() + grid() * grid(),
                 o_.name, ": forward_head: expected features [B, ", num_prefix_tokens() + grid() * grid(), ", ",
                 o_.embed_dim, "], got ", shape_string(features.sizes()));
    // DeiT: global_pool 'token' (class token); T5: mean over tokens.
    torch::Tensor pooled = o_.class_token ? features.select(1, 0) : features.mean(1);
    if (pre_logits || !head) return pooled;
    return flops::linear(pooled, head->weight, head->bias);
}

std::vector<torch::Tensor> PlainVit::forward_intermediates(const torch::Tensor& images,
                                                           const std::vector<int64_t>& indices) {
    const int64_t depth = static_cast<int64_t>(blocks.size());
    std::vector<int64_t> wanted;
    int64_t last = -1;
    for (int64_t index : indices) {
        const int64_t i = index < 0 ? depth + index : index;
        LINVIS_CHECK(i >= 0 && i < depth, o_.name, ": forward_intermediates: block index ", index,
                     " out of range for depth ", depth);
        wanted.push_back(i);
        last = std::max(last, i);
    }
    std::map<int64_t, torch::Tensor> outputs;
    torch::Tensor x = embed(images);
    const int64_t prefix = num_prefix_tokens(), tokens = grid() * grid();
    for (int64_t i = 0; i <= last; ++i) {
        x = blocks[i]->forward(x, grid(), grid());
        if (std::find(wanted.begin(), wanted.end(), i) != wanted.end()) outputs[i] = x.narrow(1, prefix, tokens);
    }
    std::vector<torch::Tensor> result;
    for (int64_t i : wanted) result.push_back(outputs.at(i));
    return result;
}

torch::Tensor PlainVit::adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const {
    if (key != "pos_embed" || !value.defined() || value.dim() != 3 || value.size(0) != 1 ||
        value.size(2) != o_.embed_dim || value.sizes() == pos_embed.sizes())
        return value;
    const int64_t tokens = value.size(1) - num_prefix_tokens();
    if (tokens <= 0) return value;
    const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(tokens))));
    // Not a square grid with this model's prefix layout (e.g. a DeiT pos_embed with a class token
    // offered to T5): leave it to the loader, which sees the shape mismatch (the official T5
    // inheritance skips that tensor, spec B5).
    if (side * side != tokens) return value;
    return nn::resample_abs_pos_embed(value, {grid(), grid()}, {side, side}, num_prefix_tokens(), o_.pos_embed_antialias);
}

}  // namespace deit_t5_detail
}  // namespace linvis::models
