#include "linvis/train/ema.h"

#include "linvis/core/error.h"

namespace linvis::train {

ModelEma::ModelEma(const torch::nn::Module& model, double decay) : decay_(decay) {
    torch::NoGradGuard no_grad;
    for (const auto& item : model.named_parameters(true)) tensors_[item.key()] = item.value().detach().clone();
    for (const auto& item : model.named_buffers(true)) tensors_[item.key()] = item.value().detach().clone();
}

void ModelEma::update(const torch::nn::Module& model) {
    torch::NoGradGuard no_grad;
    for (const auto& item : model.named_parameters(true)) {
        auto it = tensors_.find(item.key());
        LINVIS_CHECK(it != tensors_.end(), "EMA: parameter '", item.key(), "' not in the averaged model");
        it->second.mul_(decay_).add_(item.value().detach(), 1.0 - decay_);
    }
    for (const auto& item : model.named_buffers(true)) tensors_[item.key()].copy_(item.value());
}

void ModelEma::copy_to(torch::nn::Module& model) const {
    torch::NoGradGuard no_grad;
    for (auto& item : model.named_parameters(true)) item.value().copy_(tensors_.at(item.key()));
    for (auto& item : model.named_buffers(true)) item.value().copy_(tensors_.at(item.key()));
}

}  // namespace linvis::train
