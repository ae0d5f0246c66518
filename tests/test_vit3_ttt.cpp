// ViT³ TTT mixer: the official single full-batch step (spec vit3_t5_official.md A2) and the
// design space of the ViT³ study (inner models, losses, lr, epochs, mini-batches).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/ops/vit3_ttt.h"
#include "support/testing.h"

using namespace linvis::ops;
using linvis::testing::all_close;
using linvis::testing::gradcheck;
using linvis::testing::relative_error;
using torch::Tensor;

namespace {

const std::vector<Vit3InnerModel> kModels = {Vit3InnerModel::FC,     Vit3InnerModel::SiLUFC,
                                             Vit3InnerModel::GatedFC, Vit3InnerModel::MLP2,
                                             Vit3InnerModel::MLP3,   Vit3InnerModel::SwiGLU,
                                             Vit3InnerModel::DWConv3x3, Vit3InnerModel::Conv3x3};
const std::vector<Vit3InnerLoss> kLosses = {Vit3InnerLoss::Dot, Vit3InnerLoss::MSE, Vit3InnerLoss::RMSE,
                                            Vit3InnerLoss::MAE, Vit3InnerLoss::SmoothL1};

std::vector<Tensor> make_weights(const Vit3TttOptions& o, int64_t heads, int64_t d, double std_dev,
                                 torch::Dtype dtype = torch::kFloat64) {
    std::vector<Tensor> w;
    for (auto shape : vit3_inner_weight_shapes(o, heads, d)) {
        shape.insert(shape.begin(), 1);
        w.push_back(torch::randn(shape, torch::dtype(dtype)) * std_dev);
    }
    return w;
}

std::string combo(const Vit3TttOptions& o) {
    return std::string(vit3_inner_model_name(o.model)) + "/" + vit3_inner_loss_name(o.loss);
}

// A2 written out again, straight from the pseudo-code, with the alternative 'conv' form of the
// depthwise gradient (grouped conv of the padded keys by e) instead of the 9 shifted products.
Tensor manual_official(const Tensor& x_qkv, const Tensor& w1, const Tensor& w2, const Tensor& w3, int64_t heads,
                       int64_t H, int64_t W) {
    const int64_t B = x_qkv.size(0), N = x_qkv.size(1);
    const int64_t d = x_qkv.size(2) / (3 * heads + 3), C = heads * d;
    const double s = std::pow(9.0, -0.5);
    auto part = [&](int64_t offset, int64_t width) { return x_qkv.narrow(2, offset, width); };
    auto to_heads = [&](const Tensor& t) { return t.reshape({B, N, heads, d}).transpose(1, 2); };
    auto to_img = [&](const Tensor& t) { return t.reshape({B, H, W, d}).permute({0, 3, 1, 2}); };
    Tensor q1 = to_heads(part(0, C)), k1 = to_heads(part(C, C)), v1 = to_heads(part(2 * C, C));
    Tensor q2 = to_img(part(3 * C, d)), k2 = to_img(part(3 * C + d, d)), v2 = to_img(part(3 * C + 2 * d, d));
    // SwiGLU branch.
    Tensor z1 = torch::matmul(k1, w1), z2 = torch::matmul(k1, w2);
    Tensor sig = torch::sigmoid(z2);
    Tensor a = z2 * sig;
    Tensor e = (-v1 / double(N)) * s;
    Tensor g1 = torch::matmul(k1.transpose(-2, -1), e * a);
    Tensor g2 = torch::matmul(k1.transpose(-2, -1), e * z1 * (sig * (1.0 + z2 * (1.0 - sig))));
    g1 = g1 / (g1.pow(2).sum(-2, true).sqrt() + 1.0);
    g2 = g2 / (g2.pow(2).sum(-2, true).sqrt() + 1.0);
    Tensor x1 = torch::matmul(q1, w1 - g1) * torch::silu(torch::matmul(q1, w2 - g2));
    x1 = x1.transpose(1, 2).reshape({B, N, C});
    // Depthwise branch, 'conv' form: G[b*d+c, ky, kx] = sum_yx kpad[b,c,y+ky,x+kx] e[b,c,y,x].
    Tensor e2 = (-v2 / double(H * W)) * s;
    Tensor kpad = torch::constant_pad_nd(k2, {1, 1, 1, 1}, 0.0).reshape({1, B * d, H + 2, W + 2});
    Tensor g3 = torch::conv2d(kpad, e2.reshape({B * d, 1, H, W}), Tensor(), at::IntArrayRef{1, 1}, at::IntArrayRef{0, 0}, at::IntArrayRef{1, 1}, B * d).reshape({B * d, 1, 3, 3});
    g3 = g3 / (g3.pow(2).sum({-2, -1}, true).sqrt() + 1.0);
    Tensor w3_new = w3.repeat({B, 1, 1, 1}) - g3;
    Tensor x2 = torch::conv2d(q2.reshape({1, B * d, H, W}), w3_new, Tensor(), at::IntArrayRef{1, 1}, at::IntArrayRef{1, 1}, at::IntArrayRef{1, 1}, B * d);
    x2 = x2.reshape({B, d, N}).transpose(1, 2);
    return torch::cat({x1, x2}, -1);
}

}  // namespace

TEST(Vit3Ttt, ClosedFormGradientEqualsAutograd) {
    torch::manual_seed(0);
    const int64_t B = 2, h = 2, H = 3, W = 4, N = H * W, d = 4;
    int checked = 0;
    for (auto model : kModels) {
        for (auto loss : kLosses) {
            Vit3TttOptions o;
            o.model = model;
            o.loss = loss;
            o.hidden_ratio = 1.5;
            Tensor k = torch::randn({B, h, N, d}, torch::kFloat64);
            Tensor v = torch::randn({B, h, N, d}, torch::kFloat64);
            auto w = make_weights(o, h, d, 0.5);
            // Full batch and one mini-batch range (keys outside it still feed the conv models).
            for (auto range : std::vector<std::pair<int64_t, int64_t>>{{0, -1}, {3, 5}}) {
                o.use_autograd = false;
                auto closed = vit3_inner_gradients(k, v, w, o, H, W, range.first, range.second);
                o.use_autograd = true;
                auto autograd = vit3_inner_gradients(k, v, w, o, H, W, range.first, range.second);
                ASSERT_EQ(closed.size(), autograd.size());
                for (size_t i = 0; i < closed.size(); ++i) {
                    ASSERT_EQ(closed[i].size(0), B) << combo(o);
                    EXPECT_TRUE(all_close(closed[i], autograd[i], 1e-10, 1e-12))
                        << combo(o) << " weight " << i << " range " << range.first;
                    ++checked;
                }
            }
        }
    }
    EXPECT_EQ(checked, 2 * 5 * (1 + 1 + 2 + 2 + 3 + 3 + 1 + 1));
}

TEST(Vit3Ttt, OfficialStepMatchesManualSpec) {
    torch::manual_seed(1);
    const int64_t B = 2, heads = 3, d = 4, C = heads * d, H = 3, W = 5, N = H * W;
    Tensor qkv = torch::randn({B, N, 3 * C + 3 * d}, torch::kFloat64);
    Tensor w1 = torch::randn({1, heads, d, d}, torch::kFloat64) * 0.3;
    Tensor w2 = torch::randn({1, heads, d, d}, torch::kFloat64) * 0.3;
    Tensor w3 = torch::randn({d, 1, 3, 3}, torch::kFloat64) * 0.3;
    Tensor ours = vit3_ttt_mix(qkv, w1, w2, w3, heads, H, W, Tensor(), Impl::Reference);
    Tensor manual = manual_official(qkv, w1, w2, w3, heads, H, W);
    EXPECT_TRUE(all_close(ours, manual, 1e-12, 1e-14));
    // The step must change the output: without it x1 = (q W1) * silu(q W2).
    Tensor q1 = qkv.narrow(2, 0, C).reshape({B, N, heads, d}).transpose(1, 2);
    Tensor untrained = (torch::matmul(q1, w1) * torch::silu(torch::matmul(q1, w2))).transpose(1, 2).reshape({B, N, C});
    EXPECT_GT((ours.narrow(2, 0, C) - untrained).abs().max().item<double>(), 1e-3);

    // float32: same ops in the same order as the official code -> identical SwiGLU branch bits;
    // the depthwise gradient differs in summation order ('prod' vs 'conv') only.
    Tensor ours32 = vit3_ttt_mix(qkv.to(torch::kFloat32), w1.to(torch::kFloat32), w2.to(torch::kFloat32),
                                 w3.to(torch::kFloat32), heads, H, W, Tensor(), Impl::Reference);
    Tensor manual32 = manual_official(qkv.to(torch::kFloat32), w1.to(torch::kFloat32), w2.to(torch::kFloat32),
                                      w3.to(torch::kFloat32), heads, H, W);
    EXPECT_TRUE(all_close(ours32, manual32, 1e-5, 1e-6));

    // The design-space function with the official settings reproduces each branch.
    Vit3TttOptions o;
    o.model = Vit3InnerModel::GatedFC;
    o.loss = Vit3InnerLoss::Dot;
    o.loss_scale = kVit3InnerScale;
    o.normalize_grad = true;
    Tensor q = torch::randn({B, heads, N, d}, torch::kFloat32), k = torch::randn_like(q), v = torch::randn_like(q);
    Tensor w1f = w1.to(torch::kFloat32), w2f = w2.to(torch::kFloat32);
    EXPECT_TRUE(torch::equal(vit3_ttt_generic(q, k, v, {w1f, w2f}, o, H, W),
                             vit3_ttt_swiglu_branch(q, k, v, w1f, w2f, kVit3InnerScale, Impl::Reference)));
    o.model = Vit3InnerModel::DWConv3x3;
    Tensor q2 = torch::randn({B, 1, N, d}, torch::kFloat64), k2 = torch::randn_like(q2), v2 = torch::randn_like(q2);
    auto img = [&](const Tensor& t) { return t.squeeze(1).transpose(1, 2).reshape({B, d, H, W}); };
    Tensor generic = vit3_ttt_generic(q2, k2, v2, {w3.reshape({1, 1, d, 3, 3})}, o, H, W);
    Tensor branch = vit3_ttt_dwconv_branch(img(q2), img(k2), img(v2), w3, kVit3InnerScale, Impl::Reference);
    EXPECT_TRUE(all_close(img(generic), branch, 1e-12, 1e-14));
}

TEST(Vit3Ttt, RopeIsAppliedBeforeHeadSplit) {
    // Pairs p < C/4 rotate with the row index, the rest with the column index.
    Tensor rot = vit3_rope_rotations(3, 4, 16);
    ASSERT_EQ(rot.sizes(), (std::vector<int64_t>{3, 4, 8, 2}));
    EXPECT_TRUE(all_close(rot.select(1, 0).narrow(1, 4, 4).select(2, 0), torch::ones({3, 4}), 0, 0));
    EXPECT_TRUE(all_close(rot.select(0, 0).narrow(1, 0, 4).select(2, 0), torch::ones({4, 4}), 0, 0));
    EXPECT_NEAR(rot[2][1][0][1].item<double>(), std::sin(2.0), 1e-6);
    EXPECT_NEAR(rot[2][1][5][1].item<double>(), std::sin(1.0 * std::pow(10000.0, -0.25)), 1e-6);
    // Rotation preserves the norm of every pair.
    Tensor x = torch::randn({2, 3, 4, 16});
    Tensor y = apply_rope_2d(x, rot);
    EXPECT_TRUE(all_close(y.view({2, 3, 4, 8, 2}).pow(2).sum(-1), x.view({2, 3, 4, 8, 2}).pow(2).sum(-1), 1e-5, 1e-6));
    EXPECT_THROW(apply_rope_2d(torch::randn({2, 4, 3, 16}), rot), linvis::Error);
}

// apply_rope_2d_: the same values written into x, on q1's and k1's slices of a wider qkv tensor (the H-ViT³
// layer's use), float32 through the in-place pass and float64 through the reference copied back; the columns
// around the slice stay untouched; shape mismatches and a tensor autograd records are errors.
TEST(Vit3Ttt, RopeInPlaceOnASliceMatchesApplyRope2d) {
    torch::manual_seed(21);
    const int64_t B = 2, H = 5, W = 7, C = 32, width = 3 * C + 12;
    const Tensor rot = vit3_rope_rotations(H, W, C);
    for (torch::ScalarType type : {torch::kFloat32, torch::kFloat64}) {
        const Tensor qkv = torch::randn({B, H * W, width}).to(type);
        Tensor rotated = qkv.clone();
        for (int64_t part = 0; part < 2; ++part) {
            const Tensor slice = rotated.narrow(-1, part * C, C).view({B, H, W, C});
            ASSERT_FALSE(slice.is_contiguous());
            linvis::ops::apply_rope_2d_(slice, rot);
            const Tensor expected = apply_rope_2d(qkv.narrow(-1, part * C, C).reshape({B, H, W, C}), rot);
            EXPECT_TRUE(all_close(slice, expected, 1e-6, 1e-6)) << c10::toString(type) << " part " << part;
        }
        EXPECT_TRUE(torch::equal(rotated.narrow(-1, 2 * C, width - 2 * C), qkv.narrow(-1, 2 * C, width - 2 * C)));
    }
    EXPECT_THROW(linvis::ops::apply_rope_2d_(torch::randn({B, W, H, C}), rot), linvis::Error);
    const Tensor leaf = torch::randn({B, H, W, C}, torch::requires_grad());
    EXPECT_THROW(linvis::ops::apply_rope_2d_(leaf, rot), linvis::Error);
}

TEST(Ops, GradcheckVit3Official) {
    torch::manual_seed(2);
    const int64_t B = 2, heads = 2, d = 2, C = heads * d, H = 2, W = 3, N = H * W;
    auto opt = torch::dtype(torch::kFloat64).requires_grad(true);
    std::vector<Tensor> inputs = {torch::randn({B, N, 3 * C + 3 * d}, opt), (torch::randn({1, heads, d, d}) * 0.5).to(torch::kFloat64).requires_grad_(),
                                  (torch::randn({1, heads, d, d}) * 0.5).to(torch::kFloat64).requires_grad_(),
                                  (torch::randn({d, 1, 3, 3}) * 0.5).to(torch::kFloat64).requires_grad_()};
    Tensor rope = vit3_rope_rotations(H, W, C).to(torch::kFloat64);
    for (bool with_rope : {false, true}) {
        auto f = [&](const std::vector<Tensor>& in) {
            return vit3_ttt_mix(in[0], in[1], in[2], in[3], heads, H, W, with_rope ? rope : Tensor(), Impl::Reference);
        };
        EXPECT_TRUE(gradcheck(f, inputs, 1e-6, 1e-6, 1e-4)) << "rope " << with_rope;
    }
}

TEST(Ops, GradcheckVit3DesignSpace) {
    torch::manual_seed(3);
    const int64_t B = 1, h = 2, H = 2, W = 2, N = H * W, d = 2;
    int index = 0;
    for (auto model : kModels) {
        for (auto loss : kLosses) {
            Vit3TttOptions o;
            o.model = model;
            o.loss = loss;
            o.hidden_ratio = 1.5;
            o.lr = 0.7;
            o.epochs = 2;
            o.num_minibatches = 2;
            o.normalize_grad = (index++ % 2) == 1;
            std::vector<Tensor> inputs;
            for (int i = 0; i < 3; ++i) inputs.push_back(torch::randn({B, h, N, d}, torch::kFloat64).requires_grad_());
            for (auto& w : make_weights(o, h, d, 0.5)) inputs.push_back(w.requires_grad_());
            auto f = [&](const std::vector<Tensor>& in) {
                std::vector<Tensor> w(in.begin() + 3, in.end());
                return vit3_ttt_generic(in[0], in[1], in[2], w, o, H, W);
            };
            EXPECT_TRUE(gradcheck(f, inputs, 1e-6, 1e-6, 1e-4)) << combo(o) << " normalize " << o.normalize_grad;
        }
    }
}

TEST(Ops, GradcheckVit3AutogradInnerPath) {
    // Outer gradients through the autograd (create_graph) inner step: double backward.
    torch::manual_seed(4);
    for (auto model : {Vit3InnerModel::MLP2, Vit3InnerModel::Conv3x3}) {
        Vit3TttOptions o;
        o.model = model;
        o.loss = Vit3InnerLoss::MSE;
        o.use_autograd = true;
        o.epochs = 2;
        std::vector<Tensor> inputs;
        for (int i = 0; i < 3; ++i) inputs.push_back(torch::randn({1, 1, 4, 2}, torch::kFloat64).requires_grad_());
        for (auto& w : make_weights(o, 1, 2, 0.5)) inputs.push_back(w.requires_grad_());
        auto f = [&](const std::vector<Tensor>& in) {
            return vit3_ttt_generic(in[0], in[1], in[2], std::vector<Tensor>(in.begin() + 3, in.end()), o, 2, 2);
        };
        EXPECT_TRUE(gradcheck(f, inputs, 1e-6, 1e-6, 1e-4)) << vit3_inner_model_name(model);
    }
}

TEST(Vit3Ttt, MiniBatchesOfOneBatchEqualsFullBatch) {
    torch::manual_seed(5);
    const int64_t B = 2, h = 2, H = 4, W = 4, N = H * W, d = 4;
    Tensor q = torch::randn({B, h, N, d}, torch::kFloat64), k = torch::randn_like(q), v = torch::randn_like(q);
    for (auto model : kModels) {
        Vit3TttOptions o;
        o.model = model;
        o.loss = Vit3InnerLoss::MSE;
        auto w = make_weights(o, h, d, 0.3);
        // One mini-batch is the full batch: equals one explicit full-batch gradient step.
        Tensor generic = vit3_ttt_generic(q, k, v, w, o, H, W);
        auto g = vit3_inner_gradients(k, v, w, o, H, W);
        std::vector<Tensor> stepped;
        for (size_t i = 0; i < w.size(); ++i) stepped.push_back(w[i] - g[i]);
        EXPECT_TRUE(all_close(generic, vit3_inner_forward(q, stepped, o, H, W), 1e-12, 1e-14))
            << vit3_inner_model_name(model);
        // More mini-batches really change the result.
        o.num_minibatches = 4;
        EXPECT_GT((vit3_ttt_generic(q, k, v, w, o, H, W) - generic).abs().max().item<double>(), 1e-6)
            << vit3_inner_model_name(model);
    }
    // FC with the dot loss: G does not depend on W, and k sequential steps with lr/k sum to the
    // full-batch gradient (each mini-batch mean is over N/k tokens).
    Vit3TttOptions o;
    o.model = Vit3InnerModel::FC;
    auto w = make_weights(o, h, d, 0.3);
    Tensor full = vit3_ttt_generic(q, k, v, w, o, H, W);
    o.num_minibatches = 4;
    o.lr = 0.25;
    EXPECT_TRUE(all_close(vit3_ttt_generic(q, k, v, w, o, H, W), full, 1e-12, 1e-13));
}

TEST(Vit3Ttt, BatchIndependence) {
    torch::manual_seed(6);
    const int64_t B = 3, heads = 4, d = 8, C = heads * d, H = 5, W = 5, N = H * W;
    Tensor qkv = torch::randn({B, N, 3 * C + 3 * d});
    Tensor w1 = torch::randn({1, heads, d, d}) * 0.02, w2 = torch::randn({1, heads, d, d}) * 0.02;
    Tensor w3 = torch::randn({d, 1, 3, 3}) * 0.02;
    Tensor rope = vit3_rope_rotations(H, W, C);
    Tensor batched = vit3_ttt_mix(qkv, w1, w2, w3, heads, H, W, rope, Impl::Reference);
    for (int64_t b = 0; b < B; ++b) {
        Tensor alone = vit3_ttt_mix(qkv.narrow(0, b, 1), w1, w2, w3, heads, H, W, rope, Impl::Reference);
        EXPECT_TRUE(all_close(batched.narrow(0, b, 1), alone, 1e-5, 1e-6)) << "sample " << b;
    }
    {
        // Closed-form gradients: inference needs no autograd at all.
        c10::InferenceMode inference;
        EXPECT_TRUE(torch::equal(vit3_ttt_mix(qkv, w1, w2, w3, heads, H, W, rope, Impl::Reference), batched));
    }
    Vit3TttOptions o;
    o.model = Vit3InnerModel::Conv3x3;
    o.epochs = 2;
    auto w = make_weights(o, 2, 4, 0.1, torch::kFloat32);
    Tensor q = torch::randn({B, 2, N, 4}), k = torch::randn_like(q), v = torch::randn_like(q);
    Tensor all = vit3_ttt_generic(q, k, v, w, o, H, W);
    for (int64_t b = 0; b < B; ++b) {
        Tensor alone = vit3_ttt_generic(q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1), w, o, H, W);
        EXPECT_TRUE(all_close(all.narrow(0, b, 1), alone, 1e-5, 1e-6)) << "generic sample " << b;
    }
}

TEST(Vit3Ttt, Bfloat16WithinTolerance) {
    // bf16 has an 8-bit mantissa (unit roundoff 2^-9 = 2e-3); the mixer chains about ten
    // rounded ops (two matmul layers, the normalisation, the product of two branches): measured
    // 4.7e-3 / 6.2e-3 relative L2 error against float64; bound 1.5e-2. float32 must reach 1e-5.
    torch::manual_seed(7);
    const int64_t B = 2, heads = 6, d = 32, C = heads * d, H = 14, W = 14, N = H * W;
    Tensor qkv = torch::randn({B, N, 3 * C + 3 * d}, torch::kFloat64);
    Tensor w1 = torch::randn({1, heads, d, d}, torch::kFloat64) * 0.02;
    Tensor w2 = torch::randn({1, heads, d, d}, torch::kFloat64) * 0.02;
    Tensor w3 = torch::randn({d, 1, 3, 3}, torch::kFloat64) * 0.02;
    Tensor ref = vit3_ttt_mix(qkv, w1, w2, w3, heads, H, W, Tensor(), Impl::Reference);
    auto run = [&](torch::Dtype t) {
        return vit3_ttt_mix(qkv.to(t), w1.to(t), w2.to(t), w3.to(t), heads, H, W, Tensor(), Impl::Reference);
    };
    Tensor bf = run(torch::kBFloat16);
    EXPECT_EQ(bf.scalar_type(), torch::kBFloat16);
    const double err_bf16 = relative_error(bf, ref), err_f32 = relative_error(run(torch::kFloat32), ref);
    std::cout << "[ vit3_ttt_mix relative L2 error: bf16 " << err_bf16 << ", f32 " << err_f32 << " ]\n";
    EXPECT_LT(err_bf16, 1.5e-2);
    EXPECT_LT(err_f32, 1e-5);
    // The design space in bf16 too.
    Vit3TttOptions o;
    o.model = Vit3InnerModel::SwiGLU;
    o.loss = Vit3InnerLoss::MSE;
    Tensor q = torch::randn({B, 2, N, 16}, torch::kFloat64), k = torch::randn_like(q), v = torch::randn_like(q);
    auto w = make_weights(o, 2, 16, 0.2);
    Tensor gref = vit3_ttt_generic(q, k, v, w, o, H, W);
    std::vector<Tensor> wb;
    for (auto& x : w) wb.push_back(x.to(torch::kBFloat16));
    Tensor gbf = vit3_ttt_generic(q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16), wb, o, H, W);
    const double err_generic = relative_error(gbf, gref);
    std::cout << "[ vit3_ttt_generic swiglu/mse relative L2 error: bf16 " << err_generic << " ]\n";
    EXPECT_LT(err_generic, 1.5e-2);
}

TEST(Vit3Ttt, FlopsCountInnerMatmuls) {
    const int64_t B = 2, heads = 6, d = 32, C = heads * d, H = 14, W = 14, N = H * W;
    Tensor qkv = torch::randn({B, N, 3 * C + 3 * d});
    Tensor w1 = torch::zeros({1, heads, d, d}), w2 = torch::zeros({1, heads, d, d}), w3 = torch::zeros({d, 1, 3, 3});
    linvis::flops::Counter counter;
    vit3_ttt_mix(qkv, w1, w2, w3, heads, H, W, Tensor(), Impl::Reference);
    // z1, z2, G1, G2, two output products: 6 * N*C*d; conv branch: gradient + output 2 * 9*N*d.
    EXPECT_EQ(counter.macs(), B * (6 * N * C * d + 2 * 9 * N * d));
}

TEST(Vit3Ttt, RejectsBadShapes) {
    Vit3TttOptions o;
    Tensor q = torch::randn({1, 2, 6, 4});
    EXPECT_THROW(vit3_ttt_generic(q, q, q, make_weights(o, 2, 4, 0.1, torch::kFloat32), o, 2, 2), linvis::Error);
    EXPECT_THROW(vit3_ttt_generic(q, q, q, make_weights(o, 2, 3, 0.1, torch::kFloat32), o, 2, 3), linvis::Error);
    o.num_minibatches = 7;
    EXPECT_THROW(vit3_ttt_generic(q, q, q, make_weights(o, 2, 4, 0.1, torch::kFloat32), o, 2, 3), linvis::Error);
    EXPECT_THROW(vit3_ttt_mix(torch::randn({1, 6, 100}), torch::zeros({1, 2, 4, 4}), torch::zeros({1, 2, 4, 4}),
                              torch::zeros({4, 1, 3, 3}), 2, 2, 3, Tensor(), Impl::Reference),
                 linvis::Error);
    EXPECT_THROW(parse_vit3_inner_loss("l3"), linvis::Error);
    EXPECT_EQ(parse_vit3_inner_model("swiglu"), Vit3InnerModel::SwiGLU);
}
