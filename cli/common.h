// Helpers shared by the CLI commands that build and load models.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "linvis/io/transforms.h"
#include "linvis/models/model.h"
#include "options.h"

namespace linvis::cli {

// --model, --model-kwargs, --weights, --ema and --non-strict.
struct ModelOptions {
    std::string model;
    std::map<std::string, std::string> kwargs;
    std::string weights;
    bool ema = false;
    bool non_strict = false;
};

// --model NAME: a registered model (several commands require it).
CLI::Option* add_model_option(CLI::App& app, std::string& model);
// model_required=false: --model may be left out when the weights name their model (see below).
void add_model_options(CLI::App& app, ModelOptions& options, bool weights_required, bool model_required = true);

// Builds options.model with options.kwargs (plus `defaults` for keys the user did not give) and, when weights
// are given, loads them (reporting what was mapped on stderr).
models::ModelPtr build_model(const ModelOptions& options, const std::map<std::string, std::string>& defaults = {});

// The same for a generative model (models/dit.h diffusion models, models/vae.h decoders and encoders): built from the
// generative registry, weights loaded and reported the same way (a diffusion training checkpoint gives its
// EMA weights unless it has none, as the official find_model), eval mode.
std::shared_ptr<models::Model> build_generative_model(const ModelOptions& options,
                                                      const std::map<std::string, std::string>& defaults = {});

std::string with_commas(int64_t n);

// True when argv holds "--task NAME" or "--task=NAME": train, eval and predict hand a task other than
// classification to its own command line before parsing.
bool task_is(int argc, const char* const* argv, const char* name);

// ---- Self-describing weights: the safetensors metadata 'linvis train' writes beside the tensors, so
// that the weights alone say how to build and feed the model (all values are strings; the lists and
// the options are JSON):
//   model          registry name                 model_kwargs  {"embed_dim": "96", ...}
//   classes        ["T-shirt/top", ...]          mean, std     per-channel normalisation of [0, 1] pixels
//   img_size       the training resolution       dataset       what it was trained on
std::map<std::string, std::string> model_metadata(const std::string& model,
                                                  const std::map<std::string, std::string>& kwargs,
                                                  const std::vector<std::string>& classes,
                                                  const std::vector<double>& mean, const std::vector<double>& std,
                                                  int64_t img_size, const std::string& dataset);

// What a weights file says about itself (empty fields when it has no such metadata, or is not safetensors).
struct WeightsDescription {
    std::string model;
    std::map<std::string, std::string> kwargs;
    std::vector<std::string> classes;
    std::vector<double> mean, std;
    int64_t img_size = 0;
};
WeightsDescription describe_weights(const std::string& path);

// The evaluation transform for a model's input: ImageNet's normalisation with the given crop, or, for
// weights trained by linvis (their metadata has 'mean'), the training set's normalisation (one value:
// a grey model) at its resolution with the whole image, unless --img-size / --crop-pct were given.
io::EvalTransform input_transform(const WeightsDescription& described, int64_t img_size, bool img_size_given,
                                  double crop_pct, bool crop_pct_given);

// --model may be left out when the weights name their model: fills options.model and the kwargs the
// user did not give from the file's metadata. Throws naming the file when neither says which model.
void complete_model_options_from_weights(ModelOptions& options);

}  // namespace linvis::cli
