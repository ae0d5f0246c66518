// Loading weights into a model from a file, whatever its origin: a linvis/timm safetensors
// file, or an official PyTorch checkpoint (torch.save zip with the model or EMA state dict
// inside). Raw training names are mapped with the model's map_checkpoint_key and
// resolution-dependent tensors (position embeddings, RoPE tables) adapted to the model's size.
#pragma once

#include <string>

#include "linvis/io/torch_checkpoint.h"
#include "linvis/models/model.h"

namespace linvis::models {

// Outcome of mapping a raw state dict onto a model.
struct ModelMappingReport {
    std::vector<std::pair<std::string, std::string>> renamed;  // raw key -> model key (only changed ones)
    std::vector<std::string> dropped;     // raw keys map_checkpoint_key maps to "" (e.g. legacy buffers)
    std::vector<std::string> adapted;     // "key: [1, 196, 192] -> [1, 576, 192]" (adapt_checkpoint_tensor)
    std::vector<std::string> missing;     // model keys the checkpoint does not provide
    std::vector<std::string> unexpected;  // mapped keys the model does not have
    std::vector<std::string> mismatched;  // "key: checkpoint [a] vs model [b]"
    bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

// Renames raw keys with model.map_checkpoint_key (an empty result drops the key), adapts
// resolution-dependent tensors with model.adapt_checkpoint_tensor, and compares names and
// shapes with the model's parameters and buffers. Returns the tensors that match the model
// (unexpected and mismatched ones are left out), in the checkpoint's dtype. When `strict`,
// any missing/unexpected/mismatched key throws linvis::Error naming them all. Two raw keys
// mapping to the same model key always throw.
std::map<std::string, torch::Tensor> map_state_dict_to_model(const std::map<std::string, torch::Tensor>& raw,
                                                             const Model& model, bool strict,
                                                             ModelMappingReport* report = nullptr);

struct WeightsLoadResult {
    std::string format;       // "safetensors" | "torch checkpoint"
    std::string chosen_key;   // key of the state dict inside a torch checkpoint ("" for top level)
    ModelMappingReport mapping;
    int64_t loaded = 0;       // tensors copied into the model
};

// strict: every model parameter/buffer must be provided with the right shape and nothing else
// may be left over; otherwise one linvis::Error names every missing, unexpected and mismatched
// key and the file, and the model is left unchanged. prefer_ema picks the EMA weights of a
// torch checkpoint (an error if it has none; safetensors files hold one set of weights).
WeightsLoadResult load_model_weights(Model& model, const std::string& path, bool prefer_ema = false,
                                     bool strict = true);

}  // namespace linvis::models
