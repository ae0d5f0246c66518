// Data-parallel launch shared by every 'linvis train' task (cli/launch.h).
#include "launch.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "linvis/core/error.h"
#include "linvis/core/runtime.h"

namespace linvis::cli {

void add_launch_options(CLI::App& app, LaunchOptions& o) {
    add_number(app, "--nproc-per-node", o.nproc_per_node,
               "data-parallel worker processes on this machine (--batch-size is the global batch); under "
               "torchrun or Slurm the RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT environment is read instead",
               int64_t{1}, int64_t{1024});
    add_choice(app, "--dist-backend", o.dist_backend, {"gloo", "nccl"},
               "c10d process group: gloo (CPU) or nccl (CUDA only)");
    add_number(app, "--dist-timeout", o.dist_timeout,
               "seconds a worker waits for the others (rendezvous, each all-reduce) before every worker stops",
               1e-3);
}

namespace {

// Options that choose how the run executes (processes, threads), not what it trains: a run may resume
// with others.
bool is_launch_option(const std::string& token) {
    for (const char* name : {"--nproc-per-node", "--dist-backend", "--dist-timeout", "--threads"})
        if (token == name || token.rfind(std::string(name) + "=", 0) == 0) return true;
    return false;
}

}  // namespace

int run_data_parallel(int argc, const char* const* argv, const LaunchOptions& launch, int64_t global_batch,
                      int threads, const DataParallelWorker& worker) {
    const train::DistributedEnv dist_env = train::distributed_env_from_environment();
    const int64_t world = dist_env.world_size > 1 ? dist_env.world_size : launch.nproc_per_node;
    LINVIS_CHECK(global_batch % world == 0, "--batch-size ", global_batch,
                 " (the global batch) must be divisible by the number of processes, ", world);
    if (dist_env.world_size == 1 && launch.nproc_per_node > 1)
        return train::launch_local_workers(std::vector<std::string>(argv, argv + argc), launch.nproc_per_node,
                                           launch.dist_timeout);
    std::shared_ptr<train::Distributed> dist;
    if (dist_env.world_size > 1) dist = train::Distributed::create(dist_env, launch.dist_backend, launch.dist_timeout);
    else LINVIS_CHECK(launch.dist_backend == "gloo" || torch::cuda::is_available(),
                      "--dist-backend nccl: needs CUDA GPUs, and this LibTorch sees none; use --dist-backend gloo");
    if (threads <= 0 && dist_env.local_world_size > 1)
        threads = std::max<int>(1, static_cast<int>(std::thread::hardware_concurrency() /
                                                    static_cast<unsigned>(dist_env.local_world_size)));
    runtime::configure_threads(threads);
    try {
        return worker(dist, dist_env.rank == 0);
    } catch (const std::exception& e) {
        if (!dist) throw;
        const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
        const std::string message = c10_error ? c10_error->what_without_backtrace() : e.what();
        const std::string rank = "rank " + std::to_string(dist->rank());
        std::fprintf(stderr, "linvis train: error: %s%s\n", message.rfind(rank, 0) == 0 ? "" : (rank + ": ").c_str(),
                     message.c_str());
        std::fflush(stderr);
        _exit(1);
    }
}

std::string run_identity(int argc, const char* const* argv, const std::string& skip) {
    nlohmann::json run_config;
    const std::vector<std::string> tokens(argv + 1, argv + argc);
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] == "--resume" || tokens[i] == "--no-progress") continue;
        const bool skipped = !skip.empty() && (tokens[i] == skip || tokens[i].rfind(skip + "=", 0) == 0);
        if (skipped || is_launch_option(tokens[i])) {
            if (tokens[i].find('=') == std::string::npos) ++i;  // its value
            continue;
        }
        run_config.push_back(tokens[i]);
    }
    return run_config.dump();
}

}  // namespace linvis::cli
