#include "linvis/nn/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"

namespace linvis::nn {
namespace {

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
