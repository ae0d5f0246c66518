// ViL layers; see linvis/nn/vil.h and spec vil_official.md section 1.
#include "linvis/nn/checkpoint.h"
#include "linvis/nn/common.h"
#include "linvis/nn/vil.h"

#include <cmath>
#include <utility>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/precision.h"
#include "linvis/ops/activation.h"
#include "linvis/ops/depthwise_conv.h"
#include "linvis/ops/linear_headwise.h"

namespace linvis::nn {
namespace {

constexpr int64_t kQkvBlock = 4;   // qkv_block_size; also the number of mLSTM heads (1.7)
constexpr int64_t kExpansion = 2;  // inner dim I = 2 D

// "small init" of the official code (1.14): N(0, sqrt(2 / (5 D))).
void small_init(const torch::Tensor& w, int64_t dim) {
    torch::NoGradGuard no_grad;
    w.normal_(0.0, std::sqrt(2.0 / (5.0 * static_cast<double>(dim))));
}

}  // namespace

torch::Tensor residual_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  double eps) {
    return nn::layer_norm(x, {weight.size(0)}, 1.0 + weight, bias, eps);
}

ResidualLayerNormImpl::ResidualLayerNormImpl(int64_t dim, double eps_) : eps(eps_) {
    weight = register_parameter("weight", torch::zeros({dim}));
    bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor ResidualLayerNormImpl::forward(const torch::Tensor& x) {
    LINVIS_CHECK(x.size(-1) == weight.size(0), "ViL LayerNorm: input: expected last dim ", weight.size(0), ", got ",
                 shape_string(x.sizes()));
    return residual_layer_norm(x, weight, bias, eps);
}

MultiHeadLayerNormImpl::MultiHeadLayerNormImpl(int64_t dim, double eps_) : eps(eps_) {
    weight = register_parameter("weight", torch::zeros({dim}));
    bias = register_parameter("bias", torch::zeros({dim}));
}

ops::MlstmOutputNorm MultiHeadLayerNormImpl::as_output_norm() const {
    return {1.0 + weight, bias, eps};
}

torch::Tensor MultiHeadLayerNormImpl::forward(const torch::Tensor& x) {
    LINVIS_CHECK(x.dim() == 4 && x.size(1) * x.size(3) == weight.size(0),
                 "MultiHeadLayerNorm: input: expected (B, NH, S, DH) with NH*DH = ", weight.size(0), ", got ",
                 shape_string(x.sizes()));
    return ops::mlstm_output_norm(x, as_output_norm());
}

LinearHeadwiseImpl::LinearHeadwiseImpl(int64_t dim, int64_t block_, ops::Impl impl_)
    : heads(dim / block_), block(block_), impl(impl_) {
    LINVIS_CHECK(dim % block_ == 0, "LinearHeadwise: dim ", dim, " is not a multiple of the block size ", block_);
    weight = register_parameter("weight", torch::empty({heads, block, block}));
    bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor LinearHeadwiseImpl::forward(const torch::Tensor& x) {
    return ops::linear_headwise(x, weight, bias, impl);
}

MatrixLstmCellImpl::MatrixLstmCellImpl(int64_t dim, int64_t num_heads_, ops::MlstmMode mode_, int64_t chunk_size_,
                                       ops::Impl impl_)
    : num_heads(num_heads_), mode(mode_), chunk_size(chunk_size_), impl(impl_) {
    igate = register_module("igate", uninitialised_linear(3 * dim, num_heads));
    fgate = register_module("fgate", uninitialised_linear(3 * dim, num_heads));
    outnorm = register_module("outnorm", MultiHeadLayerNorm(dim, 1e-5));
    torch::NoGradGuard no_grad;
    fgate->weight.zero_();
    fgate->bias.copy_(torch::linspace(3.0, 6.0, num_heads));
    igate->weight.zero_();
    igate->bias.normal_(0.0, 0.1);
}

torch::Tensor MatrixLstmCellImpl::forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    const int64_t B = q.size(0), S = q.size(1), I = q.size(2), DH = I / num_heads;
    // Both gates in one product of cat(q, k, v): (B, S, 2 NH), then (B, NH, S, 1) each. In float32 and
    // float64 the product is split by the weights' column blocks instead of concatenating q, k and v (3 I
    // wide per token); bf16 / f16 keep the single product, whose one rounding the gates' exponentials need.
    const torch::Tensor gate_weight = torch::cat({igate->weight, fgate->weight});
    const torch::Tensor gate_bias = torch::cat({igate->bias, fgate->bias});
    torch::Tensor gates;
    if (precision::is_reduced(q)) {
        gates = flops::linear(torch::cat({q, k, v}, -1), gate_weight, gate_bias);
    } else {
        gates = flops::linear(q, gate_weight.narrow(1, 0, I), gate_bias);
        gates = add_into(gates, flops::linear(k, gate_weight.narrow(1, I, I)));
        gates = add_into(gates, flops::linear(v, gate_weight.narrow(1, 2 * I, I)));
    }
    gates = gates.transpose(-1, -2).unsqueeze(-1);
    torch::Tensor ig = gates.narrow(1, 0, num_heads);
    torch::Tensor fg = gates.narrow(1, num_heads, num_heads);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, S, num_heads, DH}).transpose(1, 2); };
    // The output norm inside the op: the fused kernel applies it while writing h in inference. h is
    // token-major there, so the reshape to (B, S, I) is a view.
    const ops::MlstmOutputNorm norm = outnorm->as_output_norm();
    torch::Tensor h = ops::mlstm_normed(heads(q), heads(k), heads(v), ig, fg, norm, mode, chunk_size, ops::kMlstmEps,
                                        impl);
    return h.transpose(1, 2).reshape({B, S, I});
}

VilLayerImpl::VilLayerImpl(int64_t dim, bool reversed_, ops::MlstmMode mode, int64_t chunk_size, ops::Impl impl)
    : reversed(reversed_), inner_dim(kExpansion * dim), impl(impl) {
    const int64_t I = inner_dim;
    learnable_skip = register_parameter("learnable_skip", torch::ones({I}));
    proj_up = register_module("proj_up", uninitialised_linear(dim, 2 * I));
    q_proj = register_module("q_proj", LinearHeadwise(I, kQkvBlock, impl));
    k_proj = register_module("k_proj", LinearHeadwise(I, kQkvBlock, impl));
    v_proj = register_module("v_proj", LinearHeadwise(I, kQkvBlock, impl));
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(I, I, 3).padding(1).groups(I)));
    mlstm_cell = register_module("mlstm_cell", MatrixLstmCell(I, kQkvBlock, mode, chunk_size, impl));
    proj_down = register_module("proj_down", uninitialised_linear(I, dim));
    // Official init (1.14; init_weights="original": wang init with num_blocks = 1).
    small_init(proj_up->weight, dim);
    for (auto* p : {&q_proj, &k_proj, &v_proj}) small_init((*p)->weight, dim);
    torch::NoGradGuard no_grad;
    proj_down->weight.normal_(0.0, 2.0 / std::sqrt(static_cast<double>(dim)));
    proj_up->bias.zero_();
    proj_down->bias.zero_();
}

torch::Tensor VilLayerImpl::cell_and_skip(torch::Tensor x_mlstm, int64_t grid_h, int64_t grid_w) {
    // silu(conv(x_mlstm)) on the token grid
    torch::Tensor x_act = ops::depthwise_conv2d_tokens(x_mlstm, grid_h, grid_w, conv->weight, conv->bias,
                                                       ops::DwEpilogue::Silu, impl);
    torch::Tensor v = v_proj->forward(x_mlstm);
    x_mlstm = torch::Tensor();
    torch::Tensor h_tilde = mlstm_cell->forward(q_proj->forward(x_act), k_proj->forward(x_act), v);
    // h_tilde is fresh: outside a graph the sum goes into it.
    return can_overwrite({h_tilde, learnable_skip, x_act}) ? h_tilde.addcmul_(learnable_skip, x_act)
                                                            : h_tilde + learnable_skip * x_act;
}

torch::Tensor VilLayerImpl::forward(const NormedInput& in, int64_t grid_h, int64_t grid_w) {
    const int64_t S = in.input().size(1), I = inner_dim;
    LINVIS_CHECK(S == grid_h * grid_w, "ViLLayer: input: expected ", grid_h, "x", grid_w, " = ", grid_h * grid_w,
                 " tokens, got shape ", shape_string(in.input().sizes()));
    auto order = [&](torch::Tensor t) { return reversed ? t.flip({1}) : t; };
    const ops::NormedProduct halves[] = {{proj_up->weight.narrow(0, 0, I), proj_up->bias.narrow(0, 0, I)},
                                         {proj_up->weight.narrow(0, I, I), proj_up->bias.narrow(0, I, I)}};
    // proj_up as two products, x_mlstm now and z after the cell: the cell then runs beside the (S, D) input
    // instead of z's (S, I) half, and x_mlstm goes once v exists. Same FLOPs as the one (S, 2I) product. In a
    // graph, where z is kept anyway, both come from one NormedInput::linear (the products act per token, so
    // they are flipped after it) and the graph keeps the block's input instead of the normalised copy.
    torch::Tensor normed, x_mlstm, z;  // normed: the block's normalised input in scan order (outside a graph)
    if (in.records_graph() || !can_overwrite({proj_up->weight, proj_up->bias})) {
        std::vector<torch::Tensor> up = in.linear(std::vector<ops::NormedProduct>{halves[0], halves[1]}, elementwise_impl(impl));
        x_mlstm = order(up[0]);
        z = order(up[1]);
    } else {
        normed = order(in.value());
        x_mlstm = flops::linear(normed, halves[0].weight, halves[0].bias);
    }
    torch::Tensor skipped;
    if (recompute_scans && is_training() && !can_overwrite({x_mlstm})) {
        // The graph of a training step keeps x_mlstm only; the conv, q, k, v, the cell and the skip run again in
        // the backward. An eval-mode graph (an input gradient for an explanation) keeps everything.
        // Holds this layer by value: the backward runs the segment after this frame is gone.
        auto self = std::static_pointer_cast<VilLayerImpl>(shared_from_this());
        skipped = checkpoint(
            [self, grid_h, grid_w](const std::vector<torch::Tensor>& in) {
                return std::vector<torch::Tensor>{self->cell_and_skip(in[0], grid_h, grid_w)};
            },
            std::vector<torch::Tensor>{x_mlstm})[0];
        x_mlstm = torch::Tensor();
    } else {
        skipped = cell_and_skip(std::move(x_mlstm), grid_h, grid_w);
    }
    if (!z.defined()) z = flops::linear(normed, halves[1].weight, halves[1].bias);
    normed = torch::Tensor();
    // In a graph the gated product is not kept for backward (ops::gated_linear).
    torch::Tensor y = ops::gated_linear(std::move(z), skipped, proj_down->weight, proj_down->bias,
                                        ops::GateActivation::Silu, elementwise_impl(impl));
    skipped = torch::Tensor();
    return reversed ? y.flip({1}) : y;
}

VilBlockImpl::VilBlockImpl(int64_t dim, bool reversed, double drop_path_, ops::MlstmMode mode, int64_t chunk_size,
                           ops::Impl impl)
    : drop_path(drop_path_) {
    norm = register_module("norm", ResidualLayerNorm(dim, 1e-5));
    layer = register_module("layer", VilLayer(dim, reversed, mode, chunk_size, impl));
}

torch::Tensor VilBlockImpl::forward(const torch::Tensor& x, int64_t grid_h, int64_t grid_w) {
    // NormedInput checks x's last dim against the norm's.
    torch::Tensor branch = layer->forward(NormedInput(x, 1.0 + norm->weight, norm->bias, norm->eps), grid_h, grid_w);
    return add_into(nn::drop_path(branch, drop_path, is_training()), x);
}

VilBlockPairImpl::VilBlockPairImpl(int64_t dim, double drop_path, ops::MlstmMode mode, int64_t chunk_size,
                                   ops::Impl impl) {
    rowwise_from_top_left =
        register_module("rowwise_from_top_left", VilBlock(dim, false, drop_path, mode, chunk_size, impl));
    rowwise_from_bot_right =
        register_module("rowwise_from_bot_right", VilBlock(dim, true, drop_path, mode, chunk_size, impl));
}

torch::Tensor VilBlockPairImpl::forward(const torch::Tensor& x, int64_t grid_h, int64_t grid_w) {
    return rowwise_from_bot_right->forward(rowwise_from_top_left->forward(x, grid_h, grid_w), grid_h, grid_w);
}

torch::Tensor VilBlockPairImpl::forward_sub_block(int64_t index, const torch::Tensor& x, int64_t grid_h,
                                                  int64_t grid_w) {
    LINVIS_CHECK(index == 0 || index == 1, "vil block pair: sub-block ", index, " outside [0, 2)");
    return (index == 0 ? rowwise_from_top_left : rowwise_from_bot_right)->forward(x, grid_h, grid_w);
}


}  // namespace linvis::nn
