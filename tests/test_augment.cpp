// Training augmentations: crop boxes inside the image, each RandAugment op's defining property,
// determinism from the RNG stream.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/train/augment.h"
#include "support/testing.h"

using namespace linvis;

TEST(Augment, RandomResizedCropBoxStaysInsideAndCoversScaleRange) {
    train::TrainAugmentConfig config;
    std::mt19937_64 rng(1);
    double min_fraction = 1.0, max_fraction = 0.0;
    for (int i = 0; i < 500; ++i) {
        auto box = train::random_resized_crop_box(120, 200, config, rng);
        ASSERT_GE(box[0], 0);
        ASSERT_GE(box[1], 0);
        ASSERT_LE(box[0] + box[2], 120);
        ASSERT_LE(box[1] + box[3], 200);
        const double fraction = static_cast<double>(box[2] * box[3]) / (120.0 * 200.0);
        min_fraction = std::min(min_fraction, fraction);
        max_fraction = std::max(max_fraction, fraction);
    }
    EXPECT_LT(min_fraction, 0.15);
    EXPECT_GT(max_fraction, 0.7);
}

TEST(Augment, OpsKeepShapeAndRangeAndDoWhatTheirNameSays) {
    torch::manual_seed(0);
    torch::Tensor image = torch::rand({3, 32, 32}) * 0.5 + 0.25;
    std::mt19937_64 rng(3);
    for (const auto& op : train::rand_augment_op_names()) {
        torch::Tensor out = train::apply_rand_augment_op(image, op, 9.0, rng);
        EXPECT_EQ(out.sizes(), image.sizes()) << op;
        EXPECT_GE(out.min().item<float>(), -1e-6) << op;
        EXPECT_LE(out.max().item<float>(), 1.0 + 1e-6) << op;
        EXPECT_FALSE(torch::equal(out, image)) << op << " left the image unchanged at magnitude 9";
    }
    EXPECT_TRUE(linvis::testing::all_close(train::apply_rand_augment_op(image, "Invert", 9, rng), 1.0 - image, 0, 1e-7));
    torch::Tensor stretched = train::apply_rand_augment_op(image, "AutoContrast", 9, rng);
    EXPECT_NEAR(stretched.amin({1, 2}).max().item<float>(), 0.0, 1e-6);
    EXPECT_NEAR(stretched.amax({1, 2}).min().item<float>(), 1.0, 1e-6);
    // Equalize spreads values over the full range.
    torch::Tensor equalized = train::apply_rand_augment_op(image, "Equalize", 9, rng);
    EXPECT_GT(equalized.max().item<float>() - equalized.min().item<float>(), 0.95);
    EXPECT_THROW(train::apply_rand_augment_op(image, "Nope", 9, rng), Error);
}

TEST(Augment, TrainTransformIsDeterministicForASeedAndNormalises) {
    torch::manual_seed(0);
    torch::Tensor image = torch::rand({3, 50, 70});
    train::TrainAugmentConfig config;
    config.img_size = 32;
    std::mt19937_64 a(42), b(42), c(43);
    torch::Tensor first = train::train_transform(image, config, a);
    torch::Tensor second = train::train_transform(image, config, b);
    torch::Tensor third = train::train_transform(image, config, c);
    EXPECT_EQ(first.sizes(), (std::vector<int64_t>{3, 32, 32}));
    EXPECT_TRUE(torch::equal(first, second));
    EXPECT_FALSE(torch::equal(first, third));
    EXPECT_THROW(train::train_transform(torch::rand({1, 8, 8}), config, a), Error);
}
