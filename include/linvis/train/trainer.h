// Training and evaluation loops with the DeiT/Swin recipe the papers use.
//
// The loop is deterministic for a fixed seed and thread count: batch order and augmentation
// depend only on (seed, epoch, batch), and the LibTorch RNG state (drop path) is checkpointed,
// so --resume continues bit for bit, also after an interruption mid-epoch.
#pragma once

#include <signal.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "linvis/models/model.h"
#include "linvis/train/data.h"
#include "linvis/train/mixup.h"
#include "linvis/train/optim.h"

namespace linvis::train {

class Distributed;  // linvis/train/distributed.h

struct TrainConfig {
    int64_t epochs = 10;
    int64_t accumulation_steps = 1;   // optimiser step every N batches
    OptimizerConfig optimizer;
    double min_lr = 1e-5;
    double warmup_lr = 1e-6;
    double warmup_epochs = 1.0;
    double clip_grad = 0.0;           // global-norm clipping, 0: off
    double ema_decay = 0.0;           // 0: no EMA
    int64_t eval_every = 1;           // evaluate after every N-th epoch; the last epoch always
    MixupConfig mixup;
    bool bf16 = false;                // bfloat16 autocast (CPU)
    uint64_t seed = 0;
    std::string output_dir;           // checkpoint.pt, metrics.jsonl, best/last weights
    bool resume = false;
    bool progress = true;             // progress bar on stderr
    bool log_epochs = true;           // one summary line per epoch on stderr
    std::string config_json;          // stored in checkpoints; resuming a different run is refused
    // Data-parallel training over this process group (null: one process). Every rank runs fit() on
    // the same data sources; the trainer shards them (BatchSource::shard), broadcasts rank 0's
    // weights, averages the gradients (GradientReducer), synchronises BatchNorm, reduces the
    // metrics, and only rank 0 writes files.
    std::shared_ptr<Distributed> distributed;
};

struct EvalResult {
    double top1 = 0.0, top5 = 0.0, loss = 0.0;  // percentages and mean cross-entropy
    int64_t images = 0;
    int64_t skipped_images = 0;
};

struct EpochRecord {
    int64_t epoch = 0;
    double train_loss = 0.0, train_acc = 0.0, lr = 0.0, images_per_s = 0.0, seconds = 0.0;
    EvalResult eval, eval_ema;
    bool has_eval = false, has_eval_ema = false;
    int64_t skipped_images = 0;
    int64_t steps = 0;                // optimiser steps in this epoch
    int64_t world_size = 1;
    double allreduce_wait_s = 0.0;    // time the optimiser steps waited for the gradient all-reduce
};

// Top-1/top-5 accuracy and mean cross-entropy of `model` over one pass of `data`. With `dist`, `data`
// is this rank's shard (BatchSource::shard(rank, world, false)) and the counts are summed over ranks.
EvalResult evaluate(models::VisionModel& model, BatchSource& data, bool bf16 = false, bool progress = false,
                    Distributed* dist = nullptr);

class Trainer {
public:
    Trainer(models::ModelPtr model, TrainConfig config);

    // Trains for config.epochs epochs (continuing from output_dir/checkpoint.pt when resume
    // is set), evaluating on `eval_data` (may be null) after every config.eval_every-th epoch and
    // the last; best.safetensors is the best evaluated epoch (lowest train loss without eval data). Throws
    // linvis::Error when the loss becomes NaN/Inf (the last good checkpoint stays).
    // Returns false when interrupted by SIGINT (a checkpoint was saved first).
    bool fit(BatchSource& train_data, BatchSource* eval_data);

    const std::vector<EpochRecord>& history() const { return history_; }
    models::VisionModel& model() { return *model_; }
    // Called with (path, model) to write best/last weights; the CLI installs the safetensors writer.
    std::function<void(const std::string& path, const torch::nn::Module& model)> save_weights;
    // Called after every epoch with the whole history (e.g. to draw the curves).
    std::function<void(const std::vector<EpochRecord>& history)> on_epoch_end;

private:
    models::ModelPtr model_;
    TrainConfig config_;
    std::vector<EpochRecord> history_;
};

// For its lifetime, SIGINT asks running loops to stop at the next optimiser step (interrupt_requested).
// SIGINT is blocked in this thread and the intra-op pool: a signal frame pushed onto a thread inside
// oneDNN's sgemm, whose kernel points rsp at a heap workspace, overwrites the heap below it.
// interrupt_requested() takes the pending signal instead.
class InterruptHandler {
public:
    InterruptHandler();
    ~InterruptHandler();
    InterruptHandler(const InterruptHandler&) = delete;
    InterruptHandler& operator=(const InterruptHandler&) = delete;

private:
    sigset_t previous_;  // this thread's signal mask before
};
bool interrupt_requested();
void clear_interrupt();

}  // namespace linvis::train
