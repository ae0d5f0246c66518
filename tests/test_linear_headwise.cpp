// Head-wise (block-diagonal) linear of ViL: the fused CPU kernel against the reference einsum,
// outputs and gradients of x, weight and bias for float64 / float32 / bfloat16, ViL's 4 x 4 blocks
// (the unrolled path) and other block shapes (the generic path), no bias, strided input, finite
// differences, and the errors for bad shapes.
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/ops/linear_headwise.h"
#include "support/testing.h"

using linvis::testing::all_close;
using linvis::testing::gradcheck;
namespace ops = linvis::ops;

namespace {

struct Case {
    std::vector<int64_t> lead;  // leading dims of x
    int64_t heads, out, in;
    bool bias;
};

struct Grads {
    torch::Tensor y, dx, dw, db;
};

Grads run(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0, const torch::Tensor& probe,
          ops::Impl impl) {
    torch::Tensor x = x0.detach().clone().set_requires_grad(true);
    torch::Tensor w = w0.detach().clone().set_requires_grad(true);
    torch::Tensor b = b0.defined() ? b0.detach().clone().set_requires_grad(true) : torch::Tensor();
    torch::Tensor y = ops::linear_headwise(x, w, b, impl);
    (y.to(torch::kFloat64) * probe).sum().backward();
    return {y.detach(), x.grad(), w.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

void expect_match(const Case& c, torch::Dtype dtype, double rtol, double atol) {
    SCOPED_TRACE("heads " + std::to_string(c.heads) + " out " + std::to_string(c.out) + " in " +
                 std::to_string(c.in) + " dtype " + std::string(c10::toString(dtype)));
    torch::manual_seed(7);
    std::vector<int64_t> xs = c.lead, ys = c.lead;
    xs.push_back(c.heads * c.in);
    ys.push_back(c.heads * c.out);
    torch::Tensor x = torch::randn(xs, torch::kFloat64).to(dtype);
    torch::Tensor w = (0.5 * torch::randn({c.heads, c.out, c.in}, torch::kFloat64)).to(dtype);
    torch::Tensor b = c.bias ? torch::randn({c.heads * c.out}, torch::kFloat64).to(dtype) : torch::Tensor();
    torch::Tensor probe = torch::randn(ys, torch::kFloat64);
    const Grads ref = run(x, w, b, probe, ops::Impl::Reference);
    const Grads fused = run(x, w, b, probe, ops::Impl::Fused);
    EXPECT_EQ(fused.y.scalar_type(), dtype);
    EXPECT_TRUE(all_close(fused.y, ref.y, rtol, atol));
    EXPECT_TRUE(all_close(fused.dx, ref.dx, rtol, atol));
    EXPECT_TRUE(all_close(fused.dw, ref.dw, rtol, atol * 10));  // sums over every row
    if (c.bias) EXPECT_TRUE(all_close(fused.db, ref.db, rtol, atol * 10));
}

const std::vector<Case> kCases = {
    {{2, 49}, 48, 4, 4, true},   // ViL-T-like q/k/v projection at 28x28 / patch 4
    {{3, 5, 7}, 6, 4, 4, false},  // more leading dims, no bias
    {{37}, 5, 3, 2, true},        // generic block shape, expanding
    {{2, 11}, 4, 2, 5, true},     // generic block shape, contracting
};

}  // namespace

TEST(LinearHeadwise, FusedMatchesReferenceFloat64) {
    for (const auto& c : kCases) expect_match(c, torch::kFloat64, 1e-12, 1e-12);
}

TEST(LinearHeadwise, FusedMatchesReferenceFloat32) {
    for (const auto& c : kCases) expect_match(c, torch::kFloat32, 1e-4, 1e-5);
}

TEST(LinearHeadwise, FusedMatchesReferenceBfloat16) {
    // The fused kernel computes in float32 and rounds once; the reference rounds the products in
    // bfloat16 (8 significant bits), so the tolerance is a few bfloat16 ulps.
    for (const auto& c : kCases) expect_match(c, torch::kBFloat16, 3e-2, 3e-2);
}

// bfloat16 outside a graph: each row widened, the float32 kernel's sums, one rounding, so the output equals the
// float32 fused kernel on the widened inputs rounded once, bit for bit; ViL's 4 x 4 blocks and the generic path,
// contiguous and row-strided input (v_proj reads one half of proj_up's output).
TEST(LinearHeadwise, Bfloat16InferenceIsTheFloat32KernelRoundedOnce) {
    torch::manual_seed(12);
    torch::NoGradGuard no_grad;
    for (const auto& c : kCases) {
        SCOPED_TRACE("heads " + std::to_string(c.heads) + " out " + std::to_string(c.out) + " in " +
                     std::to_string(c.in));
        std::vector<int64_t> xs = c.lead;
        xs.push_back(2 * c.heads * c.in);
        const torch::Tensor wide = torch::randn(xs).to(torch::kBFloat16);
        const torch::Tensor w = (0.5 * torch::randn({c.heads, c.out, c.in})).to(torch::kBFloat16);
        const torch::Tensor b = c.bias ? torch::randn({c.heads * c.out}).to(torch::kBFloat16) : torch::Tensor();
        const auto f32 = [](const torch::Tensor& t) { return t.defined() ? t.to(torch::kFloat32) : t; };
        for (const torch::Tensor& x : {wide.narrow(-1, 0, c.heads * c.in).contiguous(),
                                       wide.narrow(-1, c.heads * c.in, c.heads * c.in)}) {
            const torch::Tensor y = ops::linear_headwise(x, w, b, ops::Impl::Fused);
            EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
            EXPECT_TRUE(torch::equal(y, ops::linear_headwise(f32(x), f32(w), f32(b), ops::Impl::Fused)
                                            .to(torch::kBFloat16)))
                << (x.is_contiguous() ? "contiguous" : "row-strided");
        }
    }
}

TEST(LinearHeadwise, FusedGradientsMatchFiniteDifferences) {
    torch::manual_seed(3);
    auto opt = torch::TensorOptions().dtype(torch::kFloat64).requires_grad(true);
    std::vector<torch::Tensor> inputs = {torch::randn({3, 2, 8}, opt), torch::randn({2, 4, 4}, opt),
                                         torch::randn({8}, opt)};
    EXPECT_TRUE(gradcheck(
        [](const std::vector<torch::Tensor>& in) { return ops::linear_headwise(in[0], in[1], in[2], ops::Impl::Fused); },
        inputs));
}

TEST(LinearHeadwise, StridedInputIsReadCorrectly) {
    // ViL feeds v_proj one half of proj_up's output: a view whose rows are not contiguous.
    torch::manual_seed(5);
    torch::Tensor both = torch::randn({2, 9, 32});
    torch::Tensor half = both.narrow(-1, 0, 16);
    ASSERT_FALSE(half.is_contiguous());
    torch::Tensor w = torch::randn({4, 4, 4}), b = torch::randn({16});
    EXPECT_TRUE(all_close(ops::linear_headwise(half, w, b, ops::Impl::Fused),
                          ops::linear_headwise(half.contiguous(), w, b, ops::Impl::Reference), 1e-5, 1e-6));
}

TEST(LinearHeadwise, StridedInputGradientsMatchReference) {
    // Row-strided input (a chunk of a wider leaf: read in place) and leading dims that do not merge into one
    // row stride (a transposed view: copied first); outputs and the gradients of the wider leaf, w and b.
    torch::manual_seed(8);
    const torch::Tensor wide0 = torch::randn({3, 7, 40}, torch::kFloat64);
    const torch::Tensor w0 = torch::randn({4, 4, 4}, torch::kFloat64), b0 = torch::randn({16}, torch::kFloat64);
    const torch::Tensor probe = torch::randn({7, 3, 16}, torch::kFloat64);
    using View = torch::Tensor (*)(const torch::Tensor&);
    const std::vector<std::pair<const char*, View>> views = {
        {"chunk", [](const torch::Tensor& t) { return t.narrow(-1, 8, 16); }},
        {"transposed chunk", [](const torch::Tensor& t) { return t.narrow(-1, 8, 16).transpose(0, 1); }}};
    for (const auto& [name, view] : views) {
        for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
            SCOPED_TRACE(std::string(name) + " " + c10::toString(dtype));
            std::vector<std::vector<torch::Tensor>> results;
            for (auto impl : {ops::Impl::Reference, ops::Impl::Fused}) {
                auto leaf = [dtype](const torch::Tensor& t) { return t.to(dtype).clone().set_requires_grad(true); };
                torch::Tensor wide = leaf(wide0), w = leaf(w0), b = leaf(b0);
                torch::Tensor x = view(wide);
                ASSERT_FALSE(x.is_contiguous());
                torch::Tensor y = ops::linear_headwise(x, w, b, impl);
                torch::Tensor p = x.size(0) == 7 ? probe : probe.transpose(0, 1);
                (y.to(torch::kFloat64) * p).sum().backward();
                results.push_back({y.detach(), wide.grad(), w.grad(), b.grad()});
            }
            const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
            for (size_t t = 0; t < results[0].size(); ++t)
                EXPECT_TRUE(all_close(results[1][t], results[0][t], tol, tol * 10)) << "output " << t;
        }
    }
}

TEST(LinearHeadwise, NoGradModeGivesSameOutput) {
    torch::manual_seed(6);
    torch::Tensor x = torch::randn({4, 24}), w = torch::randn({6, 4, 4}).set_requires_grad(true);
    torch::Tensor with_grad = ops::linear_headwise(x, w, torch::Tensor(), ops::Impl::Fused);
    EXPECT_TRUE(with_grad.requires_grad());
    torch::NoGradGuard no_grad;
    torch::Tensor without = ops::linear_headwise(x, w, torch::Tensor(), ops::Impl::Fused);
    EXPECT_FALSE(without.requires_grad());
    EXPECT_TRUE(torch::equal(with_grad.detach(), without));
}

TEST(LinearHeadwise, BadShapesNameTheProblem) {
    torch::Tensor w = torch::zeros({6, 4, 4});
    for (auto impl : {ops::Impl::Reference, ops::Impl::Fused}) {
        try {
            ops::linear_headwise(torch::zeros({2, 23}), w, torch::Tensor(), impl);
            ADD_FAILURE() << "no error for a wrong last dim";
        } catch (const linvis::Error& e) {
            EXPECT_NE(std::string(e.what()).find("expected last dim 24"), std::string::npos) << e.what();
        }
        try {
            ops::linear_headwise(torch::zeros({2, 24}), w, torch::zeros({23}), impl);
            ADD_FAILURE() << "no error for a wrong bias";
        } catch (const linvis::Error& e) {
            EXPECT_NE(std::string(e.what()).find("bias: expected shape [24]"), std::string::npos) << e.what();
        }
        EXPECT_THROW(ops::linear_headwise(torch::zeros({2, 24}), torch::zeros({6, 16}), torch::Tensor(), impl),
                     linvis::Error);
    }
}
