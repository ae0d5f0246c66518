// Fused vs reference ViT³ TTT mixer (vit3_ttt_mix: both branches) and T⁵ TTT attention at the
// 1024x1024 image size (patch 16: 64x64 = 4096 tokens), the tiny models' widths, batch 1
// (T⁵ through t5_ttt_attention_qkv, the entry point the t5 models use).
//   ViT³-T: C = 192, 6 heads (d = 32), qkv (1, 4096, 3C + 3d);  T⁵-T: C = 192, 3 heads (d = 64).
// For each op: checks fused == reference (outputs and all input gradients, relative L2 < 1e-4) on
// the benchmark inputs and prints no fused number if that fails; then times forward (NoGradGuard)
// and forward+backward, median of --iters runs after one warm-up, each case in a fresh child
// process (this program re-executed with --child) whose peak RSS above its RSS after building
// the inputs is the case's peak memory (glibc mmap threshold fixed at 256 KiB in the child). Also prints the SGEMM rate of this machine and the
// achieved GFLOP/s of the fused matmul parts (whole-op and micro-kernel alone).
// Usage: OMP_WAIT_POLICY=PASSIVE bench_vit3_t5 [--threads 2] [--iters 5] [--side 64]
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "../src/ops/ttt_swiglu_cpu/kernels.h"
#include "linvis/core/runtime.h"
#include "linvis/ops/t5_ttt.h"
#include "linvis/ops/vit3_ttt.h"
#include "linvis/tools/bench.h"

namespace {

using Clock = std::chrono::steady_clock;
using linvis::ops::Impl;
using torch::Tensor;

struct Options {
    int threads = 2, iters = 5;
    int64_t side = 64;  // token grid side (1024 / 16)
};

struct Inputs {
    std::vector<Tensor> tensors;
};

constexpr int64_t kC = 192;

Inputs make_inputs(const std::string& op, int64_t side) {
    torch::manual_seed(0);
    const int64_t N = side * side;
    if (op == "vit3") {
        const int64_t h = 6, d = kC / h;
        return {{torch::randn({1, N, 3 * kC + 3 * d}), 0.02 * torch::randn({1, h, d, d}),
                 0.02 * torch::randn({1, h, d, d}), 0.02 * torch::randn({d, 1, 3, 3})}};
    }
    const int64_t h = 3, d = kC / h;
    return {{torch::randn({1, N, 3 * kC}), 0.02 * torch::randn({1, h, d, d}), 0.02 * torch::randn({1, h, d, d}),
             0.02 * torch::randn({1, h, d, d}), 0.2 * torch::randn({kC, 1, 3, 3}), 0.1 * torch::randn({kC}),
             0.2 * torch::randn({kC, 1, 3, 3}), 0.1 * torch::randn({kC})}};
}

Tensor run_op(const std::string& op, const std::vector<Tensor>& x, Impl impl, int64_t side) {
    if (op == "vit3") return linvis::ops::vit3_ttt_mix(x[0], x[1], x[2], x[3], 6, side, side, {}, impl);
    linvis::ops::T5TttParams p{x[1], x[2], x[3], x[4], x[5], x[6], x[7]};
    return linvis::ops::t5_ttt_attention_qkv(x[0], p, 3, side, side, impl);
}

// Matmul MACs of the fused kernels (forward; forward + backward), see docs/perf_vit3_t5.md.
double matmul_macs(const std::string& op, bool train, int64_t side) {
    const double N = static_cast<double>(side * side);
    if (op == "vit3") return (train ? 22.0 : 6.0) * N * kC * (kC / 6);
    return (train ? 32.0 : 9.0) * N * kC * (kC / 3);
}

std::vector<Tensor> leaves_of(const std::vector<Tensor>& x) {
    std::vector<Tensor> out;
    for (const auto& t : x) out.push_back(t.detach().clone().requires_grad_(true));
    return out;
}

// Child: one case; prints "RESULT <median ms> <peak bytes above base>".
int run_child(const std::string& op, const std::string& mode, const std::string& impl_name, const Options& o) {
    // A fixed mmap threshold: every large tensor is its own mapping, returned on free, so the peak
    // RSS is the peak of simultaneously live memory (glibc's adaptive threshold would otherwise
    // keep freed blocks of earlier iterations resident, differently for each implementation).
    mallopt(M_MMAP_THRESHOLD, 256 * 1024);
    linvis::runtime::configure_threads(o.threads);
    const Impl impl = linvis::ops::parse_impl(impl_name);
    const bool train = mode == "train";
    Inputs in = make_inputs(op, o.side);
    std::vector<Tensor> leaves = train ? leaves_of(in.tensors) : in.tensors;
    const int64_t base = linvis::tools::current_rss_bytes();
    std::vector<double> ms;
    for (int it = 0; it < o.iters + 1; ++it) {
        const auto t0 = Clock::now();
        if (train) {
            Tensor out = run_op(op, leaves, impl, o.side);
            out.backward(torch::ones_like(out));
            for (auto& l : leaves) l.mutable_grad() = Tensor();
        } else {
            torch::NoGradGuard no_grad;
            Tensor out = run_op(op, leaves, impl, o.side);
        }
        const double dt = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (it > 0) ms.push_back(dt);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("RESULT %.4f %lld\n", ms[ms.size() / 2],
                static_cast<long long>(linvis::tools::peak_rss_bytes() - base));
    return 0;
}

bool parse_result(const std::string& text, double& ms, double& peak) {
    const auto pos = text.find("RESULT ");
    if (pos == std::string::npos) return false;
    long long bytes = 0;
    if (std::sscanf(text.c_str() + pos, "RESULT %lf %lld", &ms, &bytes) != 2) return false;
    peak = static_cast<double>(bytes);
    return true;
}

bool spawn_case(const std::string& exe, const std::string& op, const std::string& mode, const std::string& impl,
                const Options& o, double& ms, double& peak) {
    const std::string cmd = "'" + exe + "' --child " + op + " " + mode + " " + impl + " --threads " +
                            std::to_string(o.threads) + " --iters " + std::to_string(o.iters) + " --side " +
                            std::to_string(o.side);
    FILE* pipe = popen(cmd.c_str(), "r");
    if (pipe == nullptr) return false;
    std::string text;
    char buf[512];
    while (std::fgets(buf, sizeof(buf), pipe) != nullptr) text += buf;
    const int rc = pclose(pipe);
    return rc == 0 && parse_result(text, ms, peak);
}

// Relative L2 errors of fused vs reference: output and every input gradient; returns the max.
double check(const std::string& op, int64_t side) {
    Inputs in = make_inputs(op, side);
    std::vector<std::vector<Tensor>> res;
    for (Impl impl : {Impl::Reference, Impl::Fused}) {
        auto leaves = leaves_of(in.tensors);
        Tensor out = run_op(op, leaves, impl, side);
        torch::manual_seed(1);
        out.backward(torch::randn(out.sizes()));
        std::vector<Tensor> r{out.detach()};
        for (auto& l : leaves) r.push_back(l.grad());
        res.push_back(r);
    }
    double worst = 0.0;
    for (size_t i = 0; i < res[0].size(); ++i) {
        const double err = ((res[1][i] - res[0][i]).norm() / res[0][i].norm()).item<double>();
        worst = std::max(worst, std::isfinite(err) ? err : 1e9);
    }
    return worst;
}

// Micro-kernel alone on the block shapes of one head: Z = K_blk W (256 x d x d) and G += K_blkᵀ P.
double microkernel_gflops(int64_t d) {
    const auto& kr = linvis::ops::fused_detail::kernels();
    const int64_t T = 256, reps = 2000;
    std::vector<float> a(T * d, 0.5f), w(d * d, 0.25f), c(T * d), g(d * d);
    const auto t0 = Clock::now();
    for (int64_t r = 0; r < reps; ++r) {
        kr.gemm(T, d, d, a.data(), d, 1, w.data(), d, c.data(), d, false);
        kr.gemm(d, d, T, a.data(), 1, d, c.data(), d, g.data(), d, false);
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    return 2.0 * 2.0 * T * d * d * reps / s * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    std::vector<std::string> child;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--threads" && i + 1 < argc) o.threads = std::atoi(argv[++i]);
        else if (a == "--iters" && i + 1 < argc) o.iters = std::max(1, std::atoi(argv[++i]));
        else if (a == "--side" && i + 1 < argc) o.side = std::max(2, std::atoi(argv[++i]));
        else if (a == "--child" && i + 3 < argc) child = {argv[i + 1], argv[i + 2], argv[i + 3]}, i += 3;
        else {
            std::fprintf(stderr, "usage: %s [--threads N] [--iters N] [--side S]\n", argv[0]);
            return 2;
        }
    }
    if (!child.empty()) return run_child(child[0], child[1], child[2], o);

    char exe[4096] = {0};
    if (readlink("/proc/self/exe", exe, sizeof(exe) - 1) <= 0) return 1;
    linvis::runtime::configure_threads(o.threads);
    const auto info = linvis::runtime::query();
    std::printf("bench_vit3_t5: %lld x %lld tokens, batch 1, C = %lld, threads %d, iters %d, OMP passive: %s\n",
                static_cast<long long>(o.side), static_cast<long long>(o.side), static_cast<long long>(kC),
                o.threads, o.iters, linvis::runtime::openmp_is_passive() ? "yes" : "NO");
    std::printf("BLAS: %s; SIMD: %s%s\n", info.blas.c_str(), linvis::runtime::simd_name(info.simd),
                linvis::ops::fused_detail::kernels().avx512 ? " (fused kernels: AVX-512)" : " (fused kernels: portable)");
    const double sgemm = linvis::tools::measure_sgemm_gflops();
    std::printf("SGEMM 2048^3 through LibTorch, %d threads: %.1f GFLOP/s\n", o.threads, sgemm);
    linvis::runtime::configure_threads(1);
    const double sgemm1 = linvis::tools::measure_sgemm_gflops();
    const double micro32 = microkernel_gflops(32), micro64 = microkernel_gflops(64);
    linvis::runtime::configure_threads(o.threads);
    std::printf("SGEMM 2048^3, 1 thread: %.1f GFLOP/s\n", sgemm1);
    std::printf("fused micro-kernel, 1 thread, 256-token blocks (X W and Xᵀ Y): d=32 %.1f GFLOP/s (%.0f%% of 1-thread "
                "SGEMM), d=64 %.1f GFLOP/s (%.0f%%)\n",
                micro32, 100.0 * micro32 / sgemm1, micro64, 100.0 * micro64 / sgemm1);

    std::printf("\n%-5s %-5s | %10s %10s %7s | %11s %11s %7s | %s\n", "op", "mode", "ref ms", "fused ms", "speedup",
                "ref MiB", "fused MiB", "mem x", "fused matmul GFLOP/s (% of SGEMM)");
    for (const std::string op : {"vit3", "t5"}) {
        const double err = check(op, o.side);
        const bool ok = err < 1e-4;
        std::printf("check %s: fused vs reference max relative L2 error %.2e (output + all input grads): %s\n",
                    op.c_str(), err, ok ? "ok" : "FAILED, fused numbers withheld");
        for (const std::string mode : {"fwd", "train"}) {
            double rms = 0, rpk = 0, fms = 0, fpk = 0;
            const bool rgood = spawn_case(exe, op, mode, "reference", o, rms, rpk);
            const bool fgood = ok && spawn_case(exe, op, mode, "fused", o, fms, fpk);
            if (!rgood) {
                std::printf("%-5s %-5s | reference case failed\n", op.c_str(), mode.c_str());
                continue;
            }
            if (!fgood) {
                std::printf("%-5s %-5s | %10.2f %10s\n", op.c_str(), mode.c_str(), rms, "-");
                continue;
            }
            const double gf = 2.0 * matmul_macs(op, mode == "train", o.side) / (fms * 1e-3) * 1e-9;
            std::printf("%-5s %-5s | %10.2f %10.2f %6.2fx | %11.1f %11.1f %6.1fx | %.1f (%.0f%%)\n", op.c_str(),
                        mode.c_str(), rms, fms, rms / fms, rpk / 1048576.0, fpk / 1048576.0,
                        rpk / std::max(fpk, 1.0), gf, 100.0 * gf / sgemm);
        }
    }
    std::printf("\nMiB: peak RSS of the child process above its RSS after building the inputs.\n"
                "fused matmul GFLOP/s: matmul FLOPs of the fused algorithm / whole fused op time (lower bound).\n");
    return 0;
}
