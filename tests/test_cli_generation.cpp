// The command-line forms of issue 13 (linvis run on diffusion models and the VAE decoder, linvis sample)
// reproduce the official outputs in ../shared/fixtures/generation, and bad input gets a one-line error.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "checkpoint_writer.h"
#include "linvis/io/safetensors.h"
#include "support/cli.h"
#include "support/fixtures.h"
#include "support/temp_dir.h"

namespace {

using linvis::testing::run_cli;

const std::string kTinyKwargs = "--model-kwargs input_size=8 hidden_size=96 depth=1 num_heads=3 num_classes=10";

// DiT5's tiny fixtures run on a 4x4 token grid: the fixtures' window there (dit.h nat_small_grid).
std::string tiny_kwargs(const std::string& family) {
    return kTinyKwargs + (family == "dit5" ? " nat_small_grid=wrap" : "");
}

std::string fixture(const std::string& name) { return linvis::testing::fixtures_dir() + "/generation/" + name; }

// DiT5's 4x4-grid fixtures are reproduced to ~3e-3 only (see tests/test_dit.cpp); the others to 1e-4.
::testing::AssertionResult close_to_fixture(const torch::Tensor& actual, const torch::Tensor& expected,
                                            double tol = 1e-4) {
    if (actual.sizes() != expected.sizes())
        return ::testing::AssertionFailure() << "shape " << actual.sizes() << " vs " << expected.sizes();
    const double scale = expected.abs().max().item<double>();
    const double err = (actual.to(torch::kFloat64) - expected.to(torch::kFloat64)).abs().max().item<double>();
    if (!(err <= tol * scale)) return ::testing::AssertionFailure() << "max abs err " << err << ", scale " << scale;
    return ::testing::AssertionSuccess();
}

torch::Tensor read(const std::string& path, const std::string& name) {
    return linvis::io::SafetensorsFile::open(path).tensor(name);
}

// The last line of the output (the error line).
std::string last_line(const std::string& output) {
    std::string s = output;
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s.substr(s.rfind('\n') == std::string::npos ? 0 : s.rfind('\n') + 1);
}

TEST(CliGeneration, RunDiffusionModelAndCfg) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    for (const std::string family : {"dit", "dit3", "dit5"}) {
        const std::string out = dir.file(family + ".out.safetensors");
        auto r = run_cli("run --model " + family + "_s2 " + tiny_kwargs(family) + " --weights " +
                         fixture(family + "_tiny.weights.safetensors") + " --input " +
                         fixture(family + "_tiny.run.safetensors") + " --output " + out + " --threads 1");
        ASSERT_EQ(r.status, 0) << r.output;
        EXPECT_TRUE(close_to_fixture(read(out, "out"), read(fixture(family + "_tiny.run.safetensors"), "out"),
                                     linvis::testing::kGenerationFixtureTolerance)) << family;
        const std::string cfg = dir.file(family + ".cfg.safetensors");
        r = run_cli("run --model " + family + "_s2 " + tiny_kwargs(family) + " --weights " +
                    fixture(family + "_tiny.weights.safetensors") + " --input " +
                    fixture(family + "_tiny.cfg1.5.safetensors") + " --output " + cfg + " --cfg-scale 1.5");
        ASSERT_EQ(r.status, 0) << r.output;
        EXPECT_TRUE(close_to_fixture(read(cfg, "out"), read(fixture(family + "_tiny.cfg1.5.safetensors"), "out"),
                                     linvis::testing::kGenerationFixtureTolerance))
            << family;
    }
}

// convert-checkpoint on a train.py checkpoint {"model", "ema", "opt"} writes the EMA weights (find_model),
// checked against the model, and they reproduce the official output.
TEST(CliGeneration, ConvertCheckpointTakesTheEma) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    auto sd = linvis::io::SafetensorsFile::open(fixture("dit3_tiny.weights.safetensors")).load_all();
    std::vector<std::pair<std::string, torch::Tensor>> ema, model;
    for (const auto& [k, v] : sd) {
        ema.emplace_back(k, v);
        model.emplace_back(k, torch::zeros_like(v));
    }
    linvis::testing::save_model_and_ema(dir.file("ckpt.pt"), model, ema, /*with_optimizer=*/false);
    auto r = run_cli("convert-checkpoint " + dir.file("ckpt.pt") + " " + dir.file("w.safetensors") + " --model dit3_s2 " +
                     tiny_kwargs("dit3"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("'ema'"), std::string::npos) << r.output;
    const std::string out = dir.file("out.safetensors");
    r = run_cli("run --model dit3_s2 " + tiny_kwargs("dit3") + " --weights " + dir.file("w.safetensors") + " --input " +
                fixture("dit3_tiny.run.safetensors") + " --output " + out);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(close_to_fixture(read(out, "out"), read(fixture("dit3_tiny.run.safetensors"), "out")));
}

TEST(CliGeneration, RunVaeDecoder) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    const std::string out = dir.file("image.safetensors");
    auto r = run_cli("run --model sd_vae_decoder --model-kwargs block_out_channels=32,32,64,64 --weights " +
                     fixture("vae_tiny.weights.safetensors") + " --input " + fixture("vae_tiny.io.safetensors") +
                     " --output " + out);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(close_to_fixture(read(out, "image"), read(fixture("vae_tiny.io.safetensors"), "image")));
}

TEST(CliGeneration, SampleDdimFromNoiseFileMatchesOfficial) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    for (const std::string family : {"dit", "dit3", "dit5"}) {
        const std::string out = dir.file(family + ".samples.safetensors");
        const std::string ref = fixture(family + "_tiny.ddim8_cfg1.5.safetensors");
        auto r = run_cli("sample --model " + family + "_s2 " + tiny_kwargs(family) + " --weights " +
                         fixture(family + "_tiny.weights.safetensors") +
                         " --sampler ddim --steps 8 --cfg-scale 1.5 --noise " + ref + " --output " + out);
        ASSERT_EQ(r.status, 0) << r.output;
        EXPECT_NE(r.output.find("8/8"), std::string::npos) << "progress bar: " << r.output;
        EXPECT_TRUE(close_to_fixture(read(out, "samples"), read(ref, "samples"), linvis::testing::kGenerationFixtureTolerance)) << family;
    }
}

TEST(CliGeneration, SamplePngGridThroughVae) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    const std::string png = dir.file("grid.png");
    auto r = run_cli("sample --model dit5_s2 " + tiny_kwargs("dit5") + " --weights " + fixture("dit5_tiny.weights.safetensors") +
                     " --steps 5 --cfg-scale 2 --labels 1,7 --seed 3 --vae " + fixture("vae_tiny.weights.safetensors") +
                     " --vae-kwargs block_out_channels=32,32,64,64 --no-progress --output " + png);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("2 samples [2, 3, 64, 64]"), std::string::npos) << r.output;
    EXPECT_GT(std::filesystem::file_size(png), 1000u);
    // a latent model without --vae cannot be written as a picture
    r = run_cli("sample --model dit5_s2 " + tiny_kwargs("dit5") + " --weights " + fixture("dit5_tiny.weights.safetensors") +
                " --steps 2 --labels 1 --no-progress --output " + dir.file("x.png"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("give --vae FILE"), std::string::npos) << r.output;
}

TEST(CliGeneration, BadInputGetsOneLineErrors) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    const std::string base = "sample --model dit_s2 " + kTinyKwargs + " --weights " + fixture("dit_tiny.weights.safetensors") +
                             " --steps 2 --no-progress --output " + dir.file("s.safetensors");
    // a noise tensor of the wrong shape (the loss fixture's noise is (3, 4, 8, 8), labels from --labels: 1)
    auto r = run_cli(base + " --labels 1 --noise " + fixture("dit_tiny.loss.safetensors"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("tensor 'noise': expected shape (1, 4, 8, 8), got [3, 4, 8, 8]"),
              std::string::npos)
        << r.output;
    // a label out of range
    r = run_cli(base + " --labels 3,10");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("label 10 out of range [0, 9]"), std::string::npos) << r.output;
    // a checkpoint of the wrong family
    r = run_cli("run --model dit3_s2 " + kTinyKwargs + " --weights " + fixture("dit_tiny.weights.safetensors") +
                " --input " + fixture("dit_tiny.run.safetensors") + " --output " + dir.file("o.safetensors"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("does not match the model"), std::string::npos) << r.output;
    // a resolution the patch size does not divide
    r = run_cli("run --model dit_s4 --model-kwargs input_size=10 --random-weights --input " +
                fixture("dit_tiny.run.safetensors") + " --output " + dir.file("o.safetensors"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("not divisible by the patch size 4"), std::string::npos) << r.output;
    // DiT5 on a grid smaller than the 5x5 window
    r = run_cli("run --model dit5_s2 --model-kwargs input_size=8 depth=1 --random-weights --input " +
                fixture("dit_tiny.run.safetensors") + " --output " + dir.file("o.safetensors"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("smaller than the 5x5"), std::string::npos) << r.output;
}

// linvis train --task diffusion on a slice of Fashion-MNIST (Debian's dataset-fashion-mnist): checkpoints,
// resume by more epochs, DiT5 inheritance from the trained DiT, and sampling a PNG from the EMA weights.
TEST(CliGeneration, TrainDiffusionResumeInheritAndSample) {
    if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
        GTEST_SKIP() << "no Fashion-MNIST in /usr/share/datasets/fashion-mnist";
    linvis::testing::TempDir dir;
    const std::string arch = " --model-kwargs depth=1 hidden_size=32 num_heads=2";
    const std::string common = " --dataset fashion-mnist --limit-train 64 --limit-eval 16 --batch-size 32 --threads 1 "
                               "--no-progress --seed 1";
    const std::string dit = dir.file("dit");
    auto r = run_cli("train --task diffusion --model dit_s4" + arch + common + " --epochs 1 --output " + dit);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("1x32x32, 10 classes"), std::string::npos) << r.output;  // 28 -> 32 px
    for (const char* f : {"checkpoint.pt", "last.safetensors", "ema.safetensors", "metrics.jsonl"})
        EXPECT_TRUE(std::filesystem::exists(dit + "/" + f)) << f;
    r = run_cli("train --task diffusion --model dit_s4" + arch + common + " --epochs 2 --resume --output " + dit);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("at epoch 1"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(4 steps)"), std::string::npos) << r.output;
    std::ifstream metrics(dit + "/metrics.jsonl");
    int lines = 0;
    for (std::string line; std::getline(metrics, line);) ++lines;
    EXPECT_EQ(lines, 2);

    r = run_cli("train --task diffusion --model dit5_s4" + arch + common + " --epochs 1 --init-from " + dit +
                "/last.safetensors --output " + dir.file("dit5"));
    ASSERT_EQ(r.status, 0) << r.output;
    // depth 1: 12 DiT tensors outside the block + 10 in it are inherited; the block's 8 new DiT5 tensors keep their init
    EXPECT_NE(r.output.find("inherited 22 tensors"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("8 keep their initialisation"), std::string::npos) << r.output;

    r = run_cli("sample --model dit_s4 --model-kwargs depth=1 hidden_size=32 num_heads=2 input_size=32 in_channels=1 "
                "num_classes=10 --weights " + dit + "/ema.safetensors --steps 4 --labels 0,9 --no-progress --output " +
                dir.file("grid.png"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_GT(std::filesystem::file_size(dir.file("grid.png")), 500u);

    r = run_cli("train --task diffusion --model dit_s4" + arch + common + " --vae x.safetensors --output " + dir.file("v"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("VAE encoder"), std::string::npos) << r.output;
}

}  // namespace
