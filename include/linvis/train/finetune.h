// Weight inheritance for T5's conversion protocol (seed 004; vit3_t5_official.md B5): a
// linear-time model takes every tensor of a pretrained softmax model whose name and shape
// match; the rest of its parameters are new and are trained at a learning-rate multiplier.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace linvis::train {

struct InheritanceReport {
    std::vector<std::string> copied;          // same name and shape: copied
    std::vector<std::string> new_parameters;  // parameters of the target the source does not have
    std::vector<std::string> new_buffers;
    std::vector<std::string> shape_mismatch;  // "name: source [..] vs target [..]" (kept as initialised)
    std::vector<std::string> unused;          // source tensors the target has no place for
};

// Copies every source tensor into the target parameter/buffer with the same name and shape.
// Shape mismatches are reported and left as initialised (when allow_shape_mismatch) or
// refused with one linvis::Error naming them all.
InheritanceReport inherit_weights(torch::nn::Module& target, const std::map<std::string, torch::Tensor>& source,
                                  bool allow_shape_mismatch = true);

// A multi-line human-readable summary of the report.
std::string describe(const InheritanceReport& report);

}  // namespace linvis::train
