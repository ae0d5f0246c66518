// linvis demo: builds a linear-time model and the DeiT baseline, runs both on a generated image
// at two resolutions, and shows how their cost grows with the number of pixels.
#include <chrono>
#include <cstdio>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/runtime.h"
#include "linvis/io/image.h"
#include "linvis/io/transforms.h"
#include "linvis/models/imagenet.h"
#include "linvis/models/registry.h"

namespace linvis::cli {
namespace {

struct Measurement {
    double gflops = 0.0;
    double milliseconds = 0.0;
};

Measurement measure(models::VisionModel& model, const torch::Tensor& image) {
    torch::NoGradGuard no_grad;
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
    std::vector<std::string> models = {"vittt_tiny", "vit3_tiny", "deit_tiny"};
    std::vector<int64_t> res = {224, 512};
    std::string save_image;
    int threads = 0;
};

int run_demo(int argc, const char* const* argv) {
    DemoOptions o;
    CommandApp app("demo", "Build a linear-time backbone and the DeiT baseline (untrained, seeded), run them on a "
                           "generated image at two resolutions and show how compute and time grow with the number of "
                           "pixels: linear for the TTT/mLSTM models, quadratic for softmax attention.");
    add_list(app, "--models", o.models, "models to compare");
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

    const torch::Tensor picture = io::demo_image(256, 320);
    if (!o.save_image.empty()) io::write_png(o.save_image, picture);
    std::printf("input: a generated %lldx%lld RGB image, evaluation transform (bicubic resize, centre crop, "
                "ImageNet normalisation)\n\n",
                static_cast<long long>(picture.size(1)), static_cast<long long>(picture.size(0)));

    std::printf("%-12s %11s | %8s %9s | %8s %9s | %-26s\n", "model", "params", "GFLOPs", "ms", "GFLOPs", "ms",
                "top-1 (untrained weights)");
    std::printf("%-12s %11s | %15lld px | %15lld px |\n", "", "", static_cast<long long>(resolutions[0]),
                static_cast<long long>(resolutions[1]));
    std::vector<std::pair<std::string, std::array<Measurement, 2>>> rows;
    for (const auto& name : o.models) {
        torch::manual_seed(0);
        std::array<Measurement, 2> m;
        std::string top1;
        for (size_t r = 0; r < 2; ++r) {
            io::EvalTransform transform;
            transform.crop_size = resolutions[r];
            torch::Tensor image = transform(picture).unsqueeze(0);
            models::ModelPtr model =
                models::create_model(name, models::ModelConfig().set("img_size", resolutions[r]));
            model->eval();
            m[r] = measure(*model, image);
            if (r == 0) {
                torch::NoGradGuard no_grad;
                torch::Tensor probs = torch::softmax(model->forward(image), -1)[0];
                const int64_t index = probs.argmax().item<int64_t>();
                char text[96];
                std::snprintf(text, sizeof(text), "%s (%lld, %.1f%%)", models::imagenet_class_name(index).c_str(),
                              static_cast<long long>(index), 100.0 * probs[index].item<float>());
                top1 = text;
                std::printf("%-12s %11s | %8.2f %9.1f |", name.c_str(),
                            with_commas(models::count_parameters(*model)).c_str(), m[0].gflops, m[0].milliseconds);
                std::fflush(stdout);
            }
        }
        std::printf(" %8.2f %9.1f | %s\n", m[1].gflops, m[1].milliseconds, top1.c_str());
        rows.push_back({name, m});
    }
    const double pixels = static_cast<double>(resolutions[1] * resolutions[1]) /
                          static_cast<double>(resolutions[0] * resolutions[0]);
    std::printf("\nFrom %lld to %lld px the image has %.1fx the pixels. Growth of each model's cost:\n",
                static_cast<long long>(resolutions[0]), static_cast<long long>(resolutions[1]), pixels);
    for (const auto& [name, m] : rows)
        std::printf("  %-12s compute %5.1fx   time %5.1fx\n", name.c_str(), m[1].gflops / m[0].gflops,
                    m[1].milliseconds / m[0].milliseconds);
    std::printf("\nThe weights are random, so the class names mean nothing: load trained weights with\n"
                "'linvis predict --model NAME --weights FILE IMAGE' (see docs/models.md), and compare\n"
                "speed and memory at higher resolutions with 'linvis bench'.\n");
    return 0;
}

CommandRegistrar registrar("demo", "compare a linear-time model with DeiT on a generated image", run_demo);

}  // namespace
}  // namespace linvis::cli
