// Datasets (Fashion-MNIST IDX, CIFAR binary, ImageFolder) and the threaded DataLoader.
#include "linvis/train/datasets.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <set>

#include "linvis/core/error.h"
#include "linvis/train/data.h"
#include "linvis/io/gzip.h"
#include "linvis/io/image.h"
#include "linvis/io/transforms.h"

namespace linvis::train {
namespace fs = std::filesystem;

namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Uniform in [0, range) without modulo bias; std::uniform_int_distribution is not specified
// exactly, so it would make the order depend on the standard library.
uint64_t uniform_below(std::mt19937_64& rng, uint64_t range) {
    const uint64_t threshold = (0 - range) % range;  // 2^64 mod range
    while (true) {
        const uint64_t r = rng();
        if (r >= threshold) return r % range;
    }
}

std::vector<uint8_t> read_whole_file(const std::string& path) {
    std::error_code ec;
    const auto status = fs::status(path, ec);
    LINVIS_CHECK(fs::exists(status), path, ": no such file");
    LINVIS_CHECK(!fs::is_directory(status), path, ": is a directory, expected a file");
    std::ifstream in(path, std::ios::binary);
    LINVIS_CHECK(in.good(), path, ": cannot open");
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LINVIS_CHECK(!in.bad(), path, ": read failed");
    return bytes;
}

// Non-empty lines of a text file, or nothing when the file is absent.
std::vector<std::string> read_name_lines(const std::string& path) {
    std::vector<std::string> names;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
        if (!line.empty()) names.push_back(line);
    }
    return names;
}

std::shared_ptr<InMemoryDataset> make_cifar(const std::string& name, const std::vector<std::string>& files,
                                            int label_bytes, std::vector<std::string> class_names) {
    std::vector<uint8_t> images;
    std::vector<int64_t> labels;
    for (const auto& file : files) read_cifar_file(file, label_bytes, int(class_names.size()), images, labels);
    const auto n = int64_t(labels.size());
    auto image_tensor = torch::from_blob(images.data(), {n, 32, 32, 3}, torch::kUInt8).clone();
    auto label_tensor = torch::tensor(labels, torch::kInt64);
    return std::make_shared<InMemoryDataset>(name, image_tensor, label_tensor, std::move(class_names));
}

bool has_image_extension(const fs::path& path) {
    std::string ext = path.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    return ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".bmp";
}

}  // namespace

const char* split_name(Split split) { return split == Split::Train ? "train" : "test"; }

uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t index) {
    return splitmix64(splitmix64(splitmix64(seed) ^ uint64_t(epoch)) ^ uint64_t(index));
}

SampleTransform to_tensor_transform() {
    return [](const torch::Tensor& image, std::mt19937_64&) { return io::to_float_chw(image); };
}

// ---------------------------------------------------------------- Dataset

Example Dataset::get(int64_t index, uint64_t seed) const {
    Example example = get_raw(index);
    std::mt19937_64 rng(seed);
    example.image = transform_(example.image, rng);
    return example;
}

void Dataset::set_transform(SampleTransform transform) {
    LINVIS_CHECK(static_cast<bool>(transform), name(), ": set_transform needs a callable transform");
    transform_ = std::move(transform);
}

void Dataset::check_index(int64_t index) const {
    LINVIS_CHECK(index >= 0 && index < size(), name(), ": index ", index, " out of range [0, ", size(), ")");
}

InMemoryDataset::InMemoryDataset(std::string name, torch::Tensor images_nhwc, torch::Tensor labels,
                                 std::vector<std::string> class_names)
    : name_(std::move(name)),
      images_(std::move(images_nhwc)),
      labels_(std::move(labels)),
      class_names_(std::move(class_names)) {
    LINVIS_CHECK(images_.scalar_type() == torch::kUInt8 && images_.dim() == 4, name_,
                 ": images must be uint8 (N, H, W, C), got ", images_.scalar_type(), " ",
                 shape_string(images_.sizes()));
    LINVIS_CHECK(labels_.scalar_type() == torch::kInt64 && labels_.dim() == 1 && labels_.size(0) == images_.size(0),
                 name_, ": labels must be int64 (", images_.size(0), "), got ", labels_.scalar_type(), " ",
                 shape_string(labels_.sizes()));
    LINVIS_CHECK(!class_names_.empty(), name_, ": no class names");
    if (labels_.numel() > 0) {
        const int64_t low = labels_.min().item<int64_t>(), high = labels_.max().item<int64_t>();
        LINVIS_CHECK(low >= 0 && high < num_classes(), name_, ": labels must be in [0, ", num_classes(),
                     "), found range [", low, ", ", high, "]");
    }
    images_ = images_.contiguous();
    labels_ = labels_.contiguous();
}

Example InMemoryDataset::get_raw(int64_t index) const {
    check_index(index);
    return {images_[index], labels_.data_ptr<int64_t>()[index], index};
}

// ---------------------------------------------------------------- IDX / Fashion-MNIST

IdxArray read_idx_file(const std::string& path, int expected_ndims) {
    const std::vector<uint8_t> bytes = io::read_gzip_file(path);
    LINVIS_CHECK(bytes.size() >= 4, path, ": not an IDX file: ", bytes.size(), " bytes, the header needs at least 4");
    const uint32_t magic = (uint32_t(bytes[0]) << 24) | (uint32_t(bytes[1]) << 16) | (uint32_t(bytes[2]) << 8) | bytes[3];
    LINVIS_CHECK(bytes[0] == 0 && bytes[1] == 0 && bytes[2] == 0x08, path, ": bad IDX magic number 0x", std::hex,
                 magic, std::dec, ", expected 0x0000080", expected_ndims, " (unsigned bytes, ", expected_ndims,
                 " dimensions)");
    const int ndims = bytes[3];
    LINVIS_CHECK(ndims == expected_ndims, path, ": IDX file has ", ndims, " dimensions, expected ", expected_ndims);
    const size_t header = 4 + 4 * size_t(ndims);
    LINVIS_CHECK(bytes.size() >= header, path, ": truncated IDX header: ", bytes.size(), " bytes, expected ", header);
    IdxArray array;
    uint64_t count = 1;
    for (int d = 0; d < ndims; ++d) {
        const uint8_t* p = bytes.data() + 4 + 4 * d;
        const uint32_t dim = (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
        array.dims.push_back(int64_t(dim));
        count *= dim;
        LINVIS_CHECK(count <= (uint64_t(1) << 40), path, ": IDX dimensions ", shape_string(array.dims), " are implausibly large");
    }
    LINVIS_CHECK(bytes.size() - header == count, path, ": IDX header announces ", shape_string(array.dims), " = ",
                 count, " values, the file holds ", bytes.size() - header,
                 (bytes.size() - header < count ? " (truncated)" : " (trailing data)"));
    array.data.assign(bytes.begin() + std::ptrdiff_t(header), bytes.end());
    return array;
}

std::shared_ptr<InMemoryDataset> load_fashion_mnist(const std::string& dir, Split split) {
    const std::string prefix = split == Split::Train ? "train" : "t10k";
    const auto locate = [&](const std::string& stem) {
        const fs::path plain = fs::path(dir) / stem;
        const fs::path gz = fs::path(dir) / (stem + ".gz");
        if (fs::exists(gz)) return gz.string();
        if (fs::exists(plain)) return plain.string();
        fail(gz.string(), ": no such file (nor ", plain.string(),
             "); Debian's package dataset-fashion-mnist installs them in ", kDebianFashionMnistDir);
    };
    const std::string images_path = locate(prefix + "-images-idx3-ubyte");
    const std::string labels_path = locate(prefix + "-labels-idx1-ubyte");
    IdxArray images = read_idx_file(images_path, 3);
    IdxArray labels = read_idx_file(labels_path, 1);
    LINVIS_CHECK(images.dims[0] == labels.dims[0], images_path, ": ", images.dims[0], " images but ", labels_path,
                 " has ", labels.dims[0], " labels");
    LINVIS_CHECK(images.dims[1] > 0 && images.dims[2] > 0, images_path, ": empty images ", shape_string(images.dims));
    std::vector<int64_t> label_values(labels.data.begin(), labels.data.end());
    for (size_t i = 0; i < label_values.size(); ++i)
        LINVIS_CHECK(label_values[i] < 10, labels_path, ": label ", label_values[i], " at position ", i,
                     " is not a class 0..9");
    const int64_t n = images.dims[0];
    auto image_tensor =
        torch::from_blob(images.data.data(), {n, images.dims[1], images.dims[2], 1}, torch::kUInt8).clone();
    auto label_tensor = torch::tensor(label_values, torch::kInt64);
    std::vector<std::string> names = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                      "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
    return std::make_shared<InMemoryDataset>(std::string("fashion-mnist-") + split_name(split), image_tensor,
                                             label_tensor, std::move(names));
}

// ---------------------------------------------------------------- CIFAR

void read_cifar_file(const std::string& path, int label_bytes, int num_classes, std::vector<uint8_t>& images,
                     std::vector<int64_t>& labels) {
    constexpr size_t kPixels = 32 * 32;
    const size_t record = size_t(label_bytes) + 3 * kPixels;
    const std::vector<uint8_t> bytes = read_whole_file(path);
    LINVIS_CHECK(!bytes.empty() && bytes.size() % record == 0, path, ": CIFAR file of ", bytes.size(),
                 " bytes is not a whole number of ", record, "-byte records (", label_bytes,
                 " label byte(s) + 3072 pixels)");
    const size_t count = bytes.size() / record;
    images.reserve(images.size() + count * 3 * kPixels);
    for (size_t r = 0; r < count; ++r) {
        const uint8_t* rec = bytes.data() + r * record;
        const int64_t label = rec[label_bytes - 1];
        LINVIS_CHECK(label < num_classes, path, ": record ", r, " has label ", label, ", expected 0..",
                     num_classes - 1);
        labels.push_back(label);
        const uint8_t* planes = rec + label_bytes;
        for (size_t p = 0; p < kPixels; ++p)
            for (size_t c = 0; c < 3; ++c) images.push_back(planes[c * kPixels + p]);
    }
}

std::shared_ptr<InMemoryDataset> load_cifar10(const std::string& dir, Split split) {
    std::vector<std::string> files;
    if (split == Split::Train) {
        for (int i = 1; i <= 5; ++i) files.push_back((fs::path(dir) / ("data_batch_" + std::to_string(i) + ".bin")).string());
    } else {
        files.push_back((fs::path(dir) / "test_batch.bin").string());
    }
    std::vector<std::string> names = {"airplane", "automobile", "bird", "cat", "deer",
                                      "dog",      "frog",       "horse", "ship", "truck"};
    const std::string meta = (fs::path(dir) / "batches.meta.txt").string();
    if (fs::exists(meta)) {
        auto listed = read_name_lines(meta);
        LINVIS_CHECK(listed.size() == 10, meta, ": expected 10 class names, found ", listed.size());
        names = std::move(listed);
    }
    return make_cifar(std::string("cifar10-") + split_name(split), files, 1, std::move(names));
}

std::shared_ptr<InMemoryDataset> load_cifar100(const std::string& dir, Split split) {
    const std::string file = (fs::path(dir) / (split == Split::Train ? "train.bin" : "test.bin")).string();
    std::vector<std::string> names;
    const std::string meta = (fs::path(dir) / "fine_label_names.txt").string();
    if (fs::exists(meta)) {
        names = read_name_lines(meta);
        LINVIS_CHECK(names.size() == 100, meta, ": expected 100 class names, found ", names.size());
    } else {
        for (int i = 0; i < 100; ++i) names.push_back(std::to_string(i));
    }
    return make_cifar(std::string("cifar100-") + split_name(split), {file}, 2, std::move(names));
}

// ---------------------------------------------------------------- ImageFolder

ImageFolder::ImageFolder(const std::string& root, int64_t max_pixels) : root_(root), max_pixels_(max_pixels) {
    io::check_pixel_limit(max_pixels, root);
    std::error_code ec;
    LINVIS_CHECK(fs::is_directory(root, ec), root, ": not a directory (ImageFolder expects DIR/<class>/<images>)");
    try {
        for (const auto& entry : fs::directory_iterator(root))
            if (entry.is_directory()) class_names_.push_back(entry.path().filename().string());
        std::sort(class_names_.begin(), class_names_.end());
        LINVIS_CHECK(!class_names_.empty(), root,
                     ": no class sub-directories (ImageFolder expects DIR/<class>/<images>)");
        for (size_t label = 0; label < class_names_.size(); ++label) {
            const fs::path class_dir = fs::path(root) / class_names_[label];
            std::vector<std::string> files;
            // Symbolic links to directories are followed, but each directory (device, inode) is
            // entered once and the root never, so a link loop (a/x -> ..) cannot make the scan
            // recurse or blow up.
            std::set<std::pair<uint64_t, uint64_t>> entered;
            auto first_visit = [&entered](const fs::path& dir) {
                struct stat st;
                if (::stat(dir.c_str(), &st) != 0) return false;
                return entered.insert({uint64_t(st.st_dev), uint64_t(st.st_ino)}).second;
            };
            first_visit(root);  // a link back up to the root would list every class again
            first_visit(class_dir);
            for (auto it = fs::recursive_directory_iterator(class_dir, fs::directory_options::follow_directory_symlink);
                 it != fs::recursive_directory_iterator(); ++it) {
                const auto& entry = *it;
                if (entry.is_directory(ec)) {
                    if (!first_visit(entry.path())) it.disable_recursion_pending();
                } else if (entry.is_regular_file(ec) && has_image_extension(entry.path())) {
                    files.push_back(entry.path().string());
                }
            }
            std::sort(files.begin(), files.end());
            LINVIS_CHECK(!files.empty(), class_dir.string(), ": class '", class_names_[label],
                         "' has no .jpg/.jpeg/.png/.bmp file");
            for (auto& file : files) samples_.emplace_back(std::move(file), int64_t(label));
        }
    } catch (const fs::filesystem_error& e) {
        fail(root, ": cannot scan the image folder: ", e.what());
    }
}

Example ImageFolder::get_raw(int64_t index) const {
    check_index(index);
    const int64_t n = size();
    for (int64_t step = 0; step < n; ++step) {
        const int64_t candidate = (index + step) % n;
        {
            std::lock_guard<std::mutex> lock(skipped_mutex_);
            if (skipped_.count(candidate)) continue;
        }
        const auto& [path, label] = samples_[size_t(candidate)];
        try {
            return {io::read_image(path, max_pixels_), label, candidate};
        } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(skipped_mutex_);
            if (skipped_.insert(candidate).second)
                std::cerr << "warning: " << name() << ": skipping unreadable image: " << e.what() << "\n";
        }
    }
    fail(name(), ": none of the ", n, " image files can be read");
}

int64_t ImageFolder::skipped_count() const {
    std::lock_guard<std::mutex> lock(skipped_mutex_);
    return int64_t(skipped_.size());
}

std::vector<std::string> ImageFolder::skipped_files() const {
    std::lock_guard<std::mutex> lock(skipped_mutex_);
    std::vector<std::string> files;
    for (int64_t index : skipped_) files.push_back(samples_[size_t(index)].first);
    return files;
}

// ---------------------------------------------------------------- DataLoader

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options)
    : dataset_(std::move(dataset)), options_(options) {
    LINVIS_CHECK(dataset_ != nullptr, "DataLoader: no dataset");
    LINVIS_CHECK(dataset_->size() > 0, "DataLoader: dataset ", dataset_->name(), " is empty");
    LINVIS_CHECK(options_.batch_size > 0, "DataLoader: batch_size must be positive, got ", options_.batch_size);
    LINVIS_CHECK(options_.num_workers >= 0, "DataLoader: num_workers must be >= 0, got ", options_.num_workers);
    LINVIS_CHECK(options_.prefetch_batches >= 1, "DataLoader: prefetch_batches must be >= 1, got ",
                 options_.prefetch_batches);
    for (int i = 0; i < options_.num_workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

DataLoader::~DataLoader() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    work_ready_.notify_all();
    for (auto& worker : workers_) worker.join();
}

void DataLoader::set_shard(int64_t rank, int64_t num_shards, bool pad, int64_t batch_size) {
    LINVIS_CHECK(num_shards >= 1 && rank >= 0 && rank < num_shards, "DataLoader: shard ", rank, " is not in [0, ",
                 num_shards, ")");
    LINVIS_CHECK(batch_size > 0, "DataLoader: batch_size must be positive, got ", batch_size);
    std::lock_guard<std::mutex> lock(mutex_);
    options_.shard_rank = rank;
    options_.num_shards = num_shards;
    options_.pad_shards = pad;
    options_.batch_size = batch_size;
}

int64_t DataLoader::batches_per_epoch() const {
    const int64_t n = options_.num_shards > 1
                          ? shard_length(dataset_->size(), options_.shard_rank, options_.num_shards, options_.pad_shards)
                          : dataset_->size();
    const int64_t b = options_.batch_size;
    return options_.drop_last ? n / b : (n + b - 1) / b;
}

std::vector<int64_t> DataLoader::epoch_order(int64_t epoch) const {
    std::vector<int64_t> order(size_t(dataset_->size()));
    std::iota(order.begin(), order.end(), int64_t(0));
    if (options_.shuffle) {
        std::mt19937_64 rng(splitmix64(splitmix64(options_.seed) + uint64_t(epoch)));
        for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[uniform_below(rng, i)]);
    }
    if (options_.num_shards > 1) order = shard_order(order, options_.shard_rank, options_.num_shards, options_.pad_shards);
    return order;
}

void DataLoader::start_epoch(int64_t epoch) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        ++generation_;
        epoch_ = epoch;
        order_ = epoch_order(epoch);
        num_batches_ = batches_per_epoch();
        next_to_claim_ = 0;
        next_to_deliver_ = 0;
        ready_.clear();
    }
    work_ready_.notify_all();
}

std::vector<int64_t> DataLoader::batch_indices(int64_t batch) const {
    const int64_t begin = batch * options_.batch_size;
    const int64_t end = std::min<int64_t>(begin + options_.batch_size, int64_t(order_.size()));
    return std::vector<int64_t>(order_.begin() + begin, order_.begin() + end);
}

Batch DataLoader::build_batch(const std::vector<int64_t>& indices, int64_t epoch) const {
    std::vector<torch::Tensor> images;
    std::vector<int64_t> labels, used;
    images.reserve(indices.size());
    for (int64_t index : indices) {
        Example example = dataset_->get(index, sample_seed(options_.seed, epoch, index));
        if (!images.empty())
            LINVIS_CHECK(example.image.sizes() == images.front().sizes() &&
                             example.image.scalar_type() == images.front().scalar_type(),
                         "DataLoader: ", dataset_->name(), ": sample ", index, " is ", example.image.scalar_type(), " ",
                         shape_string(example.image.sizes()), " but sample ", indices.front(), " is ",
                         images.front().scalar_type(), " ", shape_string(images.front().sizes()),
                         "; a batch needs one shape (add a resize/crop transform)");
        images.push_back(std::move(example.image));
        labels.push_back(example.label);
        used.push_back(example.index);
    }
    return {torch::stack(images), torch::tensor(labels, torch::kInt64), torch::tensor(used, torch::kInt64)};
}

void DataLoader::worker_loop() {
    torch::NoGradGuard no_grad;
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
        work_ready_.wait(lock, [&] {
            return stop_ || (next_to_claim_ < num_batches_ && next_to_claim_ < next_to_deliver_ + options_.prefetch_batches);
        });
        if (stop_) return;
        const int64_t batch = next_to_claim_++;
        const uint64_t generation = generation_;
        const int64_t epoch = epoch_;
        const std::vector<int64_t> indices = batch_indices(batch);
        lock.unlock();
        Slot slot;
        try {
            slot.batch = build_batch(indices, epoch);
        } catch (...) {
            slot.error = std::current_exception();
        }
        lock.lock();
        if (generation == generation_) {
            ready_[batch] = std::move(slot);
            batch_ready_.notify_all();
        }
    }
}

std::optional<Batch> DataLoader::next() {
    std::unique_lock<std::mutex> lock(mutex_);
    LINVIS_CHECK(epoch_ >= 0, "DataLoader: call start_epoch before next");
    if (next_to_deliver_ >= num_batches_) return std::nullopt;
    if (workers_.empty()) {
        const int64_t batch = next_to_deliver_++;
        const auto indices = batch_indices(batch);
        const int64_t epoch = epoch_;
        lock.unlock();
        torch::NoGradGuard no_grad;
        return build_batch(indices, epoch);
    }
    batch_ready_.wait(lock, [&] { return ready_.count(next_to_deliver_) > 0; });
    auto node = ready_.extract(next_to_deliver_);
    ++next_to_deliver_;
    lock.unlock();
    work_ready_.notify_all();
    if (node.mapped().error) std::rethrow_exception(node.mapped().error);
    return std::move(node.mapped().batch);
}

}  // namespace linvis::train
