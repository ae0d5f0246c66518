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

// The one-input, one-output form: a block of a model.
torch::Tensor checkpoint(BlockFn fn, const torch::Tensor& x);

// checkpoint(fn, x) when `enabled` (a model's grad_checkpointing option), else fn(x). fn is kept until the
// backward pass, so it must hold what it uses by value (the block's module handle, the grid size).
torch::Tensor checkpoint_if(bool enabled, BlockFn fn, const torch::Tensor& x);

}  // namespace linvis::nn
