// Fused CPU chunkwise mLSTM (Impl::Fused) against the reference forms: outputs and gradients for
// every input, float64 / float32 / bfloat16, lengths that are and are not multiples of the chunk,
// both SIMD paths, finite differences, dispatch errors, and the ViL model end to end.
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../src/ops/mlstm/cpu.h"
#include "support/simd_targets.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/models/registry.h"
#include "linvis/ops/mlstm.h"
#include "support/testing.h"

using linvis::testing::all_close;
using linvis::testing::gradcheck;
using linvis::testing::relative_error;
namespace ops = linvis::ops;
using linvis::models::create_model;
using linvis::models::ModelConfig;

namespace {

struct Inputs {
    torch::Tensor q, k, v, i, f;
    std::vector<torch::Tensor> list() const { return {q, k, v, i, f}; }
};

// Gates spread like trained ViL gates (forget bias 3..6 region, input gate around 0) times
// gate_scale, so large scales push the stabiliser through many different argmax positions.
Inputs make_inputs(int64_t B, int64_t NH, int64_t S, int64_t DH, int64_t DV, torch::Dtype dtype, uint64_t seed,
                   double gate_scale = 1.0) {
    torch::manual_seed(seed);
    auto opt = torch::TensorOptions().dtype(torch::kFloat64);
    Inputs in{torch::randn({B, NH, S, DH}, opt), torch::randn({B, NH, S, DH}, opt), torch::randn({B, NH, S, DV}, opt),
              gate_scale * 2.0 * torch::randn({B, NH, S, 1}, opt),
              gate_scale * (2.0 + 2.0 * torch::randn({B, NH, S, 1}, opt))};
    for (auto* t : {&in.q, &in.k, &in.v, &in.i, &in.f}) *t = t->to(dtype).detach().set_requires_grad(true);
    return in;
}

Inputs detached_copy(const Inputs& in, torch::Dtype dtype) {
    Inputs out;
    out.q = in.q.detach().to(dtype).set_requires_grad(true);
    out.k = in.k.detach().to(dtype).set_requires_grad(true);
    out.v = in.v.detach().to(dtype).set_requires_grad(true);
    out.i = in.i.detach().to(dtype).set_requires_grad(true);
    out.f = in.f.detach().to(dtype).set_requires_grad(true);
    return out;
}

// h and the gradients of sum(h * probe) w.r.t. q, k, v, igate, fgate.
std::vector<torch::Tensor> output_and_grads(const Inputs& in, ops::MlstmMode mode, int64_t chunk, ops::Impl impl,
                                            const torch::Tensor& probe) {
    auto h = ops::mlstm(in.q, in.k, in.v, in.i, in.f, mode, chunk, ops::kMlstmEps, impl);
    auto grads = torch::autograd::grad({(h * probe.to(h.scalar_type())).sum()}, in.list());
    std::vector<torch::Tensor> out{h.detach()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
}

const char* kNames[] = {"h", "dq", "dk", "dv", "dig", "dfg"};

using linvis::testing::for_each_simd_target;
using linvis::testing::SimdTarget;

// float32 fused vs the float64 parallel reference (the truth) for every output; the float32
// reference chunkwise form is measured next to it so the bound is relative to what the
// reference itself reaches in float32.
void expect_float32_close(int64_t B, int64_t NH, int64_t S, int64_t DH, int64_t DV, int64_t chunk, uint64_t seed) {
    auto in64 = make_inputs(B, NH, S, DH, DV, torch::kFloat64, seed);
    auto in32 = detached_copy(in64, torch::kFloat32);
    auto probe = torch::randn({B, NH, S, DV}, torch::kFloat64);
    auto truth = output_and_grads(in64, ops::MlstmMode::Parallel, chunk, ops::Impl::Reference, probe);
    auto fused = output_and_grads(in32, ops::MlstmMode::Chunkwise, chunk, ops::Impl::Fused, probe);
    auto ref32 = output_and_grads(in32, ops::MlstmMode::Chunkwise, chunk, ops::Impl::Reference, probe);
    for (size_t t = 0; t < truth.size(); ++t) {
        const double err = relative_error(fused[t], truth[t]);
        const double ref_err = relative_error(ref32[t], truth[t]);
        EXPECT_EQ(fused[t].scalar_type(), torch::kFloat32);
        EXPECT_LT(err, 1e-4) << kNames[t] << " S=" << S << " chunk=" << chunk << " (reference f32: " << ref_err << ")";
        EXPECT_LT(err, 10 * ref_err + 1e-6) << kNames[t] << " S=" << S << " chunk=" << chunk;
    }
}

}  // namespace

TEST(MlstmFused, Float64MatchesReference) {
    // Multiples of the chunk (16, 64) and not (1, 7, 33, 100), several batch / head counts, a chunk
    // larger than S, and gates scaled x4 so the stabiliser argmax moves across chunks.
    struct Case { int64_t B, NH, S, chunk; double gate_scale; };
    const std::vector<Case> cases = {{1, 1, 1, 16, 1.0},  {2, 3, 7, 4, 1.0},   {1, 2, 16, 16, 1.0},
                                     {2, 1, 33, 16, 1.0}, {1, 2, 64, 16, 1.0}, {2, 2, 100, 16, 1.0},
                                     {1, 1, 100, 64, 4.0}, {1, 2, 50, 128, 1.0}, {2, 1, 70, 8, 4.0}};
    for (const auto& c : cases) {
        auto in = make_inputs(c.B, c.NH, c.S, 8, 6, torch::kFloat64, 1000 + c.S, c.gate_scale);
        auto probe = torch::randn({c.B, c.NH, c.S, 6}, torch::kFloat64);
        auto ref = output_and_grads(in, ops::MlstmMode::Chunkwise, c.chunk, ops::Impl::Reference, probe);
        auto par = output_and_grads(in, ops::MlstmMode::Parallel, c.chunk, ops::Impl::Reference, probe);
        auto got = output_and_grads(in, ops::MlstmMode::Chunkwise, c.chunk, ops::Impl::Fused, probe);
        for (size_t t = 0; t < ref.size(); ++t) {
            EXPECT_TRUE(all_close(got[t], ref[t], 1e-9, 1e-11))
                << "vs chunkwise S=" << c.S << " chunk=" << c.chunk << " B=" << c.B << " NH=" << c.NH << " " << kNames[t];
            EXPECT_TRUE(all_close(got[t], par[t], 1e-9, 1e-11))
                << "vs parallel S=" << c.S << " chunk=" << c.chunk << " " << kNames[t];
        }
    }
}

TEST(MlstmFused, OtherEps) {
    // eps enters the normaliser and (through the stabiliser) the gate gradients: a large eps and eps = 0.
    auto in = make_inputs(2, 2, 45, 8, 6, torch::kFloat64, 77, 2.0);
    auto probe = torch::randn({2, 2, 45, 6}, torch::kFloat64);
    for (double eps : {0.0, 1e-2}) {
        auto run = [&](ops::Impl impl) {
            auto h = ops::mlstm_chunkwise(in.q, in.k, in.v, in.i, in.f, 16, eps, impl);
            auto g = torch::autograd::grad({(h * probe).sum()}, in.list());
            g.insert(g.begin(), h.detach());
            return g;
        };
        auto ref = run(ops::Impl::Reference);
        auto got = run(ops::Impl::Fused);
        for (size_t t = 0; t < ref.size(); ++t)
            EXPECT_TRUE(all_close(got[t], ref[t], 1e-9, 1e-11)) << "eps " << eps << " " << kNames[t];
    }
}

TEST(MlstmFused, FiniteDifferences) {
    // The backward checked independently of LibTorch's autograd of the reference.
    auto in = make_inputs(1, 2, 11, 3, 2, torch::kFloat64, 5, 2.0);
    auto f = [](const std::vector<torch::Tensor>& x) {
        return ops::mlstm_chunkwise(x[0], x[1], x[2], x[3], x[4], 4, ops::kMlstmEps, ops::Impl::Fused);
    };
    EXPECT_TRUE(gradcheck(f, in.list(), 1e-6, 1e-7, 1e-5));
}

// Every case on every SIMD target this CPU runs (AVX-512, AVX2, scalar; LINVIS_SIMD).
TEST(MlstmFused, Float32MatchesReference) {
    for_each_simd_target([](const SimdTarget&) {
        expect_float32_close(1, 2, 128, 32, 24, 64, 21);   // multiple of the chunk
        expect_float32_close(2, 2, 150, 32, 24, 64, 22);   // not a multiple
        expect_float32_close(1, 3, 77, 96, 96, 32, 23);    // ViL-T head size, odd chunk tail
    });
}

TEST(MlstmFused, Float64MatchesReferenceOnEveryTarget) {
    for_each_simd_target([](const SimdTarget&) {
        auto in = make_inputs(2, 1, 70, 8, 6, torch::kFloat64, 1070, 4.0);
        auto probe = torch::randn({2, 1, 70, 6}, torch::kFloat64);
        auto ref = output_and_grads(in, ops::MlstmMode::Chunkwise, 8, ops::Impl::Reference, probe);
        auto got = output_and_grads(in, ops::MlstmMode::Chunkwise, 8, ops::Impl::Fused, probe);
        for (size_t t = 0; t < ref.size(); ++t) EXPECT_TRUE(all_close(got[t], ref[t], 1e-9, 1e-11)) << kNames[t];
    });
}

namespace {

// ViL's layout: q, k, v are heads of token-major (B, S, NH * D) chunks of one wider leaf (the
// (B, S, NH, D)-as-(B, NH, S, D) view: token stride NH * D or wider, head stride D), the gates a
// transposed (B, S, 2 NH) leaf. Returns h and the gradients of sum(h * probe) w.r.t. the two leaves,
// probe given token-major (B, S, NH * DV) so that dh arrives token-major too.
std::vector<torch::Tensor> strided_output_and_grads(const torch::Tensor& wide0, const torch::Tensor& gates0,
                                                    int64_t NH, int64_t DH, int64_t DV, int64_t chunk,
                                                    ops::MlstmMode mode, ops::Impl impl, const torch::Tensor& probe,
                                                    torch::Dtype dtype) {
    torch::Tensor wide = wide0.to(dtype).clone().set_requires_grad(true);
    torch::Tensor gates = gates0.to(dtype).clone().set_requires_grad(true);
    const int64_t B = wide.size(0), S = wide.size(1);
    auto heads = [&](int64_t offset, int64_t D) {
        return wide.narrow(2, offset, NH * D).view({B, S, NH, D}).transpose(1, 2);
    };
    torch::Tensor q = heads(0, DH), k = heads(NH * DH + 3, DH), v = heads(2 * NH * DH + 5, DV);
    torch::Tensor g = gates.transpose(1, 2).unsqueeze(-1);  // (B, 2 NH, S, 1), token stride 2 NH
    EXPECT_FALSE(q.is_contiguous());
    torch::Tensor h = ops::mlstm(q, k, v, g.narrow(1, 0, NH), g.narrow(1, NH, NH), mode, chunk, ops::kMlstmEps, impl);
    torch::Tensor tokens = h.transpose(1, 2).reshape({B, S, NH * DV});
    auto grads = torch::autograd::grad({(tokens.to(torch::kFloat64) * probe).sum()}, {wide, gates});
    return {h.detach(), grads[0], grads[1]};
}

}  // namespace

TEST(MlstmFused, StridedTokenMajorInputsMatchReference) {
    const int64_t B = 2, NH = 3, S = 70, DH = 8, DV = 6;
    torch::manual_seed(1234);
    // Gaps between and after the q, k, v chunks: token stride 2 NH DH + NH DV + 9.
    const int64_t width = 2 * NH * DH + NH * DV + 9;
    torch::Tensor wide = torch::randn({B, S, width}, torch::kFloat64);
    torch::Tensor gates = torch::cat({2.0 * torch::randn({B, S, NH}, torch::kFloat64),
                                      2.0 + 2.0 * torch::randn({B, S, NH}, torch::kFloat64)}, -1);
    torch::Tensor probe = torch::randn({B, S, NH * DV}, torch::kFloat64);
    const char* names[] = {"h", "d(q, k, v leaf)", "d(gates leaf)"};
    const auto truth = strided_output_and_grads(wide, gates, NH, DH, DV, 16, ops::MlstmMode::Parallel,
                                                ops::Impl::Reference, probe, torch::kFloat64);
    for_each_simd_target([&](const SimdTarget&) {
        for (int64_t chunk : {16, 64}) {
            const auto got64 = strided_output_and_grads(wide, gates, NH, DH, DV, chunk, ops::MlstmMode::Chunkwise,
                                                        ops::Impl::Fused, probe, torch::kFloat64);
            const auto got32 = strided_output_and_grads(wide, gates, NH, DH, DV, chunk, ops::MlstmMode::Chunkwise,
                                                        ops::Impl::Fused, probe, torch::kFloat32);
            // The fused kernel writes h token-major: (B, S, NH, DV) memory.
            EXPECT_TRUE(got64[0].transpose(1, 2).is_contiguous());
            for (size_t t = 0; t < truth.size(); ++t) {
                EXPECT_TRUE(all_close(got64[t], truth[t], 1e-9, 1e-11)) << names[t] << " chunk " << chunk;
                EXPECT_LT(relative_error(got32[t], truth[t]), 1e-4) << names[t] << " chunk " << chunk;
            }
        }
    });
    // Contiguous copies of the same inputs give the same numbers as the strided views.
    auto c = make_inputs(B, NH, S, DH, DV, torch::kFloat64, 99);
    auto strided = [&](const torch::Tensor& t) {  // same values, token-major memory
        return t.detach().transpose(1, 2).contiguous().transpose(1, 2).set_requires_grad(true);
    };
    Inputs s{strided(c.q), strided(c.k), strided(c.v), strided(c.i), strided(c.f)};
    auto probe4 = torch::randn({B, NH, S, DV}, torch::kFloat64);
    auto a = output_and_grads(c, ops::MlstmMode::Chunkwise, 16, ops::Impl::Fused, probe4);
    auto b = output_and_grads(s, ops::MlstmMode::Chunkwise, 16, ops::Impl::Fused, probe4);
    for (size_t t = 0; t < a.size(); ++t) EXPECT_TRUE(all_close(b[t], a[t], 1e-12, 1e-14)) << kNames[t];
}

TEST(MlstmFused, OutputNormFusedIntoTheWrite) {
    // mlstm_normed: in inference the fused kernel normalises each (token, head) row as it writes it; with
    // autograd the norm runs after the kernel. Both against the reference form followed by
    // mlstm_output_norm, outputs and the gradients of every input including scale and shift.
    const int64_t B = 2, NH = 3, S = 45, DH = 8, DV = 6;
    auto in = make_inputs(B, NH, S, DH, DV, torch::kFloat64, 4321, 2.0);
    torch::Tensor scale = (1.0 + 0.3 * torch::randn({NH * DV}, torch::kFloat64)).set_requires_grad(true);
    torch::Tensor shift = (0.2 * torch::randn({NH * DV}, torch::kFloat64)).set_requires_grad(true);
    const ops::MlstmOutputNorm norm{scale, shift, 1e-5};
    auto probe = torch::randn({B, NH, S, DV}, torch::kFloat64);
    auto run = [&](ops::Impl impl, const Inputs& x, const ops::MlstmOutputNorm& nrm) {
        auto out = ops::mlstm_normed(x.q, x.k, x.v, x.i, x.f, nrm, ops::MlstmMode::Chunkwise, 16, ops::kMlstmEps, impl);
        auto leaves = x.list();
        leaves.push_back(nrm.scale);
        leaves.push_back(nrm.shift);
        auto grads = torch::autograd::grad({(out.to(torch::kFloat64) * probe).sum()}, leaves);
        grads.insert(grads.begin(), out.detach());
        return grads;
    };
    const auto ref = run(ops::Impl::Reference, in, norm);
    // The reference path is the unfused norm itself: a manual per-row layer norm.
    {
        auto h = ops::mlstm(in.q, in.k, in.v, in.i, in.f, ops::MlstmMode::Chunkwise, 16).detach();
        auto mean = h.mean(-1, true), var = h.var(-1, false, true);
        auto manual = (h - mean) / torch::sqrt(var + 1e-5) * scale.detach().view({NH, 1, DV}) +
                      shift.detach().view({NH, 1, DV});
        EXPECT_TRUE(all_close(ref[0], manual, 1e-10, 1e-12));
    }
    for_each_simd_target([&](const SimdTarget&) {
        const auto got = run(ops::Impl::Fused, in, norm);  // autograd: kernel, then the norm
        for (size_t t = 0; t < ref.size(); ++t) EXPECT_TRUE(all_close(got[t], ref[t], 1e-9, 1e-11)) << "output " << t;
        for (auto dtype : {torch::kFloat64, torch::kFloat32, torch::kBFloat16}) {
            torch::NoGradGuard no_grad;  // inference: the norm inside the kernel's write
            auto x = detached_copy(in, dtype);
            const ops::MlstmOutputNorm nrm{scale.detach().to(dtype), shift.detach().to(dtype), 1e-5};
            auto fused = ops::mlstm_normed(x.q, x.k, x.v, x.i, x.f, nrm, ops::MlstmMode::Chunkwise, 16,
                                           ops::kMlstmEps, ops::Impl::Fused);
            auto unfused = ops::mlstm_output_norm(
                ops::mlstm(x.q, x.k, x.v, x.i, x.f, ops::MlstmMode::Chunkwise, 16, ops::kMlstmEps, ops::Impl::Fused),
                nrm);
            EXPECT_EQ(fused.scalar_type(), dtype);
            EXPECT_TRUE(fused.transpose(1, 2).is_contiguous());  // token-major
            const double tol = dtype == torch::kFloat64 ? 1e-12 : dtype == torch::kFloat32 ? 1e-5 : 1e-2;
            if (dtype != torch::kBFloat16)  // bf16 inputs are rounded: against the unfused norm of the same only
                EXPECT_LT(relative_error(fused, ref[0]), dtype == torch::kFloat64 ? 1e-10 : tol) << c10::toString(dtype);
            EXPECT_LT(relative_error(fused, unfused), tol) << c10::toString(dtype);
        }
    });
    EXPECT_THROW(ops::mlstm_normed(in.q, in.k, in.v, in.i, in.f, {scale.narrow(0, 0, 5), shift, 1e-5},
                                   ops::MlstmMode::Chunkwise, 16, ops::kMlstmEps, ops::Impl::Fused),
                 linvis::Error);
}

TEST(MlstmFused, SimdTargetsAgreeWithScalar) {
    auto in = make_inputs(1, 2, 90, 40, 20, torch::kFloat32, 31);
    auto probe = torch::randn({1, 2, 90, 20});
    std::vector<torch::Tensor> scalar;
    {
        setenv("LINVIS_FORCE_SCALAR", "1", 1);  // the alias of LINVIS_SIMD=scalar
        EXPECT_STREQ(ops::fused_kernel_target(), "scalar");
        scalar = output_and_grads(in, ops::MlstmMode::Chunkwise, 32, ops::Impl::Fused, probe);
        unsetenv("LINVIS_FORCE_SCALAR");
    }
    for_each_simd_target([&](const SimdTarget&) {
        auto simd = output_and_grads(in, ops::MlstmMode::Chunkwise, 32, ops::Impl::Fused, probe);
        for (size_t t = 0; t < simd.size(); ++t) EXPECT_LT(relative_error(simd[t], scalar[t]), 2e-6) << kNames[t];
    });
}

TEST(MlstmFused, Bfloat16) {
    // bf16 in, float32 inside, bf16 out: the reference chunkwise form does the same, so the two
    // differ by float32 rounding plus one bf16 rounding of the output (2^-8 relative).
    auto in32 = make_inputs(2, 2, 100, 16, 16, torch::kFloat32, 41);
    auto in16 = detached_copy(in32, torch::kBFloat16);
    auto probe = torch::randn({2, 2, 100, 16});
    auto ref = output_and_grads(in16, ops::MlstmMode::Chunkwise, 32, ops::Impl::Reference, probe);
    auto got = output_and_grads(in16, ops::MlstmMode::Chunkwise, 32, ops::Impl::Fused, probe);
    for (size_t t = 0; t < ref.size(); ++t) {
        EXPECT_EQ(got[t].scalar_type(), torch::kBFloat16) << kNames[t];
        EXPECT_LT(relative_error(got[t], ref[t]), 1e-2) << kNames[t];
    }
}

TEST(MlstmFused, InferenceRecordsNothing) {
    auto in = make_inputs(1, 2, 40, 8, 8, torch::kFloat32, 51);
    torch::Tensor with_grad = ops::mlstm_chunkwise(in.q, in.k, in.v, in.i, in.f, 16, ops::kMlstmEps, ops::Impl::Fused);
    EXPECT_TRUE(with_grad.requires_grad());
    EXPECT_NE(with_grad.grad_fn(), nullptr);
    torch::Tensor no_grad, inference;
    {
        torch::NoGradGuard guard;
        no_grad = ops::mlstm_chunkwise(in.q, in.k, in.v, in.i, in.f, 16, ops::kMlstmEps, ops::Impl::Fused);
    }
    {
        c10::InferenceMode guard;
        inference = ops::mlstm_chunkwise(in.q, in.k, in.v, in.i, in.f, 16, ops::kMlstmEps, ops::Impl::Fused);
    }
    EXPECT_FALSE(no_grad.requires_grad());
    EXPECT_EQ(no_grad.grad_fn(), nullptr);
    EXPECT_TRUE(all_close(no_grad, with_grad, 0, 0));
    EXPECT_TRUE(all_close(inference.clone(), with_grad, 0, 0));
}

TEST(MlstmFused, DispatchAndErrors) {
    auto in = make_inputs(1, 2, 10, 4, 4, torch::kFloat32, 61);
    // Only the chunkwise form has a fused kernel: the other modes refuse instead of switching form.
    EXPECT_THROW(ops::mlstm(in.q, in.k, in.v, in.i, in.f, ops::MlstmMode::Parallel, 64, ops::kMlstmEps,
                            ops::Impl::Fused),
                 linvis::Error);
    EXPECT_THROW(ops::mlstm(in.q, in.k, in.v, in.i, in.f, ops::MlstmMode::Recurrent, 64, ops::kMlstmEps,
                            ops::Impl::Fused),
                 linvis::Error);
    auto fused = [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& i,
                    const torch::Tensor& f, int64_t chunk) {
        return ops::mlstm_chunkwise(q, k, v, i, f, chunk, ops::kMlstmEps, ops::Impl::Fused);
    };
    EXPECT_THROW(fused(in.q, in.k, in.v, in.i, in.f, 0), linvis::Error);
    EXPECT_THROW(fused(in.q, in.k.slice(3, 0, 3), in.v, in.i, in.f, 4), linvis::Error);
    EXPECT_THROW(fused(in.q, in.k, in.v.slice(2, 0, 5), in.i, in.f, 4), linvis::Error);
    EXPECT_THROW(fused(in.q, in.k, in.v, in.i.slice(2, 0, 4), in.f, 4), linvis::Error);
    EXPECT_THROW(fused(in.q, in.k, in.v, in.i, in.f.squeeze(-1).unsqueeze(0), 4), linvis::Error);
    EXPECT_THROW(fused(in.q, in.k.to(torch::kFloat64), in.v, in.i, in.f, 4), linvis::Error);
    // (B, NH, S) gates are accepted like (B, NH, S, 1); S = 0 gives an empty output.
    EXPECT_TRUE(all_close(fused(in.q, in.k, in.v, in.i.squeeze(-1), in.f.squeeze(-1), 4),
                          fused(in.q, in.k, in.v, in.i, in.f, 4), 0, 0));
    auto empty = make_inputs(1, 2, 0, 4, 3, torch::kFloat32, 62);
    EXPECT_EQ(fused(empty.q, empty.k, empty.v, empty.i, empty.f, 4).sizes(), torch::IntArrayRef({1, 2, 0, 3}));
}

namespace {

// A small ViL: 2 pairs (4 sub-blocks), D = 32 (I = 64, DH = 16), 8x8 patches: 36 tokens.
ModelConfig small_vil(const std::string& mode, const std::string& impl, int64_t chunk) {
    ModelConfig c;
    c.set("embed_dim", int64_t{32}).set("depth", int64_t{2}).set("patch_size", int64_t{8}).set("img_size", int64_t{48});
    c.set("num_classes", int64_t{10}).set("mlstm_mode", mode).set("chunk_size", chunk).set("impl", impl);
    return c;
}

void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
    torch::NoGradGuard no_grad;
    auto dst = to.named_parameters();
    for (const auto& kv : from.named_parameters()) dst[kv.key()].copy_(kv.value());
}

// Logits and d(sum(logits * probe))/d(image).
std::pair<torch::Tensor, torch::Tensor> logits_and_input_grad(linvis::models::VisionModel& model,
                                                              const torch::Tensor& x, const torch::Tensor& probe) {
    auto image = x.detach().clone().set_requires_grad(true);
    auto logits = model.forward(image);
    auto grad = torch::autograd::grad({(logits * probe).sum()}, {image})[0];
    return {logits.detach(), grad};
}

}  // namespace

TEST(MlstmFused, VilModelMatchesReferenceParallel) {
    torch::manual_seed(100);
    auto ref = create_model("vil_tiny", small_vil("parallel", "reference", 64));
    {
        // Official init has zero gate weights: perturb everything so every parameter matters.
        torch::manual_seed(3);
        torch::NoGradGuard no_grad;
        for (auto& p : ref->parameters()) p.add_(0.2 * torch::randn_like(p));
    }
    ref->eval();
    torch::manual_seed(4);
    auto x = torch::randn({2, 3, 48, 48}, torch::kFloat64);
    auto probe = torch::randn({2, 10}, torch::kFloat64);
    auto ref64 = create_model("vil_tiny", small_vil("parallel", "reference", 64));
    copy_parameters(*ref, *ref64);
    ref64->to(torch::kFloat64);
    ref64->eval();
    auto [ref_logits, ref_grad] = logits_and_input_grad(*ref64, x, probe);
    for (int64_t chunk : {5, 16, 64}) {  // 36 tokens: chunk tails of 1 and 4, and one short chunk
        auto fused = create_model("vil_tiny", small_vil("chunkwise", "fused", chunk));
        copy_parameters(*ref, *fused);
        fused->to(torch::kFloat64);
        fused->eval();
        auto [logits, grad] = logits_and_input_grad(*fused, x, probe);
        EXPECT_TRUE(all_close(logits, ref_logits, 1e-9, 1e-10)) << "chunk " << chunk;
        EXPECT_TRUE(all_close(grad, ref_grad, 1e-8, 1e-10)) << "chunk " << chunk;
    }
    // float32 model: same check at float32 precision (relative L2 error; logits are O(1)).
    auto fused32 = create_model("vil_tiny", small_vil("chunkwise", "fused", 16));
    copy_parameters(*ref, *fused32);
    fused32->eval();
    auto [logits32, grad32] = logits_and_input_grad(*fused32, x.to(torch::kFloat32), probe.to(torch::kFloat32));
    EXPECT_LT(relative_error(logits32, ref_logits), 1e-4);
    EXPECT_LT(relative_error(grad32, ref_grad), 1e-4);

    // impl=fused alone selects the chunkwise kernel; with another mode named it refuses.
    ModelConfig only_impl;
    only_impl.set("embed_dim", int64_t{32}).set("depth", int64_t{1}).set("patch_size", int64_t{8});
    only_impl.set("img_size", int64_t{32}).set("num_classes", int64_t{10}).set("impl", std::string("fused"));
    auto m = create_model("vil_tiny", only_impl);
    torch::NoGradGuard no_grad;
    EXPECT_EQ(m->forward(torch::randn({1, 3, 32, 32})).sizes(), torch::IntArrayRef({1, 10}));
    EXPECT_THROW(create_model("vil_tiny", small_vil("parallel", "fused", 64)), linvis::Error);
    EXPECT_THROW(create_model("vil_tiny", small_vil("recurrent", "fused", 64)), linvis::Error);
}
