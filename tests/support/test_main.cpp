// Shared GoogleTest main: fixes the seed and keeps LibTorch to the configured threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/runtime.h"

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    torch::manual_seed(0);
    linvis::runtime::configure_threads(1);
    return RUN_ALL_TESTS();
}
