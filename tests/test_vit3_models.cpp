// ViT³ / H-ViT³ models (spec vit3_t5_official.md A3, A4, A7).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/io/state_dict.h"
#include "linvis/models/registry.h"
#include "linvis/nn/batch_norm.h"
#include "linvis/nn/vit3_layers.h"
#include "linvis/ops/vit3_ttt.h"
#include "support/heap.h"
#include "support/testing.h"

using namespace linvis::models;
using linvis::testing::all_close;
using torch::Tensor;

namespace {

using Shape = std::vector<int64_t>;
using KeyList = std::vector<std::pair<std::string, Shape>>;

KeyList parameter_list(const torch::nn::Module& m) {
    KeyList out;
    for (const auto& item : m.named_parameters(true)) out.push_back({item.key(), item.value().sizes().vec()});
    return out;
}

std::map<std::string, Shape> state_dict_shapes(const torch::nn::Module& m) {
    std::map<std::string, Shape> out;
    for (const auto& item : m.named_parameters(true)) out[item.key()] = item.value().sizes().vec();
    for (const auto& item : m.named_buffers(true)) out[item.key()] = item.value().sizes().vec();
    return out;
}

ModelPtr make(const std::string& name, std::map<std::string, std::string> options = {}) {
    return create_model(name, ModelConfig(std::move(options)));
}

// Copies every parameter and buffer of `from` into `to` by name, through adapt_checkpoint_tensor.
void copy_weights(const VisionModel& from, VisionModel& to) {
    torch::NoGradGuard no_grad;
    auto dst = to.named_parameters(true);
    auto dst_buf = to.named_buffers(true);
    for (const auto& item : from.named_parameters(true)) dst[item.key()].copy_(to.adapt_checkpoint_tensor(item.key(), item.value()));
    for (const auto& item : from.named_buffers(true))
        dst_buf[item.key()].copy_(to.adapt_checkpoint_tensor(item.key(), item.value()));
}

}  // namespace

TEST(Vit3, ParameterCounts) {
    const std::vector<std::pair<std::string, int64_t>> expected = {
        {"vit3_tiny", 6149416},    {"vit3_small", 23799400},  {"vit3_base", 90055912},
        {"hvit3_tiny", 28703560}, {"hvit3_small", 54362056}, {"hvit3_base", 94369304}};
    for (const auto& [name, count] : expected) EXPECT_EQ(count_parameters(*make(name)), count) << name;
}

TEST(Vit3, StateDictNamesMatchOfficial) {
    // vit3_tiny: the A7 list, in state_dict order (210 entries, all parameters).
    KeyList expected = {{"patch_embed.proj.weight", {192, 3, 16, 16}}, {"patch_embed.proj.bias", {192}}};
    for (int i = 0; i < 12; ++i) {
        const std::string p = "blocks." + std::to_string(i) + ".";
        KeyList block = {{p + "cpe.weight", {192, 1, 3, 3}}, {p + "cpe.bias", {192}},
                         {p + "norm1.weight", {192}},        {p + "norm1.bias", {192}},
                         {p + "attn.w1", {1, 6, 32, 32}},    {p + "attn.w2", {1, 6, 32, 32}},
                         {p + "attn.w3", {32, 1, 3, 3}},     {p + "attn.qkv.weight", {672, 192}},
                         {p + "attn.qkv.bias", {672}},       {p + "attn.proj.weight", {192, 224}},
                         {p + "attn.proj.bias", {192}},      {p + "norm2.weight", {192}},
                         {p + "norm2.bias", {192}},          {p + "mlp.fc1.weight", {768, 192}},
                         {p + "mlp.fc1.bias", {768}},        {p + "mlp.fc2.weight", {192, 768}},
                         {p + "mlp.fc2.bias", {192}}};
        expected.insert(expected.end(), block.begin(), block.end());
    }
    KeyList tail = {{"norm.weight", {192}}, {"norm.bias", {192}}, {"head.weight", {1000, 192}}, {"head.bias", {1000}}};
    expected.insert(expected.end(), tail.begin(), tail.end());
    ASSERT_EQ(expected.size(), 210u);
    auto vit = make("vit3_tiny");
    EXPECT_EQ(parameter_list(*vit), expected);
    EXPECT_TRUE(vit->named_buffers(true).is_empty());

    // hvit3_tiny: the structure of A4/A7 (410 entries including BN statistics and RoPE tables).
    std::map<std::string, Shape> want;
    auto bn = [&](const std::string& p, int64_t c) {
        for (const char* n : {"weight", "bias", "running_mean", "running_var"}) want[p + n] = {c};
        want[p + "num_batches_tracked"] = {};
    };
    const std::vector<Shape> stem = {{32, 3, 3, 3}, {32, 32, 3, 3}, {32, 32, 3, 3}, {256, 32, 3, 3}, {64, 256, 1, 1}};
    for (int i = 0; i < 5; ++i) {
        const std::string p = "patch_embed.conv." + std::to_string(i) + ".";
        want[p + "conv.weight"] = stem[i];
        bn(p + "norm.", stem[i][0]);
    }
    const int64_t dims[4] = {64, 128, 320, 512}, depths[4] = {1, 3, 9, 4}, grids[4] = {56, 28, 14, 7};
    for (int s = 0; s < 4; ++s) {
        const int64_t c = dims[s], h = c / 32;
        for (int j = 0; j < depths[s]; ++j) {
            const std::string p = "layers." + std::to_string(s) + ".blocks." + std::to_string(j) + ".";
            want[p + "cpe.weight"] = {c, 1, 3, 3};
            want[p + "cpe.bias"] = {c};
            want[p + "norm1.weight"] = want[p + "norm1.bias"] = want[p + "norm2.weight"] = want[p + "norm2.bias"] = {c};
            want[p + "rope.rotations"] = {grids[s], grids[s], c / 2, 2};
            want[p + "attn.w1"] = want[p + "attn.w2"] = {1, h, 32, 32};
            want[p + "attn.w3"] = {32, 1, 3, 3};
            want[p + "attn.qkv.weight"] = {3 * c + 96, c};
            want[p + "attn.qkv.bias"] = {3 * c + 96};
            want[p + "attn.proj.weight"] = {c, c + 32};
            want[p + "attn.proj.bias"] = {c};
            want[p + "mlp.fc1.weight"] = {4 * c, c};
            want[p + "mlp.fc1.bias"] = {4 * c};
            want[p + "mlp.dwc.weight"] = {4 * c, 1, 3, 3};
            want[p + "mlp.dwc.bias"] = {4 * c};
            want[p + "mlp.fc2.weight"] = {c, 4 * c};
            want[p + "mlp.fc2.bias"] = {c};
        }
        if (s < 3) {
            const std::string p = "layers." + std::to_string(s) + ".downsample.conv.";
            const int64_t r = 4 * dims[s + 1];
            want[p + "0.conv.weight"] = {r, c, 1, 1};
            want[p + "0.conv.bias"] = {r};
            want[p + "1.conv.weight"] = {r, 1, 3, 3};
            want[p + "1.conv.bias"] = {r};
            want[p + "2.conv.weight"] = {dims[s + 1], r, 1, 1};
            want[p + "2.conv.bias"] = {dims[s + 1]};
            bn(p + "2.norm.", dims[s + 1]);
        }
    }
    bn("norm.", 512);
    want["head.weight"] = {1000, 512};
    want["head.bias"] = {1000};
    ASSERT_EQ(want.size(), 410u);
    auto hvit = make("hvit3_tiny");
    EXPECT_EQ(state_dict_shapes(*hvit), want);
    // Spot checks quoted in A7.
    auto got = state_dict_shapes(*hvit);
    EXPECT_EQ(got["layers.0.blocks.0.attn.qkv.weight"], (Shape{288, 64}));
    EXPECT_EQ(got["layers.0.blocks.0.attn.proj.weight"], (Shape{64, 96}));
    EXPECT_EQ(got["layers.0.downsample.conv.0.conv.weight"], (Shape{512, 64, 1, 1}));
    EXPECT_EQ(got["layers.3.blocks.0.rope.rotations"], (Shape{7, 7, 256, 2}));
    // Official names are used unchanged; a headless model drops the classifier keys.
    EXPECT_EQ(vit->map_checkpoint_key("blocks.3.attn.w1"), "blocks.3.attn.w1");
    EXPECT_EQ(make("vit3_tiny", {{"num_classes", "0"}})->map_checkpoint_key("head.weight"), "");
    EXPECT_EQ(make("hvit3_tiny", {{"num_classes", "0"}, {"depths", "1,1,1,1"}})->map_checkpoint_key("head.bias"), "");
    EXPECT_EQ(hvit->map_checkpoint_key("norm.running_var"), "norm.running_var");
}

TEST(Vit3, Gflops224) {
    // Paper / README figures (fvcore: one FLOP per multiply-add of matmuls and convs).
    const std::vector<std::pair<std::string, double>> paper = {{"vit3_tiny", 1.2},  {"vit3_small", 4.8},
                                                               {"vit3_base", 18.0}, {"hvit3_tiny", 4.9},
                                                               {"hvit3_small", 8.8}, {"hvit3_base", 16.7}};
    torch::NoGradGuard no_grad;
    for (const auto& [name, gflops] : paper) {
        auto model = make(name);
        model->eval();
        linvis::flops::Counter counter;
        model->forward(torch::randn({1, 3, 224, 224}));
        std::cout << "[ " << name << ": " << counter.macs() << " MACs = " << counter.gflops() << " GFLOPs (paper "
                  << gflops << ") ]\n";
        EXPECT_NEAR(counter.gflops(), gflops, 0.05 * gflops) << name;
    }
}

TEST(Vit3, ForwardBackwardRuns) {
    torch::manual_seed(0);
    for (auto [name, options] : std::vector<std::pair<std::string, std::map<std::string, std::string>>>{
             {"vit3_tiny", {{"img_size", "64"}, {"depth", "2"}, {"num_classes", "7"}, {"drop_path_rate", "0.1"}}},
             {"vit3_small", {{"img_size", "32"}, {"depth", "1"}, {"patch_size", "8"}, {"num_classes", "7"}}},
             {"hvit3_tiny", {{"img_size", "64"}, {"depths", "1,1,1,1"}, {"num_classes", "7"}, {"drop_path_rate", "0.2"}}}}) {
        auto model = make(name, options);
        model->train();
        Tensor x = torch::randn({2, 3, std::stoll(options["img_size"]), std::stoll(options["img_size"])});
        Tensor logits = model->forward(x);
        ASSERT_EQ(logits.sizes(), (Shape{2, 7})) << name;
        logits.pow(2).sum().backward();
        int64_t with_grad = 0, total = 0;
        for (const auto& p : model->parameters()) {
            ++total;
            if (p.grad().defined() && p.grad().abs().sum().item<double>() > 0) ++with_grad;
        }
        EXPECT_EQ(with_grad, total) << name << ": every parameter must receive a gradient";
        EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
    }
    EXPECT_THROW(make("vit3_tiny", {{"bogus", "1"}}), linvis::Error);
    EXPECT_THROW(make("vit3_tiny", {{"impl", "bogus"}}), linvis::Error);
    EXPECT_THROW(make("hvit3_tiny", {{"depths", "1,2,3"}}), linvis::Error);
    EXPECT_THROW(make("vit3_tiny", {{"depth", "1"}})->forward(torch::randn({1, 3, 40, 40})), linvis::Error);
}

TEST(Vit3, ResolutionChange) {
    torch::manual_seed(1);
    torch::NoGradGuard no_grad;
    // ViT³ has no absolute position embedding: the same weights run at any multiple of 16.
    auto vit = make("vit3_tiny", {{"depth", "2"}});
    vit->eval();
    EXPECT_EQ(vit->forward_features(torch::randn({1, 3, 96, 128})).sizes(), (Shape{1, 48, 192}));
    EXPECT_EQ(vit->forward(torch::randn({1, 3, 160, 160})).sizes(), (Shape{1, 1000}));
    // H-ViT³: a checkpoint made at 96 loaded into a model built for 128 gets its RoPE tables
    // recomputed (adapt_checkpoint_tensor); it must equal the 96-model run at 128, whose tables
    // are computed on the fly for the new grid.
    std::map<std::string, std::string> small = {{"depths", "1,1,1,1"}, {"img_size", "96"}};
    std::map<std::string, std::string> large = {{"depths", "1,1,1,1"}, {"img_size", "128"}};
    auto a = make("hvit3_tiny", small), b = make("hvit3_tiny", large);
    a->eval();
    b->eval();
    copy_weights(*a, *b);
    auto buffers = b->named_buffers(true);
    EXPECT_EQ(buffers["layers.0.blocks.0.rope.rotations"].sizes(), (Shape{32, 32, 32, 2}));
    Tensor x = torch::randn({2, 3, 128, 128});
    Tensor out_b = b->forward(x);
    EXPECT_TRUE(all_close(a->forward(x), out_b, 1e-5, 1e-6));
    // Different tables give different outputs (the RoPE path is live).
    EXPECT_GT((make("hvit3_tiny", large)->forward(x) - out_b).abs().max().item<double>(), 1e-4);
    EXPECT_THROW(b->adapt_checkpoint_tensor("layers.0.blocks.0.rope.rotations", torch::zeros({24, 24, 16, 2})),
                 linvis::Error);
}

TEST(Vit3, BatchIndependence) {
    torch::manual_seed(2);
    torch::NoGradGuard no_grad;
    for (auto [name, options] : std::vector<std::pair<std::string, std::map<std::string, std::string>>>{
             {"vit3_tiny", {{"depth", "2"}}}, {"hvit3_tiny", {{"depths", "1,1,2,1"}}}}) {
        auto model = make(name, options);
        model->eval();
        Tensor x = torch::randn({3, 3, 96, 96});
        Tensor all = model->forward(x);
        for (int64_t i = 0; i < 3; ++i)
            EXPECT_TRUE(all_close(all.narrow(0, i, 1), model->forward(x.narrow(0, i, 1)), 1e-4, 1e-5))
                << name << " sample " << i;
    }
}

TEST(Vit3, IntermediatesAreBlockOutputs) {
    torch::manual_seed(3);
    torch::NoGradGuard no_grad;
    auto model = make("vit3_tiny", {{"depth", "3"}});
    model->eval();
    Tensor x = torch::randn({1, 3, 64, 64});
    auto outs = model->forward_intermediates(x, {0, -1});
    ASSERT_EQ(outs.size(), 2u);
    EXPECT_EQ(outs[0].sizes(), (Shape{1, 16, 192}));
    // The final norm of the last block output is forward_features.
    auto ln = torch::layer_norm(outs[1], {192}, model->named_parameters()["norm.weight"],
                                model->named_parameters()["norm.bias"], 1e-6);
    EXPECT_TRUE(all_close(ln, model->forward_features(x), 1e-5, 1e-6));
    EXPECT_THROW(model->forward_intermediates(x, {3}), linvis::Error);
}

TEST(HVit3, IntermediatesAreMultiScale) {
    torch::manual_seed(4);
    torch::NoGradGuard no_grad;
    auto model = make("hvit3_tiny", {{"depths", "1,1,1,1"}});
    model->eval();
    Tensor x = torch::randn({2, 3, 224, 224});
    auto outs = model->forward_intermediates(x, {0, 1, 2, 3});
    ASSERT_EQ(outs.size(), 4u);
    const int64_t dims[4] = {64, 128, 320, 512};
    for (int s = 0; s < 4; ++s) EXPECT_EQ(outs[s].sizes(), (Shape{2, dims[s], 56 >> s, 56 >> s})) << "stage " << s;
    // forward_features = BatchNorm (eval, fresh statistics: x / sqrt(1 + 1e-5)) of the last stage.
    EXPECT_TRUE(all_close(model->forward_features(x), outs[3] / std::sqrt(1.0 + 1e-5), 1e-5, 1e-6));
    EXPECT_EQ(model->forward_head(model->forward_features(x), true).sizes(), (Shape{2, 512}));
    EXPECT_EQ(model->num_features(), 512);
}

namespace {
// An eval-mode BatchNorm that is not the identity: statistics and affine parameters off 0 and 1.
void randomise_norm(torch::nn::BatchNorm2dImpl& norm) {
    torch::NoGradGuard no_grad;
    norm.running_mean.normal_();
    norm.running_var.uniform_(0.5, 2.0);
    norm.weight.normal_();
    norm.bias.normal_();
}
}  // namespace

// A pointwise conv layer in eval mode on a channels-last map outside a graph (a patch merging's input, the blocks'
// tokens) is a product over the pixels: the values of conv -> [BatchNorm] -> [ReLU], a channels-last result; a
// channels-first map and a graph take LibTorch's conv with the same values. (Training mode keeps LibTorch's conv, so
// that a checkpointed forward matches its recomputation: ActivationCheckpointFamily.ModelGradientsUnchanged.)
TEST(HVit3, PointwiseConvLayerOnChannelsLastIsAProduct) {
    torch::manual_seed(62);
    struct Case {
        bool bias, norm, relu;
    };
    for (const Case c : {Case{true, false, true}, Case{true, true, false}, Case{false, true, true}, Case{true, false, false}}) {
        linvis::nn::Vit3ConvLayer layer(5, 6, 1, 1, 0, 1, c.bias, c.norm, c.relu);
        if (c.norm) randomise_norm(*layer->norm);
        layer->eval();
        const std::string what = std::string(c.bias ? "bias" : "") + (c.norm ? " norm" : "") + (c.relu ? " relu" : "");
        const torch::Tensor x = torch::randn({2, 5, 7, 9});
        torch::Tensor expected = torch::conv2d(x, layer->conv->weight, layer->conv->bias);
        if (c.norm) expected = layer->norm->forward(expected);
        if (c.relu) expected = torch::relu(expected);
        expected = expected.detach();
        const torch::Tensor last = x.contiguous(torch::MemoryFormat::ChannelsLast);
        torch::Tensor got_last, got_first;
        {
            torch::NoGradGuard no_grad;
            got_last = layer->forward(last);
            got_first = layer->forward(x);
        }
        EXPECT_TRUE(got_last.is_contiguous(torch::MemoryFormat::ChannelsLast)) << what;
        EXPECT_TRUE(all_close(got_last, expected, 1e-5, 1e-6)) << what;
        EXPECT_TRUE(all_close(got_first, expected, 1e-5, 1e-6)) << what;
        const torch::Tensor graph = layer->forward(last);  // the parameters require grad: LibTorch's conv
        EXPECT_TRUE(graph.requires_grad()) << what;
        EXPECT_TRUE(all_close(graph.detach(), expected, 1e-5, 1e-6)) << what;
    }
}

// H-ViT3's conv layers in inference write the eval-mode BatchNorm and the ReLU into the conv's output: the same values
// as LibTorch's BatchNorm and ReLU; batch_norm_eval_into declines (x untouched) wherever it must not write.
TEST(HVit3, ConvLayerNormAndReluInPlaceInInference) {
    torch::manual_seed(61);
    linvis::nn::Vit3ConvLayer layer(5, 6, 3, 1, 1, 1, false, true, true);
    randomise_norm(*layer->norm);
    layer->eval();
    const torch::Tensor x = torch::randn({2, 5, 7, 9});
    const torch::Tensor expected =
        torch::relu(layer->norm->forward(torch::conv2d(x, layer->conv->weight, {}, 1, 1))).detach();
    torch::Tensor got;
    {
        torch::NoGradGuard no_grad;
        got = layer->forward(x);
    }
    EXPECT_TRUE(all_close(got, expected, 1e-6, 1e-6));
    EXPECT_TRUE(all_close(layer->forward(x), expected, 1e-6, 1e-6));  // with a graph: LibTorch's ops

    const torch::nn::BatchNorm2dImpl& bn = *layer->norm;
    auto declines = [&](torch::Tensor t) {
        const torch::Tensor before = t.clone();
        const bool wrote = linvis::nn::batch_norm_eval_into(bn, t);
        return !wrote && torch::equal(t, before);
    };
    EXPECT_TRUE(declines(torch::randn({1, 6, 3, 3})));  // the parameters require grad: a graph would record it
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(declines(torch::randn({1, 6, 3, 3}).to(torch::kBFloat16)));
    EXPECT_TRUE(declines(torch::randn({1, 4, 3, 3})));  // not the norm's channels
    layer->train();
    EXPECT_TRUE(declines(torch::randn({1, 6, 3, 3})));
    layer->eval();
    torch::Tensor t = torch::randn({1, 6, 3, 3});
    const torch::Tensor want = layer->norm->forward(t);
    EXPECT_TRUE(linvis::nn::batch_norm_eval_into(bn, t));
    EXPECT_TRUE(all_close(t, want, 1e-6, 1e-6));
}

// In inference the eval-mode norm is folded into the conv (weights up to kMaxFoldedWeights elements): the folded
// weights follow every change of the six tensors they are made from, in place or replaced, and a larger conv keeps
// the norm as a pass over its output; each gives the values of conv -> BatchNorm -> [ReLU].
TEST(HVit3, FoldedNormFollowsTheConvAndNormTensors) {
    torch::manual_seed(63);
    for (const int64_t kernel : {int64_t{3}, int64_t{1}}) {
        linvis::nn::Vit3ConvLayer layer(5, 6, kernel, 1, kernel / 2, 1, true, true, kernel == 3);
        randomise_norm(*layer->norm);
        layer->eval();
        const torch::Tensor x = torch::randn({2, 5, 7, 9}).contiguous(torch::MemoryFormat::ChannelsLast);
        const auto expected = [&] {
            torch::NoGradGuard no_grad;
            torch::Tensor y = layer->norm->forward(torch::conv2d(x, layer->conv->weight, layer->conv->bias, 1,
                                                                 kernel / 2));
            return kernel == 3 ? torch::relu(y) : y;
        };
        const auto check = [&](const std::string& what) {
            torch::NoGradGuard no_grad;
            EXPECT_TRUE(all_close(layer->forward(x), expected(), 1e-5, 1e-6)) << "kernel " << kernel << ": " << what;
        };
        check("first call");
        check("the folded weights kept");
        torch::NoGradGuard no_grad;
        layer->norm->running_mean.add_(0.5);
        check("running_mean changed in place");
        layer->norm->running_var.mul_(3.0);
        check("running_var changed in place");
        layer->norm->weight.neg_();
        check("gamma changed in place");
        layer->norm->bias.add_(1.0);
        check("beta changed in place");
        layer->conv->weight.copy_(torch::randn_like(layer->conv->weight));
        check("conv weight loaded in place");
        layer->conv->bias.sub_(2.0);
        check("conv bias changed in place");
        layer->norm->running_mean.set_(torch::randn({6}));
        check("running_mean's storage replaced");
    }
    // A weight above the fold's size limit: the norm stays a pass over the conv's output.
    const int64_t wide = linvis::nn::Vit3ConvLayerImpl::kMaxFoldedWeights / 9 + 1;
    linvis::nn::Vit3ConvLayer big(wide, 1, 3, 1, 1, 1, false, true, false);
    randomise_norm(*big->norm);
    big->eval();
    const torch::Tensor x = torch::randn({1, wide, 3, 3});
    torch::NoGradGuard no_grad;
    const torch::Tensor expected = big->norm->forward(torch::conv2d(x, big->conv->weight, {}, 1, 1));
    EXPECT_TRUE(all_close(big->forward(x), expected, 1e-4, 1e-5));
}

// At high resolution H-ViT3's stem and patch mergings run in bands of output rows in inference (their widest maps
// never exist whole): the same features as the layers run on whole maps.
// Inference at 1024 px: the stem, the patch mergings and the first stages' blocks run in bands of rows.
TEST(HVit3, InferenceInBandsGivesTheWholeMapsFeatures) {
    torch::manual_seed(62);
    ModelConfig config;
    config.set("img_size", int64_t{1024}).set("depths", std::string("2,1,1,1")).set("num_classes", int64_t{0});
    auto model = create_model("hvit3_tiny", config);
    model->eval();
    for (auto& p : model->parameters()) p.requires_grad_(false);
    {   // BatchNorm statistics other than the init's 0 / 1, so that the norms act.
        torch::NoGradGuard no_grad;
        for (auto& b : model->named_buffers()) {
            if (b.key().find("running_mean") != std::string::npos) b.value().normal_(0.0, 0.1);
            if (b.key().find("running_var") != std::string::npos) b.value().uniform_(0.5, 1.5);
        }
    }
    const Tensor images = torch::randn({1, 3, 1024, 1024});
    Tensor whole, banded;
    int64_t whole_macs = 0, banded_macs = 0;
    {
        linvis::flops::Counter counter;
        whole = model->forward_features(images);  // grad mode on (nothing to record): whole maps
        whole_macs = counter.macs();
    }
    {
        torch::NoGradGuard no_grad;
        linvis::flops::Counter counter;
        banded = model->forward_features(images);
        banded_macs = counter.macs();
    }
    EXPECT_TRUE(all_close(banded, whole, 1e-4, 1e-5));
    EXPECT_EQ(banded_macs, whole_macs);  // the halo rows' repeats are not counted
}

// H-ViT³'s mixer and conv MLP a band of rows at a time (inference on large maps): the whole layers' values and
// FLOP counts, fused and reference, with RoPE on q1 / k1.
TEST(HVit3, MixerAndMlpInBandsMatchTheWholeLayers) {
    torch::manual_seed(65);
    const int64_t B = 2, H = 20, W = 9, C = 64;
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({C}).eps(1e-5));
    torch::NoGradGuard no_grad;
    norm->weight.normal_(1.0, 0.2);
    norm->bias.normal_(0.0, 0.2);
    const Tensor x = torch::randn({B, H * W, C});
    const Tensor rope = linvis::ops::vit3_rope_rotations(H, W, C);
    // Bands of at least 8 rows (row_bands' minimum): 3 bands of 6-7 rows here.
    const int64_t small_budget = 1;
    for (const auto impl : {linvis::ops::Impl::Auto, linvis::ops::Impl::Reference}) {
        SCOPED_TRACE(impl == linvis::ops::Impl::Auto ? "auto" : "reference");
        linvis::nn::Vit3Ttt mixer(C, 2, true, impl);
        linvis::nn::Mlp mlp(C, 4 * C, true, impl);
        for (auto& p : mixer->parameters()) p.normal_(0.0, 0.1);
        for (auto& p : mlp->parameters()) p.normal_(0.0, 0.1);
        auto counted = [](const std::function<Tensor()>& f) {
            linvis::flops::Counter counter;
            Tensor y = f();
            return std::make_pair(y, counter.macs());
        };
        const auto whole = counted([&] { return x + mixer->forward_with_rope({norm, x}, H, W, rope); });
        const auto banded =
            counted([&] { return mixer->residual_in_bands_({norm, x.clone()}, H, W, rope, small_budget); });
        // Products over fewer rows may block their sums differently: float32 rounding of 256-term sums.
        EXPECT_TRUE(all_close(banded.first, whole.first, 1e-5, 1e-5));
        EXPECT_EQ(banded.second, whole.second);
        const auto whole_mlp = counted([&] { return x + mlp->forward({norm, x}, H, W); });
        const auto banded_mlp =
            counted([&] { return mlp->residual_in_bands_({norm, x.clone()}, H, W, small_budget); });
        EXPECT_TRUE(all_close(banded_mlp.first, whole_mlp.first, 1e-5, 1e-5));
        EXPECT_EQ(banded_mlp.second, whole_mlp.second);
    }
    const auto bands = linvis::nn::row_bands(H, 1, small_budget);
    ASSERT_EQ(bands.size(), 3u);
    EXPECT_EQ(bands[1].begin, 6);
    EXPECT_EQ(bands[1].first, 5);
    EXPECT_EQ(bands[2].last, H);
}

// Training: the mixer's RoPE and mix, and the conv MLP's hidden layer, redone in the backward of the product
// after them (recompute_mix, recompute_hidden, the MLP also in bands of rows): the same gradients as the graph
// that keeps them, less kept.
TEST(HVit3, RecomputedMixAndMlpGiveTheSameGradientsAndKeepLess) {
    const int64_t C = 64, heads = 2;
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({C}).eps(1e-5));
    {
        torch::NoGradGuard no_grad;
        norm->weight.normal_(1.0, 0.2);
        norm->bias.normal_(0.0, 0.2);
    }
    const auto layers = [&](bool recompute, linvis::ops::Impl impl) {
        torch::manual_seed(66);
        linvis::nn::Vit3Ttt mixer(C, heads, true, impl);
        linvis::nn::Mlp mlp(C, 4 * C, true, impl);
        {
            torch::NoGradGuard no_grad;
            for (auto& p : mixer->parameters()) p.normal_(0.0, 0.1);
            for (auto& p : mlp->parameters()) p.normal_(0.0, 0.1);
        }
        mixer->recompute_mix = recompute;
        mlp->recompute_hidden = recompute;
        return std::make_pair(mixer, mlp);
    };
    for (const auto impl : {linvis::ops::Impl::Auto, linvis::ops::Impl::Reference}) {
        const int64_t H = 6, W = 5;
        const Tensor rope = linvis::ops::vit3_rope_rotations(H, W, C);
        std::vector<Tensor> grads[2][2];  // [recompute][mixer, mlp]
        for (const bool recompute : {false, true}) {
            auto [mixer, mlp] = layers(recompute, impl);
            torch::manual_seed(67);
            const Tensor x = torch::randn({2, H * W, C});
            grads[recompute][0] = linvis::testing::input_and_parameter_grads(
                *mixer, x, [&](const Tensor& t) { return mixer->forward_with_rope({norm, t}, H, W, rope); });
            grads[recompute][1] = linvis::testing::input_and_parameter_grads(
                *mlp, x, [&](const Tensor& t) { return mlp->forward({norm, t}, H, W); });
        }
        const std::string what = impl == linvis::ops::Impl::Auto ? "auto" : "reference";
        linvis::testing::expect_same_gradients(grads[1][0], grads[0][0], 1e-5, "mixer " + what);
        linvis::testing::expect_same_gradients(grads[1][1], grads[0][1], 1e-5, "mlp " + what);

        // The MLP in bands against the whole graph, the norm's parameters' gradients included: one band (the
        // default budget), and three of the smallest height (8 rows: a 1-byte budget).
        const auto mlp_and_norm_grads = [&](bool bands, int64_t band_bytes) {
            auto [mixer, mlp] = layers(bands, impl);
            mlp->recompute_in_bands = bands;
            mlp->recompute_band_bytes = band_bytes;
            norm->zero_grad();
            const int64_t rows = 24;
            torch::manual_seed(67);
            const Tensor x = torch::randn({2, rows * W, C});
            std::vector<Tensor> g = linvis::testing::input_and_parameter_grads(
                *mlp, x, [&](const Tensor& t) { return mlp->forward({norm, t}, rows, W); });
            g.push_back(norm->weight.grad().clone());
            g.push_back(norm->bias.grad().clone());
            return g;
        };
        const std::vector<Tensor> kept_all = mlp_and_norm_grads(false, 0);
        for (const int64_t band_bytes : {int64_t{16} << 20, int64_t{1}})
            linvis::testing::expect_same_gradients(mlp_and_norm_grads(true, band_bytes), kept_all, 1e-5,
                                                   "mlp in bands of " + std::to_string(band_bytes) + " bytes, " + what);
    }
    // What each layer's graph keeps on a 32 x 32 grid (one unit: a (1, 1024, C) float32 tensor, 256 KiB).
    const int64_t side = 32, unit = side * side * C * 4;
    const Tensor rope = linvis::ops::vit3_rope_rotations(side, side, C);
    const Tensor x = torch::randn({1, side * side, C}, torch::requires_grad());
    int64_t kept[2][2];
    for (const bool recompute : {false, true}) {
        auto [mixer, mlp] = layers(recompute, linvis::ops::Impl::Auto);
        kept[recompute][0] =
            linvis::testing::bytes_kept_by([&] { return mixer->forward_with_rope({norm, x}, side, side, rope); });
        kept[recompute][1] = linvis::testing::bytes_kept_by([&] { return mlp->forward({norm, x}, side, side); });
    }
    // The rotated q1 and k1 (2 units) and the mix's output (1.5 units); GELU's output and the conv's (4 units each).
    EXPECT_GE(kept[0][0] - kept[1][0], 3 * unit) << "mixer: " << kept[0][0] << " bytes kept, " << kept[1][0];
    EXPECT_GE(kept[0][1] - kept[1][1], 7 * unit) << "mlp: " << kept[0][1] << " bytes kept, " << kept[1][1];
    // Only a training step recomputes: an eval-mode graph (an explanation's input gradient) keeps everything.
    auto [mixer, mlp] = layers(true, linvis::ops::Impl::Auto);
    mlp->eval();
    EXPECT_GE(linvis::testing::bytes_kept_by([&] { return mlp->forward({norm, x}, side, side); }),
              kept[0][1] - unit);
}

TEST(HVit3, BlocksOfAStageShareOneRopeTable) {
    for (const bool backbone : {false, true}) {
        SCOPED_TRACE(backbone ? "features_only" : "classifier");
        auto model = make("hvit3_tiny", {{"features_only", backbone ? "true" : "false"}});
        std::map<std::string, const void*> tables;  // key -> storage
        for (const auto& item : model->named_buffers(true))
            if (item.key().find("rope.rotations") != std::string::npos) tables[item.key()] = item.value().data_ptr();
        ASSERT_EQ(tables.size(), 17u);  // every block of depths 1-3-9-4 lists its table, as the official model does
        const std::string prefix = backbone ? "attn.rope.rotations" : "rope.rotations";
        std::set<const void*> distinct;
        for (const auto& [key, storage] : tables) {
            EXPECT_NE(key.find(prefix), std::string::npos) << key;
            distinct.insert(storage);
        }
        EXPECT_EQ(distinct.size(), 4u);  // one table per stage
        EXPECT_EQ(tables.at("layers.2.blocks.0." + prefix), tables.at("layers.2.blocks.8." + prefix));

        // The model's own state dict (17 keys, 4 tables) loads back strictly.
        EXPECT_TRUE(linvis::io::load_state_dict(*model, linvis::io::state_dict(*model), true, "own").ok());
    }
    // Another grid's table is computed once per stage and is the formula's.
    auto model = make("hvit3_tiny");
    auto* rope = model->named_modules()["layers.0.blocks.0.rope"]->as<linvis::nn::Vit3RopeImpl>();
    ASSERT_NE(rope, nullptr);
    const Tensor other = rope->table(40, 24);
    EXPECT_EQ(rope->table(40, 24).data_ptr(), other.data_ptr());
    EXPECT_TRUE(torch::equal(other, linvis::ops::vit3_rope_rotations(40, 24, 64)));
    EXPECT_EQ(rope->table(56, 56).data_ptr(), rope->rotations.data_ptr());
}

// The H-ViT³ mixer in inference rotates q1/k1 inside its qkv product and runs the one fused mix kernel; in a graph
// (and under Reference) it composes the rotated copies and the two branches. Same values.
TEST(HVit3, MixerWithRopeInPlaceMatchesTheComposedForm) {
    torch::manual_seed(64);
    const int64_t H = 12, W = 9, C = 64;
    linvis::nn::Vit3Ttt fused(C, 2, true, linvis::ops::Impl::Auto);
    linvis::nn::Vit3Ttt reference(C, 2, true, linvis::ops::Impl::Reference);
    {
        torch::NoGradGuard no_grad;
        auto src = fused->named_parameters();
        for (auto& p : reference->named_parameters()) p.value().copy_(src[p.key()]);
    }
    const Tensor rope = linvis::ops::vit3_rope_rotations(H, W, C);
    const Tensor x = torch::randn({2, H * W, C});
    const Tensor composed = reference->forward_with_rope(linvis::nn::NormedInput(x), H, W, rope);
    const Tensor in_graph = fused->forward_with_rope(linvis::nn::NormedInput(x), H, W, rope);  // weights need grad
    Tensor in_place;
    {
        torch::NoGradGuard no_grad;
        in_place = fused->forward_with_rope(linvis::nn::NormedInput(x), H, W, rope);
    }
    EXPECT_TRUE(in_graph.requires_grad());
    EXPECT_TRUE(all_close(in_graph, composed, 1e-5, 1e-6));
    EXPECT_TRUE(all_close(in_place, composed, 1e-5, 1e-6));
    EXPECT_TRUE(torch::equal(rope, linvis::ops::vit3_rope_rotations(H, W, C)));  // the table itself is untouched
}
