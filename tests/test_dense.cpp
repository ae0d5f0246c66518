// Dense-prediction features (issue 14): the official H-ViT3 detection/segmentation backbone against the
// official code's outputs (fixtures/dense), and every family's feature maps at a non-square odd size.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "linvis/models/pretrained.h"
#include "linvis/models/registry.h"
#include "support/cli.h"
#include "support/fixtures.h"
#include "support/temp_dir.h"
#include "support/testing.h"

using namespace linvis::models;
using linvis::testing::load_fixture;
using torch::Tensor;

namespace {

using Options = std::map<std::string, std::string>;

// The fixture's backbone: ViTTT(dim=[32, 64, 96, 128], depths=[1, 1, 1, 1]), head width 32.
const std::map<std::string, std::string> kMiniDet = {
    {"features_only", "true"}, {"embed_dims", "32,64,96,128"}, {"depths", "1,1,1,1"}};

// |actual - expected| <= 1e-4 * max|expected| (the fixtures README's tolerance).
::testing::AssertionResult matches_reference(const Tensor& actual, const Tensor& expected) {
    const double scale = expected.abs().max().item<double>();
    return linvis::testing::all_close(actual, expected, 0.0, 1e-4 * scale);
}

int64_t parameter_count(const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    return n;
}

TEST(DenseBackbone, Hvit3DetBackboneHasTheOfficialStateDict) {
    LINVIS_REQUIRE_FIXTURES();
    ModelPtr model = create_model("hvit3_tiny", ModelConfig(kMiniDet));
    const auto official = load_fixture("dense/hvit3_mini_det.weights.safetensors");
    std::map<std::string, std::vector<int64_t>> ours;
    for (const auto& item : model->named_parameters(true)) ours[item.key()] = item.value().sizes().vec();
    for (const auto& item : model->named_buffers(true)) ours[item.key()] = item.value().sizes().vec();
    ASSERT_EQ(ours.size(), official.size());
    for (const auto& [key, value] : official) {
        ASSERT_TRUE(ours.count(key)) << "official key missing: " << key;
        EXPECT_EQ(ours[key], value.sizes().vec()) << key;
    }
    EXPECT_EQ(parameter_count(*model), 694640);  // the fixtures README's count
    // norm{i} come first, as the official backbone registers them.
    EXPECT_EQ(model->named_parameters(true).keys().front(), "norm0.weight");
}

TEST(DenseBackbone, Hvit3DetBackboneReproducesTheOfficialFeatures) {
    LINVIS_REQUIRE_FIXTURES();
    ModelPtr model = create_model("hvit3_tiny", ModelConfig(kMiniDet));
    const std::string weights = linvis::testing::fixtures_dir() + "/dense/hvit3_mini_det.weights.safetensors";
    const WeightsLoadResult loaded = load_model_weights(*model, weights, false, /*strict=*/true);
    EXPECT_EQ(loaded.loaded, 151);
    model->eval();
    EXPECT_EQ(model->feature_indices(), (std::vector<int64_t>{0, 1, 2, 3}));
    for (const std::string size : {"96x128", "100x70"}) {
        SCOPED_TRACE(size);
        const auto io = load_fixture("dense/hvit3_mini_det." + size + ".io.safetensors");
        torch::NoGradGuard no_grad;
        const std::vector<Tensor> maps = model->forward_feature_maps(io.at("input"), model->feature_indices());
        ASSERT_EQ(maps.size(), 4u);
        for (size_t k = 0; k < maps.size(); ++k)
            EXPECT_TRUE(matches_reference(maps[k], io.at("features." + std::to_string(k)))) << "features." << k;
    }
}

TEST(DenseBackbone, RunCommandWritesTheFeatureMaps) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    const std::string fixtures = linvis::testing::fixtures_dir() + "/dense/";
    const auto result = linvis::testing::run_cli(
        "run --model hvit3_tiny --model-kwargs features_only=true embed_dims=32,64,96,128 depths=1,1,1,1 "
        "--weights " + fixtures + "hvit3_mini_det.weights.safetensors --input " + fixtures +
        "hvit3_mini_det.100x70.io.safetensors --output " + dir.file("out.safetensors"));
    ASSERT_EQ(result.status, 0) << result.output;
    const auto io = load_fixture("dense/hvit3_mini_det.100x70.io.safetensors");
    const auto out = linvis::io::SafetensorsFile::open(dir.file("out.safetensors")).load_all();
    ASSERT_EQ(out.size(), 4u);
    for (int k = 0; k < 4; ++k) {
        const std::string key = "features." + std::to_string(k);
        ASSERT_TRUE(out.count(key)) << key;
        EXPECT_TRUE(matches_reference(out.at(key), io.at(key))) << key;
    }
}

// A classification checkpoint into the backbone, as the official init_weights does (strict=False):
// the head and the final BatchNorm are left out, RoPE buffers move under attn, the stage norms stay
// as initialised, and every block weight arrives.
TEST(DenseBackbone, Hvit3BackboneTakesAClassificationCheckpoint) {
    const std::map<std::string, std::string> small = {{"embed_dims", "32,64,96,128"}, {"depths", "1,1,1,1"},
                                                      {"num_classes", "10"}};
    torch::manual_seed(1);
    ModelPtr classifier = create_model("hvit3_tiny", ModelConfig(small));
    std::map<std::string, Tensor> state;
    for (const auto& item : classifier->named_parameters(true)) state[item.key()] = item.value().detach();
    for (const auto& item : classifier->named_buffers(true)) state[item.key()] = item.value().detach();
    ModelPtr backbone = create_model("hvit3_tiny", ModelConfig(kMiniDet));
    ModelMappingReport report;
    const auto mapped = map_state_dict_to_model(state, *backbone, /*strict=*/false, &report);
    EXPECT_TRUE(report.unexpected.empty());
    EXPECT_TRUE(report.mismatched.empty());
    // Left out: head.weight, head.bias and the BatchNorm1d's five entries.
    EXPECT_EQ(report.dropped.size(), 7u);
    EXPECT_EQ(report.renamed.size(), 4u);  // one RoPE buffer per block
    std::vector<std::string> expected_missing;
    for (int i = 0; i < 4; ++i)
        for (const char* p : {"bias", "weight"}) expected_missing.push_back("norm" + std::to_string(i) + "." + p);
    std::sort(report.missing.begin(), report.missing.end());
    EXPECT_EQ(report.missing, expected_missing);
    EXPECT_TRUE(mapped.count("layers.2.blocks.0.attn.qkv.weight"));
    EXPECT_TRUE(mapped.count("layers.0.blocks.0.attn.rope.rotations"));
}

// Every family as a backbone at a non-square size that is not a multiple of the patch: one NCHW map per
// requested block, the grid of the zero-padded image, and the same maps as for that padded image.
struct FamilyCase {
    std::string model;
    std::map<std::string, std::string> options;
    int64_t channels;   // of the maps (the last reported stage for hvit3)
    int64_t stride;     // of the maps (the last reported stage for hvit3)
};

class EveryFamily : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(EveryFamily, FeatureMapsAtANonSquareOddSize) {
    const FamilyCase& c = GetParam();
    auto options = c.options;
    options["features_only"] = "true";
    torch::manual_seed(0);
    ModelPtr model = create_model(c.model, ModelConfig(options));
    model->eval();
    const std::vector<int64_t> wanted = model->feature_indices();
    ASSERT_FALSE(wanted.empty());
    EXPECT_EQ(model->num_classes(), 0);
    const int64_t H = 37, W = 53;
    const Tensor image = torch::randn({2, 3, H, W});
    torch::NoGradGuard no_grad;
    const std::vector<Tensor> maps = model->forward_feature_maps(image, wanted);
    ASSERT_EQ(maps.size(), wanted.size());
    const Tensor& last = maps.back();
    EXPECT_EQ(last.sizes().vec(), (std::vector<int64_t>{2, c.channels, (H + c.stride - 1) / c.stride,
                                                         (W + c.stride - 1) / c.stride}));
    for (const auto& m : maps) EXPECT_TRUE(torch::isfinite(m).all().item<bool>());
    // Padding is zeros at the right and bottom: the padded image gives the same maps.
    const int64_t pad = c.model == "hvit3_tiny" ? 4 : c.stride;
    const Tensor padded = torch::constant_pad_nd(image, {0, (pad - W % pad) % pad, 0, (pad - H % pad) % pad}, 0.0);
    const std::vector<Tensor> again = model->forward_feature_maps(padded, wanted);
    for (size_t k = 0; k < maps.size(); ++k) EXPECT_TRUE(torch::equal(maps[k], again[k])) << "map " << k;
    // Samples are independent (no batch coupling).
    const std::vector<Tensor> single = model->forward_feature_maps(image.narrow(0, 1, 1), wanted);
    EXPECT_TRUE(linvis::testing::all_close(single.back(), last.narrow(0, 1, 1), 1e-4, 1e-5));
}

const std::map<std::string, std::string> kPlainSmall = {{"embed_dim", "64"}, {"depth", "4"}, {"num_heads", "2"}};

INSTANTIATE_TEST_SUITE_P(
    Dense, EveryFamily,
    ::testing::Values(FamilyCase{"deit_tiny", kPlainSmall, 64, 16}, FamilyCase{"t5_tiny", kPlainSmall, 64, 16},
                      FamilyCase{"vit3_tiny", kPlainSmall, 64, 16},
                      FamilyCase{"vittt_tiny", kPlainSmall, 64, 16},
                      FamilyCase{"vil_tiny", {{"embed_dim", "64"}, {"depth", "2"}}, 64, 16},
                      FamilyCase{"hvit3_tiny", {{"embed_dims", "32,64,96,128"}, {"depths", "1,1,1,1"}}, 128, 32}),
    [](const ::testing::TestParamInfo<FamilyCase>& info) { return info.param.model; });

TEST(DenseBackbone, DefaultOutIndicesAreFourEvenlySpacedBlocks) {
    ModelPtr deit = create_model("deit_tiny", ModelConfig(Options{{"features_only", "true"}}));
    EXPECT_EQ(deit->feature_indices(), (std::vector<int64_t>{2, 5, 8, 11}));
    ModelPtr chosen = create_model("deit_tiny", ModelConfig(Options{{"features_only", "true"}, {"out_indices", "1,-1"}}));
    EXPECT_EQ(chosen->feature_indices(), (std::vector<int64_t>{1, 11}));
    ModelPtr classifier = create_model("deit_tiny", ModelConfig());
    EXPECT_TRUE(classifier->feature_indices().empty());
}

TEST(DenseBackbone, BadFeatureOptionsAreNamed) {
    try {
        create_model("deit_tiny", ModelConfig(Options{{"features_only", "true"}, {"out_indices", "12"}}));
        FAIL() << "out_indices outside the blocks accepted";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("out_indices"), std::string::npos) << e.what();
    }
    try {
        create_model("hvit3_tiny", ModelConfig(Options{{"out_indices", "0,1"}}));
        FAIL() << "out_indices without features_only accepted";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("features_only"), std::string::npos) << e.what();
    }
    EXPECT_THROW(create_model("hvit3_tiny", ModelConfig(Options{{"features_only", "true"}, {"out_indices", "0,x"}})),
                 linvis::Error);
}

}  // namespace
