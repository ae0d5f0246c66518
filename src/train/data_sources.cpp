#include "linvis/train/data_sources.h"

#include <filesystem>

#include "linvis/core/error.h"
#include "linvis/io/transforms.h"
#include "linvis/train/datasets.h"

namespace linvis::train {
namespace {

namespace fs = std::filesystem;

// Mean and std of the training split of each small data set (per channel, on [0, 1] values).
struct Normalisation {
    std::vector<double> mean, std;
};
const Normalisation kFashionMnist{{0.2860}, {0.3530}};
const Normalisation kCifar10{{0.4914, 0.4822, 0.4465}, {0.2470, 0.2435, 0.2616}};
const Normalisation kCifar100{{0.5071, 0.4865, 0.4409}, {0.2673, 0.2564, 0.2762}};

// uint8 (N, H, W, C) -> normalised float (N, C, size, size), optionally only the first `limit`.
torch::Tensor prepare(const torch::Tensor& images_nhwc, const Normalisation& norm, int64_t size, int64_t limit) {
    torch::Tensor images = images_nhwc;
    if (limit > 0 && limit < images.size(0)) images = images.slice(0, 0, limit);
    torch::Tensor x = images.permute({0, 3, 1, 2}).to(torch::kFloat32).div(255.0);
    if (size != x.size(2) || size != x.size(3)) {
        namespace F = torch::nn::functional;
        x = F::interpolate(x, F::InterpolateFuncOptions()
                                  .size(std::vector<int64_t>{size, size})
                                  .mode(torch::kBicubic)
                                  .align_corners(false)
                                  .antialias(size < x.size(2)))
                .clamp(0.0, 1.0);
    }
    const int64_t c = x.size(1);
    torch::Tensor mean = torch::tensor(norm.mean, torch::kFloat32).view({1, c, 1, 1});
    torch::Tensor std = torch::tensor(norm.std, torch::kFloat32).view({1, c, 1, 1});
    return ((x - mean) / std).contiguous();
}

torch::Tensor limited(const torch::Tensor& labels, int64_t limit) {
    return limit > 0 && limit < labels.size(0) ? labels.slice(0, 0, limit) : labels;
}

// The first `limit` samples of a data set (all when limit <= 0 or larger than it).
class SubsetDataset : public Dataset {
public:
    SubsetDataset(std::shared_ptr<const Dataset> base, int64_t limit)
        : base_(std::move(base)), size_(limit > 0 ? std::min(limit, base_->size()) : base_->size()) {}
    int64_t size() const override { return size_; }
    int64_t num_classes() const override { return base_->num_classes(); }
    std::string name() const override { return base_->name(); }
    const std::vector<std::string>& class_names() const override { return base_->class_names(); }
    Example get_raw(int64_t index) const override {
        check_index(index);
        return base_->get_raw(index);
    }

private:
    std::shared_ptr<const Dataset> base_;
    int64_t size_;
};

// Batches from a DataLoader over a (decoded on demand) data set.
class LoaderBatchSource : public BatchSource {
public:
    LoaderBatchSource(std::shared_ptr<Dataset> dataset, std::shared_ptr<const ImageFolder> folder,
                      DataLoaderOptions options)
        : dataset_(dataset), folder_(std::move(folder)), loader_(dataset, options), batch_size_(options.batch_size) {}
    void start_epoch(int64_t epoch) override { loader_.start_epoch(epoch); }
    bool next(torch::Tensor& images, torch::Tensor& labels) override {
        auto batch = loader_.next();
        if (!batch) return false;
        images = batch->images;
        labels = batch->labels;
        return true;
    }
    int64_t batches_per_epoch() const override { return loader_.batches_per_epoch(); }
    int64_t num_examples() const override { return dataset_->size(); }
    int64_t skipped_images() const override { return folder_ ? folder_->skipped_count() : 0; }
    void shard(int64_t rank, int64_t world_size, bool training) override {
        int64_t batch = batch_size_;  // as constructed: the global batch when training
        if (training) {
            LINVIS_CHECK(batch % world_size == 0, "--batch-size ", batch,
                         " (the global batch) must be divisible by the number of processes, ", world_size);
            batch /= world_size;
        }
        loader_.set_shard(rank, world_size, training, batch);
    }

private:
    std::shared_ptr<Dataset> dataset_;
    std::shared_ptr<const ImageFolder> folder_;
    DataLoader loader_;
    int64_t batch_size_;
};

DataSources small_sources(const DataConfig& c, bool with_train, const std::string& label,
                          const std::shared_ptr<InMemoryDataset>& train, const std::shared_ptr<InMemoryDataset>& test,
                          const Normalisation& dataset_norm, int64_t native_size, int64_t pad) {
    DataSources out;
    const int64_t channels = test->images().size(3);
    const Normalisation norm = c.minus_one_to_one ? Normalisation{std::vector<double>(channels, 0.5),
                                                                  std::vector<double>(channels, 0.5)}
                                                  : dataset_norm;
    out.img_size = c.img_size > 0 ? c.img_size : native_size;
    out.num_classes = test->num_classes();
    out.in_chans = test->images().size(3);
    out.class_names = test->class_names();
    out.mean = norm.mean;
    out.std = norm.std;
    const bool full = c.augment == DataConfig::Augment::Full;
    const TensorAugment augment{full ? pad * out.img_size / native_size : 0, c.augment != DataConfig::Augment::None};
    if (with_train) {
        out.train = std::make_unique<TensorBatchSource>(prepare(train->images(), norm, out.img_size, c.limit_train),
                                                        limited(train->labels(), c.limit_train), c.batch_size, true,
                                                        c.seed, augment, true);
    }
    out.eval = std::make_unique<TensorBatchSource>(prepare(test->images(), norm, out.img_size, c.limit_eval),
                                                   limited(test->labels(), c.limit_eval), c.eval_batch_size, false,
                                                   c.seed);
    out.description = str_cat(label, ": ", with_train ? out.train->num_examples() : 0, " training and ",
                              out.eval->num_examples(), " test images, ", out.in_chans, "x", out.img_size, "x",
                              out.img_size, ", ", out.num_classes, " classes");
    return out;
}

}  // namespace

DataConfig::Augment parse_augment(const std::string& name) {
    if (name == "none") return DataConfig::Augment::None;
    if (name == "flip") return DataConfig::Augment::Flip;
    if (name == "full") return DataConfig::Augment::Full;
    throw Error(str_cat("--augment: expected none, flip or full, got '", name, "'"));
}

DataSources make_data_sources(const DataConfig& c, bool with_train) {
    if (c.dataset == "fashion-mnist") {
        const std::string dir = c.data_dir.empty() ? kDebianFashionMnistDir : c.data_dir;
        return small_sources(c, with_train, "Fashion-MNIST (" + dir + ")",
                             with_train ? load_fashion_mnist(dir, Split::Train) : nullptr,
                             load_fashion_mnist(dir, Split::Test), kFashionMnist, 28, 2);
    }
    if (c.dataset == "cifar10" || c.dataset == "cifar100") {
        LINVIS_CHECK(!c.data_dir.empty(), "--dataset ", c.dataset, " needs --data-dir (the extracted binary release)");
        const bool ten = c.dataset == "cifar10";
        auto load = ten ? load_cifar10 : load_cifar100;
        return small_sources(c, with_train, ten ? "CIFAR-10" : "CIFAR-100",
                             with_train ? load(c.data_dir, Split::Train) : nullptr, load(c.data_dir, Split::Test),
                             ten ? kCifar10 : kCifar100, 32, 4);
    }
    if (c.dataset.rfind("folder:", 0) == 0) {
        const fs::path root = c.dataset.substr(7);
        LINVIS_CHECK(fs::is_directory(root), "--dataset ", c.dataset, ": not a directory");
        LINVIS_CHECK(!c.minus_one_to_one, "--dataset ", c.dataset,
                     ": pixel-space diffusion training takes fashion-mnist, cifar10 or cifar100 (in-memory sets)");
        const fs::path train_dir = fs::is_directory(root / "train") ? root / "train" : root;
        fs::path eval_dir;
        for (const char* name : {"val", "validation", "test"})
            if (eval_dir.empty() && fs::is_directory(root / name)) eval_dir = root / name;
        DataSources out;
        out.img_size = c.img_size > 0 ? c.img_size : 224;
        io::EvalTransform eval_transform;
        eval_transform.crop_size = out.img_size;
        eval_transform.validate();
        out.mean = eval_transform.mean;
        out.std = eval_transform.std;
        TrainAugmentConfig augment = c.folder_augment;
        augment.img_size = out.img_size;
        DataLoaderOptions options;
        options.num_workers = c.workers;
        options.seed = c.seed;
        int64_t train_count = 0;
        if (with_train) {
            auto folder = std::make_shared<ImageFolder>(train_dir.string());
            auto subset = std::make_shared<SubsetDataset>(folder, c.limit_train);
            const DataConfig::Augment level = c.augment;
            subset->set_transform([augment, eval_transform, level](const torch::Tensor& hwc, std::mt19937_64& rng) {
                if (level == DataConfig::Augment::None) return eval_transform(hwc);
                if (level == DataConfig::Augment::Flip) {
                    torch::Tensor image = eval_transform(hwc);
                    return std::bernoulli_distribution(augment.hflip)(rng) ? image.flip({2}) : image;
                }
                return train_transform(hwc.permute({2, 0, 1}).to(torch::kFloat32).div(255.0), augment, rng);
            });
            options.batch_size = c.batch_size;
            options.shuffle = true;
            options.drop_last = true;
            out.num_classes = folder->num_classes();
            out.class_names = folder->class_names();
            train_count = subset->size();
            out.train = std::make_unique<LoaderBatchSource>(subset, folder, options);
        }
        if (!eval_dir.empty()) {
            auto folder = std::make_shared<ImageFolder>(eval_dir.string());
            auto subset = std::make_shared<SubsetDataset>(folder, c.limit_eval);
            subset->set_transform([eval_transform](const torch::Tensor& hwc, std::mt19937_64&) { return eval_transform(hwc); });
            options.batch_size = c.eval_batch_size;
            options.shuffle = false;
            options.drop_last = false;
            LINVIS_CHECK(!with_train || folder->num_classes() == out.num_classes, eval_dir.string(), ": ",
                         folder->num_classes(), " classes, but the training folder has ", out.num_classes);
            out.num_classes = folder->num_classes();
            out.class_names = folder->class_names();
            out.eval = std::make_unique<LoaderBatchSource>(subset, folder, options);
        } else {
            LINVIS_CHECK(with_train, root.string(), ": no val/, validation/ or test/ folder to evaluate on");
        }
        out.description = str_cat("ImageFolder ", root.string(), ": ", train_count, " training images",
                                  out.eval ? str_cat(", ", out.eval->num_examples(), " evaluation images") : "",
                                  ", ", out.num_classes, " classes, ", out.img_size, "x", out.img_size);
        return out;
    }
    fail("--dataset: expected fashion-mnist, cifar10, cifar100 or folder:DIR, got '", c.dataset, "'");
}

}  // namespace linvis::train
