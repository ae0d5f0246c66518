// Segmentation: metrics, the Fashion-MNIST scene generator, the ADE20K-style folder reader and its errors,
// augmentation, the model (UperNet / FPN on hierarchical and plain backbones), and a CLI train + eval + predict.
#include <cmath>
#include <filesystem>
#include <random>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/io/gzip.h"
#include "linvis/io/image.h"
#include "linvis/models/registry.h"
#include "linvis/models/segmentation.h"
#include "linvis/train/segmentation.h"
#include "support/cli.h"
#include "support/temp_dir.h"

namespace {

using namespace linvis;
using namespace linvis::train;
using linvis::testing::TempDir;
using linvis::testing::write_file;

std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const linvis::Error& e) {
        return e.what();
    }
    return "";
}

// ------------------------------------------------------------------ metrics

TEST(SegmentationMetrics, HandMadeMapsWithIgnoreAndAbsentClasses) {
    // 4 classes; class 3 never appears (absent -> NaN, not in the mean); 255 pixels not counted.
    SegmentationMetrics m(4);
    const auto target = torch::tensor({0, 0, 1, 1, 2, 2, 255, 255}, torch::kInt64).view({2, 4});
    const auto pred = torch::tensor({0, 1, 1, 1, 2, 0, 3, 0}, torch::kInt64).view({2, 4});
    m.update(pred, target);
    const auto iou = m.per_class_iou();
    // class 0: TP 1, FP 1 (pixel 5), FN 1 -> 1/3; class 1: TP 2, FP 1 -> 2/3; class 2: TP 1, FN 1 -> 1/2.
    EXPECT_NEAR(iou[0], 1.0 / 3, 1e-12);
    EXPECT_NEAR(iou[1], 2.0 / 3, 1e-12);
    EXPECT_NEAR(iou[2], 1.0 / 2, 1e-12);
    EXPECT_TRUE(std::isnan(iou[3]));  // predicted only on an ignored pixel: still absent
    EXPECT_NEAR(m.mean_iou(), (1.0 / 3 + 2.0 / 3 + 0.5) / 3, 1e-12);
    EXPECT_NEAR(m.pixel_accuracy(), 4.0 / 6, 1e-12);
    // Accumulates over updates: a perfect second map raises both.
    m.update(target.masked_fill(target == 255, 0), target.masked_fill(target == 255, 0));
    EXPECT_GT(m.pixel_accuracy(), 4.0 / 6);
    EXPECT_EQ(m.confusion().sum().item<int64_t>(), 6 + 8);
}

TEST(SegmentationMetrics, PerfectPredictionAndClassOutOfRange) {
    SegmentationMetrics m(3);
    const auto t = torch::tensor({0, 1, 2, 2}, torch::kInt64);
    m.update(t, t);
    EXPECT_DOUBLE_EQ(m.mean_iou(), 1.0);
    EXPECT_DOUBLE_EQ(m.pixel_accuracy(), 1.0);
    EXPECT_NE(error_of([&] { m.update(t, torch::tensor({0, 1, 2, 7}, torch::kInt64)); }).find("outside"),
              std::string::npos);
}

// ------------------------------------------------------------------ Fashion-MNIST scenes

// 30 fake items: item i is a 14x14 square of intensity 100 + 5 i in the middle of a 28x28 zero image, class i % 10.
std::shared_ptr<InMemoryDataset> fake_items() {
    auto images = torch::zeros({30, 28, 28, 1}, torch::kUInt8);
    auto labels = torch::empty({30}, torch::kInt64);
    for (int64_t i = 0; i < 30; ++i) {
        images[i].slice(0, 7, 21).slice(1, 7, 21).fill_(100 + 5 * i);
        labels[i] = i % 10;
    }
    std::vector<std::string> names;
    for (int i = 0; i < 10; ++i) names.push_back(std::to_string(i));
    return std::make_shared<InMemoryDataset>("fake", images, labels, names);
}

TEST(FashionScenes, DeterministicAndLabelsConsistentWithPixels) {
    auto items = fake_items();
    FashionScenes scenes(items, 128, 5, 7);
    const SegSample a = scenes.get(3), b = scenes.get(3), c = scenes.get(4);
    EXPECT_TRUE(torch::equal(a.image, b.image));
    EXPECT_TRUE(torch::equal(a.label, b.label));
    EXPECT_FALSE(torch::equal(a.image, c.image));
    FashionScenes other_seed(items, 128, 5, 8);
    EXPECT_FALSE(torch::equal(a.label, other_seed.get(3).label));
    ASSERT_EQ(a.image.sizes(), (std::vector<int64_t>{128, 128, 3}));
    ASSERT_EQ(a.label.sizes(), (std::vector<int64_t>{128, 128}));
    EXPECT_GE(a.label.min().item<int64_t>(), 0);
    EXPECT_LE(a.label.max().item<int64_t>(), 10);
    // Items are labelled 1..10 and drawn bright (tint >= 0.35 of >= 100), the background stays below 40 + 40 + 15.
    const auto fg = a.label > 0;
    EXPECT_GT(fg.sum().item<int64_t>(), 128 * 128 / 50);
    EXPECT_GT((a.label == 0).sum().item<int64_t>(), 0);
    const auto brightest = std::get<0>(a.image.to(torch::kInt32).max(2));
    EXPECT_LE(brightest.masked_select(~fg).max().item<int>(), 40 + 20 + 20 + 15);
    EXPECT_GE(brightest.masked_select(fg).min().item<int>(), int(0.35 * 100) - 1);
    // Each fake item is one class per square: every labelled pixel's class matches an item of that class, i.e.
    // its brightest channel is tint * (100 + 5 i) for some i with i % 10 == class - 1 (at most 1.0 * 245).
    EXPECT_LE(brightest.masked_select(fg).max().item<int>(), 245);
    // Larger canvases scale the items with the canvas: the foreground fraction stays comparable.
    FashionScenes big(items, 256, 5, 7);
    const double frac_small = fg.to(torch::kFloat64).mean().item<double>();
    const double frac_big = (big.get(3).label > 0).to(torch::kFloat64).mean().item<double>();
    EXPECT_GT(frac_big, 0.02);
    EXPECT_GT(frac_small, 0.02);
}

TEST(SegmentationAugment, ImageAndLabelMoveTogether) {
    // A label map equal to a function of the image: after scale/crop/flip it still is (nearest for labels).
    auto image = torch::zeros({64, 48, 3}, torch::kUInt8);
    auto label = torch::zeros({64, 48}, torch::kInt64);
    image.slice(0, 10, 40).slice(1, 5, 30).fill_(200);
    label.slice(0, 10, 40).slice(1, 5, 30).fill_(3);
    SegAugment a;
    a.scale = 64;
    a.crop = 32;
    for (int seed = 0; seed < 8; ++seed) {
        std::mt19937_64 rng(seed);
        const SegSample s = augment_sample({image, label}, a, rng);
        ASSERT_EQ(s.image.sizes(), (std::vector<int64_t>{32, 32, 3}));
        ASSERT_EQ(s.label.sizes(), (std::vector<int64_t>{32, 32}));
        // Label and picture agree except along the square's (bilinearly blurred) border.
        const auto valid = s.label != kIgnoreIndex;
        const auto disagree = ((s.label == 3) != (s.image.select(2, 0) > 110)) & valid;
        EXPECT_LE(disagree.sum().item<int64_t>(), 2 * 32 + 2 * 32) << "seed " << seed;
        const auto values = std::get<0>(at::_unique(s.label));
        for (int64_t i = 0; i < values.numel(); ++i) {
            const int64_t v = values[i].item<int64_t>();
            EXPECT_TRUE(v == 0 || v == 3 || v == kIgnoreIndex) << v;
        }
    }
}

// ------------------------------------------------------------------ folder

void write_pair(const TempDir& dir, const std::string& split, const std::string& stem, int64_t h, int64_t w,
                int64_t lh, int64_t lw, uint8_t max_class) {
    std::filesystem::create_directories(dir.path / "images" / split);
    std::filesystem::create_directories(dir.path / "annotations" / split);
    auto image = torch::randint(0, 255, {h, w, 3}, torch::kInt64).to(torch::kUInt8);
    auto label = (torch::arange(lh * lw) % (int64_t(max_class) + 1)).view({lh, lw}).to(torch::kUInt8);
    io::write_image((dir.path / "images" / split / (stem + ".png")).string(), image);
    io::write_image((dir.path / "annotations" / split / (stem + ".png")).string(), label);
}

TEST(SegmentationFolder, ReadsAdeLayoutWithReduceZeroLabel) {
    TempDir dir("seg");
    write_pair(dir, "training", "a", 9, 13, 9, 13, 4);
    write_pair(dir, "training", "b", 11, 7, 11, 7, 4);
    SegmentationFolder plain(dir.path.string(), "training", 5, false);
    ASSERT_EQ(plain.size(), 2);
    const SegSample s = plain.get(0);
    EXPECT_EQ(s.label.sizes(), (std::vector<int64_t>{9, 13}));
    EXPECT_EQ(s.label.max().item<int64_t>(), 4);
    SegmentationFolder reduced(dir.path.string(), "training", 4, true);
    const SegSample r = reduced.get(0);
    EXPECT_TRUE(torch::equal(r.label.masked_select(s.label == 0), torch::full({(s.label == 0).sum().item<int64_t>()}, kIgnoreIndex, torch::kInt64)));
    EXPECT_TRUE(torch::equal(r.label.masked_select(s.label > 0), s.label.masked_select(s.label > 0) - 1));
}

TEST(SegmentationFolder, OneLineErrorsNameTheFile) {
    TempDir dir("seg");
    write_pair(dir, "training", "size", 9, 13, 8, 13, 2);    // label map 13x8, image 13x9
    write_pair(dir, "training", "range", 9, 13, 9, 13, 7);   // class 7 with num_classes 5
    write_pair(dir, "training", "ok", 9, 13, 9, 13, 2);
    write_pair(dir, "training", "broken", 9, 13, 9, 13, 2);
    write_file((dir.path / "images" / "training" / "broken.png").string(), "not a png");
    write_pair(dir, "training", "zz", 4, 4, 4, 4, 1);
    write_file((dir.path / "annotations" / "training" / "zz.png").string(), "\x89PNG truncated");
    SegmentationFolder data(dir.path.string(), "training", 5, false);
    ASSERT_EQ(data.size(), 5);  // broken, ok, range, size, zz
    const std::string unreadable = error_of([&] { data.get(0); });
    EXPECT_NE(unreadable.find("broken.png"), std::string::npos) << unreadable;
    EXPECT_EQ(error_of([&] { data.get(1); }), "");
    const std::string range = error_of([&] { data.get(2); });
    EXPECT_NE(range.find("annotations/training/range.png"), std::string::npos) << range;
    EXPECT_NE(range.find("class id 5 outside [0, 5)"), std::string::npos) << range;
    const std::string size = error_of([&] { data.get(3); });
    EXPECT_NE(size.find("annotations/training/size.png"), std::string::npos) << size;
    EXPECT_NE(size.find("13x8"), std::string::npos) << size;
    const std::string label = error_of([&] { data.get(4); });
    EXPECT_NE(label.find("annotations/training/zz.png"), std::string::npos) << label;
    for (const auto& e : {unreadable, range, size, label}) EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    // A missing label map is found when listing.
    std::filesystem::remove(dir.path / "annotations" / "training" / "ok.png");
    const std::string missing = error_of([&] { SegmentationFolder(dir.path.string(), "training", 5, false); });
    EXPECT_NE(missing.find("ok.png"), std::string::npos) << missing;
}

// ------------------------------------------------------------------ model

struct ModelCase {
    const char* name;
    const char* head;
    bool plain;
};

class SegmentationModelTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(SegmentationModelTest, OddNonSquareShapesNamesAndGradients) {
    const ModelCase c = GetParam();
    torch::manual_seed(0);
    models::ModelConfig config;
    if (c.plain) config.set("depth", int64_t(4));  // a small plain ViT: 4 blocks, one map each
    models::SegmentationConfig sc;
    sc.head = c.head;
    sc.channels = 16;
    sc.num_classes = 5;
    auto model = models::create_segmentation_model(c.name, config, sc);
    EXPECT_EQ(model->plain_backbone(), c.plain);
    model->train();
    const auto images = torch::randn({2, 3, 67, 45});
    const auto logits = model->forward(images);
    ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 5, 67, 45}));
    // mmseg names: backbone.*, decode_head.* (and neck.* for plain backbones), nothing else.
    bool has_conv_seg = false, has_backbone = false, has_neck = false, has_ppm = false;
    for (const auto& p : model->named_parameters()) {
        const std::string& k = p.key();
        EXPECT_TRUE(k.rfind("backbone.", 0) == 0 || k.rfind("decode_head.", 0) == 0 || k.rfind("neck.", 0) == 0) << k;
        has_conv_seg |= k == "decode_head.conv_seg.weight";
        has_backbone |= k.rfind("backbone.", 0) == 0;
        has_neck |= k.rfind("neck.", 0) == 0;
        has_ppm |= k == "decode_head.psp_modules.0.conv.weight";
    }
    EXPECT_TRUE(has_conv_seg && has_backbone);
    EXPECT_EQ(has_neck, c.plain);
    EXPECT_EQ(has_ppm, std::string(c.head) == "upernet");
    const auto target = torch::randint(0, 5, {2, 67, 45}, torch::kInt64);
    torch::nn::functional::cross_entropy(logits, target).backward();
    int64_t without_grad = 0;
    for (const auto& p : model->named_parameters())
        // A plain features_only backbone keeps its final norm (checkpoint names) but reports pre-norm blocks.
        if (c.plain && p.key().rfind("backbone.norm.", 0) == 0) continue;
        else if (p.value().requires_grad() && (!p.value().grad().defined() || p.value().grad().abs().sum().item<double>() == 0))
            ++without_grad, ADD_FAILURE() << "no gradient: " << p.key();
    EXPECT_EQ(without_grad, 0);
}

INSTANTIATE_TEST_SUITE_P(Backbones, SegmentationModelTest,
                         ::testing::Values(ModelCase{"hvit3_tiny", "upernet", false}, ModelCase{"hvit3_tiny", "fpn", false},
                                           ModelCase{"deit_tiny", "upernet", true}, ModelCase{"deit_tiny", "fpn", true}),
                         [](const auto& info) { return std::string(info.param.name) + "_" + info.param.head; });

TEST(SegmentationModel, BackboneCheckpointInitialisesBackbonePrefix) {
    torch::manual_seed(1);
    models::ModelConfig config;
    config.set("depth", int64_t(4));
    auto donor = models::create_model("deit_tiny", models::ModelConfig(config.values()).set("features_only", std::string("true")));
    auto model = models::create_segmentation_model("deit_tiny", config, {});
    auto donor_params = donor->named_parameters();
    auto params = model->named_parameters();
    {
        torch::NoGradGuard g;
        for (const auto& p : donor_params) params["backbone." + p.key()].copy_(p.value());
    }
    EXPECT_TRUE(torch::equal(params["backbone.blocks.0.attn.qkv.weight"], donor_params["blocks.0.attn.qkv.weight"]));
    EXPECT_NE(error_of([] { models::SegmentationModel(models::create_model("deit_tiny"), {}); }).find("features_only"),
              std::string::npos);
}

// ------------------------------------------------------------------ CLI

TEST(SegmentationCli, TrainResumeEvalPredictOnAFolder) {
    TempDir dir("segcli");
    // 4 training and 2 validation images of 40x52 whose label is "bright" (1) or "dark" (0) pixels.
    torch::manual_seed(3);
    for (const std::string split : {"training", "validation"}) {
        std::filesystem::create_directories(dir.path / "images" / split);
        std::filesystem::create_directories(dir.path / "annotations" / split);
        for (int i = 0; i < (split == "training" ? 4 : 2); ++i) {
            auto label = (torch::rand({40, 52}) > 0.5).to(torch::kUInt8);
            auto image = (label * 200 + 20).unsqueeze(2).expand({40, 52, 3}).contiguous();
            const std::string stem = split + std::to_string(i);
            io::write_image((dir.path / "images" / split / (stem + ".png")).string(), image);
            io::write_image((dir.path / "annotations" / split / (stem + ".png")).string(), label);
        }
    }
    const std::string out = dir.file("run");
    const std::string common = "--task segmentation --model hvit3_tiny --head fpn --channels 8 --dataset folder:" +
                               dir.path.string() + " --num-classes 2 --img-size 48 --crop-size 32 --batch-size 2 "
                               "--threads 1 --checkpoint-every 1 --warmup-steps 1 --output " + out;
    auto r = linvis::testing::run_cli("train " + common + " --steps 2");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("mIoU"), std::string::npos) << r.output;
    EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint.pt"));
    EXPECT_TRUE(std::filesystem::exists(out + "/last.safetensors"));
    // Resume continues at step 2 (--steps may grow); a different configuration is refused.
    r = linvis::testing::run_cli("train " + common + " --steps 3 --lr 0.5 --resume");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.output.find("different run configuration"), std::string::npos) << r.output;
    r = linvis::testing::run_cli("train " + common + " --steps 3 --resume");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("at step 2"), std::string::npos) << r.output;
    r = linvis::testing::run_cli("eval --task segmentation --weights " + out + "/last.safetensors --dataset folder:" +
                                 dir.path.string() + " --num-classes 2 --format json --threads 1");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("\"miou\""), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("\"images\":2"), std::string::npos) << r.output;
    r = linvis::testing::run_cli("predict --task segmentation --weights " + out + "/last.safetensors --image " +
                                 (dir.path / "images" / "validation" / "validation0.png").string() + " --output " +
                                 dir.file("overlay.png") + " --threads 1");
    ASSERT_EQ(r.status, 0) << r.output;
    const auto overlay = io::read_image(dir.file("overlay.png"));
    EXPECT_EQ(overlay.size(1), 2 * 52 + 10);
    // A bad label map stops training with the file named.
    for (int i = 0; i < 4; ++i)
        write_file((dir.path / "annotations" / "training" / ("training" + std::to_string(i) + ".png")).string(), "garbage");
    r = linvis::testing::run_cli("train " + common + " --steps 1 --output " + dir.file("run2"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.output.find("annotations/training/training"), std::string::npos) << r.output;
}

}  // namespace
