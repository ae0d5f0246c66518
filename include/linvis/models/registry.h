// Model registry: every model is created by name with options, like timm.create_model.
// Each family's source file registers its sizes with a static ModelRegistrar.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "linvis/models/model.h"

namespace linvis::models {

using ModelFactory = std::function<ModelPtr(const ModelConfig&)>;

struct ModelInfo {
    std::string name;         // e.g. "vittt_tiny"
    std::string family;       // e.g. "vittt"
    std::string description;  // one line: paper and size
    ModelFactory create;
};

void register_model(ModelInfo info);
// All registered models sorted by name.
std::vector<ModelInfo> list_models();
bool has_model(const std::string& name);
// Creates a model; throws linvis::Error for an unknown name (listing close names) or an
// option the model does not understand. Common options: num_classes, img_size, in_chans,
// drop_path_rate, depth, embed_dim, num_heads, patch_size.
ModelPtr create_model(const std::string& name, const ModelConfig& config = ModelConfig());

struct ModelRegistrar {
    ModelRegistrar(std::string name, std::string family, std::string description, ModelFactory create);
};

// ---- Generative models (diffusion transformers, the VAE decoder and encoder): not classifiers, so a registry of
// their own with a kind tag; `linvis models` lists both. create_model on such a name is an error
// pointing here, and create_generative_model on a classifier name likewise.
using GenerativeFactory = std::function<std::shared_ptr<Model>(const ModelConfig&)>;

struct GenerativeModelInfo {
    std::string name;         // e.g. "dit3_s2"
    std::string family;       // "dit", "dit3", "dit5", "vae"
    std::string kind;         // "diffusion" (models/dit.h DiffusionModel) or "vae" (models/vae.h VaeDecoder, VaeEncoder)
    std::string description;
    GenerativeFactory create;
};

void register_generative_model(GenerativeModelInfo info);
std::vector<GenerativeModelInfo> list_generative_models();
bool has_generative_model(const std::string& name);
// The kind of a registered generative model, "" when the name is not one.
std::string generative_model_kind(const std::string& name);
std::shared_ptr<Model> create_generative_model(const std::string& name, const ModelConfig& config = ModelConfig());

struct GenerativeModelRegistrar {
    GenerativeModelRegistrar(std::string name, std::string family, std::string kind, std::string description,
                             GenerativeFactory create);
};

int64_t count_parameters(const torch::nn::Module& module, bool trainable_only = false);

}  // namespace linvis::models
