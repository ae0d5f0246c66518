// Data-parallel training on PyTorch's c10d (ProcessGroupGloo, TCPStore rendezvous): every c10d call
// of linvis is in src/train/distributed.cpp, behind this interface.
//
//   * DistributedEnv: rank, world size and rendezvous address from the torchrun environment
//     (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
//   * Distributed: the process group; sums, broadcasts and barriers. A peer that died or did not
//     answer within the timeout makes every call throw linvis::Error naming this rank.
//   * GradientReducer: DistributedDataParallel's gradient averaging, which LibTorch's C++ frontend
//     lacks: hooks on the parameters copy each gradient into ~25 MB buckets (reverse parameter
//     order) and start a bucket's asynchronous all-reduce as soon as it is full, while the backward
//     pass goes on; finish() waits for them and writes the averages back before the optimiser step.
//   * launch_local_workers: 'linvis train --nproc-per-node N' re-executes the program N times with
//     the torchrun environment and supervises the workers (a dead or hung worker stops them all).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace linvis::train {

struct DistributedEnv {
    int64_t rank = 0;
    int64_t world_size = 1;
    int64_t local_rank = 0;
    int64_t local_world_size = 1;
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
};

// The torchrun variables; world size 1 when WORLD_SIZE is unset. Throws linvis::Error naming the
// variable when one is malformed (not a number, rank outside [0, WORLD_SIZE), MASTER_PORT outside 1..65535).
DistributedEnv distributed_env_from_environment();

class Distributed {
public:
    // Joins the process group: rank 0 serves the TCPStore at master_addr:master_port, every rank
    // connects to it. backend: "gloo" (CPU) or "nccl" (refused with an error naming the reason when
    // this LibTorch has no CUDA/NCCL). timeout_s bounds rendezvous and every collective.
    static std::shared_ptr<Distributed> create(const DistributedEnv& env, const std::string& backend,
                                               double timeout_s);
    virtual ~Distributed() = default;

    virtual int64_t rank() const = 0;
    virtual int64_t world_size() const = 0;
    virtual double timeout_seconds() const = 0;

    // An all-reduce in flight; wait() throws linvis::Error when it failed.
    class Work {
    public:
        virtual ~Work() = default;
        virtual void wait() = 0;
    };
    // Sums a contiguous CPU tensor over all ranks in place, asynchronously.
    virtual std::unique_ptr<Work> all_reduce_sum_async(torch::Tensor& tensor) = 0;
    void all_reduce_sum(torch::Tensor& tensor) { all_reduce_sum_async(tensor)->wait(); }
    // Replaces `tensor` on every rank by rank `root`'s.
    virtual void broadcast(torch::Tensor& tensor, int64_t root = 0) = 0;
    virtual void barrier() = 0;
};

// This process's place in a run: rank 0 of 1 without a process group. Rank 0 is the only one that
// writes files and prints.
struct ProcessPlace {
    int64_t rank = 0;
    int64_t world = 1;
    bool main() const { return rank == 0; }
};
ProcessPlace process_place(const Distributed* dist);

// Synchronised BatchNorm (linvis/nn/batch_norm.h) for the guard's lifetime when the run has more than one
// process; nothing otherwise.
class BatchNormSync {
public:
    explicit BatchNormSync(const std::shared_ptr<Distributed>& dist);
    ~BatchNormSync();
    BatchNormSync(const BatchNormSync&) = delete;
    BatchNormSync& operator=(const BatchNormSync&) = delete;

private:
    bool active_;
};

// Sum over all ranks whose backward sums the incoming gradients over all ranks (for synchronised
// BatchNorm statistics, linvis/nn/batch_norm.h).
torch::Tensor differentiable_all_reduce_sum(const std::shared_ptr<Distributed>& dist, const torch::Tensor& x);

// Sums doubles over the ranks in place (metrics of the global batch, a stop flag); a no-op without
// a process group or with one process.
void sum_over_ranks(Distributed* dist, std::vector<double>& values);

// Copies rank 0's parameters and buffers to every rank.
void broadcast_module(Distributed& dist, torch::nn::Module& module);

class GradientReducer {
public:
    // Buckets of bucket_bytes, except the first (the last layers' gradients), which is capped at
    // first_bucket_bytes so that communication starts early in the backward pass (as DDP does).
    GradientReducer(torch::nn::Module& model, std::shared_ptr<Distributed> dist, int64_t bucket_bytes = 25 << 20,
                    int64_t first_bucket_bytes = 1 << 20);
    ~GradientReducer();
    GradientReducer(const GradientReducer&) = delete;
    GradientReducer& operator=(const GradientReducer&) = delete;

    // Before each backward pass: sync=false for the micro-batches of gradient accumulation whose
    // gradients only accumulate locally, true for the last one before an optimiser step.
    void prepare(bool sync);
    // After the synchronised backward pass: starts the buckets not started yet (parameters that got
    // no gradient contribute zeros), waits for all, and sets every gradient to the mean over ranks.
    void finish();
    int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
    // Buckets whose all-reduce has started since prepare(true) (during backward: the overlap).
    int64_t buckets_started() const { return static_cast<int64_t>(next_to_launch_); }
    // Seconds spent waiting in finish() (the part of the communication not hidden by the backward pass).
    double wait_seconds() const { return wait_seconds_; }
    void reset_wait_seconds() { wait_seconds_ = 0.0; }

private:
    struct Bucket {
        std::vector<size_t> params;   // indices into params_
        std::vector<int64_t> offsets; // element offset of each parameter in `flat`
        torch::Tensor flat;
        int64_t pending = 0;          // parameters whose gradient has not arrived yet
        std::unique_ptr<Distributed::Work> work;
    };
    void on_gradient(size_t param, const torch::Tensor& grad);
    void launch_ready();

    std::shared_ptr<Distributed> dist_;
    std::vector<torch::Tensor> params_;
    std::vector<unsigned> hook_ids_;
    std::vector<size_t> bucket_of_, slot_of_;
    std::vector<char> arrived_;
    std::vector<Bucket> buckets_;
    size_t next_to_launch_ = 0;
    bool sync_ = false;
    double wait_seconds_ = 0.0;
};

// Tells the supervising 'linvis train --nproc-per-node' that this worker is making progress
// (called at every batch and evaluation step; a no-op without a supervisor).
void distributed_heartbeat();

// Runs `args` (the arguments after the program name) in `nproc` copies of this executable with
// RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (a free port on
// 127.0.0.1) and waits for them. When a worker exits non-zero, is killed, or stops making
// progress while the others wait on it for longer than timeout_s, the others are stopped and the
// launcher prints one line naming that rank and returns 1. SIGINT is passed on to the workers
// (which save once and stop); returns 130 then, 0 when every worker succeeded.
int launch_local_workers(const std::vector<std::string>& args, int64_t nproc, double timeout_s);

}  // namespace linvis::train
