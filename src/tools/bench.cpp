#include "linvis/tools/bench.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/runtime.h"
#include "linvis/models/dit.h"
#include "linvis/models/registry.h"
#include "linvis/models/segmentation.h"

namespace linvis::tools {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

torch::ScalarType parse_dtype(const std::string& dtype) {
    if (dtype == "f32") return torch::kFloat32;
    if (dtype == "bf16") return torch::kBFloat16;
    fail("--dtype: expected f32 or bf16, got '", dtype, "'");
}

models::ModelPtr build_model(const BenchCase& c, const std::string& impl, int64_t res) {
    models::ModelConfig config(c.model_kwargs);
    config.set("img_size", res);
    config.set("impl", impl);
    models::ModelPtr model = models::create_model(c.model, config);
    model->to(parse_dtype(c.dtype));
    return model;
}

// A case's speed from its timed passes (median and spread, per image) and the process's peak memory.
void record_timings(BenchResult& result, const std::vector<double>& times, int64_t batch, const PeakRssGrowth& growth) {
    result.iterations = static_cast<int>(times.size());
    result.latency_ms = median(times) * 1e3;
    result.images_per_s = static_cast<double>(batch) / median(times);
    result.images_per_s_min = static_cast<double>(batch) / *std::max_element(times.begin(), times.end());
    result.images_per_s_max = static_cast<double>(batch) / *std::min_element(times.begin(), times.end());
    result.peak_mem_bytes = growth.base_bytes() + growth.bytes();
    result.packed_weight_bytes = flops::packed_weight_bytes();
}

// One timed unit of work: an inference pass, or a training step's forward and backward.
void run_pass(models::VisionModel& model, const torch::Tensor& images, const torch::Tensor& labels, bool train) {
    if (!train) {
        const c10::InferenceMode inference;  // as the torch peer (bench/compare_torch.py) runs its passes
        model.forward(images);
        return;
    }
    torch::Tensor logits = model.forward(images);
    torch::Tensor loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), labels);
    loss.backward();
    for (auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
}

// Dense cases (BenchCase::task features / segment): the same timing and memory accounting as measure_case.
BenchResult measure_dense_case(const BenchCase& c) {
    BenchResult result;
    result.config = c;
    LINVIS_CHECK(c.task == "features" || c.task == "segment", "bench: task must be classify, features or segment, got ",
                 c.task);
    LINVIS_CHECK(!(c.task == "segment" && c.train && c.batch < 2),
                 "bench: --task segment --train needs --batch >= 2 (BatchNorm in the head's ConvModules), got ", c.batch);
    torch::manual_seed(0);
    models::ModelConfig config(c.model_kwargs);
    config.set("impl", c.impl == "reference" ? std::string("reference") : c.impl);
    config.set("features_only", std::string("true"));
    models::ModelPtr backbone = models::create_model(c.model, config);
    models::SegmentationModelPtr seg;
    torch::nn::Module* module = backbone.get();
    if (c.task == "segment") {
        models::SegmentationConfig head;
        head.head = c.head;
        seg = std::make_shared<models::SegmentationModel>(backbone, head);
        module = seg.get();
    }
    module->to(parse_dtype(c.dtype));
    module->train(c.train);
    result.params = models::count_parameters(*module);
    const torch::Tensor images = torch::randn({c.batch, 3, c.res, c.res}).to(parse_dtype(c.dtype));
    const torch::Tensor labels = torch::randint(0, 11, {c.batch, c.res, c.res}, torch::kLong);
    const std::vector<int64_t> indices = backbone->feature_indices();
    auto pass = [&] {
        if (!c.train) {
            const c10::InferenceMode inference;
            if (seg) seg->forward(images);
            else backbone->forward_feature_maps(images, indices);
            return;
        }
        torch::Tensor loss;
        if (seg) {
            loss = torch::nn::functional::cross_entropy(seg->forward(images).to(torch::kFloat32), labels);
        } else {
            loss = torch::zeros({});
            for (const auto& m : backbone->forward_feature_maps(images, indices)) loss = loss + m.to(torch::kFloat32).mean();
        }
        loss.backward();
        for (auto& p : module->parameters()) p.mutable_grad() = torch::Tensor();
    };
    const PeakRssGrowth growth;  // after the build: what the passes add
    result.base_mem_bytes = growth.base_bytes();
    {
        flops::Counter counter;
        pass();
        result.gflops = counter.gflops() / static_cast<double>(c.batch);
    }
    const std::vector<double> times = time_passes(pass, std::max(1, c.warmup) - 1, c.iters, c.max_seconds);
    record_timings(result, times, c.batch, growth);
    return result;
}

// After the timed passes (so that its models do not fragment the heap the passes' peak counts, see measure_case): the
// fused-against-reference check of a case that runs a fused implementation, whose numbers are dropped when it fails.
void check_after_timing(BenchResult& result, const BenchCase& c) {
    if (c.impl == "reference") return;
    const double rel_err = check_fused_against_reference(c);
    const double tolerance = c.dtype == "bf16" ? 3e-2 : 1e-4;
    if (!(rel_err <= tolerance)) {
        result = BenchResult();
        result.config = c;
        result.status = "check_failed";
        result.message = str_cat("fused differs from reference: relative error ", rel_err, " > ", tolerance);
    }
    result.check_rel_err = rel_err;
}

double relative_l2(const torch::Tensor& a, const torch::Tensor& b) {
    const torch::Tensor a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item<double>();
}

// Diffusion cases (BenchCase::task denoise / sample): a DiT, DiT3 or DiT5 at latent side res.
BenchResult measure_diffusion_case(const BenchCase& c) {
    BenchResult result;
    result.config = c;
    LINVIS_CHECK(c.sampler_steps >= 1, "bench: --sampler-steps must be >= 1, got ", c.sampler_steps);
    LINVIS_CHECK(!(c.task == "sample" && c.train), "bench: --task sample measures inference; --train goes with "
                                                   "--task denoise (a training step)");
    torch::manual_seed(0);
    models::ModelConfig config(c.model_kwargs);
    config.set("input_size", c.res);
    config.set("impl", c.impl == "reference" ? std::string("reference") : c.impl);
    models::DiffusionModelPtr model = models::create_diffusion_model(c.model, config);
    const torch::ScalarType dtype = parse_dtype(c.dtype);
    model->to(dtype);
    model->train(c.train);
    result.params = models::count_parameters(*model);
    const int64_t B = c.batch, C = model->in_channels(), L = c.res;
    constexpr double kGuidance = 4.0;
    const torch::Tensor labels = torch::randint(0, model->num_classes(), {B}, torch::kLong);
    const torch::Tensor noise = torch::randn({B, C, L, L}).to(dtype);
    const models::GaussianDiffusion diffusion("");
    std::vector<int64_t> label_list(labels.data_ptr<int64_t>(), labels.data_ptr<int64_t>() + B);
    auto pass = [&] {
        if (c.task == "sample") {
            const c10::InferenceMode inference;
            models::SamplerConfig sampler;
            sampler.sampler = "ddim";
            sampler.steps = c.sampler_steps;
            sampler.cfg_scale = kGuidance;
            models::sample_class_conditional(*model, noise, label_list, sampler);
        } else if (!c.train) {
            const c10::InferenceMode inference;
            const torch::Tensor x = torch::cat({noise, noise});
            const torch::Tensor t = torch::full({2 * B}, 500, torch::kLong);
            const torch::Tensor y = torch::cat({labels, torch::full({B}, model->num_classes(), torch::kLong)});
            model->forward_with_cfg(x, t, y, kGuidance);
        } else {
            const torch::Tensor t = torch::randint(0, 1000, {B}, torch::kLong);
            // The diffusion's arithmetic in float32, the network in its dtype.
            auto losses = diffusion.training_losses(
                [&](const torch::Tensor& x, const torch::Tensor& tt) {
                    return model->forward(x.to(dtype), tt, labels).to(torch::kFloat32);
                },
                noise.to(torch::kFloat32), t, torch::randn_like(noise).to(torch::kFloat32));
            losses.loss.mean().backward();
            for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
        }
    };
    const PeakRssGrowth growth;  // after the build: what the passes add
    result.base_mem_bytes = growth.base_bytes();
    {
        flops::Counter counter;
        pass();
        result.gflops = counter.gflops() / static_cast<double>(B);
    }
    const std::vector<double> times = time_passes(pass, std::max(1, c.warmup) - 1, c.iters, c.max_seconds);
    record_timings(result, times, B, growth);
    check_after_timing(result, c);
    return result;
}

}  // namespace

double median(std::vector<double> values) {
    if (values.empty()) return 0.0;
    std::sort(values.begin(), values.end());
    const size_t n = values.size();
    return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::vector<double> time_passes(const std::function<void()>& pass, int warmup, int reps, double max_seconds,
                                int min_reps) {
    for (int i = 0; i < warmup; ++i) pass();
    std::vector<double> seconds;
    const auto loop_start = Clock::now();
    for (int i = 0; i < std::max(1, reps); ++i) {
        const auto start = Clock::now();
        pass();
        seconds.push_back(seconds_since(start));
        if (i + 1 >= min_reps && seconds_since(loop_start) > max_seconds) break;
    }
    return seconds;
}

namespace {

// A "Key:   123 kB" line of /proc/self/status, in bytes; -1 when missing.
int64_t proc_status_bytes(const char* key) {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line))
        if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key)) * 1024;
    return -1;
}

}  // namespace

PeakRssGrowth::PeakRssGrowth() {
    // Memory freed so far goes back to the kernel first: the linvis binary keeps freed memory in the
    // process (tcmalloc, or glibc with runtime::kMallocKeepBytes), and a pass reusing resident pages would
    // not show its growth.
    runtime::release_free_memory();
    std::ofstream("/proc/self/clear_refs") << "5";  // 5: reset VmHWM to the current RSS (Linux >= 4.0)
    base_bytes_ = proc_status_bytes("VmRSS:");
}

int64_t PeakRssGrowth::bytes() const {
    return proc_status_bytes("VmHWM:") - base_bytes_;
}

namespace {

// What a finished child printed and how it ended.
struct ChildExit {
    std::string output;
    int wait_status = 0;
    bool timed_out = false;
};

// Reads the child's output until it closes its standard output, then reaps it; kills it (SIGKILL)
// when `timeout_s` passes first.
ChildExit collect_child(pid_t pid, int output_fd, double timeout_s) {
    ChildExit result;
    const auto start = Clock::now();
    bool output_closed = false;
    char buffer[4096];
    while (true) {
        const double left_s = timeout_s - seconds_since(start);
        if (left_s < 0) {
            kill(pid, SIGKILL);
            waitpid(pid, &result.wait_status, 0);
            result.timed_out = true;
            break;
        }
        // Wake up at least every 0.2 s: the deadline is checked between waits.
        const int wait_ms = static_cast<int>(std::min(200.0, left_s * 1e3)) + 1;
        if (!output_closed) {
            struct pollfd pfd {output_fd, POLLIN, 0};
            const int ready = poll(&pfd, 1, wait_ms);
            if (ready < 0 && errno != EINTR) output_closed = true;
            if (ready <= 0) continue;
            const ssize_t n = read(output_fd, buffer, sizeof(buffer));
            if (n > 0) result.output.append(buffer, static_cast<size_t>(n));
            else if (n == 0 || errno != EINTR) output_closed = true;
            continue;
        }
        // The output is closed: the child is exiting (or left a descendant holding the pipe).
        if (waitpid(pid, &result.wait_status, WNOHANG) == pid) break;
        poll(nullptr, 0, std::min(wait_ms, 20));
    }
    return result;
}

std::string self_executable() {
    char path[4096];
    const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
    return n > 0 ? std::string(path, static_cast<size_t>(n)) : std::string("/proc/self/exe");
}

}  // namespace

ChildResult run_in_child(const std::vector<std::string>& args, double timeout_s) {
    ChildResult result;
    // Everything the child needs is prepared before fork(): after it, the child of a multi-threaded
    // process may only call async-signal-safe functions until it execs.
    const std::string executable = self_executable();
    std::vector<char*> argv{const_cast<char*>(executable.c_str())};
    for (const auto& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);
    int pipe_fds[2];
    // Close-on-exec: no other child started meanwhile inherits the pipe and holds it open.
    if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
        result.message = str_cat("pipe() failed: ", std::strerror(errno));
        return result;
    }
    const pid_t pid = fork();
    if (pid < 0) {
        result.message = str_cat("fork() failed: ", std::strerror(errno));
        close(pipe_fds[0]);
        close(pipe_fds[1]);
        return result;
    }
    if (pid == 0) {
        dup2(pipe_fds[1], STDOUT_FILENO);  // the duplicate is not close-on-exec
        execv("/proc/self/exe", argv.data());
        _exit(127);
    }
    close(pipe_fds[1]);
    const ChildExit child = collect_child(pid, pipe_fds[0], timeout_s);
    close(pipe_fds[0]);
    const int status = child.wait_status;
    if (child.timed_out) {
        result.status = ChildResult::Status::TimedOut;
        result.message = str_cat("timed out after ", timeout_s, " s");
    } else if (WIFSIGNALED(status)) {
        result.status = ChildResult::Status::KilledBySignal;
        result.message = str_cat("child killed by signal ", WTERMSIG(status),
                                 WTERMSIG(status) == SIGKILL ? " (out of memory?)" : "");
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        result.status = ChildResult::Status::ExitedNonZero;
        result.message = str_cat("child exited with status ", WEXITSTATUS(status));
    } else {
        // The answer is the last line; anything before it is the measured code's own output.
        std::string output = child.output;
        while (!output.empty() && (output.back() == '\n' || output.back() == '\r')) output.pop_back();
        const auto newline = output.rfind('\n');
        const std::string last_line = newline == std::string::npos ? output : output.substr(newline + 1);
        result.status = ChildResult::Status::UnreadableOutput;
        try {
            if (last_line.empty()) fail("the child printed nothing");
            result.json = nlohmann::json::parse(last_line);
            result.status = ChildResult::Status::Ok;
        } catch (const std::exception& e) {
            result.message = str_cat("unreadable child output: ", e.what());
        }
    }
    return result;
}

double measure_sgemm_gflops(int64_t n, int repeats) {
    // Inference tensors: oneDNN reads b in place, no packed copy of it outlives the measurement.
    const c10::InferenceMode inference;
    const torch::Tensor a = torch::randn({n, n}), b = torch::randn({n, n}), bt = b.t();
    const auto rate = [&](const std::function<void()>& product) {
        // One warm-up product: thread start, page faults, oneDNN's kernel generation.
        std::vector<double> rates;
        for (const double seconds : time_passes(product, 1, repeats)) rates.push_back(2.0 * n * n * n / seconds * 1e-9);
        return median(rates);
    };
    const double blas = rate([&] { torch::mm(a, b); });
    const double own = rate([&] { flops::linear(a, bt); });
    return std::max(blas, own);
}

namespace {

// check_fused_against_reference of a DiT, DiT3 or DiT5 (tasks denoise and sample) at a latent side of at most 16, on
// weights moved off the adaLN-Zero initialisation (under which every output is 0): the network's output for a label
// and the null label (and in training the input gradient). Not forward_with_cfg's: guidance 4 multiplies the
// difference of the two halves by 4, and with it the bf16 rounding (3 % between two bf16 runs, 1 % without).
double check_diffusion_against_reference(const BenchCase& c) {
    const int64_t L = std::min<int64_t>(c.res, 16);
    const torch::ScalarType dtype = parse_dtype(c.dtype);
    torch::manual_seed(1234);
    const auto build = [&](const std::string& impl) {
        models::ModelConfig config(c.model_kwargs);
        config.set("input_size", L);
        config.set("impl", impl);
        models::DiffusionModelPtr model = models::create_diffusion_model(c.model, config);
        model->eval();  // no label dropout
        return model;
    };
    models::DiffusionModelPtr reference = build("reference"), fused = build(c.impl);
    {
        torch::NoGradGuard no_grad;
        auto src = reference->named_parameters(true);
        for (auto& item : src) item.value().add_(0.05 * torch::randn_like(item.value()));
        for (auto& item : fused->named_parameters(true)) item.value().copy_(src[item.key()]);
        auto src_buffers = reference->named_buffers(true);
        for (auto& item : fused->named_buffers(true)) item.value().copy_(src_buffers[item.key()]);
    }
    reference->to(dtype);
    fused->to(dtype);
    const torch::Tensor noise = torch::randn({1, reference->in_channels(), L, L}).to(dtype);
    const torch::Tensor x = torch::cat({noise, noise});
    const torch::Tensor t = torch::full({2}, 500, torch::kLong);
    const torch::Tensor y = torch::tensor({int64_t{1}, reference->num_classes()}, torch::kLong);
    if (!c.train) {
        torch::NoGradGuard no_grad;
        return relative_l2(fused->forward(x, t, y), reference->forward(x, t, y));
    }
    torch::Tensor x_ref = x.clone().requires_grad_(true), x_fused = x.clone().requires_grad_(true);
    const torch::Tensor out_ref = reference->forward(x_ref, t, y), out_fused = fused->forward(x_fused, t, y);
    const torch::Tensor probe = torch::randn_like(out_ref);
    (out_ref * probe).sum().backward();
    (out_fused * probe).sum().backward();
    return std::max(relative_l2(out_fused, out_ref), relative_l2(x_fused.grad(), x_ref.grad()));
}

}  // namespace

double check_fused_against_reference(const BenchCase& c) {
    if (c.task == "denoise" || c.task == "sample") return check_diffusion_against_reference(c);
    const int64_t check_res = std::min<int64_t>(c.res, 96);
    torch::manual_seed(1234);
    models::ModelPtr reference = build_model(c, "reference", check_res);
    models::ModelPtr fused = build_model(c, c.impl, check_res);
    {
        torch::NoGradGuard no_grad;
        auto src = reference->named_parameters(true);
        for (auto& item : fused->named_parameters(true)) item.value().copy_(src[item.key()]);
        auto src_buffers = reference->named_buffers(true);
        for (auto& item : fused->named_buffers(true)) item.value().copy_(src_buffers[item.key()]);
    }
    reference->eval();
    fused->eval();
    torch::Tensor images = torch::randn({2, 3, check_res, check_res}).to(parse_dtype(c.dtype));
    const auto rel = relative_l2;
    if (!c.train) {
        torch::NoGradGuard no_grad;
        return rel(fused->forward(images), reference->forward(images));
    }
    torch::Tensor x_ref = images.clone().requires_grad_(true);
    torch::Tensor x_fused = images.clone().requires_grad_(true);
    torch::Tensor out_ref = reference->forward(x_ref), out_fused = fused->forward(x_fused);
    torch::Tensor probe = torch::randn_like(out_ref);
    (out_ref * probe).sum().backward();
    (out_fused * probe).sum().backward();
    return std::max(rel(out_fused, out_ref), rel(x_fused.grad(), x_ref.grad()));
}

BenchResult measure_case(const BenchCase& c) {
    BenchResult result;
    result.config = c;
    try {
        runtime::configure_threads(c.threads);
        if (c.task == "denoise" || c.task == "sample") return measure_diffusion_case(c);
        if (c.task != "classify") return measure_dense_case(c);
        torch::manual_seed(0);
        models::ModelPtr model = build_model(c, c.impl, c.res);
        model->train(c.train);
        result.params = models::count_parameters(*model);
        const torch::ScalarType dtype = parse_dtype(c.dtype);
        torch::Tensor images = torch::randn({c.batch, 3, c.res, c.res}).to(dtype);
        torch::Tensor labels = torch::randint(0, model->num_classes(), {c.batch}, torch::kLong);
        const PeakRssGrowth growth;  // after the build: what the passes add
    result.base_mem_bytes = growth.base_bytes();
        {  // the first warm-up pass counts the FLOPs
            flops::Counter counter;
            run_pass(*model, images, labels, c.train);
            result.gflops = counter.gflops() / static_cast<double>(c.batch);
        }
        const std::vector<double> times = time_passes([&] { run_pass(*model, images, labels, c.train); },
                                                      std::max(1, c.warmup) - 1, c.iters, c.max_seconds);
        record_timings(result, times, c.batch, growth);
        // The check comes after the timed passes: its two models, built and freed before the passes, left
        // tcmalloc's heap in pieces that the passes' peak then counted (hvit3_tiny at 2048 px: 281 MiB of growth
        // against 175 MiB in a process without them).
        check_after_timing(result, c);
    } catch (const std::exception& e) {
        result.status = "error";
        result.message = e.what();
        if (auto* torch_error = dynamic_cast<const c10::Error*>(&e)) result.message = torch_error->what_without_backtrace();
        const auto newline = result.message.find('\n');
        if (newline != std::string::npos) result.message = result.message.substr(0, newline);
    }
    return result;
}

nlohmann::json to_json(const BenchCase& c) {
    return {{"model", c.model}, {"model_kwargs", c.model_kwargs}, {"res", c.res}, {"batch", c.batch},
            {"threads", c.threads}, {"dtype", c.dtype}, {"impl", c.impl}, {"train", c.train},
            {"task", c.task}, {"head", c.head}, {"sampler_steps", c.sampler_steps}, {"warmup", c.warmup},
            {"iters", c.iters}, {"max_seconds", c.max_seconds}};
}

BenchCase bench_case_from_json(const nlohmann::json& j) {
    BenchCase c;
    c.model = j.at("model").get<std::string>();
    c.model_kwargs = j.value("model_kwargs", std::map<std::string, std::string>{});
    c.res = j.at("res").get<int64_t>();
    c.batch = j.at("batch").get<int64_t>();
    c.threads = j.value("threads", 0);
    c.dtype = j.value("dtype", std::string("f32"));
    c.impl = j.value("impl", std::string("reference"));
    c.train = j.value("train", false);
    c.task = j.value("task", std::string("classify"));
    c.head = j.value("head", std::string("upernet"));
    c.sampler_steps = j.value("sampler_steps", int64_t{10});
    c.warmup = j.value("warmup", 2);
    c.iters = j.value("iters", 5);
    c.max_seconds = j.value("max_seconds", 60.0);
    return c;
}

nlohmann::json to_json(const BenchResult& r) {
    nlohmann::json j = to_json(r.config);
    j["status"] = r.status;
    j["message"] = r.message;
    j["images_per_s"] = r.images_per_s;
    j["images_per_s_min"] = r.images_per_s_min;
    j["images_per_s_max"] = r.images_per_s_max;
    j["latency_ms"] = r.latency_ms;
    j["iterations"] = r.iterations;
    j["peak_mem_bytes"] = r.peak_mem_bytes;
    j["base_mem_bytes"] = r.base_mem_bytes;
    j["packed_weight_bytes"] = r.packed_weight_bytes;
    j["gflops"] = r.gflops;
    j["params"] = r.params;
    j["check_rel_err"] = r.check_rel_err;
    return j;
}

BenchResult bench_result_from_json(const nlohmann::json& j) {
    BenchResult r;
    r.config = bench_case_from_json(j);
    r.status = j.value("status", std::string("error"));
    r.message = j.value("message", std::string());
    r.images_per_s = j.value("images_per_s", 0.0);
    r.images_per_s_min = j.value("images_per_s_min", 0.0);
    r.images_per_s_max = j.value("images_per_s_max", 0.0);
    r.latency_ms = j.value("latency_ms", 0.0);
    r.iterations = j.value("iterations", 0);
    r.peak_mem_bytes = j.value("peak_mem_bytes", int64_t{0});
    r.base_mem_bytes = j.value("base_mem_bytes", int64_t{0});
    r.packed_weight_bytes = j.value("packed_weight_bytes", int64_t{0});
    r.gflops = j.value("gflops", 0.0);
    r.params = j.value("params", int64_t{0});
    r.check_rel_err = j.value("check_rel_err", -1.0);
    return r;
}

}  // namespace linvis::tools
