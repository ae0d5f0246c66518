// The official DiT training loop (spec dit_generation.md §4; facebookresearch/DiT@ed81ce2:train.py,
// LeapLabTHU/Transformer-to-TTT@06493e4:DiT5/train.py for the two learning-rate groups) on the CPU.
#include "linvis/train/diffusion_trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "linvis/core/error.h"
#include "linvis/io/atomic_file.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/state_dict.h"
#include "linvis/models/diffusion.h"
#include "linvis/train/checkpoint.h"
#include "linvis/train/ema.h"
#include "linvis/train/trainer.h"

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
    if (config_.vae) {
        const models::VaeConfig& v = config_.vae->config();
        LINVIS_CHECK(model_->in_channels() == v.latent_channels, "DiffusionTrainer: the model's in_channels ",
                     model_->in_channels(), " differs from the VAE's latent_channels ", v.latent_channels);
        config_.vae->eval();
        for (auto& p : config_.vae->parameters()) p.set_requires_grad(false);
    }
}

// DiT train.py: vae.encode(x).latent_dist under no_grad (the sample is drawn by fit from the step's seed).
models::LatentDistribution DiffusionTrainer::encode_images(const torch::Tensor& images) const {
    torch::NoGradGuard no_grad;
    models::VaeEncoder& vae = *config_.vae;
    const int64_t channels = vae.config().in_channels, side = model_->input_size() * vae.downsampling_factor();
    LINVIS_CHECK(images.dim() == 4 && (images.size(1) == channels || images.size(1) == 1) && images.size(2) == side &&
                     images.size(3) == side,
                 "diffusion training: latent space with input_size ", model_->input_size(), " needs images of (B, ",
                 channels, " or 1, ", side, ", ", side, "), got ", shape_string(images.sizes()));
    return vae.encode(images.size(1) == channels ? images : images.expand({-1, channels, -1, -1}).contiguous());
}

bool DiffusionTrainer::fit(BatchSource& data) {
    namespace fs = std::filesystem;
    const std::shared_ptr<Distributed>& dist = config_.distributed;
    const auto [rank, world] = process_place(dist.get());
    const bool main_rank = rank == 0;  // the only rank that writes files and prints
    const bool progress = config_.progress && main_rank;
    if (main_rank) fs::create_directories(config_.output_dir);
    const std::string checkpoint_path = (fs::path(config_.output_dir) / "checkpoint.pt").string();
    const std::string metrics_path = (fs::path(config_.output_dir) / "metrics.jsonl").string();
    if (world > 1) {
        data.shard(rank, world, true);      // the batch size is the global batch
        broadcast_module(*dist, *model_);   // every rank starts from rank 0's weights (and so does the EMA)
    }

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
        if (main_rank) {
            std::fprintf(stderr, "resumed from %s at epoch %lld", checkpoint_path.c_str(),
                         static_cast<long long>(state.epoch));
            if (state.batch > 0) std::fprintf(stderr, ", batch %lld", static_cast<long long>(state.batch));
            std::fprintf(stderr, "\n");
        }
    }

    const InterruptHandler interrupt_handler;
    std::unique_ptr<GradientReducer> reducer;
    if (world > 1) reducer = std::make_unique<GradientReducer>(*model_, dist);
    // Label dropout is drawn below with the timesteps and the noise: the official LabelEmbedder.token_drop
    // with force_drop_ids (facebookresearch/DiT@ed81ce2:models.py), each label dropped independently with
    // probability class_dropout_prob as in train mode. The label embedder (eval mode) does not draw again.
    std::vector<std::shared_ptr<torch::nn::Module>> label_embedders;
    for (const auto& m : model_->named_modules("", false))
        if (m.key() == "y_embedder" || (m.key().size() > 11 && m.key().substr(m.key().size() - 11) == ".y_embedder"))
            label_embedders.push_back(m.value());
    const double label_dropout = model_->config().class_dropout_prob;
    LINVIS_CHECK(label_dropout <= 0 || !label_embedders.empty(),
                 "DiffusionTrainer: the model has label dropout but no y_embedder module");

    const models::GaussianDiffusion diffusion("", model_->config().learn_sigma);
    const int64_t T = diffusion.num_timesteps();
    for (int64_t epoch = state.epoch; epoch < config_.epochs; ++epoch) {
        model_->train();
        for (auto& m : label_embedders) m->eval();
        data.start_epoch(epoch);
        const int64_t first_batch = epoch == state.epoch ? state.batch : 0;
        if (first_batch > 0) data.skip(first_batch);
        if (reducer) reducer->reset_wait_seconds();
        const auto start = std::chrono::steady_clock::now();
        double sum_loss = 0, sum_mse = 0, sum_vb = 0;
        int64_t batches = 0, images = 0;
        const int64_t total = data.batches_per_epoch();
        torch::Tensor x, y;
        for (int64_t b = first_batch; data.next(x, y); ++b) {
            const int64_t B = x.size(0), G = B * world;
            // The global batch's randomness from the step's seed; this rank's rows of it are the rows of
            // the single-process batch that its shard holds (r, r + W, ...: shard_order).
            const torch::Tensor rows = torch::arange(rank, G, world, torch::kInt64);
            auto global_randn = [&](at::IntArrayRef shape) {  // (B, ...) -> this rank's rows of a (G, ...) draw
                std::vector<int64_t> global = shape.vec();
                global[0] = G;
                torch::Tensor r = torch::randn(global, x.options());
                return world > 1 ? r.index_select(0, rows) : r;
            };
            // Latent space: encoding draws nothing, so its shape is known before t and the noise; the
            // posterior sample's eps is drawn last.
            std::optional<models::LatentDistribution> posterior;
            if (config_.vae) posterior = encode_images(x);
            torch::manual_seed(mix_seed(config_.seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(b) + 1));
            torch::Tensor t = torch::randint(0, T, {G}, torch::kInt64);
            torch::Tensor noise = global_randn(posterior ? posterior->mean.sizes() : x.sizes());
            torch::Tensor drop = torch::rand({G}) < label_dropout;
            if (world > 1) {
                t = t.index_select(0, rows);
                drop = drop.index_select(0, rows);
            }
            if (posterior) x = posterior->sample(global_randn(posterior->mean.sizes())) * models::kSdVaeScale;
            const torch::Tensor labels = label_dropout > 0 ? torch::where(drop, torch::full_like(y, model_->num_classes()), y) : y;
            auto losses = diffusion.training_losses(
                [&](const torch::Tensor& xt, const torch::Tensor& tt) { return model_->forward(xt, tt, labels); }, x, t,
                noise);
            torch::Tensor loss = losses.loss.mean();
            const double value = loss.item<double>();
            LINVIS_CHECK(std::isfinite(value), "diffusion training: the loss became ", value, " at epoch ", epoch,
                         ", batch ", b, " (the last checkpoint is ", checkpoint_path, ")");
            optimizer.zero_grad();
            if (reducer) reducer->prepare(true);  // the gradients are averaged over the ranks during backward
            loss.backward();
            distributed_heartbeat();
            if (reducer) reducer->finish();
            optimizer.step();
            ema_with_decay.update(*model_);
            ++state.step;
            sum_loss += value;
            sum_mse += losses.mse.mean().item<double>();
            if (losses.vb.defined()) sum_vb += losses.vb.mean().item<double>();
            ++batches;
            images += B;
            if (progress) {
                std::fprintf(stderr, "\repoch %lld/%lld  batch %lld/%lld  loss %.4f", static_cast<long long>(epoch + 1),
                             static_cast<long long>(config_.epochs), static_cast<long long>(b + 1),
                             static_cast<long long>(total), sum_loss / batches);
                std::fflush(stderr);
            }
            // Every rank stops after the same step when any of them was interrupted.
            std::vector<double> interrupted{interrupt_requested() ? 1.0 : 0.0};
            sum_over_ranks(dist.get(), interrupted);
            if (interrupted[0] > 0) {
                if (progress) std::fprintf(stderr, "\n");
                state.epoch = epoch;
                state.batch = b + 1;
                if (main_rank) {
                    save_checkpoint(checkpoint_path, state, *model_, optimizer, &ema_with_decay.tensors());
                    std::fprintf(stderr, "interrupted: saved %s (epoch %lld, batch %lld); continue with --resume\n",
                                 checkpoint_path.c_str(), static_cast<long long>(epoch + 1),
                                 static_cast<long long>(b + 1));
                }
                if (dist) dist->barrier();  // the checkpoint is complete before any worker exits
                clear_interrupt();
                model_->eval();
                return false;
            }
        }
        if (progress) std::fprintf(stderr, "\n");
        // Over the global batches: the mean of the ranks' batch means (equal shard batches), images summed.
        std::vector<double> sums{sum_loss, sum_mse, sum_vb, static_cast<double>(images)};
        sum_over_ranks(dist.get(), sums);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        DiffusionEpochRecord r;
        r.epoch = epoch;
        r.loss = batches ? sums[0] / static_cast<double>(world * batches) : 0.0;
        r.mse = batches ? sums[1] / static_cast<double>(world * batches) : 0.0;
        r.vb = batches ? sums[2] / static_cast<double>(world * batches) : 0.0;
        r.seconds = seconds;
        r.images_per_s = seconds > 0 ? sums[3] / seconds : 0.0;
        r.steps = state.step;
        r.world_size = world;
        history_.push_back(r);
        state.epoch = epoch + 1;
        state.batch = 0;
        if (main_rank) {
            std::fprintf(stderr, "epoch %lld: loss %.5f (mse %.5f, vb %.5f), %.1f images/s, %lld steps\n",
                         static_cast<long long>(epoch + 1), r.loss, r.mse, r.vb, r.images_per_s,
                         static_cast<long long>(r.steps));
            save_checkpoint(checkpoint_path, state, *model_, optimizer, &ema_with_decay.tensors());
            io::save_weights(*model_, (fs::path(config_.output_dir) / "last.safetensors").string());
            std::map<std::string, torch::Tensor> ema_tensors;
            for (const auto& [k, v] : ema_with_decay.tensors()) ema_tensors[k] = v.contiguous();
            io::save_safetensors((fs::path(config_.output_dir) / "ema.safetensors").string(), ema_tensors);
            nlohmann::json line = {{"epoch", r.epoch + 1}, {"loss", r.loss},     {"mse", r.mse},
                                   {"vb", r.vb},           {"seconds", r.seconds}, {"images_per_s", r.images_per_s},
                                   {"steps", r.steps}};
            if (world > 1) {
                line["world_size"] = world;
                line["allreduce_wait_s"] = reducer->wait_seconds();
            }
            metric_lines.push_back(line.dump());
            std::string text;
            for (const auto& l : metric_lines) text += l + "\n";
            io::write_file_atomically(metrics_path, text);
        }
    }
    model_->eval();
    if (dist) dist->barrier();  // every file is written before any worker reports success
    return true;
}

}  // namespace linvis::train
