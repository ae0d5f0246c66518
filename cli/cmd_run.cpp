// linvis run: logits (and features) of a model for an input tensor, file to file, so that
// linvis can be checked against any other implementation from the same weights.
#include <iostream>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/io/safetensors.h"
#include "linvis/models/dit.h"
#include "linvis/models/registry.h"
#include "linvis/models/vae.h"
#include "linvis/ops/impl.h"

namespace linvis::cli {
namespace {

struct RunOptions {
    ModelOptions model;
    std::string input, output;
    bool features = false;
    std::string dtype = "f32";
    int threads = 0;
    bool random_weights = false;
    int64_t seed = 0;
    double cfg_scale = 1.0;
};

std::string tensor_names(const io::SafetensorsFile& file) {
    std::string names;
    for (const auto& n : file.names()) names += (names.empty() ? "" : ", ") + n;
    return names;
}

torch::Tensor require_tensor(const io::SafetensorsFile& file, const std::string& path, const std::string& name) {
    LINVIS_CHECK(file.contains(name), path, ": no tensor named '", name, "' (has: ", tensor_names(file), ")");
    return file.tensor(name);
}

// A generative model: a diffusion network (x, t, y -> out, or forward_with_cfg with --cfg-scale), the VAE
// decoder (latent -> image = decode(latent / 0.18215)) or the VAE encoder (image -> mean, logvar and
// latent = mean * 0.18215).
int run_generative(const RunOptions& o, bool cfg_given, torch::ScalarType dtype) {
    io::SafetensorsFile input_file = io::SafetensorsFile::open(o.input);
    const std::string kind = models::generative_model_kind(o.model.model);
    std::map<std::string, torch::Tensor> out;
    torch::manual_seed(static_cast<uint64_t>(o.seed));
    if (kind == "vae") {
        LINVIS_CHECK(!cfg_given, "--cfg-scale applies to diffusion models, not to the VAE ", o.model.model);
        std::shared_ptr<models::Model> vae = build_generative_model(o.model);
        vae->to(dtype);
        const c10::InferenceMode inference;
        if (auto decoder = std::dynamic_pointer_cast<models::VaeDecoder>(vae)) {
            torch::Tensor latent = require_tensor(input_file, o.input, "latent");
            LINVIS_CHECK(latent.dim() == 4, o.input, ": tensor 'latent': expected (B, C, h, w), got ",
                         shape_string(latent.sizes()));
            out["image"] = decoder->decode(latent.to(dtype) / models::kSdVaeScale).contiguous();
        } else {
            auto encoder = std::dynamic_pointer_cast<models::VaeEncoder>(vae);
            LINVIS_CHECK(encoder != nullptr, o.model.model, " is neither a VAE encoder nor a VAE decoder");
            torch::Tensor image = require_tensor(input_file, o.input, "image");
            LINVIS_CHECK(image.dim() == 4, o.input, ": tensor 'image': expected (B, C, H, W), got ",
                         shape_string(image.sizes()));
            const models::LatentDistribution dist = encoder->encode(image.to(dtype));
            out["mean"] = dist.mean.contiguous();
            out["logvar"] = dist.logvar.contiguous();
            out["latent"] = (dist.mean * models::kSdVaeScale).contiguous();
        }
    } else {
        torch::Tensor x = require_tensor(input_file, o.input, "x");
        torch::Tensor t = require_tensor(input_file, o.input, "t");
        torch::Tensor y = require_tensor(input_file, o.input, "y");
        LINVIS_CHECK(x.dim() == 4, o.input, ": tensor 'x': expected (B, C, H, W), got ", shape_string(x.sizes()));
        std::map<std::string, std::string> defaults = {{"in_channels", std::to_string(x.size(1))}};
        if (x.size(2) == x.size(3)) defaults["input_size"] = std::to_string(x.size(2));
        auto model = std::dynamic_pointer_cast<models::DiffusionModel>(build_generative_model(o.model, defaults));
        model->to(dtype);
        const c10::InferenceMode inference;
        const torch::Tensor xx = x.to(dtype);
        out["out"] = (cfg_given ? model->forward_with_cfg(xx, t, y, o.cfg_scale) : model->forward(xx, t, y)).contiguous();
    }
    io::save_safetensors(o.output, out, {{"model", o.model.model}, {"input", o.input}});
    for (const auto& [name, tensor] : out) std::cout << "wrote " << o.output << ": " << name << " " << shape_string(tensor.sizes()) << "\n";
    return 0;
}

int run_run(int argc, const char* const* argv) {
    RunOptions o;
    CommandApp app("run", "Run a model on the tensor 'input' (B, C, H, W) of a safetensors file and write 'logits' "
                          "(B, classes) and, with --features, 'features' (the final normalised tokens before "
                          "pooling, or the last feature map) to another safetensors file. A model built with "
                          "--model-kwargs features_only=true [out_indices=i,j,...] writes its feature maps "
                          "'features.0', 'features.1', ... (NCHW) instead, for an input of any size. A diffusion "
                          "model reads 'x' (B, C, H, W), 't' (B,) and 'y' (B,) and writes 'out'; the VAE decoder "
                          "reads 'latent' and writes 'image' = decode(latent / 0.18215); the VAE encoder reads "
                          "'image' in [-1, 1] and writes 'mean', 'logvar' and 'latent' = mean * 0.18215.");
    add_model_options(app, o.model, false);
    app.add_option("--input", o.input, "safetensors file with a tensor named 'input' (diffusion: x, t, y; VAE decoder: latent; VAE encoder: image)")->type_name("FILE")->required();
    app.add_option("--output", o.output, "safetensors file to write")->type_name("FILE")->required();
    app.add_flag("--features", o.features, "also write 'features'");
    add_dtype_option(app, o.dtype, {"f32", "f64", "bf16"});
    add_threads_option(app, o.threads);
    app.add_flag("--random-weights", o.random_weights, "run without --weights (seeded random initialisation; for "
                                                       "testing)");
    add_seed_option(app, o.seed);
    app.add_option("--cfg-scale", o.cfg_scale, "diffusion models: run the official forward_with_cfg with this guidance "
                                               "scale (the batch: conditional half, then the null-label half)")
        ->type_name("S");
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(o.threads);
    LINVIS_CHECK(app.count("--weights") > 0 || o.random_weights,
                 "give --weights FILE (or --random-weights to run an untrained model)");
    const std::string& dtype_name = o.dtype;
    const torch::ScalarType dtype = dtype_name == "f32"   ? torch::kFloat32
                                    : dtype_name == "f64" ? torch::kFloat64
                                                          : torch::kBFloat16;
    if (models::has_generative_model(o.model.model)) {
        LINVIS_CHECK(!o.features, "--features applies to classifiers, not to the generative model ", o.model.model);
        return run_generative(o, app.count("--cfg-scale") > 0, dtype);
    }
    LINVIS_CHECK(app.count("--cfg-scale") == 0, "--cfg-scale applies to diffusion models, not to ", o.model.model);
    const std::string& input_path = o.input;
    io::SafetensorsFile input_file = io::SafetensorsFile::open(input_path);
    torch::Tensor input = require_tensor(input_file, input_path, "input");
    LINVIS_CHECK(input.dim() == 4, input_path, ": tensor 'input': expected shape (B, C, H, W), got ",
                 shape_string(input.sizes()));
    std::map<std::string, std::string> defaults;
    // A classifier is built for the input's size; a backbone keeps its native grid (position embeddings
    // are resampled to the input's grid, which need not be square or a multiple of the patch).
    const bool backbone = models::ModelConfig(o.model.kwargs).get_bool("features_only", false);
    if (input.size(2) == input.size(3) && !backbone) defaults["img_size"] = std::to_string(input.size(2));
    defaults["in_chans"] = std::to_string(input.size(1));
    torch::manual_seed(static_cast<uint64_t>(o.seed));
    models::ModelPtr model = build_model(o.model, defaults);
    model->to(dtype);
    const c10::InferenceMode inference;
    if (const std::vector<int64_t> stages = model->feature_indices(); !stages.empty()) {
        // A features_only backbone: its maps, features.0 ... (NCHW), in out_indices order.
        std::vector<torch::Tensor> maps = model->forward_feature_maps(input.to(dtype), stages);
        std::map<std::string, torch::Tensor> out;
        std::cout << "wrote " << o.output << ":";
        for (size_t k = 0; k < maps.size(); ++k) {
            out["features." + std::to_string(k)] = maps[k].contiguous();
            std::cout << (k ? ", " : " ") << "features." << k << " " << shape_string(maps[k].sizes());
        }
        io::save_safetensors(o.output, out, {{"model", o.model.model}, {"input", input_path}, {"dtype", dtype_name}});
        std::cout << "\n";
        return 0;
    }
    torch::Tensor features = model->forward_features(input.to(dtype));
    torch::Tensor logits = model->forward_head(features, false);
    std::map<std::string, torch::Tensor> out = {{"logits", logits.contiguous()}};
    if (o.features) out["features"] = features.contiguous();
    io::save_safetensors(o.output, out, {{"model", o.model.model}, {"input", input_path}, {"dtype", dtype_name}});
    std::cout << "wrote " << o.output << ": logits " << shape_string(logits.sizes());
    if (o.features) std::cout << ", features " << shape_string(features.sizes());
    std::cout << "\n";
    return 0;
}

CommandRegistrar registrar("run", "run a model on a tensor file and write logits (and features)", run_run);

}  // namespace
}  // namespace linvis::cli
