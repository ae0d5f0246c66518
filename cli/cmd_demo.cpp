// linvis demo: (1) a model trained by linvis on Fashion-MNIST (shipped in assets/) on the real test
// set: accuracy, predictions for sample images a person can check, and an explanation picture; (2) a
// linear-time model against the DeiT baseline at two resolutions: how compute and time grow with the
// number of pixels.
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <cctype>
#include <filesystem>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/runtime.h"
#include "linvis/io/image.h"
#include "linvis/io/transforms.h"
#include "linvis/models/registry.h"
#include "linvis/ops/impl.h"
#include "linvis/train/data_sources.h"
#include "linvis/train/trainer.h"

namespace linvis::cli {
namespace {

namespace fs = std::filesystem;

struct Measurement {
    double gflops = 0.0;
    double milliseconds = 0.0;
};

Measurement measure(models::VisionModel& model, const torch::Tensor& image) {
    const c10::InferenceMode inference;
    Measurement m;
    {
        flops::Counter counter;
        model.forward(image);  // also the warm-up
        m.gflops = counter.gflops();
    }
    const auto start = std::chrono::steady_clock::now();
    model.forward(image);
    m.milliseconds = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return m;
}

struct DemoOptions {
    std::string weights = std::string(LINVIS_ASSETS_DIR) + "/fmnist_vittt_tiny.safetensors";
    std::string samples = std::string(LINVIS_ASSETS_DIR) + "/fmnist";
    std::string data_dir;
    std::string output_dir = "demo";
    std::vector<std::string> models = {"vittt_tiny", "vit3_tiny", "deit_tiny"};
    std::vector<int64_t> res = {224, 512};
    std::string save_image;
    int threads = 0;
};

// Part 1: the shipped trained model on Fashion-MNIST.
void trained_model_part(const DemoOptions& o) {
    ModelOptions model_options;
    model_options.weights = o.weights;
    complete_model_options_from_weights(model_options);
    const WeightsDescription described = describe_weights(o.weights);
    LINVIS_CHECK(!described.classes.empty() && !described.mean.empty(), o.weights,
                 ": not a model trained by 'linvis train' (no 'classes' / 'mean' metadata)");
    std::printf("1. A model trained by linvis: %s (%s), %s\n", model_options.model.c_str(), o.weights.c_str(),
                "trained on Fashion-MNIST with the command in assets/README.md");
    models::ModelPtr model = build_model(model_options);

    // Accuracy on the whole test set, through the data pipeline training used.
    train::DataConfig data;
    data.dataset = "fashion-mnist";
    data.data_dir = o.data_dir;
    data.augment = train::DataConfig::Augment::None;
    const train::DataSources sources = train::make_data_sources(data, /*with_train=*/false);
    const train::EvalResult result = train::evaluate(*model, *sources.eval);
    std::printf("   test set: %lld images, top-1 %.2f %%, top-5 %.2f %%\n\n",
                static_cast<long long>(sources.eval->num_examples()), result.top1, result.top5);

    // Sample PNGs (test images, one per class, named after their true class): what 'linvis predict' does.
    std::vector<std::string> images;
    if (fs::is_directory(o.samples))
        for (const auto& entry : fs::directory_iterator(o.samples))
            if (entry.path().extension() == ".png") images.push_back(entry.path().string());
    std::sort(images.begin(), images.end());
    LINVIS_CHECK(!images.empty(), o.samples, ": no sample PNG images");
    const io::EvalTransform transform = input_transform(described, 0, false, 1.0, false);
    const c10::InferenceMode inference;
    const torch::Tensor probs = torch::softmax(model->forward(io::load_image_batch(images, transform)), -1);
    std::printf("   %-34s %-26s %s\n", "sample image", "predicted (probability)", "");
    int correct = 0;
    for (size_t i = 0; i < images.size(); ++i) {
        const int64_t k = probs[static_cast<int64_t>(i)].argmax().item<int64_t>();
        const std::string predicted = described.classes[static_cast<size_t>(k)];
        const std::string file = fs::path(images[i]).filename().string();
        // File names carry the true class after the test-set index: 0013_dress.png.
        std::string truth = fs::path(images[i]).stem().string();
        truth = truth.substr(truth.find('_') + 1);
        std::string predicted_key;
        for (char c : predicted) predicted_key += std::isalnum(static_cast<unsigned char>(c)) ? std::tolower(c) : '_';
        const bool ok = predicted_key == truth;
        correct += ok;
        char cell[64];
        std::snprintf(cell, sizeof(cell), "%s (%.1f %%)", predicted.c_str(),
                      100.0 * probs[static_cast<int64_t>(i)][k].item<float>());
        std::printf("   %-34s %-26s %s\n", file.c_str(), cell, ok ? "correct" : "WRONG");
    }
    std::printf("   %d of %zu samples right; try one yourself: linvis predict --weights %s %s\n\n", correct,
                images.size(), o.weights.c_str(), images.front().c_str());

    // What the model looks at: the Gradient Magnitude Map of its last block on the first sample (the
    // same picture 'linvis explain' draws).
    fs::create_directories(o.output_dir);
    const std::string picture = (fs::path(o.output_dir) / "explain_gradmap.png").string();
    std::vector<std::string> args = {"explain", "--weights", o.weights, "--what", "gradmap", "--output", picture,
                                     "--panel-size", "300,320", images.front()};
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    for (const auto& command : commands())
        if (command.name == "explain") command.run(static_cast<int>(argv.size()), argv.data());
    std::printf("   explanation: %s (Gradient Magnitude Map of the last block, Vision-TTT Eq. 6)\n\n", picture.c_str());
}

int run_demo(int argc, const char* const* argv) {
    DemoOptions o;
    CommandApp app("demo", "Two parts. (1) A model trained by linvis on Fashion-MNIST (shipped in assets/): its accuracy "
                           "on the test set, its predictions for sample images, and an explanation picture. (2) A "
                           "linear-time backbone against the DeiT baseline on a generated image at two resolutions: "
                           "how compute and time grow with the number of pixels (linear for the TTT/mLSTM models, "
                           "quadratic for softmax attention), with the fastest kernels for this CPU.");
    app.add_option("--weights", o.weights, "the trained model of part 1")->type_name("FILE");
    app.add_option("--samples", o.samples, "folder of sample PNG images for part 1 (INDEX_class.png)")->type_name("DIR");
    app.add_option("--data-dir", o.data_dir, "Fashion-MNIST if not Debian's dataset-fashion-mnist")->type_name("DIR");
    app.add_option("--output-dir", o.output_dir, "where the pictures go")->type_name("DIR");
    add_list(app, "--models", o.models, "models to compare in part 2");
    add_list(app, "--res", o.res, "two square resolutions");
    app.add_option("--save-image", o.save_image, "also write the generated input image as PNG")->type_name("FILE");
    add_threads_option(app, o.threads);
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(o.threads);
    const auto& resolutions = o.res;
    LINVIS_CHECK(resolutions.size() == 2, "--res: expected two resolutions, got ", resolutions.size());
    const runtime::Info info = runtime::query();
    std::printf("linvis %s on LibTorch %s, %d threads, %s, BLAS: %s\n\n", info.linvis_version.c_str(),
                info.torch_version.c_str(), info.torch_threads, runtime::simd_name(info.simd),
                info.blas_is_optimized ? "optimised" : "REFERENCE (slow)");

    trained_model_part(o);

    std::printf("2. Cost against resolution (untrained models: speed only); kernels: fused ops run their %s code, "
                "impl auto\n",
                ops::fused_kernel_target());
    const torch::Tensor picture = io::demo_image(256, 320);
    if (!o.save_image.empty()) io::write_png(o.save_image, picture);
    std::printf("input: a generated %lldx%lld RGB image, evaluation transform (bicubic resize, centre crop, "
                "ImageNet normalisation)\n\n",
                static_cast<long long>(picture.size(1)), static_cast<long long>(picture.size(0)));

    std::printf("%-12s %11s | %8s %9s | %8s %9s\n", "model", "params", "GFLOPs", "ms", "GFLOPs", "ms");
    std::printf("%-12s %11s | %15lld px | %15lld px |\n", "", "", static_cast<long long>(resolutions[0]),
                static_cast<long long>(resolutions[1]));
    std::vector<std::pair<std::string, std::array<Measurement, 2>>> rows;
    for (const auto& name : o.models) {
        torch::manual_seed(0);
        std::array<Measurement, 2> m;
        for (size_t r = 0; r < 2; ++r) {
            io::EvalTransform transform;
            transform.crop_size = resolutions[r];
            torch::Tensor image = transform(picture).unsqueeze(0);
            models::ModelPtr model =
                models::create_model(name, models::ModelConfig().set("img_size", resolutions[r]));
            model->eval();
            m[r] = measure(*model, image);
            if (r == 0) {
                std::printf("%-12s %11s | %8.2f %9.1f |", name.c_str(),
                            with_commas(models::count_parameters(*model)).c_str(), m[0].gflops, m[0].milliseconds);
                std::fflush(stdout);
            }
        }
        std::printf(" %8.2f %9.1f\n", m[1].gflops, m[1].milliseconds);
        rows.push_back({name, m});
    }
    const double pixels = static_cast<double>(resolutions[1] * resolutions[1]) /
                          static_cast<double>(resolutions[0] * resolutions[0]);
    std::printf("\nFrom %lld to %lld px the image has %.1fx the pixels. Growth of each model's cost:\n",
                static_cast<long long>(resolutions[0]), static_cast<long long>(resolutions[1]), pixels);
    for (const auto& [name, m] : rows)
        std::printf("  %-12s compute %5.1fx   time %5.1fx\n", name.c_str(), m[1].gflops / m[0].gflops,
                    m[1].milliseconds / m[0].milliseconds);
    std::printf("\nSpeed and memory at higher resolutions, against timm: 'linvis bench' (docs/performance.md).\n");
    return 0;
}

CommandRegistrar registrar("demo", "a trained model on Fashion-MNIST, then a linear-time model against DeiT as images grow",
                           run_demo);

}  // namespace
}  // namespace linvis::cli
