#include "ops/depthwise_conv/reference.h"

#include "linvis/core/flops.h"

namespace linvis::ops::reference {

torch::Tensor depthwise_conv2d_tokens(const torch::Tensor& x, int64_t height, int64_t width,
                                      const torch::Tensor& weight, const torch::Tensor& bias, DwEpilogue epilogue) {
    const int64_t B = x.size(0), C = x.size(2);
    torch::Tensor map = x.transpose(1, 2).reshape({B, C, height, width});
    torch::Tensor conv = flops::conv2d(map, weight, bias, {1, 1}, {1, 1}, {1, 1}, C).flatten(2).transpose(1, 2);
    switch (epilogue) {
        case DwEpilogue::Residual: return (x + conv).contiguous();
        case DwEpilogue::Silu: return torch::silu(conv).contiguous();
        case DwEpilogue::None: break;
    }
    return conv.contiguous();
}

torch::Tensor causal_depthwise_conv1d_tokens(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias) {
    const int64_t T = x.size(1), C = x.size(2), k = weight.size(2);
    torch::Tensor out = torch::conv1d(x.transpose(1, 2), weight, bias, 1, k - 1, 1, C);
    return out.narrow(2, 0, T).transpose(1, 2).contiguous();
}

}  // namespace linvis::ops::reference
