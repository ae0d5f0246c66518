// Tensor entry points of the plotting library: LibTorch images and maps to canvases.
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/plot/plot.h"

namespace linvis::plot {

namespace {

at::Tensor checked_image(const at::Tensor& image) {
    LINVIS_CHECK(image.defined(), "plot: image tensor is undefined");
    LINVIS_CHECK(image.dim() == 3 && image.size(2) == 3 && image.size(0) >= 1 && image.size(1) >= 1,
                 "plot: image tensor: expected shape (H, W, 3), got ", shape_string(image.sizes()));
    LINVIS_CHECK(image.scalar_type() == at::kByte, "plot: image tensor: expected dtype uint8, got ",
                 c10::toString(image.scalar_type()));
    return image.to(at::kCPU).contiguous();
}

}  // namespace

Canvas canvas_from_tensor(const at::Tensor& image_hwc_uint8) {
    at::Tensor img = checked_image(image_hwc_uint8);
    return Canvas::from_rgb(img.data_ptr<uint8_t>(), static_cast<int>(img.size(1)), static_cast<int>(img.size(0)));
}

Canvas heatmap_overlay(const at::Tensor& image_hwc_uint8, const at::Tensor& map_hw, double alpha, Colormap cm,
                       const ValueRange& range) {
    at::Tensor img = checked_image(image_hwc_uint8);
    LINVIS_CHECK(map_hw.defined(), "plot: heat-map tensor is undefined");
    LINVIS_CHECK(map_hw.dim() == 2 && map_hw.size(0) >= 1 && map_hw.size(1) >= 1,
                 "plot: heat-map tensor: expected shape (h, w), got ", shape_string(map_hw.sizes()));
    LINVIS_CHECK(at::isFloatingType(map_hw.scalar_type()), "plot: heat-map tensor: expected a floating dtype, got ",
                 c10::toString(map_hw.scalar_type()));
    at::Tensor map = map_hw.detach().to(at::kCPU, at::kFloat).contiguous();
    return heatmap_overlay(img.data_ptr<uint8_t>(), static_cast<int>(img.size(0)), static_cast<int>(img.size(1)),
                           map.data_ptr<float>(), static_cast<int>(map.size(0)), static_cast<int>(map.size(1)), alpha,
                           cm, range);
}

}  // namespace linvis::plot
