// TTT-Linear reference op (spec/ttt_linear_reference.md 2, 4; seed 002 appendix A and C).
// Tolerances and why: docs/ops_ttt_linear.md.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/ttt_linear.h"
#include "support/testing.h"

using linvis::ops::Impl;
using linvis::ops::TttInnerModel;
using linvis::ops::TttLinearOptions;
using linvis::ops::TttLinearResult;
using linvis::testing::all_close;
using linvis::testing::gradcheck;
using linvis::testing::relative_error;

namespace {

// The op's inputs, in the op's argument order.
struct TttInputs {
    torch::Tensor q, k, v, lr, lti, w0, b0, gamma, beta;
    std::vector<torch::Tensor> list() const { return {q, k, v, lr, lti, w0, b0, gamma, beta}; }
    static TttInputs from(const std::vector<torch::Tensor>& t) {
        return {t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]};
    }
    void requires_grad() {
        for (auto* t : {&q, &k, &v, &lr, &lti, &w0, &b0, &gamma, &beta}) t->requires_grad_(true);
    }
    TttInputs to(torch::ScalarType dtype) const {
        auto c = [&](const torch::Tensor& t) { return t.detach().to(dtype); };
        return {c(q), c(k), c(v), c(lr), c(lti), c(w0), c(b0), c(gamma), c(beta)};
    }
};

// Random inputs with inner steps large enough that every term of the update matters.
TttInputs make_inputs(int64_t B, int64_t nh, int64_t T, int64_t d, int64_t b, torch::ScalarType dtype,
                      uint64_t seed, double lr_scale = 0.5) {
    torch::manual_seed(seed);
    auto o = torch::TensorOptions().dtype(torch::kFloat64);
    TttInputs in;
    in.q = torch::randn({B, nh, T, d}, o);
    in.k = torch::randn({B, nh, T, d}, o) / std::sqrt(static_cast<double>(d));
    in.v = torch::randn({B, nh, T, d}, o);
    in.lr = lr_scale * torch::sigmoid(torch::randn({B, nh, T}, o));
    in.lti = 0.1 * torch::randn({b}, o);
    in.w0 = 0.3 * torch::randn({nh, d, d}, o);
    in.b0 = 0.1 * torch::randn({nh, 1, d}, o);
    in.gamma = 1.0 + 0.1 * torch::randn({nh, d}, o);
    in.beta = 0.1 * torch::randn({nh, d}, o);
    return in.to(dtype);
}

// The reference (this file's subject; the fused kernel is tested in test_ttt_linear_fused.cpp).
TttLinearResult run(const TttInputs& in, const TttLinearOptions& opt, Impl impl = Impl::Reference) {
    return linvis::ops::ttt_linear(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, opt, impl);
}

TttLinearOptions options(int64_t b, bool dual = true, bool causal = true, bool rope = false) {
    TttLinearOptions opt;
    opt.mini_batch_size = b;
    opt.dual_form = dual;
    opt.causal = causal;
    opt.use_rope = rope;
    return opt;
}

// Gradients of sum(output * probe) + sum(final_W * probe_W) + sum(final_b * probe_b) w.r.t. every input.
std::vector<torch::Tensor> all_grads(const TttInputs& in, const TttLinearOptions& opt, uint64_t seed) {
    TttLinearOptions o = opt;
    o.return_final_state = true;
    TttLinearResult r = run(in, o);
    torch::manual_seed(seed);
    torch::Tensor loss = (r.output * torch::randn_like(r.output)).sum() + (r.final_W * torch::randn_like(r.final_W)).sum();
    if (r.final_b.defined()) loss = loss + (r.final_b * torch::randn_like(r.final_b)).sum();
    std::vector<torch::Tensor> wrt;
    for (const auto& t : in.list())
        if (t.defined() && t.requires_grad()) wrt.push_back(t);
    return torch::autograd::grad({loss}, wrt, {}, false, false, true);
}

// One causal mini-batch written out token by token from the definitions (spec 2.7): all
// gradients at the starting state, eta_ij = tau_i lr_j, state after = row M-1.
struct HandState {
    torch::Tensor W, b, out;
};
HandState hand_mini_batch(const TttInputs& in, int64_t start, int64_t M, torch::Tensor W, torch::Tensor b,
                          bool causal = true) {
    using namespace torch::indexing;
    torch::Tensor tau = linvis::ops::ttt_token_coefficient(in.lti, M);
    std::vector<torch::Tensor> g(M), outs(M);
    auto q = in.q.narrow(2, start, M), k = in.k.narrow(2, start, M), v = in.v.narrow(2, start, M);
    auto lr = in.lr.narrow(2, start, M);
    for (int64_t j = 0; j < M; ++j) {
        auto kj = k.narrow(2, j, 1);
        g[j] = linvis::ops::ttt_layer_norm_l2_grad(torch::matmul(kj, W) + b, v.narrow(2, j, 1) - kj, in.gamma,
                                                   in.beta);
    }
    auto state_after = [&](int64_t i) {
        torch::Tensor Wi = W.clone(), bi = b.clone();
        for (int64_t j = 0; j <= i; ++j) {
            auto eta = (tau[i] * lr.narrow(2, j, 1)).unsqueeze(-1);  // (B, nh, 1, 1)
            Wi = Wi - eta * torch::matmul(k.narrow(2, j, 1).transpose(-1, -2), g[j]);
            bi = bi - eta * g[j];
        }
        return std::make_pair(Wi, bi);
    };
    for (int64_t i = 0; i < M; ++i) {
        auto [Wi, bi] = state_after(causal ? i : M - 1);
        auto qi = q.narrow(2, i, 1);
        outs[i] = qi + linvis::ops::ttt_layer_norm(torch::matmul(qi, Wi) + bi, in.gamma, in.beta);
    }
    auto [Wl, bl] = state_after(M - 1);
    return {Wl, bl, torch::cat(outs, 2)};
}

}  // namespace

TEST(TttLinear, DualEqualsPrimal) {
    // T = 13, b = 4: three full mini-batches and a remainder of 1.
    for (bool causal : {true, false}) {
        for (bool rope : {false, true}) {
            TttInputs in = make_inputs(2, 2, 13, 6, 4, torch::kFloat64, 11);
            in.requires_grad();
            TttLinearOptions dual = options(4, true, causal, rope), primal = options(4, false, causal, rope);
            dual.return_final_state = primal.return_final_state = true;
            auto rd = run(in, dual), rp = run(in, primal);
            SCOPED_TRACE(std::string("causal=") + (causal ? "1" : "0") + " rope=" + (rope ? "1" : "0"));
            EXPECT_TRUE(all_close(rd.output, rp.output, 1e-11, 1e-12));
            EXPECT_TRUE(all_close(rd.final_W, rp.final_W, 1e-11, 1e-12));
            EXPECT_TRUE(all_close(rd.final_b, rp.final_b, 1e-11, 1e-12));
            auto gd = all_grads(in, dual, 5), gp = all_grads(in, primal, 5);
            ASSERT_EQ(gd.size(), 9u);
            for (size_t i = 0; i < gd.size(); ++i) {
                SCOPED_TRACE("input " + std::to_string(i));
                EXPECT_GT(gd[i].abs().max().item<double>(), 0.0);
                EXPECT_TRUE(all_close(gd[i], gp[i], 1e-10, 1e-11));
            }
        }
    }
    // The plain linear inner model as well.
    TttInputs in = make_inputs(1, 2, 10, 4, 4, torch::kFloat64, 12, 0.1);
    TttLinearOptions dual = options(4), primal = options(4, false);
    dual.inner_model = primal.inner_model = TttInnerModel::Linear;
    EXPECT_TRUE(all_close(run(in, dual).output, run(in, primal).output, 1e-11, 1e-12));
}

TEST(TttLinear, RemainderMiniBatchNoPadding) {
    const int64_t b = 4, r = 3, T = 2 * b + r;
    for (bool causal : {true, false}) {
        SCOPED_TRACE(causal ? "causal" : "non-causal");
        TttInputs in = make_inputs(2, 3, T, 6, b, torch::kFloat64, 21);
        TttLinearOptions opt = options(b, true, causal);
        opt.return_final_state = true;
        auto full = run(in, opt);
        ASSERT_EQ(full.output.sizes(), in.q.sizes());
        // Pieces by hand: the first 2b tokens, then the last r tokens as one mini-batch of size r
        // (tau[:r], r x r masks) starting from the carried state.
        TttInputs head = in, tail = in;
        for (auto* t : {&head.q, &head.k, &head.v, &head.lr}) *t = t->narrow(2, 0, 2 * b);
        for (auto* t : {&tail.q, &tail.k, &tail.v, &tail.lr}) *t = t->narrow(2, 2 * b, r);
        auto first = run(head, opt);
        tail.w0 = first.final_W;
        tail.b0 = first.final_b;
        auto hand = hand_mini_batch(in, 2 * b, r, first.final_W, first.final_b, causal);
        EXPECT_TRUE(all_close(full.output.narrow(2, 0, 2 * b), first.output, 1e-12, 1e-13));
        EXPECT_TRUE(all_close(full.output.narrow(2, 2 * b, r), hand.out, 1e-11, 1e-12));
        EXPECT_TRUE(all_close(full.final_W, hand.W, 1e-11, 1e-12));
        EXPECT_TRUE(all_close(full.final_b, hand.b, 1e-11, 1e-12));
        // Padding the last mini-batch to b with zero-lr tokens would scale the carried update by
        // tau_{b-1} instead of tau_{r-1} (and, non-causal, change the outputs): it must differ.
        TttInputs padded = in;
        auto zpad = torch::zeros({2, 3, b - r, 6}, in.q.options());
        for (auto* t : {&padded.q, &padded.k, &padded.v}) *t = torch::cat({*t, zpad}, 2);
        padded.lr = torch::cat({in.lr, torch::zeros({2, 3, b - r}, in.lr.options())}, 2);
        auto pad = run(padded, opt);
        EXPECT_GT((pad.final_W - full.final_W).abs().max().item<double>(), 1e-4);
        if (!causal)
            EXPECT_GT((pad.output.narrow(2, 2 * b, r) - full.output.narrow(2, 2 * b, r)).abs().max().item<double>(),
                      1e-4);
    }
}

TEST(TttLinear, StateCarriedAcrossMiniBatches) {
    const int64_t b = 5, T = 3 * b;
    TttInputs in = make_inputs(2, 2, T, 8, b, torch::kFloat64, 31);
    TttLinearOptions opt = options(b);
    opt.return_final_state = true;
    auto full = run(in, opt);
    torch::Tensor W = in.w0.unsqueeze(0).expand({2, 2, 8, 8}), bias = in.b0.unsqueeze(0).expand({2, 2, 1, 8});
    for (int64_t m = 0; m < 3; ++m) {
        SCOPED_TRACE("mini-batch " + std::to_string(m));
        auto hand = hand_mini_batch(in, m * b, b, W, bias);
        EXPECT_TRUE(all_close(full.output.narrow(2, m * b, b), hand.out, 1e-11, 1e-12));
        if (m > 0) {
            // Restarting from W0 instead of the carried state gives different outputs.
            auto reset = hand_mini_batch(in, m * b, b, in.w0.unsqueeze(0).expand({2, 2, 8, 8}),
                                         in.b0.unsqueeze(0).expand({2, 2, 1, 8}));
            EXPECT_GT((reset.out - hand.out).abs().max().item<double>(), 1e-3);
        }
        W = hand.W;
        bias = hand.b;
    }
    EXPECT_TRUE(all_close(full.final_W, W, 1e-11, 1e-12));
    EXPECT_TRUE(all_close(full.final_b, bias, 1e-11, 1e-12));
    // Chaining three single-mini-batch calls through final_W / final_b gives the same run.
    TttInputs piece = in;
    for (int64_t m = 0; m < 3; ++m) {
        TttInputs p = piece;
        for (auto* t : {&p.q, &p.k, &p.v, &p.lr}) *t = t->narrow(2, m * b, b);
        auto r = run(p, opt);
        EXPECT_TRUE(all_close(r.output, full.output.narrow(2, m * b, b), 1e-12, 1e-13));
        piece.w0 = r.final_W;
        piece.b0 = r.final_b;
    }
}

TEST(TttLinear, NonCausalSeesUpdatedState) {
    const int64_t b = 6;
    TttInputs in = make_inputs(1, 2, b, 8, b, torch::kFloat64, 41);
    TttLinearOptions opt = options(b, true, false);
    opt.return_final_state = true;
    auto r = run(in, opt);
    // Every token reads the state after the whole mini-batch: out_i = q_i + LN(q_i W' + b').
    auto expected = in.q + linvis::ops::ttt_layer_norm(torch::matmul(in.q, r.final_W) + r.final_b, in.gamma, in.beta);
    EXPECT_TRUE(all_close(r.output, expected, 1e-12, 1e-13));
    // ... and that state is the causal run's carried state (tau_{M-1} row of eta).
    TttLinearOptions causal = options(b);
    causal.return_final_state = true;
    auto rc = run(in, causal);
    EXPECT_TRUE(all_close(r.final_W, rc.final_W, 1e-13, 1e-14));
    // The first token of a causal run sees only itself, so the outputs differ there.
    EXPECT_GT((r.output.narrow(2, 0, 1) - rc.output.narrow(2, 0, 1)).abs().max().item<double>(), 1e-3);
    EXPECT_TRUE(all_close(r.output.narrow(2, b - 1, 1), rc.output.narrow(2, b - 1, 1), 1e-12, 1e-13));
}

TEST(TttLinear, InnerGradientMatchesAutograd) {
    torch::manual_seed(51);
    auto o = torch::TensorOptions().dtype(torch::kFloat64);
    auto z = (2.0 * torch::randn({2, 3, 5, 8}, o) + 0.5).requires_grad_(true);
    auto target = torch::randn({2, 3, 5, 8}, o);
    auto gamma = 1.0 + 0.2 * torch::randn({3, 8}, o), beta = 0.2 * torch::randn({3, 8}, o);
    auto y = linvis::ops::ttt_layer_norm(z, gamma, beta);
    // The inner LN is LayerNorm with biased variance and eps 1e-6, per head.
    auto expected_y = torch::layer_norm(z, {8}, {}, {}, 1e-6) * gamma.unsqueeze(1) + beta.unsqueeze(1);
    EXPECT_TRUE(all_close(y, expected_y, 1e-12, 1e-12));
    auto loss = 0.5 * (y - target).pow(2).sum();
    auto autograd = torch::autograd::grad({loss}, {z})[0];
    auto closed = linvis::ops::ttt_layer_norm_l2_grad(z, target, gamma, beta);
    EXPECT_TRUE(all_close(closed, autograd, 1e-10, 1e-12));
}

TEST(TttLinear, GradNormsAreInnerGradientNorms) {
    // ||dloss_t/dW|| at the mini-batch's starting state, checked with autograd on W.
    const int64_t b = 4, T = 6;
    TttInputs in = make_inputs(1, 2, T, 5, b, torch::kFloat64, 61);
    TttLinearOptions opt = options(b);
    opt.return_grad_norms = true;
    opt.return_final_state = true;
    auto r = run(in, opt);
    ASSERT_EQ(r.grad_norms.sizes(), (std::vector<int64_t>{1, 2, T}));
    TttLinearOptions first_opt = opt;
    TttInputs first = in;
    for (auto* t : {&first.q, &first.k, &first.v, &first.lr}) *t = t->narrow(2, 0, b);
    auto W1 = run(first, first_opt);
    for (int64_t t = 0; t < T; ++t) {
        torch::Tensor W = (t < b ? in.w0.unsqueeze(0) : W1.final_W).detach().clone().requires_grad_(true);
        torch::Tensor bias = t < b ? in.b0.unsqueeze(0) : W1.final_b.detach();
        auto kt = in.k.narrow(2, t, 1), vt = in.v.narrow(2, t, 1);
        auto y = linvis::ops::ttt_layer_norm(torch::matmul(kt, W) + bias, in.gamma, in.beta);
        auto loss = 0.5 * (y - (vt - kt)).pow(2).sum({-1, -2});  // per head
        for (int64_t h = 0; h < 2; ++h) {
            auto gW = torch::autograd::grad({loss.select(1, h).sum()}, {W}, {}, true)[0].select(1, h);
            EXPECT_NEAR(r.grad_norms[0][h][t].item<double>(), gW.norm().item<double>(), 1e-12);
        }
    }
}

static void gradcheck_ttt(const TttLinearOptions& opt, int64_t T, uint64_t seed) {
    TttInputs in = make_inputs(1, 2, T, 4, opt.mini_batch_size, torch::kFloat64, seed);
    in.requires_grad();
    auto f = [&](const std::vector<torch::Tensor>& t) {
        TttLinearOptions o = opt;
        o.return_final_state = true;
        auto r = run(TttInputs::from(t), o);
        return torch::cat({r.output.reshape(-1), r.final_W.reshape(-1), r.final_b.reshape(-1)});
    };
    EXPECT_TRUE(gradcheck(f, in.list(), 1e-6, 1e-7, 1e-5));
}

TEST(Ops, GradcheckTttLinearDual) { gradcheck_ttt(options(4), 8, 71); }
TEST(Ops, GradcheckTttLinearPrimal) { gradcheck_ttt(options(4, false), 8, 72); }
TEST(Ops, GradcheckTttLinearRope) { gradcheck_ttt(options(4, true, true, true), 8, 73); }
TEST(Ops, GradcheckTttLinearNonCausal) { gradcheck_ttt(options(4, true, false), 8, 74); }
TEST(Ops, GradcheckTttLinearNonCausalPrimal) { gradcheck_ttt(options(4, false, false), 7, 75); }
TEST(Ops, GradcheckTttLinearRemainder) { gradcheck_ttt(options(4), 7, 76); }
TEST(Ops, GradcheckTttLinearLearningRateHelper) {
    torch::manual_seed(77);
    auto o = torch::TensorOptions().dtype(torch::kFloat64);
    std::vector<torch::Tensor> in = {torch::randn({2, 3, 6}, o).requires_grad_(true),
                                     torch::randn({2, 1, 6}, o).requires_grad_(true),
                                     torch::randn({2, 1}, o).requires_grad_(true)};
    auto f = [](const std::vector<torch::Tensor>& t) { return linvis::ops::ttt_learning_rate(t[0], t[1], t[2], 1.0, 4); };
    EXPECT_TRUE(gradcheck(f, in, 1e-6, 1e-8, 1e-5));
    // The value: eta_base * sigmoid(x . w_lr[h] + b_lr[h]) / d.
    auto lr = f(in);
    auto expected = torch::sigmoid((in[0][0][2] * in[1][1][0]).sum() + in[2][1][0]) / 4.0;
    EXPECT_NEAR(lr[0][1][2].item<double>(), expected.item<double>(), 1e-14);
}

TEST(Ttt, LinearAttentionTheorem) {
    // Theorem 1 (seed 002, appendix C): f(x) = x W, one batch b = T, eta = 1/2, W0 = 0 gives
    // causal linear attention z_t = sum_{s <= t} (q_t . k_s) v_s.
    const int64_t T = 9, d = 5;
    TttInputs in = make_inputs(2, 2, T, d, T, torch::kFloat64, 81);
    in.lr = torch::full({2, 2, T}, 0.5, in.q.options());
    in.w0 = torch::zeros({2, d, d}, in.q.options());
    in.b0 = in.gamma = in.beta = in.lti = torch::Tensor();
    auto expected = torch::matmul(torch::tril(torch::matmul(in.q, in.k.transpose(-1, -2))), in.v);
    for (bool dual : {true, false}) {
        TttLinearOptions opt = options(T, dual);
        opt.inner_model = TttInnerModel::Linear;
        opt.use_token_coefficient = false;
        EXPECT_TRUE(all_close(run(in, opt).output, expected, 1e-12, 1e-12)) << (dual ? "dual" : "primal");
    }
    // With mini-batches (b < T) later tokens see gradients taken at updated states: no longer equal.
    TttLinearOptions mb = options(3);
    mb.inner_model = TttInnerModel::Linear;
    mb.use_token_coefficient = false;
    EXPECT_GT((run(in, mb).output - expected).abs().max().item<double>(), 1e-3);
}

TEST(Ttt, OnlineGradientDescentForBatchOne) {
    const int64_t T = 7, d = 6;
    // Reference inner model: b = 1 is the token-by-token online GD recurrence
    // W_t = W_{t-1} - tau_0 lr_t k_t^T g_t(W_{t-1}), out_t = q_t + LN(q_t W_t + b_t).
    TttInputs in = make_inputs(2, 2, T, d, 1, torch::kFloat64, 91);
    TttLinearOptions opt = options(1);
    opt.return_final_state = true;
    auto r = run(in, opt);
    torch::Tensor W = in.w0.unsqueeze(0), bias = in.b0.unsqueeze(0);
    torch::Tensor tau0 = torch::clamp_min(1.0 + in.lti[0], 0.0);
    for (int64_t t = 0; t < T; ++t) {
        auto qt = in.q.narrow(2, t, 1), kt = in.k.narrow(2, t, 1), vt = in.v.narrow(2, t, 1);
        auto g = linvis::ops::ttt_layer_norm_l2_grad(torch::matmul(kt, W) + bias, vt - kt, in.gamma, in.beta);
        auto eta = tau0 * in.lr.narrow(2, t, 1).unsqueeze(-1);
        W = W - eta * torch::matmul(kt.transpose(-1, -2), g);
        bias = bias - eta * g;
        auto out = qt + linvis::ops::ttt_layer_norm(torch::matmul(qt, W) + bias, in.gamma, in.beta);
        EXPECT_TRUE(all_close(r.output.narrow(2, t, 1), out, 1e-11, 1e-12)) << "token " << t;
    }
    EXPECT_TRUE(all_close(r.final_W, W, 1e-11, 1e-12));
    // Theorem 2 (linear inner model, eta = 1/2, W0 = 0): the adapted-value-view form
    // z_t = sum_{s <= t} (q_t . k_s) (v_s - k_s W_{s-1}).
    TttInputs lin = in;
    lin.lr = torch::full({2, 2, T}, 0.5, in.q.options());
    lin.w0 = torch::zeros({2, d, d}, in.q.options());
    TttLinearOptions lo = options(1);
    lo.inner_model = TttInnerModel::Linear;
    lo.use_token_coefficient = false;
    auto z = run(lin, lo).output;
    torch::Tensor Ws = lin.w0.unsqueeze(0).expand({2, 2, d, d});
    torch::Tensor adapted = torch::zeros_like(lin.v);  // v_s - k_s W_{s-1}
    for (int64_t s = 0; s < T; ++s) {
        auto ks = lin.k.narrow(2, s, 1), vs = lin.v.narrow(2, s, 1);
        adapted.narrow(2, s, 1).copy_(vs - torch::matmul(ks, Ws));
        Ws = Ws - 0.5 * torch::matmul(ks.transpose(-1, -2), 2 * (torch::matmul(ks, Ws) - vs));
    }
    auto expected = torch::matmul(torch::tril(torch::matmul(lin.q, lin.k.transpose(-1, -2))), adapted);
    EXPECT_TRUE(all_close(z, expected, 1e-11, 1e-12));
}

TEST(TttLinear, BatchIndependence) {
    TttInputs in = make_inputs(3, 2, 19, 8, 4, torch::kFloat32, 101, 0.2);
    TttLinearOptions opt = options(4);
    auto full = run(in, opt).output;
    TttInputs one = in;
    for (auto* t : {&one.q, &one.k, &one.v, &one.lr}) *t = t->narrow(0, 1, 1);
    auto alone = run(one, opt).output;
    EXPECT_TRUE(all_close(alone, full.narrow(0, 1, 1), 1e-5, 1e-6));
    // Changing sample 0 leaves sample 1 untouched.
    TttInputs other = in;
    other.q = in.q.clone();
    other.q[0].fill_(3.0);
    EXPECT_TRUE(all_close(run(other, opt).output.narrow(0, 1, 2), full.narrow(0, 1, 2), 1e-5, 1e-6));
}

TEST(TttLinear, Bfloat16WithinTolerance) {
    // Vittt-like scales: d = 64, b = 16, lr = sigmoid(.) / d, T = 37 (two mini-batches + 5).
    TttInputs in = make_inputs(2, 2, 37, 64, 16, torch::kFloat32, 111, 1.0);
    in.lr = in.lr / 64.0;
    in.w0 = in.w0 / 4.0;
    for (bool dual : {true, false}) {
        TttLinearOptions opt = options(16, dual);
        opt.return_final_state = true;
        auto r32 = run(in, opt);
        auto r16 = run(in.to(torch::kBFloat16), opt);
        ASSERT_EQ(r16.output.scalar_type(), torch::kBFloat16);
        const double err = relative_error(r16.output, r32.output);
        const double err_w = relative_error(r16.final_W, r32.final_W);
        std::printf("[ bf16 ] %s: relative L2 error output %.3e, final W %.3e\n", dual ? "dual" : "primal", err, err_w);
        EXPECT_LT(err, 2e-2);
        EXPECT_LT(err_w, 2e-2);
        EXPECT_TRUE(all_close(r16.output, r32.output, 5e-2, 1e-1));
    }
}

TEST(TttLinear, FlopCountFollowsFormula) {
    // Causal: 3 M d^2 + 2 M^2 d per mini-batch and head; non-causal: 3 M d^2.
    TttInputs in = make_inputs(2, 3, 37, 8, 16, torch::kFloat32, 121);
    const int64_t heads = 6, d = 8;
    const int64_t sum_m2 = 16 * 16 * 2 + 5 * 5;
    {
        linvis::flops::Counter c;
        run(in, options(16));
        EXPECT_EQ(c.macs(), heads * (3 * 37 * d * d + 2 * sum_m2 * d));
    }
    {
        linvis::flops::Counter c;
        run(in, options(16, true, false));
        EXPECT_EQ(c.macs(), heads * 3 * 37 * d * d);
    }
}

TEST(TttLinear, RejectsBadInputs) {
    TttInputs in = make_inputs(1, 2, 8, 4, 4, torch::kFloat32, 131);
    TttInputs bad = in;
    bad.k = in.k.narrow(2, 0, 7);
    EXPECT_THROW(run(bad, options(4)), linvis::Error);
    bad = in;
    bad.w0 = torch::zeros({2, 4, 5});
    EXPECT_THROW(run(bad, options(4)), linvis::Error);
    EXPECT_THROW(run(in, options(8)), linvis::Error);  // learnable_token_idx has 4 entries, b = 8
    bad = in;
    bad.lr = in.lr.to(torch::kFloat64);
    EXPECT_THROW(run(bad, options(4)), linvis::Error);
    // impl=fused validates the same way (the fused kernel itself is tested in test_ttt_linear_fused.cpp)
    bad = in;
    bad.k = in.k.narrow(2, 0, 7);
    EXPECT_THROW(run(bad, options(4), Impl::Fused), linvis::Error);
}
