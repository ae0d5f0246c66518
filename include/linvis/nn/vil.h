// Layers of Vision-LSTM (ViL, VisionLSTM2 of NX-AI/vision-lstm). Parameter names equal the
// official torch.hub state_dict keys (spec vil_official.md 3.1); semantics follow spec section 1.
#pragma once

#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "linvis/nn/vit.h"
#include "linvis/ops/mlstm.h"

namespace linvis::nn {

// F.layer_norm(x, (D,), weight = 1 + weight, bias, eps): the ViL LayerNorm stores its weight as an
// offset from 1 (1.12). The 1 + w add is done first, then one fused layer_norm call.
torch::Tensor residual_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  double eps);

// The custom ViL LayerNorm (1.12): parameters weight (zeros at init, an offset) and bias, both (dim,).
class ResidualLayerNormImpl : public torch::nn::Module {
public:
    ResidualLayerNormImpl(int64_t dim, double eps);
    torch::Tensor forward(const torch::Tensor& x);
    torch::Tensor weight, bias;
    double eps;
};
TORCH_MODULE(ResidualLayerNorm);

// MultiHeadLayerNorm (1.9): (B, NH, S, DH) -> group_norm over each head's DH features of every
// token (biased variance), affine weight 1 + weight and bias of length NH * DH: ops::mlstm_output_norm
// with as_output_norm(), which the mLSTM cell hands to ops::mlstm_normed (fused in inference).
class MultiHeadLayerNormImpl : public torch::nn::Module {
public:
    MultiHeadLayerNormImpl(int64_t dim, double eps);
    torch::Tensor forward(const torch::Tensor& x);
    ops::MlstmOutputNorm as_output_norm() const;
    torch::Tensor weight, bias;
    double eps;
};
TORCH_MODULE(MultiHeadLayerNorm);

// LinearHeadwiseExpand (1.6 step 6): block-diagonal linear with blocks of `block` x `block`;
// weight (dim / block, block, block) in (head, out, in) layout, bias (dim,). ops::linear_headwise
// with the given impl (Fused: the fused CPU kernel).
class LinearHeadwiseImpl : public torch::nn::Module {
public:
    LinearHeadwiseImpl(int64_t dim, int64_t block, ops::Impl impl = ops::Impl::Auto);
    torch::Tensor forward(const torch::Tensor& x);  // (..., dim) -> (..., dim)
    torch::Tensor weight, bias;
    int64_t heads, block;
    ops::Impl impl;
};
TORCH_MODULE(LinearHeadwise);

// MatrixLSTMCell (1.7): gates from cat(q, k, v), mLSTM in the chosen form, per-head output norm.
// q, k, v (B, S, I) -> (B, S, I).
class MatrixLstmCellImpl : public torch::nn::Module {
public:
    MatrixLstmCellImpl(int64_t dim, int64_t num_heads, ops::MlstmMode mode, int64_t chunk_size,
                       ops::Impl impl = ops::Impl::Auto);
    torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
    torch::nn::Linear igate{nullptr}, fgate{nullptr};
    MultiHeadLayerNorm outnorm{nullptr};
    int64_t num_heads;
    ops::MlstmMode mode;
    int64_t chunk_size;
    ops::Impl impl;  // Fused: the fused chunkwise kernel (mode must be chunkwise)
};
TORCH_MODULE(MatrixLstmCell);

// ViLLayer (1.6): proj_up -> (x_mlstm, z); depthwise 3x3 conv on the token grid + SiLU -> q, k;
// v from the pre-conv x_mlstm; mLSTM cell; + learnable_skip * conv act; * SiLU(z); proj_down.
// A reversed layer flips the sequence before and after. x (B, S, D) with S = grid_h * grid_w, the block's
// normalised input (NormedInput: in a graph proj_up takes it through layer_norm_linear).
class VilLayerImpl : public torch::nn::Module {
public:
    VilLayerImpl(int64_t dim, bool reversed, ops::MlstmMode mode, int64_t chunk_size,
                 ops::Impl impl = ops::Impl::Auto);
    torch::Tensor forward(const NormedInput& x, int64_t grid_h, int64_t grid_w);
    torch::Tensor learnable_skip;
    torch::nn::Linear proj_up{nullptr}, proj_down{nullptr};
    LinearHeadwise q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};
    torch::nn::Conv2d conv{nullptr};
    MatrixLstmCell mlstm_cell{nullptr};
    bool reversed;
    int64_t inner_dim;
    ops::Impl impl;  // of the conv (ops::depthwise_conv2d_tokens)
    // In a training step's graph (training mode) the conv, q, k, v, the mLSTM cell and the skip run again in the
    // backward from x_mlstm, which the graph keeps instead of their intermediates (nn::checkpoint; the model
    // option recompute_scans).
    bool recompute_scans = false;

private:
    // h_tilde + learnable_skip * silu(conv(x_mlstm)), h_tilde the cell's normed output.
    torch::Tensor cell_and_skip(torch::Tensor x_mlstm, int64_t grid_h, int64_t grid_w);
};
TORCH_MODULE(VilLayer);

// ViLBlock (1.5): x + drop_path(layer(norm(x))), norm = ResidualLayerNorm(dim, 1e-5).
class VilBlockImpl : public torch::nn::Module {
public:
    VilBlockImpl(int64_t dim, bool reversed, double drop_path, ops::MlstmMode mode, int64_t chunk_size,
                 ops::Impl impl = ops::Impl::Auto);
    torch::Tensor forward(const torch::Tensor& x, int64_t grid_h, int64_t grid_w);
    ResidualLayerNorm norm{nullptr};
    VilLayer layer{nullptr};
    double drop_path;
};
TORCH_MODULE(VilBlock);

// ViLBlockPair (1.4): rowwise_from_top_left then rowwise_from_bot_right.
// Two sub-blocks for forward_intermediates (index 2i: after the first, 2i + 1: after both).
class VilBlockPairImpl : public VitBlock {
public:
    VilBlockPairImpl(int64_t dim, double drop_path, ops::MlstmMode mode, int64_t chunk_size,
                     ops::Impl impl = ops::Impl::Auto);
    torch::Tensor forward(const torch::Tensor& x, int64_t grid_h, int64_t grid_w) override;
    int64_t num_sub_blocks() const override { return 2; }
    torch::Tensor forward_sub_block(int64_t index, const torch::Tensor& x, int64_t grid_h, int64_t grid_w) override;
    VilBlock rowwise_from_top_left{nullptr}, rowwise_from_bot_right{nullptr};
};
TORCH_MODULE(VilBlockPair);

}  // namespace linvis::nn
