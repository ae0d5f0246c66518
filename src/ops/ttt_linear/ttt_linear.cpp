// linvis::ops::ttt_linear: input checks, RoPE, and the choice between the reference scan and the fused
// CPU kernel (include/linvis/ops/ttt_linear.h).
#include "linvis/ops/ttt_linear.h"

#include <algorithm>
#include <string>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/depthwise_conv.h"
#include "ops/records_graph.h"
#include "ops/ttt_linear/cpu.h"
#include "ops/ttt_linear/reference.h"

namespace linvis::ops {
namespace {

void check_same_dtype(const torch::Tensor& t, const char* name, const torch::Tensor& ref) {
    LINVIS_CHECK(t.scalar_type() == ref.scalar_type(), "ttt_linear: ", name, ": expected dtype ",
                 ref.scalar_type(), " (as xv), got ", t.scalar_type());
}

// Checks the convolutions that give the queries and keys (TttQkConv) against xv (B, nh, T, d).
void check_qk_conv(const TttLinearInputs& in) {
    const TttQkConv& c = in.qk_conv;
    LINVIS_CHECK(!in.xq.defined() && !in.xk.defined(),
                 "ttt_linear: xq and xk must be undefined when qk_conv.u gives them, got xq ",
                 shape_or_undefined(in.xq), " and xk ", shape_or_undefined(in.xk));
    const int64_t B = in.xv.size(0), nh = in.xv.size(1), T = in.xv.size(2), D = nh * in.xv.size(3);
    LINVIS_CHECK(c.u.dim() == 3 && c.u.size(0) == B && c.u.size(1) == T && c.u.size(2) == D,
                 "ttt_linear: qk_conv.u: expected [", B, ", ", T, ", ", D, "] (B, T, nh * d of xv), got ",
                 shape_string(c.u.sizes()));
    check_same_dtype(c.u, "qk_conv.u", in.xv);
    for (const auto* w : {&c.q_weight, &c.k_weight}) {
        const char* name = w == &c.q_weight ? "qk_conv.q_weight" : "qk_conv.k_weight";
        LINVIS_CHECK(w->defined() && w->dim() == 3 && w->size(0) == D && w->size(1) == 1 && w->size(2) >= 1,
                     "ttt_linear: ", name, ": expected [", D, ", 1, k] with k >= 1, got ", shape_or_undefined(*w));
        check_same_dtype(*w, name, in.xv);
    }
    LINVIS_CHECK(c.q_weight.size(2) == c.k_weight.size(2), "ttt_linear: qk_conv: the q and k kernels differ in size (",
                 c.q_weight.size(2), " and ", c.k_weight.size(2), ")");
    for (const auto* b : {&c.q_bias, &c.k_bias}) {
        if (!b->defined()) continue;
        const char* name = b == &c.q_bias ? "qk_conv.q_bias" : "qk_conv.k_bias";
        LINVIS_CHECK(b->dim() == 1 && b->size(0) == D, "ttt_linear: ", name, ": expected [", D, "], got ",
                     shape_string(b->sizes()));
        check_same_dtype(*b, name, in.xv);
    }
}

// Checks one scan's inputs against each other and the options (ttt_linear.h); xv gives the shape and dtype.
void check_inputs(const TttLinearInputs& in, const TttLinearOptions& opt) {
    const torch::Tensor &xv = in.xv, &lr = in.lr, &learnable_token_idx = in.learnable_token_idx, &w0 = in.w0,
                        &b0 = in.b0, &ln_weight = in.ln_weight, &ln_bias = in.ln_bias;
    LINVIS_CHECK(xv.defined() && xv.dim() == 4, "ttt_linear: xv: expected (B, nh, T, d), got ",
                 shape_or_undefined(xv));
    const int64_t B = xv.size(0), nh = xv.size(1), T = xv.size(2), d = xv.size(3);
    LINVIS_CHECK(T >= 1 && d >= 1, "ttt_linear: xv: needs T >= 1 and d >= 1, got ", shape_string(xv.sizes()));
    if (in.qk_conv.u.defined()) {
        check_qk_conv(in);
    } else {
        for (const auto* x : {&in.xq, &in.xk}) {
            const char* name = x == &in.xq ? "xq" : "xk";
            LINVIS_CHECK(x->defined() && x->sizes() == xv.sizes(), "ttt_linear: ", name, ": expected shape ",
                         shape_string(xv.sizes()), " (as xv), got ", shape_or_undefined(*x));
            check_same_dtype(*x, name, xv);
        }
    }
    LINVIS_CHECK(lr.dim() == 3 && lr.size(0) == B && lr.size(1) == nh && lr.size(2) == T,
                 "ttt_linear: lr: expected shape [", B, ", ", nh, ", ", T, "], got ", shape_string(lr.sizes()));
    LINVIS_CHECK(opt.mini_batch_size >= 1, "ttt_linear: mini_batch_size must be >= 1, got ", opt.mini_batch_size);
    const bool ln_model = opt.inner_model == TttInnerModel::ResidualLayerNorm;
    const bool w0_batched = w0.dim() == 4;
    LINVIS_CHECK((w0.dim() == 3 && w0.size(0) == nh && w0.size(1) == d && w0.size(2) == d) ||
                     (w0_batched && w0.size(0) == B && w0.size(1) == nh && w0.size(2) == d && w0.size(3) == d),
                 "ttt_linear: w0: expected [", nh, ", ", d, ", ", d, "] or [", B, ", ", nh, ", ", d, ", ", d,
                 "], got ", shape_string(w0.sizes()));
    check_same_dtype(lr, "lr", xv);
    check_same_dtype(w0, "w0", xv);
    if (ln_model) {
        LINVIS_CHECK(b0.defined() && ((b0.dim() == 3 && b0.size(0) == nh && b0.size(1) == 1 && b0.size(2) == d) ||
                                      (b0.dim() == 4 && b0.size(0) == B && b0.size(1) == nh && b0.size(2) == 1 &&
                                       b0.size(3) == d)),
                     "ttt_linear: b0: expected [", nh, ", 1, ", d, "] or [", B, ", ", nh, ", 1, ", d, "], got ",
                     shape_or_undefined(b0));
        for (const auto* p : {&ln_weight, &ln_bias}) {
            LINVIS_CHECK(p->defined() && p->dim() == 2 && p->size(0) == nh && p->size(1) == d, "ttt_linear: ",
                         p == &ln_weight ? "ln_weight" : "ln_bias", ": expected [", nh, ", ", d, "], got ",
                         shape_or_undefined(*p));
            check_same_dtype(*p, p == &ln_weight ? "ln_weight" : "ln_bias", xv);
        }
        check_same_dtype(b0, "b0", xv);
    }
    if (opt.use_token_coefficient) {
        LINVIS_CHECK(learnable_token_idx.defined() && learnable_token_idx.dim() == 1 &&
                         learnable_token_idx.size(0) == opt.mini_batch_size,
                     "ttt_linear: learnable_token_idx: expected [", opt.mini_batch_size, "], got ",
                     shape_or_undefined(learnable_token_idx));
        check_same_dtype(learnable_token_idx, "learnable_token_idx", xv);
    }
}

// Whether the fused kernel computes this scan's queries and keys from qk_conv.u itself: outside autograd (the
// kernel has no backward for the convolutions), without RoPE (applied to xq / xk before the scan), on a u with
// unit channel stride.
bool folds_qk_conv(const TttLinearInputs& in, const TttLinearOptions& opt) {
    const TttQkConv& c = in.qk_conv;
    return !opt.use_rope && c.u.stride(2) == 1 &&
           !records_graph({c.u, c.q_weight, c.q_bias, c.k_weight, c.k_bias, in.xv, in.lr, in.learnable_token_idx,
                           in.w0, in.b0, in.ln_weight, in.ln_bias});
}

}  // namespace

std::vector<TttLinearResult> ttt_linear_many(const std::vector<TttLinearInputs>& scans, const TttLinearOptions& opt,
                                             Impl impl) {
    for (const TttLinearInputs& in : scans) check_inputs(in, opt);
    std::string unsupported = opt.inner_model != TttInnerModel::ResidualLayerNorm
                                  ? std::string("inner model 'linear' (the fused kernel runs the residual LayerNorm "
                                                "inner model)")
                                  : std::string();
    for (size_t i = 0; i < scans.size() && unsupported.empty(); ++i) {
        const torch::Tensor& xv = scans[i].xv;
        if (!xv.device().is_cpu()) unsupported = "CPU tensors only, got " + xv.device().str();
        else if (xv.scalar_type() != scans[0].xv.scalar_type())  // one kernel call runs one dtype
            unsupported = "scan " + std::to_string(i) + " has dtype " + std::string(c10::toString(xv.scalar_type())) +
                          ", scan 0 " + c10::toString(scans[0].xv.scalar_type()) + " (one call runs one dtype)";
    }
    // The fused scan beats the reference's per-mini-batch small products on every SIMD target
    // (AVX-512, AVX2 and scalar; docs/ops.md).
    const bool fused = use_fused(impl, "ttt_linear", unsupported, /*fused_is_faster=*/true);
    std::vector<TttLinearInputs> ready = scans;  // with xq / xk from qk_conv unless the kernel folds it, RoPE applied
    for (TttLinearInputs& in : ready) {
        const TttQkConv& c = in.qk_conv;
        if (c.u.defined() && !(fused && folds_qk_conv(in, opt))) {
            const int64_t nh = in.xv.size(1);
            in.xq = causal_depthwise_conv1d_heads(c.u, c.q_weight, c.q_bias, nh, impl);
            in.xk = causal_depthwise_conv1d_heads(c.u, c.k_weight, c.k_bias, nh, impl);
            in.qk_conv = TttQkConv();
        }
        if (!opt.use_rope) continue;
        in.xq = ttt_rope(in.xq, opt.mini_batch_size, opt.rope_theta);
        in.xk = ttt_rope(in.xk, opt.mini_batch_size, opt.rope_theta);
    }
    std::vector<TttLinearResult> results;
    if (!fused) {
        for (const TttLinearInputs& in : ready)
            results.push_back(reference::ttt_linear_scan(in.xq, in.xk, in.xv, in.lr, in.learnable_token_idx, in.w0,
                                                         in.b0, in.ln_weight, in.ln_bias, opt));
        return results;
    }
    std::vector<torch::Tensor> taus;
    for (const TttLinearInputs& in : ready) {
        taus.push_back(opt.use_token_coefficient ? ttt_token_coefficient(in.learnable_token_idx, opt.mini_batch_size)
                                                 : torch::ones({opt.mini_batch_size}, in.xv.options()));
        if (flops::counting()) {
            // Same products as the reference (see mini_batch_step), and the folded convolutions' count as
            // causal_depthwise_conv1d_heads.
            const int64_t B = in.xv.size(0), nh = in.xv.size(1), T = in.xv.size(2), d = in.xv.size(3);
            int64_t macs = 0;
            for (int64_t start = 0; start < T; start += opt.mini_batch_size) {
                const int64_t M = std::min(opt.mini_batch_size, T - start);
                macs += 3 * M * d * d + (opt.causal ? 2 * M * M * d : 0);
            }
            flops::add(B * nh * macs);
            if (in.qk_conv.u.defined()) flops::add(2 * B * T * nh * d * in.qk_conv.q_weight.size(2));
        }
    }
    return cpu::ttt_linear_fused_many(ready, taus, opt);
}

TttLinearResult ttt_linear(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                           const torch::Tensor& lr, const torch::Tensor& learnable_token_idx,
                           const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& ln_weight,
                           const torch::Tensor& ln_bias, const TttLinearOptions& opt, Impl impl) {
    return ttt_linear_many({{xq, xk, xv, lr, learnable_token_idx, w0, b0, ln_weight, ln_bias, {}}}, opt, impl)[0];
}

}  // namespace linvis::ops
