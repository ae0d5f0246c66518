#include "linvis/tools/bench.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/runtime.h"
#include "linvis/models/registry.h"

namespace linvis::tools {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    const size_t n = values.size();
    return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

torch::ScalarType parse_dtype(const std::string& dtype) {
    if (dtype == "f32") return torch::kFloat32;
    if (dtype == "bf16") return torch::kBFloat16;
    fail("--dtype: expected f32 or bf16, got '", dtype, "'");
}

models::ModelPtr build_model(const BenchCase& c, const std::string& impl, int64_t res) {
    models::ModelConfig config(c.model_kwargs);
    config.set("img_size", res);
    if (impl != "auto") config.set("impl", impl);  // auto: the model's own default
    models::ModelPtr model = models::create_model(c.model, config);
    model->to(parse_dtype(c.dtype));
    return model;
}

// One timed unit of work: an inference pass, or a training step's forward and backward.
void run_pass(models::VisionModel& model, const torch::Tensor& images, const torch::Tensor& labels, bool train) {
    if (!train) {
        torch::NoGradGuard no_grad;
        model.forward(images);
        return;
    }
    torch::Tensor logits = model.forward(images);
    torch::Tensor loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), labels);
    loss.backward();
    for (auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
}

}  // namespace

int64_t current_rss_bytes() {
    std::ifstream statm("/proc/self/statm");
    int64_t pages_total = 0, pages_resident = 0;
    statm >> pages_total >> pages_resident;
    return pages_resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t peak_rss_bytes() {
    struct rusage usage {};
    getrusage(RUSAGE_SELF, &usage);
    return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

double measure_sgemm_gflops(int64_t n, int repeats) {
    torch::NoGradGuard no_grad;
    torch::Tensor a = torch::randn({n, n}), b = torch::randn({n, n});
    torch::mm(a, b);  // warm-up: BLAS thread start, page faults
    std::vector<double> rates;
    for (int i = 0; i < repeats; ++i) {
        const auto start = Clock::now();
        torch::mm(a, b);
        rates.push_back(2.0 * n * n * n / seconds_since(start) * 1e-9);
    }
    return median(rates);
}

double check_fused_against_reference(const BenchCase& c) {
    const int64_t check_res = std::min<int64_t>(c.res, 96);
    torch::manual_seed(1234);
    models::ModelPtr reference = build_model(c, "reference", check_res);
    models::ModelPtr fused = build_model(c, "fused", check_res);
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
    auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
        auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
        return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item<double>();
    };
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
        if (c.impl == "fused") {
            result.check_rel_err = check_fused_against_reference(c);
            const double tolerance = c.dtype == "bf16" ? 3e-2 : 1e-4;
            if (!(result.check_rel_err <= tolerance)) {
                result.status = "check_failed";
                result.message = str_cat("fused differs from reference: relative error ", result.check_rel_err,
                                         " > ", tolerance);
                return result;
            }
        }
        torch::manual_seed(0);
        models::ModelPtr model = build_model(c, c.impl, c.res);
        model->train(c.train);
        result.params = models::count_parameters(*model);
        const torch::ScalarType dtype = parse_dtype(c.dtype);
        torch::Tensor images = torch::randn({c.batch, 3, c.res, c.res}).to(dtype);
        torch::Tensor labels = torch::randint(0, model->num_classes(), {c.batch}, torch::kLong);
        result.base_mem_bytes = current_rss_bytes();
        for (int i = 0; i < std::max(1, c.warmup); ++i) {
            if (i == 0) {
                flops::Counter counter;
                run_pass(*model, images, labels, c.train);
                result.gflops = counter.gflops() / static_cast<double>(c.batch);
            } else {
                run_pass(*model, images, labels, c.train);
            }
        }
        std::vector<double> times;
        const auto loop_start = Clock::now();
        for (int i = 0; i < std::max(1, c.iters); ++i) {
            const auto start = Clock::now();
            run_pass(*model, images, labels, c.train);
            times.push_back(seconds_since(start));
            if (i + 1 >= 3 && seconds_since(loop_start) > c.max_seconds) break;
        }
        result.iterations = static_cast<int>(times.size());
        result.latency_ms = median(times) * 1e3;
        result.images_per_s = c.batch / median(times);
        result.images_per_s_min = c.batch / *std::max_element(times.begin(), times.end());
        result.images_per_s_max = c.batch / *std::min_element(times.begin(), times.end());
        result.peak_mem_bytes = peak_rss_bytes();
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
            {"warmup", c.warmup}, {"iters", c.iters}, {"max_seconds", c.max_seconds}};
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
    r.gflops = j.value("gflops", 0.0);
    r.params = j.value("params", int64_t{0});
    r.check_rel_err = j.value("check_rel_err", -1.0);
    return r;
}

}  // namespace linvis::tools
