// The Gaussian diffusion (include/linvis/models/diffusion.h) against the spec's reference values and
// the official code's outputs: respacing, the rebuilt schedule, training_losses at t = 0, 1, 999 and
// the DDIM-8 CFG sample of each family's tiny model.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

#include "linvis/core/error.h"
#include "linvis/models/diffusion.h"
#include "linvis/models/dit.h"
#include "linvis/models/pretrained.h"
#include "support/fixtures.h"

using linvis::testing::kGenerationFixtureTolerance;
using linvis::testing::matches_fixture;

namespace {

using linvis::models::GaussianDiffusion;
using linvis::models::space_timesteps;

TEST(Diffusion, RespacingMatchesSpecExamples) {
    auto s250 = space_timesteps(1000, "250");
    ASSERT_EQ(s250.size(), 250u);
    EXPECT_EQ(s250.front(), 0);
    EXPECT_EQ(s250[1], 4);
    EXPECT_EQ(s250.back(), 999);
    EXPECT_EQ(std::accumulate(s250.begin(), s250.end(), int64_t{0}), 124875);
    // the gaps of 5
    for (const auto& [a, b] : std::vector<std::pair<int64_t, int64_t>>{{164, 169}, {497, 502}, {830, 835}}) {
        auto it = std::find(s250.begin(), s250.end(), a);
        ASSERT_NE(it, s250.end()) << a;
        EXPECT_EQ(*(it + 1), b);
    }
    auto s100 = space_timesteps(1000, "100");
    EXPECT_EQ(s100[1], 10);
    EXPECT_EQ(s100[s100.size() - 3], 979);
    EXPECT_EQ(s100[s100.size() - 2], 989);
    EXPECT_EQ(s100.back(), 999);
    auto s50 = space_timesteps(1000, "50");
    EXPECT_EQ((std::vector<int64_t>(s50.begin(), s50.begin() + 5)), (std::vector<int64_t>{0, 20, 41, 61, 82}));
    EXPECT_EQ(space_timesteps(11, "5"), (std::vector<int64_t>{0, 2, 5, 8, 10}));  // half to even at 2.5, 7.5
    auto d25 = space_timesteps(1000, "ddim25");
    ASSERT_EQ(d25.size(), 25u);
    EXPECT_EQ(d25[1], 40);
    EXPECT_EQ(d25.back(), 960);
    EXPECT_EQ(space_timesteps(1000, "").size(), 1000u);
    EXPECT_EQ(space_timesteps(1000, "10,20").size(), 30u);
    EXPECT_THROW(space_timesteps(1000, "ddim999"), linvis::Error);
    EXPECT_THROW(space_timesteps(10, "11"), linvis::Error);
    EXPECT_THROW(space_timesteps(1000, "abc"), linvis::Error);
}

TEST(Diffusion, SpacedScheduleMatchesSpecValues) {
    GaussianDiffusion d("250");
    const auto& b = d.array("betas");
    ASSERT_EQ(b.size(), 250u);
    EXPECT_DOUBLE_EQ(b[0], 9.999999999998899e-05);
    EXPECT_DOUBLE_EQ(b[1], 5.990655644756426e-04);
    EXPECT_DOUBLE_EQ(b[249], 0.07751934499235003);
    const auto& plvc = d.array("posterior_log_variance_clipped");
    EXPECT_DOUBLE_EQ(plvc[0], -9.364628159803084);
    EXPECT_DOUBLE_EQ(plvc[1], -9.364628159803084);
    EXPECT_DOUBLE_EQ(d.array("alphas_cumprod")[249], 4.035829765375675e-05);
    EXPECT_EQ(d.timestep_map()[1], 4);
    // "" keeps all 1000 steps, beta rebuilt from alpha-bar ratios (last-bit differences from linspace)
    GaussianDiffusion full("");
    EXPECT_EQ(full.num_timesteps(), 1000);
    EXPECT_NEAR(full.array("betas")[999], 0.02, 1e-15);
    EXPECT_EQ(full.array("posterior_mean_coef1")[0], 1.0);
    EXPECT_EQ(full.array("posterior_mean_coef2")[0], 0.0);
}

std::shared_ptr<linvis::models::DiffusionModel> tiny(const std::string& family) {
    linvis::models::ModelConfig c(
        {{"input_size", "8"}, {"hidden_size", "96"}, {"depth", "1"}, {"num_heads", "3"}, {"num_classes", "10"}});
    if (family == "dit5") c.set("nat_small_grid", std::string("wrap"));  // G = 4: the fixtures' window
    auto m = linvis::models::create_diffusion_model(family + "_s2", c);
    linvis::models::load_model_weights(*m, linvis::testing::fixtures_dir() + "/generation/" + family +
                                               "_tiny.weights.safetensors");
    m->eval();
    return m;
}

class DiffusionFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(DiffusionFixture, TrainingLossesAtT0T1T999) {
    LINVIS_REQUIRE_FIXTURES();
    auto f = linvis::testing::load_fixture("generation/" + GetParam() + "_tiny.loss.safetensors");
    auto m = tiny(GetParam());
    torch::NoGradGuard g;
    GaussianDiffusion d("");
    torch::Tensor y = f["y"];
    auto L = d.training_losses([&](const torch::Tensor& x, const torch::Tensor& t) { return m->forward(x, t, y); },
                               f["x0"], f["t"], f["noise"]);
    const double tol = kGenerationFixtureTolerance;
    EXPECT_TRUE(matches_fixture(L.mse, f["mse"], tol)) << "mse";
    EXPECT_TRUE(matches_fixture(L.vb, f["vb"], tol)) << "vb";
    EXPECT_TRUE(matches_fixture(L.loss, f["loss"], tol)) << "loss";
    // each vb term on its own scale too (t = 0 uses the decoder NLL, the others the KL)
    for (int i = 0; i < 3; ++i)
        EXPECT_NEAR(L.vb[i].item<double>(), f["vb"][i].item<double>(), tol * std::abs(f["vb"][i].item<double>()) + 1e-7)
            << "vb[" << i << "]";
}

TEST_P(DiffusionFixture, Ddim8WithCfgMatchesOfficial) {
    LINVIS_REQUIRE_FIXTURES();
    auto f = linvis::testing::load_fixture("generation/" + GetParam() + "_tiny.ddim8_cfg1.5.safetensors");
    auto m = tiny(GetParam());
    torch::NoGradGuard g;
    GaussianDiffusion d("ddim8");
    torch::Tensor z = torch::cat({f["noise"], f["noise"]}, 0);
    torch::Tensor y = torch::cat({f["label"], torch::full({1}, 10, torch::kInt64)}, 0);
    torch::Tensor samples = d.ddim_sample_loop(
        [&](const torch::Tensor& x, const torch::Tensor& t) { return m->forward_with_cfg(x, t, y, 1.5); }, z, 0.0);
    EXPECT_TRUE(matches_fixture(samples.narrow(0, 0, 1), f["samples"], kGenerationFixtureTolerance));
}

INSTANTIATE_TEST_SUITE_P(Families, DiffusionFixture, ::testing::Values("dit", "dit3", "dit5"));

// The ancestral sampler's step: mean + exp(0.5 log_var) noise, the noise masked at t = 0.
TEST(Diffusion, PSampleMasksNoiseAtStepZero) {
    GaussianDiffusion d("10");
    auto model = [](const torch::Tensor& x, const torch::Tensor&) { return torch::zeros({x.size(0), 8, 2, 2}); };
    torch::Tensor x = torch::randn({2, 4, 2, 2}), noise = torch::randn({2, 4, 2, 2});
    torch::Tensor t0 = torch::zeros({2}, torch::kInt64), t5 = torch::full({2}, 5, torch::kInt64);
    torch::Tensor a = d.p_sample(model, x, t0, noise), b = d.p_sample(model, x, t0, torch::zeros_like(noise));
    EXPECT_TRUE(torch::equal(a, b));
    torch::Tensor c = d.p_sample(model, x, t5, noise), e = d.p_sample(model, x, t5, torch::zeros_like(noise));
    // v = 0: log variance halfway between plvc and log beta
    const double lv = 0.5 * d.array("posterior_log_variance_clipped")[5] + 0.5 * std::log(d.array("betas")[5]);
    EXPECT_TRUE(torch::allclose(c - e, std::exp(0.5 * lv) * noise, 1e-5, 1e-6));
    // the network sees the original timestep
    int64_t seen = -1;
    d.p_sample([&](const torch::Tensor& xx, const torch::Tensor& t) {
        seen = t[0].item<int64_t>();
        return torch::zeros({xx.size(0), 8, 2, 2});
    }, x, t5, noise);
    EXPECT_EQ(seen, d.timestep_map()[5]);
    EXPECT_EQ(seen, 555);
}

}  // namespace
