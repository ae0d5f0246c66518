#include "linvis/nn/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/nn/common.h"
#include "linvis/nn/vit.h"

namespace linvis::nn {
namespace {

// The ReLU's backward in place: grad = 0 where relu's output is 0 (LibTorch's threshold_backward written over grad,
// vectorised and parallel, where masked_fill_ on CPU is a serial loop in LibTorch 1.13).
void relu_backward_(torch::Tensor& grad, const torch::Tensor& relu_output) {
    at::threshold_backward_out(grad, grad, relu_output, 0);
}

// What the backward needs besides the inputs: the segment and the generator state its forward started from.
struct Recompute : torch::CustomClassHolder {
    SegmentFn fn;
    torch::Tensor rng_state;
    size_t num_inputs = 0, num_parameters = 0;  // the Function's inputs: the segment's, then its parameters
    std::vector<torch::Tensor> running_buffers;  // restored after the recomputation
};

torch::Tensor cpu_rng_state() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
public:
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::TensorList inputs,
                                                  c10::intrusive_ptr<Recompute> recompute) {
        recompute->rng_state = cpu_rng_state();
        const std::vector<torch::Tensor> segment_inputs(inputs.begin(), inputs.begin() + recompute->num_inputs);
        ctx->save_for_backward(segment_inputs);
        ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
        torch::NoGradGuard no_grad;
        const flops::WeightsInTraining training;  // the segment's weights need not be inputs (checkpoint(BlockFn))
        return recompute->fn(segment_inputs);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
        std::vector<torch::Tensor> inputs;
        for (const torch::Tensor& saved : ctx->get_saved_variables())
            inputs.push_back(saved.detach().requires_grad_(saved.requires_grad()));
        const torch::Tensor rng_after = cpu_rng_state();
        set_cpu_rng_state(recompute->rng_state);
        std::vector<torch::Tensor> buffers_after;
        for (const torch::Tensor& buffer : recompute->running_buffers) buffers_after.push_back(buffer.clone());
        std::vector<torch::Tensor> outputs;
        {
            torch::AutoGradMode grad(true);
            outputs = recompute->fn(inputs);
        }
        set_cpu_rng_state(rng_after);
        LINVIS_CHECK(outputs.size() == grads.size(), "checkpoint: the recomputed segment returned ", outputs.size(),
                     " tensors, the first run ", grads.size());
        std::vector<torch::Tensor> differentiable, their_grads;
        for (size_t i = 0; i < outputs.size(); ++i) {
            if (!grads[i].defined() || !outputs[i].requires_grad()) continue;
            differentiable.push_back(outputs[i]);
            their_grads.push_back(grads[i]);
        }
        LINVIS_CHECK(!differentiable.empty() || std::none_of(grads.begin(), grads.end(),
                                                             [](const torch::Tensor& g) { return g.defined(); }),
                     "checkpoint: the recomputed segment does not depend on its inputs");
        if (!differentiable.empty()) torch::autograd::backward(differentiable, their_grads);
        // Only now: the recomputed graph's BatchNorm nodes hold the buffers and check that they are unchanged.
        {
            torch::NoGradGuard no_grad;
            for (size_t i = 0; i < buffers_after.size(); ++i) recompute->running_buffers[i].copy_(buffers_after[i]);
        }
        torch::autograd::variable_list input_grads;
        for (const torch::Tensor& input : inputs)
            input_grads.push_back(input.requires_grad() ? input.grad() : torch::Tensor());
        // The parameters got theirs as leaves of the recomputed graph; none through the Function's edges.
        input_grads.resize(input_grads.size() + recompute->num_parameters);
        input_grads.emplace_back();  // the recompute capsule
        return input_grads;
    }
};

bool needs_grad(const torch::Tensor& t) { return t.defined() && t.requires_grad(); }

struct ProductInput : torch::CustomClassHolder {
    ProductInputFn fn;
    size_t num_inputs = 0;
    bool has_bias = false;
};

// Inputs: fn's, then the weight, then the bias when there is one.
class RecomputeIntoLinear : public torch::autograd::Function<RecomputeIntoLinear> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::TensorList inputs,
                                 c10::intrusive_ptr<ProductInput> segment) {
        const size_t n = segment->num_inputs;
        ctx->save_for_backward(inputs.vec());
        ctx->saved_data["segment"] = c10::IValue::make_capsule(segment);
        torch::NoGradGuard no_grad;
        const torch::Tensor bias = segment->has_bias ? inputs[n + 1] : torch::Tensor();
        return flops::linear(segment->fn(std::vector<torch::Tensor>(inputs.begin(), inputs.begin() + n)), inputs[n],
                             bias);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto segment = c10::static_intrusive_pointer_cast<ProductInput>(ctx->saved_data["segment"].toCapsule());
        const std::vector<torch::Tensor> saved = ctx->get_saved_variables();
        const size_t n = segment->num_inputs;
        std::vector<torch::Tensor> inputs, wanted;  // wanted: the inputs that need a gradient
        for (size_t i = 0; i < n; ++i) {
            inputs.push_back(saved[i].detach().requires_grad_(ctx->needs_input_grad(i)));
            if (ctx->needs_input_grad(i)) wanted.push_back(inputs.back());
        }
        torch::Tensor product_input;
        {
            torch::AutoGradMode graph(!wanted.empty());
            product_input = segment->fn(inputs);
        }
        const flops::LinearGradients g = flops::linear_backward(
            grads[0], product_input.detach(), saved[n],
            {!wanted.empty(), ctx->needs_input_grad(n), segment->has_bias && ctx->needs_input_grad(n + 1)});
        torch::autograd::variable_list out(saved.size() + 1);  // the last: the segment capsule
        if (!wanted.empty()) {
            const auto input_grads = torch::autograd::grad({product_input}, wanted, {g.dx}, c10::nullopt, false,
                                                           /*allow_unused=*/true);
            for (size_t i = 0, j = 0; i < n; ++i)
                if (ctx->needs_input_grad(i)) out[i] = input_grads[j++];
        }
        out[n] = g.dweight;
        if (segment->has_bias) out[n + 1] = g.dbias;
        return out;
    }
};

struct BandedProductInput : torch::CustomClassHolder {
    BandProductInputFn fn;
    int64_t height = 0, width = 0;
    std::vector<RowBand> bands;
    size_t num_parameters = 0;
    bool has_bias = false;
};

// fn over a band's rows [first, last), then its rows [begin, end): fn's work counted for those rows only, so the
// bands add up to the whole grid's count.
torch::Tensor band_product_input(const BandedProductInput& s, const torch::Tensor& tokens, const RowBand& band,
                                 const std::vector<torch::Tensor>& parameters) {
    const int64_t W = s.width, rows = band.last - band.first;
    torch::Tensor input;
    int64_t macs = 0;
    {
        const flops::Uncounted halo_rows_apart;
        const flops::Counter band_count;
        input = s.fn(tokens.narrow(1, band.first * W, rows * W), rows, parameters);
        macs = band_count.macs();
    }
    if (flops::counting()) flops::add(macs / rows * (band.end - band.begin));
    LINVIS_CHECK(input.dim() == 3 && input.size(1) == rows * W, "recompute_into_linear_in_bands: fn returned ",
                 input.sizes(), " for ", rows, " rows of ", W, " tokens");
    return input.narrow(1, (band.begin - band.first) * W, (band.end - band.begin) * W);
}

// A band's gradient `part` (its rows [first, last)) into `sum`, whose rows [0, written) hold earlier bands' already:
// added over those, copied over the rest. Bands come in order and overlap only where halo rows meet their
// neighbours, so no row is read before it is written.
void add_band_rows(torch::Tensor& sum, const torch::Tensor& part, const RowBand& band, int64_t W, int64_t& written) {
    const int64_t rows = band.last - band.first;
    const int64_t overlap = std::clamp<int64_t>(written - band.first, 0, rows);
    if (overlap > 0) sum.narrow(1, band.first * W, overlap * W).add_(part.narrow(1, 0, overlap * W));
    if (overlap < rows)
        sum.narrow(1, (band.first + overlap) * W, (rows - overlap) * W)
            .copy_(part.narrow(1, overlap * W, (rows - overlap) * W));
    written = std::max(written, band.last);
}

// Inputs: tokens, the parameters, the weight, then the bias when there is one.
class RecomputeIntoLinearInBands : public torch::autograd::Function<RecomputeIntoLinearInBands> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::TensorList inputs,
                                 c10::intrusive_ptr<BandedProductInput> segment) {
        ctx->save_for_backward(inputs.vec());
        ctx->saved_data["segment"] = c10::IValue::make_capsule(segment);
        torch::NoGradGuard no_grad;
        return run(*segment, inputs.vec());
    }

    // The product over the whole grid, a band at a time, without a graph.
    static torch::Tensor run(const BandedProductInput& s, const std::vector<torch::Tensor>& inputs) {
        const size_t p = s.num_parameters;
        const torch::Tensor& tokens = inputs[0];
        const std::vector<torch::Tensor> parameters(inputs.begin() + 1, inputs.begin() + 1 + p);
        const torch::Tensor& weight = inputs[1 + p];
        const torch::Tensor bias = s.has_bias ? inputs[2 + p] : torch::Tensor();
        const int64_t W = s.width;
        torch::Tensor out = torch::empty({tokens.size(0), s.height * W, weight.size(0)}, tokens.options());
        for (const RowBand& band : s.bands)
            out.narrow(1, band.begin * W, (band.end - band.begin) * W)
                .copy_(flops::linear(band_product_input(s, tokens, band, parameters), weight, bias));
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto segment = c10::static_intrusive_pointer_cast<BandedProductInput>(ctx->saved_data["segment"].toCapsule());
        const BandedProductInput& s = *segment;
        const std::vector<torch::Tensor> saved = ctx->get_saved_variables();
        const size_t p = s.num_parameters, n = 1 + p;  // fn's inputs: tokens and the parameters
        const torch::Tensor& weight = saved[n];
        const int64_t W = s.width;
        bool any_input = false;
        for (size_t i = 0; i < n; ++i) any_input = any_input || ctx->needs_input_grad(i);
        torch::autograd::variable_list out(saved.size() + 1);  // the last: the segment capsule
        const auto accumulate = [](torch::Tensor& sum, const torch::Tensor& part) {
            if (!part.defined()) return;
            if (!sum.defined()) sum = part.clone();
            else sum.add_(part);
        };
        // The tokens' gradient band by band (add_band_rows): no pass to zero it first.
        if (ctx->needs_input_grad(0)) out[0] = torch::empty_like(saved[0], torch::MemoryFormat::Contiguous);
        int64_t written = 0;
        for (const RowBand& band : s.bands) {
            std::vector<torch::Tensor> inputs, wanted;  // wanted: the band's inputs that need a gradient
            for (size_t i = 0; i < n; ++i) {
                torch::Tensor t = i == 0 ? saved[0].narrow(1, band.first * W, (band.last - band.first) * W) : saved[i];
                inputs.push_back(t.detach().requires_grad_(ctx->needs_input_grad(i)));
                if (ctx->needs_input_grad(i)) wanted.push_back(inputs.back());
            }
            // band_product_input narrows the rows it gets: hand it the band's rows as the whole grid's first ones.
            const RowBand local{band.begin - band.first, band.end - band.first, 0, band.last - band.first};
            torch::Tensor product_input;
            {
                torch::AutoGradMode graph(any_input);
                product_input = band_product_input(s, inputs[0], local,
                                                   std::vector<torch::Tensor>(inputs.begin() + 1, inputs.end()));
            }
            const torch::Tensor dy = grads[0].narrow(1, band.begin * W, (band.end - band.begin) * W);
            const flops::LinearGradients g = flops::linear_backward(
                dy, product_input.detach(), weight,
                {any_input, ctx->needs_input_grad(n), s.has_bias && ctx->needs_input_grad(n + 1)});
            accumulate(out[n], g.dweight);
            if (s.has_bias) accumulate(out[n + 1], g.dbias);
            if (!any_input) continue;
            const auto input_grads = torch::autograd::grad({product_input}, wanted, {g.dx}, c10::nullopt, false,
                                                           /*allow_unused=*/true);
            for (size_t i = 0, j = 0; i < n; ++i) {
                if (!ctx->needs_input_grad(i)) continue;
                const torch::Tensor& part = input_grads[j++];
                if (i == 0) {
                    add_band_rows(out[0], part.defined() ? part : torch::zeros_like(inputs[0]), band, W, written);
                } else if (part.defined()) {
                    accumulate(out[i], part);
                }
            }
        }
        return out;
    }
};

struct ConvInput : torch::CustomClassHolder {
    BlockFn fn;
    bool relu = false;
    torch::nn::Conv2d conv{nullptr};
    std::vector<torch::Tensor> running_buffers;
    size_t num_parameters = 0;
};

// Inputs: fn's input, the conv's weight and bias (an empty tensor when it has none), then fn's parameters.
class RecomputeIntoConv : public torch::autograd::Function<RecomputeIntoConv> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::TensorList inputs,
                                 c10::intrusive_ptr<ConvInput> segment) {
        ctx->save_for_backward({inputs[0]});
        ctx->saved_data["segment"] = c10::IValue::make_capsule(segment);
        torch::NoGradGuard no_grad;
        return conv_forward(segment->conv, conv_input(*segment, inputs[0]));
    }

    // fn(input), then the ReLU in place outside any graph.
    static torch::Tensor conv_input(const ConvInput& segment, const torch::Tensor& input) {
        const torch::Tensor y = segment.fn(input);
        LINVIS_CHECK(!y.storage().is_alias_of(input.storage()),
                     "recompute_into_conv2d: fn returned its input or a view of it; it must return a new tensor");
        return conv_input_after_relu(segment, y);
    }

    // fn's output, detached, with the ReLU applied in place when the segment has one.
    static torch::Tensor conv_input_after_relu(const ConvInput& segment, const torch::Tensor& fn_output) {
        torch::NoGradGuard no_grad;
        torch::Tensor y = fn_output.detach();
        return segment.relu ? y.relu_() : y;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto segment = c10::static_intrusive_pointer_cast<ConvInput>(ctx->saved_data["segment"].toCapsule());
        const torch::Tensor saved = ctx->get_saved_variables()[0];
        const torch::Tensor input = saved.detach().requires_grad_(ctx->needs_input_grad(0));
        std::vector<torch::Tensor> buffers_after;
        for (const torch::Tensor& buffer : segment->running_buffers) buffers_after.push_back(buffer.clone());
        torch::Tensor fn_output;
        {
            torch::AutoGradMode graph(true);
            fn_output = segment->fn(input);
        }
        // The ReLU written over fn's output: fn's graph does not keep its output (a BatchNorm keeps its input), so
        // the recomputed graph's backward is the same, and the ReLU's gradient is a mask applied in place.
        const torch::Tensor conv_input = conv_input_after_relu(*segment, fn_output);
        const bool into_fn = fn_output.requires_grad();
        ConvGradients g = conv_backward(segment->conv, grads[0], conv_input,
                                        {into_fn, ctx->needs_input_grad(1), ctx->needs_input_grad(2)});
        if (into_fn) {
            if (segment->relu) relu_backward_(g.dx, conv_input);
            torch::autograd::backward({fn_output}, {g.dx});
        }
        {
            // Only now: the recomputed graph's BatchNorm nodes hold the buffers and check that they are unchanged.
            torch::NoGradGuard no_grad;
            for (size_t i = 0; i < buffers_after.size(); ++i) segment->running_buffers[i].copy_(buffers_after[i]);
        }
        torch::autograd::variable_list out(3 + segment->num_parameters + 1);  // the last: the segment capsule
        if (ctx->needs_input_grad(0)) out[0] = input.grad();
        out[1] = g.dweight;
        out[2] = g.dbias;
        return out;  // fn's parameters got theirs as leaves of the recomputed graph
    }
};

// Inputs: the ReLU's input, the conv's weight and bias (an empty tensor when it has none).
class ReluConv : public torch::autograd::Function<ReluConv> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                                 const torch::Tensor& weight, const torch::Tensor& bias, torch::nn::Conv2d conv) {
        torch::NoGradGuard no_grad;
        const torch::Tensor rectified = torch::relu(input);
        ctx->save_for_backward({rectified});
        ctx->saved_data["conv"] = c10::IValue::make_capsule(c10::make_intrusive<ConvHolder>(conv));
        return conv_forward(conv, rectified);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto conv = c10::static_intrusive_pointer_cast<ConvHolder>(ctx->saved_data["conv"].toCapsule())->conv;
        const torch::Tensor rectified = ctx->get_saved_variables()[0];
        ConvGradients g = conv_backward(conv, grads[0], rectified,
                                        {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)});
        if (g.dx.defined()) relu_backward_(g.dx, rectified);
        return {g.dx, g.dweight, g.dbias, torch::Tensor()};
    }

private:
    struct ConvHolder : torch::CustomClassHolder {
        explicit ConvHolder(torch::nn::Conv2d c) : conv(std::move(c)) {}
        torch::nn::Conv2d conv;
    };
};

}  // namespace

torch::Tensor recompute_into_linear(ProductInputFn fn, const std::vector<torch::Tensor>& inputs,
                                    const torch::Tensor& weight, const torch::Tensor& bias) {
    const bool graph = torch::GradMode::is_enabled() &&
                       (std::any_of(inputs.begin(), inputs.end(), needs_grad) || needs_grad(weight) || needs_grad(bias));
    if (!graph) return flops::linear(fn(inputs), weight, bias);
    auto segment = c10::make_intrusive<ProductInput>();
    segment->fn = std::move(fn);
    segment->num_inputs = inputs.size();
    segment->has_bias = bias.defined();
    std::vector<torch::Tensor> all = inputs;
    all.push_back(weight);
    if (bias.defined()) all.push_back(bias);
    return RecomputeIntoLinear::apply(torch::TensorList(all), segment);
}

torch::Tensor recompute_into_linear_in_bands(BandProductInputFn fn, const torch::Tensor& tokens, int64_t height,
                                             int64_t width, const std::vector<torch::Tensor>& parameters,
                                             const torch::Tensor& weight, const torch::Tensor& bias,
                                             int64_t bytes_per_row, int64_t band_bytes) {
    LINVIS_CHECK(tokens.dim() == 3 && height > 0 && width > 0 && tokens.size(1) == height * width,
                 "recompute_into_linear_in_bands: tokens: expected (B, ", height * width, ", C) for a ", height, "x",
                 width, " grid, got ", tokens.sizes());
    auto segment = c10::make_intrusive<BandedProductInput>();
    segment->fn = std::move(fn);
    segment->height = height;
    segment->width = width;
    segment->bands = row_bands(height, bytes_per_row, band_bytes);
    segment->num_parameters = parameters.size();
    segment->has_bias = bias.defined();
    std::vector<torch::Tensor> all{tokens};
    all.insert(all.end(), parameters.begin(), parameters.end());
    all.push_back(weight);
    if (bias.defined()) all.push_back(bias);
    const bool graph = torch::GradMode::is_enabled() && std::any_of(all.begin(), all.end(), needs_grad);
    if (!graph) {
        torch::NoGradGuard no_grad;
        return RecomputeIntoLinearInBands::run(*segment, all);
    }
    return RecomputeIntoLinearInBands::apply(torch::TensorList(all), segment);
}

torch::Tensor recompute_into_conv2d(BlockFn fn, bool relu, const torch::Tensor& input, const SegmentState& state,
                                    const torch::nn::Conv2d& conv) {
    const bool graph = torch::GradMode::is_enabled() &&
                       (needs_grad(input) || needs_grad(conv->weight) || needs_grad(conv->bias) ||
                        std::any_of(state.parameters.begin(), state.parameters.end(), needs_grad));
    if (!graph) {
        torch::Tensor y = fn(input);
        return conv_forward(conv, relu ? torch::relu(y) : y);
    }
    auto segment = c10::make_intrusive<ConvInput>();
    segment->fn = std::move(fn);
    segment->relu = relu;
    segment->conv = conv;
    segment->running_buffers = state.running_buffers;
    segment->num_parameters = state.parameters.size();
    std::vector<torch::Tensor> all{input, conv->weight,
                                   conv->bias.defined() ? conv->bias : torch::empty({0}, input.options())};
    all.insert(all.end(), state.parameters.begin(), state.parameters.end());
    return RecomputeIntoConv::apply(torch::TensorList(all), segment);
}

torch::Tensor relu_conv2d(const torch::Tensor& input, const torch::nn::Conv2d& conv) {
    const bool graph =
        torch::GradMode::is_enabled() && (needs_grad(input) || needs_grad(conv->weight) || needs_grad(conv->bias));
    if (!graph) return conv_forward(conv, torch::relu(input));
    return ReluConv::apply(input, conv->weight, conv->bias.defined() ? conv->bias : torch::empty({0}, input.options()),
                           conv);
}

std::vector<torch::Tensor> checkpoint(SegmentFn fn, const std::vector<torch::Tensor>& inputs) {
    return checkpoint(std::move(fn), inputs, SegmentState{});
}

SegmentState module_state(const torch::nn::Module& module) {
    SegmentState state;
    for (const torch::Tensor& p : module.parameters())
        if (p.requires_grad()) state.parameters.push_back(p);
    state.running_buffers = module.buffers();
    return state;
}

std::vector<torch::Tensor> checkpoint(SegmentFn fn, const std::vector<torch::Tensor>& inputs,
                                      const SegmentState& state) {
    const bool any_grad = std::any_of(inputs.begin(), inputs.end(), needs_grad) ||
                          std::any_of(state.parameters.begin(), state.parameters.end(), needs_grad);
    if (!torch::GradMode::is_enabled() || !any_grad) return fn(inputs);
    auto recompute = c10::make_intrusive<Recompute>();
    recompute->fn = std::move(fn);
    recompute->num_inputs = inputs.size();
    recompute->num_parameters = state.parameters.size();
    recompute->running_buffers = state.running_buffers;
    std::vector<torch::Tensor> all = inputs;
    all.insert(all.end(), state.parameters.begin(), state.parameters.end());
    return CheckpointFunction::apply(torch::TensorList(all), recompute);
}

torch::Tensor checkpoint(BlockFn fn, const torch::Tensor& x) {
    return checkpoint([fn = std::move(fn)](const std::vector<torch::Tensor>& in) { return std::vector{fn(in[0])}; },
                      std::vector<torch::Tensor>{x})[0];
}

torch::Tensor checkpoint_if(bool enabled, BlockFn fn, const torch::Tensor& x) {
    return enabled ? checkpoint(std::move(fn), x) : fn(x);
}

}  // namespace linvis::nn
