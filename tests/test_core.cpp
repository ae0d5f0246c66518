// Core utilities: error messages, FLOP counting, runtime facts (command-line parsing: test_cli_args.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/precision.h"
#include "linvis/core/runtime.h"

using linvis::Error;

TEST(Error, CheckNamesExpectedAndActual) {
    try {
        LINVIS_CHECK(1 + 1 == 3, "file.safetensors: tensor 'w': expected shape ", linvis::shape_string(std::vector<int>{2, 3}),
                     ", got ", linvis::shape_string(std::vector<int>{3}));
        FAIL() << "LINVIS_CHECK did not throw";
    } catch (const Error& e) {
        EXPECT_STREQ(e.what(), "file.safetensors: tensor 'w': expected shape [2, 3], got [3]");
    }
}

TEST(Flops, CountsMultiplyAddsOfLinearMatmulAndConv) {
    auto x = torch::randn({2, 10, 8});
    auto w = torch::randn({16, 8});
    linvis::flops::Counter counter;
    auto y = linvis::flops::linear(x, w);
    EXPECT_EQ(counter.macs(), 2 * 10 * 8 * 16);
    {
        linvis::flops::Counter inner;
        linvis::flops::matmul(torch::randn({3, 4, 5}), torch::randn({5, 6}));
        EXPECT_EQ(inner.macs(), 3 * 4 * 5 * 6);
    }
    EXPECT_EQ(counter.macs(), 2 * 10 * 8 * 16 + 3 * 4 * 5 * 6);
    linvis::flops::Counter conv_counter;
    auto img = torch::randn({1, 3, 32, 32});
    auto cw = torch::randn({8, 3, 16, 16});
    linvis::flops::conv2d(img, cw, {}, {16, 16}, {0, 0}, {1, 1}, 1);
    EXPECT_EQ(conv_counter.macs(), 8 * 2 * 2 * 3 * 16 * 16);
    EXPECT_TRUE(torch::allclose(y, torch::matmul(x, w.t()), 1e-5, 1e-5));  // the two GEMMs sum in other orders
}

// Inference float32 products go to oneDNN's sgemm; they must equal LibTorch's (float64 as the judge) for
// every layout a model hands in: 1-D to 3-D inputs, non-contiguous inputs and weights, with and without
// bias, odd sizes; in a graph the gradients (and a second derivative) equal LibTorch's.
TEST(Flops, OnednnLinearMatchesLibTorch) {
    EXPECT_NE(linvis::flops::linear_backend().find("oneDNN"), std::string::npos) << linvis::flops::linear_backend();
    torch::manual_seed(3);
    struct Case { std::vector<int64_t> x; int64_t n; bool bias, transposed_x, transposed_w; };
    // Every non-empty float32 product goes to oneDNN, from a 7-vector to a 512-px ViT-T's.
    for (const Case& c : {Case{{7}, 5, true, false, false}, Case{{197, 192}, 576, true, false, false},
                          Case{{1, 1, 1}, 1, true, false, true}, Case{{1025, 192}, 576, true, false, false},
                          Case{{3, 341, 257}, 131, false, false, false}, Case{{3, 400, 129}, 700, true, true, false},
                          Case{{4, 250, 96}, 1500, true, false, true}}) {
        torch::Tensor x = torch::randn(c.x);
        if (c.transposed_x) x = x.transpose(0, 1).contiguous().transpose(0, 1);  // same sizes, other strides
        const int64_t k = c.x.back();
        torch::Tensor w = c.transposed_w ? torch::randn({k, c.n}).t() : torch::randn({c.n, k});
        torch::Tensor b = c.bias ? torch::randn({c.n}) : torch::Tensor();
        EXPECT_TRUE(linvis::flops::linear_takes_onednn(x, w, b)) << x.sizes();
        torch::Tensor y;
        {
            torch::NoGradGuard no_grad;
            y = linvis::flops::linear(x, w, b);
        }
        torch::Tensor judge = torch::nn::functional::linear(x.to(torch::kFloat64), w.to(torch::kFloat64),
                                                            c.bias ? b.to(torch::kFloat64) : torch::Tensor());
        ASSERT_EQ(y.sizes(), judge.sizes());
        const double err = ((y.to(torch::kFloat64) - judge).norm() / judge.norm()).item<double>();
        EXPECT_LT(err, 1e-6) << "x " << x.sizes() << " n " << c.n;
        setenv("LINVIS_GEMM", "torch", 1);
        torch::Tensor y_torch = linvis::flops::linear(x, w, b);
        unsetenv("LINVIS_GEMM");
        EXPECT_LT(((y - y_torch).norm() / y_torch.norm()).item<double>(), 1e-6);
    }
    // Empty products stay with LibTorch: no rows gives no rows, K = 0 gives the bias alone.
    const torch::Tensor no_rows = torch::randn({0, 8}), no_k = torch::randn({3, 0}), w8 = torch::randn({4, 8});
    const torch::Tensor bias4 = torch::randn({4});
    EXPECT_FALSE(linvis::flops::linear_takes_onednn(no_rows, w8, bias4));
    EXPECT_EQ(linvis::flops::linear(no_rows, w8, bias4).sizes(), (std::vector<int64_t>{0, 4}));
    EXPECT_FALSE(linvis::flops::linear_takes_onednn(no_k, torch::randn({4, 0}), bias4));
    EXPECT_TRUE(torch::equal(linvis::flops::linear(no_k, torch::randn({4, 0}), bias4), bias4.expand({3, 4})));
    // In a graph: first derivatives (some inputs frozen) and a second derivative through a create_graph backward
    // equal LibTorch's.
    const auto derivatives = [](bool weight_grad) {
        torch::manual_seed(5);
        torch::Tensor x = torch::randn({3, 200, 240}, torch::requires_grad());
        torch::Tensor w = torch::randn({240, 240}).requires_grad_(weight_grad), b = torch::randn({240}, torch::requires_grad());
        EXPECT_EQ(linvis::flops::linear_takes_onednn(x, w, b), std::getenv("LINVIS_GEMM") == nullptr);
        torch::Tensor y = linvis::flops::linear(x, w, b);
        torch::Tensor gx = torch::autograd::grad({(y * y).sum()}, {x}, {}, true, true)[0];
        (gx * gx).sum().backward();  // second derivative into w and b through the first backward
        std::vector<torch::Tensor> out = {y.detach(), gx.detach(), b.grad()};
        if (weight_grad) out.push_back(w.grad());
        return out;
    };
    for (bool weight_grad : {true, false}) {
        const auto onednn = derivatives(weight_grad);
        setenv("LINVIS_GEMM", "torch", 1);
        const auto torch_ref = derivatives(weight_grad);
        unsetenv("LINVIS_GEMM");
        for (size_t i = 0; i < onednn.size(); ++i)
            EXPECT_LT(((onednn[i] - torch_ref[i]).norm() / torch_ref[i].norm()).item<double>(), 1e-5) << i;
    }
    // First derivatives alone (the oneDNN backward products).
    torch::Tensor x = torch::randn({1100, 200}, torch::requires_grad()), w = torch::randn({160, 200}, torch::requires_grad());
    torch::Tensor probe = torch::randn({1100, 160});
    (linvis::flops::linear(x, w) * probe).sum().backward();
    EXPECT_TRUE(torch::allclose(x.grad(), probe.matmul(w.detach()), 1e-4, 1e-4));
    EXPECT_TRUE(torch::allclose(w.grad(), probe.t().matmul(x.detach()), 1e-4, 1e-4));
    setenv("LINVIS_GEMM", "torch", 1);
    EXPECT_EQ(linvis::flops::linear_backend(), "LibTorch");
    unsetenv("LINVIS_GEMM");
}

// pytorch/pytorch issue 83863: a bf16 product of ones accumulated in bf16 stops growing at 256
// (256 + 1 rounds back to 256). Every linvis product must accumulate in float32 on every CPU.
TEST(Precision, ReducedPrecisionProductsAccumulateInFloat32) {
    for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
        const int64_t k = 1024;
        auto ones = torch::ones({8, k}, torch::TensorOptions().dtype(dtype));
        // Both operand layouts: LibTorch 1.13's AVX2 path accumulates the row-major (non-transposed)
        // product in bf16 (256, measured under qemu -cpu max), the transposed one in float.
        for (const auto& right : {torch::ones({k, 8}, ones.options()), ones.t()}) {
            auto mm = linvis::flops::matmul(ones, right);
            EXPECT_EQ(mm.scalar_type(), dtype);
            EXPECT_TRUE(torch::all(mm.to(torch::kFloat32) == static_cast<float>(k)).item<bool>()) << mm[0][0];
        }
        auto lin = linvis::flops::linear(ones, ones.narrow(0, 0, 4));
        EXPECT_TRUE(torch::all(lin.to(torch::kFloat32) == static_cast<float>(k)).item<bool>()) << lin[0][0];
        auto image = torch::ones({1, k, 3, 3}, torch::TensorOptions().dtype(dtype));
        auto conv = linvis::flops::conv2d(image, torch::ones({2, k, 1, 1}, image.options()), {}, {1, 1}, {0, 0}, {1, 1}, 1);
        EXPECT_TRUE(torch::all(conv.to(torch::kFloat32) == static_cast<float>(k)).item<bool>()) << conv[0][0][0][0];
        // Gradients flow through the widened product and come back in the input dtype.
        auto a = ones.clone().requires_grad_(true);
        linvis::flops::matmul(a, torch::ones({k, 8}, ones.options())).sum().backward();
        EXPECT_EQ(a.grad().scalar_type(), dtype);
        EXPECT_TRUE(torch::all(a.grad().to(torch::kFloat32) == 8.0f).item<bool>());
    }
    EXPECT_EQ(linvis::precision::accumulation_dtype(torch::ones({1}, torch::kBFloat16)), torch::kFloat32);
    EXPECT_EQ(linvis::precision::accumulation_dtype(torch::ones({1}, torch::kFloat64)), torch::kFloat64);
    EXPECT_FALSE(linvis::precision::product_needs_f32(torch::ones({1})));
}

TEST(Runtime, ReportsVersionsAndAnOptimizedBlas) {
    auto info = linvis::runtime::query();
    EXPECT_FALSE(info.torch_version.empty());
    EXPECT_FALSE(info.blas.empty());
    // The setup installs OpenBLAS; the reference BLAS would make every model 25x slower.
    EXPECT_TRUE(info.blas_is_optimized) << info.blas;
}

#include "linvis/models/imagenet.h"

TEST(ImageNet, ClassNamesInIndexOrder) {
    EXPECT_STREQ(linvis::models::imagenet_synset(0), "n01440764");
    EXPECT_EQ(linvis::models::imagenet_class_name(0), "tench");
    EXPECT_EQ(linvis::models::imagenet_class_name(207), "golden retriever");
    EXPECT_EQ(linvis::models::imagenet_class_name(999), "toilet tissue");
    EXPECT_THROW(linvis::models::imagenet_class_name(1000), linvis::Error);
}
