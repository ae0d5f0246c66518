// Fused CPU TTT-Linear: one task per (sample, head) walks the mini-batches keeping the inner
// state (W, b) in a small buffer; each mini-batch is a handful of <= 64x64 dense products done
// by the SIMD layer's register-blocked GEMM. The backward recomputes states from sparse checkpoints.
// Derivation and memory formula: docs/perf_ttt_linear.md.
//
// Highway compiles the scan (cpu_kernels.h) once per SIMD target (ops/simd/simd.h): this file is
// re-included by hwy/foreach_target.h; the LibTorch part below HWY_ONCE is compiled once.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/ttt_linear/cpu.cpp"
#include "ops/simd/hwy_targets.h"
// clang-format off
#include <hwy/foreach_target.h>
#include <hwy/highway.h>
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "ops/simd/gemm-inl.h"
#include "ops/ttt_linear/scan_args.h"

HWY_BEFORE_NAMESPACE();
namespace linvis::ops::cpu::HWY_NAMESPACE {

using simd::HWY_NAMESPACE::Vec;

#include "ops/ttt_linear/cpu_kernels.h"

template <typename In, typename T>
void scan_forward_range(const ScanArgs& a, int64_t begin, int64_t end) {
    MiniBatchWork<Vec<T>> w;
    w.init(a.d, a.bmax, false);
    for (int64_t bh = begin; bh < end; ++bh) scan_forward<Vec<T>, In>(a, bh, w);
}

template <typename In, typename T>
void scan_backward_range(const ScanArgs& a, int64_t begin, int64_t end) {
    std::vector<T> states;
    MiniBatchWork<Vec<T>> w;
    w.init(a.d, a.bmax, true);
    for (int64_t bh = begin; bh < end; ++bh) scan_backward<Vec<T>, In>(a, bh, w, states);
}

const ScanFns& scan_fns() {
    static const ScanFns f{
        {scan_forward_range<float, float>, scan_forward_range<double, double>,
         scan_forward_range<c10::BFloat16, float>},
        {scan_backward_range<float, float>, scan_backward_range<double, double>,
         scan_backward_range<c10::BFloat16, float>}};
    return f;
}

}  // namespace linvis::ops::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "ops/ttt_linear/cpu.h"

#include <ATen/Parallel.h>

#include "linvis/core/error.h"
#include "ops/simd/per_target.h"
#include "ops/simd/simd.h"

namespace linvis::ops::cpu {
namespace {


void copy_strides(const torch::Tensor& t, int64_t* s) {
    for (int i = 0; i < 4; ++i) s[i] = t.stride(i);
}

// (B, nh, T, d) tensor whose memory is (B, T, nh, d): what the model reshapes to (B, T, D) for free.
torch::Tensor empty_token_major(int64_t B, int64_t nh, int64_t T, int64_t d, const torch::TensorOptions& o) {
    return torch::empty({B, T, nh, d}, o).permute({0, 2, 1, 3});
}

// The scan functions of the target chosen once per op call (saved for the backward, so both passes
// run the same code).
const ScanFns& scan_fns(simd::Target t) {
    LINVIS_SIMD_PER_TARGET(t, scan_fns)
}

template <typename In>
constexpr int dtype_index() {
    return std::is_same_v<In, float> ? 0 : std::is_same_v<In, double> ? 1 : 2;
}

// The (sample, head) tasks of all scans in one parallel region, each thread taking a contiguous run of
// the concatenated task list.
template <typename In>
void run_forward_tasks(const std::vector<ScanArgs>& scans, simd::Target target) {
    const auto fn = scan_fns(target).forward[dtype_index<In>()];
    int64_t total = 0;
    for (const ScanArgs& a : scans) total += a.B * a.nh;
    at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
        int64_t first = 0;  // global index of the current scan's first task
        for (const ScanArgs& a : scans) {
            const int64_t count = a.B * a.nh;
            const int64_t lo = std::max(begin, first), hi = std::min(end, first + count);
            if (lo < hi) fn(a, lo - first, hi - first);
            first += count;
        }
    });
}

template <typename In>
void run_backward_tasks(const ScanArgs& a, simd::Target target) {
    const auto fn = scan_fns(target).backward[dtype_index<In>()];
    at::parallel_for(0, a.B * a.nh, 1, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
}

struct Config {
    int64_t bmax = 16;
    int64_t ckpt_every = 4;
    bool causal = true;
    double eps = 1e-6;
    bool want_norms = false;
    simd::Target target = simd::Target::Scalar;
};

torch::ScalarType compute_type(torch::ScalarType in) {
    return in == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// Small inputs in the compute type, contiguous, states tiled to (B, nh, ...).
struct SmallInputs {
    torch::Tensor lr, tau, gamma, beta, w0, b0;
};

SmallInputs small_inputs(const torch::Tensor& xq, const torch::Tensor& lr, const torch::Tensor& tau,
                         const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& gamma,
                         const torch::Tensor& beta) {
    const int64_t B = xq.size(0), nh = xq.size(1), d = xq.size(3);
    const auto ct = compute_type(xq.scalar_type());
    SmallInputs s;
    s.lr = lr.to(ct).contiguous();
    s.tau = tau.to(ct).contiguous();
    s.gamma = gamma.to(ct).contiguous();
    s.beta = beta.to(ct).contiguous();
    s.w0 = (w0.dim() == 4 ? w0 : w0.unsqueeze(0)).to(ct).expand({B, nh, d, d}).contiguous();
    s.b0 = (b0.dim() == 4 ? b0 : b0.unsqueeze(0)).to(ct).expand({B, nh, 1, d}).contiguous();
    return s;
}

struct ForwardOut {
    torch::Tensor out, final_W, final_b, norms, ckpt;
};

template <typename F>
void dispatch_dtype(torch::ScalarType st, F&& f) {
    switch (st) {
        case torch::kFloat32: f(float{}, float{}); break;
        case torch::kFloat64: f(double{}, double{}); break;
        case torch::kBFloat16: f(c10::BFloat16{}, float{}); break;
        default: fail("ttt_linear (fused): unsupported dtype ", st, " (float32, float64 and bfloat16 are)");
    }
}

// The scan's inputs, shared by the forward pass and the recomputing backward pass.
ScanArgs scan_inputs(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                     const SmallInputs& s, const Config& cfg) {
    ScanArgs a;
    a.B = xq.size(0); a.nh = xq.size(1); a.T = xq.size(2); a.d = xq.size(3);
    a.bmax = cfg.bmax; a.ckpt_every = cfg.ckpt_every; a.causal = cfg.causal; a.eps = cfg.eps;
    a.q = xq.data_ptr(); a.k = xk.data_ptr(); a.v = xv.data_ptr();
    copy_strides(xq, a.qs); copy_strides(xk, a.ks); copy_strides(xv, a.vs);
    a.lr = s.lr.data_ptr(); a.tau = s.tau.data_ptr(); a.gamma = s.gamma.data_ptr(); a.beta = s.beta.data_ptr();
    a.w0 = s.w0.data_ptr(); a.b0 = s.b0.data_ptr();
    return a;
}

// Allocates one scan's outputs and points its arguments at them.
ForwardOut prepare_forward(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                           const SmallInputs& s, const Config& cfg, bool checkpoints, ScanArgs& a) {
    const int64_t B = xq.size(0), nh = xq.size(1), T = xq.size(2), d = xq.size(3);
    const auto ct = compute_type(xq.scalar_type());
    auto copt = xq.options().dtype(ct);
    ForwardOut r;
    r.out = empty_token_major(B, nh, T, d, xq.options());
    r.final_W = torch::empty({B, nh, d, d}, copt);
    r.final_b = torch::empty({B, nh, 1, d}, copt);
    if (cfg.want_norms) r.norms = torch::empty({B, nh, T}, copt);
    const int64_t nmb = (T + cfg.bmax - 1) / cfg.bmax;
    const int64_t ngroups = (nmb + cfg.ckpt_every - 1) / cfg.ckpt_every;
    if (checkpoints) r.ckpt = torch::empty({B * nh, ngroups, d * d + d}, copt);

    a = scan_inputs(xq, xk, xv, s, cfg);
    a.out = r.out.data_ptr(); copy_strides(r.out, a.outs);
    a.final_W = r.final_W.data_ptr(); a.final_b = r.final_b.data_ptr();
    a.grad_norms = cfg.want_norms ? r.norms.data_ptr() : nullptr;
    a.ckpt = checkpoints ? r.ckpt.data_ptr() : nullptr;
    return r;
}

ForwardOut run_forward(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                       const SmallInputs& s, const Config& cfg, bool checkpoints) {
    std::vector<ScanArgs> args(1);
    ForwardOut r = prepare_forward(xq, xk, xv, s, cfg, checkpoints, args[0]);
    dispatch_dtype(xq.scalar_type(), [&](auto in, auto acc) { run_forward_tasks<decltype(in)>(args, cfg.target); });
    return r;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class TttLinearFusedFunction : public torch::autograd::Function<TttLinearFusedFunction> {
public:
    static variable_list forward(AutogradContext* ctx, const torch::Tensor& xq, const torch::Tensor& xk,
                                 const torch::Tensor& xv, const torch::Tensor& lr, const torch::Tensor& tau,
                                 const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& gamma,
                                 const torch::Tensor& beta, int64_t bmax, int64_t ckpt_every, bool causal, double eps,
                                 bool want_norms, int64_t target) {
        Config cfg{bmax, ckpt_every, causal, eps, want_norms, static_cast<simd::Target>(target)};
        SmallInputs s = small_inputs(xq, lr, tau, w0, b0, gamma, beta);
        ForwardOut r = run_forward(xq, xk, xv, s, cfg, true);
        ctx->save_for_backward({xq, xk, xv, lr, tau, w0, b0, gamma, beta, r.ckpt});
        ctx->saved_data["bmax"] = bmax;
        ctx->saved_data["ckpt_every"] = ckpt_every;
        ctx->saved_data["causal"] = causal;
        ctx->saved_data["eps"] = eps;
        ctx->saved_data["target"] = target;
        torch::Tensor norms = want_norms ? r.norms.to(xq.scalar_type()) : torch::empty({0}, xq.options());
        ctx->mark_non_differentiable({norms});
        return {r.out, r.final_W.to(xq.scalar_type()), r.final_b.to(xq.scalar_type()), norms};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const torch::Tensor &xq = saved[0], &xk = saved[1], &xv = saved[2], &lr = saved[3], &tau = saved[4],
                            &w0 = saved[5], &b0 = saved[6], &gamma = saved[7], &beta = saved[8], &ckpt = saved[9];
        Config cfg;
        cfg.bmax = ctx->saved_data["bmax"].toInt();
        cfg.ckpt_every = ctx->saved_data["ckpt_every"].toInt();
        cfg.causal = ctx->saved_data["causal"].toBool();
        cfg.eps = ctx->saved_data["eps"].toDouble();
        cfg.target = static_cast<simd::Target>(ctx->saved_data["target"].toInt());
        const int64_t B = xq.size(0), nh = xq.size(1), T = xq.size(2), d = xq.size(3);
        const auto ct = compute_type(xq.scalar_type());
        auto copt = xq.options().dtype(ct);
        SmallInputs s = small_inputs(xq, lr, tau, w0, b0, gamma, beta);

        torch::Tensor dout = grads[0].defined() ? grads[0] : torch::zeros({B, nh, T, d}, xq.options());
        torch::Tensor dW = grads[1].defined() ? grads[1].to(ct).contiguous().clone()
                                              : torch::zeros({B, nh, d, d}, copt);
        torch::Tensor db = grads[2].defined() ? grads[2].to(ct).contiguous().clone()
                                              : torch::zeros({B, nh, 1, d}, copt);
        torch::Tensor dq = torch::empty_like(xq), dk = torch::empty_like(xk), dv = torch::empty_like(xv);
        torch::Tensor dlr = torch::empty({B, nh, T}, copt);
        torch::Tensor dgamma = torch::zeros({B, nh, d}, copt), dbeta = torch::zeros({B, nh, d}, copt);
        torch::Tensor dtau = torch::zeros({B * nh, cfg.bmax}, copt);

        ScanArgs a = scan_inputs(xq, xk, xv, s, cfg);
        a.ckpt = ckpt.data_ptr();
        a.dout = dout.data_ptr(); copy_strides(dout, a.douts);
        a.dq = dq.data_ptr(); a.dk = dk.data_ptr(); a.dv = dv.data_ptr();
        copy_strides(dq, a.dqs); copy_strides(dk, a.dks); copy_strides(dv, a.dvs);
        a.dlr = dlr.data_ptr(); a.dW0 = dW.data_ptr(); a.db0 = db.data_ptr();
        a.dgamma = dgamma.data_ptr(); a.dbeta = dbeta.data_ptr(); a.dtau = dtau.data_ptr();
        dispatch_dtype(xq.scalar_type(), [&](auto in, auto acc) {
            run_backward_tasks<decltype(in)>(a, cfg.target);
        });

        const auto st = xq.scalar_type();
        torch::Tensor dw0 = w0.dim() == 4 ? dW : dW.sum(0);
        torch::Tensor db0 = b0.dim() == 4 ? db : db.sum(0);
        return {dq,
                dk,
                dv,
                dlr.to(st),
                dtau.sum(0).to(tau.scalar_type()),
                dw0.to(w0.scalar_type()),
                db0.to(b0.scalar_type()),
                dgamma.sum(0).to(gamma.scalar_type()),
                dbeta.sum(0).to(beta.scalar_type()),
                torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
};

}  // namespace

namespace {

TttLinearResult result_of(const ForwardOut& r, const TttLinearOptions& options, torch::ScalarType st) {
    TttLinearResult result;
    result.output = r.out;
    if (options.return_final_state) {
        result.final_W = r.final_W.to(st);
        result.final_b = r.final_b.to(st);
    }
    if (options.return_grad_norms) result.grad_norms = r.norms.to(st);
    return result;
}

bool needs_grad(const TttLinearInputs& in, const torch::Tensor& tau) {
    if (!torch::GradMode::is_enabled()) return false;
    for (const torch::Tensor* t : {&in.xq, &in.xk, &in.xv, &in.lr, &tau, &in.w0, &in.b0, &in.ln_weight, &in.ln_bias})
        if (t->requires_grad()) return true;
    return false;
}

}  // namespace

std::vector<TttLinearResult> ttt_linear_fused_many(const std::vector<TttLinearInputs>& scans,
                                                   const std::vector<torch::Tensor>& taus,
                                                   const TttLinearOptions& options) {
    LINVIS_CHECK(options.inner_model == TttInnerModel::ResidualLayerNorm,
                 "ttt_linear (fused): only the ResidualLayerNorm inner model is fused");
    LINVIS_CHECK(options.checkpoint_every >= 1, "ttt_linear (fused): checkpoint_every must be >= 1, got ",
                 options.checkpoint_every);
    LINVIS_CHECK(taus.size() == scans.size(), "ttt_linear (fused): ", scans.size(), " scans but ", taus.size(),
                 " token coefficients");
    const simd::Target target = simd::active_target();
    bool any_grad = false;
    for (size_t i = 0; i < scans.size(); ++i) {
        LINVIS_CHECK(scans[i].xq.device().is_cpu(), "ttt_linear (fused): CPU tensors only, got ",
                     scans[i].xq.device());
        LINVIS_CHECK(scans[i].xq.scalar_type() == scans[0].xq.scalar_type(), "ttt_linear (fused): scan ", i,
                     " has dtype ", scans[i].xq.scalar_type(), ", scan 0 ", scans[0].xq.scalar_type(),
                     " (one call runs one dtype)");
        any_grad = any_grad || needs_grad(scans[i], taus[i]);
    }
    std::vector<TttLinearResult> results;
    if (!any_grad) {
        // Inference: no checkpoints, nothing saved, every scan's tasks in one parallel region.
        const Config cfg{options.mini_batch_size, options.checkpoint_every, options.causal, options.eps,
                         options.return_grad_norms, target};
        std::vector<SmallInputs> small;
        std::vector<ForwardOut> outs;
        std::vector<ScanArgs> args(scans.size());
        for (size_t i = 0; i < scans.size(); ++i) {
            const TttLinearInputs& in = scans[i];
            small.push_back(small_inputs(in.xq, in.lr, taus[i], in.w0, in.b0, in.ln_weight, in.ln_bias));
            outs.push_back(prepare_forward(in.xq, in.xk, in.xv, small.back(), cfg, false, args[i]));
        }
        if (!scans.empty())
            dispatch_dtype(scans[0].xq.scalar_type(),
                           [&](auto in, auto acc) { run_forward_tasks<decltype(in)>(args, cfg.target); });
        for (size_t i = 0; i < scans.size(); ++i)
            results.push_back(result_of(outs[i], options, scans[i].xq.scalar_type()));
        return results;
    }
    for (size_t i = 0; i < scans.size(); ++i) {
        const TttLinearInputs& in = scans[i];
        variable_list outs = TttLinearFusedFunction::apply(
            in.xq, in.xk, in.xv, in.lr, taus[i], in.w0, in.b0, in.ln_weight, in.ln_bias, options.mini_batch_size,
            options.checkpoint_every, options.causal, options.eps, options.return_grad_norms,
            static_cast<int64_t>(target));
        TttLinearResult result;
        result.output = outs[0];
        if (options.return_final_state) {
            result.final_W = outs[1];
            result.final_b = outs[2];
        }
        if (options.return_grad_norms) result.grad_norms = outs[3];
        results.push_back(result);
    }
    return results;
}

}  // namespace linvis::ops::cpu
#endif  // HWY_ONCE
