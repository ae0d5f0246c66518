// Loading weights into a model from a file, whatever its origin: a linvis/timm safetensors
// file, or an official PyTorch checkpoint (torch.save zip with the model or EMA state dict
// inside). Raw training names are mapped with the model's map_checkpoint_key and
// resolution-dependent tensors (position embeddings, RoPE tables) adapted to the model's size.
#pragma once

#include <string>

#include "linvis/io/torch_checkpoint.h"
#include "linvis/models/model.h"

namespace linvis::models {

struct WeightsLoadResult {
    std::string format;       // "safetensors" | "torch checkpoint"
    std::string chosen_key;   // key of the state dict inside a torch checkpoint ("" for top level)
    io::ModelMappingReport mapping;
    int64_t loaded = 0;       // tensors copied into the model
};

// strict: every model parameter/buffer must be provided with the right shape and nothing else
// may be left over; otherwise one linvis::Error names every missing, unexpected and mismatched
// key and the file, and the model is left unchanged. prefer_ema picks the EMA weights of a
// torch checkpoint (an error if it has none; safetensors files hold one set of weights).
WeightsLoadResult load_model_weights(VisionModel& model, const std::string& path, bool prefer_ema = false,
                                     bool strict = true);

}  // namespace linvis::models
