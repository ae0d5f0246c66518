#!/usr/bin/env python3
"""linvis against the PyTorch that users run: timm's DeiT on torch 2.x (SDPA), eager and torch.compile,
measured in the same run as `linvis bench`, resolution by resolution.

Run it through bench/compare_torch.sh, which makes the virtual environment (torch and timm from PyPI, kept
out of linvis's own dependencies) and calls this file with that environment's python. By hand:

    VENV/bin/python bench/compare_torch.py --linvis build/linvis --res 224,512,1024 \
        --models deit_tiny,vit3_tiny,vittt_tiny --markdown peer.md

What it does, for each resolution in turn (so that drift of the machine hits every column alike):
  1. `linvis bench --format json` for the linvis models (each case in its own process, as linvis bench does);
  2. timm `deit_tiny_patch16_224` (img_size=res, SDPA attention) eager, in a child process;
  3. the same compiled with torch.compile (compile time reported, not timed), in a child process.
With --train every case is a training step instead (forward, cross-entropy against one label, backward,
gradients dropped), as `linvis bench --train` times it.
Every case: batch 1, float32, the same thread count, warm-up passes then timed passes, images/s as the median;
memory as linvis bench defines it: activation = peak resident set size minus the resident size once the
model and input are built (VmHWM reset after the build).

Before timing anything, the same DeiT weights are checked to give the same logits in both: timm's randomly
initialised model is saved as safetensors, `linvis run --model deit_tiny` runs it on the same input, and the
run stops if the relative error exceeds --check-tol (no number is reported for a model that computes
something else).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TIMM_MODEL = "deit_tiny_patch16_224"


def read_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss():
    # Writing 5 to clear_refs resets VmHWM to the current resident size (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_timm(res, threads):
    import timm
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = timm.create_model(TIMM_MODEL, pretrained=False, img_size=res).eval()
    image = torch.randn(1, 3, res, res, generator=torch.Generator().manual_seed(1))
    return torch, model, image


def child_time(args):
    """One timm case in this process; prints one JSON line."""
    torch, model, image = build_timm(args.res, args.threads)
    compile_s = 0.0
    if args.train:
        # A training step as linvis bench --train times it: forward, cross-entropy, backward, grads dropped.
        label = torch.zeros(1, dtype=torch.long)

        def step(m):
            torch.nn.functional.cross_entropy(m(image), label).backward()
            for p in m.parameters():
                p.grad = None
        context = torch.enable_grad()
    else:
        def step(m):
            m(image)
        context = torch.inference_mode()
    with context:
        if args.mode == "compile":
            start = time.perf_counter()
            model = torch.compile(model)
            step(model)  # compiles
            compile_s = time.perf_counter() - start
        # As linvis bench: the base is the resident size once the model and input are built (for compile: and
        # compiled), so the warm-up's allocations count as the pass's own.
        base_kib = read_status_kib("VmRSS")
        reset_peak_rss()
        for _ in range(args.warmup):
            step(model)
        times = []
        budget_end = time.perf_counter() + args.max_seconds
        for i in range(args.iters):
            start = time.perf_counter()
            step(model)
            times.append(time.perf_counter() - start)
            if i >= 2 and time.perf_counter() > budget_end:
                break
        peak_kib = read_status_kib("VmHWM")
    rates = [1.0 / t for t in times]
    print(json.dumps({
        "model": TIMM_MODEL, "mode": args.mode, "train": bool(args.train), "res": args.res, "threads": args.threads,
        "torch": torch.__version__, "images_per_s": statistics.median(rates),
        "images_per_s_min": min(rates), "images_per_s_max": max(rates), "iterations": len(times),
        "compile_s": compile_s, "base_mib": base_kib / 1024.0,
        "activation_mib": max(0.0, (peak_kib - base_kib) / 1024.0),
        "sdpa": bool(getattr(model.blocks[0].attn, "fused_attn", False)) if args.mode == "eager" else None,
    }))


def child_export(args):
    """Saves timm's random DeiT weights, an input and its logits for the correctness check."""
    from safetensors.torch import save_file

    torch, model, image = build_timm(args.res, args.threads)
    with torch.inference_mode():
        logits = model(image)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(args.dir, "weights.safetensors"))
    save_file({"input": image.contiguous()}, os.path.join(args.dir, "input.safetensors"))
    save_file({"logits": logits.contiguous()}, os.path.join(args.dir, "expected.safetensors"))


def child_compare(args):
    from safetensors.torch import load_file

    expected = load_file(os.path.join(args.dir, "expected.safetensors"))["logits"].double()
    actual = load_file(os.path.join(args.dir, "actual.safetensors"))["logits"].double()
    if expected.shape != actual.shape:
        print(json.dumps({"rel_err": float("inf"), "why": f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"}))
        return
    rel = ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    print(json.dumps({"rel_err": rel}))


def sgemm_gflops(threads):
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(2048, 2048)
    b = torch.randn(2048, 2048)
    for _ in range(2):
        a @ b
    start = time.perf_counter()
    reps = 5
    for _ in range(reps):
        a @ b
    return 2 * 2048 ** 3 * reps / (time.perf_counter() - start) / 1e9


def run_child(extra, args, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(args.threads)] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def check_same_outputs(args):
    with tempfile.TemporaryDirectory() as tmp:
        run_child(["--child", "export", "--res", "224", "--dir", tmp], args, 600)
        subprocess.run([args.linvis, "run", "--model", "deit_tiny", "--weights",
                        os.path.join(tmp, "weights.safetensors"), "--input",
                        os.path.join(tmp, "input.safetensors"), "--output",
                        os.path.join(tmp, "actual.safetensors"), "--threads", str(args.threads)],
                       check=True, capture_output=True, text=True)
        result = run_child(["--child", "compare", "--dir", tmp], args, 600)
    return result


def linvis_bench(args, res):
    cmd = [args.linvis, "bench", "--models", args.models, "--res", str(res), "--threads", str(args.threads),
           "--warmup", str(args.warmup), "--iters", str(args.iters), "--max-seconds", str(args.max_seconds),
           "--format", "json", "--no-gemm"]
    if args.impl:
        cmd += ["--impl", args.impl]
    if args.train:
        cmd += ["--train"]
    if args.model_kwargs:
        cmd += ["--model-kwargs"] + args.model_kwargs.split()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def linvis_sgemm(args):
    out = subprocess.run([args.linvis, "bench", "--models", "deit_tiny", "--res", "32", "--threads",
                          str(args.threads), "--warmup", "0", "--iters", "3", "--format", "json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0].get("sgemm_gflops", 0.0)


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def linvis_isa(linvis):
    out = subprocess.run([linvis, "version"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.startswith("SIMD"):
            return line.split(None, 1)[1].strip()
    return "unknown"


def markdown(rows, meta):
    what = "training step (forward + cross-entropy + backward)" if meta.get("train") else "inference"
    if meta.get("linvis_model_kwargs"):
        what += f", linvis models with {meta['linvis_model_kwargs']}"
    lines = [f"Machine: {meta['cpu']} ({meta['isa']}), {meta['threads']} threads, batch 1, float32, {what}, "
             f"{meta['date']}. torch {meta['torch']} + timm {meta['timm']} from PyPI; linvis {meta['linvis_rev']}. "
             f"SGEMM 2048^2 in this run: torch {meta['torch_sgemm']:.0f} GFLOP/s, linvis "
             f"{meta['linvis_sgemm']:.0f} GFLOP/s. Same DeiT weights, same input: linvis vs timm logits "
             f"max relative error {meta['check_rel_err']:.2e}.", "",
             "| res | model | images/s | activation MiB | x timm eager | x timm compile |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        eager = row["timm_eager"]["images_per_s"]
        comp = row["timm_compile"]["images_per_s"] if row.get("timm_compile") else None
        lines.append(f"| {row['res']} | timm {TIMM_MODEL} eager (SDPA) | {eager:.3g} | "
                     f"{row['timm_eager']['activation_mib']:.0f} | 1.00 | |")
        if comp:
            lines.append(f"| {row['res']} | timm {TIMM_MODEL} torch.compile | {comp:.3g} | "
                         f"{row['timm_compile']['activation_mib']:.0f} | {comp / eager:.2f} | 1.00 |")
        for case in row["linvis"]:
            if case.get("status") != "ok":
                lines.append(f"| {row['res']} | linvis {case['model']} | {case.get('status')} | | | |")
                continue
            rate = case["images_per_s"]
            act = (case["peak_mem_bytes"] - case["base_mem_bytes"]) / 2 ** 20
            vs_comp = f"{rate / comp:.2f}" if comp else ""
            lines.append(f"| {row['res']} | linvis {case['model']} ({case['impl']}) | {rate:.3g} | {act:.0f} | "
                         f"{rate / eager:.2f} | {vs_comp} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--linvis", default="build/linvis")
    parser.add_argument("--models", default="deit_tiny,vit3_tiny,vittt_tiny,t5_tiny,vil_tiny")
    parser.add_argument("--impl", default="", help="passed to linvis bench (default: its own, auto)")
    parser.add_argument("--res", default="224,512,1024")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--train", action="store_true", help="time training steps instead of inference")
    parser.add_argument("--model-kwargs", default="", help="passed to linvis bench, e.g. 'grad_checkpointing=true'")
    parser.add_argument("--check-tol", type=float, default=1e-4)
    parser.add_argument("--json", help="write all raw results here")
    parser.add_argument("--markdown", help="write the table here")
    # internal: child processes
    parser.add_argument("--child", choices=["time", "export", "compare"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["eager", "compile"], default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.res = int(args.res.split(",")[0])
        {"time": child_time, "export": child_export, "compare": child_compare}[args.child](args)
        return 0

    import timm
    import torch

    check = check_same_outputs(args)
    if not check or not check["rel_err"] <= args.check_tol:
        print(f"linvis deit_tiny and timm {TIMM_MODEL} disagree on the same weights: {check}; no numbers",
              file=sys.stderr)
        return 1
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    meta = {"cpu": cpu_model(), "isa": linvis_isa(args.linvis), "threads": args.threads,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "timm": timm.__version__,
            "linvis_rev": rev or "unknown", "torch_sgemm": sgemm_gflops(args.threads),
            "linvis_sgemm": linvis_sgemm(args), "check_rel_err": check["rel_err"], "train": bool(args.train),
            "linvis_model_kwargs": args.model_kwargs}
    rows = []
    for res in [int(r) for r in args.res.split(",")]:
        print(f"res {res}: linvis bench", file=sys.stderr)
        row = {"res": res, "linvis": linvis_bench(args, res)}
        common = ["--res", str(res), "--warmup", str(args.warmup), "--iters", str(args.iters),
                  "--max-seconds", str(args.max_seconds), "--child", "time"] + (["--train"] if args.train else [])
        print(f"res {res}: timm eager", file=sys.stderr)
        row["timm_eager"] = run_child(common + ["--mode", "eager"], args, 3600)
        if not args.no_compile:
            print(f"res {res}: timm torch.compile", file=sys.stderr)
            row["timm_compile"] = run_child(common + ["--mode", "compile"], args, 3600)
        rows.append(row)
    table = markdown(rows, meta)
    sys.stdout.write(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
