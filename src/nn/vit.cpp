#include "linvis/nn/vit.h"

#include <algorithm>
#include <cmath>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/nn/checkpoint.h"
#include "linvis/nn/common.h"
#include "linvis/ops/depthwise_conv.h"
#include "linvis/ops/activation.h"

namespace linvis::nn {

void trunc_normal_(torch::Tensor t, double std, double a, double b) {
    torch::NoGradGuard no_grad;
    auto cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
    const double lo = cdf(a / std), hi = cdf(b / std);
    if (hi - lo >= 0.5) {
        // Most of the mass inside the bounds (the ViT init's are 100 std away): draws outside them are drawn again,
        // the same distribution without erfinv_, which LibTorch 1.13 computes a value at a time (2.7 s for ViT-B's
        // 86 M weights on a Zen 4 EPYC, against 0.3 s for normal_).
        t.normal_(0.0, std);
        while (true) {
            const torch::Tensor outside = (t < a).logical_or_(t > b);
            const int64_t count = outside.sum().item<int64_t>();
            if (count == 0) return;
            t.masked_scatter_(outside, torch::empty({count}, t.options()).normal_(0.0, std));
        }
    }
    t.uniform_(2 * lo - 1, 2 * hi - 1);
    t.erfinv_();
    t.mul_(std * std::sqrt(2.0));
    t.clamp_(a, b);
}

torch::nn::Linear vit_linear(int64_t in, int64_t out, bool bias) {
    torch::nn::Linear layer = uninitialised_linear(in, out, bias);
    trunc_normal_(layer->weight);
    if (bias) {
        torch::NoGradGuard no_grad;
        layer->bias.zero_();
    }
    return layer;
}

torch::Tensor tokens_to_map(const torch::Tensor& x, int64_t height, int64_t width) {
    LINVIS_CHECK(x.dim() == 3 && x.size(1) == height * width, "tokens_to_map: expected (B, ", height * width,
                 ", C), got ", shape_string(x.sizes()));
    return x.transpose(1, 2).reshape({x.size(0), x.size(2), height, width});
}

torch::Tensor map_to_tokens(const torch::Tensor& x) { return x.flatten(2).transpose(1, 2); }

namespace {
// The padding option of a Conv2d is a variant whose type differs between LibTorch versions (c10 or
// std); the module keeps it resolved as (left, right, top, bottom) in a protected member, read here
// through a pointer to member formed in a derived class.
struct ConvPadding : torch::nn::Conv2dImpl {
    static const std::vector<int64_t>& of(const torch::nn::Conv2dImpl& conv) {
        return conv.*(&ConvPadding::_reversed_padding_repeated_twice);
    }
};
}  // namespace

std::optional<std::array<int64_t, 2>> conv_zero_padding(const torch::nn::Conv2dImpl& conv) {
    const std::vector<int64_t>& pad = ConvPadding::of(conv);
    if (pad.size() != 4 || pad[0] != pad[1] || pad[2] != pad[3] ||
        torch::enumtype::get_enum_name(conv.options.padding_mode()) != "kZeros")
        return std::nullopt;
    return std::array<int64_t, 2>{pad[2], pad[0]};
}

torch::Tensor conv_forward(const torch::nn::Conv2d& layer, const torch::Tensor& x, bool pad_rows) {
    return conv_forward(layer, layer->weight, layer->bias, x, pad_rows);
}

torch::Tensor conv_forward(const torch::nn::Conv2d& layer, const torch::Tensor& layer_weight,
                           const torch::Tensor& layer_bias, const torch::Tensor& x, bool pad_rows) {
    const auto& o = layer->options;
    const std::optional<std::array<int64_t, 2>> pad = conv_zero_padding(*layer);
    LINVIS_CHECK(pad.has_value(), "conv_forward: only symmetric zero padding is supported");
    const auto conv = [&](const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias,
                          int64_t groups) {
        return flops::conv2d(input, weight, bias, {(*o.stride())[0], (*o.stride())[1]},
                             {pad_rows ? (*pad)[0] : 0, (*pad)[1]}, {(*o.dilation())[0], (*o.dilation())[1]}, groups);
    };
    // A large depthwise conv outside a graph, a group of channels at a time into one output: LibTorch 1.13's
    // depthwise conv on oneDNN copies its whole input into a blocked layout first (128 MiB in H-ViT3-T's first
    // patch merging at 1024 px).
    const int64_t C = x.dim() == 4 ? x.size(1) : 0, bytes = x.numel() * static_cast<int64_t>(x.element_size());
    const bool depthwise = o.groups() == C && o.out_channels() == C && C > 1;
    const bool graph = torch::GradMode::is_enabled() &&
                       (x.requires_grad() || layer_weight.requires_grad() ||
                        (layer_bias.defined() && layer_bias.requires_grad()));
    if (!depthwise || graph || bytes <= kDepthwiseChunkBytes) return conv(x, layer_weight, layer_bias, o.groups());
    const int64_t chunks = std::min(C, (bytes + kDepthwiseChunkBytes - 1) / kDepthwiseChunkBytes);
    const int64_t per_chunk = (C + chunks - 1) / chunks;
    torch::Tensor out;
    for (int64_t c0 = 0; c0 < C; c0 += per_chunk) {
        const int64_t n = std::min(per_chunk, C - c0);
        const torch::Tensor part = conv(x.narrow(1, c0, n), layer_weight.narrow(0, c0, n),
                                        layer_bias.defined() ? layer_bias.narrow(0, c0, n) : torch::Tensor(), n);
        if (!out.defined())  // in the layout of the input (a channels-last map stays channels-last)
            out = torch::empty({x.size(0), C, part.size(2), part.size(3)},
                               part.options().memory_format(part.suggest_memory_format()));
        out.narrow(1, c0, n).copy_(part);
    }
    return out;
}

ConvGradients conv_backward(const torch::nn::Conv2d& layer, const torch::Tensor& dy, const torch::Tensor& x,
                            std::array<bool, 3> needs, int64_t chunk_bytes) {
    const auto& o = layer->options;
    const std::optional<std::array<int64_t, 2>> pad = conv_zero_padding(*layer);
    LINVIS_CHECK(pad.has_value(), "conv_backward: only symmetric zero padding is supported");
    torch::NoGradGuard no_grad;
    needs[2] = needs[2] && layer->bias.defined();
    const auto backward = [&](const torch::Tensor& g, const torch::Tensor& input, const torch::Tensor& weight,
                              int64_t groups) {
        const std::vector<int64_t> bias_sizes{weight.size(0)};
        const c10::OptionalIntArrayRef bias = needs[2] ? c10::OptionalIntArrayRef(bias_sizes) : c10::nullopt;
        return at::convolution_backward(g, input, weight, bias, {(*o.stride())[0], (*o.stride())[1]}, *pad,
                                        {(*o.dilation())[0], (*o.dilation())[1]}, /*transposed=*/false, {0, 0}, groups,
                                        needs);
    };
    const int64_t C = x.size(1);
    // float32 / float64 only: LibTorch 1.13's bf16 mm may accumulate in bf16 (linvis/core/precision.h).
    const bool full_precision = x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64;
    if (is_pointwise(layer) && x.dim() == 4 && full_precision) {
        const torch::Tensor planes = x.contiguous().view({x.size(0), C, -1});
        return pointwise_conv_backward(
            layer, dy, [&](int64_t n, int64_t p0, int64_t p1) { return planes[n].narrow(1, p0, p1 - p0); }, needs,
            planes.numel() * static_cast<int64_t>(planes.element_size()));
    }
    const int64_t bytes = x.numel() * static_cast<int64_t>(x.element_size());
    const bool depthwise = o.groups() == C && o.out_channels() == C && C > 1;
    if (!depthwise || bytes <= chunk_bytes) {
        auto [dx, dweight, dbias] = backward(dy, x, layer->weight, o.groups());
        return {needs[0] ? dx : torch::Tensor(), needs[1] ? dweight : torch::Tensor(),
                needs[2] ? dbias : torch::Tensor()};
    }
    // Each channel's conv is its own: a group of channels at a time, dx written into one tensor.
    const int64_t chunks = std::min(C, (bytes + chunk_bytes - 1) / chunk_bytes);
    const int64_t per_chunk = (C + chunks - 1) / chunks;
    ConvGradients out;
    if (needs[0]) out.dx = torch::empty_like(x, torch::MemoryFormat::Contiguous);
    std::vector<torch::Tensor> dweights, dbiases;
    for (int64_t c0 = 0; c0 < C; c0 += per_chunk) {
        const int64_t n = std::min(per_chunk, C - c0);
        auto [dx, dweight, dbias] =
            backward(dy.narrow(1, c0, n), x.narrow(1, c0, n), layer->weight.narrow(0, c0, n), n);
        if (needs[0]) out.dx.narrow(1, c0, n).copy_(dx);
        if (needs[1]) dweights.push_back(dweight);
        if (needs[2]) dbiases.push_back(dbias);
    }
    if (needs[1]) out.dweight = torch::cat(dweights, 0);
    if (needs[2]) out.dbias = torch::cat(dbiases, 0);
    return out;
}

bool is_pointwise(const torch::nn::Conv2d& layer) {
    const auto& o = layer->options;
    const std::vector<int64_t>& pad = ConvPadding::of(*layer);
    const auto ones = [](const torch::ExpandingArray<2>& a) { return (*a)[0] == 1 && (*a)[1] == 1; };
    return ones(o.kernel_size()) && ones(o.stride()) && ones(o.dilation()) && o.groups() == 1 &&
           std::all_of(pad.begin(), pad.end(), [](int64_t p) { return p == 0; });
}

ConvGradients pointwise_conv_backward(const torch::nn::Conv2d& layer, const torch::Tensor& dy,
                                      const PixelSlabFn& input_slab, std::array<bool, 3> needs,
                                      int64_t slab_bytes) {
    LINVIS_CHECK(is_pointwise(layer), "pointwise_conv_backward: the conv is not 1x1 with stride 1, no padding or "
                                      "dilation and one group");
    torch::NoGradGuard no_grad;
    const int64_t B = dy.size(0), O = dy.size(1), plane = dy.size(2) * dy.size(3);
    const int64_t C = layer->weight.size(1);
    const torch::Tensor w = layer->weight.view({O, C});
    const torch::Tensor g = dy.contiguous().view({B, O, plane});
    ConvGradients out;
    if (needs[0]) {
        out.dx = torch::empty({B, C, dy.size(2), dy.size(3)}, dy.options());
        const torch::Tensor dx = out.dx.view({B, C, plane});
        const torch::Tensor wt = w.t();
        for (int64_t n = 0; n < B; ++n) {
            torch::Tensor sample = dx[n];
            at::mm_out(sample, wt, g[n]);
        }
    }
    if (needs[1]) {
        out.dweight = torch::zeros_like(w);
        const int64_t per_slab = std::max<int64_t>(
            1, std::min(plane, slab_bytes / std::max<int64_t>(C * static_cast<int64_t>(dy.element_size()), 1)));
        for (int64_t n = 0; n < B; ++n)
            for (int64_t p0 = 0; p0 < plane; p0 += per_slab) {
                const int64_t p1 = std::min(plane, p0 + per_slab);
                out.dweight.addmm_(g[n].narrow(1, p0, p1 - p0), input_slab(n, p0, p1).t());
            }
        out.dweight = out.dweight.view_as(layer->weight);
    }
    if (needs[2] && layer->bias.defined()) out.dbias = g.sum(std::vector<int64_t>{0, 2});
    return out;
}

std::vector<double> drop_path_rates(double rate, int64_t depth, bool decay) {
    LINVIS_CHECK(rate >= 0.0 && rate < 1.0, "drop_path_rate must be in [0, 1), got ", rate);
    std::vector<double> rates(static_cast<size_t>(std::max<int64_t>(depth, 0)), rate);
    if (!decay || depth <= 0) return rates;
    const torch::Tensor values = torch::linspace(0.0, rate, depth);  // float32, as timm
    for (int64_t i = 0; i < depth; ++i) rates[static_cast<size_t>(i)] = values[i].item<double>();
    return rates;
}

std::vector<int64_t> take_indices(int64_t count, const std::vector<int64_t>& indices, const std::string& what) {
    std::vector<int64_t> taken;
    taken.reserve(indices.size());
    for (int64_t index : indices) {
        const int64_t i = index < 0 ? index + count : index;
        LINVIS_CHECK(i >= 0 && i < count, what, ": forward_intermediates: index ", index, " outside [-", count, ", ",
                     count, ")");
        taken.push_back(i);
    }
    return taken;
}

PatchEmbedImpl::PatchEmbedImpl(int64_t in_chans_, int64_t dim, int64_t patch_) : in_chans(in_chans_), patch(patch_) {
    LINVIS_CHECK(in_chans >= 1 && dim >= 1 && patch >= 1, "PatchEmbed: bad in_chans ", in_chans, ", dim ", dim,
                 " or patch ", patch);
    proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_chans, dim, patch).stride(patch)));
}

torch::Tensor PatchEmbedImpl::forward(const torch::Tensor& images) {
    return flops::conv2d(images, proj->weight, proj->bias, {patch, patch}, {0, 0}, {1, 1}, 1);
}

torch::Tensor PatchEmbedImpl::tokens(const torch::Tensor& images) {
    LINVIS_CHECK(images.dim() == 4 && images.size(1) == in_chans && images.size(2) % patch == 0 &&
                     images.size(3) % patch == 0,
                 "PatchEmbed: images: expected (B, ", in_chans, ", H, W) with H and W multiples of ", patch, ", got ",
                 images.sizes());
    const int64_t B = images.size(0), h = images.size(2) / patch, w = images.size(3) / patch;
    const int64_t dim = proj->weight.size(0);
    // (B, C, h, p, w, p) -> (B, h, w, C, p, p): each row the patch in the kernel's (C, p, p) order.
    const torch::Tensor patches = images.reshape({B, in_chans, h, patch, w, patch})
                                      .permute({0, 2, 4, 1, 3, 5})
                                      .reshape({B * h * w, in_chans * patch * patch});
    return flops::linear(patches, proj->weight.reshape({dim, -1}), proj->bias).view({B, h * w, dim});
}

GridPosEmbedImpl::GridPosEmbedImpl(int64_t height, int64_t width, int64_t dim) {
    embed = register_parameter("embed", torch::empty({1, height, width, dim}));
    trunc_normal_(embed);
}

torch::Tensor GridPosEmbedImpl::forward(const torch::Tensor& grid) {
    return grid + resize_pos_embed_2d(embed, grid.size(1), grid.size(2));  // embed itself on its own grid
}

MlpImpl::MlpImpl(int64_t dim, int64_t hidden, bool with_dwc, ops::Impl impl_) : impl(impl_) {
    fc1 = register_module("fc1", vit_linear(dim, hidden));
    if (with_dwc)
        dwc = register_module("dwc", torch::nn::Conv2d(torch::nn::Conv2dOptions(hidden, hidden, 3)
                                                           .padding(1)
                                                           .groups(hidden)
                                                           .bias(true)));
    fc2 = register_module("fc2", vit_linear(hidden, dim));
}

torch::Tensor MlpImpl::add_to_(const torch::Tensor& residual, const NormedInput& x, int64_t height, int64_t width) {
    const ops::Impl passes = elementwise_impl(impl);
    if (x.records_graph() || !can_overwrite({residual, fc1->weight, fc1->bias, fc2->weight, fc2->bias}))
        return residual.add_(forward(x, height, width));
    torch::Tensor y = linear_gelu(x.value(), fc1->weight, fc1->bias, ops::GeluForm::Erf, passes);
    if (dwc) {
        y = ops::depthwise_conv2d_tokens(y, height, width, dwc->weight, dwc->bias, ops::DwEpilogue::Residual, impl);
        y = ops::gelu_(std::move(y), passes, ops::GeluForm::Erf);
    }
    return flops::linear_add_(residual, y, fc2->weight, fc2->bias);
}

torch::Tensor MlpImpl::forward(const NormedInput& x, int64_t height, int64_t width) {
    const ops::Impl passes = elementwise_impl(impl);
    if (!dwc) return nn::gelu_mlp(x, fc1, fc2, ops::GeluForm::Erf, passes);
    if (recompute_hidden && is_training() && x.records_graph()) {
        // The graph keeps fc1's output alone; GELU, the conv and GELU again are redone in fc2's backward (with
        // recompute_in_bands a band of rows at a time, so that neither they nor their gradients exist whole). A
        // training step only: an eval-mode graph (an explanation's input gradient) keeps everything, as without it.
        const ops::Impl conv_impl = impl;
        const int64_t H = height, W = width;
        const auto hidden_after_conv = [W, conv_impl, passes](const torch::Tensor& rows, int64_t band_height,
                                                              const std::vector<torch::Tensor>& conv) {
            torch::Tensor y = torch::gelu(rows);  // a new tensor: rows are the kept input's
            y = ops::depthwise_conv2d_tokens(y, band_height, W, conv[0], conv[1], ops::DwEpilogue::Residual,
                                             conv_impl);
            return ops::gelu_(std::move(y), passes, ops::GeluForm::Erf);
        };
        const torch::Tensor hidden = x.linear(fc1, passes);
        if (!recompute_in_bands) {
            const auto whole_map = [H, hidden_after_conv](const std::vector<torch::Tensor>& in) {
                return hidden_after_conv(in[0], H, {in[1], in[2]});
            };
            return recompute_into_linear(whole_map, {hidden, dwc->weight, dwc->bias}, fc2->weight, fc2->bias);
        }
        const int64_t bytes_per_row = 2 * hidden.size(0) * W * hidden.size(2) * hidden.element_size();
        return recompute_into_linear_in_bands(hidden_after_conv, hidden, H, W, {dwc->weight, dwc->bias}, fc2->weight,
                                              fc2->bias, bytes_per_row, recompute_band_bytes);
    }
    // In a float32 graph fc1 through layer_norm_linear, then the GELU (nn::linear_gelu's graph path).
    torch::Tensor y = x.records_graph() && x.input().scalar_type() == torch::kFloat32
                          ? ops::gelu_(x.linear(fc1, passes), passes, ops::GeluForm::Erf)
                          : nn::linear_gelu(x.value(), fc1->weight, fc1->bias, ops::GeluForm::Erf, passes);
    y = ops::depthwise_conv2d_tokens(y, height, width, dwc->weight, dwc->bias, ops::DwEpilogue::Residual, impl);
    return ops::gelu_linear(std::move(y), fc2->weight, fc2->bias, ops::GeluForm::Erf, passes);
}

torch::Tensor MlpImpl::residual_in_bands_(const NormedInput& in, int64_t height, int64_t width, int64_t band_bytes) {
    const torch::Tensor& x = in.input();
    LINVIS_CHECK(dwc, "Mlp::residual_in_bands_: the MLP has no depthwise conv; its tokens need no bands");
    LINVIS_CHECK(x.dim() == 3 && x.size(1) == height * width, "Mlp: expected x (B, ", height * width,
                 ", C), got ", shape_string(x.sizes()));
    const ops::Impl passes = elementwise_impl(impl);
    const int64_t B = x.size(0), hidden = fc1->weight.size(0), W = width;
    // fc1 and the conv counted once as over the whole map: a band's halo rows are repeats.
    if (flops::counting()) flops::add(B * height * width * hidden * (x.size(2) + 9));
    // Bands of at least 8 rows: fc1 and the conv redo each band's two halo rows (at most a quarter more of that
    // work; 16-row bands measured no faster within the machine's noise and used 0-20 MiB more at 1024 / 2048 px).
    const auto bands = row_bands(height, 2 * B * W * hidden * x.element_size(), band_bytes, /*min_rows=*/8);
    add_in_bands_(x, W, bands, [&](const torch::Tensor& rows, const RowBand& band) {
        torch::Tensor y;
        {
            const flops::Uncounted halo_rows_repeated;
            y = nn::linear_gelu(in.with_input(rows).value(), fc1->weight, fc1->bias, ops::GeluForm::Erf, passes);
            // The conv's outputs on the halo rows lack their outer neighbours; the band's rows are exact.
            y = ops::depthwise_conv2d_tokens(y, band.last - band.first, W, dwc->weight, dwc->bias,
                                             ops::DwEpilogue::Residual, impl);
        }
        return ops::gelu_linear(y.narrow(1, (band.begin - band.first) * W, (band.end - band.begin) * W),
                                fc2->weight, fc2->bias, ops::GeluForm::Erf, passes);
    });
    return x;
}

TransformerBlockImpl::TransformerBlockImpl(const TransformerBlockOptions& options, std::shared_ptr<Mixer> mixer)
    : options_(options) {
    const int64_t D = options.dim;
    if (options.cpe)
        cpe = register_module("cpe", torch::nn::Conv2d(torch::nn::Conv2dOptions(D, D, 3).padding(1).groups(D)));
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(options.norm_eps)));
    attn = register_module("attn", std::move(mixer));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(options.norm_eps)));
    mlp = register_module("mlp", Mlp(D, options.mlp_hidden, false, options.impl));
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x_in, int64_t height, int64_t width) {
    torch::Tensor x = x_in;
    if (cpe)
        x = ops::depthwise_conv2d_tokens(x, height, width, cpe->weight, cpe->bias, ops::DwEpilogue::Residual,
                                         options_.impl);
    // Inference: each branch's last product accumulates onto the residual stream in the GEMM, into a tensor this
    // block made (the positional conv's output for the mixer, the mixer's sum for the MLP), never into its input.
    const bool in_place = can_overwrite({x, norm1->weight, norm2->weight, mlp->fc2->weight}) &&
                          !drop_path_active(options_.drop_path, is_training());
    if (in_place && cpe) {
        x = attn->add_to_(x, NormedInput(norm1, x), height, width);
    } else {
        torch::Tensor branch = attn->forward(NormedInput(norm1, x), height, width);
        x = add_into(drop_path(branch, options_.drop_path, is_training()), x);
    }
    if (in_place) return mlp->add_to_(x, NormedInput(norm2, x), height, width);
    return add_into(drop_path(mlp->forward(NormedInput(norm2, x)), options_.drop_path, is_training()), x);
}

}  // namespace linvis::nn
