// Training loop: the loss falls, resume is bit-exact, checkpoints survive interrupted writes,
// NaN stops training, the optimiser groups and schedule follow the recipe.
#include <csignal>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/io/atomic_file.h"
#include "linvis/models/model.h"
#include "linvis/train/checkpoint.h"
#include "linvis/train/ema.h"
#include "linvis/train/mixup.h"
#include "linvis/train/optim.h"
#include "linvis/train/trainer.h"
#include "support/testing.h"

namespace fs = std::filesystem;
using namespace linvis;

namespace {

// A small conv classifier standing in for a backbone: the trainer only sees VisionModel.
class TinyNet : public models::VisionModel {
public:
    explicit TinyNet(int64_t classes = 4) : classes_(classes) {
        conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)));
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
        head = register_module("head", torch::nn::Linear(8 * 64, classes));  // 8x8 inputs
        dropout = register_module("dropout", torch::nn::Dropout(0.1));
    }
    torch::Tensor forward_features(const torch::Tensor& x) override {
        return norm(torch::relu(conv(x)).flatten(2).transpose(1, 2));
    }
    torch::Tensor forward_head(const torch::Tensor& f, bool pre_logits) override {
        torch::Tensor pooled = dropout(f.flatten(1));  // keeps where things are
        return pre_logits ? pooled : head(pooled);
    }
    std::vector<torch::Tensor> forward_intermediates(const torch::Tensor& x, const std::vector<int64_t>&) override {
        return {forward_features(x)};
    }
    int64_t num_classes() const override { return classes_; }
    int64_t num_features() const override { return 8 * 64; }
    torch::nn::Conv2d conv{nullptr};
    torch::nn::LayerNorm norm{nullptr};
    torch::nn::Linear head{nullptr};
    torch::nn::Dropout dropout{nullptr};

private:
    int64_t classes_;
};

// Four classes that differ in where a bright square sits: learnable in a few steps.
std::pair<torch::Tensor, torch::Tensor> synthetic_data(int64_t n, uint64_t seed) {
    torch::manual_seed(static_cast<uint64_t>(seed));
    torch::Tensor labels = torch::randint(0, 4, {n}, torch::kLong);
    torch::Tensor images = 0.1 * torch::randn({n, 1, 8, 8});
    for (int64_t i = 0; i < n; ++i) {
        const int64_t c = labels[i].item<int64_t>();
        images[i].slice(1, (c / 2) * 4, (c / 2) * 4 + 4).slice(2, (c % 2) * 4, (c % 2) * 4 + 4) += 1.0;
    }
    return {images, labels};
}

train::TrainConfig quiet_config(const std::string& dir, int64_t epochs) {
    train::TrainConfig config;
    config.epochs = epochs;
    config.optimizer.lr = 5e-3;
    config.optimizer.weight_decay = 0.01;
    config.warmup_epochs = 0.5;
    config.min_lr = 1e-4;
    config.mixup.mixup_alpha = 0.2;
    config.mixup.cutmix_alpha = 0.0;
    config.mixup.label_smoothing = 0.1;
    config.ema_decay = 0.9;
    config.output_dir = dir;
    config.progress = false;
    config.log_epochs = false;
    config.config_json = "{\"test\":1}";
    return config;
}

std::string temp_dir(const std::string& name) {
    fs::path dir = fs::temp_directory_path() / ("linvis_test_train_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    return dir.string();
}

}  // namespace

TEST(Train, LossFallsOnSyntheticData) {
    auto [images, labels] = synthetic_data(128, 1);
    torch::manual_seed(0);
    auto model = std::make_shared<TinyNet>();
    train::TensorBatchSource data(images, labels, 16, true, 7);
    train::TensorBatchSource eval_data(images, labels, 64, false, 7);
    const double before = train::evaluate(*model, eval_data).loss;
    train::Trainer trainer(model, quiet_config(temp_dir("falls"), 6));
    ASSERT_TRUE(trainer.fit(data, &eval_data));
    const auto& history = trainer.history();
    ASSERT_EQ(history.size(), 6u);
    EXPECT_LT(history.back().train_loss, history.front().train_loss);
    EXPECT_LT(history.back().eval.loss, 0.7 * before);
    EXPECT_GT(history.back().eval.top1, 80.0);
    EXPECT_TRUE(history.back().has_eval_ema);
}

TEST(Train, ResumeEqualsUninterruptedBitForBit) {
    auto [images, labels] = synthetic_data(96, 2);
    auto run = [&](const std::string& dir, int64_t epochs, bool resume) {
        torch::manual_seed(0);
        auto model = std::make_shared<TinyNet>();
        train::TensorBatchSource data(images, labels, 16, true, 11, train::TensorAugment{1, true});
        auto config = quiet_config(dir, epochs);
        config.resume = resume;
        train::Trainer trainer(model, config);
        trainer.fit(data, nullptr);
        return model;
    };
    auto straight = run(temp_dir("straight"), 4, false);
    const std::string dir = temp_dir("resumed");
    // The same 4-epoch run, interrupted by SIGINT early in epoch 3, then resumed.
    {
        torch::manual_seed(0);
        auto model = std::make_shared<TinyNet>();
        train::TensorBatchSource data(images, labels, 16, true, 11, train::TensorAugment{1, true});
        train::Trainer trainer(model, quiet_config(dir, 4));
        int64_t calls = 0;
        trainer.on_epoch_end = [&](const std::vector<train::EpochRecord>&) {
            if (++calls == 2) ::raise(SIGINT);  // stops at the next optimiser step, mid-epoch 3
        };
        EXPECT_FALSE(trainer.fit(data, nullptr));
    }
    auto resumed = run(dir, 4, true);
    auto a = straight->named_parameters(true);
    for (const auto& item : resumed->named_parameters(true))
        EXPECT_TRUE(torch::equal(item.value(), a[item.key()])) << item.key() << " differs after resume";
}

TEST(Train, InterruptedCheckpointWriteKeepsPreviousCheckpoint) {
    const std::string dir = temp_dir("atomic");
    const std::string path = dir + "/checkpoint.pt";
    torch::manual_seed(0);
    TinyNet model;
    auto optimizer = train::make_adamw(model, train::OptimizerConfig{});
    train::TrainingState state;
    state.epoch = 3;
    train::save_checkpoint(path, state, model, *optimizer, nullptr);
    const auto size_before = fs::file_size(path);
    EXPECT_THROW(linvis::io::write_file_atomically_via(path,
                                                     [](const std::string& temp) {
                                                         std::ofstream(temp) << "half a checkpoint";
                                                         throw linvis::Error("disk full (simulated)");
                                                     }),
                 linvis::Error);
    EXPECT_EQ(fs::file_size(path), size_before);
    for (const auto& entry : fs::directory_iterator(dir))
        EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << "temporary file left behind";
    TinyNet restored;
    auto optimizer2 = train::make_adamw(restored, train::OptimizerConfig{});
    EXPECT_EQ(train::load_checkpoint(path, restored, *optimizer2, nullptr).epoch, 3);
    EXPECT_TRUE(torch::equal(restored.conv->weight, model.conv->weight));
}

TEST(Train, CorruptCheckpointNamesTheFile) {
    const std::string dir = temp_dir("corrupt");
    const std::string path = dir + "/checkpoint.pt";
    std::ofstream(path) << "not a checkpoint";
    TinyNet model;
    auto optimizer = train::make_adamw(model, train::OptimizerConfig{});
    try {
        train::load_checkpoint(path, model, *optimizer, nullptr);
        FAIL() << "no error";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
}

TEST(Train, NanLossStopsWithMessage) {
    auto [images, labels] = synthetic_data(32, 3);
    images[0][0][0][0] = std::numeric_limits<float>::quiet_NaN();
    auto model = std::make_shared<TinyNet>();
    train::TensorBatchSource data(images, labels, 32, false, 1);
    auto config = quiet_config(temp_dir("nan"), 2);
    config.mixup.mixup_alpha = 0.0;
    train::Trainer trainer(model, config);
    try {
        trainer.fit(data, nullptr);
        FAIL() << "no error";
    } catch (const linvis::Error& e) {
        EXPECT_NE(std::string(e.what()).find("loss became nan"), std::string::npos) << e.what();
    }
}

TEST(Optim, WeightDecayExcludesNormsBiasesAndPositionEmbeddings) {
    torch::Tensor matrix = torch::zeros({4, 4}), vector = torch::zeros({4}), pos = torch::zeros({1, 4, 4});
    EXPECT_FALSE(train::excluded_from_weight_decay("blocks.0.attn.qkv.weight", matrix));
    EXPECT_TRUE(train::excluded_from_weight_decay("blocks.0.norm1.weight", vector));
    EXPECT_TRUE(train::excluded_from_weight_decay("blocks.0.attn.qkv.bias", vector));
    EXPECT_TRUE(train::excluded_from_weight_decay("pos_embed", pos));
    EXPECT_TRUE(train::excluded_from_weight_decay("cls_token", pos));
}

TEST(Optim, LrMultiplierAndFreezeMode) {
    TinyNet model;
    train::OptimizerConfig config;
    config.lr = 1e-3;
    config.boosted_parameters = {"head.weight", "head.bias"};
    config.lr_multiplier = 20.0;
    std::vector<train::ParamGroupInfo> groups;
    auto optimizer = train::make_adamw(model, config, &groups);
    train::apply_learning_rate(*optimizer, groups, 1e-3);
    bool found_boosted = false;
    for (size_t i = 0; i < groups.size(); ++i) {
        const double lr = static_cast<torch::optim::AdamWOptions&>(optimizer->param_groups()[i].options()).lr();
        const bool boosted = groups[i].names.front().rfind("head.", 0) == 0;
        EXPECT_DOUBLE_EQ(lr, boosted ? 2e-2 : 1e-3) << groups[i].label;
        found_boosted = found_boosted || boosted;
    }
    EXPECT_TRUE(found_boosted);
    config.train_only_boosted = true;
    TinyNet frozen;
    train::make_adamw(frozen, config);
    EXPECT_FALSE(frozen.conv->weight.requires_grad());
    EXPECT_TRUE(frozen.head->weight.requires_grad());
    config.boosted_parameters.insert("does.not.exist");
    EXPECT_THROW(train::make_adamw(frozen, config), linvis::Error);
}

TEST(Optim, CosineScheduleWithWarmup) {
    train::CosineSchedule s;
    s.base_lr = 1.0;
    s.min_lr = 0.0;
    s.warmup_lr = 0.0;
    s.warmup_steps = 10;
    s.total_steps = 110;
    EXPECT_DOUBLE_EQ(s.lr_at(0), 0.0);
    EXPECT_DOUBLE_EQ(s.lr_at(5), 0.5);
    EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);
    EXPECT_NEAR(s.lr_at(60), 0.5, 1e-12);
    EXPECT_NEAR(s.lr_at(110), 0.0, 1e-12);
}

TEST(Mixup, TargetsSumToOneAndSmoothingIsApplied) {
    torch::Tensor labels = torch::tensor({0, 1, 2, 3}, torch::kLong);
    torch::Tensor smooth = train::smooth_one_hot(labels, 4, 0.1);
    EXPECT_NEAR(smooth[0][0].item<float>(), 0.925, 1e-6);
    EXPECT_NEAR(smooth[0][1].item<float>(), 0.025, 1e-6);
    std::mt19937_64 rng(5);
    for (double cutmix : {0.0, 1.0}) {
        train::MixupConfig config;
        config.mixup_alpha = cutmix > 0 ? 0.0 : 0.8;
        config.cutmix_alpha = cutmix;
        torch::Tensor images = torch::rand({4, 3, 16, 16});
        torch::Tensor original = images.clone();
        torch::Tensor targets = train::mix_batch(images, labels, 4, config, rng);
        EXPECT_TRUE(linvis::testing::all_close(targets.sum(1), torch::ones({4}), 1e-6, 1e-6));
        EXPECT_FALSE(torch::equal(images, original));
        // Each mixed image is a blend of itself and its mirror in the batch with the target's weight.
        const double lam = targets[0][0].item<double>() - 0.025;
        const double expected_lam = (lam) / 0.9;
        if (cutmix == 0.0) {
            torch::Tensor expected = original[0] * expected_lam + original[3] * (1 - expected_lam);
            EXPECT_TRUE(linvis::testing::all_close(images[0], expected, 1e-5, 1e-5));
        }
    }
}

TEST(Ema, AveragesTowardsTheWeights) {
    TinyNet model;
    train::ModelEma ema(model, 0.5);
    torch::Tensor before = model.head->weight.detach().clone();
    {
        torch::NoGradGuard no_grad;
        model.head->weight.add_(2.0);
    }
    ema.update(model);
    EXPECT_TRUE(linvis::testing::all_close(ema.tensors().at("head.weight"), before + 1.0, 1e-6, 1e-6));
}

#include "linvis/train/finetune.h"

TEST(Finetune, InheritsMatchingTensorsAndReportsTheRest) {
    torch::manual_seed(0);
    TinyNet source(4), target(5);  // the heads differ in shape
    std::map<std::string, torch::Tensor> weights;
    for (const auto& item : source.named_parameters(true)) weights[item.key()] = item.value().detach().clone();
    weights["extra.weight"] = torch::zeros({2});
    auto report = train::inherit_weights(target, weights);
    EXPECT_TRUE(torch::equal(target.conv->weight, source.conv->weight));
    EXPECT_EQ(report.copied.size(), 4u);  // conv.weight/bias, norm.weight/bias
    EXPECT_EQ(report.shape_mismatch.size(), 2u);
    EXPECT_EQ(report.unused, (std::vector<std::string>{"extra.weight"}));
    EXPECT_TRUE(report.new_parameters.empty());
    EXPECT_THROW(train::inherit_weights(target, weights, false), Error);
    weights.erase("conv.bias");
    EXPECT_EQ(train::inherit_weights(target, weights).new_parameters, (std::vector<std::string>{"conv.bias"}));
}

TEST(Train, EvalEveryEvaluatesEveryNthAndTheLastEpoch) {
    auto [images, labels] = synthetic_data(32, 4);
    torch::manual_seed(0);
    auto model = std::make_shared<TinyNet>();
    train::TensorBatchSource data(images, labels, 16, true, 7);
    train::TensorBatchSource eval_data(images, labels, 32, false, 7);
    train::TrainConfig config = quiet_config(temp_dir("eval_every"), 5);
    config.eval_every = 2;
    train::Trainer trainer(model, config);
    ASSERT_TRUE(trainer.fit(data, &eval_data));
    std::vector<bool> evaluated;
    for (const auto& r : trainer.history()) evaluated.push_back(r.has_eval);
    EXPECT_EQ(evaluated, (std::vector<bool>{false, true, false, true, true}));
    config.eval_every = 0;
    EXPECT_THROW(train::Trainer(std::make_shared<TinyNet>(), config), linvis::Error);
}
