// linvis models: every registered model with its parameter count and GFLOPs at 224.
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/models/dit.h"
#include "linvis/models/profile.h"
#include "linvis/models/registry.h"

namespace linvis::cli {
namespace {

struct ModelsOptions {
    std::string format = "text";
    std::string filter;
    bool no_flops = false;
    std::vector<int64_t> res;  // GFLOPs also at these resolutions
    int threads = 0;
};

int run_models(int argc, const char* const* argv) {
    ModelsOptions o;
    CommandApp app("models", "List every model in the registry with its parameter count (1000 classes) and GFLOPs "
                             "at 224x224 (one FLOP per multiply-add, as fvcore and the papers).");
    add_format_option(app, o.format);
    app.add_option("--filter", o.filter, "only models whose name contains TEXT");
    app.add_flag("--no-flops", o.no_flops, "skip the FLOP count (faster)");
    add_list(app, "--res", o.res, "also count GFLOPs at these resolutions (models built at each size)");
    add_threads_option(app, o.threads);
    if (!parse(app, argc, argv)) return 0;
    const std::string& format = o.format;
    runtime::configure_threads(o.threads);
    const std::string& filter = o.filter;
    const std::vector<int64_t>& extra = o.res;
    nlohmann::json rows = nlohmann::json::array();
    if (format == "text") {
        std::printf("%-16s %-8s %14s %11s", "name", "family", "params", "GFLOPs@224");
        for (const int64_t r : extra) std::printf(" %11s", ("GFLOPs@" + std::to_string(r)).c_str());
        std::printf("  %s\n", "description");
    }
    for (const auto& info : models::list_models()) {
        if (!filter.empty() && info.name.find(filter) == std::string::npos) continue;
        const models::ModelSummary s = models::summarize_model(info.name, !o.no_flops, extra);
        if (format == "json") {
            rows.push_back({{"name", s.name}, {"family", s.family}, {"description", s.description},
                            {"params", s.params},
                            {"gflops_224", s.gflops_224 < 0 ? nlohmann::json(nullptr) : nlohmann::json(s.gflops_224)}});
            for (const auto& [res, gflops] : s.gflops_at) rows.back()["gflops_" + std::to_string(res)] = gflops;
        } else {
            std::printf("%-16s %-8s %14s %11s", s.name.c_str(), s.family.c_str(), with_commas(s.params).c_str(),
                        s.gflops_224 < 0 ? "-" : (std::to_string(s.gflops_224).substr(0, 6)).c_str());
            for (const auto& [res, gflops] : s.gflops_at) std::printf(" %11.2f", gflops);
            std::printf("  %s\n", s.description.c_str());
            std::fflush(stdout);
        }
    }
    // Generative models (diffusion transformers at their default 32x32x4 latent, the VAE decoder): parameters
    // only (their FLOPs depend on the latent size; see 'linvis bench').
    for (const auto& info : models::list_generative_models()) {
        if (!filter.empty() && info.name.find(filter) == std::string::npos) continue;
        const int64_t params = info.kind == "diffusion" ? models::count_diffusion_model_parameters(info.name)
                                                        : models::count_parameters(*models::create_generative_model(info.name));
        if (format == "json") {
            rows.push_back({{"name", info.name}, {"family", info.family}, {"kind", info.kind},
                            {"description", info.description}, {"params", params}, {"gflops_224", nullptr}});
        } else {
            std::printf("%-16s %-8s %14s %11s", info.name.c_str(), info.family.c_str(), with_commas(params).c_str(), "-");
            for (size_t i = 0; i < extra.size(); ++i) std::printf(" %11s", "-");
            std::printf("  %s\n", info.description.c_str());
            std::fflush(stdout);
        }
    }
    if (format == "json") std::cout << rows.dump(2) << "\n";
    return 0;
}

CommandRegistrar registrar("models", "list every model with parameters and GFLOPs at 224", run_models);

}  // namespace
}  // namespace linvis::cli
