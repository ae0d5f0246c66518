// Core utilities: error messages, FLOP counting, runtime facts (command-line parsing: test_cli_args.cpp).
#include <cstdlib>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

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
    {
        // Work a paper leaves out: the counters alive before it do not see it (one made inside does, and
        // passes nothing on); counting resumes after.
        const linvis::flops::Uncounted uncounted;
        EXPECT_FALSE(linvis::flops::counting());
        linvis::flops::Counter nested;
        linvis::flops::linear(x, w);
        EXPECT_EQ(nested.macs(), 2 * 10 * 8 * 16);
    }
    EXPECT_TRUE(linvis::flops::counting());
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
    // oneDNN works beside any LibTorch: Debian's 1.13 links the same libdnnl, and beside a pip torch 2.x, whose
    // libtorch_cpu exports its own oneDNN's call_once helpers, libdnnl is loaded with its own symbols first.
    const bool onednn = linvis::flops::onednn_unusable_reason().empty();
    EXPECT_TRUE(onednn) << linvis::flops::onednn_unusable_reason();
    torch::manual_seed(3);
    struct Case { std::vector<int64_t> x; int64_t n; bool bias, transposed_x, transposed_w; };
    // Every non-empty float32 product goes to oneDNN, from a 7-vector to a 512-px ViT-T's.
    for (const Case& c : {Case{{7}, 5, true, false, false}, Case{{197, 192}, 576, true, false, false},
                          Case{{1, 1, 1}, 1, true, false, true}, Case{{1025, 192}, 576, true, false, false},
                          Case{{3, 341, 257}, 131, false, false, false}, Case{{3, 400, 129}, 700, true, true, false},
                          Case{{4, 250, 96}, 1500, true, false, true},
                          // Narrow products (at most 3 columns, 16 rows or more) run as their transpose; 15 rows not.
                          Case{{2, 300, 192}, 3, true, false, false}, Case{{64, 40}, 1, false, true, false},
                          Case{{16, 33}, 2, true, false, true}, Case{{15, 33}, 2, true, true, true}}) {
        torch::Tensor x = torch::randn(c.x);
        if (c.transposed_x) x = x.transpose(0, 1).contiguous().transpose(0, 1);  // same sizes, other strides
        const int64_t k = c.x.back();
        torch::Tensor w = c.transposed_w ? torch::randn({k, c.n}).t() : torch::randn({c.n, k});
        torch::Tensor b = c.bias ? torch::randn({c.n}) : torch::Tensor();
        EXPECT_EQ(linvis::flops::linear_takes_onednn(x, w, b), onednn) << x.sizes();
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
    // Slices of wider tensors are read in place with their row stride as the leading dimension: a column
    // block of a weight (ViL's gate weights are blocks of one matrix) and a chunk of a wider activation.
    {
        torch::NoGradGuard no_grad;
        const torch::Tensor wide_w = torch::randn({8, 3 * 96}), wide_x = torch::randn({2, 197, 2 * 96});
        const torch::Tensor w = wide_w.narrow(1, 96, 96), x = wide_x.narrow(2, 96, 96), b = torch::randn({8});
        for (int64_t n : {8, 3}) {  // ViL's gate weights; Vision-TTT's learning-rate gates are narrow
            const torch::Tensor wn = w.narrow(0, 0, n), bn = b.narrow(0, 0, n);
            const torch::Tensor y = linvis::flops::linear(x, wn, bn);
            const torch::Tensor judge = torch::nn::functional::linear(x.to(torch::kFloat64), wn.to(torch::kFloat64),
                                                                      bn.to(torch::kFloat64));
            EXPECT_LT(((y.to(torch::kFloat64) - judge).norm() / judge.norm()).item<double>(), 1e-6) << n;
        }
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
    const auto derivatives = [onednn](bool weight_grad, int64_t n) {
        torch::manual_seed(5);
        torch::Tensor x = torch::randn({3, 200, 240}, torch::requires_grad());
        torch::Tensor w = torch::randn({n, 240}).requires_grad_(weight_grad);
        torch::Tensor b = torch::randn({n}, torch::requires_grad());
        EXPECT_EQ(linvis::flops::linear_takes_onednn(x, w, b), onednn && std::getenv("LINVIS_GEMM") == nullptr);
        torch::Tensor y = linvis::flops::linear(x, w, b);
        torch::Tensor gx = torch::autograd::grad({(y * y).sum()}, {x}, {}, true, true)[0];
        (gx * gx).sum().backward();  // second derivative into w and b through the first backward
        std::vector<torch::Tensor> out = {y.detach(), gx.detach(), b.grad()};
        if (weight_grad) out.push_back(w.grad());
        return out;
    };
    for (int64_t n : {240, 3})  // a square weight, and a narrow product (its transpose in the forward)
        for (bool weight_grad : {true, false}) {
            const auto onednn = derivatives(weight_grad, n);
            setenv("LINVIS_GEMM", "torch", 1);
            const auto torch_ref = derivatives(weight_grad, n);
            unsetenv("LINVIS_GEMM");
            for (size_t i = 0; i < onednn.size(); ++i)
                EXPECT_LT(((onednn[i] - torch_ref[i]).norm() / torch_ref[i].norm()).item<double>(), 1e-5)
                    << n << " " << i;
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

// bf16 products go to oneDNN on every CPU: its bf16 matmul primitive (LINVIS_BF16_GEMM=matmul) or its sgemm on
// float32 copies (=sgemm), by default whichever is measured faster; LibTorch under LINVIS_GEMM=torch.
// Judged against float64 products of the same bf16 values: float32 accumulation (at most K * 2^-23 of
// sum |a_i b_i|, generous for K <= 1200) plus one rounding of the output to bf16 (half an ulp: 2^-8 relative).
// LibTorch (the fallback) may round more often - the product before adding the bias, and partial sums of its
// bf16 matrix-vector backward for 1-D inputs - so its bound adds 2^-8 sum |a_i b_i| per possible rounding (K).
namespace {
bool bf16_within_bound(const torch::Tensor& y, const torch::Tensor& judge, const torch::Tensor& abs_judge,
                       int64_t k, int64_t extra_roundings, const std::string& what) {
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16) << what;
    EXPECT_EQ(y.sizes(), judge.sizes()) << what;
    const torch::Tensor err = (y.to(torch::kFloat64) - judge).abs();
    const torch::Tensor bound = std::ldexp(1.0, -8) * judge.abs() +
                                (k * std::ldexp(1.0, -23) + extra_roundings * std::ldexp(1.0, -8)) * abs_judge;
    const double worst = (err - bound).max().item<double>();
    EXPECT_LE(worst, 0.0) << what << ": max error over bound " << worst << ", max error " << err.max().item<double>();
    return worst <= 0.0;
}

// Sets LINVIS_BF16_GEMM / LINVIS_GEMM for one of "matmul", "sgemm", "torch" and clears them when it ends.
struct Bf16GemmMode {
    explicit Bf16GemmMode(const std::string& mode) {
        if (mode == "torch") setenv("LINVIS_GEMM", "torch", 1);
        else setenv("LINVIS_BF16_GEMM", mode.c_str(), 1);
    }
    ~Bf16GemmMode() {
        unsetenv("LINVIS_GEMM");
        unsetenv("LINVIS_BF16_GEMM");
    }
};
}  // namespace

// out += x W^T (+ b): oneDNN accumulates onto out (sgemm without a bias, the matmul primitive's sum post-op with
// one); graphs, aliasing and other dtypes go through an add.
TEST(Flops, LinearAddAccumulatesOntoOut) {
    torch::manual_seed(11);
    const auto judge = [](const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w,
                          const torch::Tensor& b = {}) {
        return out.to(torch::kFloat64) + torch::nn::functional::linear(x.to(torch::kFloat64), w.to(torch::kFloat64),
                                                                       b.defined() ? b.to(torch::kFloat64) : b);
    };
    const auto relative = [](const torch::Tensor& a, const torch::Tensor& b) {
        return ((a.to(torch::kFloat64) - b).norm() / b.norm()).item<double>();
    };
    {
        torch::NoGradGuard no_grad;
        // Plain, a transposed x, a transposed weight, and (2-D) a single row; each without and with a bias.
        for (int variant = 0; variant < 8; ++variant) {
            const bool with_bias = variant >= 4;
            const int shape = variant % 4;
            torch::Tensor x = shape == 3 ? torch::randn({1, 96}) : torch::randn({2, 300, 96});
            if (shape == 1) x = x.transpose(1, 2).contiguous().transpose(1, 2);
            const torch::Tensor w = shape == 2 ? torch::randn({96, 80}).t() : torch::randn({80, 96});
            const torch::Tensor b = with_bias ? torch::randn({80}) : torch::Tensor();
            const std::vector<int64_t> out_shape = shape == 3 ? std::vector<int64_t>{1, 80}
                                                              : std::vector<int64_t>{2, 300, 80};
            torch::Tensor out = torch::randn(out_shape);
            const torch::Tensor expected = judge(out, x, w, b);
            const void* storage = out.data_ptr();
            const int64_t macs = [&] {
                linvis::flops::Counter counter;
                const torch::Tensor returned = linvis::flops::linear_add_(out, x, w, b);
                EXPECT_EQ(returned.data_ptr(), storage) << "variant " << variant;
                return counter.macs();
            }();
            EXPECT_EQ(macs, x.numel() / 96 * 80 * 96) << "variant " << variant;
            EXPECT_EQ(out.data_ptr(), storage);
            EXPECT_LT(relative(out, expected), 1e-6) << "variant " << variant;
        }
        // out is x itself (a square weight): the product must read x before out is written. K is larger than a
        // GEMM's depth block, so writing into x in place would overwrite columns before they are read.
        torch::Tensor xy = torch::randn({256, 1024});
        const torch::Tensor square = torch::randn({1024, 1024}) / 32;
        const torch::Tensor expected = judge(xy, xy, square);
        linvis::flops::linear_add_(xy, xy, square);
        EXPECT_LT(relative(xy, expected), 1e-6);
        // bf16 onto bf16: on the matmul primitive out and the product are summed in float32 and rounded once (half
        // an ulp of the exact sum); on sgemm copies the product is rounded first, then the sum.
        const auto bf16 = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
        for (const std::string mode : {"matmul", "sgemm"}) {
            const Bf16GemmMode route(mode);
            const bool primitive = mode == "matmul" && linvis::flops::onednn_unusable_reason().empty() &&
                                   linvis::flops::linear_backend().find("(none)") == std::string::npos;
            for (const bool with_bias : {false, true}) {
                const std::string what = mode + (with_bias ? " with a bias" : " without a bias");
                const torch::Tensor xb = bf16(torch::randn({2, 300, 96})), wb = bf16(torch::randn({80, 96}));
                const torch::Tensor bb = with_bias ? bf16(torch::randn({80})) : torch::Tensor();
                torch::Tensor ob = bf16(torch::randn({2, 300, 80}));
                const torch::Tensor exact = judge(ob, xb, wb, bb);
                const torch::Tensor magnitude = judge(ob.abs(), xb.abs(), wb.abs(), with_bias ? bb.abs() : bb);
                const void* storage = ob.data_ptr();
                EXPECT_EQ(linvis::flops::linear_add_(ob, xb, wb, bb).data_ptr(), storage) << what;
                bf16_within_bound(ob, exact, magnitude, 96, primitive ? 0 : 1, what);
            }
        }
    }
    // In a graph it is out.add_(linear(x, w)): the gradients flow to x and w.
    torch::Tensor x = torch::randn({5, 12}, torch::requires_grad());
    torch::Tensor w = torch::randn({7, 12}, torch::requires_grad());
    torch::Tensor out = torch::randn({5, 7}) * 1.0;
    const torch::Tensor expected = judge(out.detach(), x.detach(), w.detach());
    linvis::flops::linear_add_(out, x, w).sum().backward();
    EXPECT_LT(relative(out.detach(), expected), 1e-6);
    EXPECT_TRUE(torch::allclose(x.grad(), w.detach().sum(0).expand({5, 12}), 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(w.grad(), x.detach().sum(0).expand({7, 12}), 1e-5, 1e-5));
}

// Inference keeps each float32 weight of a primitive product (bias, GELU, residual) reordered once into oneDNN's
// layout. The copy must follow the weight: an in-place change redoes it, a weight freed and another allocated
// (often at the same address) gets its own, released copies are made again, and products in a graph, on inference
// tensors, or of few rows read the weight in place.
TEST(Flops, PackedWeightsFollowTheirWeights) {
    if (std::getenv("LINVIS_GEMM") != nullptr) GTEST_SKIP() << "LINVIS_GEMM sends the products to LibTorch";
    torch::manual_seed(13);
    const auto relative = [](const torch::Tensor& a, const torch::Tensor& b) {
        return ((a.to(torch::kFloat64) - b.to(torch::kFloat64)).norm() / b.to(torch::kFloat64).norm()).item<double>();
    };
    const auto judge = [](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
        return torch::nn::functional::linear(x.to(torch::kFloat64), w.to(torch::kFloat64), b.to(torch::kFloat64));
    };
    // oneDNN 2.6 has a blocked float32 layout on AVX-512 only: elsewhere (or with the copies turned off) nothing is
    // packed, and every product must still be right.
    const char* budget = std::getenv("LINVIS_PACKED_WEIGHTS_MIB");
    const bool packing = linvis::flops::onednn_unusable_reason().empty() && __builtin_cpu_supports("avx512f") &&
                         std::getenv("DNNL_MAX_CPU_ISA") == nullptr &&
                         std::getenv("ONEDNN_MAX_CPU_ISA") == nullptr && (budget == nullptr || std::atoi(budget) > 0);
    const torch::Tensor x = torch::randn({300, 96});
    const torch::Tensor b = torch::randn({160});
    torch::Tensor w = torch::randn({160, 96});
    torch::NoGradGuard no_grad;
    // Without the copies of models other tests keep alive in this process (they can fill the budget).
    linvis::flops::release_packed_weights();
    EXPECT_EQ(linvis::flops::packed_weight_bytes(), 0);
    const int64_t before = linvis::flops::packed_weight_bytes();
    EXPECT_LT(relative(linvis::flops::linear(x, w, b), judge(x, w, b)), 1e-6);
    EXPECT_LT(relative(linvis::flops::linear_gelu(x, w, b), torch::gelu(judge(x, w, b))), 1e-6);
    const int64_t packed = linvis::flops::packed_weight_bytes() - before;
    if (packing) EXPECT_GE(packed, 160 * 96 * 4);  // one copy for both products (the same layout) or one each
    else EXPECT_EQ(packed, 0);
    // Released copies are made again by the next products that read the weight packed.
    linvis::flops::release_packed_weights();
    EXPECT_EQ(linvis::flops::packed_weight_bytes(), 0);
    EXPECT_LT(relative(linvis::flops::linear(x, w, b), judge(x, w, b)), 1e-6);
    EXPECT_LT(relative(linvis::flops::linear_gelu(x, w, b), torch::gelu(judge(x, w, b))), 1e-6);
    EXPECT_EQ(linvis::flops::packed_weight_bytes() - before, packed);
    // In place (as load_state_dict's copy_ does): the next product sees the new values.
    w.mul_(-0.5).add_(1.0);
    EXPECT_LT(relative(linvis::flops::linear(x, w, b), judge(x, w, b)), 1e-6);
    w.copy_(torch::randn({160, 96}));
    EXPECT_LT(relative(linvis::flops::linear(x, w, b), judge(x, w, b)), 1e-6);
    {
        // A slice of the weight (another offset in the same storage) is another copy (the layout may pad it).
        const torch::Tensor rows = w.narrow(0, 32, 64);
        EXPECT_LT(relative(linvis::flops::linear(x, rows, b.narrow(0, 0, 64)), judge(x, rows, b.narrow(0, 0, 64))),
                  1e-6);
        EXPECT_GE(linvis::flops::packed_weight_bytes() - before, packed + (packing ? 64 * 96 * 4 : 0));
    }
    // Weights freed and others allocated in their place: each product uses its own weight.
    w = torch::Tensor();
    for (int i = 0; i < 8; ++i) {
        const torch::Tensor fresh = torch::randn({160, 96});
        EXPECT_LT(relative(linvis::flops::linear(x, fresh, b), judge(x, fresh, b)), 1e-6) << "weight " << i;
    }
    // The freed weights' copies are released.
    EXPECT_EQ(linvis::flops::packed_weight_bytes(), before);
    const torch::Tensor kept = torch::randn({160, 96});
    // No copy: a product of 15 rows, one in a graph.
    EXPECT_LT(relative(linvis::flops::linear(x.narrow(0, 0, 15), kept, b), judge(x.narrow(0, 0, 15), kept, b)), 1e-6);
    EXPECT_EQ(linvis::flops::packed_weight_bytes(), before);
    {
        torch::AutoGradMode grad(true);
        const torch::Tensor trained = kept.clone().requires_grad_();
        const torch::Tensor in_graph = linvis::flops::linear(x, trained, b);
        EXPECT_LT(relative(in_graph.detach(), judge(x, kept, b)), 1e-6);
        // Nor one without a graph of a weight in a live graph (a training step's recomputation).
        torch::NoGradGuard recompute;
        EXPECT_LT(relative(linvis::flops::linear(x, trained, b), judge(x, kept, b)), 1e-6);
        EXPECT_EQ(linvis::flops::packed_weight_bytes(), before);
    }
    EXPECT_EQ(linvis::flops::packed_weight_bytes(), before);
    // From 16 rows on a copy (a few tokens, as H-ViT3's last stage at 224 px has 49).
    const torch::Tensor few = torch::randn({160, 96});
    EXPECT_LT(relative(linvis::flops::linear(x.narrow(0, 0, 16), few, b), judge(x.narrow(0, 0, 16), few, b)), 1e-6);
    if (packing) EXPECT_GE(linvis::flops::packed_weight_bytes() - before, 160 * 96 * 4);
    else EXPECT_EQ(linvis::flops::packed_weight_bytes(), before);
    // bf16 weights are kept packed too (where oneDNN runs bf16 products); a change in place is seen the same way,
    // and the copies go with their weight.
    const int64_t before_bf16 = linvis::flops::packed_weight_bytes();
    const auto bf16 = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
    const torch::Tensor xb = bf16(x), bb = bf16(b);
    torch::Tensor wb = bf16(torch::randn({160, 96}));
    for (int change = 0; change < 3; ++change) {
        const torch::Tensor want = judge(xb, wb, bb);
        EXPECT_LT(relative(linvis::flops::linear(xb, wb, bb), want), 1e-2) << "bf16, change " << change;
        EXPECT_LT(relative(linvis::flops::linear_gelu(xb, wb, bb), torch::gelu(want)), 1e-2)
            << "bf16, change " << change;
        wb.mul_(-0.5).add_(0.25);
    }
    wb = torch::Tensor();
    EXPECT_EQ(linvis::flops::packed_weight_bytes(), before_bf16);
}

TEST(Flops, Bf16LinearOnOnednnMatchesFloat64) {
    using linvis::flops::linear;
    const auto bf16 = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
    const auto f64 = [](const torch::Tensor& t) { return t.defined() ? t.to(torch::kFloat64) : t; };
    const bool usable = linvis::flops::onednn_unusable_reason().empty();
    if (usable) EXPECT_NE(linvis::flops::linear_backend().find(", bf16 "), std::string::npos) << linvis::flops::linear_backend();
    torch::manual_seed(11);
    struct Case { std::vector<int64_t> x; int64_t n; bool bias, transposed_x, transposed_w; };
    for (const Case& c : {Case{{7}, 5, true, false, false}, Case{{197, 192}, 576, true, false, false},
                          Case{{1, 1, 1}, 1, true, false, true}, Case{{5, 33, 17}, 9, true, false, false},
                          Case{{3, 341, 257}, 131, false, false, false}, Case{{3, 400, 129}, 700, true, true, false},
                          Case{{4, 250, 96}, 150, true, false, true}, Case{{1025, 192}, 768, false, false, true}}) {
        torch::Tensor x = bf16(torch::randn(c.x));
        if (c.transposed_x) x = x.transpose(0, 1).contiguous().transpose(0, 1);  // same sizes, other strides
        const int64_t k = c.x.back();
        torch::Tensor w = c.transposed_w ? bf16(torch::randn({k, c.n})).t() : bf16(torch::randn({c.n, k}));
        torch::Tensor b = c.bias ? bf16(torch::randn({c.n})) : torch::Tensor();
        const torch::Tensor judge = torch::nn::functional::linear(f64(x), f64(w), f64(b));
        const torch::Tensor abs_judge = torch::nn::functional::linear(f64(x).abs(), f64(w).abs(), c.bias ? f64(b).abs() : torch::Tensor());
        for (const std::string mode : {"matmul", "sgemm", "torch"}) {
            const Bf16GemmMode set_mode(mode);
            const std::string what = "x " + linvis::shape_string(x.sizes().vec()) + " n " + std::to_string(c.n) + " " + mode;
            const bool onednn = usable && mode != "torch";
            EXPECT_EQ(linvis::flops::linear_takes_onednn(x, w, b), onednn) << what;
            {
                torch::NoGradGuard no_grad;
                bf16_within_bound(linear(x, w, b), judge, abs_judge, k, onednn ? 0 : k, what + " (inference)");
                bf16_within_bound(linear(x, w, b), judge, abs_judge, k, onednn ? 0 : k, what + " (again: cached primitive)");
            }
            // Gradients in a graph: dx = g . w and dw = g^T . x each round once; db = sum of g over rows.
            const torch::Tensor xg = x.detach().requires_grad_(true), wg = w.detach().requires_grad_(true);
            const torch::Tensor bg = c.bias ? b.detach().requires_grad_(true) : torch::Tensor();
            const torch::Tensor y = linear(xg, wg, bg);
            const torch::Tensor probe = bf16(torch::randn(y.sizes()));
            y.backward(probe);
            const int64_t rows = x.numel() / k;
            const torch::Tensor g = f64(probe).reshape({rows, c.n}), x2 = f64(x).reshape({rows, k});
            bf16_within_bound(xg.grad(), g.matmul(f64(w)).view(x.sizes()), g.abs().matmul(f64(w).abs()).view(x.sizes()),
                              c.n, onednn ? 0 : c.n, what + " dx");
            bf16_within_bound(wg.grad(), g.t().matmul(x2), g.abs().t().matmul(x2.abs()), rows, onednn ? 0 : rows, what + " dw");
            if (c.bias) bf16_within_bound(bg.grad(), g.sum(0), g.abs().sum(0), rows, 1, what + " db");
        }
    }
    {
        const Bf16GemmMode set_mode("fastest");
        const torch::Tensor x = bf16(torch::randn({2, 3})), w = bf16(torch::randn({4, 3}));
        if (usable) EXPECT_THROW(linvis::flops::linear(x, w), linvis::Error);  // read where oneDNN takes bf16
    }
}

// linear_gelu: in bf16 inference the GELU (erf and tanh forms) runs on the float32 product (oneDNN's
// accumulator, or sgemm's float32 output) and the result rounds once; judged like the products above, the accumulation error passed through GELU's slope
// (at most 1.13), plus 1e-6 for oneDNN's float32 GELU. In a graph and in float32 it is gelu(linear).
TEST(Flops, Bf16LinearGeluMatchesFloat64) {
    torch::manual_seed(12);
    const auto f64 = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
    for (const std::string approximate : {"none", "tanh"}) {
        for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{9}, {197, 192}, {2, 65, 33}}) {
            const int64_t k = shape.back(), n = 3 * k + 1;
            const torch::Tensor x = torch::randn(shape).to(torch::kBFloat16);
            const torch::Tensor w = (torch::randn({n, k}) / std::sqrt(static_cast<double>(k))).to(torch::kBFloat16);
            const torch::Tensor b = torch::randn({n}).to(torch::kBFloat16);
            const torch::Tensor pre = torch::nn::functional::linear(f64(x), f64(w), f64(b));
            const torch::Tensor judge = torch::gelu(pre, approximate);
            const torch::Tensor abs_pre = torch::nn::functional::linear(f64(x).abs(), f64(w).abs(), f64(b).abs());
            for (const std::string mode : {"matmul", "sgemm"}) {
                const Bf16GemmMode set_mode(mode);
                torch::Tensor y;
                {
                    torch::NoGradGuard no_grad;
                    y = linvis::flops::linear_gelu(x, w, b, approximate);
                }
                ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
                ASSERT_EQ(y.sizes(), judge.sizes());
                const torch::Tensor bound = std::ldexp(1.0, -8) * judge.abs() + 1.13 * k * std::ldexp(1.0, -23) * abs_pre + 1e-6;
                const double worst = ((f64(y) - judge).abs() - bound).max().item<double>();
                EXPECT_LE(worst, 0.0) << approximate << " " << linvis::shape_string(shape) << " " << mode;
            }
            // float32: the GELU on the product's accumulator too (oneDNN's GELU, within a few ulps), bounded
            // like bf16 with float32's rounding; bf16 in a graph: exactly gelu(linear).
            const torch::Tensor xf = x.to(torch::kFloat32), wf = w.to(torch::kFloat32), bf = b.to(torch::kFloat32);
            const torch::Tensor yf = linvis::flops::linear_gelu(xf, wf, bf, approximate);
            ASSERT_EQ(yf.scalar_type(), torch::kFloat32);
            const torch::Tensor bound_f32 =
                std::ldexp(1.0, -20) * judge.abs() + 1.13 * k * std::ldexp(1.0, -23) * abs_pre + 1e-7;
            EXPECT_LE(((f64(yf) - judge).abs() - bound_f32).max().item<double>(), 0.0)
                << approximate << " " << linvis::shape_string(shape) << " float32";
            const torch::Tensor xg = x.detach().requires_grad_(true);
            const torch::Tensor yg = linvis::flops::linear_gelu(xg, w, b, approximate);
            EXPECT_TRUE(yg.requires_grad());
            EXPECT_TRUE(torch::equal(yg.detach(), torch::gelu(linvis::flops::linear(x, w, b), approximate)));
        }
    }
    EXPECT_THROW(linvis::flops::linear_gelu(torch::randn({2, 3}), torch::randn({4, 3}), {}, "erf"), linvis::Error);
}

// linear_relu: outside a graph the ReLU acts on the product's float32 accumulator (oneDNN's matmul epilogue), so
// float32 agrees with relu(linear) to the products' rounding and bf16 rounds once; in a graph it is exactly
// relu(linear). FLOPs are the product's.
TEST(Flops, LinearReluIsReluOfTheProduct) {
    torch::manual_seed(13);
    for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{9}, {197, 192}, {2, 65, 33}}) {
        for (const bool narrow : {false, true}) {  // narrow: 2 outputs, a product run as its transpose
            const int64_t k = shape.back(), n = narrow ? 2 : 2 * k + 3;
            const torch::Tensor x = torch::randn(shape), w = torch::randn({n, k}) / std::sqrt(static_cast<double>(k));
            const torch::Tensor b = torch::randn({n});
            const torch::Tensor pre = torch::nn::functional::linear(x.to(torch::kFloat64), w.to(torch::kFloat64),
                                                                    b.to(torch::kFloat64));
            const torch::Tensor abs_pre = torch::nn::functional::linear(x.abs().to(torch::kFloat64),
                                                                        w.abs().to(torch::kFloat64),
                                                                        b.abs().to(torch::kFloat64));
            torch::Tensor y, y16;
            int64_t macs = 0;
            {
                torch::NoGradGuard no_grad;
                const linvis::flops::Counter counter;
                y = linvis::flops::linear_relu(x, w, b);
                macs = counter.macs();
                y16 = linvis::flops::linear_relu(x.to(torch::kBFloat16), w.to(torch::kBFloat16),
                                                 b.to(torch::kBFloat16));
            }
            EXPECT_EQ(macs, x.numel() / k * n * k);
            ASSERT_EQ(y.sizes(), pre.sizes());
            EXPECT_TRUE(torch::equal(y.clamp_min(0), y)) << "negative outputs";
            const torch::Tensor judge = torch::relu(pre);
            const torch::Tensor excess = (y.to(torch::kFloat64) - judge).abs() - k * std::ldexp(1.0, -23) * abs_pre;
            EXPECT_LE((excess - 1e-7).max().item<double>(), 0.0);
            // bf16: the operands' own values, one rounding of the float32 result.
            const torch::Tensor pre16 = torch::nn::functional::linear(
                x.to(torch::kBFloat16).to(torch::kFloat64), w.to(torch::kBFloat16).to(torch::kFloat64),
                b.to(torch::kBFloat16).to(torch::kFloat64));
            ASSERT_EQ(y16.scalar_type(), torch::kBFloat16);
            EXPECT_LE(((y16.to(torch::kFloat64) - torch::relu(pre16)).abs() - std::ldexp(1.0, -8) * torch::relu(pre16) -
                       k * std::ldexp(1.0, -23) * abs_pre - 1e-7)
                          .max()
                          .item<double>(),
                      0.0);
            const torch::Tensor xg = x.detach().requires_grad_(true);
            const torch::Tensor yg = linvis::flops::linear_relu(xg, w, b);
            EXPECT_TRUE(yg.requires_grad());
            EXPECT_TRUE(torch::equal(yg.detach(), torch::relu(linvis::flops::linear(x, w, b))));
        }
    }
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
