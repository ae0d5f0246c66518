// Activation checkpointing (nn::checkpoint and the models' grad_checkpointing option): the same loss and
// gradients as the plain graph, random ops replayed identically, the caller's random stream undisturbed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "linvis/core/flops.h"
#include "linvis/nn/batch_norm.h"
#include "linvis/models/registry.h"
#include "linvis/nn/checkpoint.h"
#include "linvis/nn/common.h"
#include "linvis/nn/vit.h"
#include "support/heap.h"
#include "support/testing.h"

namespace {

struct Gradients {
    torch::Tensor loss, dx, dw, db, next_random;
};

// A block with parameters and a random mask (as drop path draws one), run plain or checkpointed.
Gradients run_block(bool checkpointed, bool input_requires_grad) {
    torch::manual_seed(21);
    torch::Tensor x = torch::randn({5, 7}).requires_grad_(input_requires_grad);
    torch::Tensor w = torch::randn({7, 7}, torch::requires_grad()), b = torch::randn({7}, torch::requires_grad());
    const linvis::nn::BlockFn block = [&](const torch::Tensor& t) {
        const torch::Tensor keep = (torch::rand({5, 1}) > 0.3).to(t.scalar_type());
        return torch::gelu(torch::addmm(b, t, w)) * keep + t;
    };
    torch::Tensor y = checkpointed ? linvis::nn::checkpoint(block, x) : block(x);
    y = checkpointed ? linvis::nn::checkpoint(block, y) : block(y);  // two in a row, as blocks of a model
    torch::Tensor loss = (y * y).sum();
    loss.backward();
    return {loss.detach(), input_requires_grad ? x.grad() : torch::Tensor(), w.grad(), b.grad(), torch::rand({3})};
}

TEST(ActivationCheckpoint, SameLossAndGradientsAsThePlainGraph) {
    for (bool input_requires_grad : {true, false}) {
        const Gradients plain = run_block(false, input_requires_grad);
        const Gradients ckpt = run_block(true, input_requires_grad);
        EXPECT_TRUE(torch::equal(plain.loss, ckpt.loss));
        ASSERT_TRUE(ckpt.dw.defined() && ckpt.db.defined()) << "parameters got no gradient";
        EXPECT_TRUE(linvis::testing::all_close(ckpt.dw, plain.dw, 1e-6, 1e-6));
        EXPECT_TRUE(linvis::testing::all_close(ckpt.db, plain.db, 1e-6, 1e-6));
        if (input_requires_grad) EXPECT_TRUE(linvis::testing::all_close(ckpt.dx, plain.dx, 1e-6, 1e-6));
        // The recomputation replays the masks and leaves the caller's random stream where the plain run left it.
        EXPECT_TRUE(torch::equal(plain.next_random, ckpt.next_random));
    }
}

TEST(ActivationCheckpoint, NoGraphMeansAPlainCall) {
    torch::Tensor x = torch::randn({4}, torch::requires_grad());
    int calls = 0;
    const linvis::nn::BlockFn twice = [&](const torch::Tensor& t) {
        ++calls;
        return t * 2;
    };
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(linvis::nn::checkpoint(twice, x), x.detach() * 2));
    EXPECT_EQ(calls, 1);
}

// A training step's checkpointed forward runs without a graph, yet its weights are being trained: its products read
// them in place rather than packing copies for inference that the next optimizer step makes stale.
TEST(ActivationCheckpoint, ForwardWithoutAGraphPacksNoWeights) {
    const torch::Tensor w = torch::randn({96, 64}, torch::requires_grad());
    const torch::Tensor b = torch::randn({96}, torch::requires_grad());
    const torch::Tensor x = torch::randn({256, 64}, torch::requires_grad());
    const linvis::nn::BlockFn product = [&](const torch::Tensor& t) { return linvis::flops::linear(t, w, b); };
    const int64_t before = linvis::flops::packed_weight_bytes();
    const torch::Tensor y = linvis::nn::checkpoint(product, x);
    EXPECT_EQ(linvis::flops::packed_weight_bytes(), before);
    y.sum().backward();
    EXPECT_TRUE(linvis::testing::all_close(w.grad(), torch::ones({256, 96}).t().mm(x.detach()), 1e-5, 1e-5));
    EXPECT_EQ(linvis::flops::packed_weight_bytes(), before);
}

// A segment with several inputs and outputs (selective recomputation): an input passed twice, one that needs
// no gradient, an output the loss does not use. Same gradients as the plain graph, none for the input without.
TEST(ActivationCheckpoint, SegmentWithSeveralInputsAndOutputs) {
    const auto run = [](bool checkpointed) {
        torch::manual_seed(23);
        torch::Tensor a = torch::randn({4, 6}, torch::requires_grad()), b = torch::randn({4, 6});
        torch::Tensor w = torch::randn({6, 6}, torch::requires_grad());
        int calls = 0;
        const linvis::nn::SegmentFn segment = [&](const std::vector<torch::Tensor>& in) {
            ++calls;
            const torch::Tensor h = torch::tanh(torch::mm(in[0] + in[1], w));
            return std::vector<torch::Tensor>{h * in[2], h.exp(), torch::sigmoid(h)};
        };
        const std::vector<torch::Tensor> in{a, a, b};
        const std::vector<torch::Tensor> out = checkpointed ? linvis::nn::checkpoint(segment, in) : segment(in);
        EXPECT_EQ(out.size(), 3u);
        ((out[0] * out[0]).sum() + out[1].sum()).backward();  // out[2] unused: its gradient stays undefined
        EXPECT_EQ(calls, checkpointed ? 2 : 1);
        EXPECT_FALSE(b.grad().defined());
        return std::vector<torch::Tensor>{out[0].detach(), a.grad(), w.grad()};
    };
    const std::vector<torch::Tensor> plain = run(false), ckpt = run(true);
    for (size_t i = 0; i < plain.size(); ++i) {
        ASSERT_TRUE(ckpt[i].defined()) << "tensor " << i;
        EXPECT_TRUE(linvis::testing::all_close(ckpt[i], plain[i], 1e-6, 1e-6)) << "tensor " << i;
    }
}

// recompute_into_linear: the plain graph's gradients for every input (one without gradient, parameters among the
// segment's inputs), the product's weight and bias (and without a bias); the segment runs again in the backward.
TEST(ActivationCheckpoint, RecomputeIntoLinearGivesThePlainGradients) {
    for (const bool with_bias : {true, false}) {
        const auto run = [&](bool recomputed) {
            torch::manual_seed(27);
            torch::Tensor h = torch::randn({2, 5, 6}, torch::requires_grad()), scale = torch::randn({6});
            torch::Tensor a = torch::randn({6}, torch::requires_grad());
            torch::Tensor w = torch::randn({3, 6}, torch::requires_grad());
            torch::Tensor b = with_bias ? torch::randn({3}, torch::requires_grad()) : torch::Tensor();
            int calls = 0;
            const linvis::nn::ProductInputFn segment = [&](const std::vector<torch::Tensor>& in) {
                ++calls;
                return torch::gelu(in[0] * in[1] + in[2]).tanh();
            };
            const std::vector<torch::Tensor> in{h, a, scale};
            const torch::Tensor y = recomputed ? linvis::nn::recompute_into_linear(segment, in, w, b)
                                               : torch::nn::functional::linear(segment(in), w, b);
            (y * y).sum().backward();
            EXPECT_EQ(calls, recomputed ? 2 : 1);
            EXPECT_FALSE(scale.grad().defined());
            std::vector<torch::Tensor> out{y.detach(), h.grad(), a.grad(), w.grad()};
            if (with_bias) out.push_back(b.grad());
            return out;
        };
        const auto plain = run(false), recomputed = run(true);
        ASSERT_EQ(plain.size(), recomputed.size());
        for (size_t i = 0; i < plain.size(); ++i) {
            ASSERT_TRUE(recomputed[i].defined()) << "tensor " << i;
            EXPECT_TRUE(linvis::testing::all_close(recomputed[i], plain[i], 1e-6, 1e-6)) << "tensor " << i;
        }
    }
    torch::NoGradGuard no_grad;  // outside a graph: the plain call
    const torch::Tensor x = torch::randn({4, 6}), w = torch::randn({2, 6});
    const auto twice = [](const std::vector<torch::Tensor>& in) { return in[0] * 2; };
    EXPECT_TRUE(linvis::testing::all_close(linvis::nn::recompute_into_linear(twice, {x}, w, {}), torch::mm(x * 2, w.t()),
                                           1e-6, 1e-6));
}

// The banded form: bands of grid rows give the whole graph's values and gradients (tokens, halo rows included, the
// conv's parameters, the product's weight and bias), recompute each band once in the backward, and count fn's work
// as over the whole grid.
TEST(ActivationCheckpoint, RecomputeIntoLinearInBandsGivesThePlainGradients) {
    const int64_t H = 19, W = 3, C = 4;
    const auto segment = [&](const torch::Tensor& rows, int64_t height, const std::vector<torch::Tensor>& conv) {
        torch::Tensor y = torch::gelu(rows);
        const torch::Tensor map = y.transpose(1, 2).reshape({rows.size(0), C, height, W});
        y = y + linvis::flops::conv2d(map, conv[0], conv[1], {1, 1}, {1, 1}, {1, 1}, C).flatten(2).transpose(1, 2);
        return y.tanh();
    };
    // One band, then three of 6-7 rows (row_bands keeps at least 8 rows a band: 19 rows make 3).
    for (const int64_t band_bytes : {int64_t{1} << 20, int64_t{8}}) {
        const auto run = [&](bool banded, int* calls) {
            torch::manual_seed(31);
            torch::Tensor h = torch::randn({2, H * W, C}, torch::requires_grad());
            torch::Tensor k = torch::randn({C, 1, 3, 3}, torch::requires_grad());
            torch::Tensor kb = torch::randn({C}, torch::requires_grad());
            torch::Tensor w = torch::randn({5, C}, torch::requires_grad());
            torch::Tensor b = torch::randn({5}, torch::requires_grad());
            const linvis::nn::BandProductInputFn fn = [&](const torch::Tensor& rows, int64_t height,
                                                          const std::vector<torch::Tensor>& conv) {
                ++*calls;
                return segment(rows, height, conv);
            };
            torch::Tensor y;
            int64_t macs = 0;
            {
                const linvis::flops::Counter count;
                y = banded ? linvis::nn::recompute_into_linear_in_bands(fn, h, H, W, {k, kb}, w, b,
                                                                        /*bytes_per_row=*/1, band_bytes)
                           : linvis::flops::linear(fn(h, H, {k, kb}), w, b);
                macs = count.macs();
            }
            (y * y.detach().cos()).sum().backward();
            return std::make_pair(std::vector<torch::Tensor>{y.detach(), h.grad(), k.grad(), kb.grad(), w.grad(),
                                                             b.grad()},
                                  macs);
        };
        int plain_calls = 0, banded_calls = 0;
        const auto [plain, plain_macs] = run(false, &plain_calls);
        const auto [banded, banded_macs] = run(true, &banded_calls);
        const int bands = static_cast<int>(linvis::nn::row_bands(H, /*bytes_per_row=*/1, band_bytes).size());
        EXPECT_EQ(bands > 1, band_bytes == 8);
        EXPECT_EQ(banded_calls, 2 * bands);  // each band in the forward and once more in the backward
        EXPECT_EQ(banded_macs, plain_macs);
        for (size_t i = 0; i < plain.size(); ++i) {
            ASSERT_TRUE(banded[i].defined()) << "tensor " << i;
            EXPECT_TRUE(linvis::testing::all_close(banded[i], plain[i], 1e-5, 1e-5))
                << "tensor " << i << ", " << bands << " bands";
        }
    }
}

// A training BatchNorm and ReLU between two convs, redone in the second conv's backward: the plain graph's values and
// gradients (input, both convs, the norm's affine parameters), the running statistics updated once, and the
// segment run once more in the backward.
TEST(ActivationCheckpoint, RecomputeIntoConvGivesThePlainGradients) {
    for (const auto& [with_bias, relu] : {std::pair{true, true}, {false, true}, {true, false}}) {
        const auto run = [&](bool recomputed, int* calls) {
            torch::manual_seed(37);
            torch::nn::Conv2d first(torch::nn::Conv2dOptions(3, 4, 3).padding(1));
            torch::nn::BatchNorm2d norm(4);
            torch::nn::Conv2d second(torch::nn::Conv2dOptions(4, 6, 3).stride(2).padding(1).bias(with_bias));
            torch::nn::init::uniform_(norm->weight, 0.5, 1.5);
            torch::nn::init::uniform_(norm->bias, -0.5, 0.5);
            norm->train();
            const torch::Tensor images = torch::randn({2, 3, 7, 9}, torch::requires_grad());
            const linvis::nn::BlockFn segment = [&](const torch::Tensor& c) {
                ++*calls;
                return norm->forward(c);
            };
            const torch::Tensor c = first->forward(images);
            const torch::Tensor y = recomputed ? linvis::nn::recompute_into_conv2d(
                                                     segment, relu, c, linvis::nn::module_state(*norm), second)
                                               : second->forward(relu ? torch::relu(segment(c)) : segment(c));
            (y * y.detach().sin()).sum().backward();
            std::vector<torch::Tensor> out{y.detach(),    images.grad(),       first->weight.grad(),
                                           first->bias.grad(), norm->weight.grad(), norm->bias.grad(),
                                           second->weight.grad(), norm->running_mean.clone(),
                                           norm->running_var.clone()};
            if (with_bias) out.push_back(second->bias.grad());
            EXPECT_EQ(norm->num_batches_tracked.item<int64_t>(), 1);
            return out;
        };
        int plain_calls = 0, recomputed_calls = 0;
        const auto plain = run(false, &plain_calls);
        const auto recomputed = run(true, &recomputed_calls);
        EXPECT_EQ(plain_calls, 1);
        EXPECT_EQ(recomputed_calls, 2);
        for (size_t i = 0; i < plain.size(); ++i) {
            ASSERT_TRUE(recomputed[i].defined()) << "tensor " << i;
            EXPECT_TRUE(linvis::testing::all_close(recomputed[i], plain[i], 1e-5, 1e-5)) << "tensor " << i;
        }
    }
    // What the graph keeps on a (1, 8, 64, 64) map (one unit: 128 KiB): the plain graph the norm's input and the ReLU's
    // output (the second conv's input), the recomputing one the norm's input only.
    {
        torch::nn::Conv2d first(torch::nn::Conv2dOptions(3, 8, 1)), second(torch::nn::Conv2dOptions(8, 2, 1));
        torch::nn::BatchNorm2d norm(8);
        const torch::Tensor images = torch::randn({1, 3, 64, 64});
        const int64_t unit = 8 * 64 * 64 * 4;
        const auto segment = [&](const torch::Tensor& c) { return norm->forward(c); };
        const int64_t plain = linvis::testing::bytes_kept_by(
            [&] { return second->forward(torch::relu(segment(first->forward(images)))); });
        const int64_t recomputed = linvis::testing::bytes_kept_by([&] {
            return linvis::nn::recompute_into_conv2d(segment, true, first->forward(images),
                                                     linvis::nn::module_state(*norm), second);
        });
        EXPECT_GE(plain - recomputed, unit * 9 / 10) << plain << " bytes kept, recomputed " << recomputed;
    }
    torch::NoGradGuard no_grad;  // outside a graph: the plain call
    torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 1));
    const torch::Tensor x = torch::randn({1, 2, 4, 4});
    const auto twice = [](const torch::Tensor& t) { return t * 2; };
    EXPECT_TRUE(linvis::testing::all_close(linvis::nn::recompute_into_conv2d(twice, true, x, {}, conv),
                                           conv->forward(torch::relu(x * 2)), 1e-6, 1e-6));
}

// A training BatchNorm, a ReLU and a conv as one node: the three modules' values and gradients (input, norm, conv),
// the running statistics updated once; float32 and float64, with and without the ReLU and the conv's bias.
TEST(ActivationCheckpoint, BatchNormReluConvGivesTheModulesGradients) {
    for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
        for (const auto& [with_bias, relu, pointwise] : {std::tuple{true, true, false}, {false, true, false},
                                                          {true, false, false}, {true, true, true},
                                                          {false, false, true}}) {
            const auto run = [&, with_bias = with_bias, relu = relu, pointwise = pointwise](bool fused) {
                torch::manual_seed(47);
                torch::nn::Conv2d first(torch::nn::Conv2dOptions(3, 5, 3).padding(1));
                torch::nn::BatchNorm2d norm(5);
                // A 3x3 conv with stride 2, or a pointwise one (its weight gradient from the norm's output in slabs).
                torch::nn::Conv2d second(pointwise ? torch::nn::Conv2dOptions(5, 4, 1).bias(with_bias)
                                                   : torch::nn::Conv2dOptions(5, 4, 3).stride(2).padding(1).bias(
                                                         with_bias));
                first->to(dtype);
                norm->to(dtype);
                second->to(dtype);
                {
                    torch::NoGradGuard no_grad;
                    norm->weight.uniform_(0.5, 1.5);
                    norm->bias.uniform_(-0.5, 0.5);
                }
                const torch::Tensor images =
                    (torch::randn({2, 3, 7, 9}) * 3 + 2).to(dtype).requires_grad_();  // off-centre maps
                const torch::Tensor c = first->forward(images);
                const auto normed = [&] { return relu ? torch::relu(norm->forward(c)) : norm->forward(c); };
                const torch::Tensor y =
                    fused ? linvis::nn::batch_norm_relu_conv2d(*norm, relu, c, second) : second->forward(normed());
                (y * y.detach().sin()).sum().backward();
                std::vector<torch::Tensor> out{y.detach(),         images.grad(),         first->weight.grad(),
                                               norm->weight.grad(), norm->bias.grad(),      second->weight.grad(),
                                               norm->running_mean.clone(), norm->running_var.clone()};
                if (with_bias) out.push_back(second->bias.grad());
                EXPECT_EQ(norm->num_batches_tracked.item<int64_t>(), 1);
                return out;
            };
            const auto plain = run(false), fused = run(true);
            const double tol = dtype == torch::kFloat64 ? 1e-10 : 1e-5;
            for (size_t i = 0; i < plain.size(); ++i) {
                ASSERT_TRUE(fused[i].defined()) << "tensor " << i;
                EXPECT_TRUE(linvis::testing::all_close(fused[i], plain[i], tol, tol))
                    << "tensor " << i << ", " << c10::toString(dtype) << ", relu " << relu << ", bias " << with_bias
                    << ", pointwise " << pointwise;
            }
        }
    }
}

// A ReLU and a conv as one node: the two ops' values and gradients, with and without the conv's bias.
TEST(ActivationCheckpoint, ReluConvGivesThePlainGradients) {
    for (const bool with_bias : {true, false}) {
        const auto run = [&](bool fused) {
            torch::manual_seed(41);
            torch::nn::Conv2d conv(torch::nn::Conv2dOptions(4, 4, 3).stride(2).padding(1).groups(4).bias(with_bias));
            const torch::Tensor x = torch::randn({2, 4, 7, 6}, torch::requires_grad());
            const torch::Tensor c = x * 1.5;  // not a leaf: the mask goes into the conv's fresh input gradient
            const torch::Tensor y = fused ? linvis::nn::relu_conv2d(c, conv) : conv->forward(torch::relu(c));
            (y * y.detach().cos()).sum().backward();
            std::vector<torch::Tensor> out{y.detach(), x.grad(), conv->weight.grad()};
            if (with_bias) out.push_back(conv->bias.grad());
            return out;
        };
        const auto plain = run(false), fused = run(true);
        for (size_t i = 0; i < plain.size(); ++i) {
            ASSERT_TRUE(fused[i].defined()) << "tensor " << i;
            EXPECT_TRUE(linvis::testing::all_close(fused[i], plain[i], 1e-5, 1e-5)) << "tensor " << i;
        }
    }
}

// Outside a graph a depthwise conv with more than kDepthwiseChunkBytes of input runs a group of channels at a time:
// LibTorch's values, and the output in the input's layout (a channels-last map stays channels-last).
TEST(ActivationCheckpoint, LargeDepthwiseConvForwardInChannelGroupsKeepsTheLayout) {
    torch::manual_seed(33);
    torch::nn::Conv2d conv(torch::nn::Conv2dOptions(64, 64, 3).stride(2).padding(1).groups(64));
    const torch::Tensor x = torch::randn({1, 64, 260, 264});  // 17.6 MB > kDepthwiseChunkBytes
    ASSERT_GT(x.numel() * 4, linvis::nn::kDepthwiseChunkBytes);
    const torch::Tensor expected = torch::conv2d(x, conv->weight, conv->bias, 2, 1, 1, 64).detach();
    torch::NoGradGuard no_grad;
    for (const auto format : {torch::MemoryFormat::Contiguous, torch::MemoryFormat::ChannelsLast}) {
        const torch::Tensor y = linvis::nn::conv_forward(conv, x.contiguous(format));
        EXPECT_TRUE(y.is_contiguous(format));
        EXPECT_TRUE(torch::allclose(y, expected, 1e-5, 1e-6));
    }
}

// nn::conv_backward gives autograd's gradients of a conv, and a depthwise conv's in groups of channels the same; so
// does conv_forward its output.
TEST(ActivationCheckpoint, ConvBackwardMatchesAutogradAlsoInChannelGroups) {
    for (const bool depthwise : {true, false}) {
        torch::manual_seed(43);
        const int64_t C = 6;
        torch::nn::Conv2d conv(torch::nn::Conv2dOptions(C, C, 3).stride(2).padding(1).groups(depthwise ? C : 1));
        EXPECT_FALSE(linvis::nn::is_pointwise(conv));
        const torch::Tensor x = torch::randn({2, C, 9, 8}, torch::requires_grad());
        const torch::Tensor y = linvis::nn::conv_forward(conv, x);
        const torch::Tensor dy = torch::randn_like(y);
        y.backward(dy);
        const int64_t input_bytes = x.numel() * 4;
        // One group; then groups of 2 channels (three), and of one channel.
        for (const int64_t chunk_bytes : {input_bytes, input_bytes / 3, input_bytes / C}) {
            const linvis::nn::ConvGradients g = linvis::nn::conv_backward(conv, dy, x.detach(), {true, true, true},
                                                                          chunk_bytes);
            const std::string what = std::string(depthwise ? "depthwise" : "dense") + ", chunk of " +
                                     std::to_string(chunk_bytes) + " bytes";
            EXPECT_TRUE(linvis::testing::all_close(g.dx, x.grad(), 1e-5, 1e-5)) << what;
            EXPECT_TRUE(linvis::testing::all_close(g.dweight, conv->weight.grad(), 1e-5, 1e-5)) << what;
            EXPECT_TRUE(linvis::testing::all_close(g.dbias, conv->bias.grad(), 1e-5, 1e-5)) << what;
        }
        const linvis::nn::ConvGradients only_dx =
            linvis::nn::conv_backward(conv, dy, x.detach(), {true, false, false}, 1);
        EXPECT_TRUE(only_dx.dx.defined() && !only_dx.dweight.defined() && !only_dx.dbias.defined());
    }
    // A pointwise conv: two products per sample on the channel-major maps, the input read in slabs of pixels (one
    // slab, then 5 pixels at a time: 72 pixels in 15 slabs, the last of 2).
    {
        torch::manual_seed(44);
        torch::nn::Conv2d pointwise(torch::nn::Conv2dOptions(6, 5, 1));
        EXPECT_TRUE(linvis::nn::is_pointwise(pointwise));
        EXPECT_FALSE(linvis::nn::is_pointwise(torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 5, 1).stride(2))));
        EXPECT_FALSE(linvis::nn::is_pointwise(torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 5, 1).padding(1))));
        const torch::Tensor x = torch::randn({2, 6, 9, 8}, torch::requires_grad());
        const torch::Tensor y = linvis::nn::conv_forward(pointwise, x);
        const torch::Tensor dy = torch::randn_like(y);
        y.backward(dy);
        const linvis::nn::ConvGradients whole = linvis::nn::conv_backward(pointwise, dy, x.detach(), {true, true, true});
        EXPECT_TRUE(linvis::testing::all_close(whole.dx, x.grad(), 1e-5, 1e-5));
        EXPECT_TRUE(linvis::testing::all_close(whole.dweight, pointwise->weight.grad(), 1e-5, 1e-5));
        EXPECT_TRUE(linvis::testing::all_close(whole.dbias, pointwise->bias.grad(), 1e-5, 1e-5));
        const torch::Tensor planes = x.detach().view({2, 6, 72});
        int64_t slabs = 0;
        const linvis::nn::ConvGradients in_slabs = linvis::nn::pointwise_conv_backward(
            pointwise, dy,
            [&](int64_t n, int64_t p0, int64_t p1) {
                ++slabs;
                return planes[n].narrow(1, p0, p1 - p0).clone();
            },
            {false, true, false}, 5 * 6 * 4);
        EXPECT_EQ(slabs, 2 * 15);
        EXPECT_FALSE(in_slabs.dx.defined() || in_slabs.dbias.defined());
        EXPECT_TRUE(linvis::testing::all_close(in_slabs.dweight, pointwise->weight.grad(), 1e-5, 1e-5));
    }
    // conv_forward outside a graph: a depthwise conv on more than 16 MiB of input in groups of channels.
    torch::NoGradGuard no_grad;
    torch::nn::Conv2d depthwise(torch::nn::Conv2dOptions(64, 64, 3).stride(2).padding(1).groups(64));
    const torch::Tensor x = torch::randn({1, 64, 260, 258});  // 17 MiB
    int64_t macs = 0;
    torch::Tensor y;
    {
        const linvis::flops::Counter count;
        y = linvis::nn::conv_forward(depthwise, x);
        macs = count.macs();
    }
    EXPECT_TRUE(linvis::testing::all_close(y, depthwise->forward(x), 1e-6, 1e-6));
    EXPECT_EQ(macs, y.numel() * 9);
}

// A checkpointed segment whose input needs no gradient (a stem on the images) and that holds a BatchNorm: its
// parameters get the plain graph's gradients and the running statistics are updated once, as without it.
TEST(ActivationCheckpoint, SegmentOnImagesWithBatchNorm) {
    const auto run = [](bool checkpointed) {
        torch::manual_seed(29);
        torch::nn::Sequential stack(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)),
                                    torch::nn::BatchNorm2d(4), torch::nn::ReLU());
        stack->train();
        const torch::Tensor images = torch::randn({2, 3, 6, 6});
        const linvis::nn::SegmentFn segment = [stack](const std::vector<torch::Tensor>& in) mutable {
            return std::vector<torch::Tensor>{stack->forward(in[0])};
        };
        const torch::Tensor y = checkpointed
                                    ? linvis::nn::checkpoint(segment, {images}, linvis::nn::module_state(*stack))[0]
                                    : segment({images})[0];
        EXPECT_TRUE(y.requires_grad());
        (y * y).sum().backward();
        std::vector<torch::Tensor> out{y.detach()};
        for (const auto& p : stack->parameters()) out.push_back(p.grad());
        for (const auto& buffer : stack->buffers()) out.push_back(buffer.clone());  // running mean, var, count
        return out;
    };
    const auto plain = run(false), ckpt = run(true);
    ASSERT_EQ(plain.size(), ckpt.size());
    for (size_t i = 0; i < plain.size(); ++i) {
        ASSERT_TRUE(ckpt[i].defined()) << "tensor " << i;
        EXPECT_TRUE(linvis::testing::all_close(ckpt[i].to(torch::kDouble), plain[i].to(torch::kDouble), 1e-5, 1e-6))
            << "tensor " << i;
    }
}

class ActivationCheckpointFamily : public ::testing::TestWithParam<std::string> {};

// A training step of a small model with drop path: grad_checkpointing=true gives the plain step's loss and
// gradients (the recomputed blocks draw the same drop-path masks).
TEST_P(ActivationCheckpointFamily, ModelGradientsUnchanged) {
    const auto step = [&](bool checkpointing) {
        torch::manual_seed(31);
        linvis::models::ModelConfig config;
        config.set("img_size", int64_t{64}).set("num_classes", int64_t{5}).set("drop_path_rate", 0.2);
        config.set("grad_checkpointing", std::string(checkpointing ? "true" : "false"));
        if (GetParam() == "hvit3_tiny") config.set("depths", std::string("1,1,2,1"));  // stages, not blocks
        else config.set("depth", int64_t{2});
        auto model = linvis::models::create_model(GetParam(), config);
        model->train();
        torch::manual_seed(32);
        const torch::Tensor images = torch::randn({2, 3, 64, 64});
        torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(images), torch::tensor({1, 3}));
        loss.backward();
        std::vector<torch::Tensor> out = {loss.detach()};
        for (const auto& p : model->parameters()) out.push_back(p.grad().defined() ? p.grad() : torch::zeros_like(p));
        // BatchNorm statistics (H-ViT3's conv stacks, recomputed too) updated once, as in the plain step.
        for (const auto& buffer : model->buffers()) out.push_back(buffer.to(torch::kDouble));
        return out;
    };
    const auto plain = step(false);
    const auto ckpt = step(true);
    ASSERT_EQ(plain.size(), ckpt.size());
    EXPECT_TRUE(linvis::testing::all_close(ckpt[0], plain[0], 1e-5, 1e-6)) << "loss";
    for (size_t i = 1; i < plain.size(); ++i)
        EXPECT_TRUE(linvis::testing::all_close(ckpt[i], plain[i], 1e-4, 1e-6)) << "parameter or buffer " << i - 1;
}

INSTANTIATE_TEST_SUITE_P(Families, ActivationCheckpointFamily,
                         ::testing::Values("deit_tiny", "vit3_tiny", "t5_tiny", "vittt_tiny", "vil_tiny", "hvit3_tiny"));

}  // namespace
