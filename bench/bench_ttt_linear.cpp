// Fused vs reference TTT-Linear at the 1024x1024 image's size (patch 16: T = 4096 tokens) and
// vittt_tiny's widths (nh = 3 heads of d = 64, b = 16), batch 1: forward (inference) and
// forward+backward times (median), peak memory of each case (peak RSS growth of a child
// process that runs only that case), and the achieved GFLOP/s of the inner products next to this
// machine's SGEMM rate. Refuses to print fused numbers unless fused == reference (outputs and
// all input gradients) on the benchmark inputs. Run with OMP_WAIT_POLICY=PASSIVE.
//   bench_ttt_linear [--threads 2] [--tokens 4096] [--heads 3] [--head-dim 64] [--reps 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "linvis/core/runtime.h"
#include "linvis/ops/ttt_linear.h"
#include "linvis/tools/bench.h"

using linvis::ops::Impl;

namespace {

struct Inputs {
    torch::Tensor q, k, v, lr, lti, w0, b0, gamma, beta;
    std::vector<torch::Tensor> list() const { return {q, k, v, lr, lti, w0, b0, gamma, beta}; }
};

// Model-like scales: q/k/v as after the projections, lr = sigmoid(.)/d as ttt_learning_rate.
Inputs make_inputs(int64_t T, int64_t nh, int64_t d, int64_t b, bool grad) {
    torch::manual_seed(0);
    Inputs in;
    in.q = torch::randn({1, nh, T, d});
    in.k = torch::randn({1, nh, T, d});
    in.v = torch::randn({1, nh, T, d});
    in.lr = torch::sigmoid(torch::randn({1, nh, T})) / static_cast<double>(d);
    in.lti = 0.01 * torch::randn({b});
    in.w0 = 0.02 * torch::randn({nh, d, d});
    in.b0 = torch::zeros({nh, 1, d});
    in.gamma = torch::ones({nh, d});
    in.beta = torch::zeros({nh, d});
    if (grad)
        for (auto* t : {&in.q, &in.k, &in.v, &in.lr, &in.lti, &in.w0, &in.b0, &in.gamma, &in.beta}) t->requires_grad_(true);
    return in;
}

linvis::ops::TttLinearOptions options(Impl impl, int64_t b) {
    linvis::ops::TttLinearOptions o;
    o.mini_batch_size = b;
    o.impl = impl;
    return o;
}

torch::Tensor run(const Inputs& in, Impl impl, int64_t b) {
    return linvis::ops::ttt_linear(in.q, in.k, in.v, in.lr, in.lti, in.w0, in.b0, in.gamma, in.beta, options(impl, b))
        .output;
}

// One pass of a case: forward only (no grad) or forward + backward of sum(out * probe).
void run_case(const Inputs& in, Impl impl, int64_t b, bool train, const torch::Tensor& probe) {
    if (!train) {
        torch::NoGradGuard ng;
        run(in, impl, b);
        return;
    }
    torch::Tensor out = run(in, impl, b);
    auto g = torch::autograd::grad({(out * probe).sum()}, in.list());
}

double median_ms(const Inputs& in, Impl impl, int64_t b, bool train, const torch::Tensor& probe, int reps) {
    run_case(in, impl, b, train, probe);  // warm-up
    std::vector<double> ms;
    for (int i = 0; i < reps; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        run_case(in, impl, b, train, probe);
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

double rel_err(const torch::Tensor& a, const torch::Tensor& e) {
    return ((a.to(torch::kFloat64) - e.to(torch::kFloat64)).norm() / e.to(torch::kFloat64).norm()).item<double>();
}

// Peak RSS growth (MiB) of a child that builds the inputs and runs one case once.
double child_peak_mib(const std::string& self, const std::string& args, const std::string& impl, bool train) {
    std::string cmd = "\"" + self + "\" " + args + " --child " + impl + (train ? " --train" : "");
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) return -1;
    double mib = -1;
    if (std::fscanf(p, "%lf", &mib) != 1) mib = -1;
    pclose(p);
    return mib;
}

}  // namespace

int run_bench(int argc, char** argv) {
    int threads = 2, reps = 5;
    int64_t T = 4096, nh = 3, d = 64, b = 16, child_reps = 1;
    std::string child;
    bool train = false;
    CLI::App app("fused vs reference TTT-Linear", "bench_ttt_linear");
    app.option_defaults()->always_capture_default();
    app.add_option("--threads", threads, "intra-op threads");
    app.add_option("--tokens", T, "sequence length (4096 = 1024x1024 image, patch 16)");
    app.add_option("--heads", nh, "heads (vittt_tiny: 3)");
    app.add_option("--head-dim", d, "head dim");
    app.add_option("--mini-batch", b, "mini-batch size");
    app.add_option("--reps", reps, "timed repetitions (median)");
    app.add_option("--child", child, "internal: measure the peak memory of one case")->type_name("IMPL");
    app.add_flag("--train", train, "internal: with --child, forward + backward");
    app.add_option("--child-reps", child_reps, "internal: with --child, run the case N times (for profilers)");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e) == 0 ? 0 : 1;  // --help, or a bad command line (status 1 as before)
    }
    linvis::runtime::configure_threads(threads);

    if (app.count("--child") > 0) {
        const Impl impl = linvis::ops::parse_impl(child);
        Inputs in = make_inputs(T, nh, d, b, train);
        torch::Tensor probe = torch::randn({1, nh, T, d});
        const int64_t base = linvis::tools::current_rss_bytes();
        for (int64_t i = 0; i < child_reps; ++i) run_case(in, impl, b, train, probe);
        std::printf("%.3f\n", static_cast<double>(linvis::tools::peak_rss_bytes() - base) / (1024.0 * 1024.0));
        return 0;
    }

    const std::string common = "--threads " + std::to_string(threads) + " --tokens " + std::to_string(T) +
                               " --heads " + std::to_string(nh) + " --head-dim " + std::to_string(d) +
                               " --mini-batch " + std::to_string(b);
    std::printf("TTT-Linear, B=1 T=%lld nh=%lld d=%lld b=%lld, %d thread(s), SIMD %s, OMP_WAIT_POLICY=%s\n",
                static_cast<long long>(T), static_cast<long long>(nh), static_cast<long long>(d),
                static_cast<long long>(b), threads, linvis::runtime::simd_name(linvis::runtime::detect_simd()),
                linvis::runtime::openmp_is_passive() ? "PASSIVE" : "(not passive)");

    // Correctness gate on the benchmark inputs: outputs and all nine input gradients.
    Inputs in = make_inputs(T, nh, d, b, true);
    torch::Tensor probe = torch::randn({1, nh, T, d});
    double worst = 0;
    {
        torch::Tensor out_ref = run(in, Impl::Reference, b);
        auto g_ref = torch::autograd::grad({(out_ref * probe).sum()}, in.list());
        torch::Tensor out_fused = run(in, Impl::Fused, b);
        auto g_fused = torch::autograd::grad({(out_fused * probe).sum()}, in.list());
        worst = rel_err(out_fused, out_ref);
        std::printf("check: output rel err %.2e", worst);
        for (size_t i = 0; i < g_ref.size(); ++i) {
            const double e = rel_err(g_fused[i], g_ref[i]);
            worst = std::max(worst, e);
        }
        std::printf(", worst input-gradient rel err %.2e\n", worst);
    }
    const bool ok = worst < 1e-4;
    if (!ok) std::printf("CHECK FAILED (limit 1e-4): fused numbers are not reported\n");

    // Inner-product MACs. Forward (as the FLOP counter): 3 M d^2 + 2 M^2 d per mini-batch and
    // head. The fused backward executes 12 M d^2 + 6 M^2 d more (state recompute 2 M d^2, full
    // mini-batch recompute 3 M d^2 + 2 M^2 d, adjoints 7 M d^2 + 4 M^2 d).
    double fwd_macs = 0, bwd_macs = 0;
    for (int64_t s = 0; s < T; s += b) {
        const double M = static_cast<double>(std::min(b, T - s));
        fwd_macs += nh * (3 * M * d * d + 2 * M * M * d);
        bwd_macs += nh * (12 * M * d * d + 6 * M * M * d);
    }
    const double sgemm = linvis::tools::measure_sgemm_gflops(1024, 5);

    const double ref_fwd = median_ms(in, Impl::Reference, b, false, probe, reps);
    const double ref_train = median_ms(in, Impl::Reference, b, true, probe, reps);
    const double mem_ref_fwd = child_peak_mib(argv[0], common, "reference", false);
    const double mem_ref_train = child_peak_mib(argv[0], common, "reference", true);
    std::printf("SGEMM (1024^2, %d thread(s)): %.1f GFLOP/s\n", threads, sgemm);
    std::printf("%-10s %-14s %10s %12s %10s\n", "impl", "case", "median ms", "peak MiB", "GFLOP/s");
    std::printf("%-10s %-14s %10.2f %12.1f %10.1f\n", "reference", "forward", ref_fwd, mem_ref_fwd,
                2 * fwd_macs / ref_fwd * 1e-6);
    std::printf("%-10s %-14s %10.2f %12.1f %10s\n", "reference", "fwd+bwd", ref_train, mem_ref_train, "-");
    if (!ok) return 1;
    const double fused_fwd = median_ms(in, Impl::Fused, b, false, probe, reps);
    const double fused_train = median_ms(in, Impl::Fused, b, true, probe, reps);
    const double mem_fused_fwd = child_peak_mib(argv[0], common, "fused", false);
    const double mem_fused_train = child_peak_mib(argv[0], common, "fused", true);
    const double gf_fwd = 2 * fwd_macs / fused_fwd * 1e-6;
    const double gf_train = 2 * (fwd_macs + bwd_macs) / fused_train * 1e-6;
    std::printf("%-10s %-14s %10.2f %12.1f %10.1f\n", "fused", "forward", fused_fwd, mem_fused_fwd, gf_fwd);
    std::printf("%-10s %-14s %10.2f %12.1f %10.1f\n", "fused", "fwd+bwd", fused_train, mem_fused_train, gf_train);
    std::printf("speedup forward %.2fx, fwd+bwd %.2fx; peak memory ratio (reference/fused) forward %.1fx, "
                "fwd+bwd %.1fx; fused inner products at %.0f%% (forward) / %.0f%% (fwd+bwd) of SGEMM\n",
                ref_fwd / fused_fwd, ref_train / fused_train, mem_ref_fwd / std::max(mem_fused_fwd, 1e-3),
                mem_ref_train / std::max(mem_fused_train, 1e-3), 100 * gf_fwd / sgemm, 100 * gf_train / sgemm);
    return 0;
}

int main(int argc, char** argv) {
    try {
        return run_bench(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_ttt_linear: %s\n", e.what());
        return 1;
    }
}
