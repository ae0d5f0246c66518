// Benchmark of the fused CPU chunkwise mLSTM against the reference forms, at the size of a
// 1024x1024 image with patch 16 (S = 4096 tokens) and ViL-T's mLSTM widths (4 heads, DH = DV = 96),
// batch 1; the head-wise q/k/v projection of the same layer (S x 384, 96 blocks of 4 x 4: fused
// kernel vs the official einsum); plus the whole vil_tiny at 1024x1024 (chunkwise fused vs the
// official parallel form).
//
//   OMP_WAIT_POLICY=PASSIVE build/bench/bench_mlstm --threads 2 [--reps 5] [--model-reps 3] [--tokens 4096]
//                                                   [--skip-model]
//
// Every case runs in a fresh child process (this program re-executed with --child), so that its
// peak resident memory (VmHWM, reset through /proc/self/clear_refs after the inputs exist) belongs
// to that case alone; the number printed is the peak growth over the inputs. Times are medians.
// Before any fused number is printed, fused == reference is checked on the benchmark inputs
// (outputs and all five gradients; model logits); on failure the fused numbers are withheld.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "../src/ops/mlstm/cpu.h"
#include "linvis/core/runtime.h"
#include "linvis/models/registry.h"
#include "linvis/ops/linear_headwise.h"
#include "linvis/ops/mlstm.h"
#include "linvis/tools/bench.h"

namespace ops = linvis::ops;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
    int threads = 2;
    int reps = 5;
    int model_reps = 3;
    int64_t tokens = 4096;
    bool skip_model = false;
};

constexpr int64_t kHeads = 4, kDim = 96, kChunk = 64;
constexpr int64_t kBlocks = kHeads * kDim / 4;  // head-wise projection: I = 384 features in 4 x 4 blocks

struct HeadwiseInputs {
    torch::Tensor x, w, b, probe;
};

HeadwiseInputs headwise_inputs(int64_t S, bool requires_grad) {
    torch::manual_seed(8);
    HeadwiseInputs in{torch::randn({1, S, kBlocks * 4}), 0.3f * torch::randn({kBlocks, 4, 4}), torch::randn({kBlocks * 4}),
                      torch::randn({1, S, kBlocks * 4})};
    for (auto* t : {&in.x, &in.w, &in.b}) t->set_requires_grad(requires_grad);
    return in;
}

torch::Tensor run_headwise(const HeadwiseInputs& in, const std::string& impl) {
    return ops::linear_headwise(in.x, in.w, in.b, impl == "fused" ? ops::Impl::Fused : ops::Impl::Reference);
}

struct OpInputs {
    torch::Tensor q, k, v, i, f;
};

OpInputs op_inputs(int64_t S, bool requires_grad) {
    torch::manual_seed(7);
    OpInputs in{torch::randn({1, kHeads, S, kDim}), torch::randn({1, kHeads, S, kDim}), torch::randn({1, kHeads, S, kDim}),
                2.0f * torch::randn({1, kHeads, S, 1}), 3.0f + 1.5f * torch::randn({1, kHeads, S, 1})};
    for (auto* t : {&in.q, &in.k, &in.v, &in.i, &in.f}) t->set_requires_grad(requires_grad);
    return in;
}

torch::Tensor run_op(const OpInputs& in, const std::string& form) {
    if (form == "parallel") return ops::mlstm(in.q, in.k, in.v, in.i, in.f, ops::MlstmMode::Parallel);
    if (form == "chunkwise")
        return ops::mlstm(in.q, in.k, in.v, in.i, in.f, ops::MlstmMode::Chunkwise, kChunk, ops::kMlstmEps,
                          ops::Impl::Reference);
    return ops::mlstm(in.q, in.k, in.v, in.i, in.f, ops::MlstmMode::Chunkwise, kChunk, ops::kMlstmEps,
                      ops::Impl::Fused);
}

int64_t status_kb(const char* key) {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key));
    return -1;
}

void reset_peak_rss() {
    std::ofstream f("/proc/self/clear_refs");
    f << "5";
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

linvis::models::ModelPtr make_vil(const std::string& impl) {
    torch::manual_seed(0);  // the same weights in every process and for both implementations
    linvis::models::ModelConfig cfg;
    cfg.set("img_size", int64_t{1024});
    cfg.set("impl", impl);
    cfg.set("mlstm_mode", std::string(impl == "fused" ? "chunkwise" : "parallel"));
    auto model = linvis::models::create_model("vil_tiny", cfg);
    model->eval();
    return model;
}

// Child: one case. Prints "RESULT <median ms> <peak growth bytes>".
int run_child(const std::string& name, const Options& o, const std::string& out_path) {
    linvis::runtime::configure_threads(o.threads);
    std::vector<double> ms;
    int64_t base_kb = 0;
    if (name.rfind("hw_", 0) == 0) {
        // hw_<fwd|fwdbwd>_<reference|fused>
        const bool train = name.find("fwdbwd") != std::string::npos;
        const std::string impl = name.substr(name.rfind('_') + 1);
        HeadwiseInputs in = headwise_inputs(o.tokens, train);
        reset_peak_rss();
        base_kb = status_kb("VmRSS:");
        // The op takes well under a millisecond per call at small S: time batches of 20 calls.
        for (int r = 0; r < o.reps + 1; ++r) {
            const auto t0 = Clock::now();
            for (int k = 0; k < 20; ++k) {
                if (train) {
                    (run_headwise(in, impl) * in.probe).sum().backward();
                    for (auto* t : {&in.x, &in.w, &in.b}) t->mutable_grad() = torch::Tensor();
                } else {
                    torch::NoGradGuard no_grad;
                    run_headwise(in, impl);
                }
            }
            if (r > 0) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / 20);
        }
    } else if (name.rfind("op_", 0) == 0) {
        // op_<fwd|fwdbwd>_<parallel|chunkwise|fused>
        const bool train = name.find("fwdbwd") != std::string::npos;
        const std::string form = name.substr(name.rfind('_') + 1);
        OpInputs in = op_inputs(o.tokens, train);
        torch::Tensor probe = torch::randn({1, kHeads, o.tokens, kDim});
        reset_peak_rss();
        base_kb = status_kb("VmRSS:");
        for (int r = 0; r < o.reps + 1; ++r) {
            const auto t0 = Clock::now();
            if (train) {
                torch::Tensor h = run_op(in, form);
                (h * probe).sum().backward();
                for (auto* t : {&in.q, &in.k, &in.v, &in.i, &in.f}) t->mutable_grad() = torch::Tensor();
            } else {
                torch::NoGradGuard no_grad;
                run_op(in, form);
            }
            if (r > 0) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        }
    } else {
        // model_fwd_<reference|fused>
        const std::string impl = name.substr(name.rfind('_') + 1);
        auto model = make_vil(impl);
        torch::manual_seed(9);
        torch::Tensor x = torch::randn({1, 3, 1024, 1024});
        reset_peak_rss();
        base_kb = status_kb("VmRSS:");
        torch::Tensor logits;
        // One warm-up pass only when several are timed (the reference pass takes minutes here).
        const int warmup = o.model_reps > 1 ? 1 : 0;
        for (int r = 0; r < o.model_reps + warmup; ++r) {
            torch::NoGradGuard no_grad;
            const auto t0 = Clock::now();
            logits = model->forward(x);
            if (r >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        }
        if (!out_path.empty()) {
            std::ofstream f(out_path, std::ios::binary);
            torch::Tensor c = logits.contiguous();
            f.write(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * sizeof(float));
        }
    }
    const int64_t peak_kb = status_kb("VmHWM:");
    std::printf("RESULT %.3f %lld\n", median(ms), static_cast<long long>((peak_kb - base_kb) * 1024));
    return 0;
}

struct CaseResult {
    double ms = -1;
    double peak_mb = -1;
};

CaseResult spawn(const std::string& self, const std::string& name, const Options& o, const std::string& out_path = "") {
    std::string cmd = self + " --child " + name + " --threads " + std::to_string(o.threads) + " --reps " +
                      std::to_string(o.reps) + " --model-reps " + std::to_string(o.model_reps) + " --tokens " +
                      std::to_string(o.tokens);
    if (!out_path.empty()) cmd += " --out " + out_path;
    CaseResult r;
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return r;
    char line[512];
    while (std::fgets(line, sizeof line, p)) {
        double ms = 0;
        long long bytes = 0;
        if (std::sscanf(line, "RESULT %lf %lld", &ms, &bytes) == 2) {
            r.ms = ms;
            r.peak_mb = bytes / 1048576.0;
        }
    }
    pclose(p);
    return r;
}

double rel_err(const torch::Tensor& a, const torch::Tensor& e) {
    return ((a.to(torch::kFloat64) - e.to(torch::kFloat64)).norm() / e.to(torch::kFloat64).norm()).item<double>();
}

// fused vs reference on the benchmark inputs: output and the five gradients. The truth is the
// reference chunkwise form in float64 (equal to the parallel form to rounding, tests/test_mlstm.cpp);
// the float32 reference parallel form is measured against the same truth. Pass: the fused error is
// below 1e-4 or at most 2x the float32 reference's own error.
bool check_op(const Options& o) {
    OpInputs in = op_inputs(o.tokens, true);
    torch::Tensor probe = torch::randn({1, kHeads, o.tokens, kDim});
    auto grads_of = [&](const OpInputs& x, const std::string& form) {
        torch::Tensor h = run_op(x, form);
        auto g = torch::autograd::grad({(h * probe.to(h.scalar_type())).sum()}, {x.q, x.k, x.v, x.i, x.f});
        g.insert(g.begin(), h.detach());
        return g;
    };
    OpInputs in64;
    for (auto [src, dst] : std::vector<std::pair<torch::Tensor*, torch::Tensor*>>{
             {&in.q, &in64.q}, {&in.k, &in64.k}, {&in.v, &in64.v}, {&in.i, &in64.i}, {&in.f, &in64.f}})
        *dst = src->detach().to(torch::kFloat64).set_requires_grad(true);
    auto truth = grads_of(in64, "chunkwise");
    auto ref = grads_of(in, "parallel");
    auto fused = grads_of(in, "fused");
    bool ok = true;
    const char* names[] = {"h", "dq", "dk", "dv", "digate", "dfgate"};
    for (size_t t = 0; t < ref.size(); ++t) {
        const double e = rel_err(fused[t], truth[t]), r = rel_err(ref[t], truth[t]);
        const bool pass = e < 1e-4 || e <= 2 * r;
        std::printf("  check %-7s rel L2 err vs float64 truth: fused %.2e, reference parallel f32 %.2e, "
                    "fused vs reference %.2e %s\n", names[t], e, r, rel_err(fused[t], ref[t]), pass ? "ok" : "FAIL");
        ok = ok && pass;
    }
    return ok;
}

// Head-wise projection, fused vs reference (the official einsum) in float32, both against the
// float64 reference: output and the three gradients. Pass: error below 1e-5 or at most 2x the
// float32 reference's own.
bool check_headwise(const Options& o) {
    HeadwiseInputs in = headwise_inputs(o.tokens, true);
    HeadwiseInputs in64{in.x.detach().to(torch::kFloat64).set_requires_grad(true),
                        in.w.detach().to(torch::kFloat64).set_requires_grad(true),
                        in.b.detach().to(torch::kFloat64).set_requires_grad(true), in.probe.to(torch::kFloat64)};
    auto grads_of = [](const HeadwiseInputs& x, const std::string& impl) {
        torch::Tensor y = run_headwise(x, impl);
        auto g = torch::autograd::grad({(y * x.probe).sum()}, {x.x, x.w, x.b});
        g.insert(g.begin(), y.detach());
        return g;
    };
    auto truth = grads_of(in64, "reference");
    auto ref = grads_of(in, "reference");
    auto fused = grads_of(in, "fused");
    bool ok = true;
    const char* names[] = {"y", "dx", "dweight", "dbias"};
    for (size_t t = 0; t < ref.size(); ++t) {
        const double e = rel_err(fused[t], truth[t]), r = rel_err(ref[t], truth[t]);
        const bool pass = e < 1e-5 || e <= 2 * r;
        std::printf("  check %-7s rel L2 err vs float64 truth: fused %.2e, reference f32 %.2e %s\n", names[t], e, r,
                    pass ? "ok" : "FAIL");
        ok = ok && pass;
    }
    return ok;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    std::string child, out_path;
    for (int a = 1; a < argc; ++a) {
        const std::string arg = argv[a];
        auto next = [&]() -> std::string { return a + 1 < argc ? argv[++a] : ""; };
        if (arg == "--threads") o.threads = std::atoi(next().c_str());
        else if (arg == "--reps") o.reps = std::max(1, std::atoi(next().c_str()));
        else if (arg == "--model-reps") o.model_reps = std::max(1, std::atoi(next().c_str()));
        else if (arg == "--tokens") o.tokens = std::atoll(next().c_str());
        else if (arg == "--skip-model") o.skip_model = true;
        else if (arg == "--child") child = next();
        else if (arg == "--out") out_path = next();
        else {
            std::fprintf(stderr, "usage: %s [--threads N] [--reps N] [--model-reps N] [--tokens S] [--skip-model]\n",
                         argv[0]);
            return 2;
        }
    }
    if (!child.empty()) return run_child(child, o, out_path);

    linvis::runtime::configure_threads(o.threads);
    const std::string self = "/proc/" + std::to_string(getpid()) + "/exe";
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    const std::string self_path = n > 0 ? std::string(exe, static_cast<size_t>(n)) : self;

    const auto info = linvis::runtime::query();
    std::printf("bench_mlstm: S=%lld tokens, batch 1, %lld heads, DH=DV=%lld, chunk %lld, threads %d, simd %s, "
                "fused path %s, OMP_WAIT_POLICY passive: %s\n",
                static_cast<long long>(o.tokens), static_cast<long long>(kHeads), static_cast<long long>(kDim),
                static_cast<long long>(kChunk), o.threads, linvis::runtime::simd_name(info.simd),
                ops::cpu::mlstm_fused_uses_avx512() ? "AVX-512" : "scalar",
                linvis::runtime::openmp_is_passive() ? "yes" : "NO");
    const double sgemm = linvis::tools::measure_sgemm_gflops(1024, 5);
    std::printf("SGEMM rate (1024^3, LibTorch BLAS, %d threads): %.1f GFLOP/s\n", o.threads, sgemm);
    // The matmul parts alone: the kernel's own tiles on the forward's chunk shapes, one thread,
    // next to a one-thread SGEMM measured right after.
    linvis::runtime::configure_threads(1);
    const double tiles = ops::cpu::mlstm_fused_gemm_gflops(kChunk, kDim, kDim, 1.0);
    const double sgemm1 = linvis::tools::measure_sgemm_gflops(1024, 5);
    linvis::runtime::configure_threads(o.threads);
    std::printf("fused GEMM tiles (chunk shapes %lldx%lldx%lld, 1 thread): %.1f GFLOP/s = %.0f%% of 1-thread SGEMM "
                "(%.1f GFLOP/s)\n", static_cast<long long>(kChunk), static_cast<long long>(kDim),
                static_cast<long long>(kDim), tiles, 100.0 * tiles / sgemm1, sgemm1);

    const bool op_ok = check_op(o);
    std::printf("op check: %s\n", op_ok ? "PASS" : "FAIL: fused numbers withheld");

    std::printf("\n%-28s %12s %14s\n", "op case (S tokens)", "median ms", "peak MiB");
    std::vector<std::string> cases = {"op_fwd_parallel", "op_fwd_chunkwise", "op_fwd_fused",
                                      "op_fwdbwd_parallel", "op_fwdbwd_chunkwise", "op_fwdbwd_fused"};
    std::vector<CaseResult> results;
    for (const auto& c : cases) {
        const bool is_fused = c.find("fused") != std::string::npos;
        CaseResult r = (is_fused && !op_ok) ? CaseResult{} : spawn(self_path, c, o);
        results.push_back(r);
        if (is_fused && !op_ok) std::printf("%-28s %12s %14s\n", c.c_str(), "withheld", "withheld");
        else std::printf("%-28s %12.2f %14.1f\n", c.c_str(), r.ms, r.peak_mb);
    }
    // Multiply-adds of the fused forward's chunk products (dense L x L blocks, mask applied after).
    const double L = static_cast<double>(std::min<int64_t>(kChunk, o.tokens));
    const double fwd_flops = 2.0 * kHeads * o.tokens * (L * 2 * kDim + 2.0 * kDim * kDim);
    if (op_ok) {
        std::printf("\nforward speedup fused vs parallel: %.2fx, vs reference chunkwise: %.2fx\n",
                    results[0].ms / results[2].ms, results[1].ms / results[2].ms);
        std::printf("fwd+bwd speedup fused vs parallel: %.2fx, vs reference chunkwise: %.2fx\n",
                    results[3].ms / results[5].ms, results[4].ms / results[5].ms);
        std::printf("fwd+bwd peak memory ratio parallel / fused: %.1fx, reference chunkwise / fused: %.1fx\n",
                    results[3].peak_mb / std::max(results[5].peak_mb, 1e-3),
                    results[4].peak_mb / std::max(results[5].peak_mb, 1e-3));
        const double rate = fwd_flops / (results[2].ms * 1e-3) * 1e-9;
        std::printf("fused forward: %.3f GFLOP in products -> %.1f GFLOP/s over the whole kernel time "
                    "(%.0f%% of SGEMM)\n", fwd_flops * 1e-9, rate, 100.0 * rate / sgemm);
    }

    std::printf("\nhead-wise q/k/v projection: x (%lld, %lld), %lld blocks of 4 x 4, float32\n",
                static_cast<long long>(o.tokens), static_cast<long long>(kBlocks * 4), static_cast<long long>(kBlocks));
    const bool hw_ok = check_headwise(o);
    std::printf("head-wise check: %s\n", hw_ok ? "PASS" : "FAIL: fused numbers withheld");
    std::vector<CaseResult> hw;
    for (const char* c : {"hw_fwd_reference", "hw_fwd_fused", "hw_fwdbwd_reference", "hw_fwdbwd_fused"}) {
        const bool is_fused = std::strstr(c, "fused") != nullptr;
        CaseResult r = (is_fused && !hw_ok) ? CaseResult{} : spawn(self_path, c, o);
        hw.push_back(r);
        if (is_fused && !hw_ok) std::printf("%-28s %12s\n", c, "withheld");
        else std::printf("%-28s %12.3f ms\n", c, r.ms);
    }
    if (hw_ok)
        std::printf("head-wise speedup fused vs einsum: forward %.2fx, fwd+bwd %.2fx\n", hw[0].ms / hw[1].ms,
                    hw[2].ms / hw[3].ms);

    if (o.skip_model) return op_ok && hw_ok ? 0 : 1;
    const std::string ref_out = "/tmp/bench_mlstm_ref_" + std::to_string(getpid()) + ".bin";
    const std::string fused_out = "/tmp/bench_mlstm_fused_" + std::to_string(getpid()) + ".bin";
    std::printf("\nmodel: vil_tiny 1024x1024 (4096 tokens), batch 1, inference forward, median of %d\n", o.model_reps);
    CaseResult ref = spawn(self_path, "model_fwd_reference", o, ref_out);
    std::printf("%-40s %12.1f ms %10.1f MiB\n", "reference (mlstm_mode parallel)", ref.ms, ref.peak_mb);
    CaseResult fused = spawn(self_path, "model_fwd_fused", o, fused_out);
    auto read = [](const std::string& path) {
        std::ifstream f(path, std::ios::binary);
        std::vector<float> v(1000);
        f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
        return f ? torch::tensor(v) : torch::Tensor();
    };
    torch::Tensor a = read(fused_out), b = read(ref_out);
    std::remove(ref_out.c_str());
    std::remove(fused_out.c_str());
    const double model_err = a.defined() && b.defined() ? rel_err(a, b) : 1.0;
    const bool model_ok = model_err < 1e-3;
    std::printf("model check: logits rel L2 err fused vs reference %.2e (bound 1e-3): %s\n", model_err,
                model_ok ? "PASS" : "FAIL: fused numbers withheld");
    if (!model_ok) return 1;
    std::printf("%-40s %12.1f ms %10.1f MiB\n", "fused (mlstm_mode chunkwise, impl fused)", fused.ms, fused.peak_mb);
    std::printf("model forward speedup fused chunkwise vs reference parallel: %.2fx\n", ref.ms / fused.ms);
    return op_ok && hw_ok ? 0 : 1;
}
