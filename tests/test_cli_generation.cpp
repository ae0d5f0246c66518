// The command-line forms of issue 13 (linvis run on diffusion models and the VAE decoder, linvis sample)
// reproduce the official outputs in ../shared/fixtures/generation, and bad input gets a one-line error.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "checkpoint_writer.h"
#include "linvis/io/safetensors.h"
#include "support/cli.h"
#include "support/fixtures.h"
#include "support/temp_dir.h"
#include "support/testing.h"

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

// --dtype bf16: the network in bf16, the sampler in float32; the official float32 samples within bf16's error (the
// relative L2 error of 8 DDIM steps, measured 0.19-0.23 %, bound 1 %), and the file says which dtype made them.
TEST(CliGeneration, SampleInBf16TracksTheFloat32Samples) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    for (const std::string family : {"dit", "dit3", "dit5"}) {
        const std::string out = dir.file(family + ".bf16.safetensors");
        const std::string ref = fixture(family + "_tiny.ddim8_cfg1.5.safetensors");
        auto r = run_cli("sample --model " + family + "_s2 " + tiny_kwargs(family) + " --weights " +
                         fixture(family + "_tiny.weights.safetensors") +
                         " --sampler ddim --steps 8 --cfg-scale 1.5 --dtype bf16 --no-progress --noise " + ref +
                         " --output " + out);
        ASSERT_EQ(r.status, 0) << r.output;
        const torch::Tensor samples = read(out, "samples"), expected = read(ref, "samples");
        ASSERT_EQ(samples.scalar_type(), torch::kFloat32) << family;
        const double err = linvis::testing::relative_error(samples, expected);
        std::printf("[ bf16 ] %s sample vs the official float32 samples: relative L2 error %.3e\n", family.c_str(),
                    err);
        EXPECT_LT(err, 1e-2) << family;
        EXPECT_GT(err, 0.0) << family << ": bf16 gave the float32 samples bit for bit; did it run in bf16?";
        EXPECT_EQ(linvis::io::SafetensorsFile::open(out).metadata().at("dtype"), "bf16") << family;
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
}

std::map<std::string, torch::Tensor> read_all(const std::string& path) {
    return linvis::io::SafetensorsFile::open(path).load_all();
}

// The largest |a - b| over the tensors of two weights files with the same names and shapes.
double max_weight_difference(const std::string& a, const std::string& b) {
    const auto wa = read_all(a), wb = read_all(b);
    EXPECT_EQ(wa.size(), wb.size());
    double worst = 0;
    for (const auto& [k, v] : wa) {
        EXPECT_TRUE(wb.count(k)) << k;
        if (!wb.count(k) || wb.at(k).sizes() != v.sizes()) return 1e30;
        worst = std::max(worst, (v - wb.at(k)).abs().max().item<double>());
    }
    return worst;
}

// linvis run --model sd_vae_encoder: 'image' -> 'mean', 'logvar' as diffusers' latent_dist
// (tests/data/vae/make_encoder_reference.py) and 'latent' = mean * 0.18215.
TEST(CliGeneration, RunVaeEncoder) {
    LINVIS_REQUIRE_FIXTURES();
    linvis::testing::TempDir dir;
    const std::string reference = std::string(LINVIS_TEST_DATA_DIR) + "/vae/vae_tiny_encode.safetensors";
    auto r = run_cli("run --model sd_vae_encoder --model-kwargs block_out_channels=32,32,64,64 --weights " +
                     fixture("vae_tiny.weights.safetensors") + " --input " + reference + " --output " + dir.file("o.safetensors"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(close_to_fixture(read(dir.file("o.safetensors"), "mean"), read(reference, "mean")));
    EXPECT_TRUE(close_to_fixture(read(dir.file("o.safetensors"), "logvar"), read(reference, "logvar")));
    EXPECT_TRUE(close_to_fixture(read(dir.file("o.safetensors"), "latent"), read(reference, "mean") * 0.18215));
    // the encoder reads 'image' (a DiT's input file has none)
    r = run_cli("run --model sd_vae_encoder --model-kwargs block_out_channels=32,32,64,64 --weights " +
                fixture("vae_tiny.weights.safetensors") + " --input " + fixture("dit_tiny.run.safetensors") + " --output " +
                dir.file("o2.safetensors"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("no tensor named 'image'"), std::string::npos) << r.output;
}

// linvis train --task diffusion --vae: DiT train.py in latent space on 32 px Fashion-MNIST (grey repeated to
// RGB) through the tiny VAE (4x4x4 latents): the model reads the VAE's latent channels at input_size 4, a
// run resumed after its first epoch ends bit for bit where the uninterrupted run ends, its EMA samples
// decode to a PNG, and wrong sizes, channels or another VAE on resume get one-line errors.
TEST(CliGeneration, TrainLatentDiffusionThroughVae) {
    LINVIS_REQUIRE_FIXTURES();
    if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
        GTEST_SKIP() << "no Fashion-MNIST in /usr/share/datasets/fashion-mnist";
    linvis::testing::TempDir dir;
    const std::string vae = dir.file("vae.safetensors");
    std::filesystem::copy_file(fixture("vae_tiny.weights.safetensors"), vae);
    const std::string base = "train --task diffusion --model dit_s2 --model-kwargs depth=1 hidden_size=32 num_heads=2";
    const std::string common = " --dataset fashion-mnist --limit-train 12 --batch-size 4 --threads 1 --lr 1e-3 "
                               "--ema-decay 0.5 --no-progress --seed 3 --vae " + vae +
                               " --vae-kwargs block_out_channels=32,32,64,64";
    const std::string whole = dir.file("whole"), parts = dir.file("parts");
    auto r = run_cli(base + common + " --epochs 2 --output " + whole);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("1x32x32, 10 classes"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("in_channels=4 input_size=4"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(6 steps)"), std::string::npos) << r.output;
    const auto w = read_all(whole + "/last.safetensors");
    EXPECT_EQ(w.at("x_embedder.proj.weight").sizes(), (std::vector<int64_t>{32, 4, 2, 2}));
    EXPECT_EQ(w.at("pos_embed").sizes(), (std::vector<int64_t>{1, 4, 32}));

    r = run_cli(base + common + " --epochs 1 --output " + parts);
    ASSERT_EQ(r.status, 0) << r.output;
    r = run_cli(base + common + " --epochs 2 --resume --output " + parts);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("at epoch 1"), std::string::npos) << r.output;
    EXPECT_EQ(max_weight_difference(parts + "/last.safetensors", whole + "/last.safetensors"), 0.0);
    EXPECT_EQ(max_weight_difference(parts + "/ema.safetensors", whole + "/ema.safetensors"), 0.0);
    std::ifstream m1(whole + "/metrics.jsonl"), m2(parts + "/metrics.jsonl");
    std::string l1, l2;
    for (int e = 0; e < 2; ++e) {
        ASSERT_TRUE(std::getline(m1, l1) && std::getline(m2, l2));
        const auto j1 = nlohmann::json::parse(l1), j2 = nlohmann::json::parse(l2);
        for (const char* key : {"loss", "mse", "vb", "steps"}) EXPECT_EQ(j1[key], j2[key]) << key << " epoch " << e + 1;
    }
    // The posterior sample's eps comes from the seed: another seed trains to other weights.
    const std::string reseeded = dir.file("reseeded");
    std::string other_seed = common;
    other_seed.replace(other_seed.find("--seed 3"), 8, "--seed 4");
    r = run_cli(base + other_seed + " --epochs 1 --output " + reseeded);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_GT(max_weight_difference(reseeded + "/last.safetensors", parts + "/last.safetensors"), 1e-4);

    // The trained latent model samples through the VAE decoder of the same file.
    r = run_cli("sample --model dit_s2 --model-kwargs depth=1 hidden_size=32 num_heads=2 input_size=4 in_channels=4 "
                "num_classes=10 --weights " + whole + "/ema.safetensors --steps 3 --labels 0,9 --vae " + vae +
                " --vae-kwargs block_out_channels=32,32,64,64 --no-progress --output " + dir.file("grid.png"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_GT(std::filesystem::file_size(dir.file("grid.png")), 500u);

    // The latents are posterior samples, not the mean: the same VAE with logvar -30 (std ~ 3e-7; quant_conv's
    // logvar half of the bias) trains to other weights; the mean is unchanged, so training on the mean would not.
    {
        auto tensors = read_all(vae);
        tensors["quant_conv.bias"] = tensors["quant_conv.bias"].clone();
        tensors["quant_conv.bias"].slice(0, 4, 8).fill_(-30.0);
        tensors["quant_conv.weight"] = tensors["quant_conv.weight"].clone();
        tensors["quant_conv.weight"].slice(0, 4, 8).zero_();
        linvis::io::save_safetensors(vae, tensors);
    }
    const std::string narrow = dir.file("narrow");
    r = run_cli(base + common + " --epochs 2 --output " + narrow);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_GT(max_weight_difference(narrow + "/last.safetensors", whole + "/last.safetensors"), 1e-4);

    // Resuming with another VAE (the same path, now with other encoder weights) is refused.
    r = run_cli(base + common + " --epochs 3 --resume --output " + parts);
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("belongs to a run with other options"), std::string::npos) << r.output;

    // The DiT must read the VAE's latents: latent channels, and 8 x input_size px images.
    r = run_cli("train --task diffusion --model dit_s2 --model-kwargs depth=1 hidden_size=32 num_heads=2 in_channels=3" +
                common + " --output " + dir.file("e1"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("in_channels=3: latent-space training with --vae " + vae +
                                       " needs the VAE's latent_channels 4"),
              std::string::npos)
        << r.output;
    r = run_cli("train --task diffusion --model dit_s2 --model-kwargs depth=1 hidden_size=32 num_heads=2 input_size=8" +
                common + " --img-size 32 --output " + dir.file("e2"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("input_size=8: latent-space training with --vae needs images of 8 x input_size = 64 px, got 32"),
              std::string::npos)
        << r.output;
    r = run_cli(base + common + " --img-size 36 --output " + dir.file("e3"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("the image size 36 is not a multiple of the VAE's downsampling factor 8"),
              std::string::npos)
        << r.output;
    r = run_cli(base + " --dataset fashion-mnist --limit-train 4 --vae-kwargs latent_channels=4 --output " + dir.file("e4"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(last_line(r.output).find("--vae-kwargs needs --vae FILE"), std::string::npos) << r.output;
}

}  // namespace
