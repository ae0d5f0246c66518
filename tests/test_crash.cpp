// Nothing lost on a crash: `linvis train` is killed with SIGKILL while it writes a checkpoint and
// in the middle of an epoch, and made to fail its checkpoint write with a file-size limit. The
// previous checkpoint must stay loadable, the error must be clear, and resuming must reproduce
// the uninterrupted run's weights bit for bit.
//
// The kills happen at known places through the test stop points (include/linvis/core/test_hooks.h):
// with LINVIS_TEST_STOP_AT=NAME:N the child stops itself (SIGSTOP) at the N-th pass through
// point NAME; the test looks at the files, then sends SIGKILL.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/io/image.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using linvis::testing::TempDir;

namespace {

std::string read_file(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// DIR/train and DIR/val with two classes of 32x32 PNGs (dark / bright with noise), 8 + 2 per class.
void make_folder(const fs::path& root) {
    torch::manual_seed(5);
    for (const char* split : {"train", "val"}) {
        const int n = std::string(split) == "train" ? 8 : 2;
        for (int c = 0; c < 2; ++c) {
            fs::create_directories(root / split / ("class" + std::to_string(c)));
            for (int i = 0; i < n; ++i) {
                torch::Tensor image =
                    (torch::randint(0, 60, {32, 32, 3}) + (c == 0 ? 30 : 160)).to(torch::kUInt8);
                linvis::io::write_png((root / split / ("class" + std::to_string(c)) / (std::to_string(i) + ".png")).string(),
                                      image);
            }
        }
    }
}

struct Child {
    pid_t pid = -1;
    fs::path log;
};

struct Launch {
    std::string stop_at;          // LINVIS_TEST_STOP_AT, "" for none
    rlim_t file_size_limit = 0;   // RLIMIT_FSIZE in bytes, 0 for none
};

// The training command: 3 epochs of 4 batches, a tiny DeiT, one thread, fixed seed.
std::vector<std::string> train_args(const fs::path& data, const fs::path& out, bool resume) {
    std::vector<std::string> args = {LINVIS_CLI_PATH, "train", "--model", "deit_tiny", "--model-kwargs", "depth=1",
                                     "embed_dim=32", "num_heads=2", "patch_size=8", "--dataset",
                                     "folder:" + data.string(), "--img-size", "32", "--epochs", "3", "--batch-size",
                                     "4", "--workers", "0", "--threads", "1", "--seed", "3", "--ema-decay", "0.9",
                                     "--output", out.string()};
    if (resume) args.push_back("--resume");
    else args.push_back("--no-progress");
    return args;
}

Child launch(const std::vector<std::string>& args, const fs::path& log, const Launch& how = {}) {
    // Everything the child needs is prepared before fork(): between fork and exec it only calls
    // async-signal-safe functions (the test process has LibTorch's threads).
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
        const std::string entry = *e;
        if (entry.rfind("LINVIS_TEST_STOP_AT=", 0) != 0 && entry.rfind("OMP_NUM_THREADS=", 0) != 0) env.push_back(entry);
    }
    env.push_back("OMP_NUM_THREADS=1");
    if (!how.stop_at.empty()) env.push_back("LINVIS_TEST_STOP_AT=" + how.stop_at);
    std::vector<char*> envp, argv;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const std::string log_path = log.string();
    struct rlimit limit = {how.file_size_limit, how.file_size_limit};
    Child child;
    child.log = log;
    child.pid = ::fork();
    if (child.pid == 0) {
        const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            ::dup2(fd, 1);
            ::dup2(fd, 2);
        }
        if (how.file_size_limit > 0) {
            ::signal(SIGXFSZ, SIG_IGN);  // write() then fails with EFBIG instead of killing the process
            ::setrlimit(RLIMIT_FSIZE, &limit);
        }
        ::execve(argv[0], argv.data(), envp.data());
        ::_exit(127);
    }
    return child;
}

// Waits until the child stops (true) or ends (false, status in *status); fails after 10 minutes.
bool wait_stopped_or_exited(const Child& child, int* status) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
    while (std::chrono::steady_clock::now() < deadline) {
        const pid_t r = ::waitpid(child.pid, status, WUNTRACED | WNOHANG);
        if (r == child.pid) return WIFSTOPPED(*status);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::kill(child.pid, SIGKILL);
    ::waitpid(child.pid, status, 0);
    ADD_FAILURE() << "child did not stop or exit in time; log:\n" << read_file(child.log);
    return false;
}

// Exit status of a child that runs to the end (-1 if it was killed by a signal).
int run_to_end(const std::vector<std::string>& args, const fs::path& log, const Launch& how = {}) {
    const Child child = launch(args, log, how);
    int status = 0;
    if (wait_stopped_or_exited(child, &status)) {
        ::kill(child.pid, SIGKILL);
        ::waitpid(child.pid, &status, 0);
        ADD_FAILURE() << "child stopped unexpectedly; log:\n" << read_file(log);
        return -1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Starts training, waits for the stop point, checks it stopped there, then SIGKILLs it.
void kill_at(const std::vector<std::string>& args, const fs::path& log, const std::string& stop_at) {
    const Child child = launch(args, log, {stop_at});
    int status = 0;
    ASSERT_TRUE(wait_stopped_or_exited(child, &status)) << "did not reach " << stop_at << "; log:\n" << read_file(log);
    EXPECT_NE(read_file(log).find("stopped at test point " + stop_at.substr(0, stop_at.rfind(':'))), std::string::npos);
    ASSERT_EQ(::kill(child.pid, SIGKILL), 0);
    ASSERT_EQ(::waitpid(child.pid, &status, 0), child.pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

std::vector<fs::path> temporaries(const fs::path& dir) {
    std::vector<fs::path> found;
    for (const auto& entry : fs::directory_iterator(dir))
        if (entry.path().filename().string().find(".tmp-") != std::string::npos) found.push_back(entry.path());
    return found;
}

// One uninterrupted run, shared by the tests: its final weights are the reference.
class Crash : public ::testing::Test {
protected:
    static void SetUpTestSuite() {
        dir_ = new TempDir("linvis_crash");
        make_folder(dir_->path / "data");
        const fs::path out = dir_->path / "straight";
        ASSERT_EQ(run_to_end(train_args(dir_->path / "data", out, false), dir_->path / "straight.log"), 0)
            << read_file(dir_->path / "straight.log");
        straight_last_ = read_file(out / "last.safetensors");
        ASSERT_GT(straight_last_.size(), 1000u);
    }
    static void TearDownTestSuite() {
        delete dir_;
        dir_ = nullptr;
    }
    static fs::path data() { return dir_->path / "data"; }
    static fs::path out(const std::string& name) { return dir_->path / name; }

    static TempDir* dir_;
    static std::string straight_last_;
};
TempDir* Crash::dir_ = nullptr;
std::string Crash::straight_last_;

}  // namespace

// SIGKILL while checkpoint.pt of epoch 2 is being written: once right after its temporary file is
// created, once when the temporary file is complete but not yet renamed. checkpoint.pt stays
// epoch 1's, the resumed run starts at epoch 2 and ends with the uninterrupted run's weights.
TEST_F(Crash, SigkillDuringCheckpointWriteKeepsThePreviousCheckpoint) {
    for (const std::string point : {"atomic-write-begin:checkpoint.pt", "atomic-write-rename:checkpoint.pt"}) {
        SCOPED_TRACE(point);
        const fs::path o = out(point.substr(0, point.find(':')));
        kill_at(train_args(data(), o, false), o.string() + ".log", point + ":2");
        ASSERT_TRUE(fs::exists(o / "checkpoint.pt"));
        const auto leftovers = temporaries(o);
        ASSERT_EQ(leftovers.size(), 1u) << "the killed write's temporary file";
        if (point.find("rename") != std::string::npos)
            EXPECT_GT(fs::file_size(leftovers[0]), fs::file_size(o / "checkpoint.pt") / 2) << "written, not renamed";
        else
            EXPECT_EQ(fs::file_size(leftovers[0]), 0u);
        const fs::path log = o.string() + ".resume.log";
        ASSERT_EQ(run_to_end(train_args(data(), o, true), log), 0) << read_file(log);
        EXPECT_NE(read_file(log).find("at epoch 2, batch 0"), std::string::npos) << read_file(log);
        EXPECT_EQ(read_file(o / "last.safetensors"), straight_last_) << "resumed weights differ";
    }
}

// A checkpoint write that fails (RLIMIT_FSIZE below the checkpoint's size, SIGXFSZ ignored, so
// write() fails with EFBIG like on a full disk): non-zero exit, one clear error naming the
// checkpoint, the old checkpoint byte for byte intact, no temporary file left.
TEST_F(Crash, FailedCheckpointWriteIsAClearErrorAndKeepsTheOldOne) {
    const fs::path o = out("fsize");
    kill_at(train_args(data(), o, false), o.string() + ".log", "atomic-write-begin:checkpoint.pt:2");
    for (const auto& t : temporaries(o)) fs::remove(t);
    const std::string before = read_file(o / "checkpoint.pt");
    ASSERT_GT(before.size(), 1000u);
    const fs::path log = o.string() + ".fsize.log";
    const int status = run_to_end(train_args(data(), o, true), log, {"", rlim_t(before.size() / 2)});
    const std::string output = read_file(log);
    EXPECT_NE(status, 0) << output;
    EXPECT_NE(status, -1) << "killed by a signal instead of reporting the error:\n" << output;
    EXPECT_NE(output.find((o / "checkpoint.pt").string() + ": write failed: File too large; the previous checkpoint is kept"),
              std::string::npos)
        << output;
    EXPECT_EQ(output.find("terminate called"), std::string::npos) << output;
    EXPECT_EQ(read_file(o / "checkpoint.pt"), before) << "old checkpoint changed";
    EXPECT_TRUE(temporaries(o).empty()) << "temporary file left behind";
    // ... and it is still a good checkpoint: without the limit the run resumes and finishes.
    ASSERT_EQ(run_to_end(train_args(data(), o, true), o.string() + ".resume.log"), 0)
        << read_file(o.string() + ".resume.log");
    EXPECT_EQ(read_file(o / "last.safetensors"), straight_last_);
}

// SIGKILL in the middle of epoch 2 (before its 3rd of 4 batches): resuming from epoch 1's
// checkpoint reproduces the uninterrupted run's final weights bit for bit.
TEST_F(Crash, ResumeAfterSigkillMidEpochReproducesTheUninterruptedRun) {
    const fs::path o = out("midepoch");
    kill_at(train_args(data(), o, false), o.string() + ".log", "train-batch:7");
    EXPECT_TRUE(temporaries(o).empty());
    EXPECT_FALSE(fs::exists(o / "last.safetensors"));
    const fs::path log = o.string() + ".resume.log";
    ASSERT_EQ(run_to_end(train_args(data(), o, true), log), 0) << read_file(log);
    EXPECT_NE(read_file(log).find("at epoch 2, batch 0"), std::string::npos) << read_file(log);
    EXPECT_EQ(read_file(o / "last.safetensors"), straight_last_) << "resumed weights differ";
}
