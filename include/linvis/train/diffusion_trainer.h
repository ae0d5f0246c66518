// Training a class-conditional diffusion model with the official DiT recipe (spec dit_generation.md §4):
// images in [-1, 1] (horizontal flips from the data source), t ~ U{0..999}, loss = mean over the batch of
// GaussianDiffusion("").training_losses (mse + vb), AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0,
// constant lr, no clipping), label dropout 0.1 in train mode (the model's), EMA of every named parameter
// (pos_embed included) with decay 0.9999 updated after every step (starting as an exact copy).
// DiT5 inheritance (DiT5/train.py): two AdamW groups, the TTT fast-weight initialisers (attn.w1 / attn.w2)
// at lr * ttt_lr_scale first, everything else at lr.
//
// Writes into output_dir after every epoch: checkpoint.pt (model, optimiser, EMA, epoch; atomically),
// last.safetensors (the model), ema.safetensors (the EMA weights, what sampling uses) and metrics.jsonl
// (one line per epoch). resume continues from checkpoint.pt where it stopped (the next epoch, or the next
// batch after a Ctrl-C); batch order is seeded per (seed, epoch), timesteps, noise and label dropout per
// (seed, epoch, batch), so a resumed run repeats the uninterrupted one.
//
// Latent space (config.vae set; DiT train.py): each batch of images (B, C, S, S) in [-1, 1], S = 8 x the
// model's input_size, becomes x = vae.encode(images).latent_dist.sample() * 0.18215 under no_grad before the
// diffusion loss; grey images (C = 1) are repeated to the VAE's in_channels. The sample's eps is drawn with
// t, noise and the label-dropout mask from the step's seed (for the whole global batch, after them), so
// resumed and data-parallel latent runs repeat the single-process run as the pixel path does. The VAE is
// frozen (eval mode, no gradients) and not stored in the checkpoint: it belongs to the run's identity
// (config_json).
//
// Data parallel (config.distributed with world size W > 1, as train::Trainer): the data source is
// sharded (its batch size is the global batch G, each rank takes G / W rows: rows r, r + W, ... of the
// single-process batch), rank 0's weights are broadcast, gradients are averaged over the ranks during
// backward (GradientReducer). Every rank draws t, noise and the label-dropout mask for the whole global
// batch from the per-step seed and keeps its own rows, so W processes compute what one process computes
// on the same global batch (up to float32 rounding of the sums). Label dropout is therefore drawn here
// (the official token_drop with force_drop_ids), not by the model. Only rank 0 writes files; the
// metrics are over the global batch.
#pragma once

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "linvis/models/dit.h"
#include "linvis/models/vae.h"
#include "linvis/train/data.h"
#include "linvis/train/distributed.h"

namespace linvis::train {

struct DiffusionTrainConfig {
    int64_t epochs = 10;
    double lr = 1e-4;
    double weight_decay = 0.0;
    double ema_decay = 0.9999;
    double ttt_lr_scale = 1.0;                // lr multiplier of the parameters in ttt_parameters
    std::set<std::string> ttt_parameters;     // the first AdamW group (DiT5 inheritance: attn.w1 / attn.w2)
    uint64_t seed = 0;
    std::string output_dir;
    bool resume = false;
    bool progress = true;
    std::string config_json;                  // stored in the checkpoint; resuming another run is refused
    std::shared_ptr<Distributed> distributed; // data-parallel process group (null or world size 1: alone)
    models::VaeEncoderPtr vae;                // latent-space training (null: pixel space)
};

struct DiffusionEpochRecord {
    int64_t epoch = 0;
    double loss = 0.0, mse = 0.0, vb = 0.0;   // means over the epoch's batches
    double seconds = 0.0, images_per_s = 0.0;
    int64_t steps = 0;                        // optimiser steps so far
    int64_t world_size = 1;
};

class DiffusionTrainer {
public:
    DiffusionTrainer(models::DiffusionModelPtr model, DiffusionTrainConfig config);
    // Trains for config.epochs epochs on (images in [-1, 1], labels) batches. Throws linvis::Error when
    // the loss becomes NaN / Inf (the last checkpoint stays). Returns false when interrupted by SIGINT
    // (every rank stops after the same step; rank 0 saved checkpoint.pt first).
    bool fit(BatchSource& data);
    const std::vector<DiffusionEpochRecord>& history() const { return history_; }

private:
    models::LatentDistribution encode_images(const torch::Tensor& images) const;

    models::DiffusionModelPtr model_;
    DiffusionTrainConfig config_;
    std::vector<DiffusionEpochRecord> history_;
};

// The names of the TTT fast-weight initialisers of a model (DiT5/train.py create_optimizer_with_layer_lr:
// names containing attn.w1, attn.w2, attn.b1, attn.b2 or attn.w3).
std::set<std::string> ttt_fast_weight_parameters(const torch::nn::Module& model);

// DiT5/train.py load_softmax_weights_to_ttt: every source tensor (a leading "module." stripped) whose key
// exists in `model` with an identical shape is copied, except keys containing attn.w1 / attn.w2; the rest
// keep their initialisation. For a softmax DiT-S/2 source: 132 copied, 96 DiT5 tensors keep their init.
struct DitInheritanceReport {
    std::vector<std::string> copied;
    std::vector<std::string> skipped;     // source keys not copied (absent, other shape, attn.w1/w2)
    std::vector<std::string> initialised; // model keys the source did not provide
};
DitInheritanceReport inherit_softmax_dit(torch::nn::Module& model, const std::map<std::string, torch::Tensor>& source);

}  // namespace linvis::train
