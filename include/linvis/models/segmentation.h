// Semantic segmentation: a features_only backbone of any family + a decode head, named as mmsegmentation
// names an EncoderDecoder (`backbone.*`, `neck.*`, `decode_head.*`), so a classification or det/seg
// backbone checkpoint initialises `backbone.` non-strictly.
//
// Heads (decode_head):
//  * "upernet": UPerHead (Xiao et al. 2018; mmseg's uper_head.py, as the ViL and ViT3 papers' ADE20K
//    configs): a pyramid pooling module (scales 1, 2, 3, 6) on the last map, lateral 1x1 convs, a top-down
//    FPN, 3x3 fpn convs, every level upsampled to the finest and concatenated, a 3x3 bottleneck, a 1x1
//    classifier (conv_seg). Every conv is a ConvModule: conv (no bias) + BatchNorm + ReLU.
//  * "fpn": the lighter head (Semantic FPN, Kirillov et al. 2019, reduced): lateral 1x1 convs, top-down sum,
//    one 3x3 conv per level, every level upsampled to the finest and summed, conv_seg.
// Plain (single-stride) backbones get the ViTDet / mmseg MultiLevelNeck-style pyramid in `neck`:
// 2x2 stride-2 deconv + BN + GELU + deconv (x4), one deconv (x2), identity, 2x2 max-pool (x1/2).
// The logits are upsampled bilinearly (align_corners=false) to the input size.
#pragma once

#include <string>

#include <torch/torch.h>

#include "linvis/models/model.h"

namespace linvis::models {

struct SegmentationConfig {
    std::string head = "upernet";  // "upernet" | "fpn"
    int64_t channels = 128;        // decode-head width (mmseg's UperNet uses 512; smaller for CPU)
    int64_t num_classes = 11;
    double dropout = 0.1;          // before conv_seg, as mmseg's decode heads
};

class SegmentationModel : public torch::nn::Module {
public:
    // `backbone` must be a features_only=true model (VisionModel::feature_indices() not empty).
    SegmentationModel(ModelPtr backbone, const SegmentationConfig& config);

    // images (B, C, H, W) of any size -> logits (B, num_classes, H, W).
    torch::Tensor forward(const torch::Tensor& images);
    // The multi-scale maps the head sees (after the neck for plain backbones), finest first.
    std::vector<torch::Tensor> pyramid(const torch::Tensor& images);

    const SegmentationConfig& config() const { return config_; }
    VisionModel& backbone() { return *backbone_; }
    bool plain_backbone() const { return plain_; }

    // Data-parallel training: this process holds rows rank, rank + world, ... of the global batch. The
    // dropout before conv_seg then draws the mask of the whole global batch (from torch's generator,
    // which the trainer seeds alike on every rank) and keeps those rows, so that N processes drop what
    // one process drops. Default: rank 0 of 1.
    void set_batch_rows(int64_t rank, int64_t world);

private:
    torch::Tensor decode(const std::vector<torch::Tensor>& maps);
    torch::Tensor dropout(const torch::Tensor& x) const;

    SegmentationConfig config_;
    ModelPtr backbone_;
    bool plain_ = false;
    std::vector<int64_t> in_channels_;
    torch::nn::ModuleList neck_{nullptr};
    torch::nn::ModuleList lateral_convs_{nullptr}, fpn_convs_{nullptr}, psp_modules_{nullptr};
    std::shared_ptr<torch::nn::Module> bottleneck_, fpn_bottleneck_;  // ConvModules
    torch::nn::Conv2d conv_seg_{nullptr};
    int64_t batch_rank_ = 0, batch_world_ = 1;
};

using SegmentationModelPtr = std::shared_ptr<SegmentationModel>;

// Builds `name` with `config` plus features_only=true, then the segmentation model around it.
SegmentationModelPtr create_segmentation_model(const std::string& name, ModelConfig config,
                                               const SegmentationConfig& seg);

}  // namespace linvis::models
