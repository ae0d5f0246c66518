// Fused CPU TTT-Linear (src/ops/ttt_linear/cpu.cpp) against the reference op: outputs,
// final state and gradients w.r.t. every input. Tolerances and why: docs/perf_ttt_linear.md.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/runtime.h"
#include "linvis/models/registry.h"
#include "linvis/ops/depthwise_conv.h"
#include "linvis/ops/ttt_linear.h"
#include "support/simd_targets.h"
#include "support/testing.h"

using linvis::ops::Impl;
using linvis::ops::TttInnerModel;
using linvis::ops::TttLinearOptions;
using linvis::ops::TttLinearResult;
using linvis::testing::all_close;
using linvis::testing::relative_error;

namespace {

struct TttInputs {
    torch::Tensor q, k, v, lr, lti, w0, b0, gamma, beta;
    std::vector<torch::Tensor> list() const { return {q, k, v, lr, lti, w0, b0, gamma, beta}; }
    TttInputs to(torch::ScalarType dtype, bool grad) const {
        auto c = [&](const torch::Tensor& t) { return t.detach().to(dtype).requires_grad_(grad); };
        return {c(q), c(k), c(v), c(lr), c(lti), c(w0), c(b0), c(gamma), c(beta)};
    }
};

const char* kInputNames[] = {"xq", "xk", "xv", "lr", "learnable_token_idx", "w0", "b0", "ln_weight", "ln_bias"};

// Inner steps large enough that every term of the update (and of its gradient) matters.
TttInputs make_inputs(int64_t B, int64_t nh, int64_t T, int64_t d, int64_t b, uint64_t seed,
                      bool batched_state = false) {
    torch::manual_seed(seed);
    auto o = torch::TensorOptions().dtype(torch::kFloat64);
    TttInputs in;
    in.q = torch::randn({B, nh, T, d}, o);
    in.k = torch::randn({B, nh, T, d}, o) / std::sqrt(static_cast<double>(d));
    in.v = torch::randn({B, nh, T, d}, o);
    in.lr = 0.5 * torch::sigmoid(torch::randn({B, nh, T}, o));
    in.lti = 0.1 * torch::randn({b}, o);
    in.w0 = 0.3 * torch::randn(batched_state ? std::vector<int64_t>{B, nh, d, d} : std::vector<int64_t>{nh, d, d}, o);
    in.b0 = 0.1 * torch::randn(batched_state ? std::vector<int64_t>{B, nh, 1, d} : std::vector<int64_t>{nh, 1, d}, o);
    in.gamma = 1.0 + 0.1 * torch::randn({nh, d}, o);
    in.beta = 0.1 * torch::randn({nh, d}, o);
    return in;
}

// TTT-Linear options plus the implementation to run them with (ops::ttt_linear's last argument).
struct RunOptions : TttLinearOptions {
    Impl impl = Impl::Auto;
};

TttLinearResult ttt(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& lr,
                    const torch::Tensor& lti, const torch::Tensor& w0, const torch::Tensor& b0,
                    const torch::Tensor& gamma, const torch::Tensor& beta, const RunOptions& o) {
    return linvis::ops::ttt_linear(q, k, v, lr, lti, w0, b0, gamma, beta, o, o.impl);
}

RunOptions options(int64_t b, bool causal, Impl impl, int64_t ckpt = 4) {
    RunOptions opt;
    opt.mini_batch_size = b;
    opt.causal = causal;
    opt.impl = impl;
    opt.checkpoint_every = ckpt;
    opt.return_final_state = true;
    return opt;
}

struct RunResult {
    torch::Tensor output, final_W, final_b;
    std::vector<torch::Tensor> grads;  // w.r.t. the 9 inputs
};

// Output, final state and the gradients of sum(out * P) + sum(W_T * P_W) + sum(b_T * P_b).
RunResult run_with_grads(const TttInputs& in, const RunOptions& opt, uint64_t probe_seed) {
    TttLinearResult r = ttt(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, opt);
    torch::manual_seed(probe_seed);
    auto po = torch::TensorOptions().dtype(torch::kFloat64);
    torch::Tensor loss = (r.output * torch::randn(r.output.sizes(), po).to(r.output.scalar_type())).sum() +
                         (r.final_W * torch::randn(r.final_W.sizes(), po).to(r.output.scalar_type())).sum() +
                         (r.final_b * torch::randn(r.final_b.sizes(), po).to(r.output.scalar_type())).sum();
    RunResult out{r.output.detach(), r.final_W.detach(), r.final_b.detach(), {}};
    out.grads = torch::autograd::grad({loss}, in.list(), {}, false, false, true);
    return out;
}

// Fused vs reference: relative L2 error of every tensor below rel_tol, elementwise within
// rtol/atol scaled by the tensor's magnitude.
void expect_match(const RunResult& fused, const RunResult& ref, double rel_tol, double rtol, double atol_scale,
                  const std::string& what) {
    auto check = [&](const torch::Tensor& f, const torch::Tensor& e, const std::string& name) {
        const double rel = relative_error(f, e);
        const double scale = e.detach().abs().max().item<double>();
        EXPECT_LT(rel, rel_tol) << what << " " << name;
        EXPECT_TRUE(all_close(f, e, rtol, atol_scale * scale)) << what << " " << name;
        return rel;
    };
    double worst_out = check(fused.output, ref.output, "output");
    worst_out = std::max(worst_out, check(fused.final_W, ref.final_W, "final_W"));
    worst_out = std::max(worst_out, check(fused.final_b, ref.final_b, "final_b"));
    double worst_grad = 0;
    for (size_t i = 0; i < ref.grads.size(); ++i) {
        ASSERT_TRUE(fused.grads[i].defined() && ref.grads[i].defined()) << what << " " << kInputNames[i];
        worst_grad = std::max(worst_grad, check(fused.grads[i], ref.grads[i], std::string("d ") + kInputNames[i]));
    }
    std::printf("[ fused ] %s: worst relative L2 error outputs %.2e, gradients %.2e\n", what.c_str(), worst_out,
                worst_grad);
}

}  // namespace

// Float64 runs in double precision on every SIMD target: the hand-derived adjoint equations must
// reproduce autograd through the reference to rounding. Lengths that are and are not multiples
// of b, causal and non-causal, several (B, nh), several checkpoint intervals.
TEST(TttLinearFused, MatchesReferenceFloat64AllGradients) {
    struct Case {
        int64_t B, nh, T, d, b, ckpt;
        bool causal;
    };
    const Case cases[] = {{1, 2, 13, 8, 4, 1, true},  {2, 1, 13, 8, 4, 2, false}, {1, 3, 32, 16, 16, 4, true},
                          {2, 2, 37, 16, 16, 2, true}, {2, 2, 37, 16, 16, 4, false}, {1, 1, 5, 6, 16, 4, true},
                          {1, 2, 40, 12, 4, 3, true}};
    for (const auto& c : cases) {
        TttInputs base = make_inputs(c.B, c.nh, c.T, c.d, c.b, 1000 + c.T + c.d);
        TttInputs in = base.to(torch::kFloat64, true);
        RunResult ref = run_with_grads(in, options(c.b, c.causal, Impl::Reference), 7);
        linvis::testing::for_each_simd_target([&](const linvis::testing::SimdTarget& t) {
            RunResult fused = run_with_grads(in, options(c.b, c.causal, Impl::Fused, c.ckpt), 7);
            expect_match(fused, ref, 1e-11, 1e-9, 1e-11,
                         std::string(t.env) + " f64 B" + std::to_string(c.B) + " nh" + std::to_string(c.nh) + " T" +
                             std::to_string(c.T) + " d" + std::to_string(c.d) + " b" + std::to_string(c.b) +
                             " ckpt" + std::to_string(c.ckpt) + (c.causal ? " causal" : " non-causal"));
        });
    }
}

// Float32 at the model's sizes (d = 64, b = 16), on one SIMD target.
void float32_cases(const char* path) {
    for (bool causal : {true, false}) {
        for (int64_t T : {64, 37}) {
            TttInputs base = make_inputs(2, 3, T, 64, 16, 2000 + T);
            RunResult ref = run_with_grads(base.to(torch::kFloat64, true), options(16, causal, Impl::Reference), 9);
            RunResult fused = run_with_grads(base.to(torch::kFloat32, true), options(16, causal, Impl::Fused), 9);
            expect_match(fused, ref, 1e-5, 1e-3, 1e-4,
                         std::string(path) + " f32 T" + std::to_string(T) + (causal ? " causal" : " non-causal"));
        }
    }
    // Widths that are not multiples of the 16, 8 or 4 lanes (masked tails): d = 24, b = 6, T = 21; d = 13.
    for (int64_t d : {24, 13}) {
        TttInputs base = make_inputs(1, 2, 21, d, 6, 2100 + d);
        RunResult ref = run_with_grads(base.to(torch::kFloat64, true), options(6, true, Impl::Reference), 9);
        RunResult fused = run_with_grads(base.to(torch::kFloat32, true), options(6, true, Impl::Fused, 2), 9);
        expect_match(fused, ref, 1e-5, 1e-3, 1e-4, std::string(path) + " f32 d" + std::to_string(d) + " b6 T21");
    }
}

// Every SIMD target this CPU runs (AVX-512, AVX2, scalar; LINVIS_SIMD, tests/support/simd_targets.h).
TEST(TttLinearFused, MatchesReferenceFloat32EveryTarget) {
    linvis::testing::for_each_simd_target([](const linvis::testing::SimdTarget& t) { float32_cases(t.env); });
}

// The float32 fused result is compared with the float64 reference above; it must also be as
// close to the float32 reference as that one is to float64 (same error class).
TEST(TttLinearFused, Float32CloseToFloat32Reference) {
    TttInputs base = make_inputs(1, 3, 50, 64, 16, 31);
    RunResult ref32 = run_with_grads(base.to(torch::kFloat32, true), options(16, true, Impl::Reference), 3);
    RunResult fused = run_with_grads(base.to(torch::kFloat32, true), options(16, true, Impl::Fused), 3);
    expect_match(fused, ref32, 2e-5, 1e-3, 1e-4, "f32 fused vs f32 reference");
}

// bfloat16 in, float32 inside, bfloat16 out: compared with the float64 reference on the same
// (bf16-rounded) inputs, and the bf16 reference is no closer than the fused kernel.
TEST(TttLinearFused, Bfloat16WithinTolerance) {
    TttInputs base = make_inputs(1, 2, 37, 64, 16, 41).to(torch::kBFloat16, false).to(torch::kFloat64, false);
    RunResult ref64 = run_with_grads(base.to(torch::kFloat64, true), options(16, true, Impl::Reference), 5);
    RunResult fused = run_with_grads(base.to(torch::kBFloat16, true), options(16, true, Impl::Fused), 5);
    RunResult ref16 = run_with_grads(base.to(torch::kBFloat16, true), options(16, true, Impl::Reference), 5);
    EXPECT_EQ(fused.output.scalar_type(), torch::kBFloat16);
    const double out_fused = relative_error(fused.output, ref64.output);
    const double out_ref16 = relative_error(ref16.output, ref64.output);
    EXPECT_LT(out_fused, 1e-2);
    EXPECT_LE(out_fused, out_ref16 * 1.5);
    double worst_grad = 0, worst_grad_ref16 = 0;
    for (size_t i = 0; i < ref64.grads.size(); ++i) {
        const double e = relative_error(fused.grads[i], ref64.grads[i]);
        worst_grad = std::max(worst_grad, e);
        worst_grad_ref16 = std::max(worst_grad_ref16, relative_error(ref16.grads[i], ref64.grads[i]));
        EXPECT_LT(e, 3e-2) << kInputNames[i];
    }
    std::printf("[ fused ] bf16: output rel err %.2e (bf16 reference %.2e), worst gradient %.2e "
                "(bf16 reference %.2e)\n",
                out_fused, out_ref16, worst_grad, worst_grad_ref16);
}

// RoPE (reference ttt_rope then the fused scan), no token coefficient, a batched initial state,
// primal form requested (same function), and the per-token inner gradient norms; each alone and
// all together.
TEST(TttLinearFused, OptionsRopeTauStateAndGradNorms) {
    for (int mask : {1, 2, 4, 8, 16, 31}) {
        const bool rope = mask & 1, no_tau = mask & 2, batched = mask & 4, norms = mask & 8, primal = mask & 16;
        TttInputs in = make_inputs(2, 2, 21, 8, 4, 77, batched).to(torch::kFloat64, true);
        RunOptions ro = options(4, true, Impl::Reference);
        ro.use_rope = rope;
        ro.use_token_coefficient = !no_tau;
        ro.return_grad_norms = norms;
        ro.dual_form = !primal;
        RunOptions fo = ro;
        fo.impl = Impl::Fused;
        fo.checkpoint_every = 2;
        torch::Tensor lti = no_tau ? torch::Tensor() : in.lti;
        auto run_opt = [&](const RunOptions& o, torch::Tensor* out_norms) {
            TttLinearResult r =
                ttt(in.q, in.k, in.v, in.lr, lti, in.w0, in.b0, in.gamma, in.beta, o);
            if (out_norms) *out_norms = r.grad_norms;
            torch::manual_seed(3);
            // randn(sizes), not randn_like: the fused output is a permuted view, and randn_like
            // would fill it in memory order.
            auto po = r.output.options();
            torch::Tensor loss = (r.output * torch::randn(r.output.sizes(), po)).sum() +
                                 (r.final_W * torch::randn(r.final_W.sizes(), po)).sum();
            std::vector<torch::Tensor> wrt = {in.q, in.k, in.v, in.lr, in.w0, in.b0, in.gamma, in.beta};
            if (!no_tau) wrt.push_back(in.lti);
            auto g = torch::autograd::grad({loss}, wrt, {}, false, false, true);
            g.push_back(r.output.detach());
            return g;
        };
        torch::Tensor norms_ref, norms_fused;
        auto ref = run_opt(ro, &norms_ref);
        auto fused = run_opt(fo, &norms_fused);
        for (size_t i = 0; i < ref.size(); ++i)
            EXPECT_TRUE(all_close(fused[i], ref[i], 1e-9, 1e-11)) << "options mask " << mask << " tensor " << i;
        if (norms) {
            EXPECT_TRUE(all_close(norms_fused, norms_ref, 1e-10, 1e-12));
            EXPECT_FALSE(norms_fused.requires_grad());
        }
        if (rope) {
            // the switch is honoured: without RoPE the result differs
            RunOptions no_rope = fo;
            no_rope.use_rope = false;
            torch::NoGradGuard ng;
            auto plain = ttt(in.q, in.k, in.v, in.lr, lti, in.w0, in.b0, in.gamma, in.beta, no_rope);
            EXPECT_GT(relative_error(plain.output, fused.back()), 1e-3);
        }
    }
}

// Inference saves nothing and builds no graph; with gradients the output hangs off the fused
// autograd node (not the reference graph).
TEST(TttLinearFused, InferenceBuildsNoGraph) {
    TttInputs in = make_inputs(1, 2, 20, 16, 16, 5).to(torch::kFloat32, true);
    RunOptions fo = options(16, true, Impl::Fused);
    {
        torch::NoGradGuard ng;
        auto r = ttt(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, fo);
        EXPECT_FALSE(r.output.requires_grad());
        EXPECT_EQ(r.output.grad_fn(), nullptr);
    }
    {
        c10::InferenceMode im;
        auto r = ttt(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, fo);
        EXPECT_FALSE(r.output.requires_grad());
    }
    auto r = ttt(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, fo);
    ASSERT_NE(r.output.grad_fn(), nullptr);
    EXPECT_NE(r.output.grad_fn()->name().find("TttLinearFused"), std::string::npos) << r.output.grad_fn()->name();
}

// Options the kernel does not fuse: the Linear inner model runs the reference (identical
// numbers); a bad checkpoint interval is an error.
TEST(TttLinearFused, FallbacksAndErrors) {
    TttInputs in = make_inputs(1, 2, 13, 8, 4, 9).to(torch::kFloat64, false);
    RunOptions ro = options(4, true, Impl::Reference);
    ro.inner_model = TttInnerModel::Linear;
    // The linear inner model has no fused kernel: Auto runs the reference, Fused is an error naming it.
    RunOptions ao = ro;
    ao.impl = Impl::Auto;
    auto a = ttt(in.q, in.k, in.v, 0.1 * in.lr, in.lti, in.w0, {}, {}, {}, ro);
    auto b = ttt(in.q, in.k, in.v, 0.1 * in.lr, in.lti, in.w0, {}, {}, {}, ao);
    EXPECT_TRUE(torch::equal(a.output, b.output));
    RunOptions fo = ro;
    fo.impl = Impl::Fused;
    try {
        ttt(in.q, in.k, in.v, 0.1 * in.lr, in.lti, in.w0, {}, {}, {}, fo);
        ADD_FAILURE() << "impl fused accepted the linear inner model";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("ttt_linear: impl 'fused' cannot take this input: inner model 'linear'"),
                  std::string::npos) << e.what();
    }
    RunOptions bad = options(4, true, Impl::Fused, 0);
    EXPECT_THROW(ttt(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, bad),
                 linvis::Error);
    // shape errors are still reported before dispatch
    RunOptions fused = options(4, true, Impl::Fused);
    EXPECT_THROW(ttt(in.q, in.k.narrow(2, 0, 7), in.v, in.lr, in.lti, in.w0, in.b0, in.gamma,
                                         in.beta, fused),
                 linvis::Error);
    // the fused op counts the same FLOPs as the reference
    int64_t ref_flops = 0, fused_flops = 0;
    {
        linvis::flops::Counter c;
        ttt(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta,
                                options(4, true, Impl::Reference));
        ref_flops = c.macs();
    }
    {
        linvis::flops::Counter c;
        ttt(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, fused);
        fused_flops = c.macs();
    }
    EXPECT_EQ(fused_flops, ref_flops);
    EXPECT_GT(ref_flops, 0);
}

// Model level: vittt_tiny with impl=fused equals impl=reference with the same weights
// (logits and the gradient w.r.t. the input images), 80x80 -> T = 25 tokens (remainder 9).
TEST(TttLinearFused, VitttTinyFusedEqualsReference) {
    using linvis::models::create_model;
    using linvis::models::ModelConfig;
    std::map<std::string, std::string> kv = {{"img_size", "80"}, {"depth", "2"}, {"num_classes", "10"}};
    torch::manual_seed(11);
    auto ref_model = create_model("vittt_tiny", ModelConfig(kv));
    kv["impl"] = "fused";
    auto fused_model = create_model("vittt_tiny", ModelConfig(kv));
    {
        torch::NoGradGuard ng;
        auto theirs = ref_model->named_parameters(true);
        for (auto& p : fused_model->named_parameters(true)) {
            const torch::Tensor* value = theirs.find(p.key());
            ASSERT_NE(value, nullptr) << p.key();
            // Non-trivial TTT parameters so that every gradient path carries signal.
            if (p.key().find("learnable_token_idx") != std::string::npos) value->uniform_(-0.05, 0.05);
            p.value().copy_(*value);
        }
    }
    ref_model->train(false);
    fused_model->train(false);
    torch::Tensor images = torch::randn({2, 3, 80, 80});
    torch::Tensor x_ref = images.clone().requires_grad_(true);
    torch::Tensor x_fused = images.clone().requires_grad_(true);
    torch::Tensor logits_ref = ref_model->forward(x_ref);
    torch::Tensor logits_fused = fused_model->forward(x_fused);
    torch::Tensor probe = torch::randn_like(logits_ref);
    (logits_ref * probe).sum().backward();
    (logits_fused * probe).sum().backward();
    const double e_logits = relative_error(logits_fused, logits_ref);
    const double e_grad = relative_error(x_fused.grad(), x_ref.grad());
    std::printf("[ fused ] vittt_tiny 80x80: logits rel err %.2e, input grad rel err %.2e\n", e_logits, e_grad);
    EXPECT_LT(e_logits, 1e-5);
    EXPECT_LT(e_grad, 1e-4);
    EXPECT_TRUE(all_close(logits_fused, logits_ref, 1e-4, 1e-5));
    // parameter gradients of a TTT branch as well
    auto pr = ref_model->named_parameters(true);
    auto pf = fused_model->named_parameters(true);
    for (const char* key : {"blocks.0.forth.W1", "blocks.1.back.learnable_token_idx", "blocks.0.forth.ttt_norm_weight",
                            "blocks.1.forth.q_proj.weight"}) {
        ASSERT_NE(pr.find(key), nullptr) << key;
        EXPECT_LT(relative_error(pf[key].grad(), pr[key].grad()), 1e-4) << key;
    }
}

// Queries and keys given as convolutions of u (ops::TttQkConv, Vision-TTT's conv_q / conv_k).
struct QkConvCase {
    int64_t B, nh, T, d, b, k;
    bool bias;
};

// u as a narrowed (B, T, nh * d) slice of a wider tensor (strided tokens), the convolution weights and biases, and
// the remaining scan inputs; in dtype.
linvis::ops::TttLinearInputs qk_conv_inputs(const QkConvCase& c, torch::ScalarType dtype, uint64_t seed) {
    const TttInputs in = make_inputs(c.B, c.nh, c.T, c.d, c.b, seed).to(dtype, false);
    const int64_t D = c.nh * c.d;
    auto o = torch::TensorOptions().dtype(torch::kFloat64);
    linvis::ops::TttLinearInputs s{{}, {}, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, {}};
    s.qk_conv.u = torch::randn({c.B, c.T, D + 5}, o).to(dtype).narrow(2, 3, D);
    s.qk_conv.q_weight = (0.5 * torch::randn({D, 1, c.k}, o)).to(dtype);
    s.qk_conv.k_weight = (0.5 * torch::randn({D, 1, c.k}, o) / std::sqrt(static_cast<double>(c.d))).to(dtype);
    if (c.bias) {
        s.qk_conv.q_bias = (0.2 * torch::randn({D}, o)).to(dtype);
        s.qk_conv.k_bias = (0.2 * torch::randn({D}, o)).to(dtype);
    }
    return s;
}

// The same scan with xq and xk computed first by the convolution op (Impl impl) and qk_conv cleared.
linvis::ops::TttLinearInputs with_convolutions_done(linvis::ops::TttLinearInputs s, Impl impl) {
    const int64_t nh = s.xv.size(1);
    const linvis::ops::TttQkConv c = s.qk_conv;
    s.xq = linvis::ops::causal_depthwise_conv1d_heads(c.u, c.q_weight, c.q_bias, nh, impl);
    s.xk = linvis::ops::causal_depthwise_conv1d_heads(c.u, c.k_weight, c.k_bias, nh, impl);
    s.qk_conv = linvis::ops::TttQkConv();
    return s;
}

// In inference the fused kernel computes a mini-batch's queries and keys from u's rows: the result is that of the
// fused convolution op followed by the scan (the same float operations: equal on the vectorised targets),
// and close to the reference scan of the reference convolutions, on every SIMD target and dtype; causal and not;
// masked widths, a remainder mini-batch, kernel sizes 4 and 2, with and without biases, a sequence shorter than the
// kernel.
TEST(TttLinearFused, QkConvFoldedEqualsConvolutionsThenScanEveryTarget) {
    // The last: fewer tokens than the kernel's reach (T = 2, k = 4).
    const std::vector<QkConvCase> cases{
        {2, 3, 37, 64, 16, 4, true}, {1, 2, 21, 13, 6, 2, false}, {1, 2, 2, 8, 4, 4, true}};
    linvis::testing::for_each_simd_target([&](const linvis::testing::SimdTarget& t) {
        for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat64})
            for (const QkConvCase& c : cases)
                for (const bool causal : {true, false}) {
                    SCOPED_TRACE(std::string(t.env) + " " + c10::toString(dtype) + " d" + std::to_string(c.d) + " k" +
                                 std::to_string(c.k) + (causal ? " causal" : " non-causal"));
                    RunOptions o = options(c.b, causal, Impl::Fused);
                    o.return_grad_norms = true;
                    const linvis::ops::TttLinearInputs folded = qk_conv_inputs(c, dtype, 300 + c.d);
                    torch::NoGradGuard no_grad;
                    const TttLinearResult f = linvis::ops::ttt_linear_many({folded}, o, Impl::Fused)[0];
                    const TttLinearResult e =
                        linvis::ops::ttt_linear_many({with_convolutions_done(folded, Impl::Fused)}, o, Impl::Fused)[0];
                    const TttLinearResult r = linvis::ops::ttt_linear_many(
                        {with_convolutions_done(folded, Impl::Reference)}, o, Impl::Reference)[0];
                    EXPECT_EQ(f.output.scalar_type(), dtype);
                    if (t.target != linvis::ops::simd::Target::Scalar) {
                        // Both convolutions multiply-add the taps in one order: the same bits (bfloat16: the
                        // queries and keys rounded to bfloat16 as the convolution op's result is).
                        EXPECT_TRUE(torch::equal(f.output, e.output));
                        EXPECT_TRUE(torch::equal(f.final_W, e.final_W));
                        EXPECT_TRUE(torch::equal(f.grad_norms, e.grad_norms));
                    } else {
                        // Without fused multiply-add the convolution op's loop may round each product.
                        const double tol = dtype == torch::kFloat64 ? 1e-12 : dtype == torch::kFloat32 ? 1e-5 : 2e-2;
                        EXPECT_TRUE(all_close(f.output, e.output, tol, tol));
                        EXPECT_TRUE(all_close(f.final_W, e.final_W, tol, tol));
                        EXPECT_TRUE(all_close(f.grad_norms, e.grad_norms, tol, tol));
                    }
                    EXPECT_LT(relative_error(f.output, r.output), dtype == torch::kBFloat16 ? 2e-2 : 1e-5);
                }
    });
}

// Where the kernel does not fold the convolutions (a graph, RoPE, the reference), the op runs them first: the same
// outputs and gradients (conv weights and biases, u) as the explicit convolutions; FLOPs counted alike; inputs that
// contradict each other are errors naming the tensor.
TEST(TttLinearFused, QkConvInGraphsAndErrors) {
    const QkConvCase c{1, 2, 21, 16, 8, 4, true};
    for (const Impl impl : {Impl::Fused, Impl::Reference}) {
        SCOPED_TRACE(linvis::ops::impl_name(impl));
        const RunOptions o = options(c.b, true, impl);
        const linvis::ops::TttLinearInputs base = qk_conv_inputs(c, torch::kFloat32, 77);
        const auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
        linvis::ops::TttLinearInputs folded = base, explicit_convs = base;
        for (auto* s : {&folded, &explicit_convs}) {
            s->qk_conv.u = leaf(base.qk_conv.u);
            s->qk_conv.q_weight = leaf(base.qk_conv.q_weight);
            s->qk_conv.k_bias = leaf(base.qk_conv.k_bias);
        }
        const torch::Tensor out_folded = linvis::ops::ttt_linear_many({folded}, o, impl)[0].output;
        const torch::Tensor out_explicit =
            linvis::ops::ttt_linear_many({with_convolutions_done(explicit_convs, impl)}, o, impl)[0].output;
        ASSERT_NE(out_folded.grad_fn(), nullptr);
        EXPECT_TRUE(torch::equal(out_folded, out_explicit));
        out_folded.square().sum().backward();
        out_explicit.square().sum().backward();
        EXPECT_TRUE(torch::equal(folded.qk_conv.u.grad(), explicit_convs.qk_conv.u.grad()));
        EXPECT_TRUE(torch::equal(folded.qk_conv.q_weight.grad(), explicit_convs.qk_conv.q_weight.grad()));
        EXPECT_TRUE(torch::equal(folded.qk_conv.k_bias.grad(), explicit_convs.qk_conv.k_bias.grad()));
        // FLOPs: the scan's and both convolutions', folded or not.
        torch::NoGradGuard no_grad;
        int64_t macs_folded = 0, macs_explicit = 0;
        {
            linvis::flops::Counter counter;
            linvis::ops::ttt_linear_many({base}, o, impl);
            macs_folded = counter.macs();
        }
        {
            linvis::flops::Counter counter;
            linvis::ops::ttt_linear_many({with_convolutions_done(base, impl)}, o, impl);
            macs_explicit = counter.macs();
        }
        EXPECT_EQ(macs_folded, macs_explicit);
    }
    // RoPE: applied to the convolutions' results, so not folded; the same as the explicit convolutions.
    {
        torch::NoGradGuard no_grad;
        RunOptions o = options(c.b, true, Impl::Fused);
        o.use_rope = true;
        const linvis::ops::TttLinearInputs base = qk_conv_inputs(c, torch::kFloat32, 78);
        EXPECT_TRUE(torch::equal(linvis::ops::ttt_linear_many({base}, o, Impl::Fused)[0].output,
                                 linvis::ops::ttt_linear_many({with_convolutions_done(base, Impl::Auto)}, o,
                                                              Impl::Fused)[0].output));
    }
    const auto expect_error = [&](linvis::ops::TttLinearInputs s, const std::string& needle) {
        try {
            linvis::ops::ttt_linear_many({s}, options(c.b, true, Impl::Fused), Impl::Fused);
            ADD_FAILURE() << "accepted: " << needle;
        } catch (const linvis::Error& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    const linvis::ops::TttLinearInputs base = qk_conv_inputs(c, torch::kFloat32, 79);
    linvis::ops::TttLinearInputs both = base;
    both.xq = with_convolutions_done(base, Impl::Auto).xq;
    expect_error(both, "xq and xk must be undefined when qk_conv.u gives them");
    linvis::ops::TttLinearInputs short_u = base;
    short_u.qk_conv.u = base.qk_conv.u.narrow(1, 0, 20);
    expect_error(short_u, "ttt_linear: qk_conv.u: expected [1, 21, 32]");
    linvis::ops::TttLinearInputs kernels = base;
    kernels.qk_conv.k_weight = base.qk_conv.k_weight.narrow(2, 0, 3);
    expect_error(kernels, "the q and k kernels differ in size (4 and 3)");
    linvis::ops::TttLinearInputs dtype = base;
    dtype.qk_conv.q_bias = base.qk_conv.q_bias.to(torch::kFloat64);
    expect_error(dtype, "qk_conv.q_bias: expected dtype Float (as xv), got Double");
    linvis::ops::TttLinearInputs no_keys = base;
    no_keys.qk_conv = linvis::ops::TttQkConv();
    expect_error(no_keys, "ttt_linear: xq: expected shape [1, 2, 21, 16] (as xv), got undefined");
}

// Several scans in one call (ops::ttt_linear_many; vittt's two directions): each result equals the single
// scan's, fused (one parallel region in inference, one autograd node per scan with gradients) and
// reference, on every SIMD target; scans of different sizes; more (sample, head) tasks than threads and fewer.
TEST(TttLinearFused, ManyScansEqualSingleScansEveryTarget) {
    const TttInputs a = make_inputs(1, 3, 37, 8, 4, 11).to(torch::kFloat32, false);
    const TttInputs b = make_inputs(2, 1, 20, 8, 4, 12, /*batched_state=*/true).to(torch::kFloat32, false);
    const TttInputs c = make_inputs(1, 3, 37, 8, 4, 13).to(torch::kFloat32, false);
    auto many_inputs = [](const std::vector<const TttInputs*>& list) {
        std::vector<linvis::ops::TttLinearInputs> scans;
        for (const TttInputs* in : list)
            scans.push_back({in->q, in->k, in->v, in->lr, in->lti, in->w0, in->b0, in->gamma, in->beta, {}});
        return scans;
    };
    const std::vector<const TttInputs*> list{&a, &b, &c};
    // 8 tasks on 3 threads: runs of 3, 3, 2 cut scan b (tasks 3 and 4) between two threads.
    const int threads = at::get_num_threads();
    at::set_num_threads(3);
    linvis::testing::for_each_simd_target([&](const linvis::testing::SimdTarget& t) {
        for (const Impl impl : {Impl::Fused, Impl::Reference}) {
            RunOptions o = options(4, /*causal=*/true, impl);
            o.return_grad_norms = true;
            torch::NoGradGuard no_grad;
            const auto results = linvis::ops::ttt_linear_many(many_inputs(list), o, impl);
            ASSERT_EQ(results.size(), list.size());
            for (size_t i = 0; i < list.size(); ++i) {
                const TttInputs& in = *list[i];
                const TttLinearResult one = ttt(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, o);
                SCOPED_TRACE(std::string(t.env) + " " + linvis::ops::impl_name(impl) + " scan " + std::to_string(i));
                // The same kernel on the same inputs: the same bits, whichever thread ran a task.
                EXPECT_TRUE(torch::equal(results[i].output, one.output));
                EXPECT_TRUE(torch::equal(results[i].final_W, one.final_W));
                EXPECT_TRUE(torch::equal(results[i].final_b, one.final_b));
                EXPECT_TRUE(torch::equal(results[i].grad_norms, one.grad_norms));
            }
        }
    });
    at::set_num_threads(threads);
    // With gradients: each scan's gradients are those of its single call.
    const TttInputs ga = a.to(torch::kFloat32, true), gb = b.to(torch::kFloat32, true);
    const RunOptions o = options(4, /*causal=*/true, Impl::Fused);
    const auto results = linvis::ops::ttt_linear_many(many_inputs({&ga, &gb}), o, Impl::Fused);
    (results[0].output.sum() + 2.0 * results[1].output.square().sum()).backward();
    const TttInputs sa = a.to(torch::kFloat32, true), sb = b.to(torch::kFloat32, true);
    ttt(sa.q, sa.k, sa.v, sa.lr, sa.lti, sa.w0, sa.b0, sa.gamma, sa.beta, o).output.sum().backward();
    (2.0 * ttt(sb.q, sb.k, sb.v, sb.lr, sb.lti, sb.w0, sb.b0, sb.gamma, sb.beta, o).output.square().sum()).backward();
    for (size_t i = 0; i < 9; ++i) {
        SCOPED_TRACE(kInputNames[i]);
        EXPECT_TRUE(torch::equal(ga.list()[i].grad(), sa.list()[i].grad()));
        EXPECT_TRUE(torch::equal(gb.list()[i].grad(), sb.list()[i].grad()));
    }
    // A scan of another dtype in the same call is an error naming both.
    const TttInputs d64 = make_inputs(1, 3, 37, 8, 4, 14);
    try {
        linvis::ops::ttt_linear_many(many_inputs({&a, &d64}), o, Impl::Fused);
        FAIL() << "mixed dtypes accepted";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("scan 1 has dtype Double"), std::string::npos) << e.what();
    }
}
