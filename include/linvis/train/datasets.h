// Training data: image classification datasets and a multi-threaded batch loader.
//
//  * Fashion-MNIST from gzip IDX files (Debian's dataset-fashion-mnist layout),
//  * CIFAR-10 / CIFAR-100 binary batches,
//  * ImageFolder: DIR/<class>/<image files> (the ImageNet layout), decoded lazily,
// all behind one Dataset interface, and a DataLoader that collates shuffled batches on
// std::thread workers. Formats and error behaviour: docs/data.md.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "linvis/io/image.h"

namespace linvis::train {

enum class Split { Train, Test };
const char* split_name(Split split);

// One transformed sample: image float (C, H, W), class label, and the dataset index it came from
// (which differs from the requested index only when ImageFolder replaced an unreadable file).
struct Example {
    torch::Tensor image;
    int64_t label = -1;
    int64_t index = -1;
};

// Per-sample transform: raw uint8 (H, W, C) image -> float (C, H, W). `rng` is seeded per sample
// by the caller (the DataLoader derives it from its seed, the epoch and the index), so random
// augmentations are reproducible whichever worker thread runs them. Must be thread-safe.
using SampleTransform = std::function<torch::Tensor(const torch::Tensor& image_hwc, std::mt19937_64& rng)>;

// The default transform: uint8 (H, W, C) -> float32 (C, H, W) in [0, 1] (torchvision ToTensor).
SampleTransform to_tensor_transform();

class Dataset {
public:
    virtual ~Dataset() = default;
    virtual int64_t size() const = 0;
    virtual int64_t num_classes() const = 0;
    virtual std::string name() const = 0;
    virtual const std::vector<std::string>& class_names() const = 0;

    // Raw sample: uint8 (H, W, C) image and label. Thread-safe. Throws for index out of range.
    virtual Example get_raw(int64_t index) const = 0;

    // get_raw + the transform, with the transform's generator seeded by `seed`. Thread-safe.
    Example get(int64_t index, uint64_t seed = 0) const;

    // Replaces the per-sample transform (default to_tensor_transform()). Not thread-safe:
    // set it before loading starts.
    void set_transform(SampleTransform transform);

protected:
    void check_index(int64_t index) const;

private:
    SampleTransform transform_ = to_tensor_transform();
};

// Images held in memory: uint8 (N, H, W, C) and int64 labels (N). Fashion-MNIST and CIFAR load into this.
class InMemoryDataset : public Dataset {
public:
    // Validates shapes, dtypes and that every label is in [0, class_names.size()).
    InMemoryDataset(std::string name, torch::Tensor images_nhwc, torch::Tensor labels,
                    std::vector<std::string> class_names);
    int64_t size() const override { return images_.size(0); }
    int64_t num_classes() const override { return int64_t(class_names_.size()); }
    std::string name() const override { return name_; }
    const std::vector<std::string>& class_names() const override { return class_names_; }
    Example get_raw(int64_t index) const override;
    const torch::Tensor& images() const { return images_; }
    const torch::Tensor& labels() const { return labels_; }

private:
    std::string name_;
    torch::Tensor images_;
    torch::Tensor labels_;
    std::vector<std::string> class_names_;
};

// ---------------------------------------------------------------- IDX (MNIST family)

// An IDX file: big-endian header (0, 0, type, ndims, ndims x uint32 sizes) then the values.
// Only type 0x08 (unsigned byte) is accepted, which is what (Fashion-)MNIST uses.
struct IdxArray {
    std::vector<int64_t> dims;
    std::vector<uint8_t> data;
};

// Reads an IDX file, gzip-compressed or not (zlib detects which). Throws linvis::Error naming the
// file when it is missing, not valid gzip, has a bad magic number, a different number of dimensions
// than `expected_ndims`, or more or fewer value bytes than the header announces.
IdxArray read_idx_file(const std::string& path, int expected_ndims);

// Debian's dataset-fashion-mnist installs here.
constexpr const char* kDebianFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// Fashion-MNIST (or MNIST) from `dir`: {train,t10k}-images-idx3-ubyte[.gz] and
// {train,t10k}-labels-idx1-ubyte[.gz]. Images (N, 28, 28, 1); checks that image and label counts
// agree and labels are < 10. Class names are Fashion-MNIST's.
std::shared_ptr<InMemoryDataset> load_fashion_mnist(const std::string& dir = kDebianFashionMnistDir,
                                                    Split split = Split::Train);

// ---------------------------------------------------------------- CIFAR

// Reads one CIFAR binary file: records of `label_bytes` label bytes (1 for CIFAR-10; 2 for
// CIFAR-100: coarse then fine) followed by 3072 bytes of 32x32 R, G, B planes. Appends images as
// (32, 32, 3) uint8 and the last label byte (the fine label for CIFAR-100). Throws naming the file
// when it is missing, empty, not a whole number of records, or a label is >= num_classes.
void read_cifar_file(const std::string& path, int label_bytes, int num_classes, std::vector<uint8_t>& images,
                     std::vector<int64_t>& labels);

// CIFAR-10 from `dir` (cifar-10-batches-bin): data_batch_1..5.bin (train) or test_batch.bin.
// Class names come from batches.meta.txt when present, else the standard ten.
std::shared_ptr<InMemoryDataset> load_cifar10(const std::string& dir, Split split = Split::Train);

// CIFAR-100 from `dir` (cifar-100-binary): train.bin or test.bin, fine labels (100 classes).
// Class names from fine_label_names.txt when present, else "0".."99".
std::shared_ptr<InMemoryDataset> load_cifar100(const std::string& dir, Split split = Split::Train);

// ---------------------------------------------------------------- ImageFolder

// DIR/<class>/**/<image>: classes are the sub-directories of DIR in sorted (byte) order -> index
// 0, 1, ...; images are files with extension .jpg, .jpeg, .png or .bmp (any case) anywhere below
// a class directory, sorted by path. Images are decoded on access with linvis::io::read_image.
// An unreadable or corrupt image never stops loading: it is reported once on stderr, counted,
// and replaced by the next readable sample (index + 1, + 2, ... wrapping around).
class ImageFolder : public Dataset {
public:
    // Throws naming the directory when it does not exist, has no class directories, or a class
    // has no image file (as torchvision does). A file announcing more than `max_pixels` pixels
    // (io::read_image's limit) is skipped as unreadable.
    explicit ImageFolder(const std::string& root, int64_t max_pixels = io::kMaxImagePixels);

    int64_t size() const override { return int64_t(samples_.size()); }
    int64_t num_classes() const override { return int64_t(class_names_.size()); }
    std::string name() const override { return "imagefolder:" + root_; }
    const std::vector<std::string>& class_names() const override { return class_names_; }
    Example get_raw(int64_t index) const override;

    // Files found unreadable so far (each counted once).
    int64_t skipped_count() const;
    std::vector<std::string> skipped_files() const;
    // (path, label) of every listed file, in index order.
    const std::vector<std::pair<std::string, int64_t>>& samples() const { return samples_; }

private:
    std::string root_;
    int64_t max_pixels_;
    std::vector<std::string> class_names_;
    std::vector<std::pair<std::string, int64_t>> samples_;
    mutable std::mutex skipped_mutex_;
    mutable std::set<int64_t> skipped_;
};

// ---------------------------------------------------------------- DataLoader

struct DataLoaderOptions {
    int64_t batch_size = 64;
    bool shuffle = true;
    bool drop_last = false;  // drop the final batch when it is smaller than batch_size
    int num_workers = 2;     // 0: batches are built on the calling thread inside next()
    int prefetch_batches = 4;  // batches built ahead of the consumer (bounded queue)
    uint64_t seed = 0;       // epoch order and per-sample transform seeds derive from it
    // Distributed training: this process reads shard `shard_rank` of `num_shards` of each epoch's
    // order (shard_order in linvis/train/data.h; padded to equal lengths when pad_shards).
    int64_t shard_rank = 0, num_shards = 1;
    bool pad_shards = true;
};

// A collated batch: images float (B, C, H, W), labels int64 (B), indices int64 (B) (dataset
// indices actually used, see Example::index).
struct Batch {
    torch::Tensor images;
    torch::Tensor labels;
    torch::Tensor indices;
};

// Loads batches of a Dataset on worker threads, in a fixed order per (seed, epoch):
//   DataLoader loader(dataset, options);
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//       loader.start_epoch(epoch);
//       while (auto batch = loader.next()) train_step(batch->images, batch->labels);
//   }
// Batches come back in order; workers build up to prefetch_batches ahead. A failure inside a
// worker (e.g. samples of different shapes) is rethrown by next().
class DataLoader {
public:
    DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options);
    ~DataLoader();
    DataLoader(const DataLoader&) = delete;
    DataLoader& operator=(const DataLoader&) = delete;

    int64_t batches_per_epoch() const;
    // The sample order of `epoch`: identity without shuffle, else a Fisher-Yates permutation from
    // a mt19937_64 seeded by (seed, epoch), the same on every platform; then this process's shard.
    std::vector<int64_t> epoch_order(int64_t epoch) const;
    // Sets the shard and the per-process batch size (options' shard fields); call before start_epoch.
    void set_shard(int64_t rank, int64_t num_shards, bool pad, int64_t batch_size);
    // Begins an epoch (abandoning whatever is left of the previous one).
    void start_epoch(int64_t epoch);
    // The next batch of the current epoch, or nullopt when the epoch is done.
    std::optional<Batch> next();
    const DataLoaderOptions& options() const { return options_; }

private:
    struct Slot {
        std::optional<Batch> batch;
        std::exception_ptr error;
    };
    Batch build_batch(const std::vector<int64_t>& indices, int64_t epoch) const;
    std::vector<int64_t> batch_indices(int64_t batch) const;  // needs mutex_ held (reads order_)
    void worker_loop();

    std::shared_ptr<const Dataset> dataset_;
    DataLoaderOptions options_;
    std::vector<std::thread> workers_;
    std::mutex mutex_;
    std::condition_variable work_ready_;
    std::condition_variable batch_ready_;
    bool stop_ = false;
    uint64_t generation_ = 0;  // bumped by start_epoch: results of older epochs are discarded
    int64_t epoch_ = -1;
    std::vector<int64_t> order_;
    int64_t num_batches_ = 0;
    int64_t next_to_claim_ = 0;
    int64_t next_to_deliver_ = 0;
    std::map<int64_t, Slot> ready_;
};

// Seed of the generator given to the transform for (loader seed, epoch, index) (splitmix64 mixing).
uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t index);

}  // namespace linvis::train
