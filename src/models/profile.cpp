#include "linvis/models/profile.h"

#include "linvis/core/flops.h"
#include "linvis/models/registry.h"

namespace linvis::models {

double measure_gflops(VisionModel& model, int64_t img_size, int64_t in_chans) {
    torch::NoGradGuard no_grad;
    const bool was_training = model.is_training();
    model.eval();
    const auto param = model.parameters();
    const auto options = param.empty() ? torch::TensorOptions() : torch::TensorOptions().dtype(param[0].dtype());
    torch::Tensor image = torch::randn({1, in_chans, img_size, img_size}, options);
    flops::Counter counter;
    model.forward(image);
    model.train(was_training);
    return counter.gflops();
}

ModelSummary summarize_model(const std::string& name, bool with_flops, const std::vector<int64_t>& extra_resolutions) {
    ModelSummary summary;
    for (const auto& info : list_models()) {
        if (info.name != name) continue;
        summary.family = info.family;
        summary.description = info.description;
    }
    ModelPtr model = create_model(name);
    summary.name = name;
    summary.params = count_parameters(*model);
    summary.gflops_224 = with_flops ? measure_gflops(*model, 224) : -1.0;
    model.reset();
    for (const int64_t res : extra_resolutions) {
        if (res == 224 && with_flops) {
            summary.gflops_at[res] = summary.gflops_224;
            continue;
        }
        ModelPtr sized = create_model(name, ModelConfig().set("img_size", res));
        summary.gflops_at[res] = measure_gflops(*sized, res);
    }
    return summary;
}

}  // namespace linvis::models
