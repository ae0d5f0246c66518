// Datasets (IDX / Fashion-MNIST, CIFAR binary, ImageFolder) and the DataLoader.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <numeric>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/io/gzip.h"
#include "linvis/io/image.h"
#include "linvis/io/transforms.h"
#include "linvis/train/data_sources.h"
#include "linvis/train/datasets.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using linvis::Error;
using namespace linvis::train;

using linvis::testing::TempDir;
using linvis::testing::expect_error_containing;
using linvis::testing::write_bytes;

namespace {




// An IDX file's bytes: magic 0 0 8 ndims, big-endian dims, values.
std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& values) {
    std::vector<uint8_t> out = {0, 0, 0x08, uint8_t(dims.size())};
    for (uint32_t d : dims)
        for (int shift : {24, 16, 8, 0}) out.push_back(uint8_t(d >> shift));
    out.insert(out.end(), values.begin(), values.end());
    return out;
}

// A small Fashion-MNIST-like directory: n images of 28x28 where image i is filled with i, label i % 10.
void write_fake_mnist(const std::string& dir, const std::string& prefix, uint32_t n, uint32_t n_labels) {
    std::vector<uint8_t> pixels, labels;
    for (uint32_t i = 0; i < n; ++i) pixels.insert(pixels.end(), 28 * 28, uint8_t(i));
    for (uint32_t i = 0; i < n_labels; ++i) labels.push_back(uint8_t(i % 10));
    linvis::io::write_gzip_file(dir + "/" + prefix + "-images-idx3-ubyte.gz", idx_bytes({n, 28, 28}, pixels));
    linvis::io::write_gzip_file(dir + "/" + prefix + "-labels-idx1-ubyte.gz", idx_bytes({n_labels}, labels));
}

// CIFAR record: label bytes then R, G, B planes; pixel (y, x) of channel c holds (r * 7 + c * 50 + y + x) % 256.
std::vector<uint8_t> cifar_records(const std::vector<std::vector<uint8_t>>& labels) {
    std::vector<uint8_t> out;
    for (size_t r = 0; r < labels.size(); ++r) {
        out.insert(out.end(), labels[r].begin(), labels[r].end());
        for (int c = 0; c < 3; ++c)
            for (int y = 0; y < 32; ++y)
                for (int x = 0; x < 32; ++x) out.push_back(uint8_t((r * 7 + c * 50 + y + x) % 256));
    }
    return out;
}

// N tiny images whose pixels all hold the index (mod 256), labels index % 5.
std::shared_ptr<InMemoryDataset> index_dataset(int64_t n) {
    auto images = (torch::arange(n, torch::kInt64) % 256).to(torch::kUInt8).view({n, 1, 1, 1}).expand({n, 2, 3, 1}).contiguous();
    return std::make_shared<InMemoryDataset>("index", images, torch::arange(n, torch::kInt64) % 5,
                                             std::vector<std::string>{"a", "b", "c", "d", "e"});
}

// Indices of every batch of one epoch.
std::vector<std::vector<int64_t>> epoch_batches(DataLoader& loader, int64_t epoch) {
    loader.start_epoch(epoch);
    std::vector<std::vector<int64_t>> batches;
    while (auto batch = loader.next()) {
        auto idx = batch->indices.contiguous();
        batches.emplace_back(idx.data_ptr<int64_t>(), idx.data_ptr<int64_t>() + idx.numel());
    }
    return batches;
}

}  // namespace

// ------------------------------------------------------------------ IDX / Fashion-MNIST

TEST(Datasets, IdxRoundTripsThroughGzipAndPlain) {
    TempDir dir;
    std::vector<uint8_t> values(2 * 3 * 4);
    for (size_t i = 0; i < values.size(); ++i) values[i] = uint8_t(i * 11);
    const auto bytes = idx_bytes({2, 3, 4}, values);
    linvis::io::write_gzip_file(dir.file("a.gz"), bytes);
    write_bytes(dir.file("a.raw"), bytes);
    EXPECT_LT(fs::file_size(dir.file("a.gz")), bytes.size() + 40);
    EXPECT_NE(fs::file_size(dir.file("a.gz")), bytes.size());  // really compressed format
    for (const char* name : {"a.gz", "a.raw"}) {
        const auto array = read_idx_file(dir.file(name), 3);
        EXPECT_EQ(array.dims, (std::vector<int64_t>{2, 3, 4})) << name;
        EXPECT_EQ(array.data, values) << name;
    }
}

TEST(Datasets, IdxErrorsNameTheFile) {
    TempDir dir;
    auto bad_magic = idx_bytes({4}, {1, 2, 3, 4});
    bad_magic[2] = 0x0d;  // float type
    linvis::io::write_gzip_file(dir.file("magic.gz"), bad_magic);
    expect_error_containing([&] { read_idx_file(dir.file("magic.gz"), 1); }, {dir.file("magic.gz"), "magic"});

    linvis::io::write_gzip_file(dir.file("ndims.gz"), idx_bytes({4}, {1, 2, 3, 4}));
    expect_error_containing([&] { read_idx_file(dir.file("ndims.gz"), 3); }, {dir.file("ndims.gz"), "dimensions"});

    linvis::io::write_gzip_file(dir.file("short.gz"), idx_bytes({5, 2, 2}, std::vector<uint8_t>(10, 1)));
    expect_error_containing([&] { read_idx_file(dir.file("short.gz"), 3); }, {dir.file("short.gz"), "truncated"});

    linvis::io::write_gzip_file(dir.file("long.gz"), idx_bytes({2}, {1, 2, 3}));
    expect_error_containing([&] { read_idx_file(dir.file("long.gz"), 1); }, {dir.file("long.gz"), "trailing"});

    // A gzip stream cut in the middle.
    std::vector<uint8_t> big(5000);
    for (size_t i = 0; i < big.size(); ++i) big[i] = uint8_t((i * 2654435761u) >> 13);
    linvis::io::write_gzip_file(dir.file("whole.gz"), idx_bytes({5000}, big));
    std::ifstream in(dir.file("whole.gz"), std::ios::binary);
    std::vector<uint8_t> gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    write_bytes(dir.file("cut.gz"), std::vector<uint8_t>(gz.begin(), gz.begin() + gz.size() / 2));
    expect_error_containing([&] { read_idx_file(dir.file("cut.gz"), 1); }, {dir.file("cut.gz")});
    EXPECT_EQ(read_idx_file(dir.file("whole.gz"), 1).data, big);

    expect_error_containing([&] { read_idx_file(dir.file("none.gz"), 1); }, {dir.file("none.gz"), "no such file"});
}

TEST(Datasets, FashionMnistLayoutFromGeneratedFiles) {
    TempDir dir;
    write_fake_mnist(dir.path.string(), "t10k", 12, 12);
    const auto data = load_fashion_mnist(dir.path.string(), Split::Test);
    ASSERT_EQ(data->size(), 12);
    EXPECT_EQ(data->num_classes(), 10);
    EXPECT_EQ(data->class_names()[9], "Ankle boot");
    const auto raw = data->get_raw(11);
    EXPECT_EQ(raw.image.sizes(), (std::vector<int64_t>{28, 28, 1}));
    EXPECT_EQ(raw.image.max().item<int>(), 11);
    EXPECT_EQ(raw.label, 1);
    const auto example = data->get(7);  // default transform: float (1, 28, 28) in [0, 1]
    EXPECT_EQ(example.image.sizes(), (std::vector<int64_t>{1, 28, 28}));
    EXPECT_FLOAT_EQ(example.image[0][5][5].item<float>(), 7.0f / 255.0f);
    EXPECT_THROW(data->get_raw(12), Error);
    // The train split is missing: the message names the file and the package.
    expect_error_containing([&] { load_fashion_mnist(dir.path.string(), Split::Train); },
                            {"train-images-idx3-ubyte.gz", "dataset-fashion-mnist"});
    // Count mismatch between images and labels.
    write_fake_mnist(dir.path.string(), "train", 12, 11);
    expect_error_containing([&] { load_fashion_mnist(dir.path.string(), Split::Train); }, {"12 images", "11 labels"});
}

TEST(Datasets, RealFashionMnistTestSplit) {
    const std::string file = std::string(kDebianFashionMnistDir) + "/t10k-images-idx3-ubyte.gz";
    if (!fs::exists(file)) GTEST_SKIP() << file << " absent (apt-get install dataset-fashion-mnist)";
    const auto data = load_fashion_mnist(kDebianFashionMnistDir, Split::Test);
    ASSERT_EQ(data->size(), 10000);
    EXPECT_EQ(data->images().sizes(), (std::vector<int64_t>{10000, 28, 28, 1}));
    const auto histogram = torch::bincount(data->labels());
    ASSERT_EQ(histogram.numel(), 10);
    for (int c = 0; c < 10; ++c) EXPECT_EQ(histogram[c].item<int64_t>(), 1000) << "class " << c;
    // Real pictures: dark background, bright objects.
    const double mean = data->images().to(torch::kFloat64).mean().item<double>() / 255.0;
    EXPECT_GT(mean, 0.2);
    EXPECT_LT(mean, 0.4);
}

// ------------------------------------------------------------------ CIFAR

TEST(Datasets, Cifar10BinaryLayout) {
    TempDir dir;
    for (int b = 1; b <= 5; ++b) write_bytes(dir.file("data_batch_" + std::to_string(b) + ".bin"), cifar_records({{uint8_t(b)}, {9}}));
    write_bytes(dir.file("test_batch.bin"), cifar_records({{3}, {0}, {7}}));
    const auto train = load_cifar10(dir.path.string(), Split::Train);
    ASSERT_EQ(train->size(), 10);
    EXPECT_EQ(train->labels()[4].item<int64_t>(), 3);  // batch 3, first record
    const auto test = load_cifar10(dir.path.string(), Split::Test);
    ASSERT_EQ(test->size(), 3);
    EXPECT_EQ(test->class_names()[3], "cat");
    const auto raw = test->get_raw(2);
    ASSERT_EQ(raw.image.sizes(), (std::vector<int64_t>{32, 32, 3}));
    EXPECT_EQ(raw.label, 7);
    // Planar R, G, B in the file -> (y, x, c) here.
    for (auto [y, x, c] : std::vector<std::array<int, 3>>{{0, 0, 0}, {5, 9, 1}, {31, 30, 2}})
        EXPECT_EQ(raw.image[y][x][c].item<int>(), (2 * 7 + c * 50 + y + x) % 256) << y << "," << x << "," << c;

    // Class names from batches.meta.txt.
    std::ofstream(dir.file("batches.meta.txt")) << "a\nb\nc\nd\ne\nf\ng\nh\ni\nj\n\n";
    EXPECT_EQ(load_cifar10(dir.path.string(), Split::Test)->class_names()[9], "j");
    fs::remove(dir.file("batches.meta.txt"));

    // Wrong size, bad label, missing file.
    auto records = cifar_records({{1}});
    records.pop_back();
    write_bytes(dir.file("test_batch.bin"), records);
    expect_error_containing([&] { load_cifar10(dir.path.string(), Split::Test); }, {dir.file("test_batch.bin"), "3073-byte records"});
    write_bytes(dir.file("test_batch.bin"), cifar_records({{1}, {10}}));
    expect_error_containing([&] { load_cifar10(dir.path.string(), Split::Test); }, {dir.file("test_batch.bin"), "label 10"});
    fs::remove(dir.file("data_batch_4.bin"));
    expect_error_containing([&] { load_cifar10(dir.path.string(), Split::Train); }, {dir.file("data_batch_4.bin"), "no such file"});
}

TEST(Datasets, Cifar100UsesFineLabels) {
    TempDir dir;
    write_bytes(dir.file("train.bin"), cifar_records({{3, 42}, {19, 99}, {0, 0}}));
    const auto data = load_cifar100(dir.path.string(), Split::Train);
    ASSERT_EQ(data->size(), 3);
    EXPECT_EQ(data->num_classes(), 100);
    EXPECT_EQ(data->labels()[0].item<int64_t>(), 42);
    EXPECT_EQ(data->labels()[1].item<int64_t>(), 99);
    EXPECT_EQ(data->get_raw(1).image[0][0][0].item<int>(), 7);
    write_bytes(dir.file("test.bin"), cifar_records({{3, 100}}));
    expect_error_containing([&] { load_cifar100(dir.path.string(), Split::Test); }, {dir.file("test.bin"), "label 100"});
    // A CIFAR-10 file (3073-byte records) is not a CIFAR-100 file (3074).
    write_bytes(dir.file("test.bin"), cifar_records({{3}, {4}}));
    expect_error_containing([&] { load_cifar100(dir.path.string(), Split::Test); }, {dir.file("test.bin"), "3074-byte"});
}

// ------------------------------------------------------------------ ImageFolder

// Symbolic links are followed, but a loop (found by fuzz_image_folder's seeds) neither recurses
// until ELOOP (a std::filesystem_error escaped) nor multiplies the samples: each directory is
// entered once, the root never.
TEST(Datasets, ImageFolderSymlinkLoopsAreEnteredOnce) {
    TempDir dir;
    fs::create_directories(dir.file("a"));
    fs::create_directories(dir.file("b/deep"));
    linvis::io::write_image(dir.file("a/one.png"), linvis::io::demo_image(8, 8));
    linvis::io::write_image(dir.file("b/two.png"), linvis::io::demo_image(8, 8));
    fs::create_directory_symlink("..", dir.file("a/up"));
    fs::create_directory_symlink(".", dir.file("a/self"));
    fs::create_directory_symlink(".", dir.file("a/self2"));
    fs::create_directory_symlink("../..", dir.file("b/deep/root"));
    fs::create_directory_symlink("../b", dir.file("a/other"));  // another class's files, reached once
    ImageFolder folder(dir.path.string());
    EXPECT_EQ(folder.class_names(), (std::vector<std::string>{"a", "b"}));
    std::vector<std::pair<std::string, int64_t>> want = {
        {dir.file("a/one.png"), 0}, {dir.file("a/other/two.png"), 0}, {dir.file("b/two.png"), 1}};
    EXPECT_EQ(folder.samples(), want);
}

TEST(Datasets, ImageFolderSortsClassesAndSkipsCorruptImages) {
    TempDir dir;
    fs::create_directories(dir.file("zebra"));
    fs::create_directories(dir.file("cat/nested"));
    linvis::io::write_image(dir.file("zebra/b.png"), linvis::io::demo_image(20, 30));
    linvis::io::write_image(dir.file("zebra/a.bmp"), linvis::io::demo_image(25, 20));
    linvis::io::write_image(dir.file("cat/x.JPG"), linvis::io::demo_image(16, 16));
    linvis::io::write_image(dir.file("cat/nested/y.png"), linvis::io::demo_image(16, 24));
    write_bytes(dir.file("zebra/broken.jpg"), {0xff, 0xd8, 0xff, 0xe0, 0x00, 0x10, 'J'});  // truncated
    write_bytes(dir.file("zebra/notes.txt"), {'h', 'i'});                                  // not an image: not listed

    ImageFolder folder(dir.path.string());
    EXPECT_EQ(folder.class_names(), (std::vector<std::string>{"cat", "zebra"}));
    ASSERT_EQ(folder.size(), 5);
    EXPECT_EQ(folder.samples()[0], (std::pair<std::string, int64_t>{dir.file("cat/nested/y.png"), 0}));
    EXPECT_EQ(folder.samples()[3], (std::pair<std::string, int64_t>{dir.file("zebra/b.png"), 1}));
    EXPECT_EQ(folder.samples()[4].first, dir.file("zebra/broken.jpg"));  // sorted: a.bmp, b.png, broken.jpg

    const auto good = folder.get_raw(3);
    EXPECT_EQ(good.image.sizes(), (std::vector<int64_t>{20, 30, 3}));
    EXPECT_EQ(good.label, 1);
    EXPECT_EQ(folder.skipped_count(), 0);

    // The broken file is replaced by the next readable one (wrapping to index 0), and counted once.
    const auto replaced = folder.get_raw(4);
    EXPECT_EQ(replaced.index, 0);
    EXPECT_EQ(replaced.label, 0);
    EXPECT_EQ(folder.skipped_count(), 1);
    EXPECT_EQ(folder.skipped_files(), (std::vector<std::string>{dir.file("zebra/broken.jpg")}));
    folder.get_raw(4);
    EXPECT_EQ(folder.skipped_count(), 1);

    // A whole epoch through the loader with the skipping dataset: no failure.
    auto shared = std::make_shared<ImageFolder>(dir.path.string());
    shared->set_transform([](const torch::Tensor& image, std::mt19937_64&) {
        return linvis::io::resize(image.permute({2, 0, 1}), 8, 8).to(torch::kFloat32).div(255.0);
    });
    DataLoader loader(shared, {2, true, false, 2, 2, 5});
    int64_t seen = 0;
    loader.start_epoch(0);
    while (auto batch = loader.next()) {
        EXPECT_EQ(batch->images.size(1), 3);
        seen += batch->images.size(0);
    }
    EXPECT_EQ(seen, 5);
    EXPECT_EQ(shared->skipped_count(), 1);
}

// A file over the folder's pixel limit is skipped like an unreadable one, before it is decoded.
TEST(Datasets, ImageFolderSkipsImagesOverItsPixelLimit) {
    TempDir dir;
    fs::create_directories(dir.file("cat"));
    linvis::io::write_image(dir.file("cat/a_small.png"), linvis::io::demo_image(16, 16));
    linvis::io::write_image(dir.file("cat/b_large.png"), linvis::io::demo_image(30, 40));
    ImageFolder folder(dir.path.string(), 16 * 16);
    EXPECT_EQ(folder.get_raw(1).index, 0);
    EXPECT_EQ(folder.skipped_files(), (std::vector<std::string>{dir.file("cat/b_large.png")}));
    EXPECT_EQ(ImageFolder(dir.path.string(), 30 * 40).get_raw(1).image.sizes(), (std::vector<int64_t>{30, 40, 3}));
    expect_error_containing([&] { ImageFolder bad(dir.path.string(), 0); },
                            {dir.path.string(), "pixel limit must be 1..268435456, got 0"});
}

TEST(Datasets, ImageFolderRejectsBadLayouts) {
    TempDir dir;
    expect_error_containing([&] { ImageFolder folder(dir.file("missing")); }, {dir.file("missing"), "not a directory"});
    expect_error_containing([&] { ImageFolder folder(dir.path.string()); }, {dir.path.string(), "no class"});
    fs::create_directories(dir.file("empty_class"));
    expect_error_containing([&] { ImageFolder folder(dir.path.string()); }, {"empty_class", "no .jpg"});
    // Every file unreadable: get_raw fails with a clear message instead of looping.
    write_bytes(dir.file("empty_class/a.png"), {1, 2, 3});
    ImageFolder folder(dir.path.string());
    expect_error_containing([&] { folder.get_raw(0); }, {"none of the 1 image files"});
}

// ------------------------------------------------------------------ DataLoader

TEST(DataLoader, EveryIndexOncePerEpochInFullBatches) {
    auto data = index_dataset(103);
    DataLoaderOptions options;
    options.batch_size = 10;
    options.num_workers = 3;
    options.seed = 7;
    DataLoader loader(data, options);
    EXPECT_EQ(loader.batches_per_epoch(), 11);
    loader.start_epoch(0);
    std::vector<int64_t> all;
    int64_t batches = 0;
    while (auto batch = loader.next()) {
        ++batches;
        const int64_t b = batch->images.size(0);
        EXPECT_EQ(batch->images.sizes(), (std::vector<int64_t>{b, 1, 2, 3}));
        EXPECT_EQ(batch->images.scalar_type(), torch::kFloat32);
        EXPECT_EQ(batch->labels.scalar_type(), torch::kInt64);
        EXPECT_EQ(b, batches <= 10 ? 10 : 3);
        // Images, labels and indices belong together.
        EXPECT_TRUE(torch::equal(batch->labels, batch->indices % 5));
        EXPECT_TRUE(torch::allclose(batch->images.amax({1, 2, 3}), batch->indices.to(torch::kFloat32) / 255.0));
        auto idx = batch->indices.contiguous();
        all.insert(all.end(), idx.data_ptr<int64_t>(), idx.data_ptr<int64_t>() + idx.numel());
    }
    EXPECT_EQ(batches, 11);
    std::vector<int64_t> sorted = all;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> expected(103);
    std::iota(expected.begin(), expected.end(), 0);
    EXPECT_EQ(sorted, expected);
    EXPECT_NE(all, expected);  // shuffled
    EXPECT_FALSE(loader.next().has_value());

    // drop_last: 10 full batches of distinct indices.
    options.drop_last = true;
    DataLoader dropping(data, options);
    const auto kept = epoch_batches(dropping, 0);
    ASSERT_EQ(kept.size(), 10u);
    std::set<int64_t> distinct;
    for (const auto& b : kept) {
        EXPECT_EQ(b.size(), 10u);
        distinct.insert(b.begin(), b.end());
    }
    EXPECT_EQ(distinct.size(), 100u);
}

TEST(DataLoader, OrderDependsOnlyOnSeedAndEpoch) {
    auto data = index_dataset(50);
    DataLoaderOptions options;
    options.batch_size = 8;
    options.num_workers = 2;
    options.seed = 11;
    DataLoader a(data, options), b(data, options);
    const auto a0 = epoch_batches(a, 0), a1 = epoch_batches(a, 1);
    EXPECT_EQ(a0, epoch_batches(b, 0));
    EXPECT_NE(a0, a1);
    EXPECT_EQ(a1, epoch_batches(b, 1));
    options.seed = 12;
    DataLoader c(data, options);
    EXPECT_NE(a0, epoch_batches(c, 0));
    options.shuffle = false;
    DataLoader plain(data, options);
    EXPECT_EQ(plain.epoch_order(3), [] {
        std::vector<int64_t> v(50);
        std::iota(v.begin(), v.end(), 0);
        return v;
    }());
}

TEST(DataLoader, RandomTransformsReproducibleAcrossWorkerCounts) {
    auto data = index_dataset(37);
    data->set_transform([](const torch::Tensor& image, std::mt19937_64& rng) {
        auto x = linvis::io::to_float_chw(image);
        return x + float(rng() % 1000) / 1000.0f;  // "augmentation" driven by the per-sample generator
    });
    std::vector<torch::Tensor> results;
    for (int workers : {0, 1, 4}) {
        DataLoaderOptions options;
        options.batch_size = 5;
        options.num_workers = workers;
        options.prefetch_batches = 2;
        options.seed = 3;
        DataLoader loader(data, options);
        loader.start_epoch(2);
        std::vector<torch::Tensor> images;
        while (auto batch = loader.next()) images.push_back(batch->images);
        results.push_back(torch::cat(images));
    }
    EXPECT_TRUE(torch::equal(results[0], results[1]));
    EXPECT_TRUE(torch::equal(results[0], results[2]));
    // The generator really varies per sample.
    EXPECT_GT(results[0].amax({1, 2, 3}).std().item<float>(), 0.1f);
}

namespace {
// Sample 4 has a different shape: collation must fail with a clear error.
class RaggedDataset : public Dataset {
public:
    int64_t size() const override { return 8; }
    int64_t num_classes() const override { return 2; }
    std::string name() const override { return "ragged"; }
    const std::vector<std::string>& class_names() const override { return names_; }
    Example get_raw(int64_t index) const override {
        check_index(index);
        return {torch::zeros({index == 4 ? 5 : 4, 4, 1}, torch::kUInt8), index % 2, index};
    }

private:
    std::vector<std::string> names_ = {"a", "b"};
};
}  // namespace

TEST(DataLoader, WorkerErrorsReachTheCallerAndEpochsRestart) {
    DataLoaderOptions options;
    options.batch_size = 4;
    options.shuffle = false;
    options.num_workers = 2;
    DataLoader loader(std::make_shared<RaggedDataset>(), options);
    expect_error_containing([&] { loader.next(); }, {"start_epoch"});
    loader.start_epoch(0);
    auto first = loader.next();
    ASSERT_TRUE(first.has_value());
    EXPECT_EQ(first->images.sizes(), (std::vector<int64_t>{4, 1, 4, 4}));
    expect_error_containing([&] { loader.next(); }, {"ragged", "sample 5", "[1, 4, 4]", "sample 4", "[1, 5, 4]"});
    // A new epoch starts cleanly after a partial one.
    loader.start_epoch(1);
    EXPECT_TRUE(loader.next().has_value());
    EXPECT_THROW(DataLoader(std::make_shared<RaggedDataset>(), {0, true, false, 1, 1, 0}), Error);  // batch 0
}

// ------------------------------------------------------------------ --augment levels

TEST(DataSources, AugmentLevelsNoneFlipFull) {
    TempDir dir;
    for (int b = 1; b <= 5; ++b) {
        std::vector<std::vector<uint8_t>> labels;
        for (int r = 0; r < 8; ++r) labels.push_back({uint8_t((b + r) % 10)});
        write_bytes(dir.file("data_batch_" + std::to_string(b) + ".bin"), cifar_records(labels));
    }
    write_bytes(dir.file("test_batch.bin"), cifar_records({{3}, {0}}));
    // Every training image of epoch 0 at the given level, as (C, H, W) tensors.
    auto epoch_images = [&](DataConfig::Augment level) {
        DataConfig c;
        c.dataset = "cifar10";
        c.data_dir = dir.path.string();
        c.batch_size = 8;
        c.seed = 3;
        c.augment = level;
        DataSources sources = make_data_sources(c, true);
        sources.train->start_epoch(0);
        std::vector<torch::Tensor> out;
        torch::Tensor images, labels;
        while (sources.train->next(images, labels))
            for (int64_t i = 0; i < images.size(0); ++i) out.push_back(images[i].clone());
        return out;
    };
    const auto plain = epoch_images(DataConfig::Augment::None);
    ASSERT_EQ(plain.size(), 40u);
    auto count = [&](const std::vector<torch::Tensor>& images, bool mirrored) {
        int64_t n = 0;
        for (const auto& image : images) {
            const torch::Tensor probe = mirrored ? image.flip({2}) : image;
            for (const auto& p : plain)
                if (torch::equal(probe, p)) {
                    ++n;
                    break;
                }
        }
        return n;
    };
    EXPECT_EQ(count(plain, false), 40);
    EXPECT_EQ(count(plain, true), 0);  // the generated images are not mirror-symmetric
    // flip: every image is an original or its mirror image, and both occur (p(all same) = 2^-39).
    const auto flipped = epoch_images(DataConfig::Augment::Flip);
    const int64_t as_is = count(flipped, false), mirrored = count(flipped, true);
    EXPECT_EQ(as_is + mirrored, 40);
    EXPECT_GT(as_is, 0);
    EXPECT_GT(mirrored, 0);
    // full: random crops after 4-pixel padding move most images off the originals.
    const auto full = epoch_images(DataConfig::Augment::Full);
    EXPECT_LT(count(full, false) + count(full, true), 20);

    EXPECT_EQ(parse_augment("flip"), DataConfig::Augment::Flip);
    expect_error_containing([] { parse_augment("sideways"); }, {"--augment", "none, flip or full", "sideways"});
}
