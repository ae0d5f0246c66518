// State dicts and strict weight loading through safetensors.
#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/state_dict.h"
#include "linvis/models/registry.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using linvis::Error;
using namespace linvis::io;

using linvis::testing::TempDir;

namespace {

// A small model with nested submodules, a ModuleList and buffers, like the real backbones.
struct BlockImpl : torch::nn::Module {
    torch::nn::LayerNorm norm{nullptr};
    torch::nn::Linear fc{nullptr};
    explicit BlockImpl(int64_t dim) {
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
        fc = register_module("fc", torch::nn::Linear(dim, dim));
    }
    torch::Tensor forward(const torch::Tensor& x) { return x + fc(norm(x)); }
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
    torch::nn::Linear embed{nullptr};
    torch::nn::ModuleList blocks;
    torch::nn::BatchNorm1d bn{nullptr};
    torch::Tensor pos;
    explicit NetImpl(int64_t dim = 8, int64_t depth = 2) {
        embed = register_module("embed", torch::nn::Linear(4, dim));
        blocks = register_module("blocks", torch::nn::ModuleList());
        for (int64_t i = 0; i < depth; ++i) blocks->push_back(Block(dim));
        bn = register_module("bn", torch::nn::BatchNorm1d(dim));
        pos = register_parameter("pos_embed", torch::zeros({1, dim}));
    }
    torch::Tensor forward(const torch::Tensor& x) {
        auto h = embed(x) + pos;
        for (const auto& b : *blocks) h = b->as<Block>()->forward(h);
        return bn(h);
    }
};
TORCH_MODULE(Net);


// Randomises every parameter and buffer so that a load that does nothing cannot pass.
void randomise(torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.copy_(torch::randn_like(p));
    for (auto& b : m.buffers()) {
        if (b.is_floating_point()) b.copy_(torch::rand_like(b) + 0.5);
        else b.fill_(7);
    }
}

std::string expect_error(const std::function<void()>& body) {
    try {
        body();
    } catch (const Error& e) {
        return e.what();
    }
    ADD_FAILURE() << "no linvis::Error thrown";
    return "";
}

}  // namespace

TEST(StateDict, KeysAreFullDottedPyTorchNames) {
    Net net;
    const auto sd = state_dict(*net);
    std::vector<std::string> keys;
    for (const auto& [k, v] : sd) keys.push_back(k);
    const std::vector<std::string> expected = {
        "blocks.0.fc.bias",  "blocks.0.fc.weight", "blocks.0.norm.bias", "blocks.0.norm.weight",
        "blocks.1.fc.bias",  "blocks.1.fc.weight", "blocks.1.norm.bias", "blocks.1.norm.weight",
        "bn.bias",           "bn.num_batches_tracked", "bn.running_mean", "bn.running_var",
        "bn.weight",         "embed.bias",         "embed.weight",       "pos_embed"};
    EXPECT_EQ(keys, expected);
    EXPECT_FALSE(sd.at("embed.weight").requires_grad());
    EXPECT_EQ(sd.at("embed.weight").data_ptr(), net->embed->weight.data_ptr());  // shares storage
}

TEST(StateDict, RoundTripThroughFileGivesIdenticalOutputs) {
    TempDir dir;
    const auto path = (dir.path / "net.safetensors").string();
    Net source;
    randomise(*source);
    source->eval();
    save_weights(*source, path, {{"arch", "test-net"}});

    Net fresh;
    randomise(*fresh);
    fresh->eval();
    const auto x = torch::randn({5, 4});
    ASSERT_FALSE(torch::equal(fresh->forward(x), source->forward(x)));
    const LoadReport report = load_weights(*fresh, path, /*strict=*/true);
    EXPECT_TRUE(report.ok());
    EXPECT_EQ(report.loaded.size(), state_dict(*source).size());
    EXPECT_TRUE(torch::equal(fresh->forward(x), source->forward(x)));
    EXPECT_EQ(fresh->bn->num_batches_tracked.item<int64_t>(), 7);

    const SafetensorsFile file = SafetensorsFile::open(path);
    EXPECT_EQ(file.metadata().at("format"), "pt");
    EXPECT_EQ(file.metadata().at("arch"), "test-net");
}

TEST(StateDict, StrictLoadNamesEveryMissingUnexpectedAndMismatchedKeyAndChangesNothing) {
    Net net;
    randomise(*net);
    Net fresh;
    auto tensors = state_dict(*fresh);  // other values
    tensors.erase("blocks.1.fc.bias");
    tensors.erase("bn.running_var");
    tensors["head.weight"] = torch::zeros({3, 8});
    tensors["blocks.0.fc.weight"] = torch::zeros({8, 9});
    tensors["pos_embed"] = torch::zeros({8});
    const auto before = state_dict(*net);
    std::map<std::string, torch::Tensor> snapshot;
    for (const auto& [k, v] : before) snapshot[k] = v.clone();

    const std::string msg = expect_error([&] { load_state_dict(*net, tensors, true, "ckpt.safetensors"); });
    EXPECT_EQ(msg.rfind("ckpt.safetensors: cannot load weights: ", 0), 0u) << msg;
    for (const char* part : {"2 missing keys: 'blocks.1.fc.bias', 'bn.running_var'", "1 unexpected key: 'head.weight'",
                             "'blocks.0.fc.weight' (model expects [8, 8], got [8, 9])",
                             "'pos_embed' (model expects [1, 8], got [8])", "2 shape mismatches"}) {
        EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
    }
    for (const auto& [k, v] : state_dict(*net)) EXPECT_TRUE(torch::equal(v, snapshot.at(k))) << k << " changed";
}

TEST(StateDict, NonStrictLoadsMatchingKeysAndReportsTheRest) {
    Net net;
    randomise(*net);
    Net other;
    randomise(*other);
    auto tensors = state_dict(*other);
    tensors.erase("embed.bias");
    tensors["extra"] = torch::ones({2});
    tensors["bn.weight"] = torch::ones({3});
    const auto old_embed_bias = net->embed->bias.clone();
    const auto old_bn_weight = net->bn->weight.clone();

    const LoadReport report = load_state_dict(*net, tensors, false, "partial.safetensors");
    EXPECT_FALSE(report.ok());
    EXPECT_EQ(report.missing, (std::vector<std::string>{"embed.bias"}));
    EXPECT_EQ(report.unexpected, (std::vector<std::string>{"extra"}));
    ASSERT_EQ(report.mismatched.size(), 1u);
    EXPECT_EQ(report.mismatched[0].key, "bn.weight");
    EXPECT_EQ(report.mismatched[0].expected, (std::vector<int64_t>{8}));
    EXPECT_EQ(report.mismatched[0].actual, (std::vector<int64_t>{3}));
    EXPECT_EQ(report.loaded.size(), state_dict(*net).size() - 2);
    EXPECT_TRUE(torch::equal(net->embed->weight, other->embed->weight));
    EXPECT_TRUE(torch::equal(net->blocks[1]->as<Block>()->fc->weight, other->blocks[1]->as<Block>()->fc->weight));
    EXPECT_TRUE(torch::equal(net->embed->bias, old_embed_bias));
    EXPECT_TRUE(torch::equal(net->bn->weight, old_bn_weight));
    EXPECT_NE(report.summary().find("1 missing key: 'embed.bias'"), std::string::npos) << report.summary();
}

TEST(StateDict, LoadConvertsDtypeAndKeepsModuleDtype) {
    TempDir dir;
    const auto path = (dir.path / "half.safetensors").string();
    Net source;
    randomise(*source);
    std::map<std::string, torch::Tensor> as_double;
    for (const auto& [k, v] : state_dict(*source)) as_double[k] = v.is_floating_point() ? v.to(torch::kFloat64) : v;
    save_safetensors(path, as_double);
    Net target;
    EXPECT_TRUE(load_weights(*target, path).ok());
    EXPECT_EQ(target->embed->weight.scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(target->embed->weight, source->embed->weight));  // f32 -> f64 -> f32 is exact
    EXPECT_TRUE(target->embed->weight.requires_grad());
}

TEST(StateDict, LoadWeightsStrictErrorNamesTheFile) {
    TempDir dir;
    const auto path = (dir.path / "small.safetensors").string();
    save_weights(*Net(8, 1), path);
    Net deeper(8, 2);
    const std::string msg = expect_error([&] { load_weights(*deeper, path, true); });
    EXPECT_EQ(msg.rfind(path + ": cannot load weights: 4 missing keys: 'blocks.1.fc.bias'", 0), 0u) << msg;
}

TEST(StateDict, KeysOfOneSharedBufferMustBringOneValue) {
    // Two parents hold one child module (as H-ViT³'s blocks of a stage hold their RoPE table): its buffer has a
    // key under each parent.
    struct Table : torch::nn::Module {
        torch::Tensor values = register_buffer("values", torch::zeros({3}));
    };
    struct Parent : torch::nn::Module {
        explicit Parent(std::shared_ptr<Table> table) { register_module("table", std::move(table)); }
    };
    struct Root : torch::nn::Module {
        std::shared_ptr<Table> table = std::make_shared<Table>();
        Root() {
            register_module("a", std::make_shared<Parent>(table));
            register_module("b", std::make_shared<Parent>(table));
        }
    } root;
    ASSERT_EQ(state_dict(root).size(), 2u);

    const torch::Tensor same = torch::tensor({1.0f, 2.0f, 3.0f});
    const LoadReport report =
        load_state_dict(root, {{"a.table.values", same}, {"b.table.values", same.clone()}}, true, "same.safetensors");
    EXPECT_EQ(report.loaded.size(), 2u);
    EXPECT_TRUE(torch::equal(root.table->values, same));

    const std::string msg = expect_error([&] {
        load_state_dict(root, {{"a.table.values", torch::ones({3})}, {"b.table.values", same}}, true,
                        "differ.safetensors");
    });
    EXPECT_EQ(msg.rfind("differ.safetensors: tensors 'a.table.values' and 'b.table.values' load into one tensor", 0),
              0u)
        << msg;
    EXPECT_TRUE(torch::equal(root.table->values, same));  // nothing changed
}

// Layers built without LibTorch's default draw (nn::uninitialised_linear) hold NaN until their model's init sets
// them: every parameter and buffer of every family (the smallest size of each) is finite once the model is built.
TEST(StateDict, EveryParameterIsSetWhenAModelIsBuilt) {
    std::vector<std::shared_ptr<torch::nn::Module>> models;
    std::vector<std::string> names;
    for (const std::string name : {"deit_tiny", "t5_tiny", "vit3_tiny", "hvit3_tiny", "vittt_tiny", "vil_tiny"}) {
        models.push_back(linvis::models::create_model(name));
        names.push_back(name);
    }
    for (const std::string name : {"dit_s8", "dit3_s8", "dit5_s8"}) {
        models.push_back(linvis::models::create_generative_model(name));
        names.push_back(name);
    }
    for (size_t i = 0; i < models.size(); ++i) {
        for (const auto& p : models[i]->named_parameters())
            EXPECT_TRUE(torch::isfinite(p.value()).all().item<bool>()) << names[i] << ": " << p.key();
        for (const auto& b : models[i]->named_buffers())
            if (b.value().is_floating_point())
                EXPECT_TRUE(torch::isfinite(b.value()).all().item<bool>()) << names[i] << ": " << b.key();
    }
}
