// linvis bench: throughput, latency, peak memory and FLOPs of models side by side.
//
// Every (model, resolution) case runs in a fresh child process (`linvis bench-case`, internal)
// so the peak memory reported is that case's own. Results: a terminal table with ratios to a
// baseline model, and optionally JSON, CSV and a PNG figure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>

#include "command.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/models/registry.h"
#include "linvis/tools/bench.h"
#include "linvis/plot/plot.h"
#include "options.h"

namespace linvis::cli {
namespace {

using tools::BenchCase;
using tools::BenchResult;

// Runs one case in a child process (`linvis bench-case <json>`) and reads the result it prints.
BenchResult run_isolated(const BenchCase& c, double timeout_s) {
    BenchResult failed;
    failed.config = c;
    failed.status = "error";
    const tools::ChildResult child = tools::run_in_child({"bench-case", tools::to_json(c).dump()}, timeout_s);
    if (!child.ok()) {
        failed.message = child.message;
        return failed;
    }
    try {
        return tools::bench_result_from_json(child.json);
    } catch (const std::exception& e) {
        failed.message = str_cat("unreadable child output: ", e.what());
        return failed;
    }
}

int run_bench_case(int argc, const char* const* argv) {
    LINVIS_CHECK(argc == 2, "bench-case takes one JSON argument");
    const BenchCase c = tools::bench_case_from_json(nlohmann::json::parse(argv[1]));
    std::cout << tools::to_json(tools::measure_case(c)).dump() << std::endl;
    return 0;
}

std::string mib(int64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.0f", static_cast<double>(bytes) / (1024.0 * 1024.0));
    return text;
}

void print_table(const std::vector<BenchResult>& results, const std::string& baseline) {
    std::printf("%-14s %5s %5s %-9s %-4s %-5s %12s %17s %10s %9s %9s %8s\n", "model", "res", "batch", "impl",
                "dtype", "mode", "images/s", "(min-max)", "latency ms", "peak MiB", "GFLOPs", "iters");
    for (const auto& r : results) {
        const auto& c = r.config;
        if (r.status != "ok") {
            std::printf("%-14s %5lld %5lld %-9s %-4s %-5s  %s: %s\n", c.model.c_str(), static_cast<long long>(c.res),
                        static_cast<long long>(c.batch), c.impl.c_str(), c.dtype.c_str(), c.train ? "train" : "infer",
                        r.status.c_str(), r.message.c_str());
            continue;
        }
        char spread[40];
        std::snprintf(spread, sizeof(spread), "(%.3g-%.3g)", r.images_per_s_min, r.images_per_s_max);
        std::printf("%-14s %5lld %5lld %-9s %-4s %-5s %12.3f %17s %10.1f %9s %9.2f %8d\n", c.model.c_str(),
                    static_cast<long long>(c.res), static_cast<long long>(c.batch), c.impl.c_str(), c.dtype.c_str(),
                    c.train ? "train" : "infer", r.images_per_s, spread, r.latency_ms, mib(r.peak_mem_bytes).c_str(),
                    r.gflops, r.iterations);
    }
    // Ratios against the baseline model at each resolution, measured in this same run.
    std::map<int64_t, const BenchResult*> base_at;
    for (const auto& r : results)
        if (r.config.model == baseline && r.status == "ok") base_at[r.config.res] = &r;
    if (base_at.empty()) return;
    std::printf("\nratios to %s at the same resolution (speed: images/s ratio; memory: peak ratio)\n", baseline.c_str());
    std::printf("%-14s %-9s %5s %10s %10s\n", "model", "impl", "res", "speed", "memory");
    for (const auto& r : results) {
        if (r.config.model == baseline || r.status != "ok" || !base_at.count(r.config.res)) continue;
        const BenchResult& b = *base_at[r.config.res];
        std::printf("%-14s %-9s %5lld %9.2fx %9.1f%%\n", r.config.model.c_str(), r.config.impl.c_str(),
                    static_cast<long long>(r.config.res),
                    r.images_per_s / b.images_per_s,
                    100.0 * static_cast<double>(r.peak_mem_bytes) / static_cast<double>(b.peak_mem_bytes));
    }
}

void write_csv(const std::string& path, const std::vector<BenchResult>& results, double sgemm) {
    std::ofstream out(path);
    LINVIS_CHECK(out.good(), path, ": cannot open for writing");
    out << "model,res,batch,impl,dtype,mode,status,images_per_s,images_per_s_min,images_per_s_max,latency_ms,"
           "peak_mem_bytes,base_mem_bytes,gflops,params,check_rel_err,sgemm_gflops,packed_weight_bytes\n";
    for (const auto& r : results) {
        const auto& c = r.config;
        out << c.model << ',' << c.res << ',' << c.batch << ',' << c.impl << ',' << c.dtype << ','
            << (c.train ? "train" : "infer") << ',' << r.status << ',' << r.images_per_s << ',' << r.images_per_s_min
            << ',' << r.images_per_s_max << ',' << r.latency_ms << ',' << r.peak_mem_bytes << ','
            << r.base_mem_bytes << ',' << r.gflops << ',' << r.params << ',' << r.check_rel_err << ',' << sgemm << ','
            << r.packed_weight_bytes << '\n';
    }
}

// Throughput and peak memory against resolution, one line per model (the papers' figures).
void draw_figure(const std::string& path, const std::vector<BenchResult>& results, const std::string& subtitle,
                 const std::string& x_label) {
    // One line per (model, implementation); the implementation is named when the run mixes them.
    auto label = [&](const BenchResult& r) {
        bool mixed = false;
        for (const auto& other : results) mixed = mixed || other.config.impl != results.front().config.impl;
        return mixed ? r.config.model + " (" + r.config.impl + ")" : r.config.model;
    };
    std::vector<std::string> order;
    for (const auto& r : results)
        if (std::find(order.begin(), order.end(), label(r)) == order.end()) order.push_back(label(r));
    plot::Figure figure(1, 2);
    figure.title("linvis bench: " + subtitle);
    auto& speed = figure.set(0, 0, plot::LineChart());
    speed.title("throughput").x_label(x_label).y_label("images/s").y_scale(plot::Scale::Log10);
    auto& memory = figure.set(0, 1, plot::LineChart());
    memory.title("peak memory").x_label(x_label).y_label("MiB").y_scale(plot::Scale::Log10);
    for (const auto& model : order) {
        std::vector<double> xs, images, mem;
        for (const auto& r : results) {
            if (label(r) != model) continue;
            xs.push_back(static_cast<double>(r.config.res));
            images.push_back(r.status == "ok" ? r.images_per_s : std::nan(""));
            mem.push_back(r.status == "ok" ? static_cast<double>(r.peak_mem_bytes) / (1024.0 * 1024.0) : std::nan(""));
        }
        speed.add(model, xs, images, plot::Marker::Circle);
        memory.add(model, xs, mem, plot::Marker::Circle);
    }
    figure.save_png(path, 1400, 520);
}

struct BenchOptions {
    std::vector<std::string> models = {"deit_tiny", "vittt_tiny", "vit3_tiny", "vil_tiny"};
    std::map<std::string, std::string> kwargs;
    std::vector<int64_t> res = {224, 384, 512, 768, 1024, 1280};
    int64_t batch = 1;
    int threads = 0;
    std::string dtype = "f32";
    std::string impl = "auto";
    bool train = false;
    std::string task = "classify";
    std::string head = "upernet";
    int64_t sampler_steps = 10;
    int warmup = 2;
    int iters = 5;
    double max_seconds = 60;
    double case_timeout = 900;
    std::string baseline = "deit_tiny";
    std::string format = "table";
    std::string csv, plot;
    bool no_gemm = false;
};

int run_bench(int argc, const char* const* argv) {
    BenchOptions o;
    CommandApp app("bench", "Measure throughput (images/s, median and spread), latency, peak memory and GFLOPs of "
                            "models side by side, each (model, resolution) in its own child process. Every case "
                            "is reported; the exit status is 1 when one failed (an error, a refused correctness "
                            "check).");
    add_list(app, "--models", o.models, "models to measure; NAME@auto, NAME@reference or NAME@fused overrides --impl "
                                        "for one");
    add_model_kwargs_option(app, o.kwargs);
    add_list(app, "--res", o.res, "square input resolutions");
    add_number(app, "--batch", o.batch, "images per pass");
    add_threads_option(app, o.threads);
    add_dtype_option(app, o.dtype, {"f32", "bf16"});
    add_impl_option(app, o.impl);
    app.add_flag("--train", o.train, "time forward + backward instead of inference");
    add_choice(app, "--task", o.task, {"classify", "features", "segment", "denoise", "sample"},
               "classify: the classifier | features: features_only backbone maps (dense) | segment: backbone + "
               "--head (with --train: a segmentation training step) | denoise: one guided denoising step of a "
               "diffusion model (with --train: a training step) | sample: a whole DDIM sampler; for denoise and "
               "sample --res is the latent side");
    add_choice(app, "--head", o.head, {"upernet", "fpn"}, "segmentation head for --task segment");
    add_number(app, "--sampler-steps", o.sampler_steps, "DDIM steps of --task sample");
    add_number(app, "--warmup", o.warmup, "warm-up passes per case");
    add_number(app, "--iters", o.iters, "timed passes per case (at least 3 are kept)");
    add_number(app, "--max-seconds", o.max_seconds, "stop timing a case after S seconds (once 3 passes are done)");
    add_number(app, "--case-timeout", o.case_timeout, "kill a case that runs longer than S seconds");
    app.add_option("--baseline", o.baseline, "model the ratios are computed against")->type_name("MODEL");
    add_format_option(app, o.format, {"table", "json"});
    app.add_option("--csv", o.csv, "also write the results as CSV")->type_name("FILE");
    app.add_option("--plot", o.plot, "also draw images/s and peak memory against resolution")->type_name("FILE.png");
    app.add_flag("--no-gemm", o.no_gemm, "skip measuring the machine's SGEMM rate");
    if (!parse(app, argc, argv)) return 0;
    const std::string& format = o.format;
    const std::string& dtype = o.dtype;
    const std::string& impl = o.impl;
    // "name@impl" overrides --impl for one model, so a fused model can be compared with a baseline
    // that has no fused kernel (e.g. --impl fused --models deit_tiny@reference,vittt_tiny).
    std::vector<std::pair<std::string, std::string>> model_impls;
    for (const auto& token : o.models) {
        const auto at = token.find('@');
        const std::string name = token.substr(0, at);
        const std::string model_impl = at == std::string::npos ? impl : token.substr(at + 1);
        LINVIS_CHECK(models::has_model(name) || models::has_generative_model(name), "--models: unknown model '", name,
                     "' (see 'linvis models')");
        const bool diffusion_task = o.task == "denoise" || o.task == "sample";
        LINVIS_CHECK(diffusion_task ? models::has_generative_model(name) &&
                                          models::generative_model_kind(name) == "diffusion"
                                    : models::has_model(name),
                     "--models: '", name, "' is not a ", diffusion_task ? "diffusion model" : "vision model",
                     " (--task ", o.task, ")");
        LINVIS_CHECK(std::find(kImplChoices.begin(), kImplChoices.end(), model_impl) != kImplChoices.end(),
                     "--models: '", token, "': the implementation after '@' must be ", choice_list(kImplChoices));
        model_impls.push_back({name, model_impl});
    }

    runtime::configure_threads(o.threads);
    const runtime::Info info = runtime::query();
    const double sgemm = o.no_gemm ? 0.0 : tools::measure_sgemm_gflops();
    if (format == "table") {
        if (o.task != "classify") std::printf("task: %s (%s)\n", o.task.c_str(), o.train ? "training step" : "inference");
        std::printf("machine: %s | threads %d | BLAS %s\n", runtime::simd_name(info.simd), info.torch_threads,
                    info.blas.c_str());
        if (sgemm > 0) std::printf("SGEMM rate (2048^3, same run): %.1f GFLOP/s\n", sgemm);
        std::printf("\n");
        std::fflush(stdout);
    }

    std::vector<BenchResult> results;
    for (const int64_t res : o.res) {
        for (const auto& [name, model_impl] : model_impls) {
            BenchCase c;
            c.model = name;
            c.model_kwargs = o.kwargs;
            c.res = res;
            c.batch = o.batch;
            c.threads = o.threads;
            c.dtype = dtype;
            c.impl = model_impl;
            c.train = o.train;
            c.task = o.task;
            c.head = o.head;
            c.sampler_steps = o.sampler_steps;
            c.warmup = o.warmup;
            c.iters = o.iters;
            c.max_seconds = o.max_seconds;
            results.push_back(run_isolated(c, o.case_timeout));
            if (format == "table") {
                const auto& r = results.back();
                std::fprintf(stderr, "  %s @ %lld: %s\n", name.c_str(), static_cast<long long>(res),
                             r.status == "ok" ? (std::to_string(r.images_per_s) + " images/s").c_str()
                                              : (r.status + ": " + r.message).c_str());
            }
        }
    }
    if (format == "json") {
        nlohmann::json rows = nlohmann::json::array();
        for (const auto& r : results) {
            nlohmann::json row = tools::to_json(r);
            row["sgemm_gflops"] = sgemm;
            rows.push_back(row);
        }
        std::cout << rows.dump(2) << "\n";
    } else {
        print_table(results, o.baseline);
    }
    if (!o.csv.empty()) write_csv(o.csv, results, sgemm);
    if (!o.plot.empty()) {
        const bool diffusion_task = o.task == "denoise" || o.task == "sample";
        const std::string work = o.train ? "forward+backward"
                                 : o.task == "denoise" ? "guided denoising step"
                                 : o.task == "sample" ? "DDIM sampler, " + std::to_string(o.sampler_steps) + " steps"
                                                      : "inference";
        char subtitle[200];
        std::snprintf(subtitle, sizeof(subtitle), "%s, batch %lld, %s, %s, %s, %d threads", o.task.c_str(),
                      static_cast<long long>(o.batch), dtype.c_str(), impl.c_str(), work.c_str(), info.torch_threads);
        draw_figure(o.plot, results, subtitle,
                    diffusion_task ? "latent side L (pixels / 8)" : "resolution (pixels per side)");
    }
    // Every case is reported above; a run with a failed case (an error, a refused correctness check) still fails as
    // a whole, so that a script does not take a partial table for a measurement.
    const auto not_ok = [](const BenchResult& r) { return r.status != "ok"; };
    const auto failed = std::count_if(results.begin(), results.end(), not_ok);
    if (failed > 0) {
        const auto first = std::find_if(results.begin(), results.end(), not_ok);
        std::cout.flush();  // the rows before the summary, also where both streams go to one pipe
        std::fflush(stdout);
        std::fprintf(stderr, "linvis bench: %lld of %zu cases failed (first: %s @ %lld: %s: %s)\n",
                     static_cast<long long>(failed), results.size(), first->config.model.c_str(),
                     static_cast<long long>(first->config.res), first->status.c_str(), first->message.c_str());
        return 1;
    }
    return 0;
}

CommandRegistrar bench_registrar("bench", "measure images/s, latency, peak memory and GFLOPs side by side", run_bench);
CommandRegistrar case_registrar("bench-case", "", run_bench_case);

}  // namespace
}  // namespace linvis::cli
