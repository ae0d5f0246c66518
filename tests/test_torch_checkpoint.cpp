// torch.save checkpoint reader: archives written here with the same opcode sequences and
// records Python's torch.save produces (tests/checkpoint_writer.h), LibTorch's own
// pickle_save output, malformed files, state-dict extraction and mapping onto a model.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <fstream>
#include <random>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "checkpoint_writer.h"
#include "linvis/core/error.h"
#include "linvis/io/torch_checkpoint.h"
#include "linvis/models/model.h"
#include "linvis/models/pretrained.h"

using linvis::Error;
using linvis::io::Value;
using linvis::testing::CheckpointWriter;

namespace {

std::string temp_path(const std::string& name) {
    return (::testing::TempDir().empty() ? std::string("/tmp/") : ::testing::TempDir()) + "linvis_ckpt_" +
           std::to_string(::getpid()) + "_" + name;
}

// Bitwise equality including dtype and shape.
::testing::AssertionResult same_tensor(const torch::Tensor& a, const torch::Tensor& b) {
    if (a.scalar_type() != b.scalar_type())
        return ::testing::AssertionFailure() << "dtype " << a.scalar_type() << " vs " << b.scalar_type();
    if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << "shape " << a.sizes() << " vs " << b.sizes();
    if (!torch::equal(a, b)) return ::testing::AssertionFailure() << "values differ";
    return ::testing::AssertionSuccess();
}

std::string expect_error(const std::function<void()>& f) {
    try {
        f();
    } catch (const Error& e) {
        return e.what();
    } catch (const std::exception& e) {
        ADD_FAILURE() << "expected linvis::Error, got another exception: " << e.what();
        return "";
    }
    ADD_FAILURE() << "expected linvis::Error, nothing was thrown";
    return "";
}

// A small "official" state dict: conv weight, linear, int64 BN counter, 0-d scalar.
std::vector<std::pair<std::string, torch::Tensor>> sample_state_dict(uint64_t seed) {
    torch::manual_seed(seed);
    return {{"patch_embed.proj.weight", torch::randn({4, 3, 2, 2})},
            {"patch_embed.proj.bias", torch::randn({4})},
            {"norm.num_batches_tracked", torch::tensor(int64_t{123456789012})},
            {"head.weight", torch::randn({5, 4}, torch::kFloat64)},
            {"logit_scale", torch::randn({})}};
}

// argparse.Namespace(lr=5e-4, model='vittt_tiny', amp=True, drop=None, epochs=300): CPython
// protocol 2 writes GLOBAL, EMPTY_TUPLE, NEWOBJ (copyreg.__newobj__), then BUILD with __dict__.
void write_namespace(CheckpointWriter& w) {
    auto& p = w.p;
    p.global("argparse", "Namespace");
    p.put();
    p.empty_tuple();
    p.newobj();
    p.put();
    p.empty_dict();
    p.put();
    p.mark();
    p.str("lr");
    p.put();
    p.real(5e-4);
    p.str("model");
    p.put();
    p.str("vittt_tiny");
    p.put();
    p.str("amp");
    p.put();
    p.boolean(true);
    p.str("drop");
    p.put();
    p.none();
    p.str("epochs");
    p.put();
    p.integer(300);
    p.setitems();
    p.build();
}

// optimizer.state_dict(): {'state': {0: {'step': 10, 'exp_avg': t, 'exp_avg_sq': t}, 1: {...}},
//                          'param_groups': [{'lr': 1e-3, 'betas': (0.9, 0.999), 'params': [0, 1]}]}
void write_optimizer(CheckpointWriter& w, const std::vector<torch::Tensor>& moments) {
    auto& p = w.p;
    p.empty_dict();
    p.put();
    p.mark();
    p.str("state");
    p.put();
    p.empty_dict();
    p.put();
    p.mark();
    for (int i = 0; i < 2; ++i) {
        p.integer(i);
        p.empty_dict();
        p.put();
        p.mark();
        p.str("step");
        p.put();
        w.tensor(torch::tensor(10.0));
        p.str("exp_avg");
        p.put();
        w.tensor(moments[static_cast<size_t>(2 * i)]);
        p.str("exp_avg_sq");
        p.put();
        w.tensor(moments[static_cast<size_t>(2 * i + 1)]);
        p.setitems();
    }
    p.setitems();
    p.str("param_groups");
    p.put();
    p.empty_list();
    p.put();
    p.empty_dict();
    p.put();
    p.mark();
    p.str("lr");
    p.put();
    p.real(1e-3);
    p.str("betas");
    p.put();
    p.real(0.9);
    p.real(0.999);
    p.tuple_n(2);
    p.put();
    p.str("params");
    p.put();
    p.empty_list();
    p.put();
    p.mark();
    p.integer(0);
    p.integer(1);
    p.appends();
    p.setitems();
    p.append();
    p.setitems();
}

void expect_state_dict(const std::map<std::string, torch::Tensor>& got,
                       const std::vector<std::pair<std::string, torch::Tensor>>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, t] : want) {
        auto it = got.find(name);
        ASSERT_NE(it, got.end()) << name;
        EXPECT_TRUE(same_tensor(it->second, t)) << name;
    }
}

}  // namespace

TEST(TorchCheckpoint, PlainStateDictReadsBackBitwise) {
    const auto sd = sample_state_dict(1);
    CheckpointWriter w;
    w.p.proto(2);
    w.state_dict(sd);
    w.p.stop();
    const std::string path = temp_path("plain.pth");
    w.save(path);

    const auto contents = linvis::io::read_torch_checkpoint(path);
    EXPECT_EQ(contents.byteorder, "little");
    EXPECT_EQ(contents.num_storages, 5);
    EXPECT_GE(contents.format_version, 1);
    ASSERT_EQ(contents.root->kind, Value::Kind::Dict);
    EXPECT_EQ(contents.root->class_name, "collections.OrderedDict");
    // insertion order is kept
    ASSERT_EQ(contents.root->entries.size(), sd.size());
    for (size_t i = 0; i < sd.size(); ++i) EXPECT_EQ(contents.root->entries[i].first->text, sd[i].first);
    // the _metadata attribute arrives as BUILD state
    ASSERT_TRUE(contents.root->state);
    EXPECT_NE(contents.root->state->find("_metadata"), nullptr);

    std::string key = "unset";
    linvis::io::StateDictReport report;
    const auto got = linvis::io::extract_state_dict(contents, false, &key, &report);
    EXPECT_EQ(key, "");
    EXPECT_EQ(report.kept, 5);
    EXPECT_TRUE(report.dropped.empty());
    expect_state_dict(got, sd);
    EXPECT_EQ(got.at("norm.num_batches_tracked").item<int64_t>(), int64_t{123456789012});
    EXPECT_EQ(got.at("logit_scale").dim(), 0);
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, TrainingCheckpointWithOptimizerNamespaceAndEma) {
    const auto sd = sample_state_dict(2);
    const auto sd_ema = sample_state_dict(3);
    torch::manual_seed(4);
    std::vector<torch::Tensor> moments = {torch::randn({4, 3, 2, 2}), torch::rand({4, 3, 2, 2}), torch::randn({4}),
                                          torch::rand({4})};
    CheckpointWriter w;
    auto& p = w.p;
    p.proto(2);
    p.empty_dict();
    p.put();
    p.mark();
    p.str("model");
    p.put();
    {  // DDP-wrapped model: every key has 'module.'
        std::vector<std::pair<std::string, torch::Tensor>> prefixed;
        for (const auto& [k, t] : sd) prefixed.emplace_back("module." + k, t);
        w.state_dict(prefixed);
    }
    p.str("model_ema");
    p.put();
    w.state_dict(sd_ema);
    p.str("optimizer");
    p.put();
    write_optimizer(w, moments);
    p.str("epoch");
    p.put();
    p.integer(5);
    p.str("scaler");
    p.put();
    p.empty_dict();
    p.put();
    p.str("args");
    p.put();
    write_namespace(w);
    p.setitems();
    p.stop();
    const std::string path = temp_path("train.pth");
    w.save(path);

    const auto contents = linvis::io::read_torch_checkpoint(path);
    const Value& root = *contents.root;
    // argparse.Namespace is an object whose attributes come from BUILD
    const Value* args = root.find("args");
    ASSERT_NE(args, nullptr);
    ASSERT_EQ(args->kind, Value::Kind::Object);
    EXPECT_EQ(args->class_name, "argparse.Namespace");
    ASSERT_NE(args->attribute("lr"), nullptr);
    EXPECT_EQ(args->attribute("lr")->real, 5e-4);
    EXPECT_EQ(args->attribute("model")->text, "vittt_tiny");
    EXPECT_TRUE(args->attribute("amp")->boolean);
    EXPECT_EQ(args->attribute("drop")->kind, Value::Kind::None);
    EXPECT_EQ(args->attribute("epochs")->integer, 300);
    EXPECT_EQ(args->attribute("nonexistent"), nullptr);
    // optimizer: int keys, nested tensors, floats and tuples
    const Value* opt = root.find("optimizer");
    ASSERT_NE(opt, nullptr);
    const Value* state = opt->find("state");
    ASSERT_NE(state, nullptr);
    ASSERT_EQ(state->entries.size(), 2u);
    EXPECT_EQ(state->entries[1].first->kind, Value::Kind::Int);
    EXPECT_EQ(state->entries[1].first->integer, 1);
    EXPECT_TRUE(same_tensor(state->entries[1].second->find("exp_avg_sq")->tensor, moments[3]));
    EXPECT_EQ(state->entries[0].second->find("step")->tensor.item<float>(), 10.0f);
    const Value* group = opt->find("param_groups")->items.at(0).get();
    EXPECT_EQ(group->find("lr")->real, 1e-3);
    EXPECT_EQ(group->find("betas")->items.at(1)->real, 0.999);
    EXPECT_EQ(group->find("params")->items.size(), 2u);
    EXPECT_EQ(root.find("epoch")->integer, 5);

    std::string key;
    linvis::io::StateDictReport report;
    const auto model = linvis::io::extract_state_dict(contents, false, &key, &report);
    EXPECT_EQ(key, "model");
    EXPECT_EQ(report.prefix_stripped, 5);
    expect_state_dict(model, sd);
    // everything else is reported as dropped, with what it was
    ASSERT_EQ(report.dropped.size(), 5u);
    EXPECT_EQ(report.dropped[0], "model_ema: collections.OrderedDict(5)");
    EXPECT_EQ(report.dropped[1], "optimizer: dict(2)");
    EXPECT_EQ(report.dropped[2], "epoch: int 5");
    EXPECT_EQ(report.dropped[4], "args: object argparse.Namespace");

    const auto ema = linvis::io::extract_state_dict(contents, true, &key, nullptr);
    EXPECT_EQ(key, "model_ema");
    expect_state_dict(ema, sd_ema);
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, YacsCfgNodeConfigAndEmaKeyOfHVit3) {
    const auto sd = sample_state_dict(5);
    const auto sd_ema = sample_state_dict(6);
    CheckpointWriter w;
    auto& p = w.p;
    p.proto(2);
    p.empty_dict();
    p.put();
    p.mark();
    p.str("model");
    p.put();
    w.state_dict(sd);
    p.str("config");
    p.put();
    // CfgNode is a dict subclass: GLOBAL, args, NEWOBJ; items via SETITEMS; then BUILD __dict__.
    p.global("yacs.config", "CfgNode");
    const int cfg_class = p.put();
    p.empty_tuple();
    p.newobj();
    p.put();
    p.mark();
    p.str("MODEL");
    p.put();
    {  // nested node built through REDUCE (copyreg-style) to cover both creation paths
        p.get(cfg_class);
        p.empty_tuple();
        p.reduce();
        p.put();
        p.mark();
        p.str("TYPE");
        p.put();
        p.str("h_vittt");
        p.put();
        p.str("DROP_PATH_RATE");
        p.put();
        p.real(0.1);
        p.setitems();
        p.empty_dict();
        p.put();
        p.str("__immutable__");
        p.put();
        p.boolean(true);
        p.setitem();
        p.build();
    }
    p.str("DATA");
    p.put();
    p.get(cfg_class);
    p.empty_tuple();
    p.newobj();
    p.put();
    p.str("IMG_SIZE");
    p.put();
    p.integer(224);
    p.setitem();
    p.setitems();
    p.empty_dict();
    p.put();
    p.mark();
    p.str("__immutable__");
    p.put();
    p.boolean(true);
    p.str("__deprecated_keys__");
    p.put();
    p.global("builtins", "set");
    p.put();
    p.empty_list();
    p.put();
    p.tuple_n(1);
    p.put();
    p.reduce();
    p.put();
    p.setitems();
    p.build();
    p.str("state_dict_ema");
    p.put();
    w.state_dict(sd_ema);
    p.str("max_accuracy");
    p.put();
    p.real(84.0);
    p.setitems();
    p.stop();
    const std::string path = temp_path("hvit3.pth");
    w.save(path, /*with_byteorder=*/false);  // torch < 2.0 wrote no byteorder record

    const auto contents = linvis::io::read_torch_checkpoint(path);
    // LibTorch 1.13's writer adds no byteorder record; 2.x adds "little" itself
    EXPECT_TRUE(contents.byteorder.empty() || contents.byteorder == "little") << contents.byteorder;
    const Value* cfg = contents.root->find("config");
    ASSERT_NE(cfg, nullptr);
    EXPECT_EQ(cfg->kind, Value::Kind::Object);
    EXPECT_EQ(cfg->class_name, "yacs.config.CfgNode");
    EXPECT_TRUE(cfg->is_dict_like());
    ASSERT_NE(cfg->find("MODEL"), nullptr);
    EXPECT_EQ(cfg->find("MODEL")->class_name, "yacs.config.CfgNode");
    EXPECT_EQ(cfg->find("MODEL")->find("TYPE")->text, "h_vittt");
    EXPECT_EQ(cfg->find("MODEL")->find("DROP_PATH_RATE")->real, 0.1);
    EXPECT_EQ(cfg->attribute("DATA")->find("IMG_SIZE")->integer, 224);
    EXPECT_TRUE(cfg->attribute("__immutable__")->boolean);
    EXPECT_EQ(cfg->attribute("__deprecated_keys__")->kind, Value::Kind::Set);
    EXPECT_NE(linvis::io::dump(*cfg).find("h_vittt"), std::string::npos);

    std::string key;
    linvis::io::StateDictReport report;
    expect_state_dict(linvis::io::extract_state_dict(contents, false, &key, &report), sd);
    EXPECT_EQ(key, "model");
    EXPECT_EQ(report.dropped[0], "config: object yacs.config.CfgNode (2 items)");
    expect_state_dict(linvis::io::extract_state_dict(contents, true, &key, nullptr), sd_ema);
    EXPECT_EQ(key, "state_dict_ema");
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, ViLRawFileUnderStateDictKeyWithParameters) {
    // ksuit checkpoint_writer: {'state_dict', 'ctor_kwargs', 'ckpt', 'abs_ckpt', 'stage_id'}
    torch::manual_seed(7);
    const torch::Tensor skip = torch::randn({8});
    const torch::Tensor up = torch::randn({16, 4});
    CheckpointWriter w;
    auto& p = w.p;
    p.proto(2);
    p.empty_dict();
    p.put();
    p.mark();
    p.str("state_dict");
    p.put();
    p.global("collections", "OrderedDict");
    p.put();
    p.empty_tuple();
    p.reduce();
    p.put();
    p.mark();
    p.str("xlstm.blocks.0.xlstm.learnable_skip");
    p.put();
    w.tensor(skip, /*as_parameter=*/true);
    p.str("xlstm.blocks.0.xlstm.proj_up.weight");
    p.put();
    w.tensor(up, /*as_parameter=*/true);
    p.setitems();
    p.str("ctor_kwargs");
    p.put();
    p.empty_dict();
    p.put();
    p.mark();
    p.str("dim");
    p.put();
    p.integer(192);
    p.str("patch_size");
    p.put();
    p.integer(16);
    p.setitems();
    p.str("stage_id");
    p.put();
    p.str("abc123");
    p.put();
    p.setitems();
    p.stop();
    const std::string path = temp_path("vil.th");
    w.save(path);
    std::string key;
    const auto got = linvis::io::extract_state_dict(linvis::io::read_torch_checkpoint(path), false, &key);
    EXPECT_EQ(key, "state_dict");
    ASSERT_EQ(got.size(), 2u);
    EXPECT_TRUE(same_tensor(got.at("xlstm.blocks.0.xlstm.learnable_skip"), skip));
    EXPECT_TRUE(same_tensor(got.at("xlstm.blocks.0.xlstm.proj_up.weight"), up));
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, HalfBFloat16IntAndBoolStoragesKeepTheirDtype) {
    torch::manual_seed(8);
    const std::vector<std::pair<std::string, torch::Tensor>> sd = {
        {"half", torch::randn({3, 5}).to(torch::kFloat16)},
        {"bf16", torch::randn({2, 7}).to(torch::kBFloat16)},
        {"i64", torch::randint(-(int64_t{1} << 40), int64_t{1} << 40, {6}, torch::kInt64)},
        {"i32", torch::randint(-1000, 1000, {2, 2}, torch::kInt32)},
        {"u8", torch::randint(0, 255, {9}, torch::kUInt8)},
        {"mask", torch::rand({4}) > 0.5},
        {"f64", torch::randn({3}, torch::kFloat64)},
        {"empty", torch::zeros({0, 4})}};
    CheckpointWriter w;
    w.p.proto(2);
    w.state_dict(sd);
    w.p.stop();
    const std::string path = temp_path("dtypes.pth");
    w.save(path);
    expect_state_dict(linvis::io::extract_state_dict(linvis::io::read_torch_checkpoint(path), false, nullptr), sd);
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, NonContiguousViewSharesItsStorage) {
    torch::manual_seed(9);
    const torch::Tensor base = torch::randn({4, 6});
    CheckpointWriter w;
    auto& p = w.p;
    p.proto(2);
    p.empty_dict();
    p.put();
    p.mark();
    const std::string key = w.add_storage(base);
    p.str("full");
    p.put();
    w.tensor_view(key, 0, {4, 6}, {6, 1});
    p.str("view");  // base.t()[2:5, 1:3]: offset 1*6+2, size (3, 2), stride (1, 6)
    p.put();
    w.tensor_view(key, 8, {3, 2}, {1, 6});
    p.setitems();
    p.stop();
    const std::string path = temp_path("view.pth");
    w.save(path);
    const auto contents = linvis::io::read_torch_checkpoint(path);
    EXPECT_EQ(contents.num_storages, 1);
    const auto got = linvis::io::extract_state_dict(contents, false, nullptr);
    const torch::Tensor expected_view = base.t().slice(0, 2, 5).slice(1, 1, 3);
    EXPECT_TRUE(same_tensor(got.at("full"), base));
    EXPECT_TRUE(same_tensor(got.at("view"), expected_view));
    EXPECT_FALSE(got.at("view").is_contiguous());
    EXPECT_EQ(got.at("view").strides().vec(), (std::vector<int64_t>{1, 6}));
    EXPECT_EQ(got.at("view").storage_offset(), 8);
    // one storage in memory, as torch.load gives
    EXPECT_EQ(static_cast<const char*>(got.at("view").data_ptr()),
              static_cast<const char*>(got.at("full").data_ptr()) + 8 * sizeof(float));
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, MemoizedObjectsAreSharedAndProtocol4OpcodesWork) {
    torch::manual_seed(10);
    const torch::Tensor tied = torch::randn({3, 2});
    CheckpointWriter w;
    auto& p = w.p;
    // protocol 4 with a FRAME, SHORT_BINUNICODE, MEMOIZE and STACK_GLOBAL
    p.proto(4);
    p.frame(0);  // a length hint the reader only checks against the remaining bytes
    p.empty_dict();
    p.memoize();
    p.mark();
    p.str("embed.weight", true);
    p.memoize();
    p.stack_global("torch._utils", "_rebuild_tensor_v2");
    const int rebuild = p.memoize();
    const std::string key = w.add_storage(tied);
    p.mark();
    p.mark();
    p.str("storage", true);
    p.memoize();
    p.stack_global("torch", "FloatStorage");
    p.memoize();
    p.str(key, true);
    p.memoize();
    p.str("cpu", true);
    p.memoize();
    p.integer(6);
    p.tuple();
    p.memoize();
    p.binpersid();
    p.integer(0);
    p.integer(3);
    p.integer(2);
    p.tuple_n(2);
    p.memoize();
    p.integer(2);
    p.integer(1);
    p.tuple_n(2);
    p.memoize();
    p.boolean(false);
    p.stack_global("collections", "OrderedDict");
    p.memoize();
    p.empty_tuple();
    p.reduce();
    p.memoize();
    p.tuple();
    p.memoize();
    p.reduce();
    const int tensor_memo = p.memoize();
    p.str("head.weight", true);
    p.memoize();
    p.get(tensor_memo);  // tied weights: the same tensor object pickled once
    p.str("meta", true);
    p.memoize();
    p.empty_list();
    const int list_memo = p.memoize();
    p.str("meta_again", true);
    p.memoize();
    p.get(list_memo);
    p.str("huge", true);
    p.memoize();
    p.integer(int64_t{1} << 62);
    p.str("negative", true);
    p.memoize();
    p.integer(-5);
    p.setitems();
    // mutate the memoized list after it was referenced twice: both references see it
    p.get(list_memo);
    p.integer(42);
    p.append();
    p.op('0');  // POP
    p.skip_memo(300);  // next memo index > 255: LONG_BINPUT / LONG_BINGET
    p.str("unused");
    const int long_memo = p.put();
    p.op('0');
    p.get(long_memo);
    p.op('0');
    p.stop();
    (void)rebuild;
    const std::string path = temp_path("memo.pth");
    w.save(path);
    const auto contents = linvis::io::read_torch_checkpoint(path);
    const Value& root = *contents.root;
    ASSERT_EQ(root.entries.size(), 6u);
    // the same node twice, and tensors sharing memory
    EXPECT_EQ(root.entries[0].second.get(), root.entries[1].second.get());
    EXPECT_TRUE(same_tensor(root.find("head.weight")->tensor, tied));
    EXPECT_EQ(root.find("meta"), root.find("meta_again"));
    ASSERT_EQ(root.find("meta")->items.size(), 1u);
    EXPECT_EQ(root.find("meta")->items[0]->integer, 42);
    EXPECT_EQ(root.find("huge")->integer, int64_t{1} << 62);
    EXPECT_EQ(root.find("negative")->integer, -5);
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, ReadsLibTorchPickleSaveOutputLikePickleLoad) {
    torch::manual_seed(11);
    c10::Dict<std::string, torch::Tensor> dict;
    dict.insert("a.weight", torch::randn({3, 4}));
    dict.insert("a.bias", torch::randn({3}, torch::kFloat64));
    dict.insert("steps", torch::tensor(int64_t{7}));
    dict.insert("h", torch::randn({2, 2}).to(torch::kFloat16));
    const std::vector<char> bytes = torch::pickle_save(dict);
    ASSERT_GE(bytes.size(), 4u);
    ASSERT_EQ(std::string(bytes.data(), 2), "PK") << "pickle_save did not produce the zip format";
    const std::string path = temp_path("pickle_save.pt");
    {
        std::ofstream out(path, std::ios::binary);
        out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    const auto reference = torch::pickle_load(bytes).toGenericDict();
    const auto got = linvis::io::extract_state_dict(linvis::io::read_torch_checkpoint(path), false, nullptr);
    ASSERT_EQ(got.size(), reference.size());
    for (const auto& item : reference) {
        const std::string name = item.key().toStringRef();
        ASSERT_TRUE(got.count(name)) << name;
        EXPECT_TRUE(same_tensor(got.at(name), item.value().toTensor())) << name;
        EXPECT_TRUE(same_tensor(got.at(name), dict.at(name))) << name;
    }
    std::remove(path.c_str());
}

// ------------------------------------------------------------------ malformed input

namespace {
std::string write_pickle_only(const std::string& name, const std::string& pickle) {
    CheckpointWriter w;
    w.p.raw(pickle);
    const std::string path = temp_path(name);
    w.save(path);
    return path;
}
}  // namespace

TEST(TorchCheckpoint, TruncatedPickleIsAnError) {
    CheckpointWriter w;
    w.p.proto(2);
    w.state_dict(sample_state_dict(12));
    w.p.stop();
    // cut inside a BINUNICODE payload, and just before STOP
    const std::string cut_mid = write_pickle_only("trunc1.pth", w.p.bytes.substr(0, 40));
    CheckpointWriter no_stop = w;  // all storages present, only the final STOP is missing
    no_stop.p.bytes.pop_back();
    const std::string cut_end = temp_path("trunc2.pth");
    no_stop.save(cut_end);
    std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(cut_mid); });
    EXPECT_NE(msg.find(cut_mid), std::string::npos) << msg;
    EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
    msg = expect_error([&] { linvis::io::read_torch_checkpoint(cut_end); });
    EXPECT_NE(msg.find("without a STOP"), std::string::npos) << msg;
    std::remove(cut_mid.c_str());
    std::remove(cut_end.c_str());
}

TEST(TorchCheckpoint, UnknownOpcodeIsAnErrorWithItsOffset) {
    linvis::testing::PickleWriter p;
    p.proto(2).empty_dict().op(0xff).stop();
    const std::string path = write_pickle_only("opcode.pth", p.bytes);
    const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
    EXPECT_NE(msg.find("unknown pickle opcode 0xff"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offset 3"), std::string::npos) << msg;
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, MissingStorageRecordIsAnError) {
    CheckpointWriter w;
    w.p.proto(2);
    w.state_dict(sample_state_dict(13));
    w.p.stop();
    const std::string path = temp_path("nostorage.pth");
    w.save(path, true, /*skip_storage=*/"2");
    const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
    EXPECT_NE(msg.find("missing storage record 'data/2'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, UnknownMemoIndexIsAnError) {
    linvis::testing::PickleWriter p;
    p.proto(2).empty_dict();
    p.put();
    p.get(7).stop();
    const std::string path = write_pickle_only("memo_bad.pth", p.bytes);
    const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
    EXPECT_NE(msg.find("BINGET"), std::string::npos) << msg;
    EXPECT_NE(msg.find("memo index 7 is not defined"), std::string::npos) << msg;
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, StackUnderflowHugeLengthsAndBadViewsAreErrors) {
    auto error_of = [](const std::string& pickle) {
        return expect_error([&] { linvis::io::unpickle(pickle, [](const std::string&) { return torch::empty({0}, torch::kUInt8); }, "x.pth"); });
    };
    linvis::testing::PickleWriter underflow;
    underflow.proto(2).op('s').stop();  // SETITEM on an empty stack
    EXPECT_NE(error_of(underflow.bytes).find("stack underflow"), std::string::npos);
    linvis::testing::PickleWriter across_mark;  // a pop may not cross a MARK
    across_mark.proto(2).empty_dict().mark().op('0').stop();
    EXPECT_NE(error_of(across_mark.bytes).find("stack underflow"), std::string::npos);
    linvis::testing::PickleWriter huge;  // BINUNICODE8 claiming 2^60 bytes must not allocate
    huge.proto(4).op(0x8d).le(uint64_t{1} << 60, 8).raw("abc").stop();
    EXPECT_NE(error_of(huge.bytes).find("needs 1152921504606846976 bytes"), std::string::npos);
    linvis::testing::PickleWriter no_mark;
    no_mark.proto(2).empty_list().op('e').stop();
    EXPECT_NE(error_of(no_mark.bytes).find("no MARK"), std::string::npos);

    // a view reaching past the end of its storage
    CheckpointWriter w;
    w.p.proto(2);
    const std::string key = w.add_storage(torch::zeros({6}));
    w.tensor_view(key, 2, {2, 3}, {3, 1});
    w.p.stop();
    const std::string path = temp_path("bad_view.pth");
    w.save(path);
    const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
    EXPECT_NE(msg.find("reaches element 7 but storage 0 holds only 6"), std::string::npos) << msg;
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, NotAZipNorLegacyAndMissingFileAreErrors) {
    const std::string text = temp_path("text.pth");
    std::ofstream(text) << "hello";
    EXPECT_NE(expect_error([&] { linvis::io::read_torch_checkpoint(text); }).find("not a zip archive"),
              std::string::npos);
    const std::string legacy = temp_path("legacy.pth");  // the legacy magic pickle, cut short
    std::ofstream(legacy, std::ios::binary) << std::string("\x80\x02\x8a\x0a", 4);
    EXPECT_NE(expect_error([&] { linvis::io::read_torch_checkpoint(legacy); }).find("legacy (pre-1.6)"),
              std::string::npos);
    const std::string other_int = temp_path("int.pth");  // a pickle, but not the magic number
    std::ofstream(other_int, std::ios::binary) << std::string("\x80\x02K\x07.", 5);
    const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(other_int); });
    EXPECT_NE(msg.find("expected the magic number 0x1950a86a20f9469cfc6c"), std::string::npos) << msg;
    EXPECT_NE(msg.find("int 7"), std::string::npos) << msg;
    const std::string broken = temp_path("broken.pth");
    std::ofstream(broken, std::ios::binary) << std::string("PK\x03\x04garbage", 11);
    EXPECT_NE(expect_error([&] { linvis::io::read_torch_checkpoint(broken); }).find("cannot read the zip archive"),
              std::string::npos);
    EXPECT_NE(expect_error([&] { linvis::io::read_torch_checkpoint(temp_path("absent.pth")); }).find("cannot open"),
              std::string::npos);
    std::remove(text.c_str());
    std::remove(legacy.c_str());
    std::remove(other_int.c_str());
    std::remove(broken.c_str());
}

namespace {
std::string legacy_fixture() { return std::string(LINVIS_TEST_DATA_DIR) + "/torch_checkpoints/legacy.pt"; }

std::string read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
}  // namespace

// tests/data/torch_checkpoints/legacy.pt is written by make_legacy.py (CPython's pickler, the
// layout of torch.save(..., _use_new_zipfile_serialization=False)); its values are re-created here.
TEST(TorchCheckpoint, LegacyFormatReadsTensorsViewsAndConfig) {
    const auto contents = linvis::io::read_torch_checkpoint(legacy_fixture());
    EXPECT_EQ(contents.format_version, 1001);
    EXPECT_EQ(contents.byteorder, "little");
    EXPECT_EQ(contents.num_storages, 5);
    EXPECT_TRUE(contents.records.empty());
    const Value& root = *contents.root;
    ASSERT_TRUE(root.is_dict_like());
    ASSERT_NE(root.find("epoch"), nullptr);
    EXPECT_EQ(root.find("epoch")->integer, 7);
    const Value* args = root.find("args");
    ASSERT_NE(args, nullptr);
    EXPECT_EQ(args->class_name, "argparse.Namespace");
    ASSERT_NE(args->attribute("model"), nullptr);
    EXPECT_EQ(args->attribute("model")->text, "deit_tiny");

    std::string chosen;
    const auto sd = linvis::io::extract_state_dict(contents, false, &chosen);
    EXPECT_EQ(chosen, "model");
    ASSERT_EQ(sd.size(), 6u);
    auto ramp = [](int64_t n, double step, double start, torch::ScalarType dtype) {
        return (torch::arange(n, torch::kFloat64) * step + start).to(dtype);
    };
    EXPECT_TRUE(same_tensor(sd.at("a.weight"), ramp(6, 0.5, -3, torch::kFloat32).view({2, 3})));
    EXPECT_TRUE(same_tensor(sd.at("a.bias"), ramp(3, 0.5, -2, torch::kFloat64)));
    EXPECT_TRUE(same_tensor(sd.at("half"), ramp(4, 0.25, -1, torch::kFloat16)));
    EXPECT_TRUE(same_tensor(sd.at("steps"), torch::tensor(int64_t{1234})));
    // the transpose shares a.weight's storage, like torch.load
    EXPECT_TRUE(same_tensor(sd.at("a_t"), sd.at("a.weight").t()));
    EXPECT_EQ(sd.at("a_t").data_ptr(), sd.at("a.weight").data_ptr());
    EXPECT_EQ(sd.at("a_t").strides(), (std::vector<int64_t>{1, 3}));
    // a tensor on a storage view: elements 4..5 of a 6-element root storage
    EXPECT_TRUE(same_tensor(sd.at("tail"), torch::tensor({0.0f, 0.5f})));
}

TEST(TorchCheckpoint, LegacyFormatEveryTruncationOrCorruptCountIsAnError) {
    const std::string good = read_bytes(legacy_fixture());
    ASSERT_GT(good.size(), 900u);
    const std::string path = temp_path("legacy_cut.pt");
    // Every proper prefix (including cuts inside the storage bytes after the pickles) is refused:
    // nothing is returned half-read.
    for (size_t cut = 1; cut < good.size(); cut += (cut < 880 ? 7 : 1)) {
        std::ofstream(path, std::ios::binary | std::ios::trunc) << good.substr(0, cut);
        const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
        EXPECT_NE(msg.find(path), std::string::npos) << "cut " << cut << ": " << msg;
    }
    // An element count that disagrees with the object pickle's numel.
    const size_t count_at = good.size() - 8 * 5 - (6 * 4 + 3 * 8 + 4 * 2 + 8 + 6 * 4);
    std::string bad = good;
    ASSERT_EQ(bad[count_at], '\x06');  // storage 0: 6 float32 elements
    bad[count_at] = '\x05';
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
    EXPECT_NE(msg.find("storage '0' holds 5 elements, the object pickle says 6"), std::string::npos) << msg;
    std::remove(path.c_str());
}

// A pickle that names a global outside the allow-list is refused, naming the global, in the zip
// format and the legacy one, however the global is named (GLOBAL, STACK_GLOBAL, INST), even when
// the rest of the file is a valid checkpoint.
TEST(TorchCheckpoint, GlobalOutsideTheAllowListIsRefusedNamingIt) {
    struct Case {
        std::string module, name;
        char how;  // 'c' GLOBAL, 's' STACK_GLOBAL, 'i' INST
    };
    const std::vector<Case> cases = {{"posix", "system", 'c'},          {"os", "system", 's'},
                                     {"builtins", "eval", 'c'},         {"subprocess", "Popen", 'i'},
                                     {"__main__", "Exploit", 's'},      {"torch", "load", 'c'},
                                     {"torch._utils", "_rebuild_evil", 'c'}};
    for (const auto& c : cases) {
        CheckpointWriter w;
        auto& p = w.p;
        p.proto(2);
        p.empty_dict();
        p.mark();
        p.str("model");
        w.state_dict(sample_state_dict(21));  // valid weights first: refusal must not return them
        p.str("payload");
        if (c.how == 'c') {
            p.global(c.module, c.name).str("echo pwned").tuple_n(1).reduce();
        } else if (c.how == 's') {
            p.stack_global(c.module, c.name).str("echo pwned").tuple_n(1).reduce();
        } else {
            p.mark().str("echo pwned").op('i').raw(c.module + "\n" + c.name + "\n");
        }
        p.setitems();
        p.stop();
        const std::string path = temp_path("evil.pth");
        w.save(path);
        const std::string full = c.module + "." + c.name;
        std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
        EXPECT_NE(msg.find("refusing global '" + full + "'"), std::string::npos) << msg;
        EXPECT_NE(msg.find(path), std::string::npos) << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
        EXPECT_FALSE(linvis::io::pickle_global_allowed(c.module, c.name)) << full;
        std::remove(path.c_str());
    }
    // Legacy format: the object pickle of legacy.pt with its argparse.Namespace renamed to posix.system
    // (same length, so the rest of the file stays valid).
    std::string legacy = read_bytes(legacy_fixture());
    const std::string from = "argparse\nNamespace\n", to = "posixxxx\nsystem___\n";
    const size_t at = legacy.find(from);
    ASSERT_NE(at, std::string::npos);
    legacy.replace(at, from.size(), to);
    const std::string path = temp_path("evil_legacy.pt");
    std::ofstream(path, std::ios::binary) << legacy;
    const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
    EXPECT_NE(msg.find("refusing global 'posixxxx.system___'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("legacy object pickle"), std::string::npos) << msg;
    std::remove(path.c_str());
    // What official checkpoints name stays allowed.
    for (const auto& [m, n] : std::vector<std::pair<std::string, std::string>>{
             {"torch._utils", "_rebuild_tensor_v2"}, {"torch", "FloatStorage"}, {"torch.cuda", "HalfStorage"},
             {"torch", "bfloat16"}, {"collections", "OrderedDict"}, {"argparse", "Namespace"},
             {"yacs.config", "CfgNode"}, {"numpy.core.multiarray", "scalar"}, {"_codecs", "encode"}})
        EXPECT_TRUE(linvis::io::pickle_global_allowed(m, n)) << m << "." << n;
}

// Found by fuzz_pth: a zip record whose central-directory entry declares 4 GB made LibTorch's
// reader allocate 4 GB before reading it. Declared sizes are now checked against the file first.
TEST(TorchCheckpoint, ZipRecordDeclaringMoreThanTheFileCanHoldIsRefused) {
    CheckpointWriter w;
    w.p.proto(2);
    w.state_dict(sample_state_dict(22));
    w.p.stop();
    const std::string path = temp_path("huge_record.pth");
    w.save(path);
    std::string bytes = read_bytes(path);
    // the central-directory entry of data.pkl: signature PK\1\2, uncompressed size at +24
    size_t at = std::string::npos;
    for (size_t i = bytes.find("PK\x01\x02"); i != std::string::npos; i = bytes.find("PK\x01\x02", i + 4)) {
        const size_t name_len = static_cast<uint8_t>(bytes[i + 28]) | (static_cast<uint8_t>(bytes[i + 29]) << 8);
        const std::string name = bytes.substr(i + 46, name_len);
        if (name.size() >= 8 && name.compare(name.size() - 8, 8, "data.pkl") == 0) at = i;
    }
    ASSERT_NE(at, std::string::npos);
    bytes.replace(at + 24, 4, std::string("\x00\x00\x00\xf0", 4));  // 0xf0000000 = 4026531840 bytes
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    const std::string msg = expect_error([&] { linvis::io::read_torch_checkpoint(path); });
    EXPECT_NE(msg.find("data.pkl' declares 4026531840 bytes, impossible in a file of"), std::string::npos) << msg;
    std::remove(path.c_str());
}

TEST(TorchCheckpoint, CorruptedPicklesNeverCrash) {
    // Every single-byte corruption and every truncation of a real data.pkl either parses or
    // throws linvis::Error; nothing else escapes.
    CheckpointWriter w;
    w.p.proto(2);
    w.state_dict(sample_state_dict(14));
    w.p.stop();
    const std::string good = w.p.bytes;
    std::map<std::string, torch::Tensor> storages;
    for (int i = 0; i < 5; ++i) storages[std::to_string(i)] = torch::zeros({400}, torch::kUInt8);
    auto loader = [&](const std::string& key) {
        auto it = storages.find(key);
        LINVIS_CHECK(it != storages.end(), "missing storage ", key);
        return it->second;
    };
    std::mt19937 rng(1234);
    int errors = 0, parsed = 0;
    auto attempt = [&](const std::string& bytes) {
        try {
            linvis::io::unpickle(bytes, loader, "fuzz");
            ++parsed;
        } catch (const Error&) {
            ++errors;
        } catch (const std::exception& e) {
            ADD_FAILURE() << "non-linvis exception: " << e.what();
        }
    };
    for (size_t cut = 0; cut < good.size(); ++cut) attempt(good.substr(0, cut));
    for (size_t i = 0; i < good.size(); ++i)
        for (int trial = 0; trial < 3; ++trial) {
            std::string bad = good;
            bad[i] = static_cast<char>(rng() & 0xff);
            attempt(bad);
        }
    EXPECT_EQ(errors + parsed, static_cast<int>(good.size() * 4));
    EXPECT_GE(errors, static_cast<int>(good.size()));  // at least every truncation fails
}

// BUILD merges a dict state into the target's (dict.update): keys equal by value (scalars) or by node (memo
// references) overwrite. A dict merged into itself stays as it is; before, float keys were never matched and
// each merge doubled the dict (a 3 KB fuzz input reached 2^28 entries).
TEST(TorchCheckpoint, BuildMergingDictStatesKeepsOneEntryPerKey) {
    const auto float_key = [](double v) {
        std::string bytes = "G";  // BINFLOAT, big-endian IEEE 754
        uint64_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        for (int i = 7; i >= 0; --i) bytes.push_back(char((bits >> (8 * i)) & 0xff));
        return bytes;
    };
    std::string pickle = "\x80\x02}";                              // the target: {}
    pickle += "}" + float_key(1.5) + "K\x01s";                     // state D = {1.5: 1}
    pickle += float_key(-0.0) + "K\x02s" + float_key(0.0) + "K\x03s";  // -0.0 and 0.0: one key, last value wins
    pickle += float_key(std::nan("")) + "K\x04s" + float_key(std::nan("")) + "K\x05s";  // two NaN nodes: two keys
    pickle += std::string("q\x00", 2) + "b";                       // memo D; target.state = D
    for (int i = 0; i < 3; ++i) pickle += std::string("h\x00", 2) + "b";  // D merged into itself 3 times
    pickle += "}" + float_key(1.5) + "K\x07sb.";                   // a new dict {1.5: 7} merged in
    const auto root = linvis::io::unpickle(pickle, [](const std::string&) { return torch::Tensor(); }, "merge.pkl");
    ASSERT_TRUE(root->state);
    const auto& entries = root->state->entries;
    ASSERT_EQ(entries.size(), 4u);
    EXPECT_EQ(entries[0].first->real, 1.5);
    EXPECT_EQ(entries[0].second->integer, 7);
    EXPECT_EQ(entries[1].second->integer, 3);
    EXPECT_TRUE(std::isnan(entries[2].first->real) && std::isnan(entries[3].first->real));
}

TEST(TorchCheckpoint, DeeplyNestedPickleDoesNotOverflowTheStack) {
    // 300k nested lists (each appended into the one before): parsing, describing and freeing
    // the tree must not recurse per level.
    const int depth = 300000;
    linvis::testing::PickleWriter p;
    p.proto(2);
    for (int i = 0; i < depth; ++i) p.empty_list();
    for (int i = 1; i < depth; ++i) p.append();
    p.stop();
    auto root = linvis::io::unpickle(p.bytes, [](const std::string&) { return torch::Tensor(); }, "deep");
    int levels = 1;
    for (const Value* v = root.get(); !v->items.empty(); v = v->items[0].get()) ++levels;
    EXPECT_EQ(levels, depth);
    EXPECT_EQ(linvis::io::describe(*root), "list(1)");
    EXPECT_FALSE(linvis::io::dump(*root).empty());
    root.reset();
}

TEST(TorchCheckpoint, NoStateDictOrNoEmaIsAnErrorListingTheKeys) {
    CheckpointWriter w;
    auto& p = w.p;
    p.proto(2);
    p.empty_dict();
    p.put();
    p.mark();
    p.str("weights_v2");
    p.put();
    w.state_dict(sample_state_dict(15));
    p.str("epoch");
    p.put();
    p.integer(3);
    p.setitems();
    p.stop();
    const std::string path = temp_path("nokey.pth");
    w.save(path);
    const auto contents = linvis::io::read_torch_checkpoint(path);
    std::string msg = expect_error([&] { linvis::io::extract_state_dict(contents, false, nullptr); });
    EXPECT_NE(msg.find("weights_v2 (collections.OrderedDict(5))"), std::string::npos) << msg;
    EXPECT_NE(msg.find("epoch (int 3)"), std::string::npos) << msg;
    msg = expect_error([&] { linvis::io::extract_state_dict(contents, true, nullptr); });
    EXPECT_NE(msg.find("no EMA state dict"), std::string::npos) << msg;
    std::remove(path.c_str());
}

// ------------------------------------------------------------------ mapping onto a model

namespace {
// A tiny model with a raw->model key mapping like ViL's (head.1 -> head, legacy buffers dropped)
// and a resolution-dependent position embedding.
class TinyModel : public linvis::models::VisionModel {
public:
    TinyModel() {
        proj = register_module("proj", std::make_shared<torch::nn::Module>())
                   ->register_parameter("weight", torch::zeros({4, 3}));
        pos = register_parameter("pos_embed", torch::zeros({1, 9, 4}));
        head = register_module("head", std::make_shared<torch::nn::Module>())
                   ->register_parameter("weight", torch::zeros({2, 4}));
        count = register_module("norm", std::make_shared<torch::nn::Module>())
                    ->register_buffer("num_batches_tracked", torch::zeros({}, torch::kInt64));
    }
    torch::Tensor forward_features(const torch::Tensor& x) override { return x; }
    torch::Tensor forward_head(const torch::Tensor& x, bool) override { return x; }
    std::vector<torch::Tensor> forward_intermediates(const torch::Tensor&, const std::vector<int64_t>&) override {
        return {};
    }
    int64_t num_classes() const override { return 2; }
    int64_t num_features() const override { return 4; }
    std::string map_checkpoint_key(const std::string& key) const override {
        if (key.find("causal_mask") != std::string::npos) return "";
        if (key.rfind("head.1.", 0) == 0) return "head." + key.substr(7);
        return key;
    }
    torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const override {
        if (key != "pos_embed" || value.size(1) == 9) return value;
        // nearest resize of a square grid to 3x3 (stand-in for the bicubic resize)
        const int64_t side = static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(value.size(1)))));
        auto grid = value.reshape({1, side, side, 4}).permute({0, 3, 1, 2});
        auto resized = torch::nn::functional::interpolate(
            grid, torch::nn::functional::InterpolateFuncOptions().size(std::vector<int64_t>{3, 3}).mode(torch::kNearest));
        return resized.permute({0, 2, 3, 1}).reshape({1, 9, 4});
    }
    torch::Tensor proj, pos, head, count;
};
}  // namespace

TEST(TorchCheckpoint, MapsRawKeysOntoAModelAndChecksShapes) {
    TinyModel model;
    torch::manual_seed(16);
    std::map<std::string, torch::Tensor> raw = {{"proj.weight", torch::randn({4, 3})},
                                                {"pos_embed", torch::randn({1, 16, 4})},
                                                {"head.1.weight", torch::randn({2, 4})},
                                                {"blocks.0.causal_mask", torch::ones({4, 4})},
                                                {"norm.num_batches_tracked", torch::tensor(int64_t{9})}};
    linvis::models::ModelMappingReport report;
    const auto out = linvis::models::map_state_dict_to_model(raw, model, true, &report);
    EXPECT_TRUE(report.complete());
    ASSERT_EQ(out.size(), 4u);
    EXPECT_TRUE(same_tensor(out.at("head.weight"), raw.at("head.1.weight")));
    EXPECT_TRUE(same_tensor(out.at("norm.num_batches_tracked"), raw.at("norm.num_batches_tracked")));
    EXPECT_EQ(out.at("pos_embed").sizes().vec(), (std::vector<int64_t>{1, 9, 4}));
    ASSERT_EQ(report.renamed.size(), 1u);
    EXPECT_EQ(report.renamed[0], (std::pair<std::string, std::string>{"head.1.weight", "head.weight"}));
    EXPECT_EQ(report.dropped, (std::vector<std::string>{"blocks.0.causal_mask"}));
    EXPECT_EQ(report.adapted, (std::vector<std::string>{"pos_embed: [1, 16, 4] -> [1, 9, 4]"}));

    // missing, unexpected and mismatched keys: strict refuses naming each, non-strict keeps the rest
    std::map<std::string, torch::Tensor> bad = {{"proj.weight", torch::randn({4, 5})},
                                                {"head.1.weight", torch::randn({2, 4})},
                                                {"extra.bias", torch::randn({3})}};
    const std::string msg = expect_error([&] { linvis::models::map_state_dict_to_model(bad, model, true); });
    EXPECT_NE(msg.find("missing keys (2): norm.num_batches_tracked, pos_embed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected keys (1): extra.bias"), std::string::npos) << msg;
    EXPECT_NE(msg.find("proj.weight: checkpoint [4, 5] vs model [4, 3]"), std::string::npos) << msg;
    const auto partial = linvis::models::map_state_dict_to_model(bad, model, false, &report);
    ASSERT_EQ(partial.size(), 1u);
    EXPECT_TRUE(partial.count("head.weight"));
    EXPECT_FALSE(report.complete());

    // two raw keys landing on one model key
    std::map<std::string, torch::Tensor> twice = {{"head.1.weight", torch::randn({2, 4})},
                                                  {"head.weight", torch::randn({2, 4})}};
    EXPECT_NE(expect_error([&] { linvis::models::map_state_dict_to_model(twice, model, false); }).find("both map to"),
              std::string::npos);
}

// ------------------------------------------------------------------ files pickled by CPython

namespace {
std::string data_file(const std::string& name) {
    return std::string(LINVIS_TEST_DATA_DIR) + "/torch_checkpoints/" + name;
}
// Storage formulas of tests/data/torch_checkpoints/make_checkpoints.py.
torch::Tensor formula(int64_t n, double step, double start, torch::ScalarType dtype) {
    return (torch::arange(n, torch::kFloat64) * step + start).to(dtype);
}
}  // namespace

TEST(TorchCheckpoint, CPythonPickledVit3CheckpointWithCfgNodeAndNumpyScalar) {
    // Protocol 2 stream from CPython's pickler with stand-ins that reduce like torch tensors,
    // parameters, storages, yacs CfgNode and numpy scalars (see make_checkpoints.py).
    const std::string path = data_file("vit3_style.pth");
    const auto contents = linvis::io::read_torch_checkpoint(path);
    EXPECT_EQ(contents.format_version, 3);
    EXPECT_EQ(contents.byteorder, "little");
    EXPECT_EQ(contents.num_storages, 7);
    EXPECT_EQ(std::count(contents.records.begin(), contents.records.end(), "data.pkl"), 1);
    EXPECT_EQ(std::count(contents.records.begin(), contents.records.end(), "data/6"), 1);
    const Value& root = *contents.root;

    std::string key;
    linvis::io::StateDictReport report;
    const auto sd = linvis::io::extract_state_dict(contents, false, &key, &report);
    EXPECT_EQ(key, "model");
    ASSERT_EQ(sd.size(), 7u);
    const torch::Tensor qkv = formula(24, 0.5, -3, torch::kFloat32).reshape({6, 4});
    EXPECT_TRUE(same_tensor(sd.at("blocks.0.attn.qkv.weight"), qkv));
    EXPECT_TRUE(same_tensor(sd.at("blocks.0.attn.w1"), formula(8, 0.5, -2, torch::kFloat64).reshape({1, 2, 2, 2})));
    EXPECT_TRUE(same_tensor(sd.at("blocks.0.attn.proj.weight"), formula(12, 0.25, -1, torch::kFloat16).reshape({4, 3})));
    EXPECT_TRUE(same_tensor(sd.at("blocks.0.norm1.weight"), formula(5, 0.5, -2, torch::kBFloat16)));
    EXPECT_TRUE(same_tensor(sd.at("patch_embed.norm.num_batches_tracked"), torch::tensor(int64_t{1234})));
    EXPECT_TRUE(same_tensor(sd.at("pos_index"), torch::arange(3, torch::kInt64) + int64_t{10000000000}));
    EXPECT_TRUE(same_tensor(sd.at("qkv_view"), qkv.t().slice(0, 1, 3).slice(1, 2, 5)));
    EXPECT_EQ(sd.at("qkv_view").storage_offset(), 9);
    ASSERT_EQ(report.dropped.size(), 6u);
    EXPECT_EQ(report.dropped[2], "max_accuracy: object numpy.core.multiarray.scalar");
    EXPECT_EQ(report.dropped[5], "config: object yacs.config.CfgNode (3 items)");

    // optimizer: exp_avg and exp_avg_sq are one memoized object
    const Value* s0 = root.find("optimizer")->find("state")->entries.at(0).second.get();
    EXPECT_EQ(s0->find("exp_avg"), s0->find("exp_avg_sq"));
    EXPECT_TRUE(same_tensor(s0->find("exp_avg")->tensor, formula(24, 0.5, -1, torch::kFloat32).reshape({6, 4})));
    EXPECT_EQ(root.find("optimizer")->find("param_groups")->items.at(0)->find("weight_decay")->real, 0.05);
    EXPECT_EQ(root.find("epoch")->integer, 299);
    // numpy.float64(76.5): scalar(dtype('f8') with BUILD state, 8 raw bytes)
    const Value* acc = root.find("max_accuracy");
    ASSERT_EQ(acc->args->items.size(), 2u);
    EXPECT_EQ(acc->args->items[0]->class_name, "numpy.dtype");
    EXPECT_EQ(acc->args->items[0]->args->items.at(0)->text, "f8");
    ASSERT_TRUE(acc->args->items[0]->state);
    ASSERT_EQ(acc->args->items[1]->text.size(), 8u);
    double value = 0;
    std::memcpy(&value, acc->args->items[1]->text.data(), 8);
    EXPECT_EQ(value, 76.5);
    // -84.9 has bytes >= 0x80: protocol 2 stores them as latin-1 text inside _codecs.encode
    const Value* acc_e = root.find("max_accuracy_e");
    ASSERT_EQ(acc_e->args->items.at(1)->text.size(), 8u);
    std::memcpy(&value, acc_e->args->items[1]->text.data(), 8);
    EXPECT_EQ(value, -84.9);
    // yacs config
    const Value* cfg = root.find("config");
    EXPECT_EQ(cfg->find("MODEL")->find("NAME")->text, "vittt_tiny");
    EXPECT_EQ(cfg->find("TRAIN")->find("BASE_LR")->real, 5e-4);
    EXPECT_TRUE(cfg->attribute("__immutable__")->boolean);
    EXPECT_FALSE(cfg->find("DATA")->attribute("__immutable__")->boolean);
}

TEST(TorchCheckpoint, CPythonPickledDit3CheckpointProtocols4And5) {
    for (const char* name : {"dit3_style.pt", "dit3_style_p5.pt"}) {
        SCOPED_TRACE(name);
        const auto contents = linvis::io::read_torch_checkpoint(data_file(name));
        std::string key;
        linvis::io::StateDictReport report;
        const auto sd = linvis::io::extract_state_dict(contents, false, &key, &report);
        EXPECT_EQ(key, "model");
        EXPECT_EQ(report.prefix_stripped, 2);
        EXPECT_TRUE(same_tensor(sd.at("x_embedder.proj.weight"), formula(6, 0.5, 0, torch::kFloat32).reshape({3, 2})));
        EXPECT_TRUE(same_tensor(sd.at("pos_embed"), formula(8, 0.5, 1, torch::kFloat32).reshape({1, 4, 2})));
        const auto ema = linvis::io::extract_state_dict(contents, true, &key, nullptr);
        EXPECT_EQ(key, "ema");
        EXPECT_TRUE(same_tensor(ema.at("pos_embed"), formula(8, 0.5, 3, torch::kFloat32).reshape({1, 4, 2})));
        const Value* args = contents.root->find("args");
        EXPECT_EQ(args->class_name, "argparse.Namespace");
        EXPECT_EQ(args->attribute("model")->text, "DiT-B/2");
        EXPECT_EQ(args->attribute("image_size")->integer, 256);
        EXPECT_EQ(args->attribute("ckpt")->kind, Value::Kind::None);
        EXPECT_TRUE(args->attribute("use_layer_lr")->boolean);
        EXPECT_EQ(args->attribute("lr")->real, 1e-4);
    }
}

TEST(TorchCheckpoint, CliDryRunPrintsTheReport) {
    const std::string command = std::string(LINVIS_CLI_PATH) + " convert-checkpoint " +
                                data_file("vit3_style.pth") + " /nonexistent/out.safetensors --dry-run 2>&1";
    FILE* pipe = popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string output;
    char buffer[256];
    while (fgets(buffer, sizeof buffer, pipe)) output += buffer;
    const int status = pclose(pipe);
    EXPECT_EQ(status, 0) << output;
    EXPECT_NE(output.find("state dict  'model': 7 tensors"), std::string::npos) << output;
    EXPECT_NE(output.find("config: object yacs.config.CfgNode (3 items)"), std::string::npos) << output;
    EXPECT_NE(output.find("dry run: nothing written"), std::string::npos) << output;
}
