// Fused CPU kernels against their references at the size of a 1024x1024 image (patch 16: 4096
// tokens), the tiny models' widths, batch 1. One subcommand per op:
//
//   build/bench_ops ttt_linear [--threads 2] [--tokens 4096] [--heads 3] [--head-dim 64]
//                                    [--mini-batch 16] [--checkpoint-every 4] [--reps 5]
//   build/bench_ops vit3_t5 [--threads 2] [--iters 5] [--side 64]
//   build/bench_ops mlstm [--threads 2] [--reps 5] [--model-reps 3] [--tokens 4096]
//                               [--skip-model]
//   build/bench_ops attention [--threads 2] [--tokens 4097] [--heads 3] [--head-dim 64]
//                                   [--reps 5]
//   build/bench_ops depthwise_conv [--threads 2] [--reps 20] [--side 64] [--dtype f32|bf16]
//   build/bench_ops layer_norm [--threads 2] [--reps 50] [--width 192]
//   build/bench_ops neighborhood_attention [--threads 2] [--reps 20]
//
// ttt_linear: the TTT-Linear scan of vittt_tiny (3 heads of d = 64, mini-batches of 16).
// vit3_t5: the ViT³ TTT mixer (vit3_ttt_mix, both branches; C = 192, 6 heads of d = 32), the T⁵ TTT
//   attention (t5_ttt_attention_qkv; C = 192, 3 heads of d = 64) and DiT⁵'s TTT branch (dit5_ttt_attention on
//   the chunks of qkv; the same widths).
// mlstm: the chunkwise mLSTM of vil_tiny (4 heads, DH = DV = 96, chunks of 64) against the reference
//   parallel and chunkwise forms; its head-wise q/k/v projection (S x 384, 96 blocks of 4 x 4: fused
//   kernel vs the official einsum); and, unless --skip-model, the whole vil_tiny at 1024x1024 (fused
//   chunkwise vs the official parallel form).
// attention: deit_tiny's softmax attention (3 heads of d = 64), the flash-style kernel against the
//   reference that materialises the T x T weights.
// depthwise_conv: the depthwise convolutions on tokens (ops/depthwise_conv.h): vittt_tiny's / vit3_tiny's
//   residual 3x3 (C = 192), ViL's silu(3x3) on a chunk of the up-projection (C = 384, token stride 768)
//   and vittt_tiny's causal Conv1d (C = 192, k = 4). --dtype bf16 times both implementations on bfloat16
//   inputs (the models' --dtype bf16), checked as bfloat16 against the float64 truth first.
// layer_norm: the models' LayerNorm (ops/layer_norm.h) on (rows, 192) with weight and bias, for 197
//   (a 224-px image and its class token), 4096 (1024 px) and 16384 (2048 px) rows.
// neighborhood_attention: DiT5-S's 5 x 5 neighbourhood attention (6 heads of d = 64) on a guided step's batch of 2,
//   on token grids 16, 32 and 64 (latent sides 32, 64 and 128), q, k and v the permuted views of one (2, N, 3C)
//   projection that DiT5 passes.
//
// Each op is first checked on the benchmark inputs: the fused output and every input gradient
// against a float64 truth, next to the float32 reference's own error. An op that fails prints no
// timing and the program exits with status 1. Then every case (implementation x forward or
// forward+backward) runs in a fresh child process (this program with the same arguments plus
// --child CASE, see tools::run_in_child) that builds its inputs and reports the median time of
// --reps/--iters passes after one warm-up and its peak RSS growth over the RSS once the inputs
// exist (tools::PeakRssGrowth): what that case alone allocates at its peak. Each op also prints this
// machine's SGEMM rate and the rate its fused products reach. One case alone, in this process (e.g.
// under a profiler): `bench_ops ttt_linear --reps 100 --child fused_train`.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <optional>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "../src/ops/mlstm/cpu.h"
#include "../src/ops/simd/simd.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/models/registry.h"
#include "linvis/ops/attention.h"
#include "linvis/ops/depthwise_conv.h"
#include "linvis/ops/layer_norm.h"
#include "linvis/ops/neighborhood_attention.h"
#include "linvis/ops/linear_headwise.h"
#include "linvis/ops/mlstm.h"
#include "linvis/ops/t5_ttt.h"
#include "linvis/ops/ttt_linear.h"
#include "linvis/ops/vit3_ttt.h"
#include "linvis/tools/bench.h"

namespace {

namespace ops = linvis::ops;
namespace runtime = linvis::runtime;
namespace tools = linvis::tools;
using ops::Impl;
using torch::Tensor;

// ================================================================ shared by the ops

// What every subcommand shares, and how a case is measured in a child process.
struct Harness {
    int threads = 2;
    double case_timeout = 3600;      // the reference vil_tiny pass alone takes minutes on a loaded machine
    std::string child;               // set in a child: the case it measures
    std::vector<std::string> args;   // this program's arguments, given again to every child
    bool failed = false;             // a check or a child failed: the exit status is 1

    // Parent: the median time (ms), peak RSS growth (MiB) and whole answer of case `name`, measured in a
    // child process. nullopt when the child failed; the reason is on stderr and `failed` is set.
    struct Measured {
        double ms = 0, peak_mib = 0;
        nlohmann::json answer;
    };
    std::optional<Measured> measure(const std::string& name) {
        std::vector<std::string> child_args = args;
        child_args.insert(child_args.end(), {"--child", name});
        const tools::ChildResult result = tools::run_in_child(child_args, case_timeout);
        if (!result.ok()) {
            std::fprintf(stderr, "bench_ops: case %s: %s\n", name.c_str(), result.message.c_str());
            failed = true;
            return std::nullopt;
        }
        return Measured{result.json.at("ms").get<double>(),
                        result.json.at("peak_bytes").get<double>() / (1024.0 * 1024.0), result.json};
    }
};

void add_harness_options(CLI::App& app, Harness& harness) {
    app.add_option("--threads", harness.threads, "intra-op threads");
    app.add_option("--case-timeout", harness.case_timeout, "kill a case's child process after S seconds")
        ->check(CLI::PositiveNumber);
    app.add_option("--child", harness.child, "internal: measure one case in this process (also for profilers)")
        ->group("");
}

// Child: the median time of `pass` in ms (`reps` timed passes after `warmup`) and its peak RSS growth
// over the RSS now: the caller builds its inputs first. The answer the parent reads, once printed.
nlohmann::json measure_passes(const std::function<void()>& pass, int warmup, int reps) {
    const tools::PeakRssGrowth peak;
    const double seconds = tools::median(tools::time_passes(pass, warmup, reps));
    return {{"ms", seconds * 1e3}, {"peak_bytes", peak.bytes()}};
}

int print_answer(const nlohmann::json& answer) {
    std::cout << answer.dump() << std::endl;
    return 0;
}

// The rate of `measure` with `threads` LibTorch/BLAS threads, the harness's own count restored after.
double with_threads(int threads, int restore, const std::function<double()>& measure) {
    runtime::configure_threads(threads);
    const double rate = measure();
    runtime::configure_threads(restore);
    return rate;
}

// An op on its list of inputs.
using OpFn = std::function<Tensor(const std::vector<Tensor>&)>;

// Copies of `inputs` in `dtype` that require grad: the leaves of a forward+backward pass.
std::vector<Tensor> leaves_of(const std::vector<Tensor>& inputs, torch::ScalarType dtype = torch::kFloat32) {
    std::vector<Tensor> leaves;
    for (const auto& t : inputs) leaves.push_back(t.detach().to(dtype).clone().requires_grad_(true));
    return leaves;
}

// The output of `op` in `dtype` and the gradients of sum(output * probe) w.r.t. every input.
std::vector<Tensor> output_and_grads(const OpFn& op, const std::vector<Tensor>& inputs, const Tensor& probe,
                                     torch::ScalarType dtype) {
    std::vector<Tensor> leaves = leaves_of(inputs, dtype);
    Tensor out = op(leaves);
    std::vector<Tensor> results = torch::autograd::grad({out}, leaves, {probe.to(dtype)});
    results.insert(results.begin(), out.detach());
    return results;
}

double rel_err(const Tensor& actual, const Tensor& expected) {
    const Tensor e = expected.to(torch::kFloat64);
    return ((actual.to(torch::kFloat64) - e).norm() / e.norm()).item<double>();
}

// The check of one op on the benchmark inputs before anything is timed.
struct OpCheck {
    std::vector<std::string> names;  // the output's, then each input gradient's
    std::vector<Tensor> inputs;      // float32
    Tensor probe;                    // the output cotangent
    OpFn truth;                      // a reference form, run in float64
    OpFn reference, fused;           // run in `dtype`
    double tolerance;
    torch::ScalarType dtype = torch::kFloat32;
};

// Fused and float32 reference results against the float64 truth, one line per tensor. A tensor passes
// when the fused error is below the tolerance or at most twice the float32 reference's own error (for
// a long sum, float32 rounding alone can exceed a fixed bound).
bool passes(const OpCheck& check, const std::string& what) {
    const auto truth = output_and_grads(check.truth, check.inputs, check.probe, torch::kFloat64);
    const auto reference = output_and_grads(check.reference, check.inputs, check.probe, check.dtype);
    const auto fused = output_and_grads(check.fused, check.inputs, check.probe, check.dtype);
    bool ok = true;
    for (size_t t = 0; t < truth.size(); ++t) {
        const double e = rel_err(fused[t], truth[t]), r = rel_err(reference[t], truth[t]);
        const bool pass = e < check.tolerance || e <= 2 * r;
        std::printf("  check %-12s rel L2 err vs float64 truth: fused %.2e, reference %s %.2e, "
                    "fused vs reference %.2e %s\n", check.names[t].c_str(), e,
                    check.dtype == torch::kFloat32 ? "f32" : c10::toString(check.dtype), r,
                    rel_err(fused[t], reference[t]), pass ? "ok" : "FAIL");
        ok = ok && pass;
    }
    std::printf("%s check (fused error < %.0e or <= 2x the reference's): %s\n", what.c_str(), check.tolerance,
                ok ? "PASS" : "FAIL: its timings are withheld");
    return ok;
}

// The table of the ops timed as fused against reference per case and mode (depthwise_conv, layer_norm): each
// case is first checked against its float64 truth (check_of(name), printed by passes), then its forward and
// training passes are timed in child processes "<case>_<fwd|train>_<reference|fused>".
void print_fused_vs_reference(Harness& h, const std::vector<std::string>& cases,
                              const std::function<OpCheck(const std::string&)>& check_of, const char* case_label,
                              const char* ms_format) {
    std::vector<std::string> table;
    for (const std::string& name : cases) {
        if (!passes(check_of(name), name)) {
            h.failed = true;
            continue;
        }
        for (const std::string mode : {"fwd", "train"}) {
            const auto ref = h.measure(name + "_" + mode + "_reference");
            const auto fused = h.measure(name + "_" + mode + "_fused");
            if (!ref || !fused) continue;
            char ms[64];
            std::snprintf(ms, sizeof(ms), ms_format, ref->ms, fused->ms);
            char row[256];
            std::snprintf(row, sizeof(row), "%-12s %-5s | %s %6.2fx | %9.1f %9.1f", name.c_str(), mode.c_str(), ms,
                          ref->ms / fused->ms, ref->peak_mib, fused->peak_mib);
            table.push_back(row);
        }
    }
    std::printf("\n%-12s %-5s | %9s %9s %7s | %9s %9s\n", case_label, "mode", "ref ms", "fused ms", "speedup",
                "ref MiB", "fused MiB");
    for (const auto& row : table) std::printf("%s\n", row.c_str());
    std::printf("\nMiB: peak RSS of the child process above its RSS after building the inputs.\n");
}

// One timed pass: the forward without autograd, or forward and backward w.r.t. every input: of the
// loss sum(output * probe), or for a cotangent of ones when `probe` is undefined (no loss temporaries;
// the ViT³ and T⁵ cases have always been measured so, the others with the loss). The leaves keep the
// inputs' dtype.
std::function<void()> op_pass(const OpFn& op, const std::vector<Tensor>& inputs, const Tensor& probe, bool train) {
    if (!train) {
        return [op, inputs] {
            torch::NoGradGuard no_grad;
            op(inputs);
        };
    }
    return [op, leaves = leaves_of(inputs, inputs.front().scalar_type()), probe] {
        const Tensor out = op(leaves);
        if (probe.defined()) torch::autograd::grad({(out * probe).sum()}, leaves);
        else torch::autograd::grad({out}, leaves, {torch::ones_like(out)});
    };
}

// "vit3_train_fused" -> {"vit3", "train", "fused"}.
std::vector<std::string> split_case(const std::string& name) {
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t end; (end = name.find('_', start)) != std::string::npos; start = end + 1)
        parts.push_back(name.substr(start, end - start));
    parts.push_back(name.substr(start));
    return parts;
}

[[noreturn]] void unknown_case(const std::string& name) {
    linvis::fail("--child: unknown case '", name, "'");
}

// ================================================================ ttt_linear

struct TttLinearOptions {
    int64_t tokens = 4096, heads = 3, head_dim = 64, mini_batch = 16;
    int64_t checkpoint_every = ops::TttLinearOptions{}.checkpoint_every;
    int reps = 5;
};

// Model-like scales: q/k/v as after the projections, lr = sigmoid(.)/d as ttt_learning_rate.
std::vector<Tensor> ttt_linear_inputs(const TttLinearOptions& o) {
    torch::manual_seed(0);
    const int64_t T = o.tokens, nh = o.heads, d = o.head_dim;
    return {torch::randn({1, nh, T, d}), torch::randn({1, nh, T, d}), torch::randn({1, nh, T, d}),
            torch::sigmoid(torch::randn({1, nh, T})) / static_cast<double>(d), 0.01 * torch::randn({o.mini_batch}),
            0.02 * torch::randn({nh, d, d}), torch::zeros({nh, 1, d}), torch::ones({nh, d}), torch::zeros({nh, d})};
}

OpFn ttt_linear_op(Impl impl, const TttLinearOptions& o) {
    return [impl, o](const std::vector<Tensor>& x) {
        ops::TttLinearOptions options;
        options.mini_batch_size = o.mini_batch;
        options.checkpoint_every = o.checkpoint_every;
        return ops::ttt_linear(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], options, impl).output;
    };
}

int run_ttt_linear(const TttLinearOptions& o, Harness& h) {
    const std::vector<Tensor> inputs = ttt_linear_inputs(o);
    const Tensor probe = torch::randn({1, o.heads, o.tokens, o.head_dim});
    if (!h.child.empty()) {  // <reference|fused>_<fwd|train>
        const auto parts = split_case(h.child);
        if (parts.size() != 2) unknown_case(h.child);
        const OpFn op = ttt_linear_op(ops::parse_impl(parts[0]), o);
        return print_answer(measure_passes(op_pass(op, inputs, probe, parts[1] == "train"), 1, o.reps));
    }
    std::printf("TTT-Linear, B=1 T=%lld nh=%lld d=%lld b=%lld, checkpoint every %lld, %d thread(s), SIMD %s, "
                "OMP_WAIT_POLICY=%s\n",
                static_cast<long long>(o.tokens), static_cast<long long>(o.heads), static_cast<long long>(o.head_dim),
                static_cast<long long>(o.mini_batch), static_cast<long long>(o.checkpoint_every), h.threads, runtime::simd_name(runtime::detect_simd()),
                runtime::openmp_wait_policy().c_str());
    const OpFn reference = ttt_linear_op(Impl::Reference, o);
    if (!passes({{"output", "dq", "dk", "dv", "dlr", "dtoken_idx", "dw0", "db0", "dln_weight", "dln_bias"}, inputs,
                 probe, reference, reference, ttt_linear_op(Impl::Fused, o), 1e-4},
                "TTT-Linear"))
        return 1;

    // Inner-product MACs. Forward (as the FLOP counter): 3 M d^2 + 2 M^2 d per mini-batch and
    // head. The fused backward executes 12 M d^2 + 6 M^2 d more (state recompute 2 M d^2, full
    // mini-batch recompute 3 M d^2 + 2 M^2 d, adjoints 7 M d^2 + 4 M^2 d).
    double fwd_macs = 0, bwd_macs = 0;
    const double d = static_cast<double>(o.head_dim);
    for (int64_t s = 0; s < o.tokens; s += o.mini_batch) {
        const double M = static_cast<double>(std::min(o.mini_batch, o.tokens - s));
        fwd_macs += o.heads * (3 * M * d * d + 2 * M * M * d);
        bwd_macs += o.heads * (12 * M * d * d + 6 * M * M * d);
    }
    const double sgemm = tools::measure_sgemm_gflops(1024, 5);
    std::printf("SGEMM (1024^2, %d thread(s)): %.1f GFLOP/s\n", h.threads, sgemm);

    const auto ref_fwd = h.measure("reference_fwd"), ref_train = h.measure("reference_train");
    const auto fused_fwd = h.measure("fused_fwd"), fused_train = h.measure("fused_train");
    if (!ref_fwd || !ref_train || !fused_fwd || !fused_train) return 1;
    const double gf_ref = 2 * fwd_macs / ref_fwd->ms * 1e-6;
    const double gf_fwd = 2 * fwd_macs / fused_fwd->ms * 1e-6;
    const double gf_train = 2 * (fwd_macs + bwd_macs) / fused_train->ms * 1e-6;
    std::printf("%-10s %-14s %10s %12s %10s\n", "impl", "case", "median ms", "peak MiB", "GFLOP/s");
    std::printf("%-10s %-14s %10.2f %12.1f %10.1f\n", "reference", "forward", ref_fwd->ms, ref_fwd->peak_mib, gf_ref);
    std::printf("%-10s %-14s %10.2f %12.1f %10s\n", "reference", "fwd+bwd", ref_train->ms, ref_train->peak_mib, "-");
    std::printf("%-10s %-14s %10.2f %12.1f %10.1f\n", "fused", "forward", fused_fwd->ms, fused_fwd->peak_mib, gf_fwd);
    std::printf("%-10s %-14s %10.2f %12.1f %10.1f\n", "fused", "fwd+bwd", fused_train->ms, fused_train->peak_mib,
                gf_train);
    std::printf("speedup forward %.2fx, fwd+bwd %.2fx; peak memory ratio (reference/fused) forward %.1fx, "
                "fwd+bwd %.1fx; fused inner products at %.0f%% (forward) / %.0f%% (fwd+bwd) of SGEMM\n",
                ref_fwd->ms / fused_fwd->ms, ref_train->ms / fused_train->ms,
                ref_fwd->peak_mib / std::max(fused_fwd->peak_mib, 1e-3),
                ref_train->peak_mib / std::max(fused_train->peak_mib, 1e-3), 100 * gf_fwd / sgemm,
                100 * gf_train / sgemm);
    return 0;
}

// ================================================================ attention

struct AttentionOptions {
    int64_t tokens = 4097, heads = 3, head_dim = 64;  // deit_tiny at 1024x1024: 64^2 patches + the class token
    int reps = 5;
};

OpFn attention_op(Impl impl, double scale) {
    return [impl, scale](const std::vector<Tensor>& x) {
        return ops::softmax_attention(x[0], x[1], x[2], scale, {}, impl);
    };
}

int run_attention(const AttentionOptions& o, Harness& h) {
    torch::manual_seed(0);
    const std::vector<Tensor> inputs = {torch::randn({1, o.heads, o.tokens, o.head_dim}),
                                        torch::randn({1, o.heads, o.tokens, o.head_dim}),
                                        torch::randn({1, o.heads, o.tokens, o.head_dim})};
    const Tensor probe = torch::randn({1, o.heads, o.tokens, o.head_dim});
    const double scale = 1.0 / std::sqrt(static_cast<double>(o.head_dim));
    if (!h.child.empty()) {  // <reference|fused>_<fwd|train>
        const auto parts = split_case(h.child);
        if (parts.size() != 2) unknown_case(h.child);
        const OpFn op = attention_op(ops::parse_impl(parts[0]), scale);
        return print_answer(measure_passes(op_pass(op, inputs, probe, parts[1] == "train"), 1, o.reps));
    }
    std::printf("softmax attention, B=1 T=%lld h=%lld d=%lld, %d thread(s), SIMD %s (kernels: %s), "
                "OMP_WAIT_POLICY=%s\n",
                static_cast<long long>(o.tokens), static_cast<long long>(o.heads), static_cast<long long>(o.head_dim),
                h.threads, runtime::simd_name(runtime::detect_simd()), ops::fused_kernel_target(),
                runtime::openmp_wait_policy().c_str());
    const OpFn reference = attention_op(Impl::Reference, scale);
    if (!passes({{"output", "dq", "dk", "dv"}, inputs, probe, reference, reference, attention_op(Impl::Fused, scale),
                 1e-4},
                "softmax attention"))
        return 1;
    // Forward: q k^T and P v, T^2 d each per head. The fused backward recomputes q k^T and does four more
    // products (dV, dP, dK, dQ): 5 T^2 d per head.
    const double t2d = static_cast<double>(o.tokens) * o.tokens * o.head_dim * o.heads;
    const double fwd_macs = 2 * t2d, bwd_macs = 5 * t2d;
    const double sgemm = tools::measure_sgemm_gflops(1024, 5);
    std::printf("SGEMM (1024^2, %d thread(s)): %.1f GFLOP/s\n", h.threads, sgemm);
    const auto ref_fwd = h.measure("reference_fwd"), ref_train = h.measure("reference_train");
    const auto fused_fwd = h.measure("fused_fwd"), fused_train = h.measure("fused_train");
    if (!ref_fwd || !ref_train || !fused_fwd || !fused_train) return 1;
    const double gf_fwd = 2 * fwd_macs / fused_fwd->ms * 1e-6;
    const double gf_train = 2 * (fwd_macs + bwd_macs) / fused_train->ms * 1e-6;
    std::printf("%-10s %-14s %10s %12s\n", "impl", "case", "median ms", "peak MiB");
    std::printf("%-10s %-14s %10.2f %12.1f\n", "reference", "forward", ref_fwd->ms, ref_fwd->peak_mib);
    std::printf("%-10s %-14s %10.2f %12.1f\n", "reference", "fwd+bwd", ref_train->ms, ref_train->peak_mib);
    std::printf("%-10s %-14s %10.2f %12.1f\n", "fused", "forward", fused_fwd->ms, fused_fwd->peak_mib);
    std::printf("%-10s %-14s %10.2f %12.1f\n", "fused", "fwd+bwd", fused_train->ms, fused_train->peak_mib);
    std::printf("speedup forward %.2fx, fwd+bwd %.2fx; peak memory ratio (reference/fused) forward %.1fx, "
                "fwd+bwd %.1fx; fused products at %.0f%% (forward) / %.0f%% (fwd+bwd) of SGEMM\n",
                ref_fwd->ms / fused_fwd->ms, ref_train->ms / fused_train->ms,
                ref_fwd->peak_mib / std::max(fused_fwd->peak_mib, 1e-3),
                ref_train->peak_mib / std::max(fused_train->peak_mib, 1e-3), 100 * gf_fwd / sgemm,
                100 * gf_train / sgemm);
    return 0;
}

// ================================================================ depthwise_conv

struct DepthwiseConvOptions {
    int reps = 20;
    int64_t side = 64;  // token grid side (1024 / 16)
    std::string dtype = "f32";
    torch::ScalarType type() const { return dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32; }
};

const char* const kDepthwiseOps[] = {"residual3x3", "silu3x3", "causal1d"};

// x (1, N, C) (for silu3x3 the (1, N, 768) up-projection, whose first half the op reads), weight, bias.
std::vector<Tensor> depthwise_inputs(const std::string& op, int64_t side) {
    torch::manual_seed(0);
    const int64_t N = side * side;
    if (op == "residual3x3") return {torch::randn({1, N, 192}), 0.3 * torch::randn({192, 1, 3, 3}), torch::randn({192})};
    if (op == "silu3x3") return {torch::randn({1, N, 768}), 0.3 * torch::randn({384, 1, 3, 3}), torch::randn({384})};
    return {torch::randn({1, N, 192}), 0.3 * torch::randn({192, 1, 4}), torch::randn({192})};
}

OpFn depthwise_op(const std::string& op, Impl impl, int64_t side) {
    if (op == "residual3x3")
        return [impl, side](const std::vector<Tensor>& x) {
            return ops::depthwise_conv2d_tokens(x[0], side, side, x[1], x[2], ops::DwEpilogue::Residual, impl);
        };
    if (op == "silu3x3")
        return [impl, side](const std::vector<Tensor>& x) {
            return ops::depthwise_conv2d_tokens(x[0].chunk(2, -1)[0], side, side, x[1], x[2], ops::DwEpilogue::Silu,
                                                impl);
        };
    return [impl](const std::vector<Tensor>& x) { return ops::causal_depthwise_conv1d_tokens(x[0], x[1], x[2], impl); };
}

int run_depthwise_conv(const DepthwiseConvOptions& o, Harness& h) {
    if (!h.child.empty()) {  // <op>_<fwd|train>_<reference|fused>
        const auto parts = split_case(h.child);
        if (parts.size() != 3) unknown_case(h.child);
        std::vector<Tensor> inputs = depthwise_inputs(parts[0], o.side);
        for (Tensor& t : inputs) t = t.to(o.type());
        const OpFn op = depthwise_op(parts[0], ops::parse_impl(parts[2]), o.side);
        return print_answer(measure_passes(op_pass(op, inputs, Tensor(), parts[1] == "train"), 2, o.reps));
    }
    std::printf("depthwise_conv: %lld x %lld tokens, %s, batch 1, threads %d, reps %d, SIMD %s (fused kernels: %s), "
                "OpenMP wait: %s\n",
                static_cast<long long>(o.side), static_cast<long long>(o.side), o.dtype.c_str(), h.threads, o.reps,
                runtime::simd_name(runtime::detect_simd()), ops::fused_kernel_target(),
                runtime::openmp_wait_policy().c_str());
    print_fused_vs_reference(
        h, std::vector<std::string>(std::begin(kDepthwiseOps), std::end(kDepthwiseOps)),
        [&](const std::string& op) {
            const OpFn reference = depthwise_op(op, Impl::Reference, o.side);
            torch::manual_seed(1);
            const Tensor probe = torch::randn({1, o.side * o.side, op == "silu3x3" ? 384 : 192});
            // bf16: the fused kernel rounds its output once (2^-9 relative), the reference more often.
            return OpCheck{{"output", "dx", "dweight", "dbias"}, depthwise_inputs(op, o.side), probe, reference,
                           reference, depthwise_op(op, Impl::Fused, o.side),
                           o.type() == torch::kFloat32 ? 1e-5 : 1e-2, o.type()};
        },
        "op", "%9.3f %9.3f");
    return h.failed ? 1 : 0;
}

// ================================================================ layer_norm

struct LayerNormOptions {
    int reps = 50;
    int64_t width = 192;  // the tiny models' C
};

const int64_t kLayerNormRows[] = {197, 4096, 16384};

// x (rows, C), weight, bias.
std::vector<Tensor> layer_norm_inputs(int64_t rows, int64_t width) {
    torch::manual_seed(0);
    return {torch::randn({rows, width}) * 2 + 0.5, torch::randn({width}) * 0.5 + 1, torch::randn({width}) * 0.3};
}

OpFn layer_norm_op(Impl impl) {
    return [impl](const std::vector<Tensor>& x) { return ops::layer_norm(x[0], {x[0].size(-1)}, x[1], x[2], 1e-6, impl); };
}

int run_layer_norm(const LayerNormOptions& o, Harness& h) {
    if (!h.child.empty()) {  // <rows>_<fwd|train>_<reference|fused>
        const auto parts = split_case(h.child);
        if (parts.size() != 3) unknown_case(h.child);
        const std::vector<Tensor> inputs = layer_norm_inputs(std::stoll(parts[0]), o.width);
        const OpFn op = layer_norm_op(ops::parse_impl(parts[2]));
        return print_answer(measure_passes(op_pass(op, inputs, Tensor(), parts[1] == "train"), 3, o.reps));
    }
    std::printf("layer_norm: (rows, %lld) with weight and bias, threads %d, reps %d, SIMD %s (fused kernels: %s), "
                "OpenMP wait: %s\n",
                static_cast<long long>(o.width), h.threads, o.reps, runtime::simd_name(runtime::detect_simd()),
                ops::fused_kernel_target(), runtime::openmp_wait_policy().c_str());
    std::vector<std::string> cases;
    for (const int64_t rows : kLayerNormRows) cases.push_back(std::to_string(rows));
    print_fused_vs_reference(
        h, cases,
        [&](const std::string& rows) {
            torch::manual_seed(1);
            const Tensor probe = torch::randn({std::stoll(rows), o.width});
            const OpFn reference = layer_norm_op(Impl::Reference);
            return OpCheck{{"output", "dx", "dweight", "dbias"}, layer_norm_inputs(std::stoll(rows), o.width), probe,
                           reference, reference, layer_norm_op(Impl::Fused), 1e-5};
        },
        "rows", "%9.4f %9.4f");
    return h.failed ? 1 : 0;
}

// ================================================================ neighborhood_attention

struct NeighborhoodOptions {
    int reps = 20;
};

constexpr int64_t kNaHeads = 6, kNaHeadDim = 64, kNaKernel = 5;
const int64_t kNaSides[] = {16, 32, 64};

// q, k, v (2, heads, side, side, d): permuted views of one (2, side^2, 3C) tensor, as DiT5 hands them over.
std::vector<Tensor> neighborhood_inputs(int64_t side) {
    torch::manual_seed(0);
    const int64_t C = kNaHeads * kNaHeadDim;
    const Tensor qkv = torch::randn({2, side * side, 3 * C});
    std::vector<Tensor> views;
    for (int64_t i = 0; i < 3; ++i)
        views.push_back(
            qkv.narrow(2, i * C, C).reshape({2, side, side, kNaHeads, kNaHeadDim}).permute({0, 3, 1, 2, 4}));
    return views;
}

OpFn neighborhood_op(Impl impl) {
    return [impl](const std::vector<Tensor>& x) {
        return ops::neighborhood_attention_2d(x[0], x[1], x[2], kNaKernel, 1.0 / std::sqrt(double(kNaHeadDim)),
                                              ops::NatSmallGrid::WholeAxis, impl);
    };
}

int run_neighborhood_attention(const NeighborhoodOptions& o, Harness& h) {
    if (!h.child.empty()) {  // <side>_<fwd|train>_<reference|fused>
        const auto parts = split_case(h.child);
        if (parts.size() != 3) unknown_case(h.child);
        const std::vector<Tensor> inputs = neighborhood_inputs(std::stoll(parts[0]));
        const OpFn op = neighborhood_op(ops::parse_impl(parts[2]));
        return print_answer(measure_passes(op_pass(op, inputs, Tensor(), parts[1] == "train"), 3, o.reps));
    }
    std::printf("neighborhood_attention: batch 2, %lld heads of d = %lld, %lld x %lld windows, threads %d, reps %d, "
                "SIMD %s (fused kernels: %s), OpenMP wait: %s\n",
                static_cast<long long>(kNaHeads), static_cast<long long>(kNaHeadDim), static_cast<long long>(kNaKernel),
                static_cast<long long>(kNaKernel), h.threads, o.reps, runtime::simd_name(runtime::detect_simd()),
                ops::fused_kernel_target(), runtime::openmp_wait_policy().c_str());
    std::vector<std::string> cases;
    for (const int64_t side : kNaSides) cases.push_back(std::to_string(side));
    print_fused_vs_reference(
        h, cases,
        [&](const std::string& side) {
            torch::manual_seed(1);
            const int64_t n = std::stoll(side);
            const Tensor probe = torch::randn({2, kNaHeads, n, n, kNaHeadDim});
            const OpFn reference = neighborhood_op(Impl::Reference);
            return OpCheck{{"output", "dq", "dk", "dv"}, neighborhood_inputs(n), probe, reference, reference,
                           neighborhood_op(Impl::Fused), 1e-5};
        },
        "grid side", "%9.3f %9.3f");
    return h.failed ? 1 : 0;
}

// ================================================================ vit3_t5

struct Vit3T5Options {
    int iters = 5;
    int64_t side = 64;  // token grid side (1024 / 16)
};

constexpr int64_t kVit3T5Width = 192;

std::vector<Tensor> vit3_t5_inputs(const std::string& op, int64_t side) {
    torch::manual_seed(0);
    const int64_t N = side * side, C = kVit3T5Width;
    if (op == "vit3") {
        const int64_t h = 6, d = C / h;
        return {torch::randn({1, N, 3 * C + 3 * d}), 0.02 * torch::randn({1, h, d, d}),
                0.02 * torch::randn({1, h, d, d}), 0.02 * torch::randn({d, 1, 3, 3})};
    }
    const int64_t h = 3, d = C / h;
    if (op == "dit5")  // qkv, w1, w2, qk_scale_ttt, qk_offset_ttt, the q and k convs
        return {torch::randn({1, N, 3 * C}), 0.02 * torch::randn({1, h, d, d}), 0.02 * torch::randn({1, h, d, d}),
                1.0 + 0.1 * torch::randn({1, 1, C, 2}), 0.1 * torch::randn({1, 1, C, 2}),
                0.2 * torch::randn({C, 1, 3, 3}), 0.1 * torch::randn({C}), 0.2 * torch::randn({C, 1, 3, 3}),
                0.1 * torch::randn({C})};
    return {torch::randn({1, N, 3 * C}), 0.02 * torch::randn({1, h, d, d}), 0.02 * torch::randn({1, h, d, d}),
            0.02 * torch::randn({1, h, d, d}), 0.2 * torch::randn({C, 1, 3, 3}), 0.1 * torch::randn({C}),
            0.2 * torch::randn({C, 1, 3, 3}), 0.1 * torch::randn({C})};
}

OpFn vit3_t5_op(const std::string& op, Impl impl, int64_t side) {
    if (op == "vit3") {
        return [impl, side](const std::vector<Tensor>& x) {
            return ops::vit3_ttt_mix(x[0], x[1], x[2], x[3], 6, side, side, {}, impl);
        };
    }
    if (op == "dit5") {  // DiT5's TTT branch on the chunks of qkv, as the model calls it
        return [impl, side](const std::vector<Tensor>& x) {
            const std::vector<Tensor> qkv = x[0].chunk(3, -1);
            return ops::dit5_ttt_attention(qkv[0], qkv[1], qkv[2],
                                           ops::Dit5TttParams{x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8]}, 3, side,
                                           side, impl);
        };
    }
    return [impl, side](const std::vector<Tensor>& x) {
        return ops::t5_ttt_attention_qkv(x[0], ops::T5TttParams{x[1], x[2], x[3], x[4], x[5], x[6], x[7]}, 3, side,
                                         side, impl);
    };
}

// The output cotangent of the check: vit3_ttt_mix returns (1, N, C + d), the T⁵ and DiT⁵ attentions (1, N, C).
Tensor vit3_t5_probe(const std::string& op, int64_t side) {
    torch::manual_seed(1);
    return torch::randn({1, side * side, kVit3T5Width + (op == "vit3" ? kVit3T5Width / 6 : 0)});
}

// Matmul MACs of the fused kernels (forward; forward + backward), see docs/perf_vit3_t5.md.
double vit3_t5_matmul_macs(const std::string& op, bool train, int64_t side) {
    const double N = static_cast<double>(side * side), C = kVit3T5Width;
    if (op == "vit3") return (train ? 22.0 : 6.0) * N * C * (C / 6);
    if (op == "dit5") return (train ? 25.0 : 7.0) * N * C * (C / 3);
    return (train ? 32.0 : 9.0) * N * C * (C / 3);
}

// Micro-kernel alone on the block shapes of one head: Z = K_blk W (256 x d x d) and G += K_blkᵀ P.
double microkernel_gflops(int64_t d) {
    const auto& kernels = ops::simd::kernels();
    const int64_t T = 256, reps = 2000;
    std::vector<float> a(T * d, 0.5f), w(d * d, 0.25f), c(T * d), g(d * d);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r) {
        kernels.gemm(T, d, d, a.data(), d, 1, w.data(), d, c.data(), d, false);
        kernels.gemm(d, d, T, a.data(), 1, d, c.data(), d, g.data(), d, false);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return 2.0 * 2.0 * T * d * d * reps / seconds * 1e-9;
}

int run_vit3_t5(const Vit3T5Options& o, Harness& h) {
    if (!h.child.empty()) {  // <vit3|t5|dit5>_<fwd|train>_<reference|fused>
        const auto parts = split_case(h.child);
        if (parts.size() != 3 || (parts[0] != "vit3" && parts[0] != "t5" && parts[0] != "dit5")) unknown_case(h.child);
        // A fixed mmap threshold: every large tensor is its own mapping, returned on free, so the peak
        // RSS is the peak of simultaneously live memory (glibc's adaptive threshold would otherwise
        // keep freed blocks of earlier iterations resident, differently for each implementation).
        mallopt(M_MMAP_THRESHOLD, 256 * 1024);
        const std::vector<Tensor> inputs = vit3_t5_inputs(parts[0], o.side);
        const OpFn op = vit3_t5_op(parts[0], ops::parse_impl(parts[2]), o.side);
        return print_answer(measure_passes(op_pass(op, inputs, Tensor(), parts[1] == "train"), 1, o.iters));
    }
    const auto info = runtime::query();
    std::printf("vit3_t5: %lld x %lld tokens, batch 1, C = %lld, threads %d, iters %d, OpenMP wait: %s\n",
                static_cast<long long>(o.side), static_cast<long long>(o.side),
                static_cast<long long>(kVit3T5Width), h.threads, o.iters, runtime::openmp_wait_policy().c_str());
    std::printf("BLAS: %s; SIMD: %s (fused kernels: %s)\n", info.blas.c_str(), runtime::simd_name(info.simd),
                ops::fused_kernel_target());
    const double sgemm = tools::measure_sgemm_gflops();
    std::printf("SGEMM 2048^3 through LibTorch, %d threads: %.1f GFLOP/s\n", h.threads, sgemm);
    double micro32 = 0, micro64 = 0;
    const double sgemm1 = with_threads(1, h.threads, [&] {
        micro32 = microkernel_gflops(32);
        micro64 = microkernel_gflops(64);
        return tools::measure_sgemm_gflops();
    });
    std::printf("SGEMM 2048^3, 1 thread: %.1f GFLOP/s\n", sgemm1);
    std::printf("fused micro-kernel, 1 thread, 256-token blocks (X W and Xᵀ Y): d=32 %.1f GFLOP/s (%.0f%% of 1-thread "
                "SGEMM), d=64 %.1f GFLOP/s (%.0f%%)\n",
                micro32, 100.0 * micro32 / sgemm1, micro64, 100.0 * micro64 / sgemm1);

    const std::map<std::string, std::vector<std::string>> gradient_names = {
        {"vit3", {"output", "dqkv", "dw1", "dw2", "dw3"}},
        {"t5", {"output", "dqkv", "dw1", "dw2", "dw3", "dq_conv_w", "dq_conv_b", "dk_conv_w", "dk_conv_b"}},
        {"dit5", {"output", "dqkv", "dw1", "dw2", "dqk_scale", "dqk_offset", "dq_conv_w", "dq_conv_b", "dk_conv_w",
                  "dk_conv_b"}}};
    std::vector<std::string> table;
    for (const std::string op : {"vit3", "t5", "dit5"}) {
        const OpFn reference = vit3_t5_op(op, Impl::Reference, o.side);
        if (!passes({gradient_names.at(op), vit3_t5_inputs(op, o.side), vit3_t5_probe(op, o.side), reference,
                     reference, vit3_t5_op(op, Impl::Fused, o.side), 1e-4},
                    op)) {
            h.failed = true;
            continue;
        }
        for (const std::string mode : {"fwd", "train"}) {
            const auto ref = h.measure(op + "_" + mode + "_reference");
            const auto fused = h.measure(op + "_" + mode + "_fused");
            if (!ref || !fused) continue;
            const double gf = 2.0 * vit3_t5_matmul_macs(op, mode == "train", o.side) / (fused->ms * 1e-3) * 1e-9;
            char row[256];
            std::snprintf(row, sizeof(row), "%-5s %-5s | %10.2f %10.2f %6.2fx | %11.1f %11.1f %6.1fx | %.1f (%.0f%%)",
                          op.c_str(), mode.c_str(), ref->ms, fused->ms, ref->ms / fused->ms, ref->peak_mib,
                          fused->peak_mib, ref->peak_mib / std::max(fused->peak_mib, 1.0 / 1048576.0), gf,
                          100.0 * gf / sgemm);
            table.push_back(row);
        }
    }
    std::printf("\n%-5s %-5s | %10s %10s %7s | %11s %11s %7s | %s\n", "op", "mode", "ref ms", "fused ms", "speedup",
                "ref MiB", "fused MiB", "mem x", "fused matmul GFLOP/s (% of SGEMM)");
    for (const auto& row : table) std::printf("%s\n", row.c_str());
    std::printf("\nMiB: peak RSS of the child process above its RSS after building the inputs.\n"
                "fused matmul GFLOP/s: matmul FLOPs of the fused algorithm / whole fused op time (lower bound).\n");
    return h.failed ? 1 : 0;
}

// ================================================================ mlstm

struct MlstmOptions {
    int reps = 5, model_reps = 3;
    int64_t tokens = 4096;
    bool skip_model = false;
};

constexpr int64_t kMlstmHeads = 4, kMlstmDim = 96, kMlstmChunk = 64;
constexpr int64_t kHeadwiseBlocks = kMlstmHeads * kMlstmDim / 4;  // I = 384 features in 4 x 4 blocks
constexpr int kHeadwiseCallsPerPass = 20;  // one call takes well under a millisecond at small S

// q, k, v, input and forget gate pre-activations; then the output cotangent.
std::vector<Tensor> mlstm_inputs(int64_t S) {
    torch::manual_seed(7);
    const int64_t NH = kMlstmHeads, D = kMlstmDim;
    return {torch::randn({1, NH, S, D}), torch::randn({1, NH, S, D}), torch::randn({1, NH, S, D}),
            2.0f * torch::randn({1, NH, S, 1}), 3.0f + 1.5f * torch::randn({1, NH, S, 1})};
}

// "parallel" and "chunkwise": the reference forms; "fused": the fused chunkwise kernel.
OpFn mlstm_op(const std::string& form) {
    if (form != "parallel" && form != "chunkwise" && form != "fused") linvis::fail("unknown mLSTM form '", form, "'");
    return [form](const std::vector<Tensor>& x) {
        if (form == "parallel") return ops::mlstm(x[0], x[1], x[2], x[3], x[4], ops::MlstmMode::Parallel);
        return ops::mlstm(x[0], x[1], x[2], x[3], x[4], ops::MlstmMode::Chunkwise, kMlstmChunk, ops::kMlstmEps,
                          form == "fused" ? Impl::Fused : Impl::Reference);
    };
}

// x, block weights, bias; then the output cotangent.
std::vector<Tensor> headwise_inputs(int64_t S, Tensor& probe) {
    torch::manual_seed(8);
    std::vector<Tensor> inputs{torch::randn({1, S, kHeadwiseBlocks * 4}), 0.3f * torch::randn({kHeadwiseBlocks, 4, 4}),
                               torch::randn({kHeadwiseBlocks * 4})};
    probe = torch::randn({1, S, kHeadwiseBlocks * 4});
    return inputs;
}

OpFn headwise_op(Impl impl) {
    return [impl](const std::vector<Tensor>& x) { return ops::linear_headwise(x[0], x[1], x[2], impl); };
}

linvis::models::ModelPtr make_vil(const std::string& impl) {
    torch::manual_seed(0);  // the same weights in every process and for both implementations
    linvis::models::ModelConfig config;
    config.set("img_size", int64_t{1024});
    config.set("impl", impl);
    config.set("mlstm_mode", std::string(impl == "fused" ? "chunkwise" : "parallel"));
    auto model = linvis::models::create_model("vil_tiny", config);
    model->eval();
    return model;
}

// Child: one case, named op_<fwd|fwdbwd>_<parallel|chunkwise|fused>, hw_<fwd|fwdbwd>_<reference|fused> or
// model_fwd_<reference|fused>. A model case also reports its logits, for the parent's check.
int run_mlstm_case(const MlstmOptions& o, const std::string& name) {
    const auto parts = split_case(name);
    if (parts.size() != 3) unknown_case(name);
    const bool train = parts[1] == "fwdbwd";
    if (parts[0] == "op") {
        const std::vector<Tensor> inputs = mlstm_inputs(o.tokens);
        const Tensor probe = torch::randn({1, kMlstmHeads, o.tokens, kMlstmDim});
        return print_answer(measure_passes(op_pass(mlstm_op(parts[2]), inputs, probe, train), 1, o.reps));
    }
    if (parts[0] == "hw") {
        Tensor probe;
        const std::vector<Tensor> inputs = headwise_inputs(o.tokens, probe);
        const auto once = op_pass(headwise_op(ops::parse_impl(parts[2])), inputs, probe, train);
        nlohmann::json answer = measure_passes(
            [&] {
                for (int k = 0; k < kHeadwiseCallsPerPass; ++k) once();
            },
            1, o.reps);
        answer["ms"] = answer["ms"].get<double>() / kHeadwiseCallsPerPass;
        return print_answer(answer);
    }
    if (parts[0] != "model") unknown_case(name);
    auto model = make_vil(parts[2]);
    torch::manual_seed(9);
    const Tensor x = torch::randn({1, 3, 1024, 1024});
    Tensor logits;
    // One warm-up pass only when several are timed (the reference pass takes minutes here).
    nlohmann::json answer = measure_passes(
        [&] {
            torch::NoGradGuard no_grad;
            logits = model->forward(x);
        },
        o.model_reps > 1 ? 1 : 0, o.model_reps);
    const Tensor flat = logits.contiguous().view(-1);
    answer["logits"] = std::vector<float>(flat.data_ptr<float>(), flat.data_ptr<float>() + flat.numel());
    return print_answer(answer);
}

int run_mlstm(const MlstmOptions& o, Harness& h) {
    if (!h.child.empty()) return run_mlstm_case(o, h.child);
    const auto info = runtime::query();
    std::printf("mlstm: S=%lld tokens, batch 1, %lld heads, DH=DV=%lld, chunk %lld, threads %d, simd %s, "
                "fused path %s, OpenMP wait: %s\n",
                static_cast<long long>(o.tokens), static_cast<long long>(kMlstmHeads),
                static_cast<long long>(kMlstmDim), static_cast<long long>(kMlstmChunk), h.threads,
                runtime::simd_name(info.simd), ops::fused_kernel_target(),
                runtime::openmp_wait_policy().c_str());
    const double sgemm = tools::measure_sgemm_gflops(1024, 5);
    std::printf("SGEMM rate (1024^3, LibTorch BLAS, %d threads): %.1f GFLOP/s\n", h.threads, sgemm);
    // The matmul parts alone: the kernel's own tiles on the forward's chunk shapes, one thread,
    // next to a one-thread SGEMM measured right after.
    double tiles = 0;
    const double sgemm1 = with_threads(1, h.threads, [&] {
        tiles = ops::cpu::mlstm_fused_gemm_gflops(kMlstmChunk, kMlstmDim, kMlstmDim, 1.0);
        return tools::measure_sgemm_gflops(1024, 5);
    });
    std::printf("fused GEMM tiles (chunk shapes %lldx%lldx%lld, 1 thread): %.1f GFLOP/s = %.0f%% of 1-thread SGEMM "
                "(%.1f GFLOP/s)\n", static_cast<long long>(kMlstmChunk), static_cast<long long>(kMlstmDim),
                static_cast<long long>(kMlstmDim), tiles, 100.0 * tiles / sgemm1, sgemm1);

    // The op. The truth is the reference chunkwise form in float64 (equal to the parallel form to
    // rounding, tests/test_mlstm.cpp); the float32 reference is the parallel form.
    const std::vector<Tensor> op_inputs = mlstm_inputs(o.tokens);
    const Tensor op_probe = torch::randn({1, kMlstmHeads, o.tokens, kMlstmDim});
    if (passes({{"h", "dq", "dk", "dv", "digate", "dfgate"}, op_inputs, op_probe, mlstm_op("chunkwise"),
                mlstm_op("parallel"), mlstm_op("fused"), 1e-4},
               "op")) {
        std::printf("\n%-28s %12s %14s\n", "op case (S tokens)", "median ms", "peak MiB");
        std::vector<double> ms, mib;
        for (const char* name : {"op_fwd_parallel", "op_fwd_chunkwise", "op_fwd_fused", "op_fwdbwd_parallel",
                                 "op_fwdbwd_chunkwise", "op_fwdbwd_fused"}) {
            const auto r = h.measure(name);
            if (!r) break;
            std::printf("%-28s %12.2f %14.1f\n", name, r->ms, r->peak_mib);
            ms.push_back(r->ms);
            mib.push_back(r->peak_mib);
        }
        if (ms.size() == 6) {
            // Multiply-adds of the fused forward's chunk products (dense L x L blocks, mask applied after).
            const double L = static_cast<double>(std::min<int64_t>(kMlstmChunk, o.tokens));
            const double fwd_flops = 2.0 * kMlstmHeads * o.tokens * (L * 2 * kMlstmDim + 2.0 * kMlstmDim * kMlstmDim);
            std::printf("\nforward speedup fused vs parallel: %.2fx, vs reference chunkwise: %.2fx\n", ms[0] / ms[2],
                        ms[1] / ms[2]);
            std::printf("fwd+bwd speedup fused vs parallel: %.2fx, vs reference chunkwise: %.2fx\n", ms[3] / ms[5],
                        ms[4] / ms[5]);
            std::printf("fwd+bwd peak memory ratio parallel / fused: %.1fx, reference chunkwise / fused: %.1fx\n",
                        mib[3] / std::max(mib[5], 1e-3), mib[4] / std::max(mib[5], 1e-3));
            const double rate = fwd_flops / (ms[2] * 1e-3) * 1e-9;
            std::printf("fused forward: %.3f GFLOP in products -> %.1f GFLOP/s over the whole kernel time "
                        "(%.0f%% of SGEMM)\n", fwd_flops * 1e-9, rate, 100.0 * rate / sgemm);
        }
    } else {
        h.failed = true;
    }

    // The head-wise projection: fused vs the official einsum, both against the reference in float64.
    std::printf("\nhead-wise q/k/v projection: x (%lld, %lld), %lld blocks of 4 x 4, float32\n",
                static_cast<long long>(o.tokens), static_cast<long long>(kHeadwiseBlocks * 4),
                static_cast<long long>(kHeadwiseBlocks));
    Tensor hw_probe;
    const std::vector<Tensor> hw_inputs = headwise_inputs(o.tokens, hw_probe);
    const OpFn hw_reference = headwise_op(Impl::Reference);
    if (passes({{"y", "dx", "dweight", "dbias"}, hw_inputs, hw_probe, hw_reference, hw_reference,
                headwise_op(Impl::Fused), 1e-5},
               "head-wise")) {
        std::vector<double> ms;
        for (const char* name : {"hw_fwd_reference", "hw_fwd_fused", "hw_fwdbwd_reference", "hw_fwdbwd_fused"}) {
            const auto r = h.measure(name);
            if (!r) break;
            std::printf("%-28s %12.3f ms\n", name, r->ms);
            ms.push_back(r->ms);
        }
        if (ms.size() == 4)
            std::printf("head-wise speedup fused vs einsum: forward %.2fx, fwd+bwd %.2fx\n", ms[0] / ms[1],
                        ms[2] / ms[3]);
    } else {
        h.failed = true;
    }

    if (o.skip_model) return h.failed ? 1 : 0;
    // Too large for a float64 truth: fused logits against the reference model's, both from the timed
    // children, before either time is printed.
    std::printf("\nmodel: vil_tiny 1024x1024 (4096 tokens), batch 1, inference forward, median of %d\n", o.model_reps);
    const auto ref = h.measure("model_fwd_reference");
    const auto fused = h.measure("model_fwd_fused");
    if (!ref || !fused) return 1;
    const double model_err = rel_err(torch::tensor(fused->answer.at("logits").get<std::vector<float>>()),
                                     torch::tensor(ref->answer.at("logits").get<std::vector<float>>()));
    const bool model_ok = model_err < 1e-3;
    std::printf("model check: logits rel L2 err fused vs reference %.2e (bound 1e-3): %s\n", model_err,
                model_ok ? "PASS" : "FAIL: its timings are withheld");
    if (!model_ok) return 1;
    std::printf("%-40s %12.1f ms %10.1f MiB\n", "reference (mlstm_mode parallel)", ref->ms, ref->peak_mib);
    std::printf("%-40s %12.1f ms %10.1f MiB\n", "fused (mlstm_mode chunkwise, impl fused)", fused->ms,
                fused->peak_mib);
    std::printf("model forward speedup fused chunkwise vs reference parallel: %.2fx\n", ref->ms / fused->ms);
    return h.failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
    runtime::restart_with_runtime_environment(argv);  // OpenMP wait and OpenBLAS kernels, as the linvis command
    Harness harness;
    harness.args.assign(argv + 1, argv + argc);
    CLI::App app("Fused CPU kernels against their references: checks, then time and peak memory of each case "
                 "in its own child process",
                 "bench_ops");
    app.option_defaults()->always_capture_default();
    app.require_subcommand(1);

    TttLinearOptions ttt;
    CLI::App* ttt_command = app.add_subcommand("ttt_linear", "fused vs reference TTT-Linear scan");
    ttt_command->add_option("--tokens", ttt.tokens, "sequence length (4096 = 1024x1024 image, patch 16)");
    ttt_command->add_option("--heads", ttt.heads, "heads (vittt_tiny: 3)");
    ttt_command->add_option("--head-dim", ttt.head_dim, "head dim");
    ttt_command->add_option("--mini-batch", ttt.mini_batch, "mini-batch size");
    ttt_command->add_option("--checkpoint-every", ttt.checkpoint_every,
                            "fused backward: (W, b) checkpointed every this many mini-batches")
        ->check(CLI::PositiveNumber);
    ttt_command->add_option("--reps", ttt.reps, "timed repetitions (median)")->check(CLI::PositiveNumber);

    Vit3T5Options vit3_t5;
    CLI::App* vit3_t5_command =
        app.add_subcommand("vit3_t5", "fused vs reference ViT³ TTT mixer, T⁵ TTT attention and DiT⁵ TTT branch");
    vit3_t5_command->add_option("--iters", vit3_t5.iters, "timed repetitions (median)")->check(CLI::PositiveNumber);
    vit3_t5_command->add_option("--side", vit3_t5.side, "token grid side (64 = 1024x1024 image, patch 16)")
        ->check(CLI::Range(int64_t{2}, int64_t{1} << 20));

    MlstmOptions mlstm;
    CLI::App* mlstm_command = app.add_subcommand(
        "mlstm", "fused vs reference chunkwise mLSTM, head-wise projection and vil_tiny at 1024x1024");
    mlstm_command->add_option("--reps", mlstm.reps, "timed repetitions of the op cases (median)")
        ->check(CLI::PositiveNumber);
    mlstm_command->add_option("--model-reps", mlstm.model_reps,
                              "timed repetitions of the model cases (one warm-up only when more than 1)")
        ->check(CLI::PositiveNumber);
    mlstm_command->add_option("--tokens", mlstm.tokens, "sequence length S (4096 = 1024x1024 image, patch 16)");
    mlstm_command->add_flag("--skip-model", mlstm.skip_model, "skip the vil_tiny model cases");

    AttentionOptions attention;
    CLI::App* attention_command =
        app.add_subcommand("attention", "fused (flash-style) vs reference softmax attention of deit_tiny");
    attention_command->add_option("--tokens", attention.tokens, "tokens (4097 = 1024x1024 image, patch 16, + class)");
    attention_command->add_option("--heads", attention.heads, "heads (deit_tiny: 3)");
    attention_command->add_option("--head-dim", attention.head_dim, "head dim");
    attention_command->add_option("--reps", attention.reps, "timed repetitions (median)")->check(CLI::PositiveNumber);

    DepthwiseConvOptions depthwise;
    CLI::App* depthwise_command = app.add_subcommand(
        "depthwise_conv", "fused vs reference depthwise convolutions on tokens (3x3 residual / SiLU, causal 1D)");
    depthwise_command->add_option("--reps", depthwise.reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
    depthwise_command->add_option("--side", depthwise.side, "token grid side (64 = 1024x1024 image, patch 16)")
        ->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
    depthwise_command->add_option("--dtype", depthwise.dtype, "dtype of the inputs, both implementations")
        ->check(CLI::IsMember({"f32", "bf16"}));

    LayerNormOptions layer_norm;
    CLI::App* layer_norm_command =
        app.add_subcommand("layer_norm", "fused vs reference LayerNorm on (rows, 192) for 197, 4096 and 16384 rows");
    layer_norm_command->add_option("--reps", layer_norm.reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
    layer_norm_command->add_option("--width", layer_norm.width, "row length C (the tiny models: 192)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));

    NeighborhoodOptions neighborhood;
    CLI::App* neighborhood_command = app.add_subcommand(
        "neighborhood_attention", "fused vs reference DiT5-S neighbourhood attention on token grids 16, 32 and 64");
    neighborhood_command->add_option("--reps", neighborhood.reps, "timed repetitions (median)")
        ->check(CLI::PositiveNumber);

    for (CLI::App* command : {ttt_command, vit3_t5_command, mlstm_command, attention_command, depthwise_command,
                              layer_norm_command, neighborhood_command})
        add_harness_options(*command, harness);
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e) == 0 ? 0 : 1;  // --help, or a bad command line
    }
    try {
        runtime::configure_threads(harness.threads);
        int status = 0;
        if (ttt_command->parsed()) status = run_ttt_linear(ttt, harness);
        if (vit3_t5_command->parsed()) status = run_vit3_t5(vit3_t5, harness);
        if (mlstm_command->parsed()) status = run_mlstm(mlstm, harness);
        if (attention_command->parsed()) status = run_attention(attention, harness);
        if (depthwise_command->parsed()) status = run_depthwise_conv(depthwise, harness);
        if (layer_norm_command->parsed()) status = run_layer_norm(layer_norm, harness);
        if (neighborhood_command->parsed()) status = run_neighborhood_attention(neighborhood, harness);
        return status;
    } catch (const c10::Error& e) {
        std::fprintf(stderr, "bench_ops: %s\n", e.what_without_backtrace());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_ops: %s\n", e.what());
    }
    return 1;
}
