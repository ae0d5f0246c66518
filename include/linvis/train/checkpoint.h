// Training checkpoints: everything needed to continue a run exactly where it stopped
// (model, optimizer moments, EMA weights, schedule position, RNG state, epoch and batch),
// written atomically: a crash or kill mid-write leaves the previous checkpoint intact.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include <torch/torch.h>

namespace linvis::train {

struct TrainingState {
    int64_t epoch = 0;           // epoch in progress (or next to start when batch == 0)
    int64_t batch = 0;           // batches of `epoch` already done
    int64_t step = 0;            // optimiser steps done in total
    double best_top1 = -1.0;
    std::string config_json;     // the run's configuration, to refuse resuming a different run
};

// Written atomically (linvis/io/atomic_file.h): a crash leaves the previous checkpoint intact.
void save_checkpoint(const std::string& path, const TrainingState& state, const torch::nn::Module& model,
                     const torch::optim::Optimizer& optimizer, const std::map<std::string, torch::Tensor>* ema);

// Loads into the given objects (same architecture/optimizer layout); throws linvis::Error naming the file
// when it is unreadable or does not match.
TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                              std::map<std::string, torch::Tensor>* ema);

}  // namespace linvis::train
