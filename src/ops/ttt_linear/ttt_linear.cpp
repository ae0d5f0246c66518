// linvis::ops::ttt_linear: input checks, RoPE, and the choice between the reference scan and the fused
// CPU kernel (include/linvis/ops/ttt_linear.h).
#include "linvis/ops/ttt_linear.h"

#include <algorithm>
#include <string>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/ttt_linear/cpu.h"
#include "ops/ttt_linear/reference.h"

namespace linvis::ops {
namespace {

void check_same_dtype(const torch::Tensor& t, const char* name, const torch::Tensor& ref) {
    LINVIS_CHECK(t.scalar_type() == ref.scalar_type(), "ttt_linear: ", name, ": expected dtype ",
                 ref.scalar_type(), " (as xq), got ", t.scalar_type());
}

// Checks one scan's inputs against each other and the options (ttt_linear.h).
void check_inputs(const TttLinearInputs& in, const TttLinearOptions& opt) {
    const torch::Tensor &xq_in = in.xq, &xk_in = in.xk, &xv = in.xv, &lr = in.lr,
                        &learnable_token_idx = in.learnable_token_idx, &w0 = in.w0, &b0 = in.b0,
                        &ln_weight = in.ln_weight, &ln_bias = in.ln_bias;
    LINVIS_CHECK(xq_in.dim() == 4, "ttt_linear: xq: expected (B, nh, T, d), got ", shape_string(xq_in.sizes()));
    const int64_t B = xq_in.size(0), nh = xq_in.size(1), T = xq_in.size(2), d = xq_in.size(3);
    LINVIS_CHECK(xk_in.sizes() == xq_in.sizes(), "ttt_linear: xk: expected shape ", shape_string(xq_in.sizes()),
                 ", got ", shape_string(xk_in.sizes()));
    LINVIS_CHECK(xv.sizes() == xq_in.sizes(), "ttt_linear: xv: expected shape ", shape_string(xq_in.sizes()),
                 ", got ", shape_string(xv.sizes()));
    LINVIS_CHECK(T >= 1 && d >= 1, "ttt_linear: xq: needs T >= 1 and d >= 1, got ", shape_string(xq_in.sizes()));
    LINVIS_CHECK(lr.dim() == 3 && lr.size(0) == B && lr.size(1) == nh && lr.size(2) == T,
                 "ttt_linear: lr: expected shape [", B, ", ", nh, ", ", T, "], got ", shape_string(lr.sizes()));
    LINVIS_CHECK(opt.mini_batch_size >= 1, "ttt_linear: mini_batch_size must be >= 1, got ", opt.mini_batch_size);
    const bool ln_model = opt.inner_model == TttInnerModel::ResidualLayerNorm;
    const bool w0_batched = w0.dim() == 4;
    LINVIS_CHECK((w0.dim() == 3 && w0.size(0) == nh && w0.size(1) == d && w0.size(2) == d) ||
                     (w0_batched && w0.size(0) == B && w0.size(1) == nh && w0.size(2) == d && w0.size(3) == d),
                 "ttt_linear: w0: expected [", nh, ", ", d, ", ", d, "] or [", B, ", ", nh, ", ", d, ", ", d,
                 "], got ", shape_string(w0.sizes()));
    check_same_dtype(xk_in, "xk", xq_in);
    check_same_dtype(xv, "xv", xq_in);
    check_same_dtype(lr, "lr", xq_in);
    check_same_dtype(w0, "w0", xq_in);
    if (ln_model) {
        LINVIS_CHECK(b0.defined() && ((b0.dim() == 3 && b0.size(0) == nh && b0.size(1) == 1 && b0.size(2) == d) ||
                                      (b0.dim() == 4 && b0.size(0) == B && b0.size(1) == nh && b0.size(2) == 1 &&
                                       b0.size(3) == d)),
                     "ttt_linear: b0: expected [", nh, ", 1, ", d, "] or [", B, ", ", nh, ", 1, ", d, "], got ",
                     b0.defined() ? shape_string(b0.sizes()) : std::string("undefined"));
        for (const auto* p : {&ln_weight, &ln_bias}) {
            LINVIS_CHECK(p->defined() && p->dim() == 2 && p->size(0) == nh && p->size(1) == d, "ttt_linear: ",
                         p == &ln_weight ? "ln_weight" : "ln_bias", ": expected [", nh, ", ", d, "], got ",
                         p->defined() ? shape_string(p->sizes()) : std::string("undefined"));
            check_same_dtype(*p, p == &ln_weight ? "ln_weight" : "ln_bias", xq_in);
        }
        check_same_dtype(b0, "b0", xq_in);
    }
    if (opt.use_token_coefficient) {
        LINVIS_CHECK(learnable_token_idx.defined() && learnable_token_idx.dim() == 1 &&
                         learnable_token_idx.size(0) == opt.mini_batch_size,
                     "ttt_linear: learnable_token_idx: expected [", opt.mini_batch_size, "], got ",
                     learnable_token_idx.defined() ? shape_string(learnable_token_idx.sizes())
                                                   : std::string("undefined"));
        check_same_dtype(learnable_token_idx, "learnable_token_idx", xq_in);
    }
}

}  // namespace

std::vector<TttLinearResult> ttt_linear_many(const std::vector<TttLinearInputs>& scans, const TttLinearOptions& opt,
                                             Impl impl) {
    for (const TttLinearInputs& in : scans) check_inputs(in, opt);
    std::vector<TttLinearInputs> ready = scans;  // with RoPE applied
    for (TttLinearInputs& in : ready) {
        if (!opt.use_rope) continue;
        in.xq = ttt_rope(in.xq, opt.mini_batch_size, opt.rope_theta);
        in.xk = ttt_rope(in.xk, opt.mini_batch_size, opt.rope_theta);
    }
    std::string unsupported = opt.inner_model != TttInnerModel::ResidualLayerNorm
                                  ? std::string("inner model 'linear' (the fused kernel runs the residual LayerNorm "
                                                "inner model)")
                                  : std::string();
    for (size_t i = 0; i < ready.size() && unsupported.empty(); ++i) {
        const torch::Tensor& xq = ready[i].xq;
        if (!xq.device().is_cpu()) unsupported = "CPU tensors only, got " + xq.device().str();
        else if (xq.scalar_type() != ready[0].xq.scalar_type())  // one kernel call runs one dtype
            unsupported = "scan " + std::to_string(i) + " has dtype " + std::string(c10::toString(xq.scalar_type())) +
                          ", scan 0 " + c10::toString(ready[0].xq.scalar_type()) + " (one call runs one dtype)";
    }
    std::vector<TttLinearResult> results;
    // The fused scan beats the reference's per-mini-batch small products on every SIMD target
    // (AVX-512, AVX2 and scalar; docs/ops.md).
    if (!use_fused(impl, "ttt_linear", unsupported, /*fused_is_faster=*/true)) {
        for (const TttLinearInputs& in : ready)
            results.push_back(reference::ttt_linear_scan(in.xq, in.xk, in.xv, in.lr, in.learnable_token_idx, in.w0,
                                                         in.b0, in.ln_weight, in.ln_bias, opt));
        return results;
    }
    std::vector<torch::Tensor> taus;
    for (const TttLinearInputs& in : ready) {
        taus.push_back(opt.use_token_coefficient ? ttt_token_coefficient(in.learnable_token_idx, opt.mini_batch_size)
                                                 : torch::ones({opt.mini_batch_size}, in.xq.options()));
        if (flops::counting()) {
            // Same products as the reference (see mini_batch_step).
            const int64_t B = in.xq.size(0), nh = in.xq.size(1), T = in.xq.size(2), d = in.xq.size(3);
            int64_t macs = 0;
            for (int64_t start = 0; start < T; start += opt.mini_batch_size) {
                const int64_t M = std::min(opt.mini_batch_size, T - start);
                macs += 3 * M * d * d + (opt.causal ? 2 * M * M * d : 0);
            }
            flops::add(B * nh * macs);
        }
    }
    return cpu::ttt_linear_fused_many(ready, taus, opt);
}

TttLinearResult ttt_linear(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                           const torch::Tensor& lr, const torch::Tensor& learnable_token_idx,
                           const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& ln_weight,
                           const torch::Tensor& ln_bias, const TttLinearOptions& opt, Impl impl) {
    return ttt_linear_many({{xq, xk, xv, lr, learnable_token_idx, w0, b0, ln_weight, ln_bias}}, opt, impl)[0];
}

}  // namespace linvis::ops
