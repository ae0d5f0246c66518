// Helpers shared by the CLI commands that build and load models.
#pragma once

#include <map>
#include <string>

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
void add_model_options(CLI::App& app, ModelOptions& options, bool weights_required);

// Builds options.model with options.kwargs (plus `defaults` for keys the user did not give) and, when weights
// are given, loads them (reporting what was mapped on stderr).
models::ModelPtr build_model(const ModelOptions& options, const std::map<std::string, std::string>& defaults = {});

// The same for a generative model (models/dit.h diffusion models, models/vae.h decoders): built from the
// generative registry, weights loaded and reported the same way (a diffusion training checkpoint gives its
// EMA weights unless it has none, as the official find_model), eval mode.
std::shared_ptr<models::Model> build_generative_model(const ModelOptions& options,
                                                      const std::map<std::string, std::string>& defaults = {});

std::string with_commas(int64_t n);

}  // namespace linvis::cli
