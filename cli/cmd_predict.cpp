// linvis predict: top-5 classes of images with their probabilities.
#include <cstdio>
#include <iostream>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/io/image.h"
#include "linvis/io/transforms.h"
#include "linvis/models/imagenet.h"
#include "segmentation.h"

namespace linvis::cli {
namespace {

struct PredictOptions {
    ModelOptions model;
    std::vector<std::string> images;
    int64_t img_size = 224;
    double crop_pct = 0.875;
    int64_t top = 5;
    int threads = 0;
};

int run_predict(int argc, const char* const* argv) {
    if (task_is(argc, argv, "segmentation")) return run_predict_segmentation(argc, argv);
    PredictOptions o;
    CommandApp app("predict", "Classify images: the top-5 classes with their probabilities, after the standard "
                              "evaluation transform (resize the shorter side with bicubic interpolation, centre crop, "
                              "normalise). Weights written by 'linvis train' describe themselves (model, options, "
                              "class names, resolution, normalisation), so --model can be left out; other weights "
                              "get ImageNet's names and normalisation.");
    add_model_options(app, o.model, true, /*model_required=*/false);
    app.add_option("IMAGE", o.images, "JPEG, PNG or BMP files")->required();
    add_number(app, "--img-size", o.img_size, "crop size (the model is built for it)", int64_t{1});
    add_number(app, "--crop-pct", o.crop_pct, "crop fraction: the shorter side is resized to img-size / crop-pct");
    add_number(app, "--top", o.top, "classes to show", int64_t{0});
    add_threads_option(app, o.threads);
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(o.threads);
    complete_model_options_from_weights(o.model);
    const WeightsDescription described = describe_weights(o.model.weights);
    const io::EvalTransform transform =
        input_transform(described, o.img_size, app.count("--img-size") > 0, o.crop_pct, app.count("--crop-pct") > 0);
    models::ModelPtr model = build_model(o.model, {{"img_size", std::to_string(transform.crop_size)}});
    const int64_t top = std::min<int64_t>(o.top, model->num_classes());
    LINVIS_CHECK(described.classes.empty() || int64_t(described.classes.size()) == model->num_classes(),
                 o.model.weights, ": metadata 'classes' names ", described.classes.size(), " classes, the model has ",
                 model->num_classes());
    const bool imagenet = described.classes.empty() && model->num_classes() == models::kImageNetClasses;
    auto class_name = [&](int64_t index) -> std::string {
        if (!described.classes.empty()) return described.classes[static_cast<size_t>(index)];
        return imagenet ? models::imagenet_lemmas(index) : "class " + std::to_string(index);
    };
    const c10::InferenceMode inference;
    for (const auto& path : o.images) {
        torch::Tensor batch = io::load_image_batch({path}, transform);
        torch::Tensor probs = torch::softmax(model->forward(batch).to(torch::kFloat32), -1)[0];
        auto [values, indices] = probs.topk(top);
        std::printf("%s\n", path.c_str());
        for (int64_t i = 0; i < top; ++i) {
            const int64_t index = indices[i].item<int64_t>();
            std::printf("  %6.2f%%  %4lld  %s\n", 100.0 * values[i].item<float>(), static_cast<long long>(index),
                        class_name(index).c_str());
        }
    }
    return 0;
}

CommandRegistrar registrar("predict", "top-5 classes of images (class names from the weights, or ImageNet's)",
                           run_predict);

}  // namespace
}  // namespace linvis::cli
