// Every c10d call of linvis (LibTorch 1.13's and 2.x's ProcessGroupGloo, TCPStore); compiled with
// USE_C10D_GLOO (CMakeLists.txt), which LibTorch's headers need to declare the Gloo process group.
#include "linvis/train/distributed.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "linvis/core/error.h"
#include "linvis/nn/batch_norm.h"

extern char** environ;

namespace linvis::train {
namespace {

using Clock = std::chrono::steady_clock;

int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
    const char* text = std::getenv(name);
    if (text == nullptr || *text == '\0') return fallback;
    char* end = nullptr;
    errno = 0;
    const long long value = std::strtoll(text, &end, 10);
    LINVIS_CHECK(errno == 0 && end != text && *end == '\0' && value >= lo && value <= hi, "environment variable ",
                 name, ": expected an integer in [", lo, ", ", hi, "], got '", text, "'");
    return value;
}

// c10d's messages carry a C++ backtrace and several lines: the first line is the cause.
std::string first_line(const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::string text = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
    const auto newline = text.find('\n');
    return newline == std::string::npos ? text : text.substr(0, newline);
}

class GlooDistributed : public Distributed {
public:
    GlooDistributed(const DistributedEnv& env, double timeout_s) : env_(env), timeout_s_(timeout_s) {
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
        try {
            c10d::TCPStoreOptions options;
            options.port = static_cast<std::uint16_t>(env.master_port);
            options.isServer = env.rank == 0;
            options.numWorkers = static_cast<size_t>(env.world_size);
            options.waitWorkers = true;
            options.timeout = timeout;
            auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
            store_ = c10::make_intrusive<c10d::PrefixStore>("linvis", tcp);
            auto pg_options = c10d::ProcessGroupGloo::Options::create(timeout);
            // One machine: loopback only. Several: the interface GLOO_SOCKET_IFNAME names, else the
            // address this host's name resolves to (as torch.distributed does).
            const bool loopback = env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0;
            const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
            if (loopback)
                pg_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
            else if (ifname != nullptr && *ifname != '\0')
                pg_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
            else
                pg_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
            group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, static_cast<int>(env.rank),
                                                                 static_cast<int>(env.world_size), pg_options);
        } catch (const linvis::Error&) {
            throw;
        } catch (const std::exception& e) {
            fail("rank ", env.rank, ": could not join the process group of ", env.world_size, " at ", env.master_addr,
                 ":", env.master_port, " within ", timeout_s, " s: ", first_line(e));
        }
    }

    int64_t rank() const override { return env_.rank; }
    int64_t world_size() const override { return env_.world_size; }
    double timeout_seconds() const override { return timeout_s_; }

    class GlooWork : public Work {
    public:
        GlooWork(const GlooDistributed& owner, c10::intrusive_ptr<c10d::Work> work, const char* what)
            : owner_(owner), work_(std::move(work)), what_(what) {}
        void wait() override {
            if (!work_) return;
            try {
                work_->wait();
            } catch (const std::exception& e) {
                work_.reset();
                owner_.failed(what_, e);
            }
            work_.reset();
        }

    private:
        const GlooDistributed& owner_;
        c10::intrusive_ptr<c10d::Work> work_;
        const char* what_;
    };

    std::unique_ptr<Work> all_reduce_sum_async(torch::Tensor& tensor) override {
        LINVIS_CHECK(tensor.is_contiguous(), "all_reduce_sum: the tensor must be contiguous");
        std::vector<at::Tensor> tensors{tensor};
        c10d::AllreduceOptions options;
        options.reduceOp = c10d::ReduceOp::SUM;
        try {
            return std::make_unique<GlooWork>(*this, group_->allreduce(tensors, options), "all-reduce");
        } catch (const std::exception& e) {
            failed("all-reduce", e);
        }
    }

    void broadcast(torch::Tensor& tensor, int64_t root) override {
        std::vector<at::Tensor> tensors{tensor};
        c10d::BroadcastOptions options;
        options.rootRank = root;
        try {
            GlooWork(*this, group_->broadcast(tensors, options), "broadcast").wait();
        } catch (const linvis::Error&) {
            throw;
        } catch (const std::exception& e) {
            failed("broadcast", e);
        }
    }

    void barrier() override {
        try {
            GlooWork(*this, group_->barrier(), "barrier").wait();
        } catch (const linvis::Error&) {
            throw;
        } catch (const std::exception& e) {
            failed("barrier", e);
        }
    }

    [[noreturn]] void failed(const char* what, const std::exception& e) const {
        fail("rank ", env_.rank, " of ", env_.world_size, ": ", what,
             " failed (another worker exited, or did not answer within --dist-timeout ", timeout_s_,
             " s): ", first_line(e));
    }

private:
    DistributedEnv env_;
    double timeout_s_;
    c10::intrusive_ptr<c10d::Store> store_;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

// Sum over ranks forward, sum of the gradients over ranks backward.
struct AllReduceSumFunction : public torch::autograd::Function<AllReduceSumFunction> {
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t handle) {
        ctx->saved_data["handle"] = handle;
        torch::Tensor out = x.contiguous().clone();
        reinterpret_cast<Distributed*>(handle)->all_reduce_sum(out);
        return out;
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto* dist = reinterpret_cast<Distributed*>(ctx->saved_data["handle"].toInt());
        torch::Tensor grad = grads[0].contiguous().clone();
        dist->all_reduce_sum(grad);
        return {grad, torch::Tensor()};
    }
};

int heartbeat_fd() {
    static const int fd = [] {
        const char* text = std::getenv("LINVIS_DIST_HEARTBEAT_FD");
        return text != nullptr ? std::atoi(text) : -1;
    }();
    return fd;
}

}  // namespace

DistributedEnv distributed_env_from_environment() {
    DistributedEnv env;
    env.world_size = env_int("WORLD_SIZE", 1, 1, 1 << 20);
    env.rank = env_int("RANK", 0, 0, env.world_size - 1);
    env.local_rank = env_int("LOCAL_RANK", 0, 0, 1 << 20);
    env.local_world_size = env_int("LOCAL_WORLD_SIZE", env.world_size, 1, 1 << 20);
    env.master_port = static_cast<int>(env_int("MASTER_PORT", 29500, 1, 65535));
    if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') env.master_addr = addr;
    LINVIS_CHECK(env.world_size == 1 || std::getenv("RANK") != nullptr,
                 "environment variable RANK: required when WORLD_SIZE is ", env.world_size, ", but it is unset");
    return env;
}

std::shared_ptr<Distributed> Distributed::create(const DistributedEnv& env, const std::string& backend,
                                                 double timeout_s) {
    LINVIS_CHECK(timeout_s > 0, "--dist-timeout: expected a positive number of seconds, got ", timeout_s);
    if (backend == "nccl") {
        LINVIS_CHECK(torch::cuda::is_available(), "--dist-backend nccl: needs CUDA GPUs, and this LibTorch (",
                     TORCH_VERSION, ") sees none; use --dist-backend gloo");
        fail("--dist-backend nccl: linvis trains on the CPU and is built without c10d's ProcessGroupNCCL; "
             "use --dist-backend gloo");
    }
    LINVIS_CHECK(backend == "gloo", "--dist-backend: expected gloo or nccl, got '", backend, "'");
    return std::make_shared<GlooDistributed>(env, timeout_s);
}

torch::Tensor differentiable_all_reduce_sum(const std::shared_ptr<Distributed>& dist, const torch::Tensor& x) {
    return AllReduceSumFunction::apply(x, reinterpret_cast<int64_t>(dist.get()));
}

void broadcast_module(Distributed& dist, torch::nn::Module& module) {
    torch::NoGradGuard no_grad;
    auto send = [&](torch::Tensor& t) {
        torch::Tensor flat = t.detach().contiguous().clone();
        dist.broadcast(flat, 0);
        t.detach().copy_(flat);
    };
    for (auto& p : module.parameters(true)) send(p);
    for (auto& b : module.buffers(true)) send(b);
}

// ---------------------------------------------------------------- GradientReducer

GradientReducer::GradientReducer(torch::nn::Module& model, std::shared_ptr<Distributed> dist, int64_t bucket_bytes,
                                 int64_t first_bucket_bytes)
    : dist_(std::move(dist)) {
    LINVIS_CHECK(dist_ != nullptr, "GradientReducer: no process group");
    for (const auto& p : model.parameters(true))
        if (p.requires_grad()) params_.push_back(p);
    bucket_of_.assign(params_.size(), 0);
    slot_of_.assign(params_.size(), 0);
    arrived_.assign(params_.size(), 0);
    // Reverse order: the backward pass produces the last layers' gradients first.
    Bucket current;
    int64_t bytes = 0;
    auto close_bucket = [&] {
        if (current.params.empty()) return;
        int64_t numel = 0;
        for (size_t k = 0; k < current.params.size(); ++k) {
            current.offsets.push_back(numel);
            numel += params_[current.params[k]].numel();
        }
        current.flat = torch::zeros({numel}, params_[current.params.front()].options().requires_grad(false));
        buckets_.push_back(std::move(current));
        current = Bucket();
        bytes = 0;
    };
    for (size_t i = params_.size(); i-- > 0;) {
        const torch::Tensor& p = params_[i];
        LINVIS_CHECK(p.scalar_type() == params_.back().scalar_type(), "GradientReducer: parameters of one dtype "
                     "expected, got ", p.scalar_type(), " and ", params_.back().scalar_type());
        const int64_t cap = buckets_.empty() ? std::min(first_bucket_bytes, bucket_bytes) : bucket_bytes;
        if (!current.params.empty() && bytes + p.numel() * static_cast<int64_t>(p.element_size()) > cap)
            close_bucket();
        bucket_of_[i] = buckets_.size();
        slot_of_[i] = current.params.size();
        current.params.push_back(i);
        bytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
    close_bucket();
    for (size_t i = 0; i < params_.size(); ++i)
        hook_ids_.push_back(params_[i].register_hook([this, i](torch::Tensor grad) { on_gradient(i, grad); }));
}

GradientReducer::~GradientReducer() {
    for (size_t i = 0; i < hook_ids_.size(); ++i) {
        try {
            params_[i].remove_hook(hook_ids_[i]);
        } catch (...) {
        }
    }
    // Pending all-reduces write into the buckets: let them finish (or fail) first.
    for (auto& bucket : buckets_) {
        try {
            if (bucket.work) bucket.work->wait();
        } catch (...) {
        }
    }
}

void GradientReducer::prepare(bool sync) {
    sync_ = sync;
    if (!sync) return;
    std::fill(arrived_.begin(), arrived_.end(), 0);
    for (auto& bucket : buckets_) {
        bucket.pending = static_cast<int64_t>(bucket.params.size());
        bucket.work.reset();
    }
    next_to_launch_ = 0;
}

void GradientReducer::on_gradient(size_t param, const torch::Tensor& grad) {
    if (!sync_ || arrived_[param]) return;
    torch::NoGradGuard no_grad;
    Bucket& bucket = buckets_[bucket_of_[param]];
    const torch::Tensor& p = params_[param];
    torch::Tensor slot = bucket.flat.narrow(0, bucket.offsets[slot_of_[param]], p.numel()).view(p.sizes());
    // The hook runs before the gradient is accumulated into .grad: earlier micro-batches are in .grad.
    slot.copy_(grad);
    if (p.grad().defined()) slot.add_(p.grad());
    arrived_[param] = 1;
    if (--bucket.pending == 0) launch_ready();
}

void GradientReducer::launch_ready() {
    // In bucket order on every rank, so that the collectives pair up.
    while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_].pending == 0) {
        Bucket& bucket = buckets_[next_to_launch_++];
        bucket.work = dist_->all_reduce_sum_async(bucket.flat);
    }
}

void GradientReducer::finish() {
    LINVIS_CHECK(sync_, "GradientReducer::finish without prepare(true)");
    torch::NoGradGuard no_grad;
    for (size_t b = next_to_launch_; b < buckets_.size(); ++b) {
        Bucket& bucket = buckets_[b];
        for (size_t k = 0; k < bucket.params.size(); ++k) {
            const size_t i = bucket.params[k];
            if (arrived_[i]) continue;
            torch::Tensor slot = bucket.flat.narrow(0, bucket.offsets[k], params_[i].numel());
            if (params_[i].grad().defined()) slot.copy_(params_[i].grad().reshape({-1}));
            else slot.zero_();
        }
        bucket.pending = 0;
    }
    launch_ready();
    const auto start = Clock::now();
    for (auto& bucket : buckets_) bucket.work->wait();
    wait_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
    const double scale = 1.0 / static_cast<double>(dist_->world_size());
    for (auto& bucket : buckets_) {
        for (size_t k = 0; k < bucket.params.size(); ++k) {
            torch::Tensor& p = params_[bucket.params[k]];
            torch::Tensor mean = bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes()) * scale;
            if (p.grad().defined()) p.mutable_grad().copy_(mean);
            else p.mutable_grad() = mean;
        }
        bucket.work.reset();
    }
    sync_ = false;
}

void distributed_heartbeat() {
    const int fd = heartbeat_fd();
    if (fd < 0) return;
    const char beat = '.';
    [[maybe_unused]] const ssize_t n = write(fd, &beat, 1);  // a full pipe (EAGAIN) loses a beat: harmless
}

// ---------------------------------------------------------------- launcher

namespace {

std::atomic<int> g_launcher_sigint{0};
std::atomic<int> g_launcher_sigterm{0};
void launcher_on_sigint(int) { g_launcher_sigint.fetch_add(1); }
void launcher_on_sigterm(int) { g_launcher_sigterm.fetch_add(1); }

int free_local_port() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    LINVIS_CHECK(fd >= 0, "--nproc-per-node: socket() failed: ", std::strerror(errno));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    const int error = errno;
    close(fd);
    LINVIS_CHECK(ok, "--nproc-per-node: no free port on 127.0.0.1: ", std::strerror(error));
    return ntohs(addr.sin_port);
}

std::string describe_status(int status) {
    if (WIFSIGNALED(status)) {
        const int sig = WTERMSIG(status);
        return str_cat("was killed by signal ", sig, " (", strsignal(sig), ")");
    }
    return str_cat("exited with status ", WEXITSTATUS(status));
}

struct Worker {
    pid_t pid = -1;
    int heartbeat = -1;   // read end
    int64_t beats = 0;
    bool running = true;
    int status = 0;
};

void stop_workers(std::vector<Worker>& workers) {
    for (auto& w : workers)
        if (w.running) {
            kill(w.pid, SIGTERM);
            kill(w.pid, SIGCONT);  // a stopped worker acts on SIGTERM only once continued
        }
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    for (;;) {
        bool any = false;
        for (auto& w : workers) {
            if (!w.running) continue;
            if (waitpid(w.pid, &w.status, WNOHANG) == w.pid) w.running = false;
            else any = true;
        }
        if (!any) return;
        if (Clock::now() > deadline) {
            for (auto& w : workers)
                if (w.running) kill(w.pid, SIGKILL);
        }
        usleep(20000);
    }
}

}  // namespace

int launch_local_workers(const std::vector<std::string>& args, int64_t nproc, double timeout_s) {
    LINVIS_CHECK(nproc >= 1, "--nproc-per-node: expected a positive number, got ", nproc);
    LINVIS_CHECK(timeout_s > 0, "--dist-timeout: expected a positive number of seconds, got ", timeout_s);
    const int port = free_local_port();
    // Everything the children need is built before fork(): after it only async-signal-safe calls.
    std::vector<std::string> base_env;
    for (char** e = environ; *e != nullptr; ++e) {
        const std::string entry = *e;
        const std::string key = entry.substr(0, entry.find('='));
        if (key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "LOCAL_WORLD_SIZE" ||
            key == "MASTER_ADDR" || key == "MASTER_PORT" || key == "LINVIS_DIST_HEARTBEAT_FD")
            continue;
        base_env.push_back(entry);
    }
    std::vector<std::string> argv_storage{"/proc/self/exe"};
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_storage) argv.push_back(a.data());
    argv.push_back(nullptr);

    std::signal(SIGINT, launcher_on_sigint);
    std::signal(SIGTERM, launcher_on_sigterm);
    std::vector<Worker> workers(static_cast<size_t>(nproc));
    for (int64_t rank = 0; rank < nproc; ++rank) {
        int fds[2];
        LINVIS_CHECK(pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, "--nproc-per-node: pipe() failed: ",
                     std::strerror(errno));
        std::vector<std::string> env = base_env;
        env.push_back(str_cat("RANK=", rank));
        env.push_back(str_cat("WORLD_SIZE=", nproc));
        env.push_back(str_cat("LOCAL_RANK=", rank));
        env.push_back(str_cat("LOCAL_WORLD_SIZE=", nproc));
        env.push_back("MASTER_ADDR=127.0.0.1");
        env.push_back(str_cat("MASTER_PORT=", port));
        env.push_back(str_cat("LINVIS_DIST_HEARTBEAT_FD=", fds[1]));
        std::vector<char*> envp;
        for (auto& e : env) envp.push_back(e.data());
        envp.push_back(nullptr);
        const pid_t parent = getpid();
        const pid_t pid = fork();
        LINVIS_CHECK(pid >= 0, "--nproc-per-node: fork() failed: ", std::strerror(errno));
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);  // the launcher gone: no orphaned worker
            if (getppid() != parent) _exit(1);
            fcntl(fds[1], F_SETFD, 0);         // the heartbeat pipe survives exec
            execve("/proc/self/exe", argv.data(), envp.data());
            _exit(127);
        }
        close(fds[1]);
        workers[static_cast<size_t>(rank)].pid = pid;
        workers[static_cast<size_t>(rank)].heartbeat = fds[0];
    }

    int sigints_forwarded = 0;
    auto last_progress = Clock::now();
    int result = 0;
    std::string failure;
    for (;;) {
        // Forward every Ctrl-C (a terminal sends it to the workers too; a second copy is harmless).
        const int sigints = g_launcher_sigint.load();
        for (; sigints_forwarded < sigints; ++sigints_forwarded)
            for (auto& w : workers)
                if (w.running) kill(w.pid, SIGINT);
        if (g_launcher_sigterm.load() > 0) {
            stop_workers(workers);
            failure = "stopped by SIGTERM";
            result = 143;
            break;
        }
        std::vector<pollfd> fds;
        for (auto& w : workers) fds.push_back({w.heartbeat, POLLIN, 0});
        poll(fds.data(), fds.size(), 100);
        char buffer[4096];
        for (auto& w : workers) {
            ssize_t n;
            while ((n = read(w.heartbeat, buffer, sizeof(buffer))) > 0) {
                w.beats += n;
                last_progress = Clock::now();
            }
        }
        // Every worker that ended since the last look (a killed worker ends before the peers it breaks).
        std::vector<size_t> failed;
        bool any_running = false;
        for (size_t r = 0; r < workers.size(); ++r) {
            Worker& w = workers[r];
            if (w.running && waitpid(w.pid, &w.status, WNOHANG) == w.pid) {
                w.running = false;
                const bool interrupted = sigints_forwarded > 0 && WIFEXITED(w.status) && WEXITSTATUS(w.status) == 130;
                if (!(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0) && !interrupted) failed.push_back(r);
            }
            any_running = any_running || w.running;
        }
        if (!failed.empty()) {
            // The cause: a worker killed by a signal; else a worker that is still there after the
            // others gave up on it (it hung: the others timed out waiting for it); else the failed
            // worker that got least far.
            size_t culprit = failed.front();
            bool signalled = false;
            for (size_t r : failed)
                if (WIFSIGNALED(workers[r].status)) {
                    culprit = r;
                    signalled = true;
                    break;
                }
            bool hung = false;
            if (!signalled) {
                // The healthy workers fail within moments of each other (the same collective broke).
                const auto grace_end = Clock::now() + std::chrono::duration<double>(std::min(timeout_s, 10.0) + 1.0);
                bool waiting = true;
                while (waiting && Clock::now() < grace_end) {
                    waiting = false;
                    for (auto& w : workers)
                        if (w.running && waitpid(w.pid, &w.status, WNOHANG) == w.pid) w.running = false;
                    for (auto& w : workers) waiting = waiting || w.running;
                    if (waiting) usleep(50000);
                }
                for (size_t r = 0; r < workers.size(); ++r)
                    if (workers[r].running && (!hung || workers[r].beats < workers[culprit].beats)) {
                        culprit = r;
                        hung = true;
                    }
                if (!hung)
                    for (size_t r : failed)
                        if (workers[r].beats < workers[culprit].beats) culprit = r;
            }
            failure = hung ? str_cat("rank ", culprit, " stopped making progress (hung); the others gave up after ",
                                     timeout_s, " s (--dist-timeout)")
                           : str_cat("rank ", culprit, " ", describe_status(workers[culprit].status));
            stop_workers(workers);
            result = 1;
            break;
        }
        if (!any_running) break;
        // Nobody progressing for well past the collective timeout: the workers themselves should have
        // given up; stop them and name the one furthest behind.
        if (Clock::now() - last_progress > std::chrono::duration<double>(2.0 * timeout_s + 30.0)) {
            size_t culprit = 0;
            for (size_t r = 0; r < workers.size(); ++r)
                if (workers[r].running && workers[r].beats < workers[culprit].beats) culprit = r;
            failure = str_cat("rank ", culprit, " stopped making progress (hung); no worker progressed for ",
                              2.0 * timeout_s + 30.0, " s");
            stop_workers(workers);
            result = 1;
            break;
        }
    }
    for (auto& w : workers) close(w.heartbeat);
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    if (result != 0) {
        std::fprintf(stderr, "linvis train: error: %s; stopped the other workers (%lld processes)\n",
                     failure.c_str(), static_cast<long long>(nproc));
        return result;
    }
    return sigints_forwarded > 0 ? 130 : 0;
}

ProcessPlace process_place(const Distributed* dist) {
    return dist ? ProcessPlace{dist->rank(), dist->world_size()} : ProcessPlace{};
}

BatchNormSync::BatchNormSync(const std::shared_ptr<Distributed>& dist) : active_(dist && dist->world_size() > 1) {
    if (active_)
        nn::set_batch_norm_sync([dist](const torch::Tensor& x) { return differentiable_all_reduce_sum(dist, x); });
}

BatchNormSync::~BatchNormSync() {
    if (active_) nn::set_batch_norm_sync({});
}

void sum_over_ranks(Distributed* dist, std::vector<double>& values) {
    if (dist == nullptr || dist->world_size() == 1) return;
    torch::Tensor t = torch::tensor(values, torch::kFloat64);
    dist->all_reduce_sum(t);
    for (size_t i = 0; i < values.size(); ++i) values[i] = t[static_cast<int64_t>(i)].item<double>();
}

}  // namespace linvis::train
