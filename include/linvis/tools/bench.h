// Throughput, latency and memory measurement: the engine behind `linvis bench` and the harness the
// op benchmarks (bench/bench_ops.cpp) share.
//
// One BenchCase (model, resolution, batch, dtype, implementation, inference or training)
// is measured by measure_case() inside the calling process; `linvis bench` runs each case
// in a fresh child process (run_in_child) so that the peak resident memory it reports belongs
// to that case alone (not the lifetime maximum of a process that measured several models).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace linvis::tools {

struct BenchCase {
    std::string model;
    std::map<std::string, std::string> model_kwargs;
    int64_t res = 224;
    int64_t batch = 1;
    int threads = 0;               // 0: all cores
    std::string dtype = "f32";     // f32 | bf16
    std::string impl = "reference";  // auto | reference | fused: the model option impl (auto: the model's default)
    bool train = false;            // forward + backward instead of inference
    // classify: the classifier | features: the features_only backbone's forward_feature_maps (dense feature
    // extraction) | segment: the backbone + the `head` (models/segmentation.h, 128 channels, 11 classes),
    // with train: a segmentation training step (per-pixel cross-entropy, backward) | denoise: a diffusion
    // model's (DiT, DiT3, DiT5) denoising step as the samplers run it, forward_with_cfg on the batch doubled
    // with the null label (guidance 4), with train: a training step (training_losses at random t, backward) |
    // sample: the whole DDIM sampler of `sampler_steps` steps with guidance 4 (models::sample_class_conditional).
    // For denoise and sample `res` is the latent side L (input_size; 8L pixels through the VAE) and
    // images/s counts the undoubled batch.
    std::string task = "classify";
    std::string head = "upernet";  // segment: upernet | fpn
    int64_t sampler_steps = 10;    // sample: DDIM steps
    int warmup = 2;
    int iters = 5;                 // at most this many timed iterations ...
    double max_seconds = 60.0;     // ... stopping early (after at least 3) once this much time is spent
};

struct BenchResult {
    BenchCase config;
    std::string status = "ok";     // ok | error | check_failed
    std::string message;           // the error, or the check's outcome
    double images_per_s = 0.0;     // median over timed iterations
    double images_per_s_min = 0.0;
    double images_per_s_max = 0.0;
    double latency_ms = 0.0;       // median time of one iteration (one batch)
    int iterations = 0;
    int64_t peak_mem_bytes = 0;    // base_mem_bytes plus the passes' peak growth (PeakRssGrowth)
    int64_t base_mem_bytes = 0;    // resident set after the build and freed memory's release, before the passes
    int64_t packed_weight_bytes = 0;  // of the peak: weights kept in oneDNN's layout (flops::packed_weight_bytes)
    double gflops = 0.0;           // per image, one FLOP per multiply-add
    int64_t params = 0;
    double check_rel_err = -1.0;   // fused vs reference relative L2 error (fused runs only)
};

// Measures one case in this process. Never throws: failures are reported in status/message.
BenchResult measure_case(const BenchCase& bench_case);

// Single-precision matrix-product rate of this machine (GFLOP/s, 2 FLOPs per multiply-add, square n x n
// products): the faster of LibTorch's BLAS (torch::mm) and linvis's own products (flops::linear: oneDNN's sgemm
// where usable), each the median of `repeats` products. Not the slower of the two: on the 2-core AMX Xeon
// (2026-11-30) Debian's OpenBLAS ran 2048^3 at 229-265 GFLOP/s and oneDNN at 269-279, so a rate taken from the
// BLAS alone made every "share of the SGEMM rate" look up to 19 % better than it was.
double measure_sgemm_gflops(int64_t n = 2048, int repeats = 5);

// Relative L2 error between the fused and the reference implementation of `model` at a small
// resolution (the same weights in both), including input gradients when train is set. Diffusion models (tasks
// denoise and sample): the network's output for a label and the null label at a latent side of at most 16, on
// weights moved off the adaLN-Zero initialisation (under which every output is 0).
double check_fused_against_reference(const BenchCase& bench_case);

nlohmann::json to_json(const BenchResult& result);
BenchResult bench_result_from_json(const nlohmann::json& j);
nlohmann::json to_json(const BenchCase& bench_case);
BenchCase bench_case_from_json(const nlohmann::json& j);

// ---------------------------------------------------------------- timing and memory of a measurement

// The median of `values` (the mean of the middle two for an even count); 0 for none.
double median(std::vector<double> values);

// Runs `pass` `warmup` times untimed, then `reps` times (at least once) timed, and returns the seconds
// of each timed pass. Once `min_reps` passes are timed, stops early when the timed loop has taken more
// than `max_seconds`.
std::vector<double> time_passes(const std::function<void()>& pass, int warmup, int reps,
                                double max_seconds = std::numeric_limits<double>::infinity(), int min_reps = 3);

// The peak resident memory this process adds over what it holds when the object is made: the
// constructor returns the memory malloc holds free to the kernel (runtime::release_free_memory), resets
// the kernel's high-water mark (VmHWM, through /proc/self/clear_refs, where the kernel allows it) and
// notes the current resident set; bytes() is the high-water mark since then minus that. Make it once
// the inputs of a measurement exist, so that it reports what the measured work itself allocates at
// its peak.
class PeakRssGrowth {
public:
    PeakRssGrowth();
    int64_t bytes() const;
    int64_t base_bytes() const { return base_bytes_; }  // the resident set when it was made

private:
    int64_t base_bytes_ = 0;
};

// ---------------------------------------------------------------- measuring in a child process

// How a measurement in a child process ended.
struct ChildResult {
    enum class Status { Ok, NotStarted, TimedOut, KilledBySignal, ExitedNonZero, UnreadableOutput };
    Status status = Status::NotStarted;
    nlohmann::json json;   // Ok: the child's answer, the last line of its standard output, parsed
    std::string message;   // otherwise what went wrong, one line: "timed out after 900 s",
                           // "child killed by signal 9 (out of memory?)", "child exited with status 1", ...
    bool ok() const { return status == Status::Ok; }
};

// Runs this executable again (/proc/self/exe) with the arguments `args` (argv[1], ...) in a child
// process and waits for it. The child's standard output comes back through a pipe (its standard
// error is this process's); its answer is the last line it prints, one JSON value, and whatever it
// prints before is ignored. A child still running after `timeout_s` seconds is killed (SIGKILL).
// A child killed by a signal or exiting with a non-zero status is a failure even if it printed a
// JSON line. Never throws; safe to call from a multi-threaded process (the child only execs).
ChildResult run_in_child(const std::vector<std::string>& args, double timeout_s);

}  // namespace linvis::tools
