// Distributed training (linvis/train/distributed.h) on c10d's Gloo over 127.0.0.1:
//   * the sampler's shards and synchronised BatchNorm's numerics, in process;
//   * 'linvis train --nproc-per-node 2' against one process on the same global batch (the weights
//     agree to float32 tolerance), for a ViT (DeiT) and a BatchNorm model (H-ViT3);
//   * a worker killed (SIGKILL) or hung (SIGSTOP) mid-training: the others stop within the timeout,
//     the launcher names the rank, and the last checkpoint resumes with a different world size.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "linvis/io/image.h"
#include "linvis/io/safetensors.h"
#include "linvis/nn/batch_norm.h"
#include "linvis/train/data.h"
#include "linvis/train/datasets.h"
#include "linvis/train/distributed.h"
#include "support/cli.h"
#include "support/fixtures.h"
#include "support/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using linvis::testing::run_cli;
using linvis::testing::TempDir;

// ---------------------------------------------------------------- shards

TEST(DistributedSampler, ShardsArePaddedDisjointAndCoverTheOrder) {
    const std::vector<int64_t> order{7, 3, 9, 0, 4};
    const auto a = linvis::train::shard_order(order, 0, 2, true);
    const auto b = linvis::train::shard_order(order, 1, 2, true);
    EXPECT_EQ(a, (std::vector<int64_t>{7, 9, 4}));
    EXPECT_EQ(b, (std::vector<int64_t>{3, 0, 7}));  // padded with the order's first entry
    EXPECT_EQ(linvis::train::shard_length(5, 1, 2, true), 3);
    // Without padding (evaluation): disjoint, every entry once.
    const auto c = linvis::train::shard_order(order, 0, 2, false);
    const auto d = linvis::train::shard_order(order, 1, 2, false);
    EXPECT_EQ(c, (std::vector<int64_t>{7, 9, 4}));
    EXPECT_EQ(d, (std::vector<int64_t>{3, 0}));
    EXPECT_EQ(linvis::train::shard_length(5, 1, 2, false), 2);
    EXPECT_THROW(linvis::train::shard_order(order, 2, 2, true), linvis::Error);
}

// Global batch b of one process is the union of batch b of every shard (same seed and epoch).
TEST(DistributedSampler, ShardBatchesTogetherAreTheSingleProcessBatch) {
    const int64_t n = 24;
    torch::Tensor images = torch::arange(n, torch::kFloat32).view({n, 1, 1, 1}).expand({n, 1, 4, 4}).contiguous();
    torch::Tensor labels = torch::arange(n, torch::kLong);
    linvis::train::TensorBatchSource single(images, labels, 8, true, 11, {1, true}, true);
    linvis::train::TensorBatchSource r0(images, labels, 8, true, 11, {1, true}, true);
    linvis::train::TensorBatchSource r1(images, labels, 8, true, 11, {1, true}, true);
    r0.shard(0, 2, true);
    r1.shard(1, 2, true);
    for (int64_t epoch : {0, 3}) {
        single.start_epoch(epoch);
        r0.start_epoch(epoch);
        r1.start_epoch(epoch);
        ASSERT_EQ(r0.batches_per_epoch(), single.batches_per_epoch());
        torch::Tensor xs, ys, x0, y0, x1, y1;
        std::set<int64_t> epoch_labels;
        while (single.next(xs, ys)) {
            ASSERT_TRUE(r0.next(x0, y0) && r1.next(x1, y1));
            EXPECT_EQ(y0.size(0), 4);
            // Same examples with the same augmentation, in another row order.
            torch::Tensor xs_sorted = xs.index_select(0, std::get<1>(ys.sort()));
            torch::Tensor yd = torch::cat({y0, y1});
            torch::Tensor xd_sorted = torch::cat({x0, x1}).index_select(0, std::get<1>(yd.sort()));
            EXPECT_TRUE(torch::equal(std::get<0>(ys.sort()), std::get<0>(yd.sort())));
            EXPECT_TRUE(torch::equal(xs_sorted, xd_sorted));
            for (int64_t i = 0; i < ys.size(0); ++i) epoch_labels.insert(ys[i].item<int64_t>());
        }
        EXPECT_EQ(static_cast<int64_t>(epoch_labels.size()), n);
    }
    linvis::train::TensorBatchSource odd(images, labels, 7, true, 11, {}, true);
    EXPECT_THROW(odd.shard(0, 2, true), linvis::Error);  // the global batch must split evenly
}

TEST(DistributedSampler, DataLoaderShardsTheEpochOrder) {
    auto dataset = std::make_shared<linvis::train::InMemoryDataset>(
        "tiny", torch::zeros({10, 2, 2, 1}, torch::kUInt8), torch::arange(10, torch::kLong) % 2,
        std::vector<std::string>{"a", "b"});
    linvis::train::DataLoaderOptions options;
    options.batch_size = 2;
    options.num_workers = 0;
    options.seed = 5;
    linvis::train::DataLoader whole(dataset, options), shard(dataset, options);
    shard.set_shard(1, 3, true, 2);
    const auto order = whole.epoch_order(2);
    EXPECT_EQ(shard.epoch_order(2), linvis::train::shard_order(order, 1, 3, true));
    EXPECT_EQ(shard.batches_per_epoch(), 2);  // ceil(10 / 3) = 4 examples
}

// ---------------------------------------------------------------- synchronised BatchNorm

// With the identity as the cross-process sum (one process), synchronised BatchNorm is torch's:
// output, input and parameter gradients, running statistics.
TEST(SyncBatchNorm, OneProcessMatchesTorchBatchNorm) {
    torch::manual_seed(3);
    for (int dims : {3, 4}) {
        torch::Tensor x = torch::randn(dims == 4 ? std::vector<int64_t>{4, 5, 3, 2} : std::vector<int64_t>{6, 5, 7}) * 3 + 1;
        torch::nn::BatchNorm2d bn2(5);
        torch::nn::BatchNorm1d bn1(5);
        torch::nn::Module& ref_module = dims == 4 ? static_cast<torch::nn::Module&>(*bn2) : *bn1;
        {
            torch::NoGradGuard no_grad;
            for (auto& p : ref_module.parameters()) p.uniform_(0.5, 1.5);
        }
        auto run = [&](bool sync) {
            torch::nn::BatchNorm2d b2(5);
            torch::nn::BatchNorm1d b1(5);
            torch::nn::Module& m = dims == 4 ? static_cast<torch::nn::Module&>(*b2) : *b1;
            {
                torch::NoGradGuard no_grad;
                auto src = ref_module.named_parameters();
                for (auto& p : m.named_parameters()) p.value().copy_(src[p.key()]);
            }
            if (sync) linvis::nn::set_batch_norm_sync([](const torch::Tensor& t) { return t * 1.0; });
            torch::Tensor input = x.clone().requires_grad_(true);
            torch::Tensor y = dims == 4 ? linvis::nn::batch_norm(*b2, input) : linvis::nn::batch_norm(*b1, input);
            linvis::nn::set_batch_norm_sync({});
            (y * torch::linspace(-1, 2, y.numel()).view(y.sizes())).sum().backward();
            std::vector<torch::Tensor> out{y.detach(), input.grad()};
            for (auto& p : m.parameters()) out.push_back(p.grad());
            for (auto& b : m.buffers()) out.push_back(b.clone());
            return out;
        };
        const auto ref = run(false), got = run(true);
        ASSERT_EQ(ref.size(), got.size());
        for (size_t i = 0; i < ref.size(); ++i)
            EXPECT_TRUE(torch::allclose(got[i].to(torch::kFloat64), ref[i].to(torch::kFloat64), 1e-4, 1e-5))
                << "dims " << dims << " tensor " << i << ": max diff "
                << (got[i].to(torch::kFloat64) - ref[i].to(torch::kFloat64)).abs().max().item<double>();
    }
}

// ---------------------------------------------------------------- the gradient reducer

// On a process group of one (Gloo, a TCPStore on a free port): the buckets start while backward still
// runs, accumulation over micro-batches that do not synchronise is kept, and the result is the gradient.
TEST(GradientReducer, StartsBucketsDuringBackwardAndKeepsAccumulatedGradients) {
    linvis::train::DistributedEnv env;
    env.master_port = 0;  // the store picks a free port: nobody else has to find it
    auto dist = linvis::train::Distributed::create(env, "gloo", 30.0);
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(6, 5), torch::nn::Tanh(), torch::nn::Linear(5, 4),
                                torch::nn::Tanh(), torch::nn::Linear(4, 3));
    torch::nn::Sequential twin(torch::nn::Linear(6, 5), torch::nn::Tanh(), torch::nn::Linear(5, 4),
                               torch::nn::Tanh(), torch::nn::Linear(4, 3));
    {
        torch::NoGradGuard no_grad;
        auto src = model->named_parameters();
        for (auto& p : twin->named_parameters()) p.value().copy_(src[p.key()]);
    }
    // Registered before the reducer's own hooks, so it runs first: what had started when the first
    // layer's weight gradient (among the last of the backward pass) arrived.
    int64_t started_when_first_layer_done = -1;
    linvis::train::GradientReducer* observed = nullptr;
    model->ptr(0)->named_parameters()["weight"].register_hook(
        [&](torch::Tensor) { started_when_first_layer_done = observed->buckets_started(); });
    // Buckets of at most 20 floats: the three layers' weights and biases make several.
    linvis::train::GradientReducer reducer(*model, dist, 80, 80);
    observed = &reducer;
    ASSERT_GE(reducer.num_buckets(), 3);
    const torch::Tensor x1 = torch::randn({7, 6}), x2 = torch::randn({7, 6});
    reducer.prepare(false);  // a micro-batch that only accumulates
    model->forward(x1).square().sum().backward();
    reducer.prepare(true);
    model->forward(x2).square().sum().backward();
    EXPECT_GE(started_when_first_layer_done, 1);  // later layers' buckets were on their way
    EXPECT_LT(started_when_first_layer_done, reducer.num_buckets());
    reducer.finish();
    (twin->forward(x1).square().sum() + twin->forward(x2).square().sum()).backward();
    auto expected = twin->named_parameters();
    for (auto& p : model->named_parameters())
        EXPECT_TRUE(torch::allclose(p.value().grad(), expected[p.key()].grad(), 1e-5, 1e-6)) << p.key();
}

// ---------------------------------------------------------------- two processes against one

// AdamW's eps is 1e-5, not 1e-8: with 1e-8 the step of a parameter whose gradient is rounding noise is +-lr
// whatever the noise, so runs that sum in another order (one process against two) drift apart by up to 2 lr per
// step (H-ViT3: 7e-5 to 3.4e-4 seen, wherever its patch-merging convs, scale-invariant under the BatchNorm that
// follows, have near-zero gradients); with 1e-5 such a step is lr * gradient / eps, and the runs differ by
// rounding only (at most 7.2e-7 seen for the three models below, on two LibTorch builds).
std::string common_args(const std::string& model) {
    return "train --model " + model +
           " --dataset fashion-mnist --limit-train 64 --limit-eval 40 --batch-size 16 --epochs 2 --lr 1e-3 "
           "--opt-eps 1e-5 --warmup-epochs 0 --mixup 0 --cutmix 0 --drop-path 0 --smoothing 0.1 --clip-grad 1.0 "
           "--ema-decay 0.9 --no-progress --seed 5 --dist-timeout 60";
}

std::map<std::string, torch::Tensor> weights(const fs::path& file) {
    return linvis::io::SafetensorsFile::open(file.string()).load_all();
}

std::vector<nlohmann::json> metrics(const fs::path& dir) {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
    return out;
}

// H-ViT3's patch merging is conv 1x1 + ReLU, depthwise conv 3x3 + ReLU, conv 1x1, BatchNorm. The norm
// subtracts any per-channel shift, so the last conv's bias has a zero gradient, and so do the earlier
// biases wherever the ReLUs pass everything (a channel bias then reaches the norm as a shift too).
// AdamW turns the rounding noise of those gradients into steps of +-lr, so these biases, and the
// running means they shift, differ between any two runs whose sums round differently; what the
// network computes with them is compared through the losses. The same holds for the merging convs'
// weights, scale-invariant under the norm (no radial gradient) and, where a ReLU passes almost nothing,
// driven by noise alone: a rounding change of the depthwise-conv kernels alone (one process both times,
// 2026-11-28) moved one channel of layers.0.downsample.conv.1 by 1.2e-3 while every other entry of that
// tensor stayed within 1.1e-4, and every weight outside the mergings within 2.6e-4.
// Likewise the features_only backbone's output LayerNorms norm{i} of a segmentation model: each feeds
// only a 1x1 conv + BatchNorm of the decode head, which removes a per-channel shift, so their biases
// get zero gradients too.
bool noise_driven(const std::string& name) {
    if (name.rfind("backbone.norm", 0) == 0 && name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0)
        return true;
    if (name.find(".downsample.conv.") == std::string::npos) return false;
    for (const std::string suffix : {".conv.bias", ".conv.weight", ".norm.running_mean"})
        if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
            return true;
    return false;
}

// Largest |a - b| over every tensor (both files hold the same names).
// The tensor of the last max_abs_difference's largest difference (for failure messages).
std::string worst_name;

double max_abs_difference(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
    EXPECT_EQ(a.size(), b.size());
    double worst = 0.0;
    for (const auto& [name, tensor] : b) {
        auto it = a.find(name);
        if (it == a.end()) {
            ADD_FAILURE() << "missing " << name;
            continue;
        }
        if (noise_driven(name)) continue;
        const double d = (it->second.to(torch::kFloat64) - tensor.to(torch::kFloat64)).abs().max().item<double>();
        if (d > worst) worst = d, worst_name = name;
    }
    return worst;
}

// Weights to rounding (common_args says why AdamW keeps them there); half the global batch differs by over 6e-3.
void expect_two_processes_match_one(const std::string& model, const std::string& extra, int64_t steps_per_epoch) {
    TempDir one("dist_one"), two("dist_two"), half("dist_half");
    const auto single = run_cli(common_args(model) + extra + " --threads 1 --output " + one.path.string());
    ASSERT_EQ(single.status, 0) << single.output;
    const auto pair = run_cli(common_args(model) + extra + " --nproc-per-node 2 --output " + two.path.string());
    ASSERT_EQ(pair.status, 0) << pair.output;
    // Only rank 0 wrote, and it wrote everything.
    for (const char* file : {"last.safetensors", "best.safetensors", "checkpoint.pt", "metrics.jsonl", "curves.png"})
        EXPECT_TRUE(fs::exists(two.path / file)) << file;
    const double diff = max_abs_difference(weights(two.path / "last.safetensors"), weights(one.path / "last.safetensors"));
    EXPECT_LT(diff, 1e-5) << model << ": " << worst_name;
    // Metrics are of the global batch and the whole evaluation split.
    const auto m1 = metrics(one.path), m2 = metrics(two.path);
    ASSERT_EQ(m1.size(), 2u);
    ASSERT_EQ(m2.size(), 2u);
    for (size_t e = 0; e < 2; ++e) {
        EXPECT_NEAR(m2[e]["train_loss"].get<double>(), m1[e]["train_loss"].get<double>(), 1e-4);
        EXPECT_EQ(m2[e]["eval"]["images"], 40);
        EXPECT_NEAR(m2[e]["eval"]["loss"].get<double>(), m1[e]["eval"]["loss"].get<double>(), 1e-4);
        EXPECT_NEAR(m2[e]["eval"]["top1"].get<double>(), m1[e]["eval"]["top1"].get<double>(), 1e-9);
        EXPECT_EQ(m2[e]["world_size"], 2);
        EXPECT_EQ(m2[e]["steps"], steps_per_epoch);
    }
    // The comparison can tell runs apart: half the global batch trains to other weights.
    const auto other = run_cli(common_args(model) + extra + " --threads 1 --batch-size 8 --output " + half.path.string());
    ASSERT_EQ(other.status, 0) << other.output;
    EXPECT_GT(max_abs_difference(weights(half.path / "last.safetensors"), weights(one.path / "last.safetensors")), 1e-3);
}

TEST(DistributedTraining, TwoProcessesMatchOneOnTheSameGlobalBatchDeit) {
    // Gradient accumulation: 4 batches of 16 per epoch, an optimiser step every 2.
    expect_two_processes_match_one("deit_tiny", " --model-kwargs depth=2 embed_dim=32 num_heads=2 --accum-steps 2", 2);
}

// Vittt recomputes its scans in the backward (recompute_scans): the parameters inside the recomputed segment
// get their gradients from a backward run within the backward, and the reducer must see each of them once.
TEST(DistributedTraining, TwoProcessesMatchOneWithRecomputedScans) {
    expect_two_processes_match_one("vittt_tiny", " --model-kwargs depth=2 embed_dim=32 num_heads=2", 4);
}

// H-ViT3 has BatchNorm: its statistics must be those of the global batch.
TEST(DistributedTraining, TwoProcessesMatchOneWithSynchronisedBatchNorm) {
    expect_two_processes_match_one("hvit3_tiny",
                                   " --img-size 32 --model-kwargs embed_dims=16,16,32,32 depths=1,1,1,1 num_heads=1,1,2,2",
                                   4);
}

// ---------------------------------------------------------------- launch errors

TEST(DistributedLaunch, ErrorsNameTheOptionOrVariable) {
    TempDir dir("dist_errors");
    const std::string args = "train --model deit_tiny --model-kwargs depth=1 embed_dim=32 num_heads=2 --dataset "
                             "fashion-mnist --limit-train 32 --limit-eval 16 --batch-size 16 --epochs 1 --no-progress "
                             "--output " + (dir.path / "run").string();
    auto nccl = run_cli(args + " --dist-backend nccl");
    EXPECT_EQ(nccl.status, 1);
    EXPECT_NE(nccl.output.find("--dist-backend nccl: needs CUDA GPUs"), std::string::npos) << nccl.output;
    auto bad_env = linvis::testing::run_program("RANK=0 WORLD_SIZE=two " + std::string(LINVIS_CLI_PATH), args);
    EXPECT_EQ(bad_env.status, 1);
    EXPECT_NE(bad_env.output.find("environment variable WORLD_SIZE: expected an integer"), std::string::npos)
        << bad_env.output;
    // Rank 0 of 2 alone: the rendezvous gives up after --dist-timeout, naming the rank and the address.
    auto alone = linvis::testing::run_program("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29653 " +
                                                  std::string(LINVIS_CLI_PATH),
                                              args + " --dist-timeout 2");
    EXPECT_EQ(alone.status, 1);
    EXPECT_NE(alone.output.find("rank 0: could not join the process group of 2 at 127.0.0.1:29653 within 2 s"),
              std::string::npos)
        << alone.output;
    auto odd = run_cli(args + " --nproc-per-node 3");
    EXPECT_NE(odd.status, 0);
    EXPECT_NE(odd.output.find("--batch-size 16 (the global batch) must be divisible by the number of processes, 3"),
              std::string::npos)
        << odd.output;
}

// ---------------------------------------------------------------- faults

struct Background {
    pid_t pid = -1;
    fs::path log;
};

Background start_cli(const std::string& arguments, const fs::path& log) {
    Background b;
    b.log = log;
    b.pid = fork();
    if (b.pid == 0) {
        const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        setpgid(0, 0);
        execl("/bin/sh", "sh", "-c", ("exec " + std::string(LINVIS_CLI_PATH) + " " + arguments).c_str(),
              static_cast<char*>(nullptr));
        _exit(127);
    }
    return b;
}

std::vector<pid_t> children_of(pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
    std::vector<pid_t> out;
    pid_t child;
    while (in >> child) out.push_back(child);
    return out;
}

// Waits up to `seconds` for the process; its exit status, or -1 (killed then) when it did not end.
int wait_for(pid_t pid, double seconds, int* raw_status = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
        if (waitpid(pid, &status, WNOHANG) == pid) {
            if (raw_status) *raw_status = status;
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

std::string read_file(const fs::path& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

const std::string kFaultArgs =
    "train --model deit_tiny --model-kwargs depth=1 embed_dim=32 num_heads=2 --dataset fashion-mnist "
    "--limit-train 1024 --limit-eval 32 --batch-size 16 --epochs 4 --no-progress --seed 1 --drop-path 0 --mixup 0 "
    "--cutmix 0 ";

// Starts two workers, waits for the first epoch's checkpoint and returns the launcher and its workers.
Background start_pair(const fs::path& out, double timeout_s, std::vector<pid_t>& workers,
                      const std::string& args = kFaultArgs) {
    Background launcher = start_cli(args + "--threads 1 --nproc-per-node 2 --dist-timeout " + std::to_string(timeout_s) +
                                        " --output " + out.string(),
                                    out.parent_path() / (out.filename().string() + ".log"));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!fs::exists(out / "checkpoint.pt") && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    workers = children_of(launcher.pid);
    return launcher;
}

TEST(DistributedFaults, KilledWorkerStopsTheOthersAndTheCheckpointResumesOnOneProcess) {
    TempDir dir("dist_kill");
    const fs::path out = dir.path / "run";
    std::vector<pid_t> workers;
    Background launcher = start_pair(out, 20.0, workers);
    ASSERT_TRUE(fs::exists(out / "checkpoint.pt")) << read_file(launcher.log);
    ASSERT_EQ(workers.size(), 2u) << read_file(launcher.log);
    ASSERT_EQ(kill(workers[1], SIGKILL), 0);
    // The launcher and rank 0 stop well within the timeout (20 s; rank 0 sees the connection drop).
    const int status = wait_for(launcher.pid, 20.0 + 10.0);
    const std::string log = read_file(launcher.log);
    ASSERT_NE(status, -1) << "the launcher did not stop within the timeout:\n" << log;
    EXPECT_EQ(status, 1) << log;
    EXPECT_NE(log.find("linvis train: error: rank 1 was killed by signal 9"), std::string::npos) << log;
    EXPECT_NE(kill(workers[0], 0), 0) << "rank 0 is still running";
    // The last complete checkpoint resumes, on one process.
    const auto resumed = run_cli(kFaultArgs + "--threads 1 --resume --output " + out.string());
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    EXPECT_EQ(resumed.output.find("epoch 1:"), std::string::npos) << resumed.output;  // continued, not restarted
    EXPECT_EQ(metrics(out).back()["epoch"], 3);
}

TEST(DistributedFaults, HungWorkerIsNamedAfterTheTimeout) {
    TempDir dir("dist_hang");
    const fs::path out = dir.path / "run";
    std::vector<pid_t> workers;
    Background launcher = start_pair(out, 4.0, workers);
    ASSERT_TRUE(fs::exists(out / "checkpoint.pt")) << read_file(launcher.log);
    ASSERT_EQ(workers.size(), 2u) << read_file(launcher.log);
    ASSERT_EQ(kill(workers[1], SIGSTOP), 0);
    const int status = wait_for(launcher.pid, 4.0 + 11.0 + 10.0);
    const std::string log = read_file(launcher.log);
    kill(workers[1], SIGKILL);  // in case the launcher did not stop it
    ASSERT_NE(status, -1) << "the launcher did not stop:\n" << log;
    EXPECT_EQ(status, 1) << log;
    EXPECT_NE(log.find("linvis train: error: rank 1 stopped making progress"), std::string::npos) << log;
    EXPECT_NE(log.find("rank 0 of 2: all-reduce failed"), std::string::npos) << log;
}

// Starts a 2-process run of `args` writing to `out`, lets it write a checkpoint, sends SIGINT to the
// launcher and checks that the run stops with status 130 after rank 0 saved exactly once.
void interrupt_pair_once(const fs::path& out, const std::string& args) {
    std::vector<pid_t> workers;
    Background launcher = start_pair(out, 60.0, workers, args);
    ASSERT_TRUE(fs::exists(out / "checkpoint.pt")) << read_file(launcher.log);
    ASSERT_EQ(kill(launcher.pid, SIGINT), 0);
    const int status = wait_for(launcher.pid, 60.0);
    const std::string log = read_file(launcher.log);
    ASSERT_EQ(status, 130) << log;
    size_t saves = 0;
    for (size_t at = log.find("interrupted: saved"); at != std::string::npos; at = log.find("interrupted: saved", at + 1))
        ++saves;
    EXPECT_EQ(saves, 1u) << log;
}

// Ctrl-C on the launcher: every worker stops at the same step, rank 0 saves once; the run then
// continues on one process and ends where an uninterrupted one-process run ends.
TEST(DistributedFaults, InterruptSavesOnceAndResumesWithADifferentWorldSize) {
    TempDir dir("dist_int");
    const fs::path out = dir.path / "run", reference = dir.path / "reference";
    ASSERT_NO_FATAL_FAILURE(interrupt_pair_once(out, kFaultArgs));
    const auto resumed = run_cli(kFaultArgs + "--threads 1 --resume --output " + out.string());
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    EXPECT_EQ(resumed.output.find("epoch 1:"), std::string::npos) << resumed.output;  // continued, not restarted
    const auto uninterrupted = run_cli(kFaultArgs + "--threads 1 --output " + reference.string());
    ASSERT_EQ(uninterrupted.status, 0) << uninterrupted.output;
    // 256 AdamW steps: float32 rounding differences of the all-reduce move near-zero weights by up to a
    // fraction of one step (lr 5e-4); the losses agree closely.
    EXPECT_LT(max_abs_difference(weights(out / "last.safetensors"), weights(reference / "last.safetensors")), 1e-3);
    const auto resumed_metrics = metrics(out), reference_metrics = metrics(reference);
    ASSERT_EQ(resumed_metrics.size(), 4u);
    ASSERT_EQ(reference_metrics.size(), 4u);
    EXPECT_NEAR(resumed_metrics.back()["train_loss"].get<double>(), reference_metrics.back()["train_loss"].get<double>(),
                1e-5);
    EXPECT_NEAR(resumed_metrics.back()["eval"]["loss"].get<double>(),
                reference_metrics.back()["eval"]["loss"].get<double>(), 1e-4);
}

// ---------------------------------------------------------------- diffusion (linvis train --task diffusion)

std::string diffusion_args() {
    return "train --task diffusion --model dit_s4 --model-kwargs depth=1 hidden_size=32 num_heads=2 --dataset "
           "fashion-mnist --limit-train 64 --batch-size 16 --epochs 2 --lr 1e-3 --ema-decay 0.9 --no-progress "
           "--seed 5 --dist-timeout 60";
}

// Every rank draws t, noise and the label-dropout mask of the whole global batch and keeps its rows: two
// processes compute what one computes on the same global batch.
TEST(DistributedDiffusion, TwoProcessesMatchOneOnTheSameGlobalBatch) {
    if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
        GTEST_SKIP() << "no Fashion-MNIST in /usr/share/datasets/fashion-mnist";
    TempDir one("ddiff_one"), two("ddiff_two"), half("ddiff_half");
    const auto single = run_cli(diffusion_args() + " --threads 1 --output " + one.path.string());
    ASSERT_EQ(single.status, 0) << single.output;
    const auto pair = run_cli(diffusion_args() + " --nproc-per-node 2 --output " + two.path.string());
    ASSERT_EQ(pair.status, 0) << pair.output;
    EXPECT_NE(pair.output.find("2 processes, 8 images per process and batch"), std::string::npos) << pair.output;
    EXPECT_NE(pair.output.find("(8 steps)"), std::string::npos) << pair.output;
    // Only rank 0 printed the summary and wrote, and it wrote everything.
    size_t summaries = 0;
    for (size_t at = pair.output.find("trained dit_s4"); at != std::string::npos; at = pair.output.find("trained dit_s4", at + 1))
        ++summaries;
    EXPECT_EQ(summaries, 1u) << pair.output;
    for (const char* file : {"last.safetensors", "ema.safetensors", "checkpoint.pt", "metrics.jsonl"})
        EXPECT_TRUE(fs::exists(two.path / file)) << file;
    // 8 AdamW steps of lr 1e-3: float32 rounding of the sums moves a weight by a small fraction of a step.
    EXPECT_LT(max_abs_difference(weights(two.path / "last.safetensors"), weights(one.path / "last.safetensors")), 2e-4);
    EXPECT_LT(max_abs_difference(weights(two.path / "ema.safetensors"), weights(one.path / "ema.safetensors")), 2e-4);
    // The losses are of the global batch.
    const auto m1 = metrics(one.path), m2 = metrics(two.path);
    ASSERT_EQ(m1.size(), 2u);
    ASSERT_EQ(m2.size(), 2u);
    for (size_t e = 0; e < 2; ++e) {
        for (const char* key : {"loss", "mse", "vb"}) {
            ASSERT_TRUE(std::isfinite(m2[e][key].get<double>())) << key;
            EXPECT_NEAR(m2[e][key].get<double>(), m1[e][key].get<double>(), 1e-4) << key << " epoch " << e + 1;
        }
        EXPECT_EQ(m2[e]["world_size"], 2);
        EXPECT_EQ(m2[e]["steps"], 4 * static_cast<int>(e + 1));
        EXPECT_FALSE(m1[e].contains("world_size"));
    }
    // The comparison can tell runs apart: half the global batch trains to other weights.
    const auto other = run_cli(diffusion_args() + " --threads 1 --batch-size 8 --output " + half.path.string());
    ASSERT_EQ(other.status, 0) << other.output;
    EXPECT_GT(max_abs_difference(weights(half.path / "last.safetensors"), weights(one.path / "last.safetensors")), 1e-3);
    // The global batch must split evenly.
    const auto odd = run_cli(diffusion_args() + " --nproc-per-node 3 --output " + (half.path / "odd").string());
    EXPECT_NE(odd.status, 0);
    EXPECT_NE(odd.output.find("--batch-size 16 (the global batch) must be divisible by the number of processes, 3"),
              std::string::npos)
        << odd.output;
}

// Latent space (--vae): every rank encodes its own rows and keeps its rows of the posterior sample's eps,
// drawn for the whole global batch from the step's seed, so two processes train what one trains.
TEST(DistributedDiffusion, LatentTwoProcessesMatchOne) {
    LINVIS_REQUIRE_FIXTURES();
    if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
        GTEST_SKIP() << "no Fashion-MNIST in /usr/share/datasets/fashion-mnist";
    TempDir one("dlat_one"), two("dlat_two"), reseeded("dlat_reseeded");
    const std::string args =
        "train --task diffusion --model dit_s2 --model-kwargs depth=1 hidden_size=32 num_heads=2 --dataset "
        "fashion-mnist --limit-train 16 --batch-size 8 --epochs 1 --lr 1e-3 --ema-decay 0.9 --no-progress "
        "--dist-timeout 60 --vae " + linvis::testing::fixtures_dir() + "/generation/vae_tiny.weights.safetensors "
        "--vae-kwargs block_out_channels=32,32,64,64 ";
    const auto single = run_cli(args + "--seed 5 --threads 1 --output " + one.path.string());
    ASSERT_EQ(single.status, 0) << single.output;
    const auto pair = run_cli(args + "--seed 5 --nproc-per-node 2 --output " + two.path.string());
    ASSERT_EQ(pair.status, 0) << pair.output;
    EXPECT_NE(pair.output.find("2 processes, 4 images per process and batch"), std::string::npos) << pair.output;
    EXPECT_LT(max_abs_difference(weights(two.path / "last.safetensors"), weights(one.path / "last.safetensors")), 2e-4);
    const auto m1 = metrics(one.path), m2 = metrics(two.path);
    ASSERT_EQ(m1.size(), 1u);
    ASSERT_EQ(m2.size(), 1u);
    EXPECT_NEAR(m2[0]["loss"].get<double>(), m1[0]["loss"].get<double>(), 1e-4);
    // The comparison can tell runs apart: another seed (t, noise, eps) trains to other weights.
    const auto other = run_cli(args + "--seed 6 --threads 1 --output " + reseeded.path.string());
    ASSERT_EQ(other.status, 0) << other.output;
    EXPECT_GT(max_abs_difference(weights(reseeded.path / "last.safetensors"), weights(one.path / "last.safetensors")), 1e-3);
}

const std::string kDiffusionFaultArgs =
    "train --task diffusion --model dit_s4 --model-kwargs depth=1 hidden_size=32 num_heads=2 --dataset fashion-mnist "
    "--limit-train 1024 --batch-size 16 --epochs 4 --no-progress --seed 1 ";

// Ctrl-C on the launcher of a diffusion run: every worker stops after the same step, rank 0 saves once
// (mid-epoch); the run then continues on one process and ends where an uninterrupted one-process run ends.
TEST(DistributedDiffusion, InterruptSavesOnceAndResumesWithADifferentWorldSize) {
    if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
        GTEST_SKIP() << "no Fashion-MNIST in /usr/share/datasets/fashion-mnist";
    TempDir dir("ddiff_int");
    const fs::path out = dir.path / "run", reference = dir.path / "reference";
    ASSERT_NO_FATAL_FAILURE(interrupt_pair_once(out, kDiffusionFaultArgs));
    const auto resumed = run_cli(kDiffusionFaultArgs + "--threads 1 --resume --output " + out.string());
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
    EXPECT_EQ(resumed.output.find("epoch 1:"), std::string::npos) << resumed.output;  // continued, not restarted
    EXPECT_NE(resumed.output.find("(256 steps)"), std::string::npos) << resumed.output;
    const auto uninterrupted = run_cli(kDiffusionFaultArgs + "--threads 1 --output " + reference.string());
    ASSERT_EQ(uninterrupted.status, 0) << uninterrupted.output;
    // 256 AdamW steps of lr 1e-4: rounding differences of the all-reduce stay a fraction of a step.
    EXPECT_LT(max_abs_difference(weights(out / "last.safetensors"), weights(reference / "last.safetensors")), 1e-3);
    EXPECT_LT(max_abs_difference(weights(out / "ema.safetensors"), weights(reference / "ema.safetensors")), 1e-3);
    const auto resumed_metrics = metrics(out), reference_metrics = metrics(reference);
    ASSERT_EQ(resumed_metrics.size(), 4u);
    ASSERT_EQ(reference_metrics.size(), 4u);
    EXPECT_NEAR(resumed_metrics.back()["loss"].get<double>(), reference_metrics.back()["loss"].get<double>(), 1e-4);
}

// ---------------------------------------------------------------- segmentation (linvis train --task segmentation)

// An ADE20K-style folder of 6 training and 3 validation images (40x52): label 1 where the image is bright,
// 0 where dark, and the ignore index on a band of rows whose height varies from image to image, so the
// ranks' shares of a global batch hold different numbers of labelled pixels.
void write_segmentation_folder(const fs::path& root) {
    torch::manual_seed(11);
    for (const std::string split : {"training", "validation"}) {
        fs::create_directories(root / "images" / split);
        fs::create_directories(root / "annotations" / split);
        for (int i = 0; i < (split == "training" ? 6 : 3); ++i) {
            torch::Tensor label = (torch::rand({40, 52}) > 0.5).to(torch::kUInt8);
            const torch::Tensor image = (label * 200 + 20).unsqueeze(2).expand({40, 52, 3}).contiguous();
            label.narrow(0, 0, 3 + 5 * i).fill_(255);
            const std::string stem = split + std::to_string(i);
            linvis::io::write_image((root / "images" / split / (stem + ".png")).string(), image);
            linvis::io::write_image((root / "annotations" / split / (stem + ".png")).string(), label);
        }
    }
}

std::string segmentation_args(const fs::path& data) {
    // H-ViT3 (BatchNorm in its patch merging) and UperNet (BatchNorm in every ConvModule): the statistics
    // must be those of the global batch. AdamW's eps is 1e-5 for the reason common_args gives (the tiny head
    // has many near-zero gradients): 3.5e-4 apart after 4 steps with 1e-8, 4e-7 with 1e-5.
    return "train --task segmentation --model hvit3_tiny --model-kwargs embed_dims=16,16,32,32 depths=1,1,1,1 "
           "num_heads=1,1,2,2 --head upernet --channels 8 --dataset folder:" + data.string() +
           " --num-classes 2 --img-size 48 --crop-size 32 --batch-size 4 --steps 4 --warmup-steps 1 --lr 1e-4 "
           "--opt-eps 1e-5 --checkpoint-every 2 --no-progress --seed 3 --dist-timeout 60";
}

std::vector<nlohmann::json> step_lines(const std::vector<nlohmann::json>& lines) {
    std::vector<nlohmann::json> out;
    for (const auto& l : lines)
        if (l.contains("loss")) out.push_back(l);
    return out;
}

TEST(DistributedSegmentation, TwoProcessesMatchOneOnTheSameGlobalBatch) {
    TempDir data("dseg_data"), one("dseg_one"), two("dseg_two"), half("dseg_half");
    write_segmentation_folder(data.path);
    const auto single = run_cli(segmentation_args(data.path) + " --threads 1 --output " + one.path.string());
    ASSERT_EQ(single.status, 0) << single.output;
    const auto pair = run_cli(segmentation_args(data.path) + " --nproc-per-node 2 --output " + two.path.string());
    ASSERT_EQ(pair.status, 0) << pair.output;
    EXPECT_NE(pair.output.find("2 processes, 2 images per process and step"), std::string::npos) << pair.output;
    size_t summaries = 0;
    for (size_t at = pair.output.find("trained hvit3_tiny"); at != std::string::npos;
         at = pair.output.find("trained hvit3_tiny", at + 1))
        ++summaries;
    EXPECT_EQ(summaries, 1u) << pair.output;  // only rank 0 prints
    for (const char* file : {"last.safetensors", "checkpoint.pt", "metrics.jsonl"})
        EXPECT_TRUE(fs::exists(two.path / file)) << file;
    // Weights and BatchNorm statistics to rounding (at most 8e-7 seen on two LibTorch builds).
    EXPECT_LT(max_abs_difference(weights(two.path / "last.safetensors"), weights(one.path / "last.safetensors")), 1e-5)
        << worst_name;
    // The losses are means over the labelled pixels of the global batch; the evaluation covers the whole split.
    const auto m1 = metrics(one.path), m2 = metrics(two.path);
    const auto s1 = step_lines(m1), s2 = step_lines(m2);
    ASSERT_EQ(s1.size(), 4u);
    ASSERT_EQ(s2.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
        EXPECT_NEAR(s2[i]["loss"].get<double>(), s1[i]["loss"].get<double>(), 2e-6) << "step " << i + 1;
        EXPECT_EQ(s2[i]["world_size"], 2);
        EXPECT_FALSE(s1[i].contains("world_size"));
    }
    ASSERT_TRUE(m1.back().contains("eval_loss"));
    ASSERT_TRUE(m2.back().contains("eval_loss"));
    EXPECT_NEAR(m2.back()["eval_loss"].get<double>(), m1.back()["eval_loss"].get<double>(), 2e-6);
    EXPECT_NEAR(m2.back()["eval_pixel_accuracy"].get<double>(), m1.back()["eval_pixel_accuracy"].get<double>(), 1e-3);
    // The comparison can tell runs apart: half the global batch trains to other weights.
    const auto other = run_cli(segmentation_args(data.path) + " --threads 1 --batch-size 2 --output " + half.path.string());
    ASSERT_EQ(other.status, 0) << other.output;
    EXPECT_GT(max_abs_difference(weights(half.path / "last.safetensors"), weights(one.path / "last.safetensors")), 1e-3);
}

// Resume with another world size: 2 steps on 2 processes, then on to 4 on one, ends where 4 on one end
// (a constant learning rate, --min-lr = --lr, so that lengthening the run keeps the schedule).
TEST(DistributedSegmentation, ResumesWithADifferentWorldSize) {
    TempDir data("dsegr_data"), out("dsegr_out");
    write_segmentation_folder(data.path);
    const std::string args = segmentation_args(data.path) + " --min-lr 1e-4";
    const std::string two_steps = std::string(args).replace(args.find("--steps 4"), 9, "--steps 2");
    const auto first = run_cli(two_steps + " --nproc-per-node 2 --output " + out.path.string());
    ASSERT_EQ(first.status, 0) << first.output;
    const auto resumed = run_cli(args + " --threads 1 --resume --output " + out.path.string());
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("at step 2"), std::string::npos) << resumed.output;
    TempDir reference("dsegr_ref");
    const auto whole = run_cli(args + " --threads 1 --output " + reference.path.string());
    ASSERT_EQ(whole.status, 0) << whole.output;
    // The resumed run differs from the uninterrupted one by rounding only (2 processes sum in another order;
    // segmentation_args says why that stays small).
    EXPECT_LT(max_abs_difference(weights(out.path / "last.safetensors"), weights(reference.path / "last.safetensors")),
              1e-5)
        << worst_name;
    const auto resumed_steps = step_lines(metrics(out.path)), whole_steps = step_lines(metrics(reference.path));
    ASSERT_EQ(resumed_steps.size(), 4u);
    ASSERT_EQ(whole_steps.size(), 4u);
    for (size_t i = 0; i < 4; ++i)
        EXPECT_NEAR(resumed_steps[i]["loss"].get<double>(), whole_steps[i]["loss"].get<double>(), 2e-6) << "step " << i + 1;
    EXPECT_NEAR(metrics(out.path).back()["eval_loss"].get<double>(), metrics(reference.path).back()["eval_loss"].get<double>(),
                2e-6);
}

// --cpu-budget counts the process's CPU seconds (a budget a busy machine does not shrink): a tiny one
// stops the run after its first step, which is checkpointed and evaluated.
TEST(DistributedSegmentation, CpuBudgetStopsTheRun) {
    TempDir data("dsegb_data"), out("dsegb_out");
    write_segmentation_folder(data.path);
    const std::string args = segmentation_args(data.path);
    const std::string many = std::string(args).replace(args.find("--steps 4"), 9, "--steps 50");
    const auto r = run_cli(many + " --cpu-budget 1e-3 --threads 1 --output " + out.path.string());
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("budget reached at step 1:"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("for 1 steps"), std::string::npos) << r.output;
    const auto lines = metrics(out.path);
    EXPECT_EQ(step_lines(lines).size(), 1u);
    EXPECT_GT(step_lines(lines)[0]["cpu_seconds"].get<double>(), 0.0);
    EXPECT_TRUE(lines.back().contains("eval_miou"));
}

}  // namespace
