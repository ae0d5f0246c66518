// T5 / DiT5 TTT attention (include/linvis/ops/t5_ttt.h, spec vit3_t5_official.md B2, B4).
#include <cmath>
#include <iostream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/attention.h"
#include "linvis/ops/neighborhood_attention.h"
#include "linvis/ops/t5_ttt.h"
#include "support/testing.h"

using namespace linvis::ops;
using linvis::testing::all_close;
using linvis::testing::gradcheck;
using linvis::testing::relative_error;

namespace {

torch::TensorOptions f64() { return torch::TensorOptions().dtype(torch::kFloat64); }

T5TttParams random_t5_params(int64_t C, int64_t h, torch::Dtype dtype, double w_std = 0.3) {
    const int64_t d = C / h;
    auto o = torch::TensorOptions().dtype(dtype);
    T5TttParams p;
    p.w1 = torch::randn({1, h, d, d}, o) * w_std;
    p.w2 = torch::randn({1, h, d, d}, o) * w_std;
    p.w3 = torch::randn({1, h, d, d}, o) * w_std;
    p.q_conv_weight = torch::rand({C, 1, 3, 3}, o) * (2.0 / 3) - 1.0 / 3;  // PyTorch default range
    p.q_conv_bias = torch::rand({C}, o) * (2.0 / 3) - 1.0 / 3;
    p.k_conv_weight = torch::rand({C, 1, 3, 3}, o) * (2.0 / 3) - 1.0 / 3;
    p.k_conv_bias = torch::rand({C}, o) * (2.0 / 3) - 1.0 / 3;
    return p;
}

Dit5TttParams random_dit5_params(int64_t C, int64_t h, torch::Dtype dtype, double w_std = 0.3) {
    T5TttParams t = random_t5_params(C, h, dtype, w_std);
    auto o = torch::TensorOptions().dtype(dtype);
    Dit5TttParams p;
    p.w1 = t.w1;
    p.w2 = t.w2;
    p.qk_scale = 1.0 + 0.3 * torch::randn({1, 1, C, 2}, o);
    p.qk_offset = 0.3 * torch::randn({1, 1, C, 2}, o);
    p.q_conv_weight = t.q_conv_weight;
    p.q_conv_bias = t.q_conv_bias;
    p.k_conv_weight = t.k_conv_weight;
    p.k_conv_bias = t.k_conv_bias;
    return p;
}

// ---- A manual version of the spec, written from the text of B2/B4 only: one sample at a time,
// hand instance norm, the 3x3 conv as nine shifted products, the inner gradient by autograd of
// the inner loss, one head at a time.

// x (N, C) on an H x W grid -> x + DWConv3x3(x), (N, C).
torch::Tensor manual_residual_conv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, int64_t H,
                                   int64_t W) {
    const int64_t C = x.size(1);
    auto grid = x.t().reshape({C, H, W});
    auto padded = torch::constant_pad_nd(grid, {1, 1, 1, 1}, 0.0);
    auto out = b.view({C, 1, 1}).expand({C, H, W}).clone();
    for (int64_t a = 0; a < 3; ++a)
        for (int64_t c = 0; c < 3; ++c)
            out = out + w.select(1, 0).select(1, a).select(1, c).view({C, 1, 1}) *
                            padded.narrow(1, a, H).narrow(2, c, W);
    return x + out.reshape({C, H * W}).t();
}

torch::Tensor manual_instance_norm(const torch::Tensor& k /* (N, C) */) {
    auto mean = k.mean(0, true);
    auto var = (k - mean).pow(2).mean(0, true);  // biased
    return (k - mean) / torch::sqrt(var + 1.0);
}

// Per-head inner step with autograd; kind 0 = TTT-SwiGLU inner product loss, 1 = TTT-MLP L2 loss.
torch::Tensor manual_inner(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V,
                           std::vector<torch::Tensor> w, int kind) {
    const double N = static_cast<double>(K.size(0));
    const double s = 1.0 / std::sqrt(static_cast<double>(K.size(1)));
    for (auto& t : w) t = t.detach().clone().requires_grad_();
    torch::Tensor loss;
    if (kind == 0) {
        auto f = torch::matmul(torch::silu(torch::matmul(K, w[0])) * torch::matmul(K, w[1]), w[2]);
        loss = -(s / N) * (f * V).sum();
    } else {
        auto f = torch::matmul(torch::silu(torch::matmul(K, w[0])), w[1]);
        loss = (s / (2 * N)) * (f - V).pow(2).sum();
    }
    auto g = torch::autograd::grad({loss}, w);
    std::vector<torch::Tensor> updated;
    for (size_t i = 0; i < w.size(); ++i) updated.push_back((w[i] - g[i]).detach());
    if (kind == 0)
        return torch::matmul(torch::silu(torch::matmul(Q, updated[0])) * torch::matmul(Q, updated[1]), updated[2]);
    return torch::matmul(torch::silu(torch::matmul(Q, updated[0])), updated[1]);
}

torch::Tensor manual_t5(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const T5TttParams& p,
                        int64_t h, int64_t H, int64_t W) {
    std::vector<torch::Tensor> outs;
    const int64_t C = q.size(2), d = C / h;
    for (int64_t b = 0; b < q.size(0); ++b) {
        auto q2 = manual_residual_conv(q[b], p.q_conv_weight, p.q_conv_bias, H, W);
        auto k2 = manual_residual_conv(manual_instance_norm(k[b]), p.k_conv_weight, p.k_conv_bias, H, W);
        std::vector<torch::Tensor> heads;
        for (int64_t i = 0; i < h; ++i)
            heads.push_back(manual_inner(q2.narrow(1, i * d, d), k2.narrow(1, i * d, d), v[b].narrow(1, i * d, d),
                                         {p.w1[0][i], p.w2[0][i], p.w3[0][i]}, 0));
        outs.push_back(torch::cat(heads, 1));
    }
    return torch::stack(outs);
}

// Allowed mask of NATTEN's clamped windows, clamp(i - K/2, 0, L - K) per axis.
torch::Tensor manual_na_mask(int64_t H, int64_t W, int64_t K) {
    auto start = [&](int64_t i, int64_t L) { return std::min(std::max<int64_t>(i - K / 2, 0), L - K); };
    auto m = torch::zeros({H * W, H * W}, torch::kBool);
    for (int64_t i = 0; i < H * W; ++i)
        for (int64_t j = 0; j < H * W; ++j) {
            const int64_t sy = start(i / W, H), sx = start(i % W, W);
            m[i][j] = j / W >= sy && j / W < sy + K && j % W >= sx && j % W < sx + K;
        }
    return m;
}

torch::Tensor manual_dit5(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const Dit5TttParams& p, int64_t h, int64_t H, int64_t W, int64_t K, bool with_na) {
    std::vector<torch::Tensor> outs;
    const int64_t C = q.size(2), d = C / h;
    auto mask = manual_na_mask(H, W, K);
    for (int64_t b = 0; b < q.size(0); ++b) {
        auto qt = q[b] * p.qk_scale[0][0].select(1, 0) + p.qk_offset[0][0].select(1, 0);
        auto kt = k[b] * p.qk_scale[0][0].select(1, 1) + p.qk_offset[0][0].select(1, 1);
        auto q2 = manual_residual_conv(qt, p.q_conv_weight, p.q_conv_bias, H, W);
        auto k2 = manual_residual_conv(manual_instance_norm(kt), p.k_conv_weight, p.k_conv_bias, H, W);
        std::vector<torch::Tensor> heads;
        for (int64_t i = 0; i < h; ++i) {
            auto ttt = manual_inner(q2.narrow(1, i * d, d), k2.narrow(1, i * d, d), v[b].narrow(1, i * d, d),
                                    {p.w1[0][i], p.w2[0][i]}, 1);
            if (!with_na) {
                heads.push_back(ttt);
                continue;
            }
            auto Q = q[b].narrow(1, i * d, d), Kr = k[b].narrow(1, i * d, d), V = v[b].narrow(1, i * d, d);
            auto logits = torch::matmul(Q / std::sqrt(static_cast<double>(d)), Kr.t())
                              .masked_fill(mask.logical_not(), -INFINITY);
            auto na = torch::matmul(logits.softmax(-1), V);
            heads.push_back(0.5 * na + 0.5 * ttt);
        }
        outs.push_back(torch::cat(heads, 1));
    }
    return torch::stack(outs);
}

}  // namespace

TEST(T5, InstanceNormKeys) {
    torch::manual_seed(20);
    // Keys with a large shared offset (the key bias the paper removes).
    auto k = torch::randn({2, 12, 6}, f64()) * 0.7 + 3.0;
    auto got = key_instance_norm_tokens(k);
    ASSERT_EQ(got.sizes(), k.sizes());
    ASSERT_EQ(key_instance_norm(k).sizes(), torch::IntArrayRef({2, 6, 12, 1}));
    auto expected = torch::empty_like(k);
    auto unbiased = torch::empty_like(k);
    for (int64_t b = 0; b < 2; ++b)
        for (int64_t c = 0; c < 6; ++c) {
            double mean = 0, sq = 0;
            for (int64_t n = 0; n < 12; ++n) mean += k[b][n][c].item<double>();
            mean /= 12;
            for (int64_t n = 0; n < 12; ++n) sq += std::pow(k[b][n][c].item<double>() - mean, 2);
            for (int64_t n = 0; n < 12; ++n) {
                expected[b][n][c] = (k[b][n][c].item<double>() - mean) / std::sqrt(sq / 12 + 1.0);
                unbiased[b][n][c] = (k[b][n][c].item<double>() - mean) / std::sqrt(sq / 11 + 1.0);
            }
        }
    EXPECT_TRUE(all_close(got, expected, 1e-13, 1e-13));
    // The check can tell biased from unbiased variance and eps 1.0 from a small eps.
    EXPECT_GT((got - unbiased).abs().max().item<double>(), 1e-3);
    EXPECT_GT((key_instance_norm_tokens(k, 1e-5) - got).abs().max().item<double>(), 1e-2);
    // Shift invariance: adding a per-channel constant to every key changes nothing.
    EXPECT_TRUE(all_close(key_instance_norm_tokens(k + torch::randn({1, 1, 6}, f64()) * 5), got, 1e-12, 1e-12));
    EXPECT_THROW(key_instance_norm(torch::randn({2, 3})), linvis::Error);
}

TEST(T5, InnerGradientsEqualAutograd) {
    torch::manual_seed(21);
    const int64_t B = 2, h = 3, N = 10, d = 4;
    auto k = torch::randn({B, h, N, d}, f64()), v = torch::randn({B, h, N, d}, f64());
    const double s = 0.5;
    // Per-sample fast weights as leaves, so autograd gives one gradient per (sample, head).
    std::vector<torch::Tensor> w;
    for (int i = 0; i < 3; ++i) w.push_back((torch::randn({B, h, d, d}, f64()) * 0.5).requires_grad_());
    {
        auto closed = ttt_swiglu_inner_gradients(k, v, w[0], w[1], w[2], s);
        auto g = torch::autograd::grad({ttt_swiglu_inner_loss(k, v, w[0], w[1], w[2], s).sum()}, w);
        EXPECT_TRUE(all_close(closed.g1, g[0], 1e-12, 1e-14));
        EXPECT_TRUE(all_close(closed.g2, g[1], 1e-12, 1e-14));
        EXPECT_TRUE(all_close(closed.g3, g[2], 1e-12, 1e-14));
        // Sign convention: the loss is the NEGATIVE inner product, so -G would not match.
        EXPECT_GT((closed.g3 + g[2]).abs().max().item<double>(), 1e-4);
    }
    {
        auto closed = ttt_mlp_inner_gradients(k, v, w[0], w[1], s);
        auto g = torch::autograd::grad({ttt_mlp_inner_loss(k, v, w[0], w[1], s).sum()}, {w[0], w[1]});
        EXPECT_TRUE(all_close(closed.g1, g[0], 1e-12, 1e-14));
        EXPECT_TRUE(all_close(closed.g2, g[1], 1e-12, 1e-14));
    }
    // Shared (1, h, d, d) weights: the per-sample closed forms sum to autograd's shared gradient.
    auto shared = (torch::randn({1, h, d, d}, f64()) * 0.5).requires_grad_();
    auto w2 = torch::randn({1, h, d, d}, f64()) * 0.5, w3 = torch::randn({1, h, d, d}, f64()) * 0.5;
    auto closed = ttt_swiglu_inner_gradients(k, v, shared, w2, w3, s);
    auto g = torch::autograd::grad({ttt_swiglu_inner_loss(k, v, shared, w2, w3, s).sum()}, {shared});
    EXPECT_TRUE(all_close(closed.g1.sum(0, true), g[0], 1e-12, 1e-14));
}

TEST(T5, MatchesManualSpec) {
    torch::manual_seed(22);
    const int64_t B = 2, H = 4, W = 5, N = H * W, C = 12, h = 3;
    auto q = torch::randn({B, N, C}, f64()), k = torch::randn({B, N, C}, f64()) + 2.0,
         v = torch::randn({B, N, C}, f64());
    auto p = random_t5_params(C, h, torch::kFloat64);
    auto got = t5_ttt_attention(q, k, v, p, h, H, W, Impl::Reference);
    EXPECT_TRUE(all_close(got, manual_t5(q, k, v, p, h, H, W), 1e-11, 1e-12));

    auto pd = random_dit5_params(C, h, torch::kFloat64);
    EXPECT_TRUE(all_close(dit5_ttt_attention(q, k, v, pd, h, H, W), manual_dit5(q, k, v, pd, h, H, W, 3, false),
                          1e-11, 1e-12));
    EXPECT_TRUE(all_close(dit5_mixed_attention(q, k, v, pd, h, H, W, 3), manual_dit5(q, k, v, pd, h, H, W, 3, true),
                          1e-11, 1e-12));
    // The learnable k scale survives the eps-1.0 instance norm; the k offset does not.
    auto pd2 = pd;
    pd2.qk_offset = pd.qk_offset.clone();
    pd2.qk_offset.select(3, 1).add_(1.5);
    EXPECT_TRUE(all_close(dit5_ttt_attention(q, k, v, pd2, h, H, W), dit5_ttt_attention(q, k, v, pd, h, H, W), 1e-11,
                          1e-12));
    auto pd3 = pd;
    pd3.qk_scale = pd.qk_scale.clone();
    pd3.qk_scale.select(3, 1).mul_(2.0);
    EXPECT_GT((dit5_ttt_attention(q, k, v, pd3, h, H, W) - dit5_ttt_attention(q, k, v, pd, h, H, W))
                  .abs().max().item<double>(), 1e-6);
    // Shape errors name the tensor.
    auto bad = p;
    bad.w3 = torch::randn({1, h, 4, 3}, f64());
    try {
        t5_ttt_attention(q, k, v, bad, h, H, W, Impl::Reference);
        FAIL() << "no error for a bad w3";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("w3"), std::string::npos) << e.what();
    }
    EXPECT_THROW(t5_ttt_attention(q, k, v, p, h, 5, 5, Impl::Reference), linvis::Error);
}

TEST(T5, FlopsCount) {
    torch::manual_seed(23);
    const int64_t B = 2, H = 4, W = 4, N = 16, C = 12, h = 3, d = 4;
    auto q = torch::randn({B, N, C}), k = torch::randn({B, N, C}), v = torch::randn({B, N, C});
    {
        linvis::flops::Counter counter;
        t5_ttt_attention(q, k, v, random_t5_params(C, h, torch::kFloat32), h, H, W, Impl::Reference);
        // 9 d x d products per (sample, head): z1, z2, da2, G1, G2, G3 and three read-out products;
        // two depthwise 3x3 convs.
        EXPECT_EQ(counter.macs(), 9 * B * h * N * d * d + 2 * 9 * B * N * C);
    }
    {
        linvis::flops::Counter counter;
        dit5_mixed_attention(q, k, v, random_dit5_params(C, h, torch::kFloat32), h, H, W, 3);
        EXPECT_EQ(counter.macs(), 7 * B * h * N * d * d + 2 * 9 * B * N * C + 2 * B * h * N * 9 * d);
    }
}

TEST(Ops, GradcheckT5Attention) {
    torch::manual_seed(24);
    const int64_t B = 1, H = 2, W = 3, N = 6, C = 4, h = 2;
    auto p = random_t5_params(C, h, torch::kFloat64);
    std::vector<torch::Tensor> in = {torch::randn({B, N, C}, f64()), torch::randn({B, N, C}, f64()),
                                     torch::randn({B, N, C}, f64()), p.w1, p.w2, p.w3, p.q_conv_weight,
                                     p.q_conv_bias, p.k_conv_weight, p.k_conv_bias};
    for (auto& t : in) t = t.detach().clone().requires_grad_();
    EXPECT_TRUE(gradcheck(
        [&](const std::vector<torch::Tensor>& x) {
            return t5_ttt_attention(x[0], x[1], x[2], T5TttParams{x[3], x[4], x[5], x[6], x[7], x[8], x[9]}, h, H, W, Impl::Reference);
        },
        in));
}

TEST(Ops, GradcheckT5Dit5Mixed) {
    torch::manual_seed(25);
    const int64_t B = 1, H = 3, W = 3, N = 9, C = 4, h = 2;
    auto p = random_dit5_params(C, h, torch::kFloat64);
    std::vector<torch::Tensor> in = {torch::randn({B, N, C}, f64()), torch::randn({B, N, C}, f64()),
                                     torch::randn({B, N, C}, f64()), p.w1, p.w2, p.qk_scale, p.qk_offset,
                                     p.q_conv_weight, p.q_conv_bias, p.k_conv_weight, p.k_conv_bias};
    for (auto& t : in) t = t.detach().clone().requires_grad_();
    EXPECT_TRUE(gradcheck(
        [&](const std::vector<torch::Tensor>& x) {
            return dit5_mixed_attention(x[0], x[1], x[2],
                                        Dit5TttParams{x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10]}, h, H, W, 3);
        },
        in));
}

TEST(T5, AttentionOpsBatchIndependence) {
    torch::manual_seed(26);
    const int64_t B = 3, H = 5, W = 5, N = 25, C = 24, h = 3;
    auto q = torch::randn({B, N, C}), k = torch::randn({B, N, C}), v = torch::randn({B, N, C});
    auto p = random_t5_params(C, h, torch::kFloat32, 0.05);
    auto pd = random_dit5_params(C, h, torch::kFloat32, 0.05);
    auto full = t5_ttt_attention(q, k, v, p, h, H, W, Impl::Reference);
    auto full_mixed = dit5_mixed_attention(q, k, v, pd, h, H, W, 5);
    for (int64_t b = 0; b < B; ++b) {
        auto one = [&](const torch::Tensor& t) { return t.narrow(0, b, 1); };
        EXPECT_TRUE(all_close(one(full), t5_ttt_attention(one(q), one(k), one(v), p, h, H, W, Impl::Reference), 1e-5, 1e-6)) << b;
        EXPECT_TRUE(all_close(one(full_mixed), dit5_mixed_attention(one(q), one(k), one(v), pd, h, H, W, 5), 1e-5,
                              1e-6)) << b;
    }
}

// Tolerance 1.5e-2 relative L2: bf16 (unit roundoff 3.9e-3) through the instance norm, two convs and
// three chained d x d products of the inner step plus three of the read-out.
TEST(T5, Bfloat16WithinTolerance) {
    torch::manual_seed(27);
    const int64_t B = 2, H = 14, W = 14, N = 196, C = 192, h = 3;
    auto q = torch::randn({B, N, C}).to(torch::kBFloat16), k = torch::randn({B, N, C}).to(torch::kBFloat16),
         v = torch::randn({B, N, C}).to(torch::kBFloat16);
    auto p = random_t5_params(C, h, torch::kBFloat16, 0.02);
    auto d64 = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
    T5TttParams p64{d64(p.w1), d64(p.w2), d64(p.w3), d64(p.q_conv_weight), d64(p.q_conv_bias), d64(p.k_conv_weight),
                    d64(p.k_conv_bias)};
    auto out = t5_ttt_attention(q, k, v, p, h, H, W, Impl::Reference);
    ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
    double err = relative_error(out, t5_ttt_attention(d64(q), d64(k), d64(v), p64, h, H, W, Impl::Reference));

    auto pd = random_dit5_params(C, h, torch::kBFloat16, 0.02);
    Dit5TttParams pd64{d64(pd.w1), d64(pd.w2), d64(pd.qk_scale), d64(pd.qk_offset), d64(pd.q_conv_weight),
                       d64(pd.q_conv_bias), d64(pd.k_conv_weight), d64(pd.k_conv_bias)};
    double err_mixed = relative_error(dit5_mixed_attention(q, k, v, pd, h, H, W, 5),
                                      dit5_mixed_attention(d64(q), d64(k), d64(v), pd64, h, H, W, 5));
    std::cout << "[measure] T5 TTT attention bf16 rel err " << err << ", DiT5 mixed " << err_mixed << "\n";
    EXPECT_LT(err, 1.5e-2);
    EXPECT_LT(err_mixed, 1.5e-2);
}
