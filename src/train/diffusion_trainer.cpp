// The official DiT training loop (spec dit_generation.md §4; facebookresearch/DiT@ed81ce2:train.py,
// LeapLabTHU/Transformer-to-TTT@06493e4:DiT5/train.py for the two learning-rate groups) on the CPU.
#include "linvis/train/diffusion_trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "linvis/core/error.h"
#include "linvis/io/atomic_file.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/state_dict.h"
#include "linvis/models/diffusion.h"
#include "linvis/train/checkpoint.h"
#include "linvis/train/ema.h"

namespace linvis::train {

std::set<std::string> ttt_fast_weight_parameters(const torch::nn::Module& model) {
    std::set<std::string> names;
    for (const auto& p : model.named_parameters(true)) {
        const std::string& k = p.key();
        for (const char* s : {"attn.w1", "attn.w2", "attn.b1", "attn.b2", "attn.w3"})
            if (k.find(s) != std::string::npos) names.insert(k);
    }
    return names;
}

DitInheritanceReport inherit_softmax_dit(torch::nn::Module& model, const std::map<std::string, torch::Tensor>& source) {
    std::map<std::string, torch::Tensor> own;
    for (const auto& p : model.named_parameters(true)) own[p.key()] = p.value();
    for (const auto& b : model.named_buffers(true)) own[b.key()] = b.value();
    DitInheritanceReport report;
    std::set<std::string> provided;
    torch::NoGradGuard no_grad;
    for (const auto& [raw, tensor] : source) {
        const std::string key = raw.rfind("module.", 0) == 0 ? raw.substr(7) : raw;
        auto it = own.find(key);
        if (key.find("attn.w1") != std::string::npos || key.find("attn.w2") != std::string::npos || it == own.end() ||
            it->second.sizes() != tensor.sizes()) {
            report.skipped.push_back(raw);
            continue;
        }
        it->second.copy_(tensor);
        report.copied.push_back(key);
        provided.insert(key);
    }
    for (const auto& [key, t] : own)
        if (!provided.count(key)) report.initialised.push_back(key);
    return report;
}

DiffusionTrainer::DiffusionTrainer(models::DiffusionModelPtr model, DiffusionTrainConfig config)
    : model_(std::move(model)), config_(std::move(config)) {
    LINVIS_CHECK(model_ != nullptr, "DiffusionTrainer: no model");
    LINVIS_CHECK(!config_.output_dir.empty(), "DiffusionTrainer: no output directory");
    LINVIS_CHECK(config_.epochs >= 1, "--epochs must be >= 1, got ", config_.epochs);
}

void DiffusionTrainer::fit(BatchSource& data) {
    namespace fs = std::filesystem;
    fs::create_directories(config_.output_dir);
    const std::string checkpoint_path = (fs::path(config_.output_dir) / "checkpoint.pt").string();
    const std::string metrics_path = (fs::path(config_.output_dir) / "metrics.jsonl").string();

    // Two AdamW groups as DiT5/train.py (only the first is non-empty with ttt parameters); trainable only.
    std::vector<torch::Tensor> fast, rest;
    for (const auto& p : model_->named_parameters(true)) {
        if (!p.value().requires_grad()) continue;
        (config_.ttt_parameters.count(p.key()) ? fast : rest).push_back(p.value());
    }
    auto options = [&](double lr) {
        return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(lr)
                                                                .betas({0.9, 0.999})
                                                                .eps(1e-8)
                                                                .weight_decay(config_.weight_decay));
    };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    if (!fast.empty()) groups.emplace_back(fast, options(config_.lr * config_.ttt_lr_scale));
    groups.emplace_back(rest, options(config_.lr));
    torch::optim::AdamW optimizer(groups, torch::optim::AdamWOptions(config_.lr).weight_decay(config_.weight_decay));

    ModelEma ema_with_decay(*model_, config_.ema_decay);  // starts as an exact copy (update_ema(decay=0))

    TrainingState state;
    state.config_json = config_.config_json;
    std::vector<std::string> metric_lines;
    if (config_.resume && fs::exists(checkpoint_path)) {
        const TrainingState loaded = load_checkpoint(checkpoint_path, *model_, optimizer, &ema_with_decay.tensors());
        LINVIS_CHECK(loaded.config_json == config_.config_json, checkpoint_path,
                     ": the checkpoint belongs to a run with other options (", loaded.config_json, ")");
        state = loaded;
        if (fs::exists(metrics_path)) {
            std::ifstream in(metrics_path);
            std::string line;
            while (std::getline(in, line) && static_cast<int64_t>(metric_lines.size()) < state.epoch)
                metric_lines.push_back(line);
        }
        std::fprintf(stderr, "resumed from %s at epoch %lld\n", checkpoint_path.c_str(),
                     static_cast<long long>(state.epoch));
    }

    const models::GaussianDiffusion diffusion("", model_->config().learn_sigma);
    const int64_t T = diffusion.num_timesteps();
    for (int64_t epoch = state.epoch; epoch < config_.epochs; ++epoch) {
        model_->train();
        torch::manual_seed(mix_seed(config_.seed, static_cast<uint64_t>(epoch), 0x646966667573ULL));
        data.start_epoch(epoch);
        const auto start = std::chrono::steady_clock::now();
        double sum_loss = 0, sum_mse = 0, sum_vb = 0;
        int64_t batches = 0, images = 0;
        const int64_t total = data.batches_per_epoch();
        torch::Tensor x, y;
        while (data.next(x, y)) {
            const int64_t B = x.size(0);
            torch::Tensor t = torch::randint(0, T, {B}, torch::kInt64);
            torch::Tensor noise = torch::randn_like(x);
            auto losses = diffusion.training_losses(
                [&](const torch::Tensor& xt, const torch::Tensor& tt) { return model_->forward(xt, tt, y); }, x, t, noise);
            torch::Tensor loss = losses.loss.mean();
            const double value = loss.item<double>();
            LINVIS_CHECK(std::isfinite(value), "diffusion training: the loss became ", value, " at epoch ", epoch,
                         ", batch ", batches, " (the last checkpoint is ", checkpoint_path, ")");
            optimizer.zero_grad();
            loss.backward();
            optimizer.step();
            ema_with_decay.update(*model_);
            ++state.step;
            sum_loss += value;
            sum_mse += losses.mse.mean().item<double>();
            if (losses.vb.defined()) sum_vb += losses.vb.mean().item<double>();
            ++batches;
            images += B;
            if (config_.progress) {
                std::fprintf(stderr, "\repoch %lld/%lld  batch %lld/%lld  loss %.4f", static_cast<long long>(epoch + 1),
                             static_cast<long long>(config_.epochs), static_cast<long long>(batches),
                             static_cast<long long>(total), sum_loss / batches);
                std::fflush(stderr);
            }
        }
        if (config_.progress) std::fprintf(stderr, "\n");
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        DiffusionEpochRecord r;
        r.epoch = epoch;
        r.loss = batches ? sum_loss / batches : 0.0;
        r.mse = batches ? sum_mse / batches : 0.0;
        r.vb = batches ? sum_vb / batches : 0.0;
        r.seconds = seconds;
        r.images_per_s = seconds > 0 ? images / seconds : 0.0;
        r.steps = state.step;
        history_.push_back(r);
        std::fprintf(stderr, "epoch %lld: loss %.5f (mse %.5f, vb %.5f), %.1f images/s, %lld steps\n",
                     static_cast<long long>(epoch + 1), r.loss, r.mse, r.vb, r.images_per_s,
                     static_cast<long long>(r.steps));

        state.epoch = epoch + 1;
        state.batch = 0;
        save_checkpoint(checkpoint_path, state, *model_, optimizer, &ema_with_decay.tensors());
        io::save_weights(*model_, (fs::path(config_.output_dir) / "last.safetensors").string());
        std::map<std::string, torch::Tensor> ema_tensors;
        for (const auto& [k, v] : ema_with_decay.tensors()) ema_tensors[k] = v.contiguous();
        io::save_safetensors((fs::path(config_.output_dir) / "ema.safetensors").string(), ema_tensors);
        metric_lines.push_back(nlohmann::json({{"epoch", r.epoch + 1}, {"loss", r.loss}, {"mse", r.mse}, {"vb", r.vb},
                                               {"seconds", r.seconds}, {"images_per_s", r.images_per_s},
                                               {"steps", r.steps}})
                                   .dump());
        std::string text;
        for (const auto& line : metric_lines) text += line + "\n";
        io::write_file_atomically(metrics_path, text);
    }
    model_->eval();
}

}  // namespace linvis::train
