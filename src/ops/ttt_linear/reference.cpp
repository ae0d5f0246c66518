// Reference TTT-Linear (spec/ttt_linear_reference.md 2.4-2.7, 4). The op sequence of each
// step follows the TTT authors' PyTorch code so that the same inputs give the same numbers.
#include "linvis/ops/ttt_linear.h"

#include <vector>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/ttt_linear/reference.h"

namespace linvis::ops {
namespace {

const int64_t kLastDim[] = {-1};

struct InnerState {
    torch::Tensor W;  // (B, nh, d, d)
    torch::Tensor b;  // (B, nh, 1, d); undefined for the linear inner model
};

struct MiniBatchOut {
    torch::Tensor output;      // (B, nh, M, d)
    torch::Tensor grad_norms;  // (B, nh, M) if requested
};

// gamma/beta (nh, d) -> (nh, 1, d) so that they broadcast over (B, nh, M, d).
torch::Tensor per_head(const torch::Tensor& p) { return p.unsqueeze(-2); }

// One mini-batch of M tokens starting from `state`; updates `state` to the state after it.
MiniBatchOut mini_batch_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& lr, const torch::Tensor& tau, InnerState& state,
                             const torch::Tensor& gamma, const torch::Tensor& beta, const TttLinearOptions& opt) {
    const int64_t M = q.size(2);
    const bool ln_model = opt.inner_model == TttInnerModel::ResidualLayerNorm;
    const torch::Tensor& W = state.W;
    const torch::Tensor& b = state.b;

    // Gradients of every token's loss, all at the mini-batch's starting state.
    torch::Tensor z1 = torch::matmul(k, W);
    torch::Tensor grad;  // d loss_j / d z_j, (B, nh, M, d)
    if (ln_model) {
        z1 = z1 + b;
        grad = ttt_layer_norm_l2_grad(z1, v - k, gamma, beta, opt.eps);
    } else {
        grad = 2 * (z1 - v);
    }

    // eta_ij = tau_i * lr_j; row M-1 gives the state carried to the next mini-batch.
    torch::Tensor eta = tau.view({1, 1, M, 1}) * lr.unsqueeze(-2);  // (B, nh, M, M)
    torch::Tensor z_bar;
    torch::Tensor next_W;
    torch::Tensor next_b;

    if (opt.dual_form) {
        torch::Tensor last_eta = eta.select(-2, M - 1).unsqueeze(-1);  // (B, nh, M, 1)
        next_W = W - torch::matmul((last_eta * k).transpose(-1, -2), grad);
        if (ln_model) next_b = b - torch::sum(last_eta * grad, {-2}, true);
        if (opt.causal) {
            torch::Tensor attn = torch::tril(torch::matmul(q, k.transpose(-1, -2)));
            if (ln_model) {
                torch::Tensor b_bar = b - torch::matmul(torch::tril(eta), grad);
                z_bar = torch::matmul(q, W) - torch::matmul(eta * attn, grad) + b_bar;
            } else {
                z_bar = torch::matmul(q, W) - torch::matmul(eta * attn, grad);
            }
        } else {
            // Every row uses the last row of eta: token i reads the fully updated state.
            torch::Tensor eta_all = last_eta.transpose(-1, -2).expand({-1, -1, M, M});
            torch::Tensor attn = torch::matmul(q, k.transpose(-1, -2));
            z_bar = torch::matmul(q, W) - torch::matmul(eta_all * attn, grad);
            if (ln_model) z_bar = z_bar + (b - torch::matmul(eta_all, grad));
        }
    } else {
        // Primal form: accumulate lr_j k_j^T g_j token by token and materialise every W_i.
        torch::Tensor grad_W = torch::zeros_like(W);
        torch::Tensor grad_b;
        if (ln_model) grad_b = torch::zeros_like(b);
        std::vector<torch::Tensor> W_rows(M);
        std::vector<torch::Tensor> b_rows(M);
        for (int64_t i = 0; i < M; ++i) {
            torch::Tensor lr_i = lr.narrow(2, i, 1).unsqueeze(-1);      // (B, nh, 1, 1)
            torch::Tensor k_i = k.narrow(2, i, 1);                       // (B, nh, 1, d)
            torch::Tensor g_i = grad.narrow(2, i, 1);                    // (B, nh, 1, d)
            grad_W = grad_W + lr_i * (k_i.transpose(-1, -2) * g_i);      // outer product
            if (ln_model) grad_b = grad_b + lr_i * g_i;
            W_rows[i] = W - tau[i] * grad_W;
            if (ln_model) b_rows[i] = b - tau[i] * grad_b;
        }
        next_W = W_rows[M - 1];
        if (ln_model) next_b = b_rows[M - 1];
        std::vector<torch::Tensor> z_rows(M);
        for (int64_t i = 0; i < M; ++i) {
            const int64_t src = opt.causal ? i : M - 1;
            torch::Tensor z = torch::matmul(q.narrow(2, i, 1), W_rows[src]);
            z_rows[i] = ln_model ? z + b_rows[src] : z;
        }
        z_bar = torch::cat(z_rows, 2);
    }

    if (flops::counting()) {
        const int64_t heads = q.size(0) * q.size(1);
        const int64_t d = q.size(3);
        // k W, q W and the W update; plus, causal only, q k^T and (eta * A) g (Appendix B.2).
        int64_t macs = 3 * M * d * d;
        if (opt.causal) macs += 2 * M * M * d;
        flops::add(heads * macs);
    }

    MiniBatchOut out;
    out.output = ln_model ? q + ttt_layer_norm(z_bar, gamma, beta, opt.eps) : z_bar;
    if (opt.return_grad_norms) out.grad_norms = k.norm(2, {-1}) * grad.norm(2, {-1});
    state.W = next_W;
    state.b = next_b;
    return out;
}


}  // namespace

torch::Tensor ttt_token_coefficient(const torch::Tensor& learnable_token_idx, int64_t length) {
    LINVIS_CHECK(learnable_token_idx.dim() == 1 && learnable_token_idx.size(0) >= length,
                 "ttt_token_coefficient: learnable_token_idx: expected shape [>= ", length, "], got ",
                 shape_string(learnable_token_idx.sizes()));
    // The reference's token_idx buffer is 1/arange(1, b+1) made in float32 and cast with the model.
    torch::Tensor base = 1.0 / torch::arange(1, length + 1, torch::TensorOptions().dtype(torch::kFloat32));
    base = base.to(learnable_token_idx.scalar_type());
    return torch::clamp_min(base + learnable_token_idx.narrow(0, 0, length), 0.0);
}

torch::Tensor ttt_learning_rate(const torch::Tensor& x, const torch::Tensor& w_lr, const torch::Tensor& b_lr,
                                double eta_base, int64_t head_dim) {
    LINVIS_CHECK(x.dim() == 3, "ttt_learning_rate: x: expected (B, T, C), got ", shape_string(x.sizes()));
    const int64_t C = x.size(2);
    LINVIS_CHECK(w_lr.dim() == 3 && w_lr.size(1) == 1 && w_lr.size(2) == C,
                 "ttt_learning_rate: w_lr: expected [nh, 1, ", C, "], got ", shape_string(w_lr.sizes()));
    const int64_t nh = w_lr.size(0);
    LINVIS_CHECK(b_lr.dim() == 2 && b_lr.size(0) == nh && b_lr.size(1) == 1,
                 "ttt_learning_rate: b_lr: expected [", nh, ", 1], got ", shape_string(b_lr.sizes()));
    LINVIS_CHECK(head_dim > 0, "ttt_learning_rate: head_dim must be positive, got ", head_dim);
    // (B, T, C) x (C, nh) -> (B, T, nh) -> (B, nh, T); through flops::linear (oneDNN): LibTorch's matmul with
    // N = nh took 16 ms of 470 per vittt_tiny image at 1024 px. Not counted, as in the paper (docs/vittt.md).
    torch::Tensor logits;
    {
        const flops::Uncounted uncounted;
        logits = flops::linear(x, w_lr.squeeze(1), b_lr.view({nh}));
    }
    return ttt_learning_rate_of_logits(logits, eta_base, head_dim);
}

torch::Tensor ttt_learning_rate_of_logits(const torch::Tensor& logits, double eta_base, int64_t head_dim) {
    LINVIS_CHECK(logits.dim() == 3, "ttt_learning_rate: logits: expected (B, T, nh), got ", shape_string(logits.sizes()));
    LINVIS_CHECK(head_dim > 0, "ttt_learning_rate: head_dim must be positive, got ", head_dim);
    return eta_base * torch::sigmoid(logits).permute({0, 2, 1}) / static_cast<double>(head_dim);
}

torch::Tensor ttt_layer_norm(const torch::Tensor& z, const torch::Tensor& gamma, const torch::Tensor& beta,
                             double eps) {
    torch::Tensor mu = z.mean({-1}, true);
    torch::Tensor var = z.var(torch::IntArrayRef(kLastDim), false, true);
    torch::Tensor std = torch::sqrt(var + eps);
    torch::Tensor x_hat = (z - mu) / std;
    return per_head(gamma) * x_hat + per_head(beta);
}

torch::Tensor ttt_layer_norm_l2_grad(const torch::Tensor& z, const torch::Tensor& target, const torch::Tensor& gamma,
                                     const torch::Tensor& beta, double eps) {
    const int64_t D = z.size(-1);
    torch::Tensor mu = z.mean({-1}, true);
    torch::Tensor var = z.var(torch::IntArrayRef(kLastDim), false, true);
    torch::Tensor std = torch::sqrt(var + eps);
    torch::Tensor x_hat = (z - mu) / std;
    torch::Tensor y = per_head(gamma) * x_hat + per_head(beta);
    torch::Tensor grad_x_hat = (y - target) * per_head(gamma);
    return (1.0 / static_cast<double>(D)) *
           (static_cast<double>(D) * grad_x_hat - grad_x_hat.sum({-1}, true) -
            x_hat * (grad_x_hat * x_hat).sum({-1}, true)) /
           std;
}

torch::Tensor ttt_rope(const torch::Tensor& x, int64_t period, double theta) {
    LINVIS_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "ttt_rope: x: expected (B, nh, T, d) with even d, got ",
                 shape_string(x.sizes()));
    LINVIS_CHECK(period > 0, "ttt_rope: period must be positive, got ", period);
    const int64_t T = x.size(2);
    const int64_t d = x.size(3);
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor inv_freq = 1.0 / torch::pow(theta, torch::arange(0, d, 2, f32) / static_cast<double>(d));
    torch::Tensor pos = torch::remainder(torch::arange(T, torch::TensorOptions().dtype(torch::kLong)), period)
                            .to(torch::kFloat32);
    torch::Tensor freqs = pos.unsqueeze(1) * inv_freq.unsqueeze(0);  // (T, d/2)
    torch::Tensor cos = torch::cos(freqs).to(x.scalar_type());
    torch::Tensor sin = torch::sin(freqs).to(x.scalar_type());
    torch::Tensor pairs = x.reshape({x.size(0), x.size(1), T, d / 2, 2});
    torch::Tensor x0 = pairs.select(-1, 0);
    torch::Tensor x1 = pairs.select(-1, 1);
    torch::Tensor r0 = x0 * cos - x1 * sin;
    torch::Tensor r1 = x1 * cos + x0 * sin;
    return torch::stack({r0, r1}, -1).reshape(x.sizes());
}

namespace reference {

TttLinearResult ttt_linear_scan(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                                const torch::Tensor& lr, const torch::Tensor& learnable_token_idx,
                                const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& ln_weight,
                                const torch::Tensor& ln_bias, const TttLinearOptions& opt) {
    const int64_t B = xq.size(0), nh = xq.size(1), T = xq.size(2), d = xq.size(3);
    const bool ln_model = opt.inner_model == TttInnerModel::ResidualLayerNorm;
    const bool w0_batched = w0.dim() == 4;
    InnerState state;
    state.W = w0_batched ? w0 : w0.unsqueeze(0).expand({B, nh, d, d});
    if (ln_model) state.b = b0.dim() == 4 ? b0 : b0.unsqueeze(0).expand({B, nh, 1, d});

    std::vector<torch::Tensor> outputs;
    std::vector<torch::Tensor> norms;
    for (int64_t start = 0; start < T; start += opt.mini_batch_size) {
        const int64_t M = std::min(opt.mini_batch_size, T - start);
        torch::Tensor tau = opt.use_token_coefficient ? ttt_token_coefficient(learnable_token_idx, M)
                                                      : torch::ones({M}, xq.options());
        MiniBatchOut mb = mini_batch_step(xq.narrow(2, start, M), xk.narrow(2, start, M), xv.narrow(2, start, M),
                                          lr.narrow(2, start, M), tau, state, ln_weight, ln_bias, opt);
        outputs.push_back(mb.output);
        if (opt.return_grad_norms) norms.push_back(mb.grad_norms);
    }

    TttLinearResult result;
    result.output = outputs.size() == 1 ? outputs[0] : torch::cat(outputs, 2);
    if (opt.return_final_state) {
        result.final_W = state.W;
        result.final_b = state.b;
    }
    if (opt.return_grad_norms) result.grad_norms = norms.size() == 1 ? norms[0] : torch::cat(norms, 2);
    return result;
}


}  // namespace reference

}  // namespace linvis::ops
