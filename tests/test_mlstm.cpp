// mLSTM op: the parallel (official), recurrent and chunkwise forms agree; the parallel form equals a
// direct transcription of the spec (vil_official.md 1.7); gradients, long sequences, bf16.
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/mlstm.h"
#include "support/testing.h"

using linvis::testing::all_close;
using linvis::testing::gradcheck;
using linvis::testing::relative_error;
namespace ops = linvis::ops;

namespace {

struct Inputs {
    torch::Tensor q, k, v, i, f;
    std::vector<torch::Tensor> list() const { return {q, k, v, i, f}; }
};

// Gates spread like trained ViL gates (forget bias 3..6, input gate around 0) plus noise.
Inputs make_inputs(int64_t B, int64_t NH, int64_t S, int64_t DH, int64_t DV, torch::Dtype dtype, uint64_t seed,
                   bool requires_grad = false) {
    torch::manual_seed(seed);
    auto opt = torch::TensorOptions().dtype(torch::kFloat64);
    Inputs in{torch::randn({B, NH, S, DH}, opt), torch::randn({B, NH, S, DH}, opt), torch::randn({B, NH, S, DV}, opt),
              2.0 * torch::randn({B, NH, S, 1}, opt), 2.0 + 2.0 * torch::randn({B, NH, S, 1}, opt)};
    for (auto* t : {&in.q, &in.k, &in.v, &in.i, &in.f}) *t = t->to(dtype).detach().set_requires_grad(requires_grad);
    return in;
}

torch::Tensor run(const Inputs& in, ops::MlstmMode mode, int64_t chunk = 64) {
    return ops::mlstm(in.q, in.k, in.v, in.i, in.f, mode, chunk, ops::kMlstmEps, ops::Impl::Reference);
}

// Output and input gradients for the loss sum(h * probe).
std::vector<torch::Tensor> output_and_grads(const Inputs& in, ops::MlstmMode mode, int64_t chunk,
                                            const torch::Tensor& probe) {
    auto h = run(in, mode, chunk);
    auto grads = torch::autograd::grad({(h * probe).sum()}, in.list());
    std::vector<torch::Tensor> out{h.detach()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
}

void expect_forms_agree(ops::MlstmMode mode, const std::vector<int64_t>& lengths, const std::vector<int64_t>& chunks) {
    const char* names[] = {"h", "dq", "dk", "dv", "di", "df"};
    for (int64_t S : lengths) {
        auto in = make_inputs(2, 2, S, 8, 6, torch::kFloat64, 100 + S, true);
        auto probe = torch::randn({2, 2, S, 6}, torch::kFloat64);
        auto ref = output_and_grads(in, ops::MlstmMode::Parallel, 0, probe);
        for (int64_t chunk : chunks) {
            auto got = output_and_grads(in, mode, chunk, probe);
            for (size_t t = 0; t < ref.size(); ++t)
                EXPECT_TRUE(all_close(got[t], ref[t], 1e-9, 1e-11))
                    << ops::mlstm_mode_name(mode) << " S=" << S << " chunk=" << chunk << " " << names[t];
            if (mode == ops::MlstmMode::Recurrent) break;  // chunk size has no meaning there
        }
    }
}

}  // namespace

TEST(Mlstm, ChunkwiseEqualsParallel) {
    // Multiples of the chunk (16, 64, 96) and not (1, 7, 33, 100), chunk sizes 1..64 and > S.
    expect_forms_agree(ops::MlstmMode::Chunkwise, {1, 7, 16, 33, 64, 96, 100}, {1, 4, 16, 64, 128});
}

TEST(Mlstm, RecurrentEqualsParallel) {
    expect_forms_agree(ops::MlstmMode::Recurrent, {1, 7, 33, 100}, {0});
    // The step API continues from a given state exactly like one scan over the whole sequence.
    auto in = make_inputs(1, 2, 20, 4, 3, torch::kFloat64, 7);
    auto whole = ops::mlstm_recurrent(in.q, in.k, in.v, in.i, in.f);
    using torch::indexing::Slice;
    ops::MlstmState mid;
    auto first = ops::mlstm_recurrent(in.q.slice(2, 0, 11), in.k.slice(2, 0, 11), in.v.slice(2, 0, 11),
                                      in.i.slice(2, 0, 11), in.f.slice(2, 0, 11), ops::kMlstmEps, nullptr, &mid);
    auto second = ops::mlstm_recurrent(in.q.slice(2, 11), in.k.slice(2, 11), in.v.slice(2, 11), in.i.slice(2, 11),
                                       in.f.slice(2, 11), ops::kMlstmEps, &mid);
    EXPECT_TRUE(all_close(torch::cat({first, second}, 2), whole, 0, 0));
}

TEST(Mlstm, ZeroStabiliserStartDiffersOnlyThroughEps) {
    // mlstm_kernels starts from m = 0: with eps = 0 that is the same function (1.16.4).
    auto in = make_inputs(1, 2, 30, 4, 3, torch::kFloat64, 8);
    auto zero_m = ops::mlstm_initial_state(1, 2, 4, 3, in.q.options(), 0.0);
    auto a = ops::mlstm_recurrent(in.q, in.k, in.v, in.i, in.f, 0.0, &zero_m);
    auto b = ops::mlstm_parallel(in.q, in.k, in.v, in.i, in.f, 0.0);
    EXPECT_TRUE(all_close(a, b, 1e-10, 1e-12));
}

TEST(Mlstm, MatchesManualSpec) {
    // Direct transcription of the closed form in 1.7, element by element, in float64.
    const int64_t B = 2, NH = 3, S = 13, DH = 5, DV = 4;
    auto in = make_inputs(B, NH, S, DH, DV, torch::kFloat64, 11);
    const double eps = 1e-6;
    auto q = in.q.accessor<double, 4>();
    auto k = in.k.accessor<double, 4>();
    auto v = in.v.accessor<double, 4>();
    auto ig = in.i.accessor<double, 4>();
    auto fg = in.f.accessor<double, 4>();
    auto expected = torch::zeros({B, NH, S, DV}, torch::kFloat64);
    auto e = expected.accessor<double, 4>();
    auto logsig = [](double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); };
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < NH; ++h)
            for (int64_t i = 0; i < S; ++i) {
                std::vector<double> logD(i + 1);
                double m = -std::numeric_limits<double>::infinity();
                for (int64_t j = 0; j <= i; ++j) {
                    double logF = 0;  // forget gates of steps j+1..i
                    for (int64_t r = j + 1; r <= i; ++r) logF += logsig(fg[b][h][r][0]);
                    logD[j] = logF + ig[b][h][j][0];
                    m = std::max(m, logD[j]);
                }
                std::vector<double> c(i + 1);
                double row_sum = 0;
                for (int64_t j = 0; j <= i; ++j) {
                    double qk = 0;
                    for (int64_t d = 0; d < DH; ++d) qk += q[b][h][i][d] * k[b][h][j][d] / std::sqrt(double(DH));
                    c[j] = qk * std::exp(logD[j] - m);
                    row_sum += c[j];
                }
                const double n = std::max(std::abs(row_sum), std::exp(-m));
                for (int64_t j = 0; j <= i; ++j)
                    for (int64_t d = 0; d < DV; ++d) e[b][h][i][d] += c[j] / (n + eps) * v[b][h][j][d];
            }
    EXPECT_TRUE(all_close(ops::mlstm_parallel(in.q, in.k, in.v, in.i, in.f), expected, 1e-11, 1e-13));
    // Gates given as (B, NH, S) are the same as (B, NH, S, 1).
    EXPECT_TRUE(all_close(ops::mlstm_parallel(in.q, in.k, in.v, in.i.squeeze(-1), in.f.squeeze(-1)), expected,
                          1e-11, 1e-13));
}

TEST(Mlstm, FiniteAtLongSequence) {
    // 16k tokens; gate pre-activations alternate between large positive and negative stretches
    // (|x| up to 60), which overflow exp() unless the stabiliser works.
    const int64_t S = 16384;
    torch::manual_seed(3);
    auto in = make_inputs(1, 1, S, 4, 4, torch::kFloat32, 5);
    auto stretch = (torch::arange(S) / 512).remainder(2).to(torch::kFloat32).mul(2).sub(1).view({1, 1, S, 1});
    in.i = (60.0 * stretch + 5.0 * torch::randn({1, 1, S, 1})).set_requires_grad(true);
    in.f = (-60.0 * stretch + 5.0 * torch::randn({1, 1, S, 1})).set_requires_grad(true);
    in.q.set_requires_grad(true);
    auto h_chunk = run(in, ops::MlstmMode::Chunkwise, 64);
    ASSERT_TRUE(torch::isfinite(h_chunk).all().item<bool>());
    (h_chunk * torch::randn_like(h_chunk)).sum().backward();
    EXPECT_TRUE(torch::isfinite(in.q.grad()).all().item<bool>());
    EXPECT_TRUE(torch::isfinite(in.i.grad()).all().item<bool>());
    EXPECT_TRUE(torch::isfinite(in.f.grad()).all().item<bool>());
    torch::NoGradGuard no_grad;
    auto h_rec = run(in, ops::MlstmMode::Recurrent);
    ASSERT_TRUE(torch::isfinite(h_rec).all().item<bool>());
    auto h_chunk48 = run(in, ops::MlstmMode::Chunkwise, 48);  // chunk not dividing S
    ASSERT_TRUE(torch::isfinite(h_chunk48).all().item<bool>());
    // Accuracy against the same computation in float64 (the parallel form would need a 16k x 16k matrix).
    Inputs in64{in.q.detach().to(torch::kFloat64), in.k.to(torch::kFloat64), in.v.to(torch::kFloat64),
                in.i.detach().to(torch::kFloat64), in.f.detach().to(torch::kFloat64)};
    auto ref = run(in64, ops::MlstmMode::Chunkwise, 64);
    const double err_chunk = relative_error(h_chunk.detach(), ref), err_rec = relative_error(h_rec, ref),
                 err_chunk48 = relative_error(h_chunk48, ref);
    std::printf("16k tokens, float32 vs float64: chunkwise %.3g, chunkwise(48) %.3g, recurrent %.3g\n", err_chunk,
                err_chunk48, err_rec);
    EXPECT_LT(err_chunk, 5e-3);
    EXPECT_LT(err_chunk48, 5e-3);
    EXPECT_LT(err_rec, 5e-3);
    EXPECT_LT(relative_error(run(in64, ops::MlstmMode::Recurrent), ref), 1e-9);
}

TEST(Mlstm, BatchIndependence) {
    auto in = make_inputs(3, 2, 21, 4, 5, torch::kFloat64, 21);
    for (auto mode : {ops::MlstmMode::Parallel, ops::MlstmMode::Chunkwise, ops::MlstmMode::Recurrent}) {
        auto full = run(in, mode, 8);
        for (int64_t b = 0; b < 3; ++b) {
            Inputs one{in.q.narrow(0, b, 1), in.k.narrow(0, b, 1), in.v.narrow(0, b, 1), in.i.narrow(0, b, 1),
                       in.f.narrow(0, b, 1)};
            EXPECT_TRUE(all_close(run(one, mode, 8), full.narrow(0, b, 1), 1e-12, 1e-14))
                << ops::mlstm_mode_name(mode) << " sample " << b;
        }
        // Changing sample 0 leaves samples 1 and 2 untouched.
        Inputs changed = in;
        changed.v = in.v.clone();
        changed.v[0].add_(1.0);
        auto other = run(changed, mode, 8);
        EXPECT_TRUE(all_close(other.slice(0, 1), full.slice(0, 1), 0, 0));
        EXPECT_FALSE(torch::allclose(other[0], full[0]));
    }
}

TEST(Mlstm, Bfloat16WithinTolerance) {
    // bf16 inputs (8-bit mantissa, unit roundoff 2^-8 = 3.9e-3); reference: float64 parallel on the
    // same rounded inputs. Documented tolerance: relative L2 error <= 1e-2 for every form.
    auto in = make_inputs(2, 2, 100, 16, 16, torch::kBFloat16, 31);
    Inputs in64{in.q.to(torch::kFloat64), in.k.to(torch::kFloat64), in.v.to(torch::kFloat64),
                in.i.to(torch::kFloat64), in.f.to(torch::kFloat64)};
    auto ref = run(in64, ops::MlstmMode::Parallel);
    for (auto mode : {ops::MlstmMode::Parallel, ops::MlstmMode::Chunkwise, ops::MlstmMode::Recurrent}) {
        auto h = run(in, mode, 32);
        EXPECT_EQ(h.scalar_type(), torch::kBFloat16);
        const double err = relative_error(h, ref);
        EXPECT_LT(err, 1e-2) << ops::mlstm_mode_name(mode);
        RecordProperty(std::string("bf16_rel_err_") + ops::mlstm_mode_name(mode), std::to_string(err));
        std::printf("bf16 %s: relative L2 error %.3g\n", ops::mlstm_mode_name(mode), err);
    }
    // float32 for comparison: much tighter.
    Inputs in32{in64.q.to(torch::kFloat32), in64.k.to(torch::kFloat32), in64.v.to(torch::kFloat32),
                in64.i.to(torch::kFloat32), in64.f.to(torch::kFloat32)};
    for (auto mode : {ops::MlstmMode::Parallel, ops::MlstmMode::Chunkwise, ops::MlstmMode::Recurrent})
        EXPECT_LT(relative_error(run(in32, mode, 32), ref), 1e-5) << ops::mlstm_mode_name(mode);
}

TEST(Mlstm, CountsMatmulFlops) {
    const int64_t B = 2, NH = 3, S = 20, DH = 4, DV = 5, L = 8;
    auto in = make_inputs(B, NH, S, DH, DV, torch::kFloat32, 41);
    {
        linvis::flops::Counter c;
        run(in, ops::MlstmMode::Parallel);
        EXPECT_EQ(c.macs(), B * NH * (S * S * DH + S * S * DV));
    }
    {
        linvis::flops::Counter c;
        run(in, ops::MlstmMode::Recurrent);
        EXPECT_EQ(c.macs(), B * NH * S * (2 * DH * DV + DH));
    }
    {
        linvis::flops::Counter c;
        run(in, ops::MlstmMode::Chunkwise, L);
        const int64_t NC = (S + L - 1) / L;
        const int64_t intra = NC * (L * L * DH + L * L * DV);
        const int64_t inter = (NC - 1) * L * DH * DV + NC * L * DH * DV + NC * L * DH;
        EXPECT_EQ(c.macs(), B * NH * (intra + inter));
    }
}

TEST(Mlstm, RejectsBadShapes) {
    auto in = make_inputs(1, 2, 5, 4, 3, torch::kFloat32, 1);
    EXPECT_THROW(ops::mlstm_parallel(in.q, in.k.slice(2, 0, 4), in.v, in.i, in.f), linvis::Error);
    EXPECT_THROW(ops::mlstm_chunkwise(in.q, in.k, in.v, in.i.slice(2, 0, 4), in.f), linvis::Error);
    EXPECT_THROW(ops::mlstm_chunkwise(in.q, in.k, in.v, in.i, in.f, 0), linvis::Error);
    EXPECT_THROW(ops::parse_mlstm_mode("quadratic"), linvis::Error);
}

namespace {
void gradcheck_form(ops::MlstmMode mode) {
    auto in = make_inputs(1, 2, 5, 3, 2, torch::kFloat64, 51, true);
    auto f = [mode](const std::vector<torch::Tensor>& x) { return ops::mlstm(x[0], x[1], x[2], x[3], x[4], mode, 2, ops::kMlstmEps, ops::Impl::Reference); };
    EXPECT_TRUE(gradcheck(f, in.list(), 1e-6, 1e-7, 1e-5));
}
}  // namespace

TEST(Ops, GradcheckMlstmParallel) { gradcheck_form(ops::MlstmMode::Parallel); }
TEST(Ops, GradcheckMlstmChunkwise) { gradcheck_form(ops::MlstmMode::Chunkwise); }
TEST(Ops, GradcheckMlstmRecurrent) { gradcheck_form(ops::MlstmMode::Recurrent); }
