// Segmentation model: features_only backbone + neck (plain backbones) + UPerHead or a light FPN head.
// Layer layout and names follow open-mmlab/mmsegmentation@v1.2.2:mmseg/models/decode_heads/uper_head.py
// (lateral_convs, psp_modules, bottleneck, fpn_convs, fpn_bottleneck, conv_seg; ConvModule = conv + bn).
#include "linvis/models/segmentation.h"

#include <iterator>

#include "linvis/core/error.h"
#include "linvis/models/registry.h"
#include "linvis/nn/batch_norm.h"

namespace linvis::models {
namespace {

namespace F = torch::nn::functional;

// mmcv's ConvModule: conv (no bias) + BatchNorm + ReLU, children named conv and bn.
struct ConvModuleImpl : torch::nn::Module {
    ConvModuleImpl(int64_t in, int64_t out, int64_t kernel) {
        conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel)
                                                             .padding(kernel / 2)
                                                             .bias(false)));
        bn = register_module("bn", torch::nn::BatchNorm2d(out));
    }
    torch::Tensor forward(const torch::Tensor& x) { return torch::relu(nn::batch_norm(*bn, conv->forward(x))); }
    torch::nn::Conv2d conv{nullptr};
    torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(ConvModule);

// One level of the plain-backbone pyramid (ViTDet's simple feature pyramid, as mmseg's ViT configs):
// scale 4: deconv, BN, GELU, deconv; 2: deconv; 1: identity; 0 (1/2): max-pool.
struct NeckLevelImpl : torch::nn::Module {
    NeckLevelImpl(int64_t channels, int scale) : scale(scale) {
        auto deconv = [&] {
            return torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(channels, channels, 2).stride(2));
        };
        if (scale >= 2) up1 = register_module("up1", deconv());
        if (scale == 4) {
            bn = register_module("bn", torch::nn::BatchNorm2d(channels));
            up2 = register_module("up2", deconv());
        }
    }
    torch::Tensor forward(const torch::Tensor& x) {
        if (scale == 4) return up2->forward(torch::gelu(nn::batch_norm(*bn, up1->forward(x))));
        if (scale == 2) return up1->forward(x);
        if (scale == 1) return x;
        return F::max_pool2d(x, F::MaxPool2dFuncOptions(2).stride(2).ceil_mode(true));
    }
    int scale;
    torch::nn::ConvTranspose2d up1{nullptr}, up2{nullptr};
    torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(NeckLevel);

const int64_t kPoolScales[] = {1, 2, 3, 6};

torch::Tensor resize_to(const torch::Tensor& x, int64_t h, int64_t w) {
    if (x.size(2) == h && x.size(3) == w) return x;
    return F::interpolate(x, F::InterpolateFuncOptions()
                                 .size(std::vector<int64_t>{h, w})
                                 .mode(torch::kBilinear)
                                 .align_corners(false));
}

}  // namespace

SegmentationModel::SegmentationModel(ModelPtr backbone, const SegmentationConfig& config)
    : config_(config), backbone_(std::move(backbone)) {
    LINVIS_CHECK(backbone_ != nullptr && !backbone_->feature_indices().empty(),
                 "segmentation: the backbone must be built with features_only=true");
    LINVIS_CHECK(config_.head == "upernet" || config_.head == "fpn",
                 "segmentation: head must be upernet or fpn, got ", config_.head);
    LINVIS_CHECK(config_.channels > 0, "segmentation: channels must be > 0, got ", config_.channels);
    LINVIS_CHECK(config_.num_classes > 0, "segmentation: num_classes must be > 0, got ", config_.num_classes);
    LINVIS_CHECK(config_.dropout >= 0 && config_.dropout < 1, "segmentation: dropout must be in [0, 1), got ",
                 config_.dropout);
    register_module("backbone", backbone_);

    // Probe the backbone once for the channels and strides of its maps.
    std::vector<torch::Tensor> probe;
    {
        torch::NoGradGuard no_grad;
        const bool was_training = backbone_->is_training();
        backbone_->eval();
        int64_t in_chans = 3;
        for (const auto& p : backbone_->named_parameters())
            if (p.value().dim() == 4) { in_chans = p.value().size(1); break; }  // the first conv: the stem
        probe = backbone_->forward_feature_maps(torch::zeros({1, in_chans, 64, 64}), backbone_->feature_indices());
        backbone_->train(was_training);
    }
    plain_ = true;
    for (const auto& m : probe) {
        in_channels_.push_back(m.size(1));
        if (m.size(2) != probe[0].size(2)) plain_ = false;
    }
    const int64_t levels = static_cast<int64_t>(in_channels_.size());
    if (plain_ && levels > 1) {
        LINVIS_CHECK(levels == 4, "segmentation: a plain backbone needs 4 out_indices for the pyramid, got ", levels);
        neck_ = register_module("neck", torch::nn::ModuleList());
        const int scales[] = {4, 2, 1, 0};
        for (int64_t i = 0; i < levels; ++i) neck_->push_back(NeckLevel(in_channels_[size_t(i)], scales[i]));
    } else {
        plain_ = false;
    }

    auto head = std::make_shared<torch::nn::Module>();
    register_module("decode_head", head);
    const int64_t C = config_.channels;
    lateral_convs_ = head->register_module("lateral_convs", torch::nn::ModuleList());
    fpn_convs_ = head->register_module("fpn_convs", torch::nn::ModuleList());
    const bool uper = config_.head == "upernet";
    // UPerHead: the last level goes through the PPM (bottleneck) instead of a lateral conv.
    for (int64_t i = 0; i < (uper ? levels - 1 : levels); ++i) {
        lateral_convs_->push_back(ConvModule(in_channels_[size_t(i)], C, 1));
        fpn_convs_->push_back(ConvModule(C, C, 3));
    }
    if (uper) {
        psp_modules_ = head->register_module("psp_modules", torch::nn::ModuleList());
        for (size_t s = 0; s < std::size(kPoolScales); ++s) psp_modules_->push_back(ConvModule(in_channels_.back(), C, 1));
        bottleneck_ = head->register_module(
            "bottleneck", ConvModule(in_channels_.back() + int64_t(std::size(kPoolScales)) * C, C, 3));
        fpn_bottleneck_ = head->register_module("fpn_bottleneck", ConvModule(levels * C, C, 3));
    }
    conv_seg_ = head->register_module("conv_seg", torch::nn::Conv2d(torch::nn::Conv2dOptions(C, config_.num_classes, 1)));
}

std::vector<torch::Tensor> SegmentationModel::pyramid(const torch::Tensor& images) {
    std::vector<torch::Tensor> maps = backbone_->forward_feature_maps(images, backbone_->feature_indices());
    if (plain_)
        for (size_t i = 0; i < maps.size(); ++i) maps[i] = neck_[i]->as<NeckLevelImpl>()->forward(maps[i]);
    return maps;
}

torch::Tensor SegmentationModel::decode(const std::vector<torch::Tensor>& maps) {
    const size_t levels = maps.size();
    std::vector<torch::Tensor> lat;
    const bool uper = config_.head == "upernet";
    for (size_t i = 0; i < lateral_convs_->size(); ++i)
        lat.push_back(lateral_convs_[i]->as<ConvModuleImpl>()->forward(maps[i]));
    if (uper) {  // PSP on the last map
        const torch::Tensor& x = maps.back();
        std::vector<torch::Tensor> outs{x};
        for (size_t s = 0; s < psp_modules_->size(); ++s) {
            torch::Tensor pooled = F::adaptive_avg_pool2d(x, F::AdaptiveAvgPool2dFuncOptions(kPoolScales[s]));
            outs.push_back(resize_to(psp_modules_[s]->as<ConvModuleImpl>()->forward(pooled), x.size(2), x.size(3)));
        }
        lat.push_back(bottleneck_->as<ConvModuleImpl>()->forward(torch::cat(outs, 1)));
    }
    for (size_t i = levels - 1; i > 0; --i)  // top-down
        lat[i - 1] = lat[i - 1] + resize_to(lat[i], lat[i - 1].size(2), lat[i - 1].size(3));
    const int64_t h = lat[0].size(2), w = lat[0].size(3);
    std::vector<torch::Tensor> outs;
    for (size_t i = 0; i < levels; ++i) {
        torch::Tensor o = (uper && i == levels - 1) ? lat[i] : fpn_convs_[i]->as<ConvModuleImpl>()->forward(lat[i]);
        outs.push_back(resize_to(o, h, w));
    }
    torch::Tensor fused;
    if (uper) {
        fused = fpn_bottleneck_->as<ConvModuleImpl>()->forward(torch::cat(outs, 1));
    } else {
        fused = outs[0];
        for (size_t i = 1; i < levels; ++i) fused = fused + outs[i];
    }
    return conv_seg_->forward(dropout(fused));
}

void SegmentationModel::set_batch_rows(int64_t rank, int64_t world) {
    LINVIS_CHECK(world >= 1 && rank >= 0 && rank < world, "segmentation: rank ", rank, " of ", world, " processes");
    batch_rank_ = rank;
    batch_world_ = world;
}

torch::Tensor SegmentationModel::dropout(const torch::Tensor& x) const {
    const double p = config_.dropout;
    if (!is_training() || p == 0) return x;
    // torch's dropout (keep with probability 1 - p, scale by 1 / (1 - p)) with the mask drawn for the
    // whole global batch, of which this process keeps its rows.
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] *= batch_world_;
    torch::Tensor keep = torch::empty(shape, x.options()).bernoulli_(1.0 - p);
    if (batch_world_ > 1) keep = keep.index_select(0, torch::arange(batch_rank_, shape[0], batch_world_, torch::kInt64));
    return x * keep / (1.0 - p);
}

torch::Tensor SegmentationModel::forward(const torch::Tensor& images) {
    LINVIS_CHECK(images.dim() == 4, "segmentation: images must be (B, C, H, W), got ", images.dim(), " dims");
    return resize_to(decode(pyramid(images)), images.size(2), images.size(3));
}

SegmentationModelPtr create_segmentation_model(const std::string& name, ModelConfig config,
                                               const SegmentationConfig& seg) {
    config.set("features_only", std::string("true"));
    return std::make_shared<SegmentationModel>(create_model(name, config), seg);
}

}  // namespace linvis::models
