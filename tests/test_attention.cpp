// Softmax, linear and 2-D neighborhood attention (include/linvis/ops/attention.h,
// include/linvis/ops/neighborhood_attention.h).
#include <algorithm>
#include <iostream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/attention.h"
#include "linvis/ops/neighborhood_attention.h"
#include "support/testing.h"

using namespace linvis::ops;
using linvis::testing::all_close;
using linvis::testing::gradcheck;
using linvis::testing::relative_error;

namespace {

const auto kF64 = torch::TensorOptions().dtype(torch::kFloat64);

// Window start written independently of the library: clamp(i - K/2, 0, L - K).
int64_t clamped_start(int64_t i, int64_t length, int64_t k) {
    if (k >= length) return 0;
    return std::min(std::max<int64_t>(i - k / 2, 0), length - k);
}

// Allowed-key mask (N, N) built from clamped_start, for the brute-force reference.
torch::Tensor brute_force_mask(int64_t H, int64_t W, int64_t k) {
    auto mask = torch::zeros({H * W, H * W}, torch::kBool);
    for (int64_t y = 0; y < H; ++y)
        for (int64_t x = 0; x < W; ++x)
            for (int64_t y2 = 0; y2 < H; ++y2)
                for (int64_t x2 = 0; x2 < W; ++x2) {
                    const int64_t sy = clamped_start(y, H, k), sx = clamped_start(x, W, k);
                    const bool inside = y2 >= sy && y2 < sy + std::min(k, H) && x2 >= sx && x2 < sx + std::min(k, W);
                    mask[y * W + x][y2 * W + x2] = inside;
                }
    return mask;
}

// (B, h, H, W, d) -> (B, h, N, d)
torch::Tensor flat(const torch::Tensor& t) { return t.reshape({t.size(0), t.size(1), t.size(2) * t.size(3), t.size(4)}); }

}  // namespace

TEST(NeighborhoodAttention, BorderClamp) {
    // Window starts on a 7-long axis computed by hand.
    const std::vector<int64_t> k3 = {0, 0, 1, 2, 3, 4, 4};
    const std::vector<int64_t> k5 = {0, 0, 0, 1, 2, 2, 2};
    for (int64_t i = 0; i < 7; ++i) {
        EXPECT_EQ(natten_window_start(i, 7, 3), k3[i]) << "k=3 i=" << i;
        EXPECT_EQ(natten_window_start(i, 7, 5), k5[i]) << "k=5 i=" << i;
    }
    // Corner / edge windows of a 7x7 grid: (query y, x, K) -> first neighbour and last neighbour.
    struct Case { int64_t y, x, k, first_y, first_x; };
    for (const Case& c : {Case{0, 0, 3, 0, 0}, Case{6, 6, 3, 4, 4}, Case{0, 3, 5, 0, 1}, Case{6, 0, 5, 2, 0},
                          Case{3, 6, 3, 2, 4}, Case{1, 5, 5, 0, 2}, Case{3, 3, 5, 1, 1}}) {
        auto idx = neighborhood_indices(7, 7, c.k);
        ASSERT_EQ(idx.sizes(), torch::IntArrayRef({49, c.k * c.k}));
        for (int64_t a = 0; a < c.k; ++a)
            for (int64_t b = 0; b < c.k; ++b)
                EXPECT_EQ(idx[c.y * 7 + c.x][a * c.k + b].item<int64_t>(), (c.first_y + a) * 7 + c.first_x + b)
                    << "query (" << c.y << "," << c.x << ") k=" << c.k << " neighbour " << a * c.k + b;
    }
    // Below the kernel: WholeAxis keeps the whole short axis; FlatWrap takes the clamp formula literally
    // (start G - 5 = -1 on a 4x4 grid for every query) and wraps negative flat indices like PyTorch: the
    // first neighbour (-1)*4 + (-1) = -5 -> 11, neighbour 5 (row 0, column -1) = -1 -> 15, the last 3*4+3 = 15.
    EXPECT_EQ(neighborhood_indices(4, 4, 5).sizes(), torch::IntArrayRef({16, 16}));
    auto wrap = neighborhood_indices(4, 4, 5, NatSmallGrid::FlatWrap);
    ASSERT_EQ(wrap.sizes(), torch::IntArrayRef({16, 25}));
    for (int64_t n = 0; n < 16; ++n) {
        EXPECT_EQ(wrap[n][0].item<int64_t>(), 11);
        EXPECT_EQ(wrap[n][5].item<int64_t>(), 15);
        EXPECT_EQ(wrap[n][6].item<int64_t>(), 0);
        EXPECT_EQ(wrap[n][24].item<int64_t>(), 15);
    }
    EXPECT_EQ(natten_window_start(0, 4, 5, NatSmallGrid::FlatWrap), -1);
    EXPECT_TRUE(neighborhood_indices(7, 7, 5, NatSmallGrid::FlatWrap).equal(neighborhood_indices(7, 7, 5)));
    EXPECT_THROW(neighborhood_indices(2, 2, 5, NatSmallGrid::FlatWrap), linvis::Error);  // index -9 < -4
    // Output equals brute-force masked softmax attention with the clamped-window mask.
    torch::manual_seed(1);
    for (int64_t k : {3, 5}) {
        auto q = torch::randn({2, 2, 7, 7, 4}, kF64), kk = torch::randn({2, 2, 7, 7, 4}, kF64),
             v = torch::randn({2, 2, 7, 7, 3}, kF64);
        const double scale = 0.5;
        auto na = neighborhood_attention_2d(q, kk, v, k, scale);
        auto mask = brute_force_mask(7, 7, k);
        EXPECT_TRUE(mask.equal(neighborhood_mask(7, 7, k))) << "k=" << k;
        auto ref = softmax_attention(flat(q), flat(kk), flat(v), scale, mask);
        EXPECT_TRUE(all_close(flat(na), ref, 1e-12, 1e-12)) << "k=" << k;
        // The window is shifted, not truncated: every query sees exactly k*k keys.
        EXPECT_TRUE(mask.sum(1).eq(k * k).all().item<bool>());
        // A truncated (zero-padded) window would give a different result at the border.
        auto truncated = torch::zeros({49, 49}, torch::kBool);
        for (int64_t i = 0; i < 49; ++i)
            for (int64_t j = 0; j < 49; ++j)
                truncated[i][j] = std::abs(i / 7 - j / 7) <= k / 2 && std::abs(i % 7 - j % 7) <= k / 2;
        auto wrong = softmax_attention(flat(q), flat(kk), flat(v), scale, truncated);
        EXPECT_GT((wrong - ref).abs().max().item<double>(), 1e-3);
    }
    // Logit order: neighbour n = ky*K + kx, value q . k.
    auto q = torch::randn({1, 1, 7, 7, 4}, kF64), kk = torch::randn({1, 1, 7, 7, 4}, kF64);
    auto logits = na2d_qk(q, kk, 5);
    ASSERT_EQ(logits.sizes(), torch::IntArrayRef({1, 1, 7, 7, 25}));
    for (int64_t n = 0; n < 25; ++n) {
        // query (6, 1) with K = 5: window rows 2..6, columns 0..4
        const double expect = (q[0][0][6][1] * kk[0][0][2 + n / 5][0 + n % 5]).sum().item<double>();
        EXPECT_NEAR(logits[0][0][6][1][n].item<double>(), expect, 1e-12) << "neighbour " << n;
    }
    EXPECT_THROW(natten_window_start(0, 7, 4), linvis::Error);
}

TEST(NeighborhoodAttention, FullWindowEqualsSoftmax) {
    torch::manual_seed(2);
    struct Case { int64_t H, W, k; };
    for (const Case& c : {Case{7, 7, 7}, Case{7, 7, 9}, Case{5, 7, 7}, Case{4, 6, 11}}) {
        auto q = torch::randn({2, 3, c.H, c.W, 5}, kF64), k = torch::randn({2, 3, c.H, c.W, 5}, kF64),
             v = torch::randn({2, 3, c.H, c.W, 4}, kF64);
        auto na = neighborhood_attention_2d(q, k, v, c.k, 0.3);
        auto ref = softmax_attention(flat(q), flat(k), flat(v), 0.3);
        EXPECT_TRUE(all_close(flat(na), ref, 1e-12, 1e-12)) << c.H << "x" << c.W << " k=" << c.k;
    }
    // A window smaller than the grid is not global attention.
    auto q = torch::randn({1, 1, 7, 7, 5}, kF64), k = torch::randn({1, 1, 7, 7, 5}, kF64),
         v = torch::randn({1, 1, 7, 7, 4}, kF64);
    EXPECT_GT((flat(neighborhood_attention_2d(q, k, v, 5, 0.3)) - softmax_attention(flat(q), flat(k), flat(v), 0.3))
                  .abs().max().item<double>(), 1e-3);
}

TEST(LinearAttention, CausalEqualsMaskedQuadratic) {
    torch::manual_seed(3);
    auto q = torch::randn({2, 2, 37, 6}, kF64), k = torch::randn({2, 2, 37, 6}, kF64),
         v = torch::randn({2, 2, 37, 5}, kF64);
    for (bool normalize : {true, false})
        for (FeatureMap map : {FeatureMap::EluPlusOne, FeatureMap::Relu})
            for (int64_t chunk : {1, 8, 37, 64}) {
                LinearAttentionOptions opt;
                opt.causal = true;
                opt.normalize = normalize;
                opt.feature_map = map;
                opt.chunk_size = chunk;
                auto pq = map == FeatureMap::Relu ? torch::relu(q) : torch::elu(q) + 1;
                auto pk = map == FeatureMap::Relu ? torch::relu(k) : torch::elu(k) + 1;
                auto scores = torch::matmul(pq, pk.transpose(-2, -1)).tril();
                auto ref = torch::matmul(scores, v);
                if (normalize) ref = ref / (scores.sum(-1, true) + opt.eps);
                EXPECT_TRUE(all_close(linear_attention(q, k, v, opt), ref, 1e-11, 1e-12))
                    << "normalize " << normalize << " chunk " << chunk;
            }
    // Non-causal: the same quadratic form without the mask.
    auto pq = torch::elu(q) + 1, pk = torch::elu(k) + 1;
    auto scores = torch::matmul(pq, pk.transpose(-2, -1));
    auto ref = torch::matmul(scores, v) / (scores.sum(-1, true) + 1e-6);
    EXPECT_TRUE(all_close(linear_attention(q, k, v), ref, 1e-11, 1e-12));
    // Causal differs from non-causal (the mask matters).
    LinearAttentionOptions causal;
    causal.causal = true;
    EXPECT_GT((linear_attention(q, k, v, causal) - ref).abs().max().item<double>(), 1e-3);
}

TEST(Ops, GradcheckAttentionSoftmax) {
    torch::manual_seed(4);
    auto q = torch::randn({1, 2, 5, 3}, kF64).requires_grad_(), k = torch::randn({1, 2, 6, 3}, kF64).requires_grad_(),
         v = torch::randn({1, 2, 6, 2}, kF64).requires_grad_();
    auto mask = torch::rand({5, 6}) > 0.3;
    mask.select(1, 0).fill_(true);
    EXPECT_TRUE(gradcheck([](const std::vector<torch::Tensor>& in) { return softmax_attention(in[0], in[1], in[2], 0.7); },
                          {q, k, v}));
    EXPECT_TRUE(gradcheck(
        [&](const std::vector<torch::Tensor>& in) { return softmax_attention(in[0], in[1], in[2], 0.7, mask); },
        {q, k, v}));
}

TEST(Ops, GradcheckAttentionLinear) {
    torch::manual_seed(5);
    auto q = torch::randn({1, 2, 7, 3}, kF64).requires_grad_(), k = torch::randn({1, 2, 7, 3}, kF64).requires_grad_(),
         v = torch::randn({1, 2, 7, 2}, kF64).requires_grad_();
    for (bool causal : {false, true}) {
        LinearAttentionOptions opt;
        opt.causal = causal;
        opt.chunk_size = 3;
        EXPECT_TRUE(gradcheck([&](const std::vector<torch::Tensor>& in) { return linear_attention(in[0], in[1], in[2], opt); },
                              {q, k, v}))
            << "causal " << causal;
    }
}

TEST(Ops, GradcheckNeighborhoodAttention) {
    torch::manual_seed(6);
    auto q = torch::randn({1, 2, 4, 5, 2}, kF64).requires_grad_(), k = torch::randn({1, 2, 4, 5, 2}, kF64).requires_grad_(),
         v = torch::randn({1, 2, 4, 5, 2}, kF64).requires_grad_();
    EXPECT_TRUE(gradcheck(
        [](const std::vector<torch::Tensor>& in) { return neighborhood_attention_2d(in[0], in[1], in[2], 3, 0.6); },
        {q, k, v}));
}

namespace {
// f(batch) row b equals f(sample b alone).
::testing::AssertionResult batch_independent(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
                                             const std::vector<torch::Tensor>& batch, double tol) {
    auto full = f(batch);
    for (int64_t b = 0; b < batch[0].size(0); ++b) {
        std::vector<torch::Tensor> one;
        for (auto& t : batch) one.push_back(t.narrow(0, b, 1));
        auto ok = all_close(full.narrow(0, b, 1), f(one), tol, tol);
        if (!ok) return ::testing::AssertionFailure() << "sample " << b << ": " << ok.message();
    }
    return ::testing::AssertionSuccess();
}
}  // namespace

TEST(SoftmaxAttention, BatchIndependence) {
    torch::manual_seed(7);
    std::vector<torch::Tensor> in = {torch::randn({3, 2, 20, 8}), torch::randn({3, 2, 20, 8}), torch::randn({3, 2, 20, 8})};
    EXPECT_TRUE(batch_independent([](const auto& t) { return softmax_attention(t[0], t[1], t[2], 0.35); }, in, 1e-6));
}

TEST(LinearAttention, BatchIndependence) {
    torch::manual_seed(8);
    std::vector<torch::Tensor> in = {torch::randn({3, 2, 50, 8}), torch::randn({3, 2, 50, 8}), torch::randn({3, 2, 50, 8})};
    LinearAttentionOptions causal;
    causal.causal = true;
    causal.chunk_size = 16;
    EXPECT_TRUE(batch_independent([](const auto& t) { return linear_attention(t[0], t[1], t[2]); }, in, 1e-6));
    EXPECT_TRUE(batch_independent([&](const auto& t) { return linear_attention(t[0], t[1], t[2], causal); }, in, 1e-6));
}

TEST(NeighborhoodAttention, BatchIndependence) {
    torch::manual_seed(9);
    std::vector<torch::Tensor> in = {torch::randn({3, 2, 6, 7, 8}), torch::randn({3, 2, 6, 7, 8}),
                                     torch::randn({3, 2, 6, 7, 8})};
    EXPECT_TRUE(batch_independent([](const auto& t) { return neighborhood_attention_2d(t[0], t[1], t[2], 5, 0.35); },
                                  in, 1e-6));
}

namespace {
// bf16 run vs float64 run from the same bf16-rounded inputs; relative L2 error.
double bf16_error(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
                  const std::vector<torch::Tensor>& inputs) {
    std::vector<torch::Tensor> lo, hi;
    for (auto& t : inputs) {
        lo.push_back(t.to(torch::kBFloat16));
        hi.push_back(lo.back().to(torch::kFloat64));
    }
    auto out = f(lo);
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    return relative_error(out, f(hi));
}
}  // namespace

// Tolerance 1e-2 relative L2 (bf16 has an 8-bit mantissa, unit roundoff 2^-8 = 3.9e-3; the
// outputs pass through a few rounded products and sums). Measured values are printed.
// Softmax attention keeps scores, softmax and the weighted sum in float32 and rounds once at the end:
// each output element is off by at most 2^-9 relative, so the relative L2 error is below 2^-9 on every
// ISA (it was 0.0169 on AVX2 when LibTorch 1.13 accumulated the bf16 products in bf16). Bound 2^-8.
TEST(SoftmaxAttention, Bfloat16WithinTolerance) {
    torch::manual_seed(10);
    double err = bf16_error([](const auto& t) { return softmax_attention(t[0], t[1], t[2], 0.125); },
                            {torch::randn({2, 3, 197, 64}), torch::randn({2, 3, 197, 64}), torch::randn({2, 3, 197, 64})});
    std::cout << "[measure] softmax attention bf16 rel err " << err << "\n";
    EXPECT_LT(err, 1.0 / 256);
}

TEST(LinearAttention, Bfloat16WithinTolerance) {
    torch::manual_seed(11);
    std::vector<torch::Tensor> in = {torch::randn({2, 3, 196, 64}), torch::randn({2, 3, 196, 64}),
                                     torch::randn({2, 3, 196, 64})};
    LinearAttentionOptions causal;
    causal.causal = true;
    double err = bf16_error([](const auto& t) { return linear_attention(t[0], t[1], t[2]); }, in);
    double err_causal = bf16_error([&](const auto& t) { return linear_attention(t[0], t[1], t[2], causal); }, in);
    std::cout << "[measure] linear attention bf16 rel err " << err << " (causal " << err_causal << ")\n";
    EXPECT_LT(err, 1e-2);
    EXPECT_LT(err_causal, 1e-2);
}

TEST(NeighborhoodAttention, Bfloat16WithinTolerance) {
    torch::manual_seed(12);
    double err = bf16_error([](const auto& t) { return neighborhood_attention_2d(t[0], t[1], t[2], 5, 0.125); },
                            {torch::randn({2, 3, 14, 14, 64}), torch::randn({2, 3, 14, 14, 64}),
                             torch::randn({2, 3, 14, 14, 64})});
    std::cout << "[measure] neighborhood attention bf16 rel err " << err << "\n";
    EXPECT_LT(err, 1e-2);
}

TEST(Ops, AttentionFlopsAndErrors) {
    auto q = torch::randn({2, 3, 10, 4}), k = torch::randn({2, 3, 12, 4}), v = torch::randn({2, 3, 12, 5});
    {
        linvis::flops::Counter counter;
        softmax_attention(q, k, v, 0.5);
        EXPECT_EQ(counter.macs(), 2 * 3 * 10 * 12 * (4 + 5));
    }
    {
        linvis::flops::Counter counter;
        neighborhood_attention_2d(torch::randn({2, 3, 6, 6, 4}), torch::randn({2, 3, 6, 6, 4}),
                                  torch::randn({2, 3, 6, 6, 5}), 3, 0.5);
        EXPECT_EQ(counter.macs(), 2 * 3 * 36 * 9 * (4 + 5));
    }
    EXPECT_THROW(softmax_attention(q, k, torch::randn({2, 3, 11, 5}), 0.5), linvis::Error);
    // The fused kernel takes no mask (tests/test_attention_fused.cpp covers the rest).
    EXPECT_THROW(softmax_attention(q, k, v, 0.5, torch::ones({10, 12}, torch::kBool), Impl::Fused), linvis::Error);
    LinearAttentionOptions causal;
    causal.causal = true;
    EXPECT_THROW(linear_attention(q, k, v, causal), linvis::Error);
}
