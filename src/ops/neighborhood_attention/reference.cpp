// Reference 2-D neighborhood attention (NATTEN semantics): the window geometry, na2d_qk / na2d_av and
// their composition (see include/linvis/ops/neighborhood_attention.h and spec B4).
#include "linvis/ops/neighborhood_attention.h"

#include <algorithm>
#include <cmath>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/neighborhood_attention/reference.h"

namespace linvis::ops {
namespace {

void check_kernel(const char* op, int64_t kernel_size) {
    LINVIS_CHECK(kernel_size >= 1 && kernel_size % 2 == 1, op, ": kernel_size must be odd and >= 1, got ",
                 kernel_size);
}

void check_grid_tensor(const char* op, const char* name, const torch::Tensor& t) {
    LINVIS_CHECK(t.defined() && t.dim() == 5, op, ": ", name, ": expected (B, h, H, W, d), got ",
                 shape_or_undefined(t));
}

}  // namespace

int64_t natten_window_start(int64_t index, int64_t length, int64_t kernel_size, NatSmallGrid small_grid) {
    check_kernel("natten_window_start", kernel_size);
    LINVIS_CHECK(index >= 0 && index < length, "natten_window_start: index ", index, " outside [0, ", length, ")");
    if (kernel_size > length) return small_grid == NatSmallGrid::WholeAxis ? 0 : length - kernel_size;
    if (kernel_size == length) return 0;
    const int64_t half = kernel_size / 2;
    // NATTEN get_window_start, dilation 1.
    return std::max<int64_t>(index - half, 0) + (index + half >= length ? length - index - half - 1 : 0);
}

torch::Tensor neighborhood_indices(int64_t height, int64_t width, int64_t kernel_size, NatSmallGrid small_grid) {
    check_kernel("neighborhood_indices", kernel_size);
    LINVIS_CHECK(height >= 1 && width >= 1, "neighborhood_indices: grid must be non-empty, got ", height, "x", width);
    const bool whole = small_grid == NatSmallGrid::WholeAxis;
    const int64_t ky = whole ? std::min(kernel_size, height) : kernel_size;
    const int64_t kx = whole ? std::min(kernel_size, width) : kernel_size;
    const int64_t n = height * width;
    torch::Tensor table = torch::empty({n, ky * kx}, torch::kInt64);
    auto acc = table.accessor<int64_t, 2>();
    for (int64_t y = 0; y < height; ++y) {
        const int64_t sy = natten_window_start(y, height, kernel_size, small_grid);
        for (int64_t x = 0; x < width; ++x) {
            const int64_t sx = natten_window_start(x, width, kernel_size, small_grid);
            for (int64_t a = 0; a < ky; ++a)
                for (int64_t b = 0; b < kx; ++b) {
                    int64_t flat = (sy + a) * width + (sx + b);
                    // Only FlatWrap yields negative indices; they wrap as PyTorch indexing wraps them.
                    LINVIS_CHECK(flat >= -n, "neighborhood_indices: a ", height, "x", width, " grid is too small for ",
                                 kernel_size, "x", kernel_size, " flat-wrap windows (index ", flat, " < -", n, ")");
                    acc[y * width + x][a * kx + b] = flat < 0 ? flat + n : flat;
                }
        }
    }
    return table;
}

torch::Tensor neighborhood_mask(int64_t height, int64_t width, int64_t kernel_size) {
    torch::Tensor idx = neighborhood_indices(height, width, kernel_size);
    torch::Tensor mask = torch::zeros({height * width, height * width}, torch::kBool);
    mask.scatter_(1, idx, true);
    return mask;
}

torch::Tensor na2d_qk(const torch::Tensor& q, const torch::Tensor& k, int64_t kernel_size, NatSmallGrid small_grid) {
    check_grid_tensor("na2d_qk", "q", q);
    LINVIS_CHECK(k.sizes() == q.sizes(), "na2d_qk: k: expected shape ", shape_string(q.sizes()), ", got ",
                 shape_string(k.sizes()));
    const int64_t B = q.size(0), h = q.size(1), H = q.size(2), W = q.size(3), d = q.size(4), N = H * W;
    torch::Tensor idx = neighborhood_indices(H, W, kernel_size, small_grid).to(q.device());
    const int64_t kk = idx.size(1);
    torch::Tensor neighbours = k.reshape({B, h, N, d}).index_select(2, idx.reshape({-1})).view({B, h, N, kk, d});
    torch::Tensor logits = flops::matmul(q.reshape({B, h, N, 1, d}), neighbours.transpose(-2, -1));
    return logits.view({B, h, H, W, kk});
}

torch::Tensor na2d_av(const torch::Tensor& attn, const torch::Tensor& v, int64_t kernel_size,
                      NatSmallGrid small_grid) {
    check_grid_tensor("na2d_av", "v", v);
    const int64_t B = v.size(0), h = v.size(1), H = v.size(2), W = v.size(3), dv = v.size(4), N = H * W;
    torch::Tensor idx = neighborhood_indices(H, W, kernel_size, small_grid).to(v.device());
    const int64_t kk = idx.size(1);
    LINVIS_CHECK(attn.dim() == 5 && attn.size(0) == B && attn.size(1) == h && attn.size(2) == H && attn.size(3) == W &&
                     attn.size(4) == kk,
                 "na2d_av: attn: expected shape ", shape_string(std::vector<int64_t>{B, h, H, W, kk}), ", got ",
                 shape_string(attn.sizes()));
    torch::Tensor neighbours = v.reshape({B, h, N, dv}).index_select(2, idx.reshape({-1})).view({B, h, N, kk, dv});
    torch::Tensor out = flops::matmul(attn.reshape({B, h, N, 1, kk}), neighbours);
    return out.view({B, h, H, W, dv});
}

namespace reference {

torch::Tensor neighborhood_attention_2d(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        int64_t kernel_size, double scale, NatSmallGrid small_grid) {
    // DiT5 order: q * scale first, then the neighbourhood dot products.
    torch::Tensor attn = na2d_qk(q * scale, k, kernel_size, small_grid).softmax(-1);
    return na2d_av(attn, v, kernel_size, small_grid);
}

}  // namespace reference

}  // namespace linvis::ops
