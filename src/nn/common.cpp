#include "linvis/nn/common.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/precision.h"
#include "linvis/ops/layer_norm.h"

namespace linvis::nn {

torch::Tensor layer_norm(const torch::Tensor& x, torch::IntArrayRef normalized_shape, const torch::Tensor& weight,
                         const torch::Tensor& bias, double eps) {
    const torch::ScalarType acc = precision::accumulation_dtype(x);
    if (acc == x.scalar_type()) return ops::layer_norm(x, normalized_shape, weight, bias, eps);
    const auto widen = [acc](const torch::Tensor& t) { return t.defined() ? t.to(acc) : t; };
    return ops::layer_norm(x.to(acc), normalized_shape, widen(weight), widen(bias), eps).to(x.scalar_type());
}

torch::Tensor layer_norm(const torch::nn::LayerNorm& norm, const torch::Tensor& x) {
    const auto& o = norm->options;
    return layer_norm(x, o.normalized_shape(), norm->weight, norm->bias, o.eps());
}

torch::Tensor modulated_layer_norm(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                                   double eps, ops::Impl impl) {
    const torch::ScalarType acc = precision::accumulation_dtype(x);
    if (acc == x.scalar_type()) return ops::modulated_layer_norm(x, shift, scale, eps, impl);
    return ops::modulated_layer_norm(x.to(acc), shift.to(acc), scale.to(acc), eps, impl).to(x.scalar_type());
}

NormedInput::NormedInput(torch::Tensor x) : x_(std::move(x)) {}

NormedInput::NormedInput(const torch::nn::LayerNorm& norm, torch::Tensor x)
    : x_(std::move(x)), weight_(norm->weight), bias_(norm->bias), eps_(norm->options.eps()), norm_(Norm::LayerNorm) {
    const std::vector<int64_t>& shape = norm->options.normalized_shape();
    LINVIS_CHECK(shape.size() == 1, "NormedInput: the LayerNorm normalises ", shape.size(),
                 " trailing dims; pre-norm blocks normalise one");
    LINVIS_CHECK(x_.dim() >= 1 && x_.size(-1) == shape[0], "LayerNorm: input: expected last dim ", shape[0],
                 ", got shape ", shape_string(x_.sizes()));
}

NormedInput::NormedInput(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps)
    : x_(std::move(x)), weight_(std::move(weight)), bias_(std::move(bias)), eps_(eps), norm_(Norm::LayerNorm) {
    LINVIS_CHECK(x_.dim() >= 1 && (!weight_.defined() || x_.size(-1) == weight_.size(0)),
                 "LayerNorm: input: expected last dim ", weight_.defined() ? weight_.size(0) : 0, ", got shape ",
                 shape_string(x_.sizes()));
}

NormedInput NormedInput::modulated(torch::Tensor x, torch::Tensor shift, torch::Tensor scale, double eps) {
    NormedInput in(std::move(x));
    in.shift_ = std::move(shift);
    in.scale_ = std::move(scale);
    in.eps_ = eps;
    in.norm_ = Norm::Modulated;
    return in;
}

torch::nn::Linear uninitialised_linear(int64_t in, int64_t out, bool bias) {
    LINVIS_CHECK(in > 0 && out > 0, "uninitialised_linear: in and out features must be positive, got ", in, " and ",
                 out);
    // One input feature, not zero: the constructor's kaiming bound divides by the fan-in.
    torch::nn::Linear layer(torch::nn::LinearOptions(1, 0).bias(bias));
    layer->options.in_features(in).out_features(out);
    torch::NoGradGuard no_grad;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    layer->weight.set_data(torch::full({out, in}, nan, layer->weight.options()));
    if (bias) layer->bias.set_data(torch::full({out}, nan, layer->bias.options()));
    return layer;
}

torch::Tensor NormedInput::value(ops::Impl impl) const {
    switch (norm_) {
        case Norm::LayerNorm: return layer_norm(x_, {x_.size(-1)}, weight_, bias_, eps_);
        case Norm::Modulated: return nn::modulated_layer_norm(x_, shift_, scale_, eps_, impl);
        case Norm::None: break;
    }
    return x_;
}

bool NormedInput::records_graph() const { return !can_overwrite({x_, weight_, bias_, shift_, scale_}); }

std::vector<torch::Tensor> NormedInput::linear(const std::vector<ops::NormedProduct>& products,
                                               ops::Impl impl) const {
    const bool fused_node = impl != ops::Impl::Reference && precision::accumulation_dtype(x_) == x_.scalar_type();
    if (fused_node && norm_ == Norm::LayerNorm)
        return ops::layer_norm_linear(x_, weight_, bias_, eps_, products, impl);
    if (fused_node && norm_ == Norm::Modulated)
        return ops::modulated_layer_norm_linear(x_, shift_, scale_, eps_, products, impl);
    const torch::Tensor normed = value(impl);
    std::vector<torch::Tensor> out;
    for (const ops::NormedProduct& product : products) out.push_back(ops::normed_product(normed, product));
    return out;
}

torch::Tensor NormedInput::linear(const torch::nn::Linear& layer, ops::Impl impl) const {
    return linear(std::vector<ops::NormedProduct>{{layer->weight, layer->bias}}, impl)[0];
}

NormedInput NormedInput::with_input(torch::Tensor x) const {
    NormedInput other = *this;
    other.x_ = std::move(x);
    return other;
}

std::vector<RowBand> row_bands(int64_t height, int64_t bytes_per_row, int64_t budget, int64_t min_rows) {
    const int64_t rows = std::max<int64_t>({min_rows, 1, budget / std::max<int64_t>(bytes_per_row, 1)});
    const int64_t count = (height + rows - 1) / rows;
    std::vector<RowBand> bands;
    for (int64_t i = 0; i < count; ++i) {
        const int64_t begin = height * i / count, end = height * (i + 1) / count;
        bands.push_back({begin, end, std::max<int64_t>(begin - 1, 0), std::min(end + 1, height)});
    }
    return bands;
}

void add_in_bands_(const torch::Tensor& x, int64_t width, const std::vector<RowBand>& bands,
                   const std::function<torch::Tensor(const torch::Tensor&, const RowBand&)>& branch) {
    LINVIS_CHECK(can_overwrite({x}), "add_in_bands_: x records a graph; bands in place are for inference");
    const int64_t W = width;
    torch::Tensor above;  // the row above the next band as it was: its own band has been added into x by then
    for (const RowBand& band : bands) {
        torch::Tensor rows = x.narrow(1, band.first * W, (band.last - band.first) * W);
        if (band.first < band.begin)
            rows = torch::cat({above, x.narrow(1, band.begin * W, (band.last - band.begin) * W)}, 1);
        const torch::Tensor y = branch(rows, band);
        if (band.last > band.end) above = x.narrow(1, (band.end - 1) * W, W).clone();
        x.narrow(1, band.begin * W, (band.end - band.begin) * W).add_(y);
    }
}

bool drop_path_active(double rate, bool training) { return training && rate > 0.0; }

torch::Tensor drop_path(const torch::Tensor& x, double rate, bool training) {
    if (!drop_path_active(rate, training)) return x;
    LINVIS_CHECK(rate < 1.0, "drop_path: rate: expected < 1, got ", rate);
    const double keep = 1.0 - rate;
    std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
    shape[0] = x.size(0);
    torch::Tensor mask = torch::empty(shape, x.options()).bernoulli_(keep);
    return x * mask / keep;
}

bool can_overwrite(std::initializer_list<torch::Tensor> operands) {
    if (!torch::GradMode::is_enabled()) return true;
    for (const torch::Tensor& t : operands)
        if (t.requires_grad()) return false;
    return true;
}

torch::Tensor add_into(torch::Tensor fresh, const torch::Tensor& other) {
    // Never into a tensor that shares memory with `other` (a branch that returned its input).
    const bool separate = !fresh.storage().is_alias_of(other.storage());
    if (separate && can_overwrite({fresh, other}) && fresh.sizes() == other.sizes() &&
        fresh.scalar_type() == other.scalar_type())
        return fresh.add_(other);
    return fresh + other;
}

ops::Impl elementwise_impl(ops::Impl model_impl) {
    return model_impl == ops::Impl::Reference ? ops::Impl::Reference : ops::Impl::Auto;
}

torch::Tensor linear_gelu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          ops::GeluForm form, ops::Impl impl) {
    // float32 outside a graph on oneDNN: the bias and the GELU go into the product (its matmul primitive's epilogue
    // acts on each tile while it is in cache), instead of a pass over the whole hidden layer afterwards.
    const bool in_product = x.scalar_type() != torch::kFloat32 ||
                            (impl != ops::Impl::Reference && can_overwrite({x, weight, bias}) &&
                             flops::linear_takes_onednn(x, weight, bias));
    if (in_product) return flops::linear_gelu(x, weight, bias, form == ops::GeluForm::Tanh ? "tanh" : "none");
    return ops::gelu_(flops::linear(x, weight, bias), impl, form);
}

torch::Tensor gelu_mlp(const NormedInput& x, const torch::nn::Linear& fc1, const torch::nn::Linear& fc2,
                       ops::GeluForm form, ops::Impl impl) {
    if (!x.records_graph() && can_overwrite({fc1->weight, fc1->bias, fc2->weight, fc2->bias}))
        return flops::linear(linear_gelu(x.value(impl), fc1->weight, fc1->bias, form, impl), fc2->weight, fc2->bias);
    return ops::gelu_linear(x.linear(fc1, impl), fc2->weight, fc2->bias, form, impl);
}

torch::Tensor resample_abs_pos_embed(const torch::Tensor& pos_embed, std::array<int64_t, 2> new_grid,
                                     std::array<int64_t, 2> old_grid, int64_t num_prefix_tokens, bool antialias) {
    LINVIS_CHECK(pos_embed.defined() && pos_embed.dim() == 3 && pos_embed.size(0) == 1,
                 "resample_abs_pos_embed: pos_embed: expected shape [1, tokens, dim], got ",
                 shape_or_undefined(pos_embed));
    LINVIS_CHECK(num_prefix_tokens >= 0 && num_prefix_tokens < pos_embed.size(1),
                 "resample_abs_pos_embed: num_prefix_tokens ", num_prefix_tokens, " invalid for ",
                 pos_embed.size(1), " positions");
    const int64_t dim = pos_embed.size(2);
    const int64_t tokens = pos_embed.size(1) - num_prefix_tokens;
    if (old_grid[0] <= 0 || old_grid[1] <= 0) {
        const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(tokens))));
        LINVIS_CHECK(side * side == tokens, "resample_abs_pos_embed: pos_embed: ", tokens,
                     " grid positions are not a square grid; give old_grid");
        old_grid = {side, side};
    }
    LINVIS_CHECK(old_grid[0] * old_grid[1] == tokens, "resample_abs_pos_embed: pos_embed: expected ",
                 old_grid[0], "x", old_grid[1], " = ", old_grid[0] * old_grid[1], " grid positions, got ", tokens);
    LINVIS_CHECK(new_grid[0] >= 1 && new_grid[1] >= 1, "resample_abs_pos_embed: new grid ", new_grid[0], "x",
                 new_grid[1], " is empty");
    if (new_grid == old_grid) return pos_embed;

    const auto original = pos_embed.scalar_type();
    const auto compute = original == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    torch::Tensor grid = pos_embed.narrow(1, num_prefix_tokens, tokens)
                             .reshape({1, old_grid[0], old_grid[1], dim})
                             .permute({0, 3, 1, 2})
                             .to(compute);
    namespace F = torch::nn::functional;
    grid = F::interpolate(grid, F::InterpolateFuncOptions()
                                    .size(std::vector<int64_t>{new_grid[0], new_grid[1]})
                                    .mode(torch::kBicubic)
                                    .align_corners(false)
                                    .antialias(antialias));
    grid = grid.permute({0, 2, 3, 1}).reshape({1, new_grid[0] * new_grid[1], dim}).to(original);
    if (num_prefix_tokens == 0) return grid;
    return torch::cat({pos_embed.narrow(1, 0, num_prefix_tokens), grid}, 1);
}

torch::Tensor resize_pos_embed_2d(const torch::Tensor& embed, int64_t h, int64_t w) {
    LINVIS_CHECK(embed.dim() == 4 && embed.size(0) == 1, "pos_embed.embed: expected shape [1, H, W, D], got ",
                 shape_string(embed.sizes()));
    LINVIS_CHECK(h > 0 && w > 0, "pos_embed.embed: target grid must be positive, got ", h, "x", w);
    if (embed.size(1) == h && embed.size(2) == w) return embed;
    namespace F = torch::nn::functional;
    torch::Tensor channels_first = embed.permute({0, 3, 1, 2});
    torch::Tensor resized = F::interpolate(channels_first, F::InterpolateFuncOptions()
                                                               .size(std::vector<int64_t>{h, w})
                                                               .mode(torch::kBicubic)
                                                               .align_corners(false));
    return resized.permute({0, 2, 3, 1});
}

torch::Tensor pad_to_multiple(const torch::Tensor& x, int64_t multiple) {
    const int64_t pad_h = (multiple - x.size(-2) % multiple) % multiple;
    const int64_t pad_w = (multiple - x.size(-1) % multiple) % multiple;
    if (pad_h == 0 && pad_w == 0) return x;
    return torch::constant_pad_nd(x, {0, pad_w, 0, pad_h}, 0.0);
}

}  // namespace linvis::nn
