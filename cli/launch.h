// How many processes a 'linvis train' run uses (data parallel on c10d, linvis/train/distributed.h), shared
// by every task it trains (classification, diffusion, segmentation), and the run's identity for --resume.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "options.h"
#include "linvis/train/distributed.h"

namespace linvis::cli {

struct LaunchOptions {
    int64_t nproc_per_node = 1;
    std::string dist_backend = "gloo";
    double dist_timeout = 300.0;
};

// --nproc-per-node, --dist-backend, --dist-timeout.
void add_launch_options(CLI::App& app, LaunchOptions& o);

// The process's part of a data-parallel run: alone (no process group), the launcher of
// --nproc-per-node workers (re-executing argv), or one worker of a torchrun-style environment. Checks
// that the global batch splits evenly, configures the threads (workers sharing a machine share its
// cores) and runs `worker(process group or null, is rank 0)`. A worker's error is reported with its
// rank and ends the process at once (its peers may be gone, and c10d's destructors would block).
using DataParallelWorker = std::function<int(const std::shared_ptr<train::Distributed>&, bool main_rank)>;
int run_data_parallel(int argc, const char* const* argv, const LaunchOptions& launch, int64_t global_batch,
                      int threads, const DataParallelWorker& worker);

// The run's identity for --resume: the arguments without --resume, --no-progress, the launch options and
// --threads (a run may resume with another world size or thread count) and, when `skip` names it, an
// option that may change between runs (with its value).
std::string run_identity(int argc, const char* const* argv, const std::string& skip = "");

}  // namespace linvis::cli
