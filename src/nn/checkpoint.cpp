#include "linvis/nn/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <utility>

#include "linvis/core/error.h"

namespace linvis::nn {
namespace {

// What the backward needs besides x: the block and the generator state its forward started from.
struct Recompute : torch::CustomClassHolder {
    BlockFn fn;
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
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                 c10::intrusive_ptr<Recompute> recompute) {
        recompute->rng_state = cpu_rng_state();
        ctx->save_for_backward({x});
        ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
        torch::NoGradGuard no_grad;
        return recompute->fn(x);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const torch::Tensor x = ctx->get_saved_variables()[0];
        auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
        const torch::Tensor rng_after = cpu_rng_state();
        set_cpu_rng_state(recompute->rng_state);
        torch::Tensor input = x.detach().requires_grad_(true);
        torch::Tensor output;
        {
            torch::AutoGradMode grad(true);
            output = recompute->fn(input);
        }
        set_cpu_rng_state(rng_after);
        LINVIS_CHECK(output.requires_grad(), "checkpoint: the recomputed block does not depend on its input");
        torch::autograd::backward({output}, {grads[0]});
        return {input.grad(), torch::Tensor()};
    }
};

}  // namespace

torch::Tensor checkpoint(BlockFn fn, const torch::Tensor& x) {
    if (!torch::GradMode::is_enabled() || !x.requires_grad()) return fn(x);
    auto recompute = c10::make_intrusive<Recompute>();
    recompute->fn = std::move(fn);
    return CheckpointFunction::apply(x, recompute);
}

torch::Tensor checkpoint_if(bool enabled, BlockFn fn, const torch::Tensor& x) {
    return enabled ? checkpoint(std::move(fn), x) : fn(x);
}

}  // namespace linvis::nn
