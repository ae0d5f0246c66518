// linvis::ops::vit3_ttt_* (official op): input checks and the choice between the reference and the
// fused CPU kernels (include/linvis/ops/vit3_ttt.h). The whole-mix kernel has no RoPE, so a mix given a RoPE table
// runs the two branches separately, each of which may still be fused; H-ViT³'s layer rotates q1 and k1 in place
// first in inference (apply_rope_2d_) and passes no table.
#include "linvis/ops/vit3_ttt.h"

#include <string>

#include "linvis/core/error.h"
#include "linvis/core/precision.h"
#include "ops/simd/simd.h"
#include "ops/ttt_swiglu_cpu/entry_points.h"
#include "ops/vit3_ttt/reference.h"

namespace linvis::ops {

using torch::Tensor;

torch::Tensor vit3_ttt_swiglu_branch(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1,
                                     const Tensor& w2, double scale, Impl impl) {
    LINVIS_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
                 "vit3_ttt_swiglu_branch: q, k, v must share shape (B, h, N, d), got ", shape_string(q.sizes()),
                 ", ", shape_string(k.sizes()), ", ", shape_string(v.sizes()));
    const int64_t h = q.size(1), d = q.size(3);
    for (const Tensor* w : {&w1, &w2})
        LINVIS_CHECK(w->dim() == 4 && (w->size(0) == 1 || w->size(0) == q.size(0)) && w->size(1) == h &&
                         w->size(2) == d && w->size(3) == d,
                     "vit3_ttt_swiglu_branch: w1/w2: expected shape [1, ", h, ", ", d, ", ", d, "], got ",
                     shape_string(w->sizes()));
    if (use_fused(impl, "vit3_ttt_swiglu_branch", fused_detail::fused_unsupported(q), simd::vectorised()))
        return fused_detail::vit3_swiglu_branch_fused(q, k, v, w1, w2, scale);
    return reference::vit3_ttt_swiglu_branch(q, k, v, w1, w2, scale);
}

torch::Tensor vit3_ttt_dwconv_branch(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w3,
                                     double scale, Impl impl) {
    LINVIS_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
                 "vit3_ttt_dwconv_branch: q, k, v must share shape (B, d, H, W), got ", shape_string(q.sizes()),
                 ", ", shape_string(k.sizes()), ", ", shape_string(v.sizes()));
    const int64_t d = q.size(1);
    LINVIS_CHECK(w3.dim() == 4 && w3.size(0) == d && w3.size(1) == 1 && w3.size(2) == 3 && w3.size(3) == 3,
                 "vit3_ttt_dwconv_branch: w3: expected shape [", d, ", 1, 3, 3], got ", shape_string(w3.sizes()));
    if (use_fused(impl, "vit3_ttt_dwconv_branch", fused_detail::fused_unsupported(q), simd::vectorised()))
        return fused_detail::vit3_dwconv_branch_fused(q, k, v, w3, scale);
    return reference::vit3_ttt_dwconv_branch(q, k, v, w3, scale);
}

void apply_rope_2d_(const Tensor& x, const Tensor& rotations) {
    check_rope_shapes(x, rotations, "apply_rope_2d_");
    LINVIS_CHECK(!(torch::GradMode::is_enabled() && (x.requires_grad() || rotations.requires_grad())),
                 "apply_rope_2d_: x or rotations requires grad; use apply_rope_2d in a graph");
    if (x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && rotations.scalar_type() == torch::kFloat32 &&
        rotations.device().is_cpu() && x.stride(3) == 1) {
        fused_detail::rope_2d_in_place(x, rotations.contiguous());
        return;
    }
    x.copy_(apply_rope_2d(x, rotations));
}

torch::Tensor vit3_ttt_mix(const Tensor& qkv, const Tensor& w1, const Tensor& w2, const Tensor& w3,
                           int64_t num_heads, int64_t height, int64_t width, const Tensor& rope_rotations,
                           Impl impl) {
    LINVIS_CHECK(qkv.dim() == 3, "vit3_ttt_mix: qkv must be (B, N, 3C+3d), got ", shape_string(qkv.sizes()));
    const int64_t B = qkv.size(0), N = qkv.size(1), h = num_heads;
    LINVIS_CHECK(N == height * width, "vit3_ttt_mix: N = ", N, " but height*width = ", height * width);
    LINVIS_CHECK(qkv.size(2) % (3 * (h + 1)) == 0, "vit3_ttt_mix: qkv width ", qkv.size(2),
                 " is not 3C+3d for ", h, " heads");
    const int64_t d = qkv.size(2) / (3 * (h + 1)), C = d * h;
    // The whole-mix kernel has no RoPE; with RoPE the mix is composed here and each branch applies
    // `impl` itself (Fused then runs both branch kernels, or fails there for an unsupported dtype).
    if (!rope_rotations.defined() &&
        use_fused(impl, "vit3_ttt_mix", fused_detail::fused_unsupported(qkv), simd::vectorised())) {
        LINVIS_CHECK(w1.dim() == 4 && w1.size(1) == h && w1.size(2) == d && w1.size(3) == d &&
                         w2.sizes() == w1.sizes() && (w1.size(0) == 1 || w1.size(0) == B),
                     "vit3_ttt_mix: w1/w2: expected shape [1, ", h, ", ", d, ", ", d, "], got ",
                     shape_string(w1.sizes()), " and ", shape_string(w2.sizes()));
        LINVIS_CHECK(w3.dim() == 4 && w3.size(0) == d && w3.size(1) == 1 && w3.size(2) == 3 && w3.size(3) == 3,
                     "vit3_ttt_mix: w3: expected shape [", d, ", 1, 3, 3], got ", shape_string(w3.sizes()));
        return fused_detail::vit3_ttt_mix_fused(qkv, w1, w2, w3, h, height, width);
    }
    auto parts = torch::split_with_sizes(qkv, {C, C, C, d, d, d}, -1);
    Tensor q1 = parts[0], k1 = parts[1], v1 = parts[2];
    if (rope_rotations.defined()) {
        q1 = apply_rope_2d(q1.reshape({B, height, width, C}), rope_rotations).reshape({B, N, C});
        k1 = apply_rope_2d(k1.reshape({B, height, width, C}), rope_rotations).reshape({B, N, C});
    }
    auto heads = [&](const Tensor& t) { return t.reshape({B, N, h, d}).transpose(1, 2); };
    auto image = [&](const Tensor& t) { return t.reshape({B, height, width, d}).permute({0, 3, 1, 2}); };
    Tensor x1 = vit3_ttt_swiglu_branch(heads(q1), heads(k1), heads(v1), w1, w2, kVit3InnerScale, impl);
    Tensor x2 = vit3_ttt_dwconv_branch(image(parts[3]), image(parts[4]), image(parts[5]), w3, kVit3InnerScale, impl);
    x1 = x1.transpose(1, 2).reshape({B, N, C});
    x2 = x2.reshape({B, d, N}).transpose(1, 2);
    return torch::cat({x1, x2}, -1);
}

Vit3TttInBands::Vit3TttInBands(Tensor w1, Tensor w2, Tensor w3, int64_t num_heads, int64_t batch, int64_t height,
                               int64_t width, Impl impl)
    : w1_(std::move(w1)), w2_(std::move(w2)), w3_(std::move(w3)), num_heads_(num_heads), head_dim_(w3_.size(0)),
      batch_(batch), height_(height), width_(width), impl_(impl) {
    const int64_t h = num_heads, d = head_dim_;
    LINVIS_CHECK(w1_.dim() == 4 && w1_.size(0) == 1 && w1_.size(1) == h && w1_.size(2) == d && w1_.size(3) == d &&
                     w2_.sizes() == w1_.sizes(),
                 "Vit3TttInBands: w1/w2: expected shape [1, ", h, ", ", d, ", ", d, "], got ",
                 shape_string(w1_.sizes()), " and ", shape_string(w2_.sizes()));
    LINVIS_CHECK(w3_.dim() == 4 && w3_.size(1) == 1 && w3_.size(2) == 3 && w3_.size(3) == 3,
                 "Vit3TttInBands: w3: expected shape [d, 1, 3, 3], got ", shape_string(w3_.sizes()));
    LINVIS_CHECK(batch > 0 && height > 0 && width > 0, "Vit3TttInBands: empty map ", batch, " x ", height, " x ",
                 width);
}

void Vit3TttInBands::check_band(const Tensor& t, int64_t channels, int64_t begin, int64_t end,
                                const char* what) const {
    LINVIS_CHECK(0 <= begin && begin < end && end <= height_, "Vit3TttInBands: band of rows [", begin, ", ", end,
                 ") is not within the map's ", height_, " rows");
    const int64_t rows = last_row(end) - first_row(begin);
    LINVIS_CHECK(t.dim() == 4 && t.size(0) == batch_ && t.size(1) == rows && t.size(2) == width_ &&
                     t.size(3) == channels,
                 "Vit3TttInBands: ", what, " of rows [", begin, ", ", end, "): expected shape [", batch_, ", ", rows,
                 ", ", width_, ", ", channels, "] (the band with its halo rows), got ", shape_string(t.sizes()));
    LINVIS_CHECK(!(torch::GradMode::is_enabled() && t.requires_grad()),
                 "Vit3TttInBands: ", what, " requires grad; the banded mix is for inference (vit3_ttt_mix in a graph)");
}

void Vit3TttInBands::accumulate(const Tensor& kv, int64_t begin, int64_t end) {
    const int64_t d = head_dim_, C = num_heads_ * d;
    LINVIS_CHECK(!stepped_, "Vit3TttInBands: accumulate after apply: every band's keys come first");
    check_band(kv, 2 * C + 2 * d, begin, end, "kv");
    LINVIS_CHECK(begin == rows_accumulated_, "Vit3TttInBands: bands come in order: expected the band from row ",
                 rows_accumulated_, ", got [", begin, ", ", end, ")");
    if (begin == 0) {
        fused_ = use_fused(impl_, "vit3_ttt_mix", fused_detail::fused_unsupported(kv), simd::vectorised());
        const auto options = kv.options().dtype(fused_ ? torch::kFloat32 : precision::accumulation_dtype(kv));
        g1_ = torch::zeros({batch_, num_heads_, d, d}, options);
        g2_ = torch::zeros({batch_, num_heads_, d, d}, options);
        g3_ = torch::zeros({batch_, 9, d}, options);
    }
    const int64_t offset = begin - first_row(begin), tokens = height_ * width_;
    if (fused_)
        fused_detail::vit3_bands_accumulate_fused(kv, offset, end - begin, num_heads_, tokens, w1_, w2_, g1_, g2_, g3_);
    else
        reference::vit3_bands_accumulate(kv, offset, end - begin, num_heads_, tokens, w1_, w2_, g1_, g2_, g3_);
    rows_accumulated_ = end;
}

void Vit3TttInBands::take_step() {
    LINVIS_CHECK(rows_accumulated_ == height_, "Vit3TttInBands: apply before every band's keys: rows [0, ",
                 rows_accumulated_, ") of ", height_, " accumulated");
    updated_ = fused_ ? fused_detail::vit3_bands_step_fused(w1_, w2_, w3_, g1_, g2_, g3_)
                      : reference::vit3_bands_step(w1_, w2_, w3_, g1_, g2_, g3_);
    g1_ = g2_ = g3_ = Tensor();
    stepped_ = true;
}

Tensor Vit3TttInBands::apply(const Tensor& q, int64_t begin, int64_t end) {
    if (!stepped_) take_step();
    check_band(q, (num_heads_ + 1) * head_dim_, begin, end, "q");
    const int64_t offset = begin - first_row(begin);
    return fused_ ? fused_detail::vit3_bands_apply_fused(q, offset, end - begin, num_heads_, updated_)
                  : reference::vit3_bands_apply(q, offset, end - begin, num_heads_, updated_);
}

}  // namespace linvis::ops
