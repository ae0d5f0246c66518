// Optimiser set-up of the DeiT/Swin recipe the papers train with: AdamW whose parameter
// groups exclude norms, biases and position embeddings from weight decay, an optional
// learning-rate multiplier for chosen parameters (T5's new parameters), and a cosine
// schedule with linear warm-up evaluated per optimisation step.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace linvis::train {

struct OptimizerConfig {
    double lr = 5e-4;
    double weight_decay = 0.05;
    double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
    // Parameters named here get lr * lr_multiplier (T5 trains its new parameters at 20x).
    std::set<std::string> boosted_parameters;
    double lr_multiplier = 1.0;
    // Train only boosted_parameters (T5's "Freeze" mode); the rest get requires_grad=false.
    bool train_only_boosted = false;
};

// True for parameters that take no weight decay: 1-D tensors (norm weights, biases, gains),
// position embeddings, class tokens and other learnable tokens (timm's rule plus its
// no_weight_decay() names).
bool excluded_from_weight_decay(const std::string& name, const torch::Tensor& parameter);

// One group of parameters that share decay and lr multiplier.
struct ParamGroupInfo {
    std::string label;  // "decay", "no_decay", "decay_x20", ...
    std::vector<std::string> names;
    double weight_decay = 0.0;
    double lr_scale = 1.0;
};

// AdamW over `module`'s trainable parameters, grouped as above. `groups` receives each
// optimizer param group's description, index-aligned with optimizer->param_groups().
std::unique_ptr<torch::optim::AdamW> make_adamw(torch::nn::Module& module, const OptimizerConfig& config,
                                                std::vector<ParamGroupInfo>* groups = nullptr);

// Cosine decay from base_lr to min_lr over total_steps after a linear warm-up from
// warmup_lr over warmup_steps (timm's CosineLRScheduler with t_in_epochs=False).
struct CosineSchedule {
    double base_lr = 5e-4;
    double min_lr = 1e-5;
    double warmup_lr = 1e-6;
    int64_t warmup_steps = 0;
    int64_t total_steps = 1;
    double lr_at(int64_t step) const;
};

// Sets every group's lr to lr * its lr_scale.
void apply_learning_rate(torch::optim::AdamW& optimizer, const std::vector<ParamGroupInfo>& groups, double lr);

// Clips the global L2 norm of all gradients to max_norm (<= 0: no clipping); returns the norm before clipping.
double clip_gradients(torch::nn::Module& module, double max_norm);

}  // namespace linvis::train
