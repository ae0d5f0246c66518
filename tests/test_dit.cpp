// DiT / DiT3 / DiT5 (include/linvis/models/dit.h) against the official code's outputs
// (../shared/fixtures/generation, spec dit_generation.md), the spec's parameter counts and key names,
// and the one-line errors for bad input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <set>
#include <string>

#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "linvis/models/dit.h"
#include "linvis/models/pretrained.h"
#include "linvis/models/registry.h"
#include "checkpoint_writer.h"
#include "support/fixtures.h"
#include "support/temp_dir.h"
#include "support/testing.h"

using linvis::testing::kGenerationFixtureTolerance;
using linvis::testing::matches_fixture;

namespace {

using linvis::models::create_diffusion_model;
using linvis::models::DiffusionModelPtr;
using linvis::models::ModelConfig;

// The fixtures' tiny config: DiT(input_size=8, patch_size=2, hidden_size=96, depth=1, num_heads=3, num_classes=10).
DiffusionModelPtr tiny(const std::string& family) {
    ModelConfig c({{"input_size", "8"}, {"hidden_size", "96"}, {"depth", "1"}, {"num_heads", "3"}, {"num_classes", "10"}});
    if (family == "dit5") c.set("nat_small_grid", std::string("wrap"));  // G = 4: the fixtures' window
    DiffusionModelPtr m = create_diffusion_model(family + "_s2", c);
    linvis::models::load_model_weights(*m, linvis::testing::fixtures_dir() + "/generation/" + family +
                                               "_tiny.weights.safetensors");
    m->eval();
    return m;
}

class DitFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(DitFixture, ForwardMatchesOfficial) {
    LINVIS_REQUIRE_FIXTURES();
    auto f = linvis::testing::load_fixture("generation/" + GetParam() + "_tiny.run.safetensors");
    auto m = tiny(GetParam());
    torch::NoGradGuard g;
    EXPECT_TRUE(matches_fixture(m->forward(f["x"], f["t"], f["y"]), f["out"], kGenerationFixtureTolerance));
}

TEST_P(DitFixture, ForwardWithCfgMatchesOfficial) {
    LINVIS_REQUIRE_FIXTURES();
    auto f = linvis::testing::load_fixture("generation/" + GetParam() + "_tiny.cfg1.5.safetensors");
    auto m = tiny(GetParam());
    torch::NoGradGuard g;
    torch::Tensor out = m->forward_with_cfg(f["x"], f["t"], f["y"], 1.5);
    EXPECT_TRUE(matches_fixture(out, f["out"], kGenerationFixtureTolerance));
    // channels 3.. are not guided and the two halves of the guided channels are equal
    EXPECT_TRUE(torch::equal(out.narrow(0, 0, 1).narrow(1, 0, 3), out.narrow(0, 1, 1).narrow(1, 0, 3)));
}

INSTANTIATE_TEST_SUITE_P(Families, DitFixture, ::testing::Values("dit", "dit3", "dit5"));

// The names of every node of the autograd graph behind `out`.
std::set<std::string> graph_nodes(const torch::Tensor& out) {
    std::set<std::string> names;
    std::vector<torch::autograd::Node*> todo{out.grad_fn().get()};
    std::set<torch::autograd::Node*> seen;
    while (!todo.empty()) {
        torch::autograd::Node* node = todo.back();
        todo.pop_back();
        if (node == nullptr || !seen.insert(node).second) continue;
        names.insert(node->name());
        for (const torch::autograd::Edge& edge : node->next_edges()) todo.push_back(edge.function.get());
    }
    return names;
}

// Training: each block's adaLN and the first products after it (qkv, fc1, the final layer) are one node in the
// fused model (ops::modulated_layer_norm_linear, keeping x rather than the modulated copy), and every gradient is
// the reference model's.
bool has_node(const std::set<std::string>& nodes, const std::string& name) {
    return std::any_of(nodes.begin(), nodes.end(),
                       [&](const std::string& n) { return n.find(name) != std::string::npos; });
}

TEST(Dit, TrainingGradientsMatchTheReferenceModelInEveryFamily) {
    for (const std::string family : {"dit", "dit3", "dit5"}) {
        SCOPED_TRACE(family);
        const ModelConfig options({{"input_size", "8"}, {"hidden_size", "96"}, {"depth", "2"}, {"num_heads", "3"},
                                   {"num_classes", "10"}, {"class_dropout_prob", "0"}});
        auto make = [&](const std::string& impl) {
            ModelConfig c = options;
            c.set("impl", impl);
            if (family == "dit5") c.set("nat_small_grid", std::string("wrap"));
            return create_diffusion_model(family + "_s2", c);
        };
        DiffusionModelPtr reference = make("reference"), fused = make("auto");
        torch::manual_seed(31);
        // Weights off the adaLN-zero initialisation, under which every gradient but the last layer's is 0.
        linvis::testing::share_random_weights(*reference, *fused);
        reference->train();
        fused->train();
        const torch::Tensor x = torch::randn({2, 4, 8, 8}), t = torch::tensor({5, 900}), y = torch::tensor({3, 7});
        const torch::Tensor g = torch::randn({2, 8, 8, 8});
        const torch::Tensor out_ref = reference->forward(x, t, y), out = fused->forward(x, t, y);
        const std::set<std::string> nodes = graph_nodes(out), ref_nodes = graph_nodes(out_ref);
        EXPECT_TRUE(has_node(nodes, "NormedProducts"));
        EXPECT_FALSE(has_node(ref_nodes, "NormedProducts"));
        EXPECT_TRUE(linvis::testing::all_close(out, out_ref, 1e-4, 1e-5 * out_ref.abs().max().item<double>()));
        (out * g).sum().backward();
        (out_ref * g).sum().backward();
        auto ref_params = reference->named_parameters(true);
        for (const auto& item : fused->named_parameters(true)) {
            if (!item.value().requires_grad()) continue;  // pos_embed: fixed sin-cos positions
            const torch::Tensor &got = item.value().grad(), &want = ref_params[item.key()].grad();
            ASSERT_TRUE(got.defined() && want.defined()) << item.key();
            const double scale = want.abs().max().item<double>();
            EXPECT_GT(scale, 0.0) << item.key();
            EXPECT_LE((got - want).abs().max().item<double>(), 1e-4 * scale) << item.key();
        }
    }
}

// Spec §1.5: totals (state-dict numel, including pos_embed), trainable counts and entry counts.
TEST(Dit, ParameterCountsMatchSpec) {
    struct Row {
        const char* name;
        int64_t total;
    };
    const Row rows[] = {
        {"dit_s2", 32963360},  {"dit_s4", 32945024},  {"dit_s8", 33148160},  {"dit_b2", 130512416},
        {"dit_b4", 130475648}, {"dit_b8", 130881536}, {"dit3_s2", 34788128}, {"dit3_s4", 34769792},
        {"dit3_s8", 34972928}, {"dit3_b2", 134152736}, {"dit3_b4", 134115968}, {"dit3_b8", 134521856},
        {"dit5_s2", 33663776}, {"dit5_s4", 33645440}, {"dit5_s8", 33848576}, {"dit5_b2", 131913248},
        {"dit5_b4", 131876480}, {"dit5_b8", 132282368},
    };
    for (const Row& r : rows) {
        auto m = create_diffusion_model(r.name);
        EXPECT_EQ(linvis::models::count_parameters(*m), r.total) << r.name;
    }
    EXPECT_EQ(linvis::models::count_parameters(*create_diffusion_model("dit_s2"), true), 32865056);
    EXPECT_EQ(linvis::models::count_parameters(*create_diffusion_model("dit3_s2"), true), 34689824);
    EXPECT_EQ(linvis::models::count_parameters(*create_diffusion_model("dit5_s2"), true), 33565472);
    EXPECT_EQ(create_diffusion_model("dit_s2")->named_parameters().size(), 132u);
    EXPECT_EQ(create_diffusion_model("dit3_s2")->named_parameters().size(), 192u);
    EXPECT_EQ(create_diffusion_model("dit5_s2")->named_parameters().size(), 228u);
}

// L/2 and XL/2 totals of §1.5 without building 0.5-0.7 B parameters: the total is linear in depth, so
// outside + depth * block from depth-1 and depth-2 builds.
TEST(Dit, LargeSizesMatchSpec) {
    const std::tuple<const char*, int64_t, int64_t> rows[] = {{"dit_l2", 24, 458102816}, {"dit_xl2", 28, 675129632},
                                                             {"dit3_l2", 24, 467804192}, {"dit3_xl2", 28, 689410976},
                                                             {"dit5_l2", 24, 461838368}, {"dit5_xl2", 28, 680548640}};
    for (const auto& [name, depth, total] : rows) {
        const int64_t one = linvis::models::count_parameters(*create_diffusion_model(name, ModelConfig().set("depth", std::string("1"))));
        const int64_t two = linvis::models::count_parameters(*create_diffusion_model(name, ModelConfig().set("depth", std::string("2"))));
        EXPECT_EQ(one + (depth - 1) * (two - one), total) << name;
    }
}

TEST(Dit, StateDictKeysAreOfficial) {
    auto m = create_diffusion_model("dit3_s2");
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& p : m->named_parameters()) shapes[p.key()] = p.value().sizes().vec();
    const std::map<std::string, std::vector<int64_t>> expected = {
        {"pos_embed", {1, 256, 384}},
        {"x_embedder.proj.weight", {384, 4, 2, 2}},
        {"t_embedder.mlp.0.weight", {384, 256}},
        {"t_embedder.mlp.2.weight", {384, 384}},
        {"y_embedder.embedding_table.weight", {1001, 384}},
        {"final_layer.linear.weight", {32, 384}},
        {"final_layer.adaLN_modulation.1.weight", {768, 384}},
        {"blocks.0.cpe.weight", {384, 1, 3, 3}},
        {"blocks.0.attn.w1", {1, 6, 64, 64}},
        {"blocks.0.attn.w3", {64, 1, 3, 3}},
        {"blocks.0.attn.qkv.weight", {1344, 384}},
        {"blocks.0.attn.proj.weight", {384, 448}},
        {"blocks.11.mlp.fc1.weight", {1536, 384}},
        {"blocks.11.adaLN_modulation.1.weight", {2304, 384}},
    };
    for (const auto& [key, shape] : expected) {
        ASSERT_TRUE(shapes.count(key)) << key;
        EXPECT_EQ(shapes[key], shape) << key;
    }
    auto m5 = create_diffusion_model("dit5_s2");
    std::set<std::string> keys5;
    for (const auto& p : m5->named_parameters()) keys5.insert(p.key());
    for (const char* k : {"blocks.0.attn.qk_scale_ttt", "blocks.0.attn.qk_offset_ttt", "blocks.0.attn.q_conv2d.weight",
                          "blocks.0.attn.k_conv2d.bias", "blocks.0.attn.w2"})
        EXPECT_TRUE(keys5.count(k)) << k;
    EXPECT_FALSE(m->named_parameters()["pos_embed"].requires_grad());
}

// From-scratch init (spec §2): output exactly zero, pos_embed sin-cos with the column first.
TEST(Dit, InitialisationGivesZeroOutputAndSinCosPositions) {
    auto m = create_diffusion_model("dit_s4", ModelConfig({{"input_size", "16"}, {"depth", "2"}}));
    m->eval();
    torch::NoGradGuard g;
    torch::Tensor out = m->forward(torch::randn({2, 4, 16, 16}), torch::tensor({0, 999}), torch::tensor({3, 1000}));
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 8, 16, 16}));
    EXPECT_EQ(out.abs().max().item<double>(), 0.0);
    torch::Tensor pos = linvis::models::dit_pos_embed(8, 4);  // C = 8: halves of 4, omega = [1, 1/100]
    // token (i=1, j=2) = n 6: [sin(2), sin(0.02), cos(2), cos(0.02), sin(1), sin(0.01), cos(1), cos(0.01)]
    const double e[] = {std::sin(2.0), std::sin(0.02), std::cos(2.0), std::cos(0.02),
                        std::sin(1.0), std::sin(0.01), std::cos(1.0), std::cos(0.01)};
    for (int k = 0; k < 8; ++k) EXPECT_NEAR(pos[6][k].item<double>(), e[k], 1e-7) << k;
    torch::Tensor temb = linvis::models::dit_timestep_embedding(torch::tensor({5}), 256);
    EXPECT_NEAR(temb[0][0].item<double>(), std::cos(5.0), 1e-6);    // cos first
    EXPECT_NEAR(temb[0][128].item<double>(), std::sin(5.0), 1e-6);  // then sin
}

TEST(Dit, LabelDropoutOnlyInTrainMode) {
    auto m = create_diffusion_model("dit_s4", ModelConfig({{"input_size", "8"}, {"depth", "1"}, {"class_dropout_prob", "1.0"}}));
    // With dropout probability 1 every label becomes the null label in train mode: outputs for different
    // labels coincide; in eval mode they do not (after giving the label table and adaLN some weight).
    {
        torch::NoGradGuard g;
        for (auto& p : m->parameters()) p.normal_(0, 0.05);
    }
    torch::NoGradGuard g;
    torch::Tensor x = torch::randn({1, 4, 8, 8}), t = torch::tensor({10});
    m->train();
    EXPECT_TRUE(torch::equal(m->forward(x, t, torch::tensor({1})), m->forward(x, t, torch::tensor({2}))));
    m->eval();
    EXPECT_FALSE(torch::equal(m->forward(x, t, torch::tensor({1})), m->forward(x, t, torch::tensor({2}))));
}

std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const linvis::Error& e) {
        return e.what();
    }
    return "(no error)";
}

TEST(Dit, BadInputGivesOneLineErrors) {
    auto m = create_diffusion_model("dit_s2", ModelConfig({{"input_size", "8"}, {"depth", "1"}, {"num_classes", "10"}}));
    m->eval();
    torch::NoGradGuard g;
    std::string e = error_of([&] { m->forward(torch::randn({1, 4, 8, 8}), torch::tensor({1}), torch::tensor({11})); });
    EXPECT_NE(e.find("label 11 out of range [0, 10]"), std::string::npos) << e;
    e = error_of([&] { m->forward(torch::randn({1, 4, 6, 6}), torch::tensor({1}), torch::tensor({1})); });
    EXPECT_NE(e.find("expected (B, 4, 8, 8)"), std::string::npos) << e;
    e = error_of([&] { create_diffusion_model("dit_s4", ModelConfig().set("input_size", std::string("10"))); });
    EXPECT_NE(e.find("not divisible by the patch size 4"), std::string::npos) << e;
    // DiT5-S/8 at 32x32 latents (G = 4): builds (the spec counts its parameters) but does not run
    auto s8 = create_diffusion_model("dit5_s8", ModelConfig().set("depth", std::string("1")));
    e = error_of([&] { s8->forward(torch::randn({1, 4, 32, 32}), torch::tensor({1}), torch::tensor({1})); });
    EXPECT_NE(e.find("token grid 4x4 (input_size / patch_size) is smaller than the 5x5"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    e = error_of([&] { create_diffusion_model("deit_tiny"); });
    EXPECT_NE(e.find("classifier"), std::string::npos) << e;
    e = error_of([&] { linvis::models::create_model("dit_s2"); });
    EXPECT_NE(e.find("diffusion model"), std::string::npos) << e;
    for (const std::string& msg : {e}) EXPECT_EQ(msg.find('\n'), std::string::npos);
}

TEST(Dit, WrongFamilyCheckpointIsRejected) {
    LINVIS_REQUIRE_FIXTURES();
    ModelConfig c({{"input_size", "8"}, {"hidden_size", "96"}, {"depth", "1"}, {"num_heads", "3"}, {"num_classes", "10"}});
    auto m = create_diffusion_model("dit3_s2", c);
    const std::string path = linvis::testing::fixtures_dir() + "/generation/dit5_tiny.weights.safetensors";
    const std::string e = error_of([&] { linvis::models::load_model_weights(*m, path); });
    EXPECT_NE(e.find("does not match the model"), std::string::npos) << e;
    EXPECT_NE(e.find("dit5_tiny.weights.safetensors"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

// Official checkpoints: a train.py file {"model", "ema", "opt", "args"} gives its EMA (find_model), a bare
// torch.save(state_dict) loads as is.
TEST(Dit, OfficialCheckpointFormatsLoad) {
    LINVIS_REQUIRE_FIXTURES();
    auto sd = linvis::testing::load_fixture("generation/dit_tiny.weights.safetensors");
    auto f = linvis::testing::load_fixture("generation/dit_tiny.run.safetensors");
    std::vector<std::pair<std::string, torch::Tensor>> ema, model;
    for (const auto& [k, v] : sd) {
        ema.emplace_back(k, v);
        model.emplace_back(k, v + 0.5);  // the non-EMA weights differ
    }
    linvis::testing::TempDir dir;
    linvis::testing::save_model_and_ema(dir.file("train.pt"), model, ema, /*with_optimizer=*/true);
    {
        linvis::testing::CheckpointWriter w;
        w.p.proto(2);
        w.state_dict(ema);
        w.p.stop();
        w.save(dir.file("bare.pt"));
    }
    ModelConfig c({{"input_size", "8"}, {"hidden_size", "96"}, {"depth", "1"}, {"num_heads", "3"}, {"num_classes", "10"}});
    for (const char* file : {"train.pt", "bare.pt"}) {
        auto m = create_diffusion_model("dit_s2", c);
        auto r = linvis::models::load_model_weights(*m, dir.file(file));
        EXPECT_EQ(r.chosen_key, std::string(file) == "train.pt" ? "ema" : "") << file;
        m->eval();
        torch::NoGradGuard g;
        EXPECT_TRUE(matches_fixture(m->forward(f["x"], f["t"], f["y"]), f["out"])) << file;
    }
    // an explicit EMA request on a bare state dict is an error
    auto m = create_diffusion_model("dit_s2", c);
    EXPECT_THROW(linvis::models::load_model_weights(*m, dir.file("bare.pt"), /*prefer_ema=*/true), linvis::Error);
}

TEST(Dit, Dit5InheritsEverySoftmaxKey) {
    auto dit = create_diffusion_model("dit_s2");
    auto dit5 = create_diffusion_model("dit5_s2");
    std::map<std::string, torch::Tensor> p5;
    for (const auto& p : dit5->named_parameters()) p5[p.key()] = p.value();
    int64_t copied = 0, fresh = 0;
    for (const auto& p : dit->named_parameters()) {
        ASSERT_TRUE(p5.count(p.key())) << p.key();
        EXPECT_EQ(p5[p.key()].sizes(), p.value().sizes()) << p.key();
        ++copied;
    }
    for (const auto& [k, v] : p5) fresh += linvis::models::is_dit5_new_parameter(k);
    EXPECT_EQ(copied, 132);
    EXPECT_EQ(fresh, 96);
}

}  // namespace
