// The measurement harness of linvis bench and bench_ops (include/linvis/tools/bench.h): a child
// process's answer, timeout, signal and exit status; the timing and peak-memory helpers; and the
// bench_ops command line.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "linvis/core/flops.h"
#include "linvis/tools/bench.h"
#include "support/cli.h"

using linvis::tools::ChildResult;
using linvis::tools::run_in_child;

namespace {

constexpr const char* kChildFlag = "--harness-test-child=";

// The child half of the tests: run_in_child runs this test program again, and with kChildFlag<behaviour>
// among its arguments it behaves so instead of running the tests. Checked while the program starts, before
// GoogleTest reads the arguments.
int act_as_child_when_asked() {
    std::ifstream cmdline("/proc/self/cmdline");
    const std::string text((std::istreambuf_iterator<char>(cmdline)), std::istreambuf_iterator<char>());
    const auto flag = text.find(kChildFlag);
    if (flag == std::string::npos) return 0;
    const std::string behaviour = text.substr(flag + std::string(kChildFlag).size()).c_str();
    if (behaviour == "answer") {
        std::printf("progress the parent ignores\n{\"answer\": 42}\n");
    } else if (behaviour == "no-answer") {
        std::printf("done\n");
    } else if (behaviour == "sleep") {
        sleep(600);
    } else if (behaviour == "signal") {
        raise(SIGTERM);
    } else if (behaviour == "exit-3") {
        std::printf("{\"answer\": 42}\n");
        std::fflush(stdout);
        std::_Exit(3);
    }
    std::fflush(stdout);
    std::_Exit(0);
}

const int child_hook = act_as_child_when_asked();

ChildResult run_child(const std::string& behaviour, double timeout_s = 60) {
    return run_in_child({kChildFlag + behaviour}, timeout_s);
}

}  // namespace

TEST(BenchHarness, ChildAnswerIsItsLastJsonLine) {
    const ChildResult result = run_child("answer");
    ASSERT_TRUE(result.ok()) << result.message;
    EXPECT_EQ(result.json.at("answer").get<int>(), 42);
}

TEST(BenchHarness, ChildPastItsTimeoutIsKilledAndReported) {
    // The child sleeps for 10 minutes: only the kill ends it before ctest's own timeout.
    const ChildResult result = run_child("sleep", 0.5);
    EXPECT_EQ(result.status, ChildResult::Status::TimedOut);
    EXPECT_EQ(result.message, "timed out after 0.5 s");
}

TEST(BenchHarness, ChildKilledBySignalIsReported) {
    const ChildResult result = run_child("signal");
    EXPECT_EQ(result.status, ChildResult::Status::KilledBySignal);
    EXPECT_EQ(result.message, std::string("child killed by signal ").append(std::to_string(SIGTERM)));
}

TEST(BenchHarness, ChildExitingNonZeroFailsEvenWithAnAnswer) {
    const ChildResult result = run_child("exit-3");
    EXPECT_EQ(result.status, ChildResult::Status::ExitedNonZero);
    EXPECT_EQ(result.message, "child exited with status 3");
}

TEST(BenchHarness, ChildWithoutJsonAnswerIsUnreadable) {
    const ChildResult result = run_child("no-answer");
    EXPECT_EQ(result.status, ChildResult::Status::UnreadableOutput);
    EXPECT_EQ(result.message.rfind("unreadable child output: ", 0), 0u) << result.message;
}

TEST(BenchHarness, MedianOfOddAndEvenCounts) {
    EXPECT_EQ(linvis::tools::median({3.0, 1.0, 2.0}), 2.0);
    EXPECT_EQ(linvis::tools::median({4.0, 1.0, 3.0, 2.0}), 2.5);
    EXPECT_EQ(linvis::tools::median({}), 0.0);
}

TEST(BenchHarness, TimePassesWarmsUpThenTimesEachPass) {
    int calls = 0;
    const auto seconds = linvis::tools::time_passes([&] { ++calls; }, 2, 4);
    EXPECT_EQ(calls, 6);
    ASSERT_EQ(seconds.size(), 4u);
    for (const double s : seconds) EXPECT_GE(s, 0.0);
    // A time budget already spent stops the loop once the minimum number of passes is timed.
    calls = 0;
    EXPECT_EQ(linvis::tools::time_passes([&] { ++calls; }, 0, 10, 0.0, 3).size(), 3u);
    EXPECT_EQ(calls, 3);
}

// The SGEMM rate is the faster of LibTorch's BLAS and linvis's own products: both libraries run, each one warm-up and
// `repeats` timed products.
TEST(BenchHarness, SgemmRateTimesLinvisProductsBesideTheBlas) {
    double gflops = 0.0;
    int64_t counted = 0;
    {
        const linvis::flops::Counter counter;
        gflops = linvis::tools::measure_sgemm_gflops(64, 3);
        counted = counter.macs();
    }
    EXPECT_GT(gflops, 0.0);
    EXPECT_TRUE(std::isfinite(gflops));
    EXPECT_EQ(counted, 4 * 64 * 64 * 64);  // linvis's products (torch::mm is not counted)
}

TEST(BenchHarness, PeakRssGrowthSeesMemoryTouchedSinceItStarted) {
    constexpr int64_t kBytes = 64 << 20;
    const linvis::tools::PeakRssGrowth peak;
    std::vector<char> block(kBytes, 1);  // written, hence resident
    EXPECT_GE(peak.bytes(), kBytes * 3 / 4);
    EXPECT_EQ(block[kBytes / 2], 1);
}

TEST(BenchOps, EveryOpAnswersHelpWithItsOptions) {
    const auto top = linvis::testing::run_program(LINVIS_BENCH_OPS_PATH, "--help");
    EXPECT_EQ(top.status, 0) << top.output;
    const std::vector<std::pair<std::string, std::vector<std::string>>> ops = {
        {"ttt_linear", {"--tokens", "--heads", "--head-dim", "--mini-batch", "--reps", "--threads"}},
        {"vit3_t5", {"--iters", "--side", "--threads"}},
        {"mlstm", {"--reps", "--model-reps", "--tokens", "--skip-model", "--threads"}},
        {"depthwise_conv", {"--reps", "--side", "--threads"}}};
    for (const auto& [op, options] : ops) {
        EXPECT_NE(top.output.find(op), std::string::npos) << op;
        const auto help = linvis::testing::run_program(LINVIS_BENCH_OPS_PATH, op + " --help");
        EXPECT_EQ(help.status, 0) << op << ": " << help.output;
        for (const auto& option : options) EXPECT_NE(help.output.find(option), std::string::npos) << op << option;
    }
    EXPECT_NE(linvis::testing::run_program(LINVIS_BENCH_OPS_PATH, "ttt_linear --tokens many").status, 0);
}
