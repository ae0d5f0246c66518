// State dicts and strict weight loading.
#include "linvis/io/state_dict.h"

#include <algorithm>

#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"

namespace linvis::io {
namespace {

std::string join_quoted(const std::vector<std::string>& keys) {
    std::string out;
    for (const auto& k : keys) out += (out.empty() ? "'" : ", '") + k + "'";
    return out;
}

const char* plural(size_t n, const char* one, const char* many) { return n == 1 ? one : many; }

}  // namespace

std::map<std::string, torch::Tensor> state_dict(const torch::nn::Module& module) {
    std::map<std::string, torch::Tensor> out;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) out[item.key()] = item.value().detach();
    for (const auto& item : module.named_buffers(/*recurse=*/true)) out[item.key()] = item.value().detach();
    return out;
}

std::string LoadReport::summary() const {
    std::vector<std::string> parts;
    if (!missing.empty()) {
        parts.push_back(str_cat(missing.size(), plural(missing.size(), " missing key: ", " missing keys: "),
                                join_quoted(missing)));
    }
    if (!unexpected.empty()) {
        parts.push_back(str_cat(unexpected.size(), plural(unexpected.size(), " unexpected key: ", " unexpected keys: "),
                                join_quoted(unexpected)));
    }
    if (!mismatched.empty()) {
        std::string list;
        for (const auto& m : mismatched) {
            list += str_cat(list.empty() ? "" : ", ", "'", m.key, "' (model expects ", shape_string(m.expected),
                            ", got ", shape_string(m.actual), ")");
        }
        parts.push_back(str_cat(mismatched.size(), plural(mismatched.size(), " shape mismatch: ", " shape mismatches: "),
                                list));
    }
    std::string out;
    for (const auto& p : parts) out += (out.empty() ? "" : "; ") + p;
    return out;
}

LoadReport load_state_dict(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                           bool strict, const std::string& source) {
    std::map<std::string, torch::Tensor> targets;
    for (const auto& item : module.named_parameters(true)) targets[item.key()] = item.value();
    for (const auto& item : module.named_buffers(true)) targets[item.key()] = item.value();

    LoadReport report;
    std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // (target, source)
    std::map<const void*, std::pair<std::string, torch::Tensor>> first_into;  // shared targets: first key, value
    for (const auto& [key, target] : targets) {
        auto it = tensors.find(key);
        if (it == tensors.end()) {
            report.missing.push_back(key);
            continue;
        }
        LINVIS_CHECK(it->second.defined(), source, ": tensor '", key, "' is undefined");
        if (it->second.sizes() != target.sizes()) {
            report.mismatched.push_back({key, target.sizes().vec(), it->second.sizes().vec()});
            continue;
        }
        // Keys that name one tensor of the model (a buffer its modules share) must bring one value.
        const auto [first, inserted] = first_into.try_emplace(target.numel() > 0 ? target.data_ptr() : nullptr,
                                                              key, it->second);
        if (!inserted && target.numel() > 0) {
            const torch::Tensor& earlier = first->second.second;
            LINVIS_CHECK(torch::equal(earlier.to(it->second.dtype()), it->second), source, ": tensors '",
                         first->second.first, "' and '", key,
                         "' load into one tensor of the model (a buffer shared by its modules) but differ");
            report.loaded.push_back(key);
            continue;
        }
        copies.emplace_back(target, it->second);
        report.loaded.push_back(key);
    }
    for (const auto& [key, value] : tensors) {
        if (targets.count(key) == 0) report.unexpected.push_back(key);
    }
    if (strict && !report.ok()) fail(source, ": cannot load weights: ", report.summary());

    torch::NoGradGuard no_grad;
    for (auto& [target, value] : copies) target.copy_(value);
    return report;
}

void save_weights(const torch::nn::Module& module, const std::string& path,
                  const std::map<std::string, std::string>& metadata) {
    std::map<std::string, std::string> meta = metadata;
    meta.emplace("format", "pt");
    save_safetensors(path, state_dict(module), meta);
}

LoadReport load_weights(torch::nn::Module& module, const std::string& path, bool strict) {
    const SafetensorsFile file = SafetensorsFile::open(path);
    return load_state_dict(module, file.load_all(), strict, path);
}

}  // namespace linvis::io
