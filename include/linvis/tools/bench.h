// Throughput, latency and memory measurement of models, the engine behind `linvis bench`.
//
// One BenchCase (model, resolution, batch, dtype, implementation, inference or training)
// is measured by measure_case() inside the calling process; `linvis bench` runs each case
// in a fresh child process so that the peak resident memory it reports belongs to that
// case alone (not the lifetime maximum of a process that measured several models).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

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
    int64_t peak_mem_bytes = 0;    // peak resident set size of the measuring process
    int64_t base_mem_bytes = 0;    // resident set size after the model was built, before the first pass
    double gflops = 0.0;           // per image, one FLOP per multiply-add
    int64_t params = 0;
    double check_rel_err = -1.0;   // fused vs reference relative L2 error (fused runs only)
};

// Measures one case in this process. Never throws: failures are reported in status/message.
BenchResult measure_case(const BenchCase& bench_case);

// Single-precision matrix-product rate of this machine (GFLOP/s, 2 FLOPs per multiply-add,
// square n x n products through LibTorch's BLAS), median of several runs.
double measure_sgemm_gflops(int64_t n = 2048, int repeats = 5);

// Relative L2 error between the fused and the reference implementation of `model` at a small
// resolution (the same weights in both), including input gradients when train is set.
double check_fused_against_reference(const BenchCase& bench_case);

nlohmann::json to_json(const BenchResult& result);
BenchResult bench_result_from_json(const nlohmann::json& j);
nlohmann::json to_json(const BenchCase& bench_case);
BenchCase bench_case_from_json(const nlohmann::json& j);

// Current and peak resident set size of this process in bytes.
int64_t current_rss_bytes();
int64_t peak_rss_bytes();

}  // namespace linvis::tools
