#include "linvis/train/trainer.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/test_hooks.h"
#include "linvis/train/checkpoint.h"
#include "linvis/train/distributed.h"
#include "linvis/train/ema.h"

namespace linvis::train {
namespace {

std::atomic<bool> g_interrupted{false};

void on_sigint(int) { g_interrupted.store(true); }

sigset_t sigint_set() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    return set;
}

using Clock = std::chrono::steady_clock;

// bfloat16 autocast on CPU for the lifetime of the guard (LibTorch 1.13 and 2.x spell it differently).
class CpuAutocast {
public:
    explicit CpuAutocast(bool enabled) : enabled_(enabled) {
        if (!enabled_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
        previous_ = at::autocast::is_autocast_enabled(at::kCPU);
        at::autocast::set_autocast_enabled(at::kCPU, true);
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
#else
        previous_ = at::autocast::is_cpu_enabled();
        at::autocast::set_cpu_enabled(true);
        at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
#endif
    }
    ~CpuAutocast() {
        if (!enabled_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
        at::autocast::set_autocast_enabled(at::kCPU, previous_);
#else
        at::autocast::set_cpu_enabled(previous_);
#endif
        at::autocast::clear_cache();
    }

private:
    bool enabled_;
    bool previous_ = false;
};

// One line of progress on stderr, redrawn in place on a terminal, every few seconds otherwise.
class ProgressBar {
public:
    ProgressBar(bool enabled, std::string label, int64_t total)
        : enabled_(enabled), label_(std::move(label)), total_(total), tty_(isatty(STDERR_FILENO) != 0),
          start_(Clock::now()), last_draw_(start_) {}

    void update(int64_t done, const std::string& stats, bool force = false) {
        if (!enabled_) return;
        const auto now = Clock::now();
        const double since_draw = std::chrono::duration<double>(now - last_draw_).count();
        if (!force && since_draw < (tty_ ? 0.2 : 10.0)) return;
        last_draw_ = now;
        const double elapsed = std::chrono::duration<double>(now - start_).count();
        const double eta = done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(total_ - done) : 0.0;
        const int width = 24;
        const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
        std::string bar(static_cast<size_t>(filled), '#');
        bar.resize(width, '.');
        std::fprintf(stderr, "%s%s [%s] %lld/%lld %s ETA %02d:%02d%s", tty_ ? "\r" : "", label_.c_str(), bar.c_str(),
                     static_cast<long long>(done), static_cast<long long>(total_), stats.c_str(),
                     static_cast<int>(eta) / 60, static_cast<int>(eta) % 60, tty_ ? "\033[K" : "\n");
        std::fflush(stderr);
    }
    void finish() {
        if (enabled_ && tty_) std::fprintf(stderr, "\n");
    }

private:
    bool enabled_;
    std::string label_;
    int64_t total_;
    bool tty_;
    Clock::time_point start_, last_draw_;
};

nlohmann::json eval_json(const EvalResult& e) {
    return {{"top1", e.top1}, {"top5", e.top5}, {"loss", e.loss}, {"images", e.images}};
}

void append_metrics(const std::string& path, const EpochRecord& r) {
    nlohmann::json j = {{"epoch", r.epoch}, {"train_loss", r.train_loss}, {"train_acc", r.train_acc},
                        {"lr", r.lr}, {"images_per_s", r.images_per_s}, {"seconds", r.seconds},
                        {"skipped_images", r.skipped_images}, {"steps", r.steps}};
    if (r.world_size > 1) {
        j["world_size"] = r.world_size;
        j["allreduce_wait_s"] = r.allreduce_wait_s;
    }
    if (r.has_eval) j["eval"] = eval_json(r.eval);
    if (r.has_eval_ema) j["eval_ema"] = eval_json(r.eval_ema);
    std::ofstream out(path, std::ios::app);
    out << j.dump() << "\n";
}

}  // namespace

InterruptHandler::InterruptHandler() {
    std::signal(SIGINT, on_sigint);  // threads that do not block it (Gloo's, the data loader's) may still take it
    const sigset_t set = sigint_set();
    pthread_sigmask(SIG_BLOCK, &set, &previous_);  // threads started from here on inherit the mask
    // The pool's threads started before (they run sgemm too) keep it blocked.
    at::parallel_for(0, at::get_num_threads(), 1,
                     [&](int64_t, int64_t) { pthread_sigmask(SIG_BLOCK, &set, nullptr); });
}

// Restored so that processes started later (fork and exec keep the mask) can be interrupted.
InterruptHandler::~InterruptHandler() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }

bool interrupt_requested() {
    const sigset_t set = sigint_set();
    const timespec now{};
    if (sigtimedwait(&set, nullptr, &now) == SIGINT) g_interrupted.store(true);
    return g_interrupted.load();
}
void clear_interrupt() { g_interrupted.store(false); }

EvalResult evaluate(models::VisionModel& model, BatchSource& data, bool bf16, bool progress, Distributed* dist) {
    torch::NoGradGuard no_grad;
    const bool was_training = model.is_training();
    model.eval();
    data.start_epoch(0);
    EvalResult result;
    double loss_sum = 0.0;
    int64_t correct1 = 0, correct5 = 0;
    ProgressBar bar(progress, "eval", data.batches_per_epoch());
    torch::Tensor images, labels;
    int64_t batch = 0;
    while (data.next(images, labels)) {
        torch::Tensor logits;
        {
            CpuAutocast autocast(bf16);
            logits = model.forward(images).to(torch::kFloat32);
        }
        loss_sum += torch::nn::functional::cross_entropy(
                        logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                        .item<double>();
        const int64_t k = std::min<int64_t>(5, logits.size(1));
        torch::Tensor top = std::get<1>(logits.topk(k, 1));
        torch::Tensor hits = top.eq(labels.view({-1, 1}));
        correct1 += hits.select(1, 0).sum().item<int64_t>();
        correct5 += hits.any(1).sum().item<int64_t>();
        result.images += labels.size(0);
        bar.update(++batch, "");
        distributed_heartbeat();
    }
    bar.finish();
    if (dist != nullptr && dist->world_size() > 1) {
        std::vector<double> sums{loss_sum, static_cast<double>(correct1), static_cast<double>(correct5),
                                 static_cast<double>(result.images)};
        sum_over_ranks(dist, sums);
        loss_sum = sums[0];
        correct1 = static_cast<int64_t>(sums[1]);
        correct5 = static_cast<int64_t>(sums[2]);
        result.images = static_cast<int64_t>(sums[3]);
    }
    LINVIS_CHECK(result.images > 0, "evaluation data is empty");
    result.top1 = 100.0 * static_cast<double>(correct1) / static_cast<double>(result.images);
    result.top5 = 100.0 * static_cast<double>(correct5) / static_cast<double>(result.images);
    result.loss = loss_sum / static_cast<double>(result.images);
    result.skipped_images = data.skipped_images();
    model.train(was_training);
    return result;
}

Trainer::Trainer(models::ModelPtr model, TrainConfig config) : model_(std::move(model)), config_(std::move(config)) {
    LINVIS_CHECK(model_ != nullptr, "trainer: no model");
    LINVIS_CHECK(config_.epochs > 0, "--epochs must be positive, got ", config_.epochs);
    LINVIS_CHECK(config_.eval_every > 0, "--eval-every must be positive, got ", config_.eval_every);
    LINVIS_CHECK(config_.accumulation_steps > 0, "--accum-steps must be positive, got ", config_.accumulation_steps);
    LINVIS_CHECK(!config_.output_dir.empty(), "trainer: an output directory is required");
}

bool Trainer::fit(BatchSource& train_data, BatchSource* eval_data) {
    namespace fs = std::filesystem;
    const std::shared_ptr<Distributed>& dist = config_.distributed;
    const auto [rank, world] = process_place(dist.get());
    const bool main_rank = rank == 0;  // the only rank that writes files and prints
    const bool progress = config_.progress && main_rank;
    fs::create_directories(config_.output_dir);
    const std::string checkpoint_path = (fs::path(config_.output_dir) / "checkpoint.pt").string();
    const std::string metrics_path = (fs::path(config_.output_dir) / "metrics.jsonl").string();

    if (world > 1) {
        train_data.shard(rank, world, true);
        if (eval_data != nullptr) eval_data->shard(rank, world, false);
        broadcast_module(*dist, *model_);  // every rank starts from rank 0's weights
    }
    std::vector<ParamGroupInfo> groups;
    auto optimizer = make_adamw(*model_, config_.optimizer, &groups);
    std::unique_ptr<ModelEma> ema = config_.ema_decay > 0 ? std::make_unique<ModelEma>(*model_, config_.ema_decay)
                                                          : nullptr;
    const int64_t batches = train_data.batches_per_epoch();
    LINVIS_CHECK(batches > 0, "training data is empty");
    const int64_t steps_per_epoch = (batches + config_.accumulation_steps - 1) / config_.accumulation_steps;
    CosineSchedule schedule;
    schedule.base_lr = config_.optimizer.lr;
    schedule.min_lr = config_.min_lr;
    schedule.warmup_lr = config_.warmup_lr;
    schedule.warmup_steps = static_cast<int64_t>(config_.warmup_epochs * static_cast<double>(steps_per_epoch));
    schedule.total_steps = config_.epochs * steps_per_epoch;

    TrainingState state;
    state.config_json = config_.config_json;
    if (config_.resume && fs::exists(checkpoint_path)) {
        TrainingState loaded = load_checkpoint(checkpoint_path, *model_, *optimizer, ema ? &ema->tensors() : nullptr);
        LINVIS_CHECK(loaded.config_json == config_.config_json, checkpoint_path,
                     ": was written by a run with a different configuration; use another --output directory");
        state = loaded;
        std::ifstream in(metrics_path);
        std::string line;
        while (std::getline(in, line)) {
            auto j = nlohmann::json::parse(line, nullptr, false);
            if (j.is_discarded() || j.value("epoch", int64_t{-1}) >= state.epoch) continue;
            EpochRecord r;
            r.epoch = j["epoch"];
            r.train_loss = j.value("train_loss", 0.0);
            r.train_acc = j.value("train_acc", 0.0);
            r.lr = j.value("lr", 0.0);
            if (j.contains("eval")) {
                r.has_eval = true;
                r.eval.top1 = j["eval"].value("top1", 0.0);
                r.eval.top5 = j["eval"].value("top5", 0.0);
                r.eval.loss = j["eval"].value("loss", 0.0);
            }
            history_.push_back(r);
        }
        if (progress)
            std::fprintf(stderr, "resuming from %s at epoch %lld, batch %lld\n", checkpoint_path.c_str(),
                         static_cast<long long>(state.epoch + 1), static_cast<long long>(state.batch));
    } else if (!config_.resume && main_rank) {
        fs::remove(metrics_path);
    }
    const InterruptHandler interrupt_handler;
    std::unique_ptr<GradientReducer> reducer;
    if (world > 1) {
        reducer = std::make_unique<GradientReducer>(*model_, dist);
        // Drop path and other LibTorch randomness: a stream of its own per rank.
        torch::manual_seed(mix_seed(config_.seed, static_cast<uint64_t>(state.step), static_cast<uint64_t>(rank) + 1));
    }
    const BatchNormSync batch_norm_sync(dist);

    for (int64_t epoch = state.epoch; epoch < config_.epochs; ++epoch) {
        model_->train();
        train_data.start_epoch(epoch);
        if (state.batch > 0) train_data.skip(state.batch);
        ProgressBar bar(progress, "epoch " + std::to_string(epoch + 1) + "/" + std::to_string(config_.epochs),
                        batches);
        const auto epoch_start = Clock::now();
        double loss_sum = 0.0, correct = 0.0;
        int64_t seen = 0, steps = 0;
        if (reducer) reducer->reset_wait_seconds();
        double lr = schedule.lr_at(state.step);
        torch::Tensor images, labels;
        optimizer->zero_grad();
        for (int64_t b = state.batch; b < batches && train_data.next(images, labels); ++b) {
            test_stop_point("train-batch");
            std::mt19937_64 mix_rng(mix_seed(config_.seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(b)));
            const int64_t num_classes = model_->num_classes();
            torch::Tensor targets = mix_batch(images, labels, num_classes, config_.mixup, mix_rng);
            torch::Tensor logits;
            {
                CpuAutocast autocast(config_.bf16);
                logits = model_->forward(images);
            }
            torch::Tensor loss = soft_target_cross_entropy(logits, targets);
            const double loss_value = loss.item<double>();
            if (!std::isfinite(loss_value)) {
                bar.finish();
                // Spelled out: printing a NaN gives "nan" or "-nan" depending on the BLAS that produced it.
                const char* what = std::isnan(loss_value) ? "nan" : (loss_value > 0 ? "inf" : "-inf");
                fail("loss became ", what, " at epoch ", epoch + 1, ", batch ", b + 1,
                     "; stopped. The last good checkpoint is ", checkpoint_path,
                     " (lower --lr, or enable --clip-grad)");
            }
            const bool step_now = (b + 1) % config_.accumulation_steps == 0 || b + 1 == batches;
            // Gradients of the last micro-batch before a step are all-reduced while backward runs.
            if (reducer) reducer->prepare(step_now);
            (loss / static_cast<double>(config_.accumulation_steps)).backward();
            distributed_heartbeat();
            loss_sum += loss_value * static_cast<double>(labels.size(0));
            correct += logits.argmax(1).eq(targets.argmax(1)).sum().item<double>();
            seen += labels.size(0);
            bool stop_now = false;
            if (step_now) {
                if (reducer) reducer->finish();
                lr = schedule.lr_at(state.step);
                apply_learning_rate(*optimizer, groups, lr);
                if (config_.clip_grad > 0) clip_gradients(*model_, config_.clip_grad);
                optimizer->step();
                optimizer->zero_grad();
                if (ema) ema->update(*model_);
                ++state.step;
                ++steps;
                // Every rank stops at the same step when any of them was interrupted.
                std::vector<double> interrupted{interrupt_requested() ? 1.0 : 0.0};
                sum_over_ranks(dist.get(), interrupted);
                stop_now = interrupted[0] > 0;
            }
            const double elapsed = std::chrono::duration<double>(Clock::now() - epoch_start).count();
            char stats[160];
            std::snprintf(stats, sizeof(stats), "loss %.4f acc %.2f%% lr %.2e %.1f img/s", loss_sum / seen,
                          100.0 * correct / seen, lr, seen / std::max(elapsed, 1e-9));
            bar.update(b + 1, stats, b + 1 == batches);
            if (stop_now) {
                bar.finish();
                state.epoch = epoch;
                state.batch = b + 1;
                if (main_rank) {
                    save_checkpoint(checkpoint_path, state, *model_, *optimizer, ema ? &ema->tensors() : nullptr);
                    std::fprintf(stderr, "interrupted: saved %s (epoch %lld, batch %lld); continue with --resume\n",
                                 checkpoint_path.c_str(), static_cast<long long>(epoch + 1),
                                 static_cast<long long>(b + 1));
                }
                if (dist) dist->barrier();  // the checkpoint is complete before any worker exits
                clear_interrupt();
                return false;
            }
        }
        bar.finish();
        // Metrics of the global batch: sums over the ranks.
        std::vector<double> sums{loss_sum, correct, static_cast<double>(seen),
                                 static_cast<double>(train_data.skipped_images())};
        sum_over_ranks(dist.get(), sums);
        loss_sum = sums[0];
        correct = sums[1];
        seen = static_cast<int64_t>(sums[2]);
        EpochRecord record;
        record.epoch = epoch;
        record.seconds = std::chrono::duration<double>(Clock::now() - epoch_start).count();
        record.train_loss = seen > 0 ? loss_sum / seen : 0.0;
        record.train_acc = seen > 0 ? 100.0 * correct / seen : 0.0;
        record.lr = lr;
        record.images_per_s = seen / std::max(record.seconds, 1e-9);
        record.skipped_images = static_cast<int64_t>(sums[3]);
        record.steps = steps;
        record.world_size = world;
        record.allreduce_wait_s = reducer ? reducer->wait_seconds() : 0.0;
        const bool eval_now = eval_data != nullptr &&
                              ((epoch + 1) % config_.eval_every == 0 || epoch + 1 == config_.epochs);
        if (eval_now) {
            const flops::WeightsInTraining training;  // no packed copies kept into the next epoch's steps
            record.eval = evaluate(*model_, *eval_data, config_.bf16, false, dist.get());
            record.has_eval = true;
            if (ema) {
                // Evaluate the averaged weights in place, then put the trained weights back.
                const ModelEma trained(*model_, 0.0);
                ema->copy_to(*model_);
                record.eval_ema = evaluate(*model_, *eval_data, config_.bf16, false, dist.get());
                record.has_eval_ema = true;
                trained.copy_to(*model_);
            }
        }
        history_.push_back(record);
        if (main_rank) append_metrics(metrics_path, record);
        if (config_.log_epochs && main_rank) {
            std::fprintf(stderr, "epoch %lld: train loss %.4f acc %.2f%%", static_cast<long long>(epoch + 1),
                         record.train_loss, record.train_acc);
            if (record.has_eval)
                std::fprintf(stderr, " | eval top1 %.2f%% top5 %.2f%% loss %.4f", record.eval.top1, record.eval.top5,
                             record.eval.loss);
            if (record.skipped_images > 0)
                std::fprintf(stderr, " | %lld unreadable images skipped", static_cast<long long>(record.skipped_images));
            std::fprintf(stderr, " | %.0f s\n", record.seconds);
        }
        // Without eval data the lowest training loss stands in; epochs skipped by eval_every do not compete.
        const double top1 = record.has_eval ? record.eval.top1 : -record.train_loss;
        if ((record.has_eval || eval_data == nullptr) && top1 > state.best_top1) {
            state.best_top1 = top1;
            if (save_weights && main_rank)
                save_weights((fs::path(config_.output_dir) / "best.safetensors").string(), *model_);
        }
        state.epoch = epoch + 1;
        state.batch = 0;
        if (main_rank) {
            save_checkpoint(checkpoint_path, state, *model_, *optimizer, ema ? &ema->tensors() : nullptr);
            if (on_epoch_end) on_epoch_end(history_);
        }
    }
    if (save_weights && main_rank)
        save_weights((fs::path(config_.output_dir) / "last.safetensors").string(), *model_);
    if (dist) dist->barrier();  // every file is written before any worker reports success
    return true;
}

}  // namespace linvis::train
