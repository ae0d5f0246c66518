// From a data-set name on the command line to the trainer's batch sources:
//   fashion-mnist          Debian's dataset-fashion-mnist (or --data-dir), 28x28 grey
//   cifar10 | cifar100     the binary release in --data-dir, 32x32 RGB
//   folder:DIR             an ImageFolder tree: DIR/train and DIR/val (or DIR alone for training)
// Small in-memory sets are normalised once and augmented by random crop with padding and a
// horizontal flip; folders get the DeiT training transform (RandomResizedCrop, flip,
// RandAugment, random erasing) for training and the evaluation transform for evaluation.
#pragma once

#include <array>
#include <memory>
#include <string>

#include "linvis/train/augment.h"
#include "linvis/train/data.h"

namespace linvis::train {

struct DataConfig {
    std::string dataset;        // fashion-mnist | cifar10 | cifar100 | folder:DIR
    std::string data_dir;       // for fashion-mnist (default: Debian's path) and cifar
    int64_t img_size = 0;       // 0: the data set's own size (28, 32) or 224 for folders
    int64_t batch_size = 128;
    int64_t eval_batch_size = 256;
    int64_t limit_train = 0;    // 0: all
    int64_t limit_eval = 0;
    int workers = 2;            // decoding threads for folders
    uint64_t seed = 0;
    // Training augmentation. Full: random crop (after padding) + horizontal flip for the small sets,
    // the DeiT recipe (RandomResizedCrop, flip, RandAugment, erasing) for folders. Flip: horizontal
    // flip only (folders: the eval transform, then the flip). None: the eval images.
    enum class Augment { None, Flip, Full };
    Augment augment = Augment::Full;
    TrainAugmentConfig folder_augment;  // used for folders (img_size is overwritten)
    // Fashion-MNIST / CIFAR: pixels mapped to [-1, 1] ((x - 0.5) / 0.5, the diffusion models' range) instead of
    // the data set's mean / std. Not available for folders.
    bool minus_one_to_one = false;
};

// "none" | "flip" | "full"; throws linvis::Error naming the accepted values otherwise.
DataConfig::Augment parse_augment(const std::string& name);

struct DataSources {
    std::unique_ptr<BatchSource> train;
    std::unique_ptr<BatchSource> eval;  // null when the data set has no evaluation split
    int64_t num_classes = 0;
    int64_t in_chans = 3;
    int64_t img_size = 0;
    std::string description;            // one line for the log
    // What a trained model needs to be used on its own (written into its weights' metadata):
    // the class names and the per-channel normalisation of the [0, 1] pixels it was trained on.
    std::vector<std::string> class_names;
    std::vector<double> mean, std;
};

// Builds the sources; throws linvis::Error naming the data set, path or option when something is wrong.
// with_train=false builds only the evaluation source (for 'linvis eval').
DataSources make_data_sources(const DataConfig& config, bool with_train = true);

}  // namespace linvis::train
