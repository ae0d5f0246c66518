// The tensor arena (core/tensor_arena.h): first-fit placement, joining of freed neighbours, the same
// addresses in every pass, release of free pages, and LibTorch's large CPU tensors served from it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/core/tensor_arena.h"
#include "linvis/models/model.h"
#include "linvis/models/registry.h"

namespace arena = linvis::tensor_arena;
using arena::kPageBytes;

namespace {

std::size_t offset_of(const arena::Arena& a, const void* block, const void* base) {
    EXPECT_TRUE(a.contains(block));
    return static_cast<std::size_t>(static_cast<const char*>(block) - static_cast<const char*>(base));
}

}  // namespace

TEST(TensorArena, PlacesFirstFitAndJoinsFreedNeighbours) {
    arena::Arena a(64 * kPageBytes);
    void* first = a.allocate(kPageBytes);
    void* second = a.allocate(2 * kPageBytes - 100);  // rounded up to whole pages
    void* third = a.allocate(kPageBytes);
    EXPECT_EQ(offset_of(a, second, first), kPageBytes);
    EXPECT_EQ(offset_of(a, third, first), 3 * kPageBytes);
    EXPECT_EQ(a.stats().live_bytes, 4 * kPageBytes);

    a.free(second);  // a two-page hole
    EXPECT_EQ(a.stats().free_ranges, 1u);
    void* too_big = a.allocate(3 * kPageBytes);  // does not fit the hole: goes above the third block
    EXPECT_EQ(offset_of(a, too_big, first), 4 * kPageBytes);
    void* fits = a.allocate(kPageBytes);  // the lowest range that holds it: the hole
    EXPECT_EQ(offset_of(a, fits, first), kPageBytes);

    // Freeing the blocks on both sides of the remaining one-page hole makes one range of them.
    a.free(first);
    a.free(third);
    a.free(fits);
    EXPECT_EQ(a.stats().free_ranges, 1u);
    void* four_pages = a.allocate(4 * kPageBytes);
    EXPECT_EQ(four_pages, first);
    a.free(four_pages);
    a.free(too_big);
    const arena::Stats s = a.stats();
    EXPECT_EQ(s.live_bytes, 0u);
    EXPECT_EQ(s.live_blocks, 0u);
    EXPECT_EQ(s.high_water_bytes, 7 * kPageBytes);
    EXPECT_EQ(s.peak_live_bytes, 7 * kPageBytes);  // the three-page block and the four-page one
    EXPECT_EQ(s.overflow_blocks, 0u);
}

// A pass that frees what it allocates leaves the range empty, so the next pass with the same requests
// gets the same addresses and no more memory; the high water stays at what the first pass needed.
TEST(TensorArena, RepeatedPassesReuseTheSameAddresses) {
    arena::Arena a(std::size_t{1} << 30);
    auto pass = [&a] {
        std::mt19937 rng(7);
        std::vector<void*> live;
        std::vector<std::uintptr_t> addresses;
        for (int step = 0; step < 400; ++step) {
            if (!live.empty() && rng() % 3 == 0) {
                const std::size_t victim = rng() % live.size();
                a.free(live[victim]);
                live.erase(live.begin() + static_cast<std::ptrdiff_t>(victim));
            } else {
                void* block = a.allocate((1 + rng() % 64) * kPageBytes + rng() % kPageBytes);
                EXPECT_NE(block, nullptr);
                live.push_back(block);
                addresses.push_back(reinterpret_cast<std::uintptr_t>(block));
            }
        }
        for (void* block : live) a.free(block);
        return addresses;
    };
    const auto first = pass();
    const std::size_t high_water = a.stats().high_water_bytes;
    EXPECT_EQ(a.stats().free_ranges, 1u);
    for (int repeat = 0; repeat < 3; ++repeat) {
        EXPECT_EQ(pass(), first);
        EXPECT_EQ(a.stats().high_water_bytes, high_water);
    }
}

TEST(TensorArena, AnswersNullWhenNoRangeHoldsTheRequest) {
    arena::Arena a(4 * kPageBytes);
    EXPECT_EQ(a.allocate(5 * kPageBytes), nullptr);
    void* block = a.allocate(3 * kPageBytes);
    ASSERT_NE(block, nullptr);
    EXPECT_EQ(a.allocate(2 * kPageBytes), nullptr);
    EXPECT_EQ(a.stats().overflow_blocks, 2u);
    a.free(block);
}

TEST(TensorArena, ReleaseFreeHandsPagesBackAndLowersTheHighWater) {
    arena::Arena a(16 * kPageBytes);
    auto* kept = static_cast<unsigned char*>(a.allocate(kPageBytes));
    auto* freed = static_cast<unsigned char*>(a.allocate(4 * kPageBytes));
    std::memset(kept, 0xab, kPageBytes);
    std::memset(freed, 0xcd, 4 * kPageBytes);
    a.free(freed);
    EXPECT_EQ(a.release_free(), 4 * kPageBytes);
    EXPECT_EQ(a.stats().high_water_bytes, kPageBytes);
    EXPECT_EQ(a.stats().peak_live_bytes, kPageBytes);  // counted afresh from the release on
    EXPECT_EQ(kept[kPageBytes - 1], 0xab);  // live blocks keep their contents
    // The released pages come back as fresh zeroed pages.
    auto* again = static_cast<unsigned char*>(a.allocate(4 * kPageBytes));
    EXPECT_EQ(again, freed);
    EXPECT_TRUE(std::all_of(again, again + 4 * kPageBytes, [](unsigned char b) { return b == 0; }));
    a.free(again);
    a.free(kept);
}

TEST(TensorArena, RejectsBlocksItDidNotHandOut) {
    arena::Arena a(8 * kPageBytes);
    int on_stack = 0;
    EXPECT_THROW(a.free(&on_stack), linvis::Error);
    auto* block = static_cast<char*>(a.allocate(2 * kPageBytes));
    EXPECT_THROW(a.free(block + kPageBytes), linvis::Error);  // inside a block, not its start
    a.free(block);
    EXPECT_THROW(a.free(block), linvis::Error);  // twice
}

TEST(TensorArena, ThreadsAllocatingAtOnceLeaveItConsistent) {
    arena::Arena a(std::size_t{1} << 30);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&a, t] {
            std::mt19937 rng(static_cast<unsigned>(t));
            std::vector<void*> live;
            for (int step = 0; step < 2000; ++step) {
                if (live.size() > 8 || (!live.empty() && rng() % 2 == 0)) {
                    a.free(live.back());
                    live.pop_back();
                } else {
                    auto* block = static_cast<unsigned char*>(a.allocate((1 + rng() % 8) * kPageBytes));
                    ASSERT_NE(block, nullptr);
                    block[0] = static_cast<unsigned char>(t);  // no two threads hold the same block
                    live.push_back(block);
                }
                if (!live.empty()) EXPECT_EQ(static_cast<unsigned char*>(live.back())[0], t);
            }
            for (void* block : live) a.free(block);
        });
    }
    for (auto& thread : threads) thread.join();
    const arena::Stats s = a.stats();
    EXPECT_EQ(s.live_blocks, 0u);
    EXPECT_EQ(s.live_bytes, 0u);
    EXPECT_EQ(s.free_ranges, 1u);
}

// The test program installs the arena as the linvis command does (tests/support/test_main.cpp).
TEST(TensorArena, ServesLibTorchsLargeCpuTensors) {
    if (!arena::installed()) GTEST_SKIP() << "LINVIS_TENSOR_ARENA=0";
    const arena::Stats before = arena::stats();
    {
        auto large = torch::ones({static_cast<int64_t>(arena::kMinBlockBytes / sizeof(float))});
        auto small = torch::ones({1000});
        EXPECT_EQ(arena::stats().live_blocks, before.live_blocks + 1);
        EXPECT_EQ(arena::stats().live_bytes, before.live_bytes + arena::kMinBlockBytes);
        large.resize_({3 * static_cast<int64_t>(arena::kMinBlockBytes / sizeof(float))});  // a new block, data kept
        EXPECT_EQ(large.narrow(0, 0, 4).sum().item<float>(), 4.0f);
        EXPECT_EQ(arena::stats().live_bytes, before.live_bytes + 3 * arena::kMinBlockBytes);
        EXPECT_EQ(small.sum().item<float>(), 1000.0f);

        c10::Allocator* cpu = c10::GetCPUAllocator();
        ASSERT_NE(cpu->raw_deleter(), nullptr);
        void* raw_large = cpu->raw_allocate(2 * arena::kMinBlockBytes);
        void* raw_small = cpu->raw_allocate(64);
        EXPECT_EQ(arena::stats().live_blocks, before.live_blocks + 2);
        cpu->raw_deallocate(raw_large);
        cpu->raw_deallocate(raw_small);
    }
    EXPECT_EQ(arena::stats().live_blocks, before.live_blocks);
    EXPECT_EQ(arena::stats().live_bytes, before.live_bytes);
}

// A long-lived tensor made mid-pass (a folded weight) takes its memory from malloc: usable as any tensor, and never
// a block of the range.
TEST(TensorArena, EmptyOutsideArenaIsNotInTheRange) {
    const int64_t count = 4 * static_cast<int64_t>(arena::kMinBlockBytes / sizeof(float));
    const arena::Stats before = arena::stats();
    {
        torch::Tensor kept = arena::empty_outside_arena({count / 4, 4}, torch::kFloat32);
        EXPECT_EQ(kept.sizes(), torch::IntArrayRef({count / 4, 4}));
        EXPECT_EQ(kept.scalar_type(), torch::kFloat32);
        kept.fill_(2.0f);
        EXPECT_EQ(kept.sum().item<float>(), 2.0f * static_cast<float>(count));
        EXPECT_EQ(arena::stats().live_blocks, before.live_blocks);
        EXPECT_EQ(arena::stats().live_bytes, before.live_bytes);
        EXPECT_EQ(arena::empty_outside_arena({0}, torch::kFloat64).numel(), 0);
        EXPECT_THROW(arena::empty_outside_arena({-1}, torch::kFloat32), linvis::Error);
    }
    EXPECT_EQ(arena::stats().live_bytes, before.live_bytes);
}

// What the arena is for: once a model's first pass has packed its weights, every later pass needs no new
// memory and ends where it started. H-ViT3 at batch 4 and 224 px has stage-1 tensors of 3 MiB and more.
TEST(TensorArena, ModelPassesReuseTheirMemory) {
    if (!arena::installed()) GTEST_SKIP() << "LINVIS_TENSOR_ARENA=0";
    auto model = linvis::models::create_model("hvit3_tiny", {});
    model->eval();
    torch::NoGradGuard no_grad;
    const auto images = torch::randn({4, 3, 224, 224});
    const arena::Stats before = arena::stats();
    model->forward(images);  // packs the weights: they stay
    const torch::Tensor second = model->forward(images);
    const arena::Stats after_second = arena::stats();
    EXPECT_GT(after_second.high_water_bytes, before.live_bytes + 8 * arena::kMinBlockBytes);
    for (int pass = 0; pass < 2; ++pass) {
        const torch::Tensor again = model->forward(images);
        EXPECT_TRUE(torch::equal(again, second));
        EXPECT_EQ(arena::stats().high_water_bytes, after_second.high_water_bytes);
        EXPECT_EQ(arena::stats().live_bytes, after_second.live_bytes);
        EXPECT_EQ(arena::stats().live_blocks, after_second.live_blocks);
    }
}
