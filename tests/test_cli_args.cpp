// Command-line parsing of every linvis subcommand (CLI11, cli/options.h), through the built program: option
// names, defaults, multi-value options, comma lists, positionals, and one-line errors that name the option,
// what it accepts and what it got.
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "linvis/io/safetensors.h"
#include "support/cli.h"
#include "support/temp_dir.h"

using linvis::testing::CommandResult;
using linvis::testing::run_cli;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A rejected command line: exit status 1 and exactly one line, "linvis <command>: error: ...", holding `message`.
void expect_one_line_error(const std::string& arguments, const std::string& message) {
    const CommandResult r = run_cli(arguments);
    EXPECT_EQ(r.status, 1) << arguments << "\n" << r.output;
    std::string text = r.output;
    while (!text.empty() && text.back() == '\n') text.pop_back();
    EXPECT_EQ(text.find('\n'), std::string::npos) << arguments << ": not one line:\n" << r.output;
    EXPECT_EQ(text.rfind("linvis " + arguments.substr(0, arguments.find(' ')) + ": error: ", 0), 0u)
        << arguments << "\n" << r.output;
    EXPECT_TRUE(contains(text, message)) << arguments << "\nexpected: " << message << "\ngot: " << r.output;
}

}  // namespace

TEST(CliArgs, HelpListsEveryOptionOfEveryCommand) {
    // The command-line forms that scripts and the docs use: none may disappear.
    const std::map<std::string, std::vector<std::string>> options = {
        {"version", {"--format", "--threads"}},
        {"models", {"--format", "--filter", "--no-flops", "--res", "--threads"}},
        {"inspect", {"FILE", "--format"}},
        {"convert-checkpoint", {"IN", "OUT", "--model", "--model-kwargs", "--ema", "--non-strict", "--dry-run"}},
        {"predict", {"IMAGE", "--model", "--model-kwargs", "--weights", "--ema", "--non-strict", "--img-size",
                     "--crop-pct", "--top", "--threads"}},
        {"run", {"--model", "--model-kwargs", "--weights", "--ema", "--non-strict", "--input", "--output",
                 "--features", "--dtype", "--threads", "--random-weights", "--seed"}},
        {"demo", {"--models", "--res", "--save-image", "--threads"}},
        {"bench", {"--models", "--model-kwargs", "--res", "--batch", "--threads", "--dtype", "--impl", "--train",
                   "--warmup", "--iters", "--max-seconds", "--case-timeout", "--baseline", "--format", "--csv",
                   "--plot", "--no-gemm"}},
        {"explain", {"IMAGE", "--model", "--model-kwargs", "--weights", "--ema", "--non-strict", "--what", "--output",
                     "--block", "--branch", "--head", "--query", "--img-size", "--decades", "--erf-cells",
                     "--save-map", "--panel-size", "--seed", "--threads"}},
        {"train", {"--model", "--model-kwargs", "--output", "--epochs", "--batch-size", "--accum-steps",
                   "--limit-train", "--lr", "--min-lr", "--warmup-lr", "--warmup-epochs", "--weight-decay",
                   "--smoothing", "--mixup", "--cutmix", "--mixup-prob", "--mixup-switch-prob", "--drop-path",
                   "--clip-grad", "--ema-decay", "--augment", "--no-augment", "--eval-every", "--bf16", "--seed",
                   "--resume", "--init-from", "--new-lr-mult", "--freeze-inherited", "--no-progress", "--dataset",
                   "--data-dir", "--img-size", "--limit-eval", "--eval-batch-size", "--workers", "--threads"}},
        {"eval", {"--model", "--model-kwargs", "--weights", "--ema", "--non-strict", "--dataset", "--data-dir",
                  "--img-size", "--limit-eval", "--eval-batch-size", "--workers", "--threads", "--format", "--bf16"}},
    };
    for (const auto& [command, names] : options) {
        const CommandResult help = run_cli(command + " --help");
        EXPECT_EQ(help.status, 0) << command << ": " << help.output;
        EXPECT_TRUE(contains(help.output, "usage: linvis " + command)) << help.output;
        for (const auto& name : names) EXPECT_TRUE(contains(help.output, name + " ")) << command << " " << name;
    }
    // Defaults and choice sets are shown.
    const std::string bench = run_cli("bench --help").output;
    for (const char* shown : {"--impl auto|reference|fused=auto", "--dtype f32|bf16=f32", "--format table|json=table",
                              "=deit_tiny,vittt_tiny,vit3_tiny,vil_tiny", "=224,384,512,768,1024,1280",
                              "--max-seconds FLOAT=60", "--threads INT=0"})
        EXPECT_TRUE(contains(bench, shown)) << shown << "\n" << bench;
    EXPECT_TRUE(contains(run_cli("explain --help").output, "REQUIRED"));
    // The command list and unknown commands are main()'s, as before.
    EXPECT_EQ(run_cli("help").status, 0);
    EXPECT_EQ(run_cli("").status, 1);
    EXPECT_EQ(run_cli("frobnicate --help").status, 2);
}

TEST(CliArgs, RejectsUnknownOptionsExtraArgumentsAndMissingValues) {
    expect_one_line_error("models --bogus", "unknown option '--bogus' (see 'linvis models --help')");
    expect_one_line_error("models --bogus=3 --format json", "unknown option '--bogus'");
    expect_one_line_error("inspect a.safetensors b.safetensors", "unexpected argument 'b.safetensors'");
    expect_one_line_error("models --res 224 512", "unexpected argument '512'");  // a list is one argument
    expect_one_line_error("version --format", "--format");                       // the value is missing
    expect_one_line_error("run --model-kwargs", "--model-kwargs");
    expect_one_line_error("run --input x.safetensors --output y.safetensors", "--model is required");
    expect_one_line_error("inspect --format json", "FILE is required");
    expect_one_line_error("predict --model deit_tiny photo.jpg", "--weights is required");
    expect_one_line_error("convert-checkpoint a.pth b.safetensors --model-kwargs depth=2", "--model");
    expect_one_line_error("models --no-flops=1", "no-flops");  // a flag takes no value
}

TEST(CliArgs, RejectsBadNumbersAndChoicesNamingTheAcceptedValues) {
    expect_one_line_error("version --threads two", "--threads expects an integer, got 'two'");
    expect_one_line_error("version --threads 0x10", "--threads expects an integer, got '0x10'");
    expect_one_line_error("version --threads=2.5", "--threads expects an integer, got '2.5'");
    expect_one_line_error("predict --model deit_tiny --weights w.safetensors --img-size 0 x.png",
                          "--img-size expects an integer >= 1, got '0'");
    expect_one_line_error("predict --model deit_tiny --weights w.safetensors --crop-pct most x.png",
                          "--crop-pct expects a number, got 'most'");
    expect_one_line_error("train --model deit_tiny --output o --dataset fashion-mnist --lr 1e-3x",
                          "--lr expects a number, got '1e-3x'");
    expect_one_line_error("train --model deit_tiny --output o --dataset fashion-mnist --drop-path high",
                          "--drop-path expects a number, got 'high'");
    expect_one_line_error("train --model deit_tiny --output o --dataset fashion-mnist --opt-eps 0",
                          "--opt-eps expects a number >= 1e-30, got '0'");
    expect_one_line_error("train --task segmentation --model hvit3_tiny --output o --dataset folder:d --opt-eps -1",
                          "--opt-eps expects a number >= 1e-30, got '-1'");
    expect_one_line_error("models --res 224,x", "--res expects comma-separated integers, got 'x'");
    expect_one_line_error("version --format xml", "--format must be text or json, got 'xml'");
    expect_one_line_error("inspect --format yaml f.safetensors", "--format must be text or json, got 'yaml'");
    expect_one_line_error("bench --format text", "--format must be table or json, got 'text'");
    expect_one_line_error("bench --impl turbo", "--impl must be auto, reference or fused, got 'turbo'");
    expect_one_line_error("bench --dtype f64", "--dtype must be f32 or bf16, got 'f64'");
    expect_one_line_error("bench --models deit_tiny@turbo",
                          "'deit_tiny@turbo': the implementation after '@' must be auto, reference or fused");
    expect_one_line_error("bench --models deit_tiny,nosuch", "--models: unknown model 'nosuch'");
    expect_one_line_error("run --model deit_tiny --random-weights --input x --output y --dtype f16",
                          "--dtype must be f32, f64 or bf16, got 'f16'");
    expect_one_line_error("train --model deit_tiny --output o --dataset fashion-mnist --augment more",
                          "--augment must be full, flip or none, got 'more'");
    expect_one_line_error("explain --model deit_tiny --what heat --output x.png",
                          "--what must be erf, gradmap or attention, got 'heat'");
    expect_one_line_error("explain --model deit_tiny --what erf --output x.png --erf-cells -1",
                          "--erf-cells expects an integer >= 0, got '-1'");
    expect_one_line_error("run --model deit_tiny --model-kwargs depth --random-weights --input x --output y",
                          "--model-kwargs: expected key=value, got 'depth'");
}

TEST(CliArgs, MultiValueOptionsCommaListsPositionalsAndDefaults) {
    linvis::testing::TempDir dir("linvis_cli_args");
    const std::string input = (dir.path / "x.safetensors").string(), output = (dir.path / "y.safetensors").string();
    linvis::io::save_safetensors(input, {{"input", torch::randn({2, 3, 32, 32})}});
    // --model-kwargs takes every value up to the next option and a second --model-kwargs adds to the first (a
    // later key wins); a negative number is a value and --seed=N the inline form. --dtype and --features keep their
    // defaults.
    CommandResult r = run_cli("run --model vit3_tiny --model-kwargs depth=1 num_classes=5 --random-weights "
                              "--model-kwargs num_classes=7 --seed=-1 --threads 1 --input " + input + " --output " +
                              output);
    ASSERT_EQ(r.status, 0) << r.output;
    auto out = linvis::io::SafetensorsFile::open(output);
    EXPECT_EQ(out.tensor("logits").sizes(), (std::vector<int64_t>{2, 7}));
    EXPECT_EQ(out.tensor("logits").scalar_type(), torch::kFloat32);
    EXPECT_FALSE(out.contains("features"));
    EXPECT_EQ(out.metadata().at("dtype"), "f32");
    // A positional before the options, a later value replacing an earlier one.
    r = run_cli("inspect " + output + " --format text --format=json");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_EQ(nlohmann::json::parse(r.output)["tensor_count"], 1);
    // A comma list is one argument (empty items skipped); given twice, the last one counts.
    r = run_cli("models --filter deit_tiny --no-flops --res 32,,48 --format json --threads 1");
    ASSERT_EQ(r.status, 0) << r.output;
    auto rows = nlohmann::json::parse(r.output.substr(r.output.find('[')));
    ASSERT_FALSE(rows.empty());
    EXPECT_TRUE(rows[0].contains("gflops_32") && rows[0].contains("gflops_48")) << rows[0].dump();
    r = run_cli("models --filter deit_tiny --no-flops --res 32 --res 48 --format json --threads 1");
    ASSERT_EQ(r.status, 0) << r.output;
    rows = nlohmann::json::parse(r.output.substr(r.output.find('[')));
    EXPECT_TRUE(!rows[0].contains("gflops_32") && rows[0].contains("gflops_48")) << rows[0].dump();
}
