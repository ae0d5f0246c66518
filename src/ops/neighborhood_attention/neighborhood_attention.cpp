// linvis::ops::neighborhood_attention_2d and dit5_mixed_attention: input checks, FLOP count and the choice
// between the reference and the fused CPU kernel (include/linvis/ops/neighborhood_attention.h).
#include "linvis/ops/neighborhood_attention.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/neighborhood_attention/cpu.h"
#include "ops/neighborhood_attention/reference.h"

namespace linvis::ops {

torch::Tensor neighborhood_attention_2d(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        int64_t kernel_size, double scale, NatSmallGrid small_grid, Impl impl) {
    const char* op = "neighborhood_attention_2d";
    LINVIS_CHECK(kernel_size >= 1 && kernel_size % 2 == 1, op, ": kernel_size must be odd and >= 1, got ", kernel_size);
    LINVIS_CHECK(q.defined() && q.dim() == 5, op, ": q: expected (B, h, H, W, d), got ",
                 shape_or_undefined(q));
    LINVIS_CHECK(k.defined() && k.sizes() == q.sizes(), op, ": k: expected shape ", shape_string(q.sizes()), ", got ",
                 shape_or_undefined(k));
    LINVIS_CHECK(v.defined() && v.dim() == 5 && v.sizes().slice(0, 4) == q.sizes().slice(0, 4), op,
                 ": v: expected (B, h, H, W, dv) matching q ", shape_string(q.sizes()), ", got ",
                 shape_or_undefined(v));
    const bool below_kernel = q.size(2) < kernel_size || q.size(3) < kernel_size;
    const std::string unsupported =
        !q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu() ? "CPU tensors only, got " + q.device().str()
        : !q.is_floating_point() ? std::string("floating-point tensors only")
        : small_grid == NatSmallGrid::FlatWrap && below_kernel
            ? "flat-wrap windows on a grid below the kernel (reference only), got " + std::to_string(q.size(2)) + "x" +
                  std::to_string(q.size(3))
            : std::string();
    // Auto on every target: the kernel never materialises the (N, K*K, d) neighbour tensors of the reference, and
    // it was the faster path in every DiT5 measurement of docs/generation.md.
    if (use_fused(impl, op, unsupported, /*fused_is_faster=*/true)) {
        const int64_t kk = std::min(kernel_size, q.size(2)) * std::min(kernel_size, q.size(3));
        flops::add(q.size(0) * q.size(1) * q.size(2) * q.size(3) * kk * (q.size(4) + v.size(4)));
        return cpu::neighborhood_attention_2d_fused(q, k, v, kernel_size, scale);
    }
    return reference::neighborhood_attention_2d(q, k, v, kernel_size, scale, small_grid);
}

torch::Tensor dit5_mixed_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const Dit5TttParams& params, int64_t num_heads, int64_t height, int64_t width,
                                   int64_t kernel_size, NatSmallGrid small_grid, Impl impl) {
    // Both branches follow `impl` (each has a reference and a fused CPU kernel).
    torch::Tensor x_ttt = dit5_ttt_attention(q, k, v, params, num_heads, height, width, impl);
    const int64_t B = q.size(0), C = q.size(2), d = C / num_heads;
    auto to_grid = [&](const torch::Tensor& t) {
        return t.reshape({B, height, width, num_heads, d}).permute({0, 3, 1, 2, 4});
    };
    const double scale = std::pow(static_cast<double>(d), -0.5);
    torch::Tensor x_na =
        neighborhood_attention_2d(to_grid(q), to_grid(k), to_grid(v), kernel_size, scale, small_grid, impl);
    x_na = x_na.permute({0, 2, 3, 1, 4}).reshape({B, height * width, C});
    // Outside a graph the mix is done in place over the TTT branch's fresh output, with no temporaries:
    // (a + b) * 0.5 rounds as 0.5 a + 0.5 b does (halving is exact), so the values are the same.
    if (!x_ttt.requires_grad() && !x_na.requires_grad() && x_ttt.sizes() == x_na.sizes())
        return x_ttt.add_(x_na).mul_(0.5);
    return 0.5 * x_na + 0.5 * x_ttt;
}

}  // namespace linvis::ops
