// Activation checkpointing (timm's set_grad_checkpointing, torch.utils.checkpoint in its reentrant form):
// a block runs without keeping its intermediate tensors for the backward pass, which runs the block
// again from its saved input. A training step then holds one block's intermediates at a time instead of
// every block's, for about one more forward pass of compute: the memory a 1024-px or 2048-px training
// step needs (docs/performance.md). The same mechanism recomputes a segment of a block with several inputs
// and outputs (selective recomputation): the segment's inputs are kept, its intermediates are not.
#pragma once

#include <functional>
#include <vector>

#include <torch/torch.h>

namespace linvis::nn {

using BlockFn = std::function<torch::Tensor(const torch::Tensor&)>;
using SegmentFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

// fn(inputs), computed so that its backward recomputes fn from the inputs. The parameters fn uses receive
// their gradients during that recomputation (accumulated into their .grad as leaves), the inputs theirs
// through the returned tensors. The CPU random generator is restored for the recomputation, so random ops in
// fn (drop path) draw the same values twice. Plain fn(inputs) when no graph is being recorded or no input
// requires grad (the checkpoint could then not route gradients to fn's parameters). fn runs without a graph
// the first time, so it must not write into its inputs (they are the recomputation's), nor change module state
// that its second run would change again (BatchNorm running statistics do). Not twice differentiable, and the
// parameters' gradients go into their .grad even when the caller asked torch::autograd::grad for others only.
std::vector<torch::Tensor> checkpoint(SegmentFn fn, const std::vector<torch::Tensor>& inputs);

// What a segment owns besides its inputs, for checkpointing a segment whose input needs no gradient (a model's
// stem on the images) or that holds BatchNorm layers (its running statistics would be updated twice).
struct SegmentState {
    std::vector<torch::Tensor> parameters;       // those that require grad: the segment is recomputed for them
    std::vector<torch::Tensor> running_buffers;  // updated in place by fn: restored after the recomputation
};
// A module's parameters that require grad and all its buffers (a conv stack's BatchNorm statistics).
SegmentState module_state(const torch::nn::Module& module);

// checkpoint(fn, inputs) that also recomputes fn when only `state.parameters` require grad, and leaves
// `state.running_buffers` as fn's first run left them (one update per training step, as without checkpointing).
std::vector<torch::Tensor> checkpoint(SegmentFn fn, const std::vector<torch::Tensor>& inputs,
                                      const SegmentState& state);

// flops::linear(fn(inputs), weight, bias), keeping only the inputs (and the product's weight): for a cheap segment
// in front of a product (activations, a depthwise conv) whose output is wide. The backward recomputes fn(inputs)
// with a graph, takes the product's gradients from it as the product's own backward would (flops::linear_backward:
// the product is not recomputed) and fn's inputs' through the recomputed graph. fn must be deterministic and must
// not write into its inputs; inputs may be parameters (a conv's weight): their gradients come back through this
// node as any input's. Plain linear(fn(inputs)) when no graph is recorded. Not twice differentiable.
using ProductInputFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;
torch::Tensor recompute_into_linear(ProductInputFn fn, const std::vector<torch::Tensor>& inputs,
                                    const torch::Tensor& weight, const torch::Tensor& bias);

// recompute_into_linear for a segment that acts on a grid of tokens and reads one neighbouring row above and below
// (a 3x3 depthwise conv between activations: H-ViT3's conv MLP): forward and backward run a band of grid rows at a
// time (row_bands over `height`, `bytes_per_row` of fn's maps per grid row, at most `band_bytes` a band), so fn's
// maps, the product's input and that input's gradient never exist whole. fn(rows, band_height, parameters) maps
// tokens (B, band_height * width, C) to the product's input on the same rows; its outer rows (no neighbours there)
// are not used. The graph keeps `tokens`, the parameters, the weight and the bias; the backward recomputes fn band
// by band with a graph, takes the product's gradients as its own backward would (flops::linear_backward, the product
// not recomputed) and sums each band's gradients into those of tokens (halo rows included) and of the parameters.
// With one band, the same values as recompute_into_linear. FLOPs: fn's work counted once over the whole grid.
// Without a graph to record, the same bands and no node. Not twice differentiable.
using BandProductInputFn = std::function<torch::Tensor(const torch::Tensor& rows, int64_t band_height,
                                                       const std::vector<torch::Tensor>& parameters)>;
torch::Tensor recompute_into_linear_in_bands(BandProductInputFn fn, const torch::Tensor& tokens, int64_t height,
                                             int64_t width, const std::vector<torch::Tensor>& parameters,
                                             const torch::Tensor& weight, const torch::Tensor& bias,
                                             int64_t bytes_per_row, int64_t band_bytes);

// conv_forward(conv, fn(input)), or with `relu` conv_forward(conv, relu(fn(input))), for a cheap per-element segment
// between two convolutions (a BatchNorm in training, then a ReLU): the graph keeps fn's input and the conv's weight,
// not the conv's input, one map instead of two. The backward recomputes fn with a graph, applies the ReLU in place
// outside it, takes the conv's gradients as its own backward would (nn::conv_backward on the recomputed input: the
// conv is not recomputed), masks the input's gradient in place for the ReLU and takes fn's input's through the
// recomputed graph. `state.parameters` (those fn uses) get their gradients as leaves of that graph (into .grad, as
// checkpoint's), and `state.running_buffers` that fn updates are left as its first run left them. Plain
// conv_forward(conv, [relu](fn(input))) when no graph is recorded. fn must be deterministic and return a new tensor
// (not its input or a view of it). Not twice differentiable.
torch::Tensor recompute_into_conv2d(BlockFn fn, bool relu, const torch::Tensor& input, const SegmentState& state,
                                    const torch::nn::Conv2d& conv);

// conv_forward(conv, relu(input)) as one graph node that keeps relu(input), the conv's own input, and not also the
// ReLU's: its backward masks the conv's input gradient in place (where relu(input) is 0) instead of writing the ReLU's
// gradient into a third map. The same values and gradients as the two ops. Plain ops when no graph is recorded.
torch::Tensor relu_conv2d(const torch::Tensor& input, const torch::nn::Conv2d& conv);

// The one-input, one-output form: a block of a model.
torch::Tensor checkpoint(BlockFn fn, const torch::Tensor& x);

// checkpoint(fn, x) when `enabled` (a model's grad_checkpointing option), else fn(x). fn is kept until the
// backward pass, so it must hold what it uses by value (the block's module handle, the grid size).
torch::Tensor checkpoint_if(bool enabled, BlockFn fn, const torch::Tensor& x);

}  // namespace linvis::nn
