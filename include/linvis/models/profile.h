// Static facts about a model: parameter count and FLOPs at a resolution.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "linvis/models/model.h"

namespace linvis::models {

// Multiply-adds of one forward pass of one image of size img_size x img_size, counted
// by the instrumented primitives in linvis/core/flops.h (the fvcore convention), in GFLOPs.
double measure_gflops(VisionModel& model, int64_t img_size, int64_t in_chans = 3);

struct ModelSummary {
    std::string name;
    std::string family;
    std::string description;
    int64_t params = 0;
    double gflops_224 = 0.0;  // < 0 when not measured
    std::map<int64_t, double> gflops_at;  // extra resolutions asked for (model built at that size)
};

// Builds `name` with default options and measures it (FLOPs skipped when with_flops is false).
// Also measures GFLOPs at each resolution in `extra_resolutions` (a model built with img_size = r).
ModelSummary summarize_model(const std::string& name, bool with_flops = true,
                             const std::vector<int64_t>& extra_resolutions = {});

}  // namespace linvis::models
