// train/sample_quality.h (the Frechet distance on classifier features, the classifier's accuracy on
// conditioned samples) and `linvis eval --task diffusion` end to end.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "linvis/core/error.h"
#include "linvis/io/state_dict.h"
#include "linvis/models/dit.h"
#include "linvis/train/sample_quality.h"
#include "support/cli.h"
#include "support/temp_dir.h"

namespace {

using linvis::train::frechet_distance;
using linvis::train::GaussianStats;

GaussianStats stats(const torch::Tensor& mean, const torch::Tensor& cov) {
    GaussianStats s;
    s.mean = mean.to(torch::kFloat64);
    s.cov = cov.to(torch::kFloat64);
    s.count = 2;
    return s;
}

// A random orthogonal matrix (QR of a Gaussian matrix).
torch::Tensor random_rotation(int64_t d) {
    return std::get<0>(torch::linalg_qr(torch::randn({d, d}, torch::kFloat64)));
}

// FD of two Gaussians with commuting covariances S_i = Q diag(d_i) Q^T:
// |m1 - m2|^2 + sum_j (d1_j + d2_j - 2 sqrt(d1_j d2_j)).
double closed_form(const torch::Tensor& m1, const torch::Tensor& d1, const torch::Tensor& m2, const torch::Tensor& d2) {
    return ((m1 - m2).pow(2).sum() + (d1 + d2 - 2 * (d1 * d2).sqrt()).sum()).item<double>();
}

TEST(SampleQuality, FrechetDistanceMatchesTheClosedFormForDiagonalCovariances) {
    torch::manual_seed(1);
    const int64_t d = 7;
    const torch::Tensor m1 = torch::randn({d}, torch::kFloat64), m2 = torch::randn({d}, torch::kFloat64);
    const torch::Tensor d1 = torch::rand({d}, torch::kFloat64) * 3 + 0.1, d2 = torch::rand({d}, torch::kFloat64) * 2;
    const double fd = frechet_distance(stats(m1, torch::diag(d1)), stats(m2, torch::diag(d2)));
    EXPECT_NEAR(fd, closed_form(m1, d1, m2, d2), 1e-10 * std::max(1.0, std::abs(fd)));
    // Only the means differ: the squared distance of the means.
    EXPECT_NEAR(frechet_distance(stats(m1, torch::diag(d1)), stats(m2, torch::diag(d1))),
                (m1 - m2).pow(2).sum().item<double>(), 1e-10);
    // One Gaussian is a point mass (a singular covariance): tr(S1).
    EXPECT_NEAR(frechet_distance(stats(m1, torch::diag(d1)), stats(m1, torch::zeros({d, d}))), d1.sum().item<double>(),
                1e-9);
}

TEST(SampleQuality, FrechetDistanceMatchesTheClosedFormForCommutingCovariances) {
    torch::manual_seed(2);
    const int64_t d = 12;
    const torch::Tensor q = random_rotation(d);
    const torch::Tensor m1 = torch::randn({d}, torch::kFloat64), m2 = m1 + 0.3;
    const torch::Tensor d1 = torch::rand({d}, torch::kFloat64) + 0.05, d2 = torch::rand({d}, torch::kFloat64) * 4 + 0.05;
    const torch::Tensor s1 = q.matmul(torch::diag(d1)).matmul(q.t()), s2 = q.matmul(torch::diag(d2)).matmul(q.t());
    EXPECT_NEAR(frechet_distance(stats(m1, s1), stats(m2, s2)), closed_form(m1, d1, m2, d2), 1e-9);
}

// Non-commuting covariances: tr((S1 S2)^1/2) is the sum of the square roots of the (real, non-negative)
// eigenvalues of the non-symmetric S1 S2, computed here by the general eigensolver instead.
TEST(SampleQuality, FrechetDistanceMatchesTheGeneralEigenvaluesOfTheProduct) {
    torch::manual_seed(3);
    const int64_t d = 9;
    const torch::Tensor a = torch::randn({d, d}, torch::kFloat64), b = torch::randn({d, d}, torch::kFloat64);
    const torch::Tensor s1 = a.matmul(a.t()) + 0.1 * torch::eye(d, torch::kFloat64);
    const torch::Tensor s2 = b.matmul(b.t()) / 3;
    const torch::Tensor m1 = torch::randn({d}, torch::kFloat64), m2 = torch::randn({d}, torch::kFloat64);
    const torch::Tensor eig = torch::real(torch::linalg_eigvals(s1.matmul(s2)));
    const double expected = ((m1 - m2).pow(2).sum() + s1.trace() + s2.trace() - 2 * eig.clamp_min(0).sqrt().sum())
                                .item<double>();
    const double fd = frechet_distance(stats(m1, s1), stats(m2, s2));
    EXPECT_NEAR(fd, expected, 1e-8 * std::abs(expected));
    // Symmetric in its arguments.
    EXPECT_NEAR(frechet_distance(stats(m2, s2), stats(m1, s1)), fd, 1e-8 * std::abs(fd));
}

TEST(SampleQuality, FrechetDistanceOfFeatureSets) {
    torch::manual_seed(4);
    const torch::Tensor x = torch::randn({300, 16}) * torch::linspace(0.1, 3, 16) + 2;
    const torch::Tensor y = torch::randn({200, 16}) * 0.5 - 1;
    // Identical sets: zero up to the rounding of the square root (features of scale ~3).
    EXPECT_NEAR(frechet_distance(x, x), 0.0, 1e-8);
    const double xy = frechet_distance(x, y);
    EXPECT_GT(xy, 10.0);
    EXPECT_NEAR(frechet_distance(y, x), xy, 1e-9 * xy);
    // The statistics are float64 mean and the unbiased covariance (numpy.cov's, as the FID code uses).
    const GaussianStats s = linvis::train::gaussian_statistics(x);
    EXPECT_EQ(s.count, 300);
    EXPECT_EQ(s.cov.scalar_type(), torch::kFloat64);
    const torch::Tensor xd = x.to(torch::kFloat64), c = xd - xd.mean(0);
    EXPECT_TRUE(torch::allclose(s.cov, c.t().matmul(c) / 299.0, 1e-12, 1e-12));
    // A shift of every feature by v adds |v|^2.
    EXPECT_NEAR(frechet_distance(x, x + 0.5), 16 * 0.25, 1e-6);
    // Fewer vectors than dimensions (singular covariances): still finite, non-negative and reproducible.
    const torch::Tensor a = torch::randn({30, 96}), b = torch::randn({30, 96}) + 0.1;
    const double ab = frechet_distance(a, b);
    EXPECT_TRUE(std::isfinite(ab));
    EXPECT_GE(ab, 0.0);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(frechet_distance(a, b), ab) << i;
    EXPECT_THROW(linvis::train::gaussian_statistics(x.narrow(0, 0, 1)), linvis::Error);
    EXPECT_THROW(frechet_distance(x, y.narrow(1, 0, 8)), linvis::Error);
}

// A classifier with known outputs: features = the image's pixels (B, 4) of a 1x2x2 image, logits = the
// features themselves (4 classes): the predicted class is the brightest pixel.
class PixelClassifier : public linvis::models::VisionModel {
public:
    torch::Tensor forward_features(const torch::Tensor& images) override { return images.flatten(1); }
    torch::Tensor forward_head(const torch::Tensor& features, bool pre_logits) override {
        return pre_logits ? features : features * 10;
    }
    std::vector<torch::Tensor> forward_intermediates(const torch::Tensor&, const std::vector<int64_t>&) override {
        return {};
    }
    int64_t num_classes() const override { return 4; }
    int64_t num_features() const override { return 4; }
};

TEST(SampleQuality, ClassifierOutputsAndAccuracyOfConditionedSamples) {
    PixelClassifier classifier;
    // Eight images; image i has its brightest pixel at i % 4.
    torch::Tensor images = torch::zeros({8, 1, 2, 2});
    for (int64_t i = 0; i < 8; ++i) images[i][0][(i % 4) / 2][(i % 4) % 2] = 1.0;
    const auto out = linvis::train::classifier_outputs(classifier, images, /*batch_size=*/3);  // batches 3 + 3 + 2
    ASSERT_EQ(out.features.sizes(), (std::vector<int64_t>{8, 4}));
    EXPECT_TRUE(torch::equal(out.features, images.flatten(1)));
    EXPECT_TRUE(torch::equal(out.logits, images.flatten(1) * 10));
    // Conditioned on labels of which 6 of 8 agree with the brightest pixel: 75 %.
    const torch::Tensor labels = torch::tensor({0, 1, 2, 3, 0, 1, 0, 0}, torch::kInt64);
    EXPECT_DOUBLE_EQ(linvis::train::top1_accuracy(out.logits, labels), 75.0);
    EXPECT_DOUBLE_EQ(linvis::train::top1_accuracy(out.logits, torch::tensor({0, 1, 2, 3, 0, 1, 2, 3}, torch::kInt64)),
                     100.0);
    EXPECT_THROW(linvis::train::top1_accuracy(out.logits, labels.narrow(0, 0, 5)), linvis::Error);
}

TEST(SampleQuality, DiffusionPixelsToClassifierInput) {
    // Constant images: [-1, 1] -> [0, 1] -> resized (a constant stays constant) -> (v - mean) / std.
    const torch::Tensor x = torch::tensor({-1.0f, 0.0f, 0.5f, 1.5f}).view({4, 1, 1, 1}).expand({4, 1, 32, 32});
    const torch::Tensor in = linvis::train::diffusion_pixels_to_classifier_input(x, 28, {0.286}, {0.353});
    ASSERT_EQ(in.sizes(), (std::vector<int64_t>{4, 1, 28, 28}));
    const std::vector<double> v = {0.0, 0.5, 0.75, 1.0};  // 1.5 is clamped to 1
    for (int64_t i = 0; i < 4; ++i) {
        EXPECT_NEAR(in[i].min().item<double>(), (v[i] - 0.286) / 0.353, 1e-5) << i;
        EXPECT_NEAR(in[i].max().item<double>(), (v[i] - 0.286) / 0.353, 1e-5) << i;
    }
    // The way back of the data pipeline's 28 -> 32: a smooth 28-px image survives 28 -> 32 -> 28 closely.
    namespace F = torch::nn::functional;
    const torch::Tensor grid = torch::linspace(0, 1, 28);
    const torch::Tensor smooth = (grid.view({1, 1, 28, 1}) * grid.view({1, 1, 1, 28})).contiguous();
    const torch::Tensor up = F::interpolate(smooth, F::InterpolateFuncOptions()
                                                        .size(std::vector<int64_t>{32, 32})
                                                        .mode(torch::kBicubic)
                                                        .align_corners(false))
                                 .clamp(0, 1);
    const torch::Tensor back = linvis::train::diffusion_pixels_to_classifier_input(up * 2 - 1, 28, {0.0}, {1.0});
    EXPECT_LT((back - smooth).abs().max().item<double>(), 0.02);
    EXPECT_THROW(linvis::train::diffusion_pixels_to_classifier_input(x, 28, {0.5, 0.5}, {0.5, 0.5}), linvis::Error);
}

const char* kFashionMnist = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";

// An untrained tiny pixel-space DiT, saved as safetensors. Its output layer is zero-initialised (the official
// initialisation), so the samples are a fixed function of the noise: reproducible to the last bit.
std::string tiny_dit(const linvis::testing::TempDir& dir) {
    torch::manual_seed(5);
    auto model = linvis::models::create_diffusion_model(
        "dit_s4", linvis::models::ModelConfig({{"input_size", "32"}, {"in_channels", "1"}, {"num_classes", "10"},
                                               {"depth", "1"}, {"hidden_size", "32"}, {"num_heads", "2"}}));
    const std::string path = dir.file("tiny_dit.safetensors");
    linvis::io::save_weights(*model, path);
    return path;
}

const std::string kTinyDitKwargs =
    " --model dit_s4 --model-kwargs input_size=32 in_channels=1 num_classes=10 depth=1 hidden_size=32 num_heads=2";

TEST(SampleQuality, EvalDiffusionEndToEnd) {
    if (!std::filesystem::exists(kFashionMnist)) GTEST_SKIP() << "no Fashion-MNIST in /usr/share/datasets/fashion-mnist";
    linvis::testing::TempDir dir;
    const std::string weights = tiny_dit(dir), json = dir.file("m.json"), grid = dir.file("grid.png");
    // The same sampling each time; `rest` adds the output files and any further option.
    const auto eval = [&](const std::string& rest) {
        return linvis::testing::run_cli("eval --task diffusion" + kTinyDitKwargs + " --weights " + weights +
                                        " --sampler ddim --steps 3 --cfg-scale 1.5 --samples-per-class 3 "
                                        "--batch-size 8 --seed 2 --threads 1 --no-progress " + rest);
    };
    const auto metrics = [](const std::string& path) {
        std::ifstream in(path);
        return nlohmann::json::parse(in);
    };
    auto r = eval("--output " + json + " --grid " + grid);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("not Inception FID"), std::string::npos) << r.output;
    const nlohmann::json m = metrics(json);
    for (const char* key : {"frechet_distance", "frechet_distance_real_train_vs_test", "classifier_accuracy",
                            "classifier_accuracy_real_test", "sampling_seconds"}) {
        ASSERT_TRUE(m.contains(key)) << key;
        EXPECT_TRUE(std::isfinite(m[key].get<double>())) << key;
    }
    EXPECT_EQ(m["samples"].get<int64_t>(), 30);
    EXPECT_EQ(m["real_images"].get<int64_t>(), 30);
    EXPECT_EQ(m["feature_dim"].get<int64_t>(), 96);  // the shipped vittt_tiny classifier's width
    EXPECT_EQ(m["respacing"].get<std::string>(), "ddim3");
    EXPECT_EQ(m["classifier_accuracy_per_class"].size(), 10u);
    EXPECT_GE(m["frechet_distance"].get<double>(), 0.0);
    EXPECT_GE(m["frechet_distance_real_train_vs_test"].get<double>(), 0.0);
    // Noise samples are far from real clothes; real training images are close to real test images.
    EXPECT_GT(m["frechet_distance"].get<double>(), m["frechet_distance_real_train_vs_test"].get<double>());
    // The classifier recognises real images after the 28 -> 32 -> 28 round trip far above chance.
    EXPECT_GT(m["classifier_accuracy_real_test"].get<double>(), 30.0);
    EXPECT_GT(std::filesystem::file_size(grid), 500u);

    // The same seed (and batch size: each batch draws its noise in turn) gives the same samples and numbers.
    const std::string json2 = dir.file("m2.json");
    r = eval("--output " + json2);
    ASSERT_EQ(r.status, 0) << r.output;
    const nlohmann::json m2 = metrics(json2);
    EXPECT_NEAR(m2["frechet_distance"].get<double>(), m["frechet_distance"].get<double>(),
                1e-9 * m["frechet_distance"].get<double>());

    // --dtype bf16: the network in bf16, the sampler in float32 (a bf16 network given float32 latents failed before).
    // The untrained network's output is 0 in any dtype, so the samples, and the distance, are float32's.
    const std::string json3 = dir.file("m3.json");
    r = eval("--dtype bf16 --output " + json3);
    ASSERT_EQ(r.status, 0) << r.output;
    const nlohmann::json m3 = metrics(json3);
    EXPECT_EQ(m3["dtype"].get<std::string>(), "bf16");
    EXPECT_EQ(m["dtype"].get<std::string>(), "f32");
    EXPECT_NEAR(m3["frechet_distance"].get<double>(), m["frechet_distance"].get<double>(),
                1e-9 * m["frechet_distance"].get<double>());
}

std::string last_line(const std::string& output) {
    std::string s = output;
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s.substr(s.rfind('\n') == std::string::npos ? 0 : s.rfind('\n') + 1);
}

TEST(SampleQuality, EvalDiffusionRejectsAWrongClassifier) {
    linvis::testing::TempDir dir;
    const std::string weights = tiny_dit(dir);
    const std::string base = "eval --task diffusion" + kTinyDitKwargs + " --weights " + weights +
                             " --steps 2 --samples-per-class 2 --threads 1 --no-progress --classifier ";
    // The DiT's own weights: no classifier metadata.
    auto r = linvis::testing::run_cli(base + weights);
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("--classifier " + weights + ": not a classifier written by 'linvis train'"),
              std::string::npos)
        << r.output;
    // Not a safetensors file.
    r = linvis::testing::run_cli(base + dir.file("model.pt"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("expected a .safetensors file"), std::string::npos) << r.output;
    // A missing file.
    r = linvis::testing::run_cli(base + dir.file("missing.safetensors"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("missing.safetensors"), std::string::npos) << r.output;
    // A classifier of another number of classes than the diffusion model.
    auto model = linvis::models::create_diffusion_model(
        "dit_s4", linvis::models::ModelConfig({{"input_size", "16"}, {"in_channels", "1"}, {"num_classes", "7"},
                                               {"depth", "1"}, {"hidden_size", "32"}, {"num_heads", "2"}}));
    const std::string seven = dir.file("seven.safetensors");
    linvis::io::save_weights(*model, seven);
    r = linvis::testing::run_cli("eval --task diffusion --model dit_s4 --model-kwargs input_size=16 in_channels=1 "
                                 "num_classes=7 depth=1 hidden_size=32 num_heads=2 --weights " + seven +
                                 " --steps 2 --samples-per-class 2 --threads 1 --no-progress");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("expected a classifier of 7 classes"), std::string::npos) << r.output;
}

}  // namespace
