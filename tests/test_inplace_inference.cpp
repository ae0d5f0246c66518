// Layers write activations, gates and residual sums into tensors they just computed when no autograd
// graph records them (nn::can_overwrite). These tests hold that path to the out-of-place one of the same
// model: the same logits and features, the caller's input untouched, repeated calls identical, and the
// gradients of a training step unchanged.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/common.h"
#include "support/testing.h"

namespace {

using linvis::models::ModelConfig;

linvis::models::ModelPtr small_model(const std::string& name) {
    torch::manual_seed(11);
    ModelConfig config = ModelConfig().set("img_size", int64_t{64}).set("num_classes", int64_t{5});
    // Two blocks (H-ViT3: one per stage) keep the models small.
    if (name == "hvit3_tiny") config.set("depths", std::string("1,1,1,1"));
    else config.set("depth", int64_t{2});
    auto model = linvis::models::create_model(name, config);
    model->eval();
    return model;
}

TEST(InPlaceInference, CanOverwriteOnlyWithoutAGraph) {
    const torch::Tensor plain = torch::randn({3}), tracked = torch::randn({3}, torch::requires_grad());
    EXPECT_TRUE(linvis::nn::can_overwrite({plain}));
    EXPECT_FALSE(linvis::nn::can_overwrite({plain, tracked}));
    {
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(linvis::nn::can_overwrite({plain, tracked}));
    }
    torch::Tensor fresh = plain.clone();
    const torch::Tensor other = torch::randn({3});
    torch::Tensor sum = linvis::nn::add_into(fresh, other);
    EXPECT_EQ(sum.data_ptr(), fresh.data_ptr());  // written in place
    EXPECT_TRUE(torch::equal(sum, plain + other));
    torch::Tensor graph_sum = linvis::nn::add_into(plain.clone(), tracked);
    EXPECT_TRUE(graph_sum.requires_grad());
    EXPECT_TRUE(torch::equal(graph_sum.detach(), plain + tracked.detach()));
    // A "fresh" tensor that is (a view of) the other operand is not overwritten.
    torch::Tensor shared = torch::randn({3});
    const torch::Tensor shared_copy = shared.clone();
    torch::Tensor doubled = linvis::nn::add_into(shared.view({3}), shared);
    EXPECT_TRUE(torch::equal(shared, shared_copy));
    EXPECT_TRUE(torch::equal(doubled, shared_copy * 2));
    // Broadcasting sums are not written in place (the fresh tensor would have to grow).
    torch::Tensor row = torch::randn({1, 3});
    EXPECT_EQ(linvis::nn::add_into(row, torch::randn({2, 3})).sizes(), (std::vector<int64_t>{2, 3}));
}

class InPlaceInferenceFamily : public ::testing::TestWithParam<std::string> {};

TEST_P(InPlaceInferenceFamily, SameOutputsAsTheOutOfPlacePath) {
    auto model = small_model(GetParam());
    torch::manual_seed(12);
    const torch::Tensor input = torch::randn({2, 3, 64, 64});
    const torch::Tensor input_copy = input.clone();
    // Out of place: grad mode on and the weights require grad, so every layer keeps its temporaries.
    const torch::Tensor logits_graph = model->forward(input).detach();
    const torch::Tensor features_graph = model->forward_features(input).detach();
    torch::Tensor logits, logits_again, features;
    {
        torch::NoGradGuard no_grad;
        logits = model->forward(input);
        logits_again = model->forward(input);
        features = model->forward_features(input);
    }
    EXPECT_TRUE(torch::equal(input, input_copy)) << "the caller's input was overwritten";
    EXPECT_TRUE(linvis::testing::all_close(logits, logits_graph, 1e-5, 1e-6));
    EXPECT_TRUE(linvis::testing::all_close(features, features_graph, 1e-5, 1e-6));
    EXPECT_TRUE(torch::equal(logits, logits_again));
    // Under c10::InferenceMode (linvis bench and the inference commands, as torch.inference_mode in the torch peer):
    // the same logits.
    {
        const c10::InferenceMode inference;
        EXPECT_TRUE(linvis::testing::all_close(model->forward(input), logits, 1e-5, 1e-6));
    }
    // Frozen weights with grad mode on take the in-place path too, and give the same logits.
    for (auto& p : model->parameters()) p.requires_grad_(false);
    EXPECT_TRUE(linvis::testing::all_close(model->forward(input), logits_graph, 1e-5, 1e-6));
}

TEST_P(InPlaceInferenceFamily, TrainingGradientsUnchangedByInferencePasses) {
    auto model = small_model(GetParam());
    torch::manual_seed(13);
    const torch::Tensor input = torch::randn({2, 3, 64, 64});
    const auto step_grads = [&] {
        model->zero_grad();
        model->forward(input).square().sum().backward();
        std::vector<torch::Tensor> grads;
        for (auto& p : model->parameters())
            if (p.grad().defined()) grads.push_back(p.grad().clone());
        return grads;
    };
    const auto before = step_grads();
    {
        torch::NoGradGuard no_grad;
        model->forward(input);
    }
    // Nothing an inference-mode pass leaves in the model (a cache of inference tensors) reaches the graph.
    {
        const c10::InferenceMode inference;
        model->forward(input);
    }
    const auto after = step_grads();
    ASSERT_EQ(before.size(), after.size());
    ASSERT_FALSE(before.empty());
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << "parameter " << i;
}

// A pass under c10::InferenceMode packs the same weights for oneDNN as one under NoGradGuard: what the model keeps
// across passes (H-ViT3's convs with their BatchNorm folded in) is made of normal tensors, whose version counters the
// packed copies follow; inference tensors have none and are never packed.
TEST_P(InPlaceInferenceFamily, InferenceModePacksWhatNoGradPacks) {
    const torch::Tensor input = torch::randn({2, 3, 64, 64});
    const auto packed_by_a_pass = [&](bool inference_mode) {
        // Without the copies of models other tests keep alive in this process (they can fill the budget).
        linvis::flops::release_packed_weights();
        auto model = small_model(GetParam());
        const int64_t before = linvis::flops::packed_weight_bytes();
        if (inference_mode) {
            const c10::InferenceMode inference;
            model->forward(input);
        } else {
            torch::NoGradGuard no_grad;
            model->forward(input);
        }
        return linvis::flops::packed_weight_bytes() - before;
    };
    const int64_t no_grad = packed_by_a_pass(false);
    EXPECT_GT(no_grad, 0);
    EXPECT_EQ(packed_by_a_pass(true), no_grad);
}

INSTANTIATE_TEST_SUITE_P(Families, InPlaceInferenceFamily,
                         ::testing::Values("deit_tiny", "vit3_tiny", "hvit3_tiny", "t5_tiny", "vittt_tiny",
                                           "vil_tiny"));

}  // namespace
