// Exponential moving average of a model's weights (timm ModelEmaV2): after each optimiser
// step, ema = decay * ema + (1 - decay) * weights; buffers are copied.
#pragma once

#include <map>
#include <string>

#include <torch/torch.h>

namespace linvis::train {

class ModelEma {
public:
    ModelEma(const torch::nn::Module& model, double decay);
    void update(const torch::nn::Module& model);
    // Copies the averaged weights into `model` (same architecture).
    void copy_to(torch::nn::Module& model) const;
    double decay() const { return decay_; }
    std::map<std::string, torch::Tensor>& tensors() { return tensors_; }
    const std::map<std::string, torch::Tensor>& tensors() const { return tensors_; }

private:
    double decay_;
    std::map<std::string, torch::Tensor> tensors_;  // parameters and buffers by name
};

}  // namespace linvis::train
