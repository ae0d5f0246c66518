#include "common.h"

#include <iostream>

#include "linvis/core/error.h"
#include "linvis/models/pretrained.h"
#include "linvis/models/registry.h"

namespace linvis::cli {

CLI::Option* add_model_option(CLI::App& app, std::string& model) {
    return app.add_option("--model", model, "model name (see 'linvis models')")->type_name("NAME");
}

void add_model_options(CLI::App& app, ModelOptions& options, bool weights_required) {
    add_model_option(app, options.model)->required();
    add_model_kwargs_option(app, options.kwargs);
    app.add_option("--weights", options.weights, "weights: .safetensors, or an official PyTorch checkpoint (.pth)")
        ->type_name("FILE")
        ->required(weights_required);
    add_weights_flags(app, options.ema, options.non_strict);
}

namespace {
void load_and_report(models::Model& model, const ModelOptions& options) {
    const std::string& weights = options.weights;
    if (!weights.empty()) {
        const auto result = models::load_model_weights(model, weights, options.ema, !options.non_strict);
        std::cerr << "loaded " << result.loaded << " tensors from " << weights << " (" << result.format
                  << (result.chosen_key.empty() ? "" : ", key '" + result.chosen_key + "'") << ")";
        if (!result.mapping.renamed.empty()) std::cerr << ", " << result.mapping.renamed.size() << " renamed";
        if (!result.mapping.adapted.empty()) std::cerr << ", " << result.mapping.adapted.size() << " resized";
        std::cerr << "\n";
        for (const auto& key : result.mapping.missing) std::cerr << "  missing (kept as initialised): " << key << "\n";
        for (const auto& key : result.mapping.unexpected) std::cerr << "  unexpected (ignored): " << key << "\n";
        for (const auto& key : result.mapping.mismatched) std::cerr << "  shape mismatch (ignored): " << key << "\n";
    }
}
}  // namespace

models::ModelPtr build_model(const ModelOptions& options, const std::map<std::string, std::string>& defaults) {
    auto kwargs = options.kwargs;
    for (const auto& [key, value] : defaults) kwargs.emplace(key, value);
    models::ModelPtr model = models::create_model(options.model, models::ModelConfig(kwargs));
    load_and_report(*model, options);
    model->eval();
    return model;
}

std::shared_ptr<models::Model> build_generative_model(const ModelOptions& options,
                                                      const std::map<std::string, std::string>& defaults) {
    auto kwargs = options.kwargs;
    for (const auto& [key, value] : defaults) kwargs.emplace(key, value);
    std::shared_ptr<models::Model> model = models::create_generative_model(options.model, models::ModelConfig(kwargs));
    load_and_report(*model, options);
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
