// Helpers shared by the CLI commands that build and load models.
#pragma once

#include <map>
#include <string>

#include "linvis/models/model.h"
#include "linvis/tools/args.h"

namespace linvis::cli {

// Declares --model, --model-kwargs, --weights, --ema and --non-strict.
void add_model_options(tools::ArgParser& args, bool weights_required);

// Builds the model named by --model with --model-kwargs (plus `defaults` for keys the user did
// not give) and, when --weights is set, loads them (reporting what was mapped on stderr).
models::ModelPtr build_model_from_args(const tools::ArgParser& args,
                                       const std::map<std::string, std::string>& defaults = {});

std::string with_commas(int64_t n);

}  // namespace linvis::cli
