// Hierarchical H-ViT³: hvit3_tiny / hvit3_small / hvit3_base (spec vit3_t5_official.md A4,
// official vittt/models/h_vittt.py). Conv stem (/4), four stages of TTT blocks with 2-D RoPE
// on q1/k1 and a conv MLP, conv patch merging between stages, BatchNorm1d + GAP head.
#include <array>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "linvis/nn/batch_norm.h"
#include "linvis/nn/checkpoint.h"
#include "linvis/nn/common.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/vit3_layers.h"
#include "linvis/ops/depthwise_conv.h"
#include "linvis/ops/vit3_ttt.h"

namespace linvis::models {
namespace {

using torch::Tensor;
namespace lnn = linvis::nn;

class HVit3BlockImpl : public torch::nn::Module {
public:
    // Blocks whose qkv product or MLP hidden layer would exceed this run in bands of about this many bytes in
    // inference: hvit3_tiny's activations at 1024 / 2048 px then stay below timm's SDPA DeiT's (docs/performance.md,
    // "H-ViT³ in bands of rows"), at the price of recomputing the bands' halo rows (0-6 % of the time measured).
    static constexpr int64_t kBandBytes = int64_t{8} << 20;

    // `rope`: the stage's RoPE holder, shared by its blocks. `rope_in_attn`: the det/seg backbone's layout, whose
    // TTTAttention owns the RoPE buffer (attn.rope.rotations); the classification block holds it itself
    // (rope.rotations).
    HVit3BlockImpl(int64_t dim, int64_t heads, lnn::Vit3Rope stage_rope, double mlp_ratio, double dpr,
                   ops::Impl impl, bool rope_in_attn)
        : drop_path_rate(dpr), impl(impl) {
        // Registration order of the official TTTBlock: cpe, norm1, rope, attn, norm2, mlp.
        cpe = register_module("cpe", torch::nn::Conv2d(torch::nn::Conv2dOptions(dim, dim, 3).padding(1).groups(dim)));
        norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-5)));
        if (rope_in_attn) {
            attn = register_module("attn", lnn::Vit3Ttt(dim, heads, true, impl));
            rope = attn->register_module("rope", stage_rope);
        } else {
            rope = register_module("rope", stage_rope);
            attn = register_module("attn", lnn::Vit3Ttt(dim, heads, true, impl));
        }
        norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-5)));
        mlp = register_module("mlp", lnn::Mlp(dim, static_cast<int64_t>(dim * mlp_ratio), true, impl));
    }
    Tensor forward(Tensor x, int64_t H, int64_t W) {
        // Inference on a large map (the first stages at high resolution): the CPE, the mixer and the MLP a band of
        // rows at a time, so that the mixer's and the MLP's widest tensors (qkv, 3C + 3d channels; the hidden
        // layer, 4C twice) never exist whole, each adding into x in place (nn::add_in_bands_): the block holds x
        // (the stage's own map, moved in) and bands. Elsewhere the residual sums into the branch's fresh output in
        // inference (nn::add_into), not a third tensor. Reference keeps the whole-map form.
        const bool inference =
            !is_training() && impl != ops::Impl::Reference && !torch::GradMode::is_enabled() && !x.requires_grad();
        const int64_t bytes_per_channel = x.element_size() * x.size(0) * H * W;
        const bool mixer_in_bands =
            inference && bytes_per_channel * (3 * attn->dim + 3 * attn->head_dim) > kBandBytes;
        if (mixer_in_bands && x.is_contiguous()) {
            const auto bands = lnn::row_bands(H, bytes_per_channel / H * x.size(2), kBandBytes);
            if (flops::counting()) flops::add(x.size(0) * H * W * x.size(2) * 9);  // the halo rows' repeats aside
            const flops::Uncounted halo_rows_repeated;
            lnn::add_in_bands_(x, W, bands, [&](const Tensor& rows, const lnn::RowBand& band) {
                const Tensor conv = ops::depthwise_conv2d_tokens(rows, band.last - band.first, W, cpe->weight,
                                                                 cpe->bias, ops::DwEpilogue::None, impl);
                return conv.narrow(1, (band.begin - band.first) * W, (band.end - band.begin) * W);
            });
        } else {
            x = ops::depthwise_conv2d_tokens(x, H, W, cpe->weight, cpe->bias, ops::DwEpilogue::Residual, impl);
        }
        // Inference on the whole map: x is the block's own tensor (the CPE's output), so proj's and fc2's products
        // accumulate onto it in the GEMM (nn::Mixer::add_to_).
        const bool in_place = inference && lnn::can_overwrite({x, attn->proj->weight, mlp->fc2->weight});
        if (mixer_in_bands)
            x = attn->residual_in_bands_(lnn::NormedInput(norm1, x), H, W, rope->table(H, W), kBandBytes);
        else if (in_place)
            x = attn->forward_with_rope(lnn::NormedInput(norm1, x), H, W, rope->table(H, W), /*residual=*/x);
        else
            x = lnn::add_into(lnn::drop_path(attn->forward_with_rope(lnn::NormedInput(norm1, x), H, W,
                                                                     rope->table(H, W)),
                                             drop_path_rate, is_training()),
                              x);
        if (inference && bytes_per_channel * 2 * mlp->fc1->weight.size(0) > kBandBytes)
            return mlp->residual_in_bands_(lnn::NormedInput(norm2, x), H, W, kBandBytes);
        if (in_place) return mlp->add_to_(x, lnn::NormedInput(norm2, x), H, W);
        x = lnn::add_into(
            lnn::drop_path(mlp->forward(lnn::NormedInput(norm2, x), H, W), drop_path_rate, is_training()), x);
        return x;
    }

    double drop_path_rate;
    ops::Impl impl;
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
        if (!is_training() && !x.requires_grad() && !torch::GradMode::is_enabled()) {
            if (auto banded = forward_in_bands(x)) return *banded;
            // Inference on channels-last maps (the stem's image copied: 0.6 MiB at 224 px; a patch merging's input
            // is so already): oneDNN's convs then read and write them without reordering to and from its blocked
            // layout, a pointwise conv is a product (Vit3ConvLayerImpl::forward), and the stem's output is the
            // blocks' tokens without a copy: at 224 px about 2 % of a pass (docs/performance.md, "H-ViT3's stem
            // channels-last"). Not in bands: there the copies' memory outweighed a gain that did not show.
            x = x.contiguous(at::MemoryFormat::ChannelsLast);
        }
        if (is_training() && torch::GradMode::is_enabled()) return forward_keeping_conv_outputs(x);
        for (const auto& layer : *conv) x = layer->as<lnn::Vit3ConvLayerImpl>()->forward(x);
        return x;
    }
    torch::nn::ModuleList conv{nullptr};

private:
    // Training: a layer's BatchNorm and ReLU are redone in the next conv's backward (nn::recompute_into_conv2d), so
    // the graph keeps each conv's output and not also its normalised, rectified copy: at 1024 px the stem's four
    // 32- and 256-channel maps at a half and a quarter of the image, 160 MiB for hvit3_tiny.
    Tensor forward_keeping_conv_outputs(const Tensor& x) {
        const auto layer = [this](size_t i) { return (*conv)[i]->as<lnn::Vit3ConvLayerImpl>(); };
        Tensor y = lnn::conv_forward(layer(0)->conv, x);
        for (size_t i = 0; i + 1 < conv->size(); ++i) {
            lnn::Vit3ConvLayerImpl* current = layer(i);
            // A conv and its ReLU alone: the graph keeps the ReLU's output (the next conv's input) and the ReLU's
            // gradient is masked in place. A frozen (eval-mode) norm would write into its input, the kept conv
            // output, outside a graph: the plain layers.
            if (!current->norm && current->relu) {
                y = lnn::relu_conv2d(y, layer(i + 1)->conv);
                continue;
            }
            if (!current->norm || !current->norm->is_training()) {
                y = lnn::conv_forward(layer(i + 1)->conv, current->post(y));
                continue;
            }
            y = lnn::batch_norm_relu_conv2d(*current->norm, current->relu, y, layer(i + 1)->conv);
        }
        return layer(conv->size() - 1)->post(y);
    }

    // Inference at high resolution: the stack's widest maps (the stem's (4 C0)-channel map at a quarter of the
    // image, a patch merging's 4x-wide hidden map before its stride) exist a band of output rows at a time, and
    // LibTorch's convolution (oneDNN's blocked output, then a dense copy) holds two of them. Each layer is a conv
    // then per-pixel BatchNorm / ReLU, so a band of output rows needs only the rows its receptive field covers;
    // those outside the map are the convs' zero padding. Nothing when the widest full map is small.
    std::optional<Tensor> forward_in_bands(const Tensor& x) {
        // The widest layer's band, about: 16 MiB, and 8 MiB when that layer's map (bounded as below) is 64 MiB or
        // more (hvit3_tiny's stem: 6 / 32 / 128 MiB at 224 / 512 / 1024 px). The smaller bands cut hvit3_tiny's
        // activation peak at 1024 / 2048 px from 61-69 / 168 to 48 / 132 MiB on the AVX2 EPYC for 2.2 % more of the
        // model's MACs (the halo rows), run time unchanged within the noise; on smaller maps they were slower in some
        // runs (docs/performance.md, "H-ViT3's conv stacks in smaller bands").
        constexpr int64_t kBandBytes = int64_t{16} << 20, kLargeMapBandBytes = int64_t{8} << 20;
        constexpr int64_t kLargeMapBytes = int64_t{64} << 20;
        struct Geometry {
            int64_t kernel, stride, pad, height;  // height: of the layer's input
        };
        std::vector<Geometry> g;
        int64_t height = x.size(2), width = x.size(3), widest_row = 0, widest_map = 0, macs = 0;
        for (const auto& layer : *conv) {
            const torch::nn::Conv2d& layer_conv = layer->as<lnn::Vit3ConvLayerImpl>()->conv;
            const auto& o = layer_conv->options;
            const int64_t k = (*o.kernel_size())[0], s = (*o.stride())[0];
            const std::optional<std::array<int64_t, 2>> padding = lnn::conv_zero_padding(*layer_conv);
            if (!padding || (*padding)[0] != (*padding)[1]) return std::nullopt;
            const int64_t p = (*padding)[0];
            if ((*o.dilation())[0] != 1) return std::nullopt;
            g.push_back({k, s, p, height});
            height = (height + 2 * p - k) / s + 1;
            width = (width + 2 * p - (*o.kernel_size())[1]) / (*o.stride())[1] + 1;
            macs += x.size(0) * o.out_channels() * height * width * (o.in_channels() / o.groups()) * k *
                    (*o.kernel_size())[1];
            const int64_t wide = (x.size(3) + 2 * p - k) / s + 1;  // an upper bound of each layer's width
            const int64_t row_bytes = o.out_channels() * wide * x.size(0) * x.element_size();
            widest_row = std::max(widest_row, row_bytes);
            widest_map = std::max(widest_map, row_bytes * height);
        }
        const int64_t out_height = height;
        // Output rows per band: about band_bytes of the widest layer's map, whose rows are up to 4 times the
        // output's (the stem's two strides), and at least 4, so that the halo rows stay a modest share (the stem's
        // convs compute 12 % more rows than the map's at 4 rows per band, 6 % at 8).
        const int64_t band_bytes = widest_map >= kLargeMapBytes ? kLargeMapBandBytes : kBandBytes;
        const int64_t band = std::max<int64_t>(4, band_bytes / std::max<int64_t>(widest_row, 1) / 4);
        // Whole maps when the widest is below one band's budget: there bands only add halo rows and copies
        // (hvit3_tiny at 224 px, its stem's widest map bounded at 6 MiB: two bands ran 0.1-1.6 % slower on Zen 4
        // and kept 1.4 MiB more).
        if (band >= out_height || widest_map < kBandBytes) return std::nullopt;
        // FLOPs count each conv once over its whole map (as the whole maps' calls would), not the halo rows' repeats.
        if (flops::counting()) flops::add(macs);
        const flops::Uncounted halo_rows_repeated;
        Tensor out;
        for (int64_t o0 = 0; o0 < out_height; o0 += band) {
            const int64_t o1 = std::min(out_height, o0 + band);
            // Rows each layer's input must hold for output rows [o0, o1), clipped to the map, and the zero rows
            // (padding) above and below.
            std::vector<std::array<int64_t, 4>> rows(g.size());  // begin, end, zeros above, zeros below
            int64_t a = o0, b = o1;
            for (size_t l = g.size(); l-- > 0;) {
                const int64_t need_a = a * g[l].stride - g[l].pad;
                const int64_t need_b = (b - 1) * g[l].stride - g[l].pad + g[l].kernel;
                const int64_t ca = std::max<int64_t>(need_a, 0), cb = std::min(need_b, g[l].height);
                rows[l] = {ca, cb, ca - need_a, need_b - cb};
                a = ca;
                b = cb;
            }
            Tensor t = x.narrow(2, rows[0][0], rows[0][1] - rows[0][0]);
            for (size_t l = 0; l < g.size(); ++l) {
                if (rows[l][2] > 0 || rows[l][3] > 0)
                    t = torch::constant_pad_nd(t, {0, 0, rows[l][2], rows[l][3]});
                t = (*conv)[l]->as<lnn::Vit3ConvLayerImpl>()->forward(t, /*pad_rows=*/false);
            }
            // Channels last, so that the blocks' tokens (B, H*W, C) are this map without a copy.
            if (!out.defined())
                out = torch::empty({t.size(0), out_height, t.size(3), t.size(1)}, t.options()).permute({0, 3, 1, 2});
            out.narrow(2, o0, o1 - o0).copy_(t);
        }
        return out;
    }
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

std::vector<int64_t> read_stage_list(const ModelConfig& config, const std::string& key,
                                     const std::vector<int64_t>& dflt) {
    std::vector<int64_t> out = config.get_int_list(key, dflt);
    LINVIS_CHECK(out.size() == 4, "hvit3: option ", key, ": expected 4 values (one per stage), got ", out.size());
    return out;
}

// The per-stage shape of a size; every option of the family (read_hvit3_options) on top of it.
struct HVit3Config {
    std::vector<int64_t> dims, depths;
};

// The official code fixes the head width at 32 (h_vittt.py's sizes and the det/seg TTTAttention).
constexpr int64_t kHeadDim = 32;

struct HVit3Options {
    int64_t num_classes = 1000, img_size = 224, in_chans = 3;
    std::vector<int64_t> dims, depths, heads;  // per stage
    double mlp_ratio = 4.0, drop_path_rate = 0.0;
    ops::Impl impl = ops::Impl::Auto;
    bool grad_checkpointing = false;  // nn::checkpoint around every TTT block, the stem and the patch mergings
    // Training: the conv MLP's hidden layer redone in fc2's backward (Mlp::recompute_hidden): on (27 % less memory
    // at 1024 px for 3 % more time; with grad_checkpointing, whose peak is then a block's MLP backward, a band of rows
    // at a time: 17 % less for 6 % more). The mixer's RoPE and mix redone in proj's (Vit3Ttt::recompute_mix): off,
    // 16 % less for 6 % more (docs/performance.md).
    bool recompute_mlp = true, recompute_mix = false;
    // features_only: the official detection/segmentation backbone (spec A6): a LayerNorm norm{i} per
    // reported stage, no BatchNorm or head, RoPE under attn and recomputed for every grid, the Stem
    // and PatchMerging padding for any input size.
    FeatureOptions features;
    std::vector<int64_t> out_indices;  // resolved
};

// The one config style of linvis' families: an options struct read from the ModelConfig over the
// size's defaults, checked here (see read_plain_vit_options for the plain ViTs).
HVit3Options read_hvit3_options(const ModelConfig& config, const HVit3Config& base) {
    HVit3Options o;
    o.num_classes = config.get_int("num_classes", o.num_classes);
    o.img_size = config.get_int("img_size", o.img_size);
    o.in_chans = config.get_int("in_chans", o.in_chans);
    o.dims = read_stage_list(config, "embed_dims", base.dims);
    o.depths = read_stage_list(config, "depths", base.depths);
    std::vector<int64_t> heads_of_width;
    for (int64_t d : o.dims) heads_of_width.push_back(d % kHeadDim == 0 ? d / kHeadDim : 0);
    o.heads = read_stage_list(config, "num_heads", heads_of_width);
    o.features = read_feature_options(config);
    if (o.features.features_only) {
        o.num_classes = 0;
        o.out_indices = lnn::take_indices(4, o.features.out_indices.empty() ? std::vector<int64_t>{0, 1, 2, 3}
                                                                              : o.features.out_indices,
                                          "hvit3 out_indices (stages)");
    }
    o.mlp_ratio = config.get_double("mlp_ratio", o.mlp_ratio);
    o.drop_path_rate = config.get_double("drop_path_rate", o.drop_path_rate);
    o.impl = ops::parse_impl(config.get_string("impl", ops::impl_name(o.impl)));
    o.grad_checkpointing = config.get_bool("grad_checkpointing", o.grad_checkpointing);
    o.recompute_mlp = config.get_bool("recompute_mlp", o.recompute_mlp);
    o.recompute_mix = config.get_bool("recompute_mix", o.recompute_mix);
    LINVIS_CHECK(o.num_classes >= 0 && o.in_chans > 0 && o.img_size >= 32, "hvit3: bad options num_classes=",
                 o.num_classes, " in_chans=", o.in_chans, " img_size=", o.img_size);
    LINVIS_CHECK(o.drop_path_rate >= 0.0 && o.drop_path_rate < 1.0, "hvit3: drop_path_rate must be in [0, 1), got ",
                 o.drop_path_rate);
    for (int s = 0; s < 4; ++s)
        LINVIS_CHECK(o.depths[s] >= 1 && o.dims[s] % 4 == 0 && o.heads[s] >= 1 && o.dims[s] % o.heads[s] == 0,
                     "hvit3: stage ", s, ": need depth >= 1, dim % 4 == 0 and dim % heads == 0, got depth ",
                     o.depths[s], " dim ", o.dims[s], " heads ", o.heads[s],
                     o.heads[s] == 0 ? " (give num_heads: the width is not a multiple of 32)" : "");
    return o;
}

bool ends_with(const std::string& text, const std::string& suffix) {
    return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Output side of a k3/s2/p1 conv.
int64_t half_up(int64_t n) { return (n - 1) / 2 + 1; }

class HVit3Model : public VisionModel {
public:
    explicit HVit3Model(const HVit3Options& o)
        : num_classes_(o.num_classes),
          img_size_(o.img_size),
          in_chans_(o.in_chans),
          dims_(o.dims),
          backbone_(o.features.features_only),
          grad_checkpointing_(o.grad_checkpointing),
          out_indices_(o.out_indices) {
        const auto& depths = o.depths;
        // The backbone registers its output norms first, as the official ViTTT backbone does.
        if (backbone_)
            for (int64_t i : out_indices_) {
                const std::string name = "norm" + std::to_string(i);
                if (!stage_norms_.count(i))
                    stage_norms_.emplace(i, register_module(name, torch::nn::LayerNorm(torch::nn::LayerNormOptions(
                                                                      {dims_[static_cast<size_t>(i)]})
                                                                      .eps(1e-5))));
            }
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
            const lnn::Vit3Rope stage_rope(grid, grid, dims_[s]);
            for (int64_t j = 0; j < depths[s]; ++j) {
                HVit3Block block(dims_[s], heads[s], stage_rope, mlp_ratio, rates[static_cast<size_t>(block_index++)],
                                 impl, backbone_);
                block->mlp->recompute_hidden = o.recompute_mlp;
                block->mlp->recompute_in_bands = o.grad_checkpointing;
                block->attn->recompute_mix = o.recompute_mix;
                layer->blocks->push_back(block);
            }
            if (s < 3) layer->downsample = layer->register_module("downsample", make_patch_merging(dims_[s], dims_[s + 1]));
            layers->push_back(layer);
            grid = half_up(grid);
        }
        if (backbone_) return;
        norm = register_module("norm", torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(dims_[3]).eps(1e-5)));
        if (num_classes_ > 0) head = register_module("head", lnn::vit_linear(dims_[3], num_classes_));
    }

    Tensor forward_features(const Tensor& images) override {
        Tensor x = run(images, {});
        if (backbone_) return stage_norms_.count(3) ? normed_map(3, x) : x;
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

    std::vector<Tensor> forward_feature_maps(const Tensor& images, const std::vector<int64_t>& indices) override {
        const std::vector<int64_t> wanted = lnn::take_indices(4, indices, "hvit3 (stages)");
        std::vector<Tensor> stages;
        run(images, &stages);
        std::vector<Tensor> out;
        for (int64_t j : wanted) out.push_back(stage_norms_.count(j) ? normed_map(j, stages[j]) : stages[j]);
        return out;
    }
    std::vector<int64_t> feature_indices() const override { return out_indices_; }

    int64_t num_classes() const override { return num_classes_; }
    // Official keys are used as they are; a headless model (num_classes=0) drops the classifier. The
    // backbone takes a classification checkpoint as the official one does (non-strict): the head and
    // the final BatchNorm are left out and each block's RoPE buffer moves under attn.
    std::string map_checkpoint_key(const std::string& key) const override {
        if (num_classes_ == 0 && key.rfind("head.", 0) == 0) return "";
        if (backbone_) {
            if (key.rfind("norm.", 0) == 0) return "";
            const std::string block_rope = ".rope.rotations", attn_rope = ".attn.rope.rotations";
            if (key.rfind("layers.", 0) == 0 && ends_with(key, block_rope) && !ends_with(key, attn_rope))
                return key.substr(0, key.size() - block_rope.size()) + attn_rope;
        }
        return key;
    }
    int64_t num_features() const override { return dims_[3]; }

    // RoPE tables depend on the grid: a checkpoint made at another resolution gets the table
    // recomputed for this model's grid (the det/seg backbone's functional RoPE, same formula).
    Tensor adapt_checkpoint_tensor(const std::string& key, const Tensor& value) const override {
        if (!ends_with(key, ".rope.rotations")) return value;
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
        // The backbone's Stem pads right/bottom to a multiple of 4 and its PatchMerging pads odd sides
        // by one (zeros, before the convolutions); the classification model has neither.
        Tensor map = run_stack(patch_embed, backbone_ ? lnn::pad_to_multiple(images, 4) : images);
        for (size_t s = 0; s < layers->size(); ++s) {
            auto* layer = layers[s]->as<BasicLayerImpl>();
            const int64_t H = map.size(2), W = map.size(3);
            // The map's storage lives on in x alone, and each block gets x itself (moved): a banded block adds into
            // it in place (one map alive), a whole-map block frees it once the CPE's sum exists (two, not four).
            Tensor x = lnn::map_to_tokens(std::exchange(map, Tensor()));
            for (const auto& block : *layer->blocks) {
                auto* b = block->as<HVit3BlockImpl>();
                x = grad_checkpointing_
                        ? lnn::checkpoint_if(true, [b, H, W](const Tensor& t) { return b->forward(t, H, W); }, x)
                        : b->forward(std::move(x), H, W);
            }
            map = lnn::tokens_to_map(x, H, W);
            if (stages) stages->push_back(map);
            if (layer->downsample) map = run_stack(layer->downsample, backbone_ ? lnn::pad_to_multiple(map, 2) : map);
        }
        return map;
    }

    // The stem or a patch merging; with grad_checkpointing recomputed in the backward as the blocks are (at 1024 px
    // hvit3_tiny's conv stacks keep about 650 MiB of maps otherwise), their BatchNorm statistics updated once.
    Tensor run_stack(ConvStack stack, const Tensor& x) const {
        if (!grad_checkpointing_) return stack->forward(x);
        const auto segment = [stack](const std::vector<Tensor>& in) mutable {
            return std::vector<Tensor>{stack->forward(in[0])};
        };
        return lnn::checkpoint(segment, {x}, lnn::module_state(*stack))[0];
    }

    // norm{stage} over the channels of a stage map (B, C, H, W), as the backbone applies it to its tokens.
    Tensor normed_map(int64_t stage, const Tensor& map) const {
        torch::nn::LayerNorm norm_layer = stage_norms_.at(stage);
        return lnn::tokens_to_map(lnn::layer_norm(norm_layer, lnn::map_to_tokens(map)), map.size(2), map.size(3));
    }

    int64_t num_classes_, img_size_, in_chans_;
    std::vector<int64_t> dims_;
    bool backbone_;
    bool grad_checkpointing_;
    std::vector<int64_t> out_indices_;
    std::map<int64_t, torch::nn::LayerNorm> stage_norms_;
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
                              factory({{64, 128, 320, 512}, {1, 3, 9, 4}}));
const ModelRegistrar reg_small("hvit3_small", "hvit3",
                               "H-ViT³-S (arXiv 2512.01643): dims 64-512, depths 2-6-18-8; 54.36M params",
                               factory({{64, 128, 320, 512}, {2, 6, 18, 8}}));
const ModelRegistrar reg_base("hvit3_base", "hvit3",
                              "H-ViT³-B (arXiv 2512.01643): dims 96-640, depths 2-6-18-8; 94.37M params",
                              factory({{96, 192, 448, 640}, {2, 6, 18, 8}}));

}  // namespace
}  // namespace linvis::models
