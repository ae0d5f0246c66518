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

namespace linvis::cli {
namespace {

int run_predict(int argc, const char* const* argv) {
    tools::ArgParser args("predict", "Classify images: the top-5 classes (ImageNet names built in) with their "
                                     "probabilities, after the standard evaluation transform (resize the shorter "
                                     "side with bicubic interpolation, centre crop, normalise).");
    add_model_options(args, true);
    args.positional("IMAGE", "JPEG, PNG or BMP files", true, true)
        .option("--img-size", "N", "crop size (the model is built for it)", "224")
        .option("--crop-pct", "F", "crop fraction: the shorter side is resized to img-size / crop-pct", "0.875")
        .option("--top", "K", "classes to show", "5")
        .option("--threads", "N", "threads (0: all cores)", "0");
    if (!args.parse(argc, argv, 1)) return 0;
    runtime::configure_threads(static_cast<int>(args.get_int("--threads")));
    io::EvalTransform transform;
    transform.crop_size = args.get_int("--img-size");
    transform.crop_pct = args.get_double("--crop-pct");
    transform.validate();
    models::ModelPtr model = build_model_from_args(args, {{"img_size", std::to_string(transform.crop_size)}});
    const int64_t top = std::min<int64_t>(args.get_int("--top"), model->num_classes());
    const bool imagenet = model->num_classes() == models::kImageNetClasses;
    torch::NoGradGuard no_grad;
    for (const auto& path : args.positionals()) {
        torch::Tensor batch = io::load_image_batch({path}, transform);
        torch::Tensor probs = torch::softmax(model->forward(batch).to(torch::kFloat32), -1)[0];
        auto [values, indices] = probs.topk(top);
        std::printf("%s\n", path.c_str());
        for (int64_t i = 0; i < top; ++i) {
            const int64_t index = indices[i].item<int64_t>();
            std::printf("  %6.2f%%  %4lld  %s\n", 100.0 * values[i].item<float>(), static_cast<long long>(index),
                        imagenet ? models::imagenet_lemmas(index) : ("class " + std::to_string(index)).c_str());
        }
    }
    return 0;
}

CommandRegistrar registrar("predict", "top-5 classes of images (ImageNet names built in)", run_predict);

}  // namespace
}  // namespace linvis::cli
