// Helpers shared by the op and model tests: closeness with a readable report, and a
// finite-difference gradient check (LibTorch's C++ API has no gradcheck).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace linvis::testing {

// Max |a-b| and max relative error, for failure messages.
inline std::string diff_report(const torch::Tensor& actual, const torch::Tensor& expected) {
    auto a = actual.detach().to(torch::kFloat64);
    auto e = expected.detach().to(torch::kFloat64);
    auto abs_err = (a - e).abs().max().item<double>();
    auto scale = e.abs().max().item<double>();
    return "max abs err " + std::to_string(abs_err) + ", max |expected| " + std::to_string(scale);
}

// Asserts |actual - expected| <= atol + rtol * |expected| elementwise (and same shape, no NaN).
inline ::testing::AssertionResult all_close(const torch::Tensor& actual, const torch::Tensor& expected,
                                            double rtol, double atol) {
    if (actual.sizes() != expected.sizes())
        return ::testing::AssertionFailure() << "shape " << actual.sizes() << " != " << expected.sizes();
    auto a = actual.detach().to(torch::kFloat64);
    auto e = expected.detach().to(torch::kFloat64);
    if (!torch::isfinite(a).all().item<bool>()) return ::testing::AssertionFailure() << "non-finite values";
    auto bad = ((a - e).abs() > (atol + rtol * e.abs())).sum().item<int64_t>();
    if (bad > 0)
        return ::testing::AssertionFailure() << bad << " of " << a.numel() << " elements outside rtol "
                                             << rtol << " atol " << atol << ": " << diff_report(a, e);
    return ::testing::AssertionSuccess();
}

// The gradients of sum(forward(x) * r), r random, of x and then of every parameter of `module` in order: a
// backward with no special structure, for comparing two ways of computing a block. Every parameter must get one.
inline std::vector<torch::Tensor> input_and_parameter_grads(
    torch::nn::Module& module, torch::Tensor x, const std::function<torch::Tensor(const torch::Tensor&)>& forward) {
    x = x.detach().requires_grad_(true);
    const torch::Tensor y = forward(x);
    (y * torch::randn_like(y)).sum().backward();
    std::vector<torch::Tensor> grads{x.grad()};
    for (const auto& p : module.named_parameters()) {
        EXPECT_TRUE(p.value().grad().defined()) << p.key() << " got no gradient";
        grads.push_back(p.value().grad());
    }
    return grads;
}

// Two lists of gradients of one computation done two ways, float32 sums in another order: each within `rel` of its
// scale (the largest |expected|).
inline void expect_same_gradients(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected,
                                  double rel, const std::string& what) {
    ASSERT_EQ(actual.size(), expected.size()) << what;
    for (size_t i = 0; i < expected.size(); ++i)
        EXPECT_LE((actual[i] - expected[i]).abs().max().item<double>(), rel * expected[i].abs().max().item<double>())
            << "gradient " << i << " " << what;
}

// Gives `a` random weights N(0, std^2) (every parameter: off any initialisation, such as DiT's adaLN-zero under
// which every output is 0) and `b`, a model of the same architecture, the same ones; draws from LibTorch's generator.
inline void share_random_weights(torch::nn::Module& a, torch::nn::Module& b, double std = 0.05) {
    torch::NoGradGuard no_grad;
    auto source = a.named_parameters(true);
    for (auto& item : source) item.value().copy_(std * torch::randn_like(item.value()));
    for (auto& item : b.named_parameters(true)) item.value().copy_(source[item.key()]);
}

// Relative L2 error ||a - e|| / ||e||.
inline double relative_error(const torch::Tensor& actual, const torch::Tensor& expected) {
    auto a = actual.detach().to(torch::kFloat64);
    auto e = expected.detach().to(torch::kFloat64);
    return ((a - e).norm() / e.norm().clamp_min(1e-300)).item<double>();
}

// Finite-difference check of d(sum(f(inputs) * probe))/d(inputs) in float64.
// `inputs` must be float64 leaf tensors; each input with requires_grad is checked
// element by element with central differences (keep them small).
inline ::testing::AssertionResult gradcheck(
    const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
    std::vector<torch::Tensor> inputs, double eps = 1e-6, double atol = 1e-5, double rtol = 1e-3) {
    for (auto& t : inputs)
        if (t.defined() && t.scalar_type() != torch::kFloat64)
            return ::testing::AssertionFailure() << "gradcheck needs float64 inputs";
    torch::Tensor out = f(inputs);
    torch::Tensor probe = torch::randn_like(out);
    torch::Tensor loss = (out * probe).sum();
    std::vector<torch::Tensor> wrt;
    for (auto& t : inputs)
        if (t.defined() && t.requires_grad()) wrt.push_back(t);
    auto analytic = torch::autograd::grad({loss}, wrt, {}, false, false, true);
    torch::NoGradGuard no_grad;
    size_t k = 0;
    for (auto& t : inputs) {
        if (!t.defined() || !t.requires_grad()) continue;
        torch::Tensor numeric = torch::zeros_like(t);
        auto flat = t.view({-1});
        auto num_flat = numeric.view({-1});
        for (int64_t i = 0; i < flat.numel(); ++i) {
            const double orig = flat[i].item<double>();
            flat[i] = orig + eps;
            const double plus = (f(inputs) * probe).sum().item<double>();
            flat[i] = orig - eps;
            const double minus = (f(inputs) * probe).sum().item<double>();
            flat[i] = orig;
            num_flat[i] = (plus - minus) / (2 * eps);
        }
        torch::Tensor a = analytic[k].defined() ? analytic[k] : torch::zeros_like(t);
        auto ok = all_close(a, numeric, rtol, atol);
        if (!ok) return ::testing::AssertionFailure() << "input " << k << " (shape " << t.sizes() << "): " << ok.message();
        ++k;
    }
    return ::testing::AssertionSuccess();
}

}  // namespace linvis::testing
