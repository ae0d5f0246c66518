// Shared GoogleTest main: fixes the seed, keeps LibTorch to the configured threads and serves large
// tensors from the tensor arena, as the linvis command does.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/runtime.h"
#include "linvis/core/tensor_arena.h"

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    torch::manual_seed(0);
    linvis::runtime::configure_threads(1);
    linvis::tensor_arena::install();  // as the linvis command does
    return RUN_ALL_TESTS();
}
