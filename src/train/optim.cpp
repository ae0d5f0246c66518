#include "linvis/train/optim.h"

#include <cmath>

#include "linvis/core/error.h"

namespace linvis::train {

bool excluded_from_weight_decay(const std::string& name, const torch::Tensor& parameter) {
    if (parameter.dim() <= 1) return true;
    const char* keywords[] = {"pos_embed", "cls_token", "dist_token", "token_idx", "rope", "relative_position"};
    for (const char* keyword : keywords)
        if (name.find(keyword) != std::string::npos) return true;
    const std::string bias_suffix = ".bias";
    return name.size() >= bias_suffix.size() &&
           name.compare(name.size() - bias_suffix.size(), bias_suffix.size(), bias_suffix) == 0;
}

std::unique_ptr<torch::optim::AdamW> make_adamw(torch::nn::Module& module, const OptimizerConfig& config,
                                                std::vector<ParamGroupInfo>* groups_out) {
    struct Bucket {
        ParamGroupInfo info;
        std::vector<torch::Tensor> params;
    };
    std::vector<Bucket> buckets;
    auto bucket_for = [&](bool decay, bool boosted) -> Bucket& {
        std::string label = decay ? "decay" : "no_decay";
        if (boosted && config.lr_multiplier != 1.0) label += "_x" + std::to_string(config.lr_multiplier);
        for (auto& b : buckets)
            if (b.info.label == label) return b;
        Bucket b;
        b.info.label = label;
        b.info.weight_decay = decay ? config.weight_decay : 0.0;
        b.info.lr_scale = boosted ? config.lr_multiplier : 1.0;
        buckets.push_back(b);
        return buckets.back();
    };
    size_t boosted_found = 0;
    for (auto& item : module.named_parameters(true)) {
        const bool boosted = config.boosted_parameters.count(item.key()) != 0;
        boosted_found += boosted ? 1 : 0;
        if (config.train_only_boosted && !boosted) item.value().set_requires_grad(false);
        if (!item.value().requires_grad()) continue;
        Bucket& b = bucket_for(!excluded_from_weight_decay(item.key(), item.value()), boosted);
        b.info.names.push_back(item.key());
        b.params.push_back(item.value());
    }
    LINVIS_CHECK(boosted_found == config.boosted_parameters.size(), "optimizer: ",
                 config.boosted_parameters.size() - boosted_found,
                 " parameter(s) named for the lr multiplier do not exist in the model");
    LINVIS_CHECK(!buckets.empty(), "optimizer: the model has no trainable parameters");
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (auto& b : buckets) {
        auto options = std::make_unique<torch::optim::AdamWOptions>(config.lr * b.info.lr_scale);
        options->betas({config.beta1, config.beta2}).eps(config.eps).weight_decay(b.info.weight_decay);
        groups.emplace_back(b.params, std::move(options));
        if (groups_out) groups_out->push_back(b.info);
    }
    return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(config.lr));
}

double CosineSchedule::lr_at(int64_t step) const {
    if (step < warmup_steps)
        return warmup_lr + (base_lr - warmup_lr) * static_cast<double>(step) / static_cast<double>(warmup_steps);
    const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
    const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps));
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

void apply_learning_rate(torch::optim::AdamW& optimizer, const std::vector<ParamGroupInfo>& groups, double lr) {
    auto& param_groups = optimizer.param_groups();
    LINVIS_CHECK(param_groups.size() == groups.size(), "optimizer: ", param_groups.size(),
                 " param groups but ", groups.size(), " descriptions");
    for (size_t i = 0; i < param_groups.size(); ++i)
        static_cast<torch::optim::AdamWOptions&>(param_groups[i].options()).lr(lr * groups[i].lr_scale);
}

double clip_gradients(torch::nn::Module& module, double max_norm) {
    std::vector<torch::Tensor> grads;
    for (auto& p : module.parameters())
        if (p.grad().defined()) grads.push_back(p.grad());
    if (grads.empty()) return 0.0;
    double total = 0.0;
    for (auto& g : grads) total += g.to(torch::kFloat64).pow(2).sum().item<double>();
    const double norm = std::sqrt(total);
    if (max_norm > 0 && norm > max_norm) {
        const double scale = max_norm / (norm + 1e-6);
        for (auto& g : grads) g.mul_(scale);
    }
    return norm;
}

}  // namespace linvis::train
