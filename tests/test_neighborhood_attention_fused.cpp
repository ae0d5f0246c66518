// The fused CPU neighbourhood-attention kernel (src/ops/neighborhood_attention/cpu.cpp) against the reference
// (gathers + softmax with autograd): outputs and the gradients of q, k and v, float32 and float64, clamped
// windows at every border, windows covering a whole short axis, non-square grids (and grids wider than one strip of
// queries), dv != d, head dims that are not a whole number of vectors or fill more than one register block of the
// SIMD layer's window kernels, windows of 9, 25 and 49 keys (every group size of window_dots); on every LINVIS_SIMD
// target; strided views as DiT5 passes them, in a graph and outside one (where no attention weights are kept).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "linvis/core/error.h"
#include "linvis/ops/neighborhood_attention.h"
#include "support/simd_targets.h"
#include "support/testing.h"

namespace {

using linvis::ops::Impl;
using linvis::ops::NatSmallGrid;
using linvis::ops::neighborhood_attention_2d;
using linvis::testing::all_close;

struct Case {
    int64_t B, h, H, W, d, dv, K;
};

void compare(const Case& c, torch::ScalarType type, double rtol, double atol) {
    torch::manual_seed(c.B * 100 + c.H * 10 + c.W + c.K);
    auto opts = torch::TensorOptions().dtype(type);
    torch::Tensor q0 = torch::randn({c.B, c.h, c.H, c.W, c.d}, opts), k0 = torch::randn({c.B, c.h, c.H, c.W, c.d}, opts);
    torch::Tensor v0 = torch::randn({c.B, c.h, c.H, c.W, c.dv}, opts);
    torch::Tensor probe = torch::randn({c.B, c.h, c.H, c.W, c.dv}, opts);
    const double scale = std::pow(static_cast<double>(c.d), -0.5);
    std::vector<torch::Tensor> outs, grads;
    for (const Impl impl : {Impl::Reference, Impl::Fused}) {
        torch::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
        torch::Tensor o = neighborhood_attention_2d(q, k, v, c.K, scale, NatSmallGrid::WholeAxis, impl);
        (o * probe).sum().backward();
        outs.push_back(o.detach());
        grads.push_back(q.grad());
        grads.push_back(k.grad());
        grads.push_back(v.grad());
    }
    const std::string where = "B" + std::to_string(c.B) + " H" + std::to_string(c.H) + " W" + std::to_string(c.W) +
                              " K" + std::to_string(c.K) + " " + std::string(c10::toString(type));
    EXPECT_TRUE(all_close(outs[1], outs[0], rtol, atol)) << "out " << where;
    const char* names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(all_close(grads[3 + i], grads[i], rtol, atol)) << names[i] << " " << where;
}

const Case kCases[] = {
    {2, 3, 8, 8, 16, 16, 5},   // DiT5's kernel on a small grid: every query near a border
    {1, 2, 16, 16, 32, 32, 5}, // interior queries too
    {1, 2, 7, 11, 8, 12, 5},   // non-square, dv != d
    {2, 1, 5, 5, 4, 4, 5},     // the window is the whole grid (G = K)
    {1, 2, 3, 9, 6, 6, 5},     // K > H on one axis: that axis is covered whole
    {1, 1, 6, 6, 4, 5, 3},
    {1, 2, 9, 9, 8, 8, 7},
    {1, 2, 10, 9, 64, 64, 5},  // DiT-S's head dim
    {1, 1, 6, 7, 20, 36, 3},   // head dims past one block of partial sums, with a remainder
    {1, 2, 7, 19, 72, 72, 5},  // DiT-XL's head dim; three strips of queries, the last one short
    {1, 1, 4, 12, 136, 136, 3}, // d and dv past eight AVX2 vectors: window_sum's block of eight vectors twice
};

void run_all_cases() {
    for (const Case& c : kCases) {
        compare(c, torch::kFloat64, 1e-10, 1e-12);
        compare(c, torch::kFloat32, 1e-4, 1e-5);
    }
}

TEST(NeighborhoodAttentionFused, MatchesReferenceForwardAndGradients) { run_all_cases(); }

TEST(NeighborhoodAttentionFused, MatchesReferenceOnEveryTarget) {
    linvis::testing::for_each_simd_target([](const linvis::testing::SimdTarget&) { run_all_cases(); });
}

// DiT5 hands over q, k and v as (B, N, C) -> (B, heads, H, W, d) permuted views of its projections: the kernel reads
// them through their strides, in a graph (gradients) and outside one (no graph, the same output).
TEST(NeighborhoodAttentionFused, StridedViewsInAndOutOfAGraph) {
    linvis::testing::for_each_simd_target([](const linvis::testing::SimdTarget& t) {
        torch::manual_seed(31);
        const int64_t B = 2, heads = 3, H = 6, W = 7, d = 20, C = heads * d;
        const torch::Tensor qkv = torch::randn({B, H * W, 3 * C});
        const auto view = [&](int64_t i) {
            return qkv.narrow(2, i * C, C).reshape({B, H, W, heads, d}).permute({0, 3, 1, 2, 4});
        };
        const torch::Tensor probe = torch::randn({B, heads, H, W, d});
        const double scale = std::pow(static_cast<double>(d), -0.5);
        std::vector<torch::Tensor> results;
        for (const Impl impl : {Impl::Reference, Impl::Fused}) {
            torch::Tensor q = view(0).clone().requires_grad_(), k = view(1).clone().requires_grad_(),
                          v = view(2).clone().requires_grad_();
            if (impl == Impl::Fused) {
                q = view(0).detach().requires_grad_();  // the view itself, strided
                k = view(1).detach().requires_grad_();
                v = view(2).detach().requires_grad_();
                ASSERT_FALSE(q.is_contiguous());
            }
            torch::Tensor o = neighborhood_attention_2d(q, k, v, 5, scale, NatSmallGrid::WholeAxis, impl);
            (o * probe).sum().backward();
            results.insert(results.end(), {o.detach(), q.grad(), k.grad(), v.grad()});
        }
        const char* names[] = {"out", "dq", "dk", "dv"};
        for (int i = 0; i < 4; ++i) EXPECT_TRUE(all_close(results[4 + i], results[i], 1e-4, 1e-5)) << t.env << names[i];
        torch::NoGradGuard no_grad;
        const torch::Tensor inference =
            neighborhood_attention_2d(view(0), view(1), view(2), 5, scale, NatSmallGrid::WholeAxis, Impl::Fused);
        EXPECT_FALSE(inference.grad_fn());
        EXPECT_TRUE(torch::equal(inference, results[4])) << t.env << ": the same kernel with and without a graph";
    });
}

TEST(NeighborhoodAttentionFused, Bfloat16ComputedInFloat32) {
    auto opts = torch::TensorOptions().dtype(torch::kBFloat16);
    torch::Tensor q = torch::randn({1, 2, 8, 8, 16}, opts), k = torch::randn({1, 2, 8, 8, 16}, opts),
                  v = torch::randn({1, 2, 8, 8, 16}, opts);
    torch::Tensor fused = neighborhood_attention_2d(q, k, v, 5, 0.25, NatSmallGrid::WholeAxis, Impl::Fused);
    EXPECT_EQ(fused.scalar_type(), torch::kBFloat16);
    torch::Tensor ref = neighborhood_attention_2d(q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32), 5,
                                                  0.25, NatSmallGrid::WholeAxis, Impl::Reference);
    EXPECT_TRUE(all_close(fused.to(torch::kFloat32), ref, 2e-2, 2e-2));
}

// Neighbour order ky*5 + kx and the clamped start: with v = one-hot of the key position and q = 0
// (uniform weights over the window), the output says which keys were used.
TEST(NeighborhoodAttentionFused, ClampedWindowsCoverTheNattenNeighbours) {
    const int64_t G = 7, N = G * G;
    torch::Tensor q = torch::zeros({1, 1, G, G, 2}, torch::kFloat64), k = torch::randn({1, 1, G, G, 2}, torch::kFloat64);
    torch::Tensor v = torch::eye(N, torch::kFloat64).view({1, 1, G, G, N});
    torch::Tensor out = neighborhood_attention_2d(q, k, v, 5, 1.0, NatSmallGrid::WholeAxis, Impl::Fused).view({N, N});
    for (int64_t y = 0; y < G; ++y)
        for (int64_t x = 0; x < G; ++x) {
            const int64_t sy = std::min(std::max<int64_t>(y - 2, 0), G - 5), sx = std::min(std::max<int64_t>(x - 2, 0), G - 5);
            for (int64_t m = 0; m < N; ++m) {
                const int64_t my = m / G, mx = m % G;
                const bool inside = my >= sy && my < sy + 5 && mx >= sx && mx < sx + 5;
                EXPECT_NEAR(out[y * G + x][m].item<double>(), inside ? 1.0 / 25 : 0.0, 1e-12) << y << "," << x << " key " << m;
            }
        }
}

TEST(NeighborhoodAttentionFused, BadInput) {
    torch::Tensor q = torch::randn({1, 1, 6, 6, 4});
    const NatSmallGrid whole = NatSmallGrid::WholeAxis;
    EXPECT_THROW(neighborhood_attention_2d(q, torch::randn({1, 1, 6, 5, 4}), q, 5, 1.0, whole, Impl::Fused),
                 linvis::Error);
    EXPECT_THROW(neighborhood_attention_2d(q, q, q, 4, 1.0, whole, Impl::Fused), linvis::Error);
    EXPECT_THROW(neighborhood_attention_2d(q.to(torch::kInt64), q.to(torch::kInt64), q.to(torch::kInt64), 5, 1.0,
                                           whole, Impl::Fused),
                 linvis::Error);
    // Flat-wrap windows below the kernel have no fused kernel: Fused says so, Auto takes the reference.
    torch::Tensor small = torch::randn({1, 1, 4, 4, 4});
    EXPECT_THROW(neighborhood_attention_2d(small, small, small, 5, 1.0, NatSmallGrid::FlatWrap, Impl::Fused),
                 linvis::Error);
    EXPECT_NO_THROW(neighborhood_attention_2d(small, small, small, 5, 1.0, NatSmallGrid::FlatWrap));
}

}  // namespace
