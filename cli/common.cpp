#include "common.h"

#include <iostream>

#include "linvis/core/error.h"
#include "linvis/models/pretrained.h"
#include "linvis/models/registry.h"

namespace linvis::cli {

void add_model_options(tools::ArgParser& args, bool weights_required) {
    args.option("--model", "NAME", "model name (see 'linvis models')", "", true)
        .multi_option("--model-kwargs", "K=V", "model options, e.g. img_size=384 num_classes=10 depth=6")
        .option("--weights", "FILE", "weights: .safetensors, or an official PyTorch checkpoint (.pth)", "",
                weights_required)
        .flag("--ema", "take the EMA weights of a PyTorch training checkpoint")
        .flag("--non-strict", "load the tensors that match and report the rest instead of refusing");
}

models::ModelPtr build_model_from_args(const tools::ArgParser& args,
                                       const std::map<std::string, std::string>& defaults) {
    auto kwargs = tools::parse_key_values(args.get_all("--model-kwargs"), "--model-kwargs");
    for (const auto& [key, value] : defaults) kwargs.emplace(key, value);
    models::ModelPtr model = models::create_model(args.get("--model"), models::ModelConfig(kwargs));
    const std::string weights = args.get("--weights");
    if (!weights.empty()) {
        const auto result =
            models::load_model_weights(*model, weights, args.get_flag("--ema"), !args.get_flag("--non-strict"));
        std::cerr << "loaded " << result.loaded << " tensors from " << weights << " (" << result.format
                  << (result.chosen_key.empty() ? "" : ", key '" + result.chosen_key + "'") << ")";
        if (!result.mapping.renamed.empty()) std::cerr << ", " << result.mapping.renamed.size() << " renamed";
        if (!result.mapping.adapted.empty()) std::cerr << ", " << result.mapping.adapted.size() << " resized";
        std::cerr << "\n";
        for (const auto& key : result.mapping.missing) std::cerr << "  missing (kept as initialised): " << key << "\n";
        for (const auto& key : result.mapping.unexpected) std::cerr << "  unexpected (ignored): " << key << "\n";
        for (const auto& key : result.mapping.mismatched) std::cerr << "  shape mismatch (ignored): " << key << "\n";
    }
    model->eval();
    return model;
}

std::string with_commas(int64_t n) {
    std::string digits = std::to_string(n), out;
    for (size_t i = 0; i < digits.size(); ++i) {
        if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
    }
    return out;
}

}  // namespace linvis::cli
