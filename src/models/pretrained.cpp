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

WeightsLoadResult load_model_weights(VisionModel& model, const std::string& path, bool prefer_ema, bool strict) {
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
        raw = io::extract_state_dict(io::read_torch_checkpoint(path), prefer_ema, &result.chosen_key);
    }
    std::map<std::string, torch::Tensor> mapped;
    try {
        mapped = io::map_state_dict_to_model(raw, model, strict, &result.mapping);
    } catch (const Error& e) {
        fail(path, ": ", e.what());
    }
    const io::LoadReport report = io::load_state_dict(model, mapped, strict, path);
    result.loaded = static_cast<int64_t>(report.loaded.size());
    return result;
}

}  // namespace linvis::models
