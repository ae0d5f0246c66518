#include "common.h"

#include <iostream>

#include <nlohmann/json.hpp>

#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "linvis/models/pretrained.h"
#include "linvis/models/registry.h"

namespace linvis::cli {

CLI::Option* add_model_option(CLI::App& app, std::string& model) {
    return app.add_option("--model", model, "model name (see 'linvis models')")->type_name("NAME");
}

void add_model_options(CLI::App& app, ModelOptions& options, bool weights_required, bool model_required) {
    add_model_option(app, options.model)->required(model_required);
    add_model_kwargs_option(app, options.kwargs);
    app.add_option("--weights", options.weights, "weights: .safetensors, or an official PyTorch checkpoint (.pth)")
        ->type_name("FILE")
        ->required(weights_required);
    add_weights_flags(app, options.ema, options.non_strict);
}

namespace {
void load_and_report(models::Model& model, const ModelOptions& options, bool strict) {
    const std::string& weights = options.weights;
    if (!weights.empty()) {
        const auto result = models::load_model_weights(model, weights, options.ema, strict);
        std::cerr << "loaded " << result.loaded << " tensors from " << weights << " (" << result.format
                  << (result.chosen_key.empty() ? "" : ", key '" + result.chosen_key + "'") << ")";
        if (!result.mapping.renamed.empty()) std::cerr << ", " << result.mapping.renamed.size() << " renamed";
        if (!result.mapping.adapted.empty()) std::cerr << ", " << result.mapping.adapted.size() << " resized";
        if (!result.mapping.dropped.empty()) std::cerr << ", " << result.mapping.dropped.size() << " left out";
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
    // A features_only backbone takes classification checkpoints as the official det/seg code does:
    // non-strictly, reporting what was left out.
    load_and_report(*model, options, !options.non_strict && model->feature_indices().empty());
    model->eval();
    return model;
}

std::shared_ptr<models::Model> build_generative_model(const ModelOptions& options,
                                                      const std::map<std::string, std::string>& defaults) {
    auto kwargs = options.kwargs;
    for (const auto& [key, value] : defaults) kwargs.emplace(key, value);
    std::shared_ptr<models::Model> model = models::create_generative_model(options.model, models::ModelConfig(kwargs));
    load_and_report(*model, options, !options.non_strict);
    model->eval();
    return model;
}

bool task_is(int argc, const char* const* argv, const char* name) {
    const std::string joined = std::string("--task=") + name;
    for (int i = 1; i < argc; ++i) {
        if (std::string(argv[i]) == "--task" && i + 1 < argc && std::string(argv[i + 1]) == name) return true;
        if (argv[i] == joined) return true;
    }
    return false;
}

std::string with_commas(int64_t n) {
    std::string digits = std::to_string(n), out;
    for (size_t i = 0; i < digits.size(); ++i) {
        if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
    }
    return out;
}

std::map<std::string, std::string> model_metadata(const std::string& model,
                                                  const std::map<std::string, std::string>& kwargs,
                                                  const std::vector<std::string>& classes,
                                                  const std::vector<double>& mean, const std::vector<double>& std,
                                                  int64_t img_size, const std::string& dataset) {
    std::map<std::string, std::string> out = {{"model", model}, {"model_kwargs", nlohmann::json(kwargs).dump()}};
    if (!classes.empty()) out["classes"] = nlohmann::json(classes).dump();
    if (!mean.empty()) out["mean"] = nlohmann::json(mean).dump();
    if (!std.empty()) out["std"] = nlohmann::json(std).dump();
    if (img_size > 0) out["img_size"] = std::to_string(img_size);
    if (!dataset.empty()) out["dataset"] = dataset;
    return out;
}

WeightsDescription describe_weights(const std::string& path) {
    WeightsDescription d;
    if (path.size() < 12 || path.compare(path.size() - 12, 12, ".safetensors") != 0) return d;
    const auto file = io::SafetensorsFile::open(path);
    const auto& meta = file.metadata();
    auto get = [&](const char* key) -> std::string {
        auto it = meta.find(key);
        return it == meta.end() ? std::string() : it->second;
    };
    // Metadata is a file's own claim: malformed JSON is an error naming the file and key.
    auto parse = [&](const char* key, auto& target) {
        const std::string text = get(key);
        if (text.empty()) return;
        try {
            nlohmann::json::parse(text).get_to(target);
        } catch (const std::exception& e) {
            fail(path, ": metadata '", key, "': expected JSON of the right shape, got '", text, "'");
        }
    };
    d.model = get("model");
    parse("model_kwargs", d.kwargs);
    parse("classes", d.classes);
    parse("mean", d.mean);
    parse("std", d.std);
    const std::string size = get("img_size");
    if (!size.empty()) {
        try {
            d.img_size = std::stoll(size);
        } catch (const std::exception&) {
            fail(path, ": metadata 'img_size': expected an integer, got '", size, "'");
        }
    }
    return d;
}

io::EvalTransform input_transform(const WeightsDescription& described, int64_t img_size, bool img_size_given,
                                  double crop_pct, bool crop_pct_given) {
    io::EvalTransform transform;
    transform.crop_size = img_size;
    transform.crop_pct = crop_pct;
    if (!described.mean.empty()) {
        transform.mean = described.mean;
        transform.std = described.std;
        if (described.img_size > 0 && !img_size_given) transform.crop_size = described.img_size;
        if (!crop_pct_given) transform.crop_pct = 1.0;
    }
    transform.validate();
    return transform;
}

void complete_model_options_from_weights(ModelOptions& options) {
    if (!options.model.empty()) return;
    LINVIS_CHECK(!options.weights.empty(), "--model NAME is required (or --weights FILE that names its model)");
    const WeightsDescription d = describe_weights(options.weights);
    LINVIS_CHECK(!d.model.empty(), options.weights, ": the file does not name its model (no metadata 'model'); give --model NAME");
    options.model = d.model;
    for (const auto& [key, value] : d.kwargs) options.kwargs.emplace(key, value);
}

}  // namespace linvis::cli
