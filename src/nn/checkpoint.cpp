#include "linvis/nn/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "linvis/core/error.h"

namespace linvis::nn {
namespace {

// What the backward needs besides the inputs: the segment and the generator state its forward started from.
struct Recompute : torch::CustomClassHolder {
    SegmentFn fn;
    torch::Tensor rng_state;
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
        ctx->save_for_backward(inputs.vec());
        ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
        torch::NoGradGuard no_grad;
        return recompute->fn(inputs.vec());
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
        std::vector<torch::Tensor> inputs;
        for (const torch::Tensor& saved : ctx->get_saved_variables())
            inputs.push_back(saved.detach().requires_grad_(saved.requires_grad()));
        const torch::Tensor rng_after = cpu_rng_state();
        set_cpu_rng_state(recompute->rng_state);
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
        torch::autograd::variable_list input_grads;
        for (const torch::Tensor& input : inputs)
            input_grads.push_back(input.requires_grad() ? input.grad() : torch::Tensor());
        input_grads.emplace_back();  // the recompute capsule
        return input_grads;
    }
};

}  // namespace

std::vector<torch::Tensor> checkpoint(SegmentFn fn, const std::vector<torch::Tensor>& inputs) {
    const bool any_grad = std::any_of(inputs.begin(), inputs.end(),
                                      [](const torch::Tensor& t) { return t.defined() && t.requires_grad(); });
    if (!torch::GradMode::is_enabled() || !any_grad) return fn(inputs);
    auto recompute = c10::make_intrusive<Recompute>();
    recompute->fn = std::move(fn);
    return CheckpointFunction::apply(torch::TensorList(inputs), recompute);
}

torch::Tensor checkpoint(BlockFn fn, const torch::Tensor& x) {
    return checkpoint([fn = std::move(fn)](const std::vector<torch::Tensor>& in) { return std::vector{fn(in[0])}; },
                      std::vector<torch::Tensor>{x})[0];
}

torch::Tensor checkpoint_if(bool enabled, BlockFn fn, const torch::Tensor& x) {
    return enabled ? checkpoint(std::move(fn), x) : fn(x);
}

}  // namespace linvis::nn
