// The linvis command line end to end: exit codes, JSON outputs, file round trips.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "linvis/io/image.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/state_dict.h"
#include "linvis/models/registry.h"
#include "support/cli.h"
#include "support/testing.h"

namespace fs = std::filesystem;

using linvis::testing::run_cli;
using linvis::testing::run_program;

namespace {


std::string last_line(const std::string& text) {
    std::string trimmed = text;
    while (!trimmed.empty() && trimmed.back() == '\n') trimmed.pop_back();
    const auto pos = trimmed.rfind('\n');
    return pos == std::string::npos ? trimmed : trimmed.substr(pos + 1);
}

fs::path temp_dir(const std::string& name) {
    fs::path dir = fs::temp_directory_path() / ("linvis_test_cli_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    return dir;
}

}  // namespace

#if LINVIS_CLI_TCMALLOC
// The command is linked with tcmalloc, and tcmalloc (not glibc) answers its malloc, whatever glibc's
// malloc environment says.
TEST(Cli, MallocIsTcmalloc) {
    for (const std::string env : {"", "MALLOC_TRIM_THRESHOLD_=131072 "}) {
        auto version = run_program("env -u LINVIS_NO_REEXEC " + env + LINVIS_CLI_PATH, "version --format json");
        ASSERT_EQ(version.status, 0) << version.output;
        const std::string malloc = nlohmann::json::parse(last_line(version.output)).value("malloc", std::string());
        EXPECT_EQ(malloc.rfind("tcmalloc", 0), 0u) << env << version.output;
    }
}
#elif defined(__GLIBC__)
// The command restarts itself with glibc's malloc keeping freed memory (runtime::kMallocKeepBytes), unless
// the user set malloc's environment, which is then left alone.
TEST(Cli, StartsWithMallocKeepingFreedMemoryUnlessTheUserChose) {
    const std::string clean = "env -u MALLOC_MMAP_THRESHOLD_ -u MALLOC_TRIM_THRESHOLD_ -u GLIBC_TUNABLES -u LINVIS_NO_REEXEC ";
    auto chosen = run_program(clean + LINVIS_CLI_PATH, "version --format json");
    ASSERT_EQ(chosen.status, 0) << chosen.output;
    EXPECT_EQ(nlohmann::json::parse(last_line(chosen.output)).value("malloc", std::string()), "keep freed memory")
        << chosen.output;
    auto user = run_program(clean + "MALLOC_TRIM_THRESHOLD_=131072 " + LINVIS_CLI_PATH, "version --format json");
    ASSERT_EQ(user.status, 0) << user.output;
    EXPECT_EQ(nlohmann::json::parse(last_line(user.output)).value("malloc", std::string()), "set by the user")
        << user.output;
    auto tunables = run_program(clean + "GLIBC_TUNABLES=glibc.malloc.arena_max=1 " + LINVIS_CLI_PATH, "version");
    ASSERT_EQ(tunables.status, 0) << tunables.output;
    EXPECT_NE(tunables.output.find("malloc: set by the user"), std::string::npos) << tunables.output;
}
#endif

TEST(Cli, HelpVersionAndErrorsExitCodes) {
    EXPECT_EQ(run_cli("--help").status, 0);
    auto version = run_cli("version --format json");
    ASSERT_EQ(version.status, 0) << version.output;
    auto info = nlohmann::json::parse(last_line(version.output));
    EXPECT_TRUE(info.contains("libtorch") && info.contains("blas") && info.contains("simd"));
    // OpenBLAS never runs its generic SSE3 (Prescott) kernels on a CPU with AVX2: where the loaded
    // OpenBLAS does not know the CPU, the command restarts itself with OPENBLAS_CORETYPE set.
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        info.value("blas", std::string()).find("OpenBLAS") != std::string::npos)
        EXPECT_EQ(info.value("blas", std::string()).find("kernels: Prescott"), std::string::npos) << info.dump();
    auto unknown = run_cli("frobnicate");
    EXPECT_NE(unknown.status, 0);
    EXPECT_NE(unknown.output.find("unknown command 'frobnicate'"), std::string::npos);
    auto bad_flag = run_cli("models --bogus");
    EXPECT_NE(bad_flag.status, 0);
    EXPECT_NE(bad_flag.output.find("unknown option '--bogus'"), std::string::npos);
    // Every command answers --help.
    for (const char* command : {"version", "models", "run", "predict", "demo", "bench", "train", "eval", "inspect",
                                "convert-checkpoint"}) {
        auto help = run_cli(std::string(command) + " --help");
        EXPECT_EQ(help.status, 0) << command << ": " << help.output;
        EXPECT_NE(help.output.find("usage: linvis"), std::string::npos) << command;
    }
}

// `version` names where the bf16 attention's products run: LINVIS_AMX=emulate is reported as such, LINVIS_AMX=off
// as off, and an unknown value is an error naming the variable.
TEST(Cli, VersionNamesTheMatrixEngine) {
    const auto engine = [](const std::string& env) {
        const auto r = run_program(env + " " + LINVIS_CLI_PATH, "version --format json");
        EXPECT_EQ(r.status, 0) << r.output;
        return nlohmann::json::parse(last_line(r.output)).value("matrix_engine", std::string("missing"));
    };
    EXPECT_EQ(engine("LINVIS_AMX=emulate"), "AMX emulated");
    EXPECT_EQ(engine("LINVIS_AMX=off"), "off");
    const auto bad = run_program(std::string("LINVIS_AMX=tmm9 ") + LINVIS_CLI_PATH, "version");
    EXPECT_NE(bad.status, 0);
    EXPECT_NE(bad.output.find("LINVIS_AMX"), std::string::npos) << bad.output;
}

TEST(Cli, ModelsJsonListsCountsAndFlops) {
    auto result = run_cli("models --format json --filter _tiny --threads 1");
    ASSERT_EQ(result.status, 0) << result.output;
    auto rows = nlohmann::json::parse(result.output.substr(result.output.find('[')));
    std::map<std::string, nlohmann::json> by_name;
    for (const auto& row : rows) by_name[row["name"]] = row;
    ASSERT_TRUE(by_name.count("vittt_tiny") && by_name.count("deit_tiny") && by_name.count("vil_tiny"));
    EXPECT_EQ(by_name["vittt_tiny"]["params"], 6982384);
    EXPECT_EQ(by_name["deit_tiny"]["params"], 5717416);
    EXPECT_NEAR(by_name["deit_tiny"]["gflops_224"].get<double>(), 1.2537, 0.001);
}

TEST(Cli, RunWritesLogitsAndFeaturesFromWeights) {
    const fs::path dir = temp_dir("run");
    torch::manual_seed(3);
    auto model = linvis::models::create_model("vit3_tiny", linvis::models::ModelConfig()
                                                                 .set("img_size", int64_t{64})
                                                                 .set("depth", int64_t{2})
                                                                 .set("num_classes", int64_t{7}));
    model->eval();
    linvis::io::save_weights(*model, (dir / "w.safetensors").string());
    torch::Tensor input = torch::randn({2, 3, 64, 64});
    linvis::io::save_safetensors((dir / "x.safetensors").string(), {{"input", input}});
    auto result = run_cli("run --model vit3_tiny --model-kwargs depth=2 num_classes=7 --weights " +
                          (dir / "w.safetensors").string() + " --input " + (dir / "x.safetensors").string() +
                          " --output " + (dir / "y.safetensors").string() + " --features --threads 1");
    ASSERT_EQ(result.status, 0) << result.output;
    auto out = linvis::io::SafetensorsFile::open((dir / "y.safetensors").string());
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(linvis::testing::all_close(out.tensor("logits"), model->forward(input), 1e-5, 1e-5));
    EXPECT_EQ(out.tensor("features").sizes(), model->forward_features(input).sizes());
    // A wrong key in the input file names the file and the keys it has.
    linvis::io::save_safetensors((dir / "bad.safetensors").string(), {{"images", input}});
    auto bad = run_cli("run --model vit3_tiny --random-weights --input " + (dir / "bad.safetensors").string() +
                       " --output " + (dir / "z.safetensors").string());
    EXPECT_EQ(bad.status, 1);
    EXPECT_NE(bad.output.find("no tensor named 'input' (has: images)"), std::string::npos) << bad.output;
    // Weights of another shape are refused, naming the mismatched key.
    auto mismatch = run_cli("run --model vit3_tiny --model-kwargs depth=2 --weights " +
                            (dir / "w.safetensors").string() + " --input " + (dir / "x.safetensors").string() +
                            " --output " + (dir / "z.safetensors").string());
    EXPECT_EQ(mismatch.status, 1);
    EXPECT_NE(mismatch.output.find("head.weight"), std::string::npos) << mismatch.output;
}

TEST(Cli, TrainThenEvalOnAnImageFolderWithACorruptImage) {
    const fs::path root = temp_dir("folder");
    for (const char* split : {"train", "val"}) {
        for (int c = 0; c < 2; ++c) {
            fs::create_directories(root / split / ("class" + std::to_string(c)));
            for (int i = 0; i < 6; ++i) {
                torch::Tensor image = torch::full({20, 24, 3}, c == 0 ? 40 : 210, torch::kUInt8);
                linvis::io::write_png((root / split / ("class" + std::to_string(c)) / (std::to_string(i) + ".png")).string(),
                                      image);
            }
        }
    }
    std::ofstream(root / "train" / "class0" / "broken.png") << "not a png";
    const fs::path out = temp_dir("train_out");
    auto train = run_cli("train --model deit_tiny --model-kwargs depth=1 embed_dim=32 num_heads=2 patch_size=8 "
                         "--dataset folder:" + root.string() + " --img-size 32 --epochs 2 --batch-size 4 "
                         "--workers 1 --threads 1 --no-progress --output " + out.string());
    ASSERT_EQ(train.status, 0) << train.output;
    EXPECT_NE(train.output.find("unreadable images skipped"), std::string::npos) << train.output;
    for (const char* file : {"best.safetensors", "last.safetensors", "checkpoint.pt", "metrics.jsonl", "curves.png"})
        EXPECT_TRUE(fs::exists(out / file)) << file;
    auto eval = run_cli("eval --model deit_tiny --model-kwargs depth=1 embed_dim=32 num_heads=2 patch_size=8 "
                        "num_classes=2 --weights " + (out / "last.safetensors").string() + " --dataset folder:" +
                        root.string() + " --img-size 32 --threads 1 --format json");
    ASSERT_EQ(eval.status, 0) << eval.output;
    auto metrics = nlohmann::json::parse(last_line(eval.output));
    EXPECT_EQ(metrics["images"], 12);
    for (const char* key : {"top1", "top5", "loss"}) EXPECT_TRUE(metrics.contains(key)) << key;
}

TEST(Cli, BenchJsonHasTheRequiredFieldsPerCase) {
    const fs::path dir = temp_dir("bench");
    auto result = run_cli("bench --models deit_tiny,vittt_tiny --model-kwargs depth=1 --res 64 --warmup 1 --iters 2 "
                          "--threads 1 --no-gemm --format json --plot " + (dir / "bench.png").string() + " --csv " +
                          (dir / "bench.csv").string());
    ASSERT_EQ(result.status, 0) << result.output;
    auto rows = nlohmann::json::parse(result.output.substr(result.output.find('[')));
    ASSERT_EQ(rows.size(), 2u);
    for (const auto& row : rows) {
        EXPECT_EQ(row["status"], "ok") << row.dump();
        for (const char* key : {"model", "res", "batch", "impl", "images_per_s", "peak_mem_bytes", "gflops",
                                "packed_weight_bytes"})
            EXPECT_TRUE(row.contains(key)) << key;
        EXPECT_GT(row["images_per_s"].get<double>(), 0.0);
        EXPECT_GT(row["peak_mem_bytes"].get<int64_t>(), 0);
    }
    EXPECT_GT(fs::file_size(dir / "bench.png"), 1000u);
    std::ifstream csv(dir / "bench.csv");
    std::string header, line;
    std::getline(csv, header);
    int lines = 0;
    while (std::getline(csv, line)) ++lines;
    EXPECT_EQ(lines, 2);
    EXPECT_EQ(header.rfind("model,res,batch,impl", 0), 0u) << header;
}

namespace {
// The JSON rows of a `linvis bench --format json` run (each case must have succeeded).
nlohmann::json bench_rows(const std::string& args) {
    auto result = run_cli("bench " + args + " --warmup 1 --iters 1 --threads 1 --no-gemm --format json");
    EXPECT_EQ(result.status, 0) << result.output;
    auto rows = nlohmann::json::parse(result.output.substr(result.output.find('[')));
    for (const auto& row : rows) EXPECT_EQ(row["status"], "ok") << row.dump();
    return rows;
}
}  // namespace

TEST(Cli, BenchDiffusionStepSamplerAndTrainingStep) {
    const std::string tiny = " --model-kwargs depth=1 hidden_size=96 num_heads=3 num_classes=10 --res 10";
    auto step = bench_rows("--task denoise --models dit_s2,dit3_s2,dit5_s2" + tiny);
    auto sampler = bench_rows("--task sample --sampler-steps 3 --models dit_s2,dit5_s2" + tiny);
    auto train = bench_rows("--task denoise --train --models dit3_s2" + tiny);
    ASSERT_EQ(step.size(), 3u);
    ASSERT_EQ(sampler.size(), 2u);
    ASSERT_EQ(train.size(), 1u);
    // A guided step runs the model on the doubled batch; the sampler runs it once per step.
    for (int i : {0, 2}) {
        const double per_step = step[i]["gflops"].get<double>();
        EXPECT_GT(per_step, 0.0);
        EXPECT_NEAR(sampler[i / 2]["gflops"].get<double>(), 3 * per_step, 1e-6 * per_step) << step[i]["model"];
    }
    // A training step runs the model on the undoubled batch: at least the products of one plain forward.
    EXPECT_GE(train[0]["gflops"].get<double>(), 0.5 * step[1]["gflops"].get<double>() * (1 - 1e-9));
    // Every fused case was checked against impl=reference (after its timing); bf16 runs, its guided step and its
    // training step (the diffusion's arithmetic in float32, the network in bf16), within the bf16 bound.
    for (const auto* rows : {&step, &sampler, &train})
        for (const auto& row : *rows) {
            EXPECT_GE(row["check_rel_err"].get<double>(), 0.0) << row.dump();
            EXPECT_LT(row["check_rel_err"].get<double>(), 1e-4) << row.dump();
        }
    auto bf16 = bench_rows("--task denoise --dtype bf16 --models dit_s2,dit5_s2" + tiny);
    auto bf16_train = bench_rows("--task denoise --train --dtype bf16 --models dit3_s2" + tiny);
    ASSERT_EQ(bf16.size() + bf16_train.size(), 3u);
    for (const auto* rows : {&bf16, &bf16_train})
        for (const auto& row : *rows) {
            EXPECT_GE(row["check_rel_err"].get<double>(), 0.0) << row.dump();
            EXPECT_LT(row["check_rel_err"].get<double>(), 3e-2) << row.dump();
        }
    // A latent grid below DiT5's 5x5 window is refused with the model's one-line error, and a vision model is not
    // a diffusion model.
    auto small = run_cli("bench --task denoise --models dit5_s2 --model-kwargs depth=1 --res 8 --iters 1 --warmup 1 "
                         "--no-gemm --format json");
    EXPECT_NE(small.output.find("smaller than the 5x5"), std::string::npos) << small.output;
    EXPECT_NE(small.status, 0) << "a run with a failed case must fail";
    // A model option the model refuses: every case reported (the JSON rows, each with its error), then exit 1.
    auto refused = run_cli("bench --models deit_tiny,vittt_tiny --res 32 --iters 1 --warmup 0 --no-gemm --format json "
                           "--model-kwargs grad_checkpointing=maybe");
    EXPECT_EQ(refused.status, 1) << refused.output;
    const size_t begin = refused.output.find('['), end = refused.output.rfind(']');  // the summary line follows
    ASSERT_TRUE(begin != std::string::npos && end != std::string::npos && end > begin) << refused.output;
    const auto rows = nlohmann::json::parse(refused.output.substr(begin, end - begin + 1));
    ASSERT_EQ(rows.size(), 2u);
    for (const auto& row : rows) EXPECT_EQ(row["status"], "error") << row.dump();
    EXPECT_NE(refused.output.find("2 of 2 cases failed"), std::string::npos) << refused.output;
    EXPECT_NE(refused.output.find("expected true/false, got 'maybe'"), std::string::npos) << refused.output;
    auto wrong = run_cli("bench --task denoise --models deit_tiny --res 8 --no-gemm");
    EXPECT_NE(wrong.status, 0);
    EXPECT_NE(wrong.output.find("is not a diffusion model"), std::string::npos) << wrong.output;
}

TEST(Cli, BenchSegmentationHeads) {
    const std::string backbone = "--task segment --models hvit3_tiny --model-kwargs embed_dims=16,16,32,32 "
                                 "depths=1,1,1,1 num_heads=1,1,2,2 --res 64 --batch 2";
    auto upernet = bench_rows(backbone + " --head upernet");
    auto fpn = bench_rows(backbone + " --head fpn --train");
    ASSERT_EQ(upernet.size(), 1u);
    ASSERT_EQ(fpn.size(), 1u);
    EXPECT_EQ(upernet[0]["head"], "upernet");
    EXPECT_EQ(fpn[0]["head"], "fpn");
    // Same backbone, different heads: UperNet's PPM and fusion convs are larger than the FPN head.
    EXPECT_GT(upernet[0]["params"].get<int64_t>(), fpn[0]["params"].get<int64_t>());
}
