#include "linvis/models/registry.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "linvis/core/error.h"

namespace linvis::models {
namespace {

std::map<std::string, ModelInfo>& table() {
    static std::map<std::string, ModelInfo> models;
    return models;
}

std::map<std::string, GenerativeModelInfo>& generative_table() {
    static std::map<std::string, GenerativeModelInfo> models;
    return models;
}

template <typename Table>
std::string close_names(const Table& t, const std::string& name) {
    std::string close;
    const std::string family = name.substr(0, name.find('_'));
    for (const auto& [other, info] : t)
        if (other.rfind(family, 0) == 0) close += (close.empty() ? "" : ", ") + other;
    return close;
}

std::string lowercase(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s;
}

bool parse_bool(const std::string& key, const std::string& text) {
    const std::string v = lowercase(text);
    if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
    if (v == "0" || v == "false" || v == "no" || v == "off") return false;
    fail("model option ", key, ": expected true/false, got '", text, "'");
}

}  // namespace

ModelConfig& ModelConfig::set(const std::string& key, const std::string& value) {
    values_[key] = value;
    return *this;
}
ModelConfig& ModelConfig::set(const std::string& key, int64_t value) { return set(key, std::to_string(value)); }
ModelConfig& ModelConfig::set(const std::string& key, double value) {
    std::ostringstream out;
    out.precision(17);
    out << value;
    return set(key, out.str());
}

int64_t ModelConfig::get_int(const std::string& key, int64_t default_value) const {
    used_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return default_value;
    try {
        size_t used = 0;
        int64_t v = std::stoll(it->second, &used);
        if (used == it->second.size()) return v;
    } catch (const std::exception&) {
    }
    fail("model option ", key, ": expected an integer, got '", it->second, "'");
}

double ModelConfig::get_double(const std::string& key, double default_value) const {
    used_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return default_value;
    try {
        size_t used = 0;
        double v = std::stod(it->second, &used);
        if (used == it->second.size()) return v;
    } catch (const std::exception&) {
    }
    fail("model option ", key, ": expected a number, got '", it->second, "'");
}

bool ModelConfig::get_bool(const std::string& key, bool default_value) const {
    used_.insert(key);
    auto it = values_.find(key);
    return it == values_.end() ? default_value : parse_bool(key, it->second);
}

std::string ModelConfig::get_string(const std::string& key, const std::string& default_value) const {
    used_.insert(key);
    auto it = values_.find(key);
    return it == values_.end() ? default_value : it->second;
}

std::vector<int64_t> ModelConfig::get_int_list(const std::string& key, const std::vector<int64_t>& default_value) const {
    used_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return default_value;
    std::vector<int64_t> out;
    std::stringstream in(it->second);
    std::string item;
    while (std::getline(in, item, ',')) {
        try {
            size_t used = 0;
            out.push_back(std::stoll(item, &used));
            if (used == item.size()) continue;
        } catch (const std::exception&) {
        }
        fail("model option ", key, ": expected comma-separated integers, got '", it->second, "'");
    }
    LINVIS_CHECK(!out.empty(), "model option ", key, ": expected comma-separated integers, got nothing");
    return out;
}

FeatureOptions read_feature_options(const ModelConfig& config) {
    FeatureOptions o;
    o.features_only = config.get_bool("features_only", false);
    o.out_indices = config.get_int_list("out_indices", {});
    LINVIS_CHECK(o.features_only || o.out_indices.empty(),
                 "model option out_indices: only meaningful with features_only=true");
    return o;
}

void ModelConfig::check_all_used(const std::string& model_name) const {
    std::string unknown;
    for (const auto& [key, value] : values_)
        if (!used_.count(key)) unknown += (unknown.empty() ? "" : ", ") + key;
    if (!unknown.empty()) fail(model_name, ": unknown model option(s): ", unknown);
}

void register_model(ModelInfo info) {
    LINVIS_CHECK(!table().count(info.name), "model '", info.name, "' registered twice");
    table()[info.name] = std::move(info);
}

std::vector<ModelInfo> list_models() {
    std::vector<ModelInfo> out;
    for (const auto& [name, info] : table()) out.push_back(info);
    return out;
}

bool has_model(const std::string& name) { return table().count(name) != 0; }

ModelPtr create_model(const std::string& name, const ModelConfig& config) {
    auto it = table().find(name);
    if (it == table().end()) {
        LINVIS_CHECK(!generative_table().count(name), "model '", name, "' is a ", generative_model_kind(name),
                     " model, not a classifier: use 'linvis run' or 'linvis sample' with it");
        const std::string close = close_names(table(), name);
        fail("unknown model '", name, "'", close.empty() ? std::string(" (see 'linvis models')") : "; did you mean one of: " + close);
    }
    ModelConfig local = config;
    ModelPtr model = it->second.create(local);
    local.check_all_used(name);
    return model;
}

ModelRegistrar::ModelRegistrar(std::string name, std::string family, std::string description,
                               ModelFactory create) {
    register_model({std::move(name), std::move(family), std::move(description), std::move(create)});
}

void register_generative_model(GenerativeModelInfo info) {
    LINVIS_CHECK(!table().count(info.name) && !generative_table().count(info.name), "model '", info.name,
                 "' registered twice");
    generative_table()[info.name] = std::move(info);
}

std::vector<GenerativeModelInfo> list_generative_models() {
    std::vector<GenerativeModelInfo> out;
    for (const auto& [name, info] : generative_table()) out.push_back(info);
    return out;
}

bool has_generative_model(const std::string& name) { return generative_table().count(name) != 0; }

std::string generative_model_kind(const std::string& name) {
    auto it = generative_table().find(name);
    return it == generative_table().end() ? std::string() : it->second.kind;
}

std::shared_ptr<Model> create_generative_model(const std::string& name, const ModelConfig& config) {
    auto it = generative_table().find(name);
    if (it == generative_table().end()) {
        LINVIS_CHECK(!table().count(name), "model '", name, "' is a classifier, not a generative model");
        const std::string close = close_names(generative_table(), name);
        fail("unknown model '", name, "'",
             close.empty() ? std::string(" (see 'linvis models')") : "; did you mean one of: " + close);
    }
    ModelConfig local = config;
    std::shared_ptr<Model> model = it->second.create(local);
    local.check_all_used(name);
    return model;
}

GenerativeModelRegistrar::GenerativeModelRegistrar(std::string name, std::string family, std::string kind,
                                                   std::string description, GenerativeFactory create) {
    register_generative_model(
        {std::move(name), std::move(family), std::move(kind), std::move(description), std::move(create)});
}

int64_t count_parameters(const torch::nn::Module& module, bool trainable_only) {
    int64_t total = 0;
    for (const auto& p : module.parameters(true))
        if (!trainable_only || p.requires_grad()) total += p.numel();
    return total;
}

}  // namespace linvis::models
