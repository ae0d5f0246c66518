// Module weights by name: PyTorch-style state dicts and strict loading from safetensors.
//
// Keys are the full dotted names PyTorch's Module.state_dict() uses ("blocks.0.attn.qkv.weight"),
// i.e. LibTorch's named_parameters() followed by named_buffers(), both recursive. Every
// registered buffer counts (LibTorch has no non-persistent buffers).
#pragma once

#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace linvis::io {

// Parameters and buffers of `module` and all its submodules by full dotted name. The tensors
// share storage with the module (as PyTorch's state_dict does); detach()ed, no grad.
std::map<std::string, torch::Tensor> state_dict(const torch::nn::Module& module);

struct ShapeMismatch {
    std::string key;
    std::vector<int64_t> expected;  // the module's shape
    std::vector<int64_t> actual;    // the provided tensor's shape
};

// What load_state_dict found. Keys in each list are sorted.
struct LoadReport {
    std::vector<std::string> loaded;      // copied into the module
    std::vector<std::string> missing;     // in the module, not provided
    std::vector<std::string> unexpected;  // provided, not in the module
    std::vector<ShapeMismatch> mismatched;
    bool ok() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
    // One line naming every missing, unexpected and mismatched key ("" when ok()).
    std::string summary() const;
};

// Copies each provided tensor into the module's parameter/buffer of the same name, under
// NoGradGuard, converting dtype and device to the module's (Tensor::copy_ semantics).
// strict=true: if any key is missing, unexpected or mismatched in shape, throws one
// linvis::Error "<source>: cannot load weights: ..." naming every such key (with expected
// and actual shapes) and leaves the module unchanged. strict=false: loads the keys whose
// shapes match and reports the rest.
LoadReport load_state_dict(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                           bool strict, const std::string& source);

// state_dict(module) saved with save_safetensors (atomic). `metadata` gets
// {"format": "pt"} added unless it sets "format" itself (the transformers/timm convention).
void save_weights(const torch::nn::Module& module, const std::string& path,
                  const std::map<std::string, std::string>& metadata = {});

// load_state_dict(module, SafetensorsFile::open(path).load_all(), strict, path).
LoadReport load_weights(torch::nn::Module& module, const std::string& path, bool strict = true);

}  // namespace linvis::io
