// Fused CPU TTT-Linear: one task per (sample, head) walks the mini-batches keeping the inner
// state (W, b) in a small buffer; each mini-batch is a handful of <= 64x64 dense products done
// by register-blocked micro-kernels (AVX-512 or portable, chosen at run time). The backward
// recomputes states from sparse checkpoints. Derivation and memory formula: docs/perf_ttt_linear.md.
#include "ops/ttt_linear/cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "linvis/core/error.h"
#include "linvis/ops/impl.h"

namespace linvis::ops::cpu {
namespace {

// Everything one scan task reads and writes. Big per-token tensors (q, k, v, out and their
// gradients) keep their dtype In and their strides; the small ones (lr, tau, gamma, beta, states,
// parameter gradients) are contiguous in the compute type T (float, or double for float64).
struct ScanArgs {
    int64_t B = 0, nh = 0, T = 0, d = 0, bmax = 0, ckpt_every = 1;
    bool causal = true;
    double eps = 1e-6;
    const void *q = nullptr, *k = nullptr, *v = nullptr;
    int64_t qs[4] = {}, ks[4] = {}, vs[4] = {};
    const void *lr = nullptr, *tau = nullptr, *gamma = nullptr, *beta = nullptr, *w0 = nullptr, *b0 = nullptr;
    void* out = nullptr;
    int64_t outs[4] = {};
    void *final_W = nullptr, *final_b = nullptr, *grad_norms = nullptr, *ckpt = nullptr;
    const void* dout = nullptr;
    int64_t douts[4] = {};
    void *dq = nullptr, *dk = nullptr, *dv = nullptr;
    int64_t dqs[4] = {}, dks[4] = {}, dvs[4] = {};
    void *dlr = nullptr, *dW0 = nullptr, *db0 = nullptr, *dgamma = nullptr, *dbeta = nullptr, *dtau = nullptr;
};

// 1-lane "vector": the portable path, for float and double.
template <typename S>
struct ScalarVec {
    using T = S;
    using Mask = int;
    static constexpr int W = 1;
    S x;
    static Mask mask(int) { return 1; }
    static ScalarVec load(const S* p, Mask) { return {*p}; }
    void store(S* p, Mask) const { *p = x; }
    static ScalarVec set1(S s) { return {s}; }
    static ScalarVec zero() { return {S(0)}; }
    static ScalarVec keep(Mask, ScalarVec a) { return a; }
    static ScalarVec fma(ScalarVec a, ScalarVec b, ScalarVec c) { return {a.x * b.x + c.x}; }
    static S reduce(ScalarVec a) { return a.x; }
    static void transpose_block(const S*, int64_t, S*, int64_t) {}  // unused (W = 1)
    friend ScalarVec operator+(ScalarVec a, ScalarVec b) { return {a.x + b.x}; }
    friend ScalarVec operator-(ScalarVec a, ScalarVec b) { return {a.x - b.x}; }
    friend ScalarVec operator*(ScalarVec a, ScalarVec b) { return {a.x * b.x}; }
};

}  // namespace

namespace portable {
#define LINVIS_TTT_KATTR
#include "ops/ttt_linear/cpu_kernels.h"
#undef LINVIS_TTT_KATTR
}  // namespace portable

// GCC 12 reports its own _mm512_undefined_* placeholders inside the shuffle intrinsics as
// uninitialised once they are inlined; they are never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {
#define LINVIS_TTT_KATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// 16 float lanes; partial vectors through masked loads and stores.
struct Vec16f {
    using T = float;
    using Mask = __mmask16;
    static constexpr int W = 16;
    __m512 x;
    LINVIS_TTT_KATTR static Mask mask(int n) {
        return static_cast<Mask>(n >= 16 ? 0xFFFFu : ((1u << n) - 1u));
    }
    LINVIS_TTT_KATTR static Vec16f load(const float* p, Mask m) { return {_mm512_maskz_loadu_ps(m, p)}; }
    LINVIS_TTT_KATTR void store(float* p, Mask m) const { _mm512_mask_storeu_ps(p, m, x); }
    LINVIS_TTT_KATTR static Vec16f set1(float s) { return {_mm512_set1_ps(s)}; }
    LINVIS_TTT_KATTR static Vec16f zero() { return {_mm512_setzero_ps()}; }
    LINVIS_TTT_KATTR static Vec16f keep(Mask m, Vec16f a) { return {_mm512_maskz_mov_ps(m, a.x)}; }
    LINVIS_TTT_KATTR static Vec16f fma(Vec16f a, Vec16f b, Vec16f c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }
    // Folds halves with in-register shuffles (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized).
    LINVIS_TTT_KATTR static float reduce(Vec16f a) {
        __m512 s = _mm512_add_ps(a.x, _mm512_shuffle_f32x4(a.x, a.x, 0x4E));
        s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0xB1));
        __m128 t = _mm512_castps512_ps128(s);
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
        return _mm_cvtss_f32(t);
    }
    // dst (16 x 16, row stride ldd) = src (16 x 16, row stride lds) transposed: 32-bit, 64-bit
    // and two 128-bit-lane interleaving stages.
    LINVIS_TTT_KATTR static void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
        for (int i = 0; i < 8; ++i) {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; ++i) {
            const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
            const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
            r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
            r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
            r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
            r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
        }
        for (int i = 0; i < 2; ++i)
            for (int j = 0; j < 4; ++j) {
                t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
                t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
            }
        for (int j = 0; j < 8; ++j) {
            _mm512_storeu_ps(dst + j * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
            _mm512_storeu_ps(dst + (8 + j) * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd));
        }
    }
};
LINVIS_TTT_KATTR inline Vec16f operator+(Vec16f a, Vec16f b) { return {_mm512_add_ps(a.x, b.x)}; }
LINVIS_TTT_KATTR inline Vec16f operator-(Vec16f a, Vec16f b) { return {_mm512_sub_ps(a.x, b.x)}; }
LINVIS_TTT_KATTR inline Vec16f operator*(Vec16f a, Vec16f b) { return {_mm512_mul_ps(a.x, b.x)}; }

#include "ops/ttt_linear/cpu_kernels.h"
#undef LINVIS_TTT_KATTR
}  // namespace avx512
#pragma GCC diagnostic pop

namespace {


void copy_strides(const torch::Tensor& t, int64_t* s) {
    for (int i = 0; i < 4; ++i) s[i] = t.stride(i);
}

// (B, nh, T, d) tensor whose memory is (B, T, nh, d): what the model reshapes to (B, T, D) for free.
torch::Tensor empty_token_major(int64_t B, int64_t nh, int64_t T, int64_t d, const torch::TensorOptions& o) {
    return torch::empty({B, T, nh, d}, o).permute({0, 2, 1, 3});
}

template <typename In, typename T>
void run_forward_tasks(const ScanArgs& a, bool simd) {
    at::parallel_for(0, a.B * a.nh, 1, [&](int64_t begin, int64_t end) {
        if constexpr (std::is_same_v<T, float>) {
            if (simd) {
                avx512::MiniBatchWork<avx512::Vec16f> w;
                w.init(a.d, a.bmax, false);
                for (int64_t bh = begin; bh < end; ++bh) avx512::scan_forward<avx512::Vec16f, In>(a, bh, w);
                return;
            }
        }
        portable::MiniBatchWork<ScalarVec<T>> w;
        w.init(a.d, a.bmax, false);
        for (int64_t bh = begin; bh < end; ++bh) portable::scan_forward<ScalarVec<T>, In>(a, bh, w);
    });
}

template <typename In, typename T>
void run_backward_tasks(const ScanArgs& a, bool simd) {
    at::parallel_for(0, a.B * a.nh, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> states;
        if constexpr (std::is_same_v<T, float>) {
            if (simd) {
                avx512::MiniBatchWork<avx512::Vec16f> w;
                w.init(a.d, a.bmax, true);
                for (int64_t bh = begin; bh < end; ++bh) avx512::scan_backward<avx512::Vec16f, In>(a, bh, w, states);
                return;
            }
        }
        portable::MiniBatchWork<ScalarVec<T>> w;
        w.init(a.d, a.bmax, true);
        for (int64_t bh = begin; bh < end; ++bh) portable::scan_backward<ScalarVec<T>, In>(a, bh, w, states);
    });
}

struct Config {
    int64_t bmax = 16;
    int64_t ckpt_every = 4;
    bool causal = true;
    double eps = 1e-6;
    bool want_norms = false;
    bool simd = true;
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

ForwardOut run_forward(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                       const SmallInputs& s, const Config& cfg, bool checkpoints) {
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

    ScanArgs a = scan_inputs(xq, xk, xv, s, cfg);
    a.out = r.out.data_ptr(); copy_strides(r.out, a.outs);
    a.final_W = r.final_W.data_ptr(); a.final_b = r.final_b.data_ptr();
    a.grad_norms = cfg.want_norms ? r.norms.data_ptr() : nullptr;
    a.ckpt = checkpoints ? r.ckpt.data_ptr() : nullptr;
    dispatch_dtype(xq.scalar_type(), [&](auto in, auto acc) {
        run_forward_tasks<decltype(in), decltype(acc)>(a, cfg.simd);
    });
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
                                 bool want_norms, bool simd) {
        Config cfg{bmax, ckpt_every, causal, eps, want_norms, simd};
        SmallInputs s = small_inputs(xq, lr, tau, w0, b0, gamma, beta);
        ForwardOut r = run_forward(xq, xk, xv, s, cfg, true);
        ctx->save_for_backward({xq, xk, xv, lr, tau, w0, b0, gamma, beta, r.ckpt});
        ctx->saved_data["bmax"] = bmax;
        ctx->saved_data["ckpt_every"] = ckpt_every;
        ctx->saved_data["causal"] = causal;
        ctx->saved_data["eps"] = eps;
        ctx->saved_data["simd"] = simd;
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
        cfg.simd = ctx->saved_data["simd"].toBool();
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
            run_backward_tasks<decltype(in), decltype(acc)>(a, cfg.simd);
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

bool ttt_linear_fused_uses_avx512() { return fused_kernels_use_avx512(); }

TttLinearResult ttt_linear_fused(const torch::Tensor& xq, const torch::Tensor& xk, const torch::Tensor& xv,
                                 const torch::Tensor& lr, const torch::Tensor& tau, const torch::Tensor& w0,
                                 const torch::Tensor& b0, const torch::Tensor& ln_weight, const torch::Tensor& ln_bias,
                                 const TttLinearOptions& options, bool force_scalar) {
    LINVIS_CHECK(xq.device().is_cpu(), "ttt_linear (fused): CPU tensors only, got ", xq.device());
    LINVIS_CHECK(options.inner_model == TttInnerModel::ResidualLayerNorm,
                 "ttt_linear (fused): only the ResidualLayerNorm inner model is fused");
    LINVIS_CHECK(options.checkpoint_every >= 1, "ttt_linear (fused): checkpoint_every must be >= 1, got ",
                 options.checkpoint_every);
    const bool simd = !force_scalar && ttt_linear_fused_uses_avx512();
    const bool needs_grad = torch::GradMode::is_enabled() &&
                            (xq.requires_grad() || xk.requires_grad() || xv.requires_grad() || lr.requires_grad() ||
                             tau.requires_grad() || w0.requires_grad() || b0.requires_grad() ||
                             ln_weight.requires_grad() || ln_bias.requires_grad());
    TttLinearResult result;
    if (!needs_grad) {
        // Inference: no checkpoints, nothing saved.
        Config cfg{options.mini_batch_size, options.checkpoint_every, options.causal, options.eps,
                   options.return_grad_norms, simd};
        SmallInputs s = small_inputs(xq, lr, tau, w0, b0, ln_weight, ln_bias);
        ForwardOut r = run_forward(xq, xk, xv, s, cfg, false);
        const auto st = xq.scalar_type();
        result.output = r.out;
        if (options.return_final_state) {
            result.final_W = r.final_W.to(st);
            result.final_b = r.final_b.to(st);
        }
        if (options.return_grad_norms) result.grad_norms = r.norms.to(st);
        return result;
    }
    variable_list outs = TttLinearFusedFunction::apply(
        xq, xk, xv, lr, tau, w0, b0, ln_weight, ln_bias, options.mini_batch_size, options.checkpoint_every,
        options.causal, options.eps, options.return_grad_norms, simd);
    result.output = outs[0];
    if (options.return_final_state) {
        result.final_W = outs[1];
        result.final_b = outs[2];
    }
    if (options.return_grad_norms) result.grad_norms = outs[3];
    return result;
}

}  // namespace linvis::ops::cpu
