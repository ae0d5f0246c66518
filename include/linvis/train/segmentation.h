// Semantic segmentation data, metrics and training (docs/dense.md).
//
// Data sets give (image uint8 (H, W, 3), label int64 (H, W)) with an ignore index (255):
//  * SegmentationFolder: the ADE20K / mmseg layout ROOT/images/<split>/<stem>.{jpg,jpeg,png,bmp} and
//    ROOT/annotations/<split>/<stem>.png (single-channel label maps; a grey PNG read as its grey value),
//    reduce_zero_label as mmseg's ADE20K config (0 -> ignore, k -> k - 1). A label map whose size differs
//    from its image, a class id outside [0, num_classes) other than the ignore index, an unreadable or
//    missing file: one-line linvis::Error naming the file.
//  * FashionScenes: deterministic "Fashion-MNIST scenes" generated from (seed, split, index); see
//    make_fashion_scene.
// SegmentationTrainer: AdamW, linear warm-up then poly decay (power 1, mmseg), a backbone lr multiplier,
// cross-entropy with the ignore index, random scale/crop/flip, atomic checkpoints and exact resume,
// data-parallel over the processes of a run (linvis/train/distributed.h) with the single-process result.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/models/segmentation.h"
#include "linvis/train/datasets.h"
#include "linvis/train/distributed.h"

namespace linvis::train {

constexpr int64_t kIgnoreIndex = 255;

struct SegSample {
    torch::Tensor image;  // uint8 (H, W, 3)
    torch::Tensor label;  // int64 (H, W): class ids or kIgnoreIndex
};

class SegmentationDataset {
public:
    virtual ~SegmentationDataset() = default;
    virtual int64_t size() const = 0;
    virtual int64_t num_classes() const = 0;
    virtual std::string name() const = 0;
    virtual std::vector<std::string> class_names() const = 0;
    virtual SegSample get(int64_t index) const = 0;  // thread-safe
};

class SegmentationFolder : public SegmentationDataset {
public:
    // Lists ROOT/images/<split>; every image needs ROOT/annotations/<split>/<stem>.png (error naming it).
    SegmentationFolder(const std::string& root, const std::string& split, int64_t num_classes,
                       bool reduce_zero_label);
    int64_t size() const override { return int64_t(images_.size()); }
    int64_t num_classes() const override { return num_classes_; }
    std::string name() const override { return "segfolder:" + root_ + "/" + split_; }
    std::vector<std::string> class_names() const override;
    SegSample get(int64_t index) const override;

private:
    std::string root_, split_;
    int64_t num_classes_;
    bool reduce_zero_label_;
    std::vector<std::string> images_, labels_;
};

// "Fashion-MNIST scenes" of side `size`: a dark textured background (label 0) and 8..16 Fashion-MNIST
// items, each scaled by s in [1, 2] * size / 256 (nearest), tinted by a random colour and placed at a
// random position (may be cut by the border); later items occlude earlier ones. A pixel belongs to an
// item where the item's intensity is > 40 of 255; it is labelled 1 + the item's class (1..10), every
// other pixel 0. The image and the label come from one mt19937_64 seeded by splitmix64(seed, index), the
// items drawn from `items` (the Fashion-MNIST train split for training scenes, t10k for evaluation).
SegSample make_fashion_scene(const InMemoryDataset& items, int64_t size, uint64_t seed, int64_t index);

class FashionScenes : public SegmentationDataset {
public:
    FashionScenes(std::shared_ptr<InMemoryDataset> items, int64_t size, int64_t count, uint64_t seed);
    int64_t size() const override { return count_; }
    int64_t num_classes() const override { return 11; }
    std::string name() const override;
    std::vector<std::string> class_names() const override;
    SegSample get(int64_t index) const override;

private:
    std::shared_ptr<InMemoryDataset> items_;
    int64_t size_, count_;
    uint64_t seed_;
};

// Training augmentation (mmseg's ADE20K pipeline): resize by a random ratio in [min_scale, max_scale] of
// `scale` (the longer side; bilinear image, nearest label), random crop of crop x crop (padded with 0 /
// the ignore index when smaller), horizontal flip with probability 0.5.
struct SegAugment {
    int64_t scale = 512;
    int64_t crop = 512;
    double min_scale = 0.5, max_scale = 2.0;
    bool flip = true;
};
SegSample augment_sample(const SegSample& sample, const SegAugment& augment, std::mt19937_64& rng);

// uint8 (H, W, 3) -> float (3, H, W) normalised with the ImageNet mean and std.
torch::Tensor normalize_image(const torch::Tensor& image_hwc);

// Confusion-matrix metrics as mmseg's IoUMetric: per-class IoU = TP / (TP + FP + FN), NaN for a class
// absent from both prediction and ground truth; mIoU the mean over the classes that are not NaN; pixel
// accuracy (aAcc) = correct / labelled pixels. Pixels labelled ignore_index are not counted.
class SegmentationMetrics {
public:
    explicit SegmentationMetrics(int64_t num_classes, int64_t ignore_index = kIgnoreIndex);
    void update(const torch::Tensor& prediction, const torch::Tensor& target);  // int64, same shape
    // Adds the confusion matrices of all ranks (every rank then holds the total); a no-op with one process.
    void sum_over_ranks(Distributed* dist);
    std::vector<double> per_class_iou() const;
    double mean_iou() const;        // in [0, 1]
    double pixel_accuracy() const;  // in [0, 1]
    const torch::Tensor& confusion() const { return confusion_; }

private:
    int64_t num_classes_, ignore_index_;
    torch::Tensor confusion_;  // (num_classes, num_classes) int64, rows: target, cols: prediction
};

struct SegEvalResult {
    double miou = 0, pixel_accuracy = 0;
    double loss = 0;  // cross-entropy averaged over the labelled pixels of the whole split
    std::vector<double> per_class_iou;
    int64_t images = 0;
};
// Whole-image inference (batches of equal-size images), limit > 0: the first `limit` images. With a
// process group, rank r evaluates images r, r + W, ... and the counts are summed over the ranks, so
// every rank gets the result of the whole split.
SegEvalResult evaluate_segmentation(models::SegmentationModel& model, const SegmentationDataset& data,
                                    int64_t batch_size = 2, int64_t limit = 0, bool progress = false,
                                    Distributed* dist = nullptr);

struct SegTrainConfig {
    std::string output_dir;
    int64_t steps = 1000;
    int64_t batch_size = 4;        // the global batch: split over the processes of a data-parallel run
    double lr = 1e-3;
    double min_lr = 0;
    double backbone_lr_mult = 1.0;
    double weight_decay = 0.01;
    double eps = 1e-8;             // AdamW's epsilon (mmseg's default)
    int64_t warmup_steps = 50;
    double poly_power = 1.0;
    double clip_grad = 0;
    int64_t eval_every = 0;        // 0: at the end only
    int64_t checkpoint_every = 50;
    int64_t eval_limit = 0;
    double time_budget_s = 0;      // > 0: stop (checkpointed, then evaluated) once the training time exceeds it
    double cpu_budget_s = 0;       // > 0: the same for the CPU time of the process (all threads; rank 0's)
    uint64_t seed = 0;
    bool resume = false;
    bool progress = true;
    SegAugment augment;
    std::string config_json;       // refused on resume when different
    // Data-parallel training (null: one process): each rank computes its share of every global batch, the
    // gradients and BatchNorm statistics are those of the global batch, only rank 0 writes files.
    std::shared_ptr<Distributed> distributed;
};

struct SegStepRecord {
    int64_t step = 0;
    double loss = 0, lr = 0, seconds = 0;
};

class SegmentationTrainer {
public:
    SegmentationTrainer(models::SegmentationModelPtr model, SegTrainConfig config);
    // Trains to config.steps (or the time budget, or Ctrl-C: every rank stops after the same step and a
    // checkpoint is saved once); returns the final evaluation (eval may be null; none after Ctrl-C).
    SegEvalResult fit(const SegmentationDataset& train, const SegmentationDataset* eval);
    std::function<void(const std::string& path, const torch::nn::Module&)> save_weights;
    int64_t step() const { return step_; }
    bool interrupted() const { return interrupted_; }

private:
    double lr_at(int64_t step) const;
    models::SegmentationModelPtr model_;
    SegTrainConfig config_;
    int64_t step_ = 0;
    bool interrupted_ = false;
};

}  // namespace linvis::train
