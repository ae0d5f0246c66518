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
    scan_forward<Vec<T>, In>(a, begin, end, w);
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
#include "ops/records_graph.h"
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
void run_tasks(const std::vector<ScanArgs>& scans, ScanRange fn) {
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
void run_forward_tasks(const std::vector<ScanArgs>& scans, simd::Target target) {
    run_tasks(scans, scan_fns(target).forward[dtype_index<In>()]);
}

template <typename In>
void run_backward_tasks(const std::vector<ScanArgs>& scans, simd::Target target) {
    run_tasks(scans, scan_fns(target).backward[dtype_index<In>()]);
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

// Small inputs in the compute type, contiguous, states tiled to (B, nh, ...); the folded convolutions' taps
// (k, nh * d) and biases (zeros when undefined).
struct SmallInputs {
    torch::Tensor lr, tau, gamma, beta, w0, b0, q_taps, q_bias, k_taps, k_bias;
};

// xv gives the shape and dtype (B, nh, T, d).
SmallInputs small_inputs(const torch::Tensor& xv, const torch::Tensor& lr, const torch::Tensor& tau,
                         const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& gamma,
                         const torch::Tensor& beta, const TttQkConv* qk_conv = nullptr) {
    const int64_t B = xv.size(0), nh = xv.size(1), d = xv.size(3);
    const auto ct = compute_type(xv.scalar_type());
    SmallInputs s;
    s.lr = lr.to(ct).contiguous();
    s.tau = tau.to(ct).contiguous();
    s.gamma = gamma.to(ct).contiguous();
    s.beta = beta.to(ct).contiguous();
    s.w0 = (w0.dim() == 4 ? w0 : w0.unsqueeze(0)).to(ct).expand({B, nh, d, d}).contiguous();
    s.b0 = (b0.dim() == 4 ? b0 : b0.unsqueeze(0)).to(ct).expand({B, nh, 1, d}).contiguous();
    if (qk_conv != nullptr && qk_conv->u.defined()) {
        const auto taps = [&](const torch::Tensor& w) { return w.to(ct).squeeze(1).t().contiguous(); };
        const auto bias = [&](const torch::Tensor& b) {
            return b.defined() ? b.to(ct).contiguous() : torch::zeros({nh * d}, xv.options().dtype(ct));
        };
        s.q_taps = taps(qk_conv->q_weight);
        s.k_taps = taps(qk_conv->k_weight);
        s.q_bias = bias(qk_conv->q_bias);
        s.k_bias = bias(qk_conv->k_bias);
    }
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

// The scan's inputs, shared by the forward pass and the recomputing backward pass. xq and xk are undefined
// when the small inputs carry the convolutions that give them (u, a TttQkConv).
ScanArgs scan_inputs(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                     const SmallInputs& s, const Config& cfg, const torch::Tensor& u = torch::Tensor()) {
    ScanArgs a;
    a.B = xv.size(0); a.nh = xv.size(1); a.T = xv.size(2); a.d = xv.size(3);
    a.bmax = cfg.bmax; a.ckpt_every = cfg.ckpt_every; a.causal = cfg.causal; a.eps = cfg.eps;
    a.v = xv.data_ptr();
    copy_strides(xv, a.vs);
    if (u.defined()) {
        a.u = u.data_ptr();
        for (int i = 0; i < 3; ++i) a.us[i] = u.stride(i);
        a.q_taps = s.q_taps.data_ptr(); a.q_bias = s.q_bias.data_ptr();
        a.k_taps = s.k_taps.data_ptr(); a.k_bias = s.k_bias.data_ptr();
        a.conv_k = s.q_taps.size(0);
        a.kernels = &simd::kernels();
    } else {
        a.q = xq.data_ptr(); a.k = xk.data_ptr();
        copy_strides(xq, a.qs); copy_strides(xk, a.ks);
    }
    a.lr = s.lr.data_ptr(); a.tau = s.tau.data_ptr(); a.gamma = s.gamma.data_ptr(); a.beta = s.beta.data_ptr();
    a.w0 = s.w0.data_ptr(); a.b0 = s.b0.data_ptr();
    return a;
}

// Allocates one scan's outputs and points its arguments at them.
ForwardOut prepare_forward(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                           const SmallInputs& s, const Config& cfg, bool checkpoints, ScanArgs& a,
                           const torch::Tensor& u) {
    const int64_t B = xv.size(0), nh = xv.size(1), T = xv.size(2), d = xv.size(3);
    const auto ct = compute_type(xv.scalar_type());
    auto copt = xv.options().dtype(ct);
    ForwardOut r;
    r.out = empty_token_major(B, nh, T, d, xv.options());
    r.final_W = torch::empty({B, nh, d, d}, copt);
    r.final_b = torch::empty({B, nh, 1, d}, copt);
    if (cfg.want_norms) r.norms = torch::empty({B, nh, T}, copt);
    const int64_t nmb = (T + cfg.bmax - 1) / cfg.bmax;
    const int64_t ngroups = (nmb + cfg.ckpt_every - 1) / cfg.ckpt_every;
    if (checkpoints) r.ckpt = torch::empty({B * nh, ngroups, d * d + d}, copt);

    a = scan_inputs(xq, xk, xv, s, cfg, u);
    a.out = r.out.data_ptr(); copy_strides(r.out, a.outs);
    a.final_W = r.final_W.data_ptr(); a.final_b = r.final_b.data_ptr();
    a.grad_norms = cfg.want_norms ? r.norms.data_ptr() : nullptr;
    a.ckpt = checkpoints ? r.ckpt.data_ptr() : nullptr;
    return r;
}

// kScanInputs tensors per scan: xq, xk, xv, lr, tau, w0, b0, gamma, beta (the Function's inputs below).
constexpr size_t kScanInputs = 9;

// Every scan's outputs, all scans' tasks in one parallel region; `in` holds kScanInputs tensors per scan, and
// `qk_convs` (one per scan, or null) the convolutions of the scans whose xq and xk are undefined.
std::vector<ForwardOut> forward_all(const torch::Tensor* in, size_t scans, const Config& cfg, bool checkpoints,
                                    const TttQkConv* qk_convs = nullptr) {
    std::vector<SmallInputs> small;
    std::vector<ForwardOut> outs;
    std::vector<ScanArgs> args(scans);
    small.reserve(scans);
    for (size_t i = 0; i < scans; ++i) {
        const torch::Tensor* t = in + i * kScanInputs;
        const TttQkConv* conv = qk_convs != nullptr ? qk_convs + i : nullptr;
        small.push_back(small_inputs(t[2], t[3], t[4], t[5], t[6], t[7], t[8], conv));
        outs.push_back(prepare_forward(t[0], t[1], t[2], small.back(), cfg, checkpoints, args[i],
                                       conv != nullptr ? conv->u : torch::Tensor()));
    }
    if (scans > 0)
        dispatch_dtype(in[2].scalar_type(),
                       [&](auto x, auto acc) { run_forward_tasks<decltype(x)>(args, cfg.target); });
    return outs;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The scans of one ttt_linear_many call as one autograd node: kScanInputs input tensors per scan, and
// kScanOutputs outputs per scan (out, final_W, final_b, norms). Forward and backward each run every scan's
// tasks in one parallel region.
constexpr size_t kScanOutputs = 4;

class TttLinearFusedFunction : public torch::autograd::Function<TttLinearFusedFunction> {
public:
    static variable_list forward(AutogradContext* ctx, torch::TensorList inputs, int64_t bmax, int64_t ckpt_every,
                                 bool causal, double eps, bool want_norms, int64_t target) {
        const Config cfg{bmax, ckpt_every, causal, eps, want_norms, static_cast<simd::Target>(target)};
        const size_t n = inputs.size() / kScanInputs;
        const std::vector<ForwardOut> outs = forward_all(inputs.data(), n, cfg, /*checkpoints=*/true);
        variable_list saved(inputs.begin(), inputs.end()), results, norms;
        for (size_t i = 0; i < n; ++i) {
            const auto st = inputs[i * kScanInputs].scalar_type();
            saved.push_back(outs[i].ckpt);
            norms.push_back(want_norms ? outs[i].norms.to(st) : torch::empty({0}, inputs[i * kScanInputs].options()));
            results.insert(results.end(), {outs[i].out, outs[i].final_W.to(st), outs[i].final_b.to(st), norms.back()});
        }
        ctx->save_for_backward(saved);
        ctx->saved_data["scans"] = static_cast<int64_t>(n);
        ctx->saved_data["bmax"] = bmax;
        ctx->saved_data["ckpt_every"] = ckpt_every;
        ctx->saved_data["causal"] = causal;
        ctx->saved_data["eps"] = eps;
        ctx->saved_data["target"] = target;
        ctx->mark_non_differentiable(norms);
        return results;
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const size_t n = static_cast<size_t>(ctx->saved_data["scans"].toInt());
        Config cfg;
        cfg.bmax = ctx->saved_data["bmax"].toInt();
        cfg.ckpt_every = ctx->saved_data["ckpt_every"].toInt();
        cfg.causal = ctx->saved_data["causal"].toBool();
        cfg.eps = ctx->saved_data["eps"].toDouble();
        cfg.target = static_cast<simd::Target>(ctx->saved_data["target"].toInt());
        struct Grads {
            torch::Tensor dq, dk, dv, dlr, dW, db, dgamma, dbeta, dtau, dout;
        };
        std::vector<SmallInputs> small;
        std::vector<Grads> g(n);
        std::vector<ScanArgs> args(n);
        for (size_t i = 0; i < n; ++i) {
            const torch::Tensor* in = saved.data() + i * kScanInputs;
            const torch::Tensor &xq = in[0], &xk = in[1], &xv = in[2], &ckpt = saved[n * kScanInputs + i];
            const int64_t B = xq.size(0), nh = xq.size(1), T = xq.size(2), d = xq.size(3);
            const auto copt = xq.options().dtype(compute_type(xq.scalar_type()));
            const torch::Tensor* go = grads.data() + i * kScanOutputs;
            small.push_back(small_inputs(xv, in[3], in[4], in[5], in[6], in[7], in[8]));
            Grads& r = g[i];
            r.dout = go[0].defined() ? go[0] : torch::zeros({B, nh, T, d}, xq.options());
            r.dW = go[1].defined() ? go[1].to(copt.dtype()).contiguous().clone() : torch::zeros({B, nh, d, d}, copt);
            r.db = go[2].defined() ? go[2].to(copt.dtype()).contiguous().clone() : torch::zeros({B, nh, 1, d}, copt);
            r.dq = torch::empty_like(xq); r.dk = torch::empty_like(xk); r.dv = torch::empty_like(xv);
            r.dlr = torch::empty({B, nh, T}, copt);
            r.dgamma = torch::zeros({B, nh, d}, copt); r.dbeta = torch::zeros({B, nh, d}, copt);
            r.dtau = torch::zeros({B * nh, cfg.bmax}, copt);
            ScanArgs& a = args[i];
            a = scan_inputs(xq, xk, xv, small.back(), cfg);
            a.ckpt = ckpt.data_ptr();
            a.dout = r.dout.data_ptr(); copy_strides(r.dout, a.douts);
            a.dq = r.dq.data_ptr(); a.dk = r.dk.data_ptr(); a.dv = r.dv.data_ptr();
            copy_strides(r.dq, a.dqs); copy_strides(r.dk, a.dks); copy_strides(r.dv, a.dvs);
            a.dlr = r.dlr.data_ptr(); a.dW0 = r.dW.data_ptr(); a.db0 = r.db.data_ptr();
            a.dgamma = r.dgamma.data_ptr(); a.dbeta = r.dbeta.data_ptr(); a.dtau = r.dtau.data_ptr();
        }
        dispatch_dtype(saved[0].scalar_type(),
                       [&](auto in, auto acc) { run_backward_tasks<decltype(in)>(args, cfg.target); });

        variable_list out;
        for (size_t i = 0; i < n; ++i) {
            const torch::Tensor* in = saved.data() + i * kScanInputs;
            const torch::Tensor &tau = in[4], &w0 = in[5], &b0 = in[6], &gamma = in[7], &beta = in[8];
            const Grads& r = g[i];
            const auto st = in[0].scalar_type();
            const torch::Tensor dw0 = w0.dim() == 4 ? r.dW : r.dW.sum(0);
            const torch::Tensor db0 = b0.dim() == 4 ? r.db : r.db.sum(0);
            out.insert(out.end(), {r.dq, r.dk, r.dv, r.dlr.to(st), r.dtau.sum(0).to(tau.scalar_type()),
                                   dw0.to(w0.scalar_type()), db0.to(b0.scalar_type()),
                                   r.dgamma.sum(0).to(gamma.scalar_type()), r.dbeta.sum(0).to(beta.scalar_type())});
        }
        out.resize(out.size() + 6);  // bmax, ckpt_every, causal, eps, want_norms, target
        return out;
    }
};

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
    return records_graph({in.xq, in.xk, in.xv, in.lr, tau, in.w0, in.b0, in.ln_weight, in.ln_bias});
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
    bool any_grad = false, any_qk_conv = false;
    std::vector<torch::Tensor> inputs;  // kScanInputs per scan
    std::vector<TttQkConv> qk_convs;
    for (size_t i = 0; i < scans.size(); ++i) {
        const TttLinearInputs& in = scans[i];  // one dtype for all: ops::ttt_linear_many checked it
        LINVIS_CHECK(in.xv.device().is_cpu(), "ttt_linear (fused): CPU tensors only, got ", in.xv.device());
        inputs.insert(inputs.end(), {in.xq, in.xk, in.xv, in.lr, taus[i], in.w0, in.b0, in.ln_weight, in.ln_bias});
        qk_convs.push_back(in.qk_conv);
        any_grad = any_grad || needs_grad(in, taus[i]);
        any_qk_conv = any_qk_conv || in.qk_conv.u.defined();
    }
    LINVIS_CHECK(!(any_grad && any_qk_conv),
                 "ttt_linear (fused): queries and keys from qk_conv are computed outside autograd only");
    std::vector<TttLinearResult> results;
    if (!any_grad) {
        // Inference: no checkpoints, nothing saved.
        const Config cfg{options.mini_batch_size, options.checkpoint_every, options.causal, options.eps,
                         options.return_grad_norms, target};
        const std::vector<ForwardOut> outs =
            forward_all(inputs.data(), scans.size(), cfg, /*checkpoints=*/false, qk_convs.data());
        for (size_t i = 0; i < scans.size(); ++i)
            results.push_back(result_of(outs[i], options, scans[i].xv.scalar_type()));
        return results;
    }
    const variable_list outs = TttLinearFusedFunction::apply(
        torch::TensorList(inputs), options.mini_batch_size, options.checkpoint_every, options.causal, options.eps,
        options.return_grad_norms, static_cast<int64_t>(target));
    for (size_t i = 0; i < scans.size(); ++i) {
        const torch::Tensor* o = outs.data() + i * kScanOutputs;
        TttLinearResult result;
        result.output = o[0];
        if (options.return_final_state) {
            result.final_W = o[1];
            result.final_b = o[2];
        }
        if (options.return_grad_norms) result.grad_norms = o[3];
        results.push_back(result);
    }
    return results;
}

}  // namespace linvis::ops::cpu
#endif  // HWY_ONCE
