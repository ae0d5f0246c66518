// linvis run: logits (and features) of a model for an input tensor, file to file, so that
// linvis can be checked against any other implementation from the same weights.
#include <iostream>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/io/safetensors.h"
#include "linvis/ops/impl.h"

namespace linvis::cli {
namespace {

int run_run(int argc, const char* const* argv) {
    tools::ArgParser args("run", "Run a model on the tensor 'input' (B, C, H, W) of a safetensors file and write "
                                 "'logits' (B, classes) and, with --features, 'features' (the final normalised "
                                 "tokens before pooling, or the last feature map) to another safetensors file.");
    add_model_options(args, false);
    args.option("--input", "FILE", "safetensors file with a tensor named 'input'", "", true)
        .option("--output", "FILE", "safetensors file to write", "", true)
        .flag("--features", "also write 'features'")
        .option("--dtype", "f32|f64|bf16", "compute dtype", "f32")
        .option("--threads", "N", "threads (0: all cores)", "0")
        .flag("--random-weights", "run without --weights (seeded random initialisation; for testing)")
        .option("--seed", "N", "seed of the random initialisation", "0");
    if (!args.parse(argc, argv, 1)) return 0;
    runtime::configure_threads(static_cast<int>(args.get_int("--threads")));
    LINVIS_CHECK(args.has("--weights") || args.get_flag("--random-weights"),
                 "give --weights FILE (or --random-weights to run an untrained model)");
    const std::string dtype_name = args.get("--dtype");
    const torch::ScalarType dtype = dtype_name == "f32"    ? torch::kFloat32
                                    : dtype_name == "f64"  ? torch::kFloat64
                                    : dtype_name == "bf16" ? torch::kBFloat16
                                                           : (fail("--dtype: expected f32, f64 or bf16, got '",
                                                                   dtype_name, "'"), torch::kFloat32);
    const std::string input_path = args.get("--input");
    io::SafetensorsFile input_file = io::SafetensorsFile::open(input_path);
    LINVIS_CHECK(input_file.contains("input"), input_path, ": no tensor named 'input' (has: ",
                 [&] {
                     std::string names;
                     for (const auto& n : input_file.names()) names += (names.empty() ? "" : ", ") + n;
                     return names;
                 }(),
                 ")");
    torch::Tensor input = input_file.tensor("input");
    LINVIS_CHECK(input.dim() == 4, input_path, ": tensor 'input': expected shape (B, C, H, W), got ",
                 shape_string(input.sizes()));
    std::map<std::string, std::string> defaults;
    if (input.size(2) == input.size(3)) defaults["img_size"] = std::to_string(input.size(2));
    defaults["in_chans"] = std::to_string(input.size(1));
    torch::manual_seed(static_cast<uint64_t>(args.get_int("--seed")));
    models::ModelPtr model = build_model_from_args(args, defaults);
    model->to(dtype);
    torch::NoGradGuard no_grad;
    torch::Tensor features = model->forward_features(input.to(dtype));
    torch::Tensor logits = model->forward_head(features, false);
    std::map<std::string, torch::Tensor> out = {{"logits", logits.contiguous()}};
    if (args.get_flag("--features")) out["features"] = features.contiguous();
    io::save_safetensors(args.get("--output"), out,
                         {{"model", args.get("--model")}, {"input", input_path}, {"dtype", dtype_name}});
    std::cout << "wrote " << args.get("--output") << ": logits " << shape_string(logits.sizes());
    if (args.get_flag("--features")) std::cout << ", features " << shape_string(features.sizes());
    std::cout << "\n";
    return 0;
}

CommandRegistrar registrar("run", "run a model on a tensor file and write logits (and features)", run_run);

}  // namespace
}  // namespace linvis::cli
