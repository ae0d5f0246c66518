#include "linvis/nn/vittt_block.h"

#include <ATen/Parallel.h>

#include "linvis/nn/checkpoint.h"
#include "linvis/nn/common.h"
#include "linvis/nn/probe.h"

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/activation.h"
#include "linvis/ops/depthwise_conv.h"
#include "linvis/ops/ttt_linear.h"

namespace linvis::nn {
namespace {

namespace F = torch::nn::functional;

// Linear weights N(0, 0.02), bias 0 (spec/vittt.md "Initialisation").
void init_linear(torch::nn::Linear& linear) {
    torch::NoGradGuard no_grad;
    linear->weight.normal_(0.0, 0.02);
    if (linear->bias.defined()) linear->bias.zero_();
}

torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x) {
    return flops::linear(x, l->weight, l->bias);
}

}  // namespace

// ------------------------------------------------------------------ TttLinearBranch
TttLinearBranchImpl::TttLinearBranchImpl(const TttBranchOptions& options) : options_(options) {
    const int64_t D = options.dim, nh = options.num_heads;
    LINVIS_CHECK(D > 0 && nh > 0 && D % nh == 0, "vittt: embed_dim ", D, " must be a positive multiple of num_heads ",
                 nh);
    LINVIS_CHECK(options.mini_batch_size >= 1, "vittt: mini_batch_size must be >= 1, got ", options.mini_batch_size);
    const int64_t d = D / nh;
    learnable_token_idx = register_parameter("learnable_token_idx", torch::zeros({options.mini_batch_size}));
    learnable_ttt_lr_weight = register_parameter("learnable_ttt_lr_weight", torch::zeros({nh, 1, D}));
    learnable_ttt_lr_bias = register_parameter("learnable_ttt_lr_bias", torch::zeros({nh, 1}));
    ttt_norm_weight = register_parameter("ttt_norm_weight", torch::ones({nh, d}));
    ttt_norm_bias = register_parameter("ttt_norm_bias", torch::zeros({nh, d}));
    W1 = register_parameter("W1", torch::zeros({nh, d, d}), options.learnable_w0);
    b1 = register_parameter("b1", torch::zeros({nh, 1, d}), options.learnable_w0);
    q_proj = register_module("q_proj", uninitialised_linear(D, D, false));
    v_proj = register_module("v_proj", uninitialised_linear(D, D, false));
    auto conv = torch::nn::Conv1dOptions(D, D, options.conv_kernel).groups(D).bias(true);
    conv_q = register_module("conv_q", torch::nn::Conv1d(conv));
    conv_k = register_module("conv_k", torch::nn::Conv1d(conv));
    post_norm = register_module("post_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(1e-6)));
    reset_parameters();
}

void TttLinearBranchImpl::reset_parameters() {
    torch::NoGradGuard no_grad;
    learnable_token_idx.zero_();
    learnable_ttt_lr_weight.normal_(0.0, 0.02);
    learnable_ttt_lr_bias.zero_();
    ttt_norm_weight.fill_(1.0);
    ttt_norm_bias.zero_();
    W1.normal_(0.0, 0.02);
    b1.zero_();
    init_linear(q_proj);
    init_linear(v_proj);
    conv_q->reset_parameters();  // PyTorch default init
    conv_k->reset_parameters();
    post_norm->reset_parameters();
}

std::vector<ops::NormedProduct> TttLinearBranchImpl::products() const {
    const int64_t nh = options_.num_heads;
    return {{q_proj->weight, q_proj->bias},
            {v_proj->weight, v_proj->bias},
            {learnable_ttt_lr_weight.squeeze(1), learnable_ttt_lr_bias.view({nh}), /*counted=*/false}};
}

ops::TttLinearInputs TttLinearBranchImpl::scan_inputs(const torch::Tensor& x, bool reversed) {
    LINVIS_CHECK(x.dim() == 3 && x.size(2) == options_.dim, "vittt TTT branch: input: expected (B, T, ",
                 options_.dim, "), got ", shape_string(x.sizes()));
    const std::vector<ops::NormedProduct> lr_gate{products()[2]};
    const torch::Tensor lr_logits = NormedInput(x).linear(lr_gate, ops::Impl::Auto)[0];
    return assemble(linear(q_proj, x), linear(v_proj, x), lr_logits, reversed);
}

ops::TttLinearInputs TttLinearBranchImpl::scan_inputs(const std::vector<torch::Tensor>& products, bool reversed) {
    LINVIS_CHECK(products.size() == 3, "vittt TTT branch: expected the 3 products of products(), got ",
                 products.size());
    return assemble(products[0], products[1], products[2], reversed);
}

ops::TttLinearInputs TttLinearBranchImpl::assemble(torch::Tensor u, torch::Tensor v, const torch::Tensor& lr_logits,
                                                   bool reversed) {
    const int64_t B = u.size(0), T = u.size(1), nh = options_.num_heads, d = options_.dim / nh;
    // The products act on each token alone, so flipping their results equals computing them on flip(x).
    auto order = [&](torch::Tensor t, int64_t token_dim) { return reversed ? torch::flip(t, {token_dim}) : t; };
    ops::TttLinearInputs in;
    in.xv = order(std::move(v), 1).reshape({B, T, nh, d}).permute({0, 2, 1, 3});
    in.lr = order(ops::ttt_learning_rate_of_logits(lr_logits, options_.eta_base, d), 2);
    in.learnable_token_idx = learnable_token_idx;
    in.w0 = W1;
    in.b0 = b1;
    in.ln_weight = ttt_norm_weight;
    in.ln_bias = ttt_norm_bias;
    // XQ, XK = conv_q(u), conv_k(u) as the reference: pad k-1 on both sides, keep the first T outputs.
    in.qk_conv = {order(std::move(u), 1), conv_q->weight, conv_q->bias, conv_k->weight, conv_k->bias};
    return in;
}

ops::TttLinearOptions TttLinearBranchImpl::scan_options(bool grad_norms) const {
    ops::TttLinearOptions opt;
    opt.mini_batch_size = options_.mini_batch_size;
    opt.return_grad_norms = grad_norms;
    return opt;
}

torch::Tensor TttLinearBranchImpl::output(const ops::TttLinearResult& scanned) {
    const torch::Tensor& out = scanned.output;  // (B, nh, T, d)
    return nn::layer_norm(post_norm, out.permute({0, 2, 1, 3}).reshape({out.size(0), out.size(2), options_.dim}));
}

torch::Tensor TttLinearBranchImpl::forward(const torch::Tensor& x, torch::Tensor* grad_norms) {
    ops::TttLinearInputs in = scan_inputs(x);
    ops::TttLinearResult r = ops::ttt_linear_many({in}, scan_options(grad_norms != nullptr), options_.impl)[0];
    if (grad_norms != nullptr) *grad_norms = r.grad_norms;
    return output(r);
}

// ------------------------------------------------------------------ SwiGluMlp
SwiGluMlpImpl::SwiGluMlpImpl(int64_t dim, int64_t hidden, ops::Impl impl) : impl_(elementwise_impl(impl)) {
    gate_proj = register_module("gate_proj", uninitialised_linear(dim, hidden, false));
    up_proj = register_module("up_proj", uninitialised_linear(dim, hidden, false));
    down_proj = register_module("down_proj", uninitialised_linear(hidden, dim, false));
    init_linear(gate_proj);
    init_linear(up_proj);
    init_linear(down_proj);
}

torch::Tensor SwiGluMlpImpl::forward(const NormedInput& x) {
    // silu(gate) * up written into gate outside a graph: one hidden-size temporary fewer; in a graph the product
    // is not kept for backward (ops::gated_linear), nor the normalised input (NormedInput::linear).
    const std::vector<ops::NormedProduct> products{{gate_proj->weight, gate_proj->bias},
                                                   {up_proj->weight, up_proj->bias}};
    std::vector<torch::Tensor> p = x.linear(products, impl_);
    return ops::gated_linear(std::move(p[0]), p[1], down_proj->weight, {}, ops::GateActivation::Silu, impl_);
}

torch::Tensor SwiGluMlpImpl::add_to(const torch::Tensor& residual, const NormedInput& x) {
    if (!can_overwrite({residual, gate_proj->weight, up_proj->weight, down_proj->weight}))
        return residual.add_(forward(x));
    std::vector<torch::Tensor> p = x.linear({{gate_proj->weight, gate_proj->bias}, {up_proj->weight, up_proj->bias}},
                                            impl_);
    return flops::linear_add_(residual, ops::silu_mul_(std::move(p[0]), p[1], impl_), down_proj->weight);
}

// ------------------------------------------------------------------ VitttBlock
namespace {

// forth = (forth + back_reversed with its tokens put back in order) * gate, in one pass: the values of
// forth.add_(flip(back_reversed)).mul_(gate), the same float operations in the same order. For contiguous
// CPU float32 (B, T, C) tensors of one shape, forth sharing memory with neither; false (nothing written)
// otherwise.
bool merge_directions_into(const torch::Tensor& forth, const torch::Tensor& back_reversed, const torch::Tensor& gate) {
    for (const torch::Tensor* t : {&forth, &back_reversed, &gate})
        if (!t->device().is_cpu() || t->scalar_type() != torch::kFloat32 || !t->is_contiguous() ||
            t->sizes() != forth.sizes())
            return false;
    if (forth.dim() != 3 || forth.storage().is_alias_of(back_reversed.storage()) ||
        forth.storage().is_alias_of(gate.storage()))
        return false;
    const int64_t T = forth.size(1), C = forth.size(2);
    float* f = forth.data_ptr<float>();
    const float* b = back_reversed.data_ptr<float>();
    const float* g = gate.data_ptr<float>();
    at::parallel_for(0, forth.size(0) * T, 64, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {
            const int64_t sample = row / T, token = row % T;
            float* fr = f + row * C;
            const float* br = b + (sample * T + (T - 1 - token)) * C;
            const float* gr = g + row * C;
            for (int64_t c = 0; c < C; ++c) fr[c] = (fr[c] + br[c]) * gr[c];
        }
    });
    return true;
}

}  // namespace

VitttBlockImpl::VitttBlockImpl(const VitttBlockOptions& options) : options_(options) {
    const int64_t D = options.branch.dim;
    dwconv = register_module("dwconv", torch::nn::Conv2d(torch::nn::Conv2dOptions(D, D, 3).padding(1).groups(D)));
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(options.norm_eps)));
    g_proj = register_module("g_proj", uninitialised_linear(D, D, false));
    if (options.shared_directions) {
        ttt = register_module("ttt", TttLinearBranch(options.branch));
    } else {
        forth = register_module("forth", TttLinearBranch(options.branch));
        back = register_module("back", TttLinearBranch(options.branch));
    }
    o_proj = register_module("o_proj", uninitialised_linear(D, D, false));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(options.norm_eps)));
    mlp = register_module("mlp", SwiGluMlp(D, options.mlp_hidden, options.branch.impl));
    init_linear(g_proj);
    init_linear(o_proj);
}

void VitttBlockImpl::reset_parameters() {
    dwconv->reset_parameters();
    norm1->reset_parameters();
    init_linear(g_proj);
    if (options_.shared_directions) {
        ttt->reset_parameters();
    } else {
        forth->reset_parameters();
        back->reset_parameters();
    }
    init_linear(o_proj);
    norm2->reset_parameters();
    init_linear(mlp->gate_proj);
    init_linear(mlp->up_proj);
    init_linear(mlp->down_proj);
}

torch::Tensor VitttBlockImpl::drop_path(const torch::Tensor& x) const {
    return nn::drop_path(x, options_.drop_path, is_training());
}

namespace {

// Both directions' scans in one call (their heads share the cores, ops::ttt_linear_many): forth's post-normed
// output, and back's left in scan order (tokens reversed), for a merge that reads it so.
std::pair<torch::Tensor, torch::Tensor> scan_both(TttLinearBranchImpl& forth, TttLinearBranchImpl& back,
                                                  std::vector<ops::TttLinearInputs> inputs, torch::Tensor* norms_forth,
                                                  torch::Tensor* norms_back) {
    std::vector<ops::TttLinearResult> scanned = ops::ttt_linear_many(
        inputs, forth.scan_options(norms_forth != nullptr || norms_back != nullptr), forth.options().impl);
    inputs.clear();
    if (norms_forth != nullptr) *norms_forth = scanned[0].grad_norms;
    if (norms_back != nullptr) *norms_back = torch::flip(scanned[1].grad_norms, {2});
    torch::Tensor z_forth = forth.output(scanned[0]);
    scanned[0] = {};
    return {z_forth, back.output(scanned[1])};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> VitttBlockImpl::mixer_branches(torch::Tensor x,
                                                                       torch::Tensor* norms_forth,
                                                                       torch::Tensor* norms_back) {
    auto [z_forth, z_back_reversed] =
        scan_both(*forth_branch(), *back_branch(), direction_inputs(std::move(x)), norms_forth, norms_back);
    return {z_forth, torch::flip(z_back_reversed, {1})};
}

std::vector<ops::TttLinearInputs> VitttBlockImpl::direction_inputs(torch::Tensor x) {
    // x dies here: the scans need only their inputs (autograd keeps what backward needs).
    ops::TttLinearInputs of_forth = forth_branch()->scan_inputs(x);
    // The products act on each token alone, so on the reversed tokens they give back's inputs in scan order:
    // one flipped copy of x instead of one of u, of v and of the learning rates.
    torch::Tensor reversed = torch::flip(x, {1});
    x = torch::Tensor();
    return {std::move(of_forth), back_branch()->scan_inputs(reversed)};
}

torch::Tensor VitttBlockImpl::forward(const torch::Tensor& y_in, int64_t h, int64_t w) {
    const int64_t D = options_.branch.dim;
    LINVIS_CHECK(y_in.dim() == 3 && y_in.size(1) == h * w && y_in.size(2) == D, "vittt block: input: expected (B, ",
                 h * w, ", ", D, ") for a ", h, "x", w, " grid, got ", shape_string(y_in.sizes()));
    // Conv2d "dataset preprocessing" on the token grid (row-major tokens): y = y_in + dwconv(y_in).
    torch::Tensor y = ops::depthwise_conv2d_tokens(y_in, h, w, dwconv->weight, dwconv->bias, ops::DwEpilogue::Residual,
                                                   options_.branch.impl);

    if (can_overwrite({y, o_proj->weight, mlp->down_proj->weight}) &&
        !drop_path_active(options_.drop_path, is_training())) {
        // Inference: y is this block's own tensor (the conv's output), so each branch's last product accumulates
        // onto it in the GEMM instead of a fresh product and an add.
        mixer(y, /*residual=*/y);
        return mlp->add_to(y, NormedInput(norm2, y));
    }
    y = add_into(drop_path(mixer(y)), y);
    y = add_into(drop_path(mlp->forward(NormedInput(norm2, y))), y);
    return y;
}

torch::Tensor VitttBlockImpl::mixer(const torch::Tensor& y, const torch::Tensor& residual) {
    // The mixer's temporaries (x, gate, both directions) live in this frame only: none is alive in the MLP.
    const ops::Impl impl = elementwise_impl(options_.branch.impl);
    nn::Probe* probe_forth = probing("ttt.grad_norms.forth");
    nn::Probe* probe_back = probing("ttt.grad_norms.back");
    torch::Tensor norms_forth, norms_back;
    torch::Tensor* want_forth = probe_forth ? &norms_forth : nullptr;
    torch::Tensor* want_back = probe_back ? &norms_back : nullptr;
    // In a graph the gate stays a pre-activation: ops::gated_linear recomputes its GELU and the gated product in
    // the backward instead of the graph keeping both (two (B, T, D) tensors per block). Every product of norm1's
    // output is one NormedInput::linear, so the graph keeps y and not the normalised copy either.
    const bool graph = !can_overwrite({y, g_proj->weight, o_proj->weight});
    LINVIS_CHECK(!graph || !residual.defined(), "vittt block: mixer onto a residual is for inference only");
    torch::Tensor gate, z_forth, z_back_reversed;
    if (graph) {
        std::vector<ops::NormedProduct> products{{g_proj->weight, g_proj->bias}};
        for (const ops::NormedProduct& p : forth_branch()->products()) products.push_back(p);
        // One branch for both directions (v1): its products serve both.
        if (!options_.shared_directions)
            for (const ops::NormedProduct& p : back_branch()->products()) products.push_back(p);
        std::vector<torch::Tensor> out = NormedInput(norm1, y).linear(products, impl);
        gate = out[0];
        const std::vector<torch::Tensor> of_scans(out.begin() + 1, out.end());
        out.clear();
        // From the products (u, v, lr logits of each direction) to both post-normed outputs. Holds the branches
        // by value: a recomputing backward runs it after this frame is gone.
        const auto scans = [forth_ = forth_branch().ptr(), back_ = back_branch().ptr(),
                            shared = options_.shared_directions](torch::Tensor* norms_f,
                                                                 torch::Tensor* norms_b) -> SegmentFn {
            return [=](const std::vector<torch::Tensor>& p) {
                const std::vector<torch::Tensor> of_forth(p.begin(), p.begin() + 3);
                const std::vector<torch::Tensor> of_back =
                    shared ? of_forth : std::vector<torch::Tensor>(p.begin() + 3, p.end());
                auto [z_f, z_b] = scan_both(*forth_, *back_,
                                            {forth_->scan_inputs(of_forth), back_->scan_inputs(of_back, true)},
                                            norms_f, norms_b);
                return std::vector<torch::Tensor>{z_f, z_b};
            };
        };
        // Recomputed in the backward of a training step (not under a probe, which reads the norms of this run):
        // the graph keeps the six products instead of each direction's flipped u, XQ, XK, XV, state checkpoints
        // and scan output. An eval-mode graph (an input gradient for an explanation) keeps everything.
        const bool recompute =
            options_.recompute_scans && is_training() && probe_forth == nullptr && probe_back == nullptr;
        const std::vector<torch::Tensor> z =
            recompute ? checkpoint(scans(nullptr, nullptr), of_scans) : scans(want_forth, want_back)(of_scans);
        z_forth = z[0];
        z_back_reversed = z[1];
    } else {
        torch::Tensor x = nn::layer_norm(norm1, y);
        gate = nn::linear_gelu(x, g_proj->weight, g_proj->bias, ops::GeluForm::Tanh, impl);
        std::tie(z_forth, z_back_reversed) =
            scan_both(*forth_branch(), *back_branch(), direction_inputs(std::move(x)), want_forth, want_back);
    }
    if (probe_forth) probe_forth->record("ttt.grad_norms.forth", norms_forth);
    if (probe_back) probe_back->record("ttt.grad_norms.back", norms_back);
    if (graph)
        return ops::gated_linear(gate, z_forth + torch::flip(z_back_reversed, {1}), o_proj->weight, o_proj->bias,
                                 ops::GateActivation::GeluTanh, impl);
    // z_forth and z_back_reversed are fresh post_norm outputs: in inference the sum and the gate go into z_forth
    // in one pass that reads back's tokens in reverse, instead of a flipped copy, an add and a multiply.
    torch::Tensor gated;
    if (!can_overwrite({z_forth, z_back_reversed, gate}))
        gated = gate * (z_forth + torch::flip(z_back_reversed, {1}));
    else if (merge_directions_into(z_forth, z_back_reversed, gate))
        gated = z_forth;
    else
        gated = z_forth.add_(torch::flip(z_back_reversed, {1})).mul_(gate);
    if (residual.defined()) return flops::linear_add_(residual, gated, o_proj->weight);
    return linear(o_proj, gated);
}

// ------------------------------------------------------------------ position embedding
}  // namespace linvis::nn
