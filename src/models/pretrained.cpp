#include "linvis/models/pretrained.h"

#include <filesystem>
#include <fstream>

#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/state_dict.h"

namespace linvis::models {
namespace {

bool looks_like_safetensors(const std::string& path) {
    const std::string suffix = ".safetensors";
    if (path.size() >= suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0)
        return true;
    // Content sniffing: torch checkpoints are zip files ("PK"); safetensors start with a u64 length then '{'.
    std::ifstream in(path, std::ios::binary);
    char head[9] = {};
    in.read(head, 9);
    return in.gcount() == 9 && head[8] == '{';
}

}  // namespace

namespace {
std::string name_list(const std::vector<std::string>& names, size_t limit = 20) {
    std::string s;
    for (size_t i = 0; i < names.size() && i < limit; ++i) s += str_cat(i ? ", " : "", names[i]);
    if (names.size() > limit) s += str_cat(", ... (", names.size() - limit, " more)");
    return s;
}
}  // namespace

std::map<std::string, torch::Tensor> map_state_dict_to_model(const std::map<std::string, torch::Tensor>& raw,
                                                             const Model& model, bool strict,
                                                             ModelMappingReport* report) {
    ModelMappingReport local;
    ModelMappingReport& rep = report ? *report : local;
    rep = ModelMappingReport();
    std::map<std::string, torch::Tensor> expected;
    for (const auto& item : model.named_parameters(true)) expected[item.key()] = item.value();
    for (const auto& item : model.named_buffers(true)) expected[item.key()] = item.value();

    std::map<std::string, torch::Tensor> out;
    std::map<std::string, std::string> source_of;
    for (const auto& [raw_key, tensor] : raw) {
        const std::string key = model.map_checkpoint_key(raw_key);
        if (key.empty()) {
            rep.dropped.push_back(raw_key);
            continue;
        }
        if (key != raw_key) rep.renamed.emplace_back(raw_key, key);
        auto seen = source_of.find(key);
        LINVIS_CHECK(seen == source_of.end(), "checkpoint keys '", seen == source_of.end() ? "" : seen->second,
                     "' and '", raw_key, "' both map to model key '", key, "'");
        source_of[key] = raw_key;
        const torch::Tensor adapted = model.adapt_checkpoint_tensor(key, tensor);
        if (adapted.sizes() != tensor.sizes())
            rep.adapted.push_back(str_cat(key, ": ", shape_string(tensor.sizes()), " -> ", shape_string(adapted.sizes())));
        auto target = expected.find(key);
        if (target == expected.end()) {
            rep.unexpected.push_back(key == raw_key ? key : str_cat(key, " (from ", raw_key, ")"));
            continue;
        }
        if (adapted.sizes() != target->second.sizes()) {
            rep.mismatched.push_back(str_cat(key, ": checkpoint ", shape_string(adapted.sizes()), " vs model ",
                                             shape_string(target->second.sizes())));
            continue;
        }
        out[key] = adapted;
    }
    for (const auto& [key, t] : expected)
        if (!source_of.count(key)) rep.missing.push_back(key);
    if (strict && !rep.complete()) {
        std::string msg = "checkpoint does not match the model:";
        if (!rep.missing.empty()) msg += str_cat(" missing keys (", rep.missing.size(), "): ", name_list(rep.missing), ";");
        if (!rep.unexpected.empty())
            msg += str_cat(" unexpected keys (", rep.unexpected.size(), "): ", name_list(rep.unexpected), ";");
        if (!rep.mismatched.empty())
            msg += str_cat(" shape mismatches (", rep.mismatched.size(), "): ", name_list(rep.mismatched), ";");
        fail(msg);
    }
    return out;
}

WeightsLoadResult load_model_weights(Model& model, const std::string& path, bool prefer_ema, bool strict) {
    LINVIS_CHECK(std::filesystem::exists(path), path, ": weights file not found");
    WeightsLoadResult result;
    std::map<std::string, torch::Tensor> raw;
    if (looks_like_safetensors(path)) {
        LINVIS_CHECK(!prefer_ema, path, ": --ema applies to PyTorch training checkpoints; a safetensors file "
                                        "holds one set of weights (pass the EMA file itself)");
        result.format = "safetensors";
        raw = io::SafetensorsFile::open(path).load_all();
    } else {
        result.format = "torch checkpoint";
        const io::CheckpointContents contents = io::read_torch_checkpoint(path);
        bool ema = prefer_ema;
        if (!ema && model.loads_ema_by_default()) {
            // The EMA when the file has one (DiT's find_model), else the model / bare state dict.
            try {
                raw = io::extract_state_dict(contents, true, &result.chosen_key);
                ema = true;
            } catch (const Error&) {
            }
        }
        if (raw.empty()) raw = io::extract_state_dict(contents, ema, &result.chosen_key);
    }
    std::map<std::string, torch::Tensor> mapped;
    try {
        mapped = map_state_dict_to_model(raw, model, strict, &result.mapping);
    } catch (const Error& e) {
        fail(path, ": ", e.what());
    }
    const io::LoadReport report = io::load_state_dict(model, mapped, strict, path);
    result.loaded = static_cast<int64_t>(report.loaded.size());
    return result;
}

}  // namespace linvis::models
