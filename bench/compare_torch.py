#!/usr/bin/env python3
"""linvis against the PyTorch that users run: for every linvis model the same architecture on torch 2.x
(its "peer"), eager and torch.compile, plus timm's DeiT-tiny as a common reference, measured in the same run as
`linvis bench`, resolution by resolution.

Peers (same architecture, same state-dict names, so the same weights load into both):
  deit_tiny  -> timm `deit_tiny_patch16_224` (img_size=res, SDPA attention);
  vit3_tiny  -> bench/peer_models.py Vit3 (LeapLabTHU/ViTTT ViT3-T, written from spec/vit3_t5_official.md A2-A7);
  hvit3_tiny -> bench/peer_models.py HVit3 (LeapLabTHU/ViTTT H-ViT3-T, spec A2, A4, A7), its RoPE buffers built for
                the resolution;
  t5_tiny    -> bench/peer_models.py T5 (LeapLabTHU/Transformer-to-TTT T5_tiny, spec B2/B6);
  vil_tiny   -> bench/peer_models.py Vil (NX-AI/vision-lstm VisionLSTM2 vil2-tiny, spec/vil_official.md), with the
                official (and only) mLSTM backend, the quadratic parallel form: its memory grows as S^2 with the
                token count S, and a resolution whose estimate exceeds the available memory is skipped, not run;
  vittt_tiny -> none: it has no official code (spec/vittt.md), so it is compared with timm's DeiT only;
  dit_s2, dit3_s2, dit5_s2 (--task denoise) -> bench/peer_models.py Dit: facebookresearch/DiT's DiT-S/2 with timm's
                Attention (SDPA), LeapLabTHU/ViTTT's DiTTT-S/2 and LeapLabTHU/Transformer-to-TTT's DiT5-S/2
                (spec/dit_generation.md), NATTEN's na2d_qk / na2d_av written as the exact pure-PyTorch gather the
                fixtures used (the peer environment installs no NATTEN); timed as one guided denoising step,
                forward_with_cfg with guidance 4 on the batch of 2 (a label and the null label), as
                `linvis bench --task denoise` times it, --res being the latent side. No timm DeiT reference.
The peer modules are our own plain PyTorch from the specs (no official code is copied), using the ops the
official code uses (F.silu, F.conv2d, F.layer_norm, F.instance_norm, F.group_norm, einsum). bench/check_peer_models.py
checks them on their own (state-dict counts, closed-form inner gradients vs autograd, parallel mLSTM vs the
recurrence, batch independence).

Run it through bench/compare_torch.sh, which makes the virtual environment (torch and timm from PyPI, kept
out of linvis's own dependencies) and calls this file with that environment's python. By hand:

    VENV/bin/python bench/compare_torch.py --linvis build/linvis --res 224,512,1024 \
        --models deit_tiny,vit3_tiny,hvit3_tiny,vittt_tiny,t5_tiny,vil_tiny --markdown peer.md

What it does:
  0. correctness, at 224 (the generation models: latent side 16, `linvis run` on x, t, y, every parameter moved
     off its adaLN-Zero init), for timm's DeiT and for every requested model that has a peer: the torch model with
     its random initialisation (peer_models: the official init, then every 1-D parameter - biases, norm
     weights, ViL's skip - moved by N(0, 0.02) so that none sits at an exact 0 or 1) is saved (DeiT: safetensors;
     peers: the official-style torch.save .pth, read by linvis's checkpoint loader), `linvis run --model M`
     runs it on the same input, and the logits must agree to --check-tol relative max error. If timm's DeiT
     fails the run stops; a peer that fails is not timed and its columns say so (exit status 2).
  then for each resolution in turn (so that drift of the machine hits every column alike):
  1. `linvis bench --format json` for the linvis models (each case in its own process, as linvis bench does);
  2. timm DeiT eager, then compiled with torch.compile (compile time reported, not timed), each in a child
     process;
  3. each checked peer the same way, eager then compiled, each in its own child process.
With --train every case is a training step instead (forward, cross-entropy against one label, backward,
gradients dropped), as `linvis bench --train` times it.
Every case: batch 1, float32, the same thread count, warm-up passes then timed passes, images/s as the median;
memory as linvis bench defines it: activation = peak resident set size minus the resident size once the
model and input are built (VmHWM reset after the build); for linvis less the float32 weights it keeps in oneDNN's
layout for inference (packed_weight_bytes, weight memory constant in the image size), which the table names.
Reported per linvis model: images/s over timm DeiT eager and compile (as before), and over its same-architecture
peer eager and compile (JSON: rows[i].ratios[model]; markdown: the last columns).
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
# linvis model -> description of its same-architecture peer on torch 2.x. Models not listed have none.
PEERS = {
    "deit_tiny": f"timm {TIMM_MODEL} (SDPA)",
    "vit3_tiny": "ViT3-T (LeapLabTHU/ViTTT) in peer_models.py",
    "hvit3_tiny": "H-ViT3-T (LeapLabTHU/ViTTT) in peer_models.py",
    "t5_tiny": "T5_tiny (LeapLabTHU/Transformer-to-TTT) in peer_models.py",
    "vil_tiny": "ViL-T (NX-AI/vision-lstm VisionLSTM2, parallel mLSTM) in peer_models.py",
    "dit_s2": "DiT-S/2 (facebookresearch/DiT, timm Attention with SDPA) in peer_models.py",
    "dit3_s2": "DiTTT-S/2 (LeapLabTHU/ViTTT dittt) in peer_models.py",
    "dit5_s2": "DiT5-S/2 (LeapLabTHU/Transformer-to-TTT DiT5, NATTEN as a pure-PyTorch gather) in peer_models.py",
}
# Generation models: `--task denoise` times one guided denoising step, forward_with_cfg (guidance 4) on the batch
# doubled with the null label, as `linvis bench --task denoise` does; --res is the latent side.
DIT_MODELS = ("dit_s2", "dit3_s2", "dit5_s2")
CFG_SCALE = 4.0
CHECK_LATENT = 16  # the correctness check's latent side: a grid of 8 x 8 tokens holds DiT5's 5 x 5 window
NO_PEER_NOTE = {"vittt_tiny": "no official code (spec/vittt.md): DeiT only"}


def read_status_kib(field, path="/proc/self/status"):
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{path} has no {field}")


def reset_peak_rss():
    # Writing 5 to clear_refs resets VmHWM to the current resident size (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peer_estimated_bytes(model, res):
    """A lower bound on the peer's peak (inference; training needs more) for models whose official form is
    quadratic in the tokens: ViL's parallel mLSTM keeps about eight (4 heads, S, S) float32 matrices alive at
    once (S = (res/16)^2)."""
    if model != "vil_tiny":
        return 0
    tokens = (res // 16) ** 2
    return 8 * 4 * tokens * tokens * 4


def build_peer(model_name, res, threads, dtype="f32"):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if model_name == "deit_tiny":
        import timm
        model = timm.create_model(TIMM_MODEL, pretrained=False, img_size=res).eval()
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import peer_models
        model = peer_models.create(model_name, img_size=res)
    generator = torch.Generator().manual_seed(1)
    # --dtype bf16: parameters and input in bfloat16, as linvis bench --dtype bf16 runs its models.
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = model.to(dt)
    if model_name in DIT_MODELS:
        # (x, t, y): the latent batch doubled, a label and the null label (1000), one timestep.
        x = torch.randn(1, 4, res, res, generator=generator).repeat(2, 1, 1, 1).to(dt)
        return torch, model, (x, torch.tensor([500, 500]), torch.tensor([7, 1000]))
    image = torch.randn(1, 3, res, res, generator=generator).to(dt)
    return torch, model, image


def child_time(args):
    """One peer case in this process; prints one JSON line."""
    torch, model, image = build_peer(args.peer, args.res, args.threads, args.dtype)
    compile_s = 0.0
    if args.peer in DIT_MODELS:
        if args.train:
            raise SystemExit("--train: the generation models are timed for inference only")

        import peer_models  # build_peer put it on the path

        def step(m):
            peer_models.guided(m, *image, CFG_SCALE)
        if args.dtype == "bf16":
            # The official timestep embedding is computed in float32 and would meet bf16 weights: under autocast,
            # as a user runs the official code in bf16, each product takes bf16 operands.
            guided = step

            def step(m):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    guided(m)
        context = torch.inference_mode()
    elif args.train:
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
    sdpa = None
    if args.peer == "deit_tiny" and args.mode == "eager":
        sdpa = bool(getattr(model.blocks[0].attn, "fused_attn", False))
    print(json.dumps({
        "model": TIMM_MODEL if args.peer == "deit_tiny" else args.peer, "peer_of": args.peer,
        "status": "ok", "mode": args.mode, "train": bool(args.train), "res": args.res, "threads": args.threads,
        "dtype": args.dtype,
        "torch": torch.__version__, "images_per_s": statistics.median(rates),
        "images_per_s_min": min(rates), "images_per_s_max": max(rates), "iterations": len(times),
        "compile_s": compile_s, "base_mib": base_kib / 1024.0,
        "activation_mib": max(0.0, (peak_kib - base_kib) / 1024.0), "sdpa": sdpa,
    }))


def child_export(args):
    """Saves the peer's random weights, an input and its logits for the correctness check."""
    from safetensors.torch import save_file

    torch, model, image = build_peer(args.peer, args.res, args.threads)
    if args.peer in DIT_MODELS:
        # adaLN-Zero starts every modulation and the output layer at 0: move every parameter, so that each term
        # of the computation shows in the output.
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
    elif args.peer != "deit_tiny":
        # Move every 1-D parameter (biases, norm weights or offsets, ViL's learnable skip) off its exact
        # initial 0 or 1, so that a wrong bias, eps or 1 + weight shows in the logits.
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.02 * torch.randn(p.shape, generator=generator))
            # BatchNorm's running statistics (H-ViT3) likewise off 0 and 1, so that eval mode must read them.
            for name, b in model.named_buffers():
                if name.endswith("running_mean"):
                    b.add_(0.1 * torch.randn(b.shape, generator=generator))
                elif name.endswith("running_var"):
                    b.mul_(torch.exp(0.2 * torch.randn(b.shape, generator=generator)))
    with torch.inference_mode():
        if args.peer in DIT_MODELS:
            inputs, expected = dict(zip(("x", "t", "y"), image)), {"out": model(*image)}
        else:
            inputs, expected = {"input": image}, {"logits": model(image)}
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if args.peer == "deit_tiny":
        save_file(state, os.path.join(args.dir, "weights.safetensors"))
    else:
        torch.save(state, os.path.join(args.dir, "weights.pth"))
    save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(args.dir, "input.safetensors"))
    save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(args.dir, "expected.safetensors"))


def child_compare(args):
    from safetensors.torch import load_file

    key, expected = next(iter(load_file(os.path.join(args.dir, "expected.safetensors")).items()))  # logits or out
    expected = expected.double()
    actual = load_file(os.path.join(args.dir, "actual.safetensors"))[key].double()
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


def check_same_outputs(args, model):
    """The peer of `model` and `linvis run --model model` on the same weights and input: {"rel_err": ...}."""
    res = CHECK_LATENT if model in DIT_MODELS else 224
    with tempfile.TemporaryDirectory() as tmp:
        run_child(["--child", "export", "--peer", model, "--res", str(res), "--dir", tmp], args, 600)
        weights = "weights.safetensors" if model == "deit_tiny" else "weights.pth"
        kwargs = ["--model-kwargs", f"input_size={res}"] if model in DIT_MODELS else []
        run = subprocess.run([args.linvis, "run", "--model", model, "--weights", os.path.join(tmp, weights),
                              "--input", os.path.join(tmp, "input.safetensors"), "--output",
                              os.path.join(tmp, "actual.safetensors"), "--threads", str(args.threads)] + kwargs,
                             capture_output=True, text=True)
        if run.returncode != 0:
            return {"rel_err": float("inf"), "why": f"linvis run failed: {run.stderr.strip()[-500:]}"}
        return run_child(["--child", "compare", "--dir", tmp], args, 600)


def linvis_bench(args, res):
    cmd = [args.linvis, "bench", "--models", args.models, "--res", str(res), "--threads", str(args.threads),
           "--warmup", str(args.warmup), "--iters", str(args.iters), "--max-seconds", str(args.max_seconds),
           "--format", "json", "--no-gemm", "--dtype", args.dtype]
    if args.impl:
        cmd += ["--impl", args.impl]
    if args.train:
        cmd += ["--train"]
    if args.task == "denoise":
        cmd += ["--task", "denoise"]
    if args.model_kwargs:
        cmd += ["--model-kwargs"] + args.model_kwargs.split()
    # linvis bench exits 1 when a case failed, after printing every case (a failed one with its status): the rows
    # are read either way, and only a run without them is an error.
    out = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return json.loads(out.stdout[out.stdout.index("["):])
    except ValueError:
        raise RuntimeError(f"linvis bench exited {out.returncode} without its rows: {out.stderr.strip()[-500:]}")


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


def linvis_matrix_engine(linvis):
    out = subprocess.run([linvis, "version", "--format", "json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1]).get("matrix_engine", "unknown")


def time_peer(args, model, res, mode):
    """One peer case in a child process, or a record of why it has no number."""
    need = peer_estimated_bytes(model, res)
    if need:
        avail = read_status_kib("MemAvailable", "/proc/meminfo") * 1024
        if need > avail:
            return {"status": f"skipped: needs > {need / 2 ** 30:.0f} GiB ({avail / 2 ** 30:.0f} available)",
                    "peer_of": model, "mode": mode, "res": res}
    common = ["--res", str(res), "--warmup", str(args.warmup), "--iters", str(args.iters),
              "--max-seconds", str(args.max_seconds), "--child", "time", "--peer", model, "--mode", mode,
              "--dtype", args.dtype]
    try:
        return run_child(common + (["--train"] if args.train else []), args, 3600)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        last = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
        return {"status": f"failed: {last}", "peer_of": model, "mode": mode, "res": res}


def rate_of(case):
    return case["images_per_s"] if case and case.get("status", "ok") == "ok" else None


def ratios(row, linvis_models):
    """Per linvis model: images/s over timm DeiT eager/compile and over its same-architecture peer."""
    out = {}
    deit_eager, deit_comp = rate_of(row.get("timm_eager")), rate_of(row.get("timm_compile"))
    for case in row["linvis"]:
        if case.get("status") != "ok":
            continue
        model, rate = case["model"], case["images_per_s"]
        peer = row["peers"].get(model, {})
        eager, comp = rate_of(peer.get("eager")), rate_of(peer.get("compile"))
        out[model] = {
            "vs_timm_deit_eager": rate / deit_eager if deit_eager else None,
            "vs_timm_deit_compile": rate / deit_comp if deit_comp else None,
            "peer": PEERS.get(model), "peer_note": NO_PEER_NOTE.get(model),
            "vs_peer_eager": rate / eager if eager else None,
            "vs_peer_compile": rate / comp if comp else None,
        }
    return out


def fmt(x):
    return f"{x:.2f}" if x is not None else ""


def markdown(rows, meta):
    denoise = meta.get("task") == "denoise"
    what = "training step (forward + cross-entropy + backward)" if meta.get("train") else "inference"
    if denoise:
        what = (f"one guided denoising step (forward_with_cfg, guidance {CFG_SCALE:g}, the batch of 2 with the null "
                f"label), res = the latent side")
    if meta.get("linvis_model_kwargs"):
        what += f", linvis models with {meta['linvis_model_kwargs']}"
    checks = ", ".join(f"{m} {c['rel_err']:.2e}" for m, c in meta["checks"].items())
    dtype = "bfloat16 (linvis's bf16 attention and TTT-mixer products: " + meta.get("matrix_engine", "?") + ")" \
        if meta.get("dtype") == "bf16" else "float32"
    lines = [f"Machine: {meta['cpu']} ({meta['isa']}), {meta['threads']} threads, batch 1, {dtype}, {what}, "
             f"{meta['date']}. torch {meta['torch']} + timm {meta['timm']} from PyPI; linvis {meta['linvis_rev']}. "
             f"SGEMM 2048^2 in this run: torch {meta['torch_sgemm']:.0f} GFLOP/s, linvis "
             f"{meta['linvis_sgemm']:.0f} GFLOP/s. Same weights, same input at "
             f"{'latent side %d' % CHECK_LATENT if denoise else '224'}, linvis vs its torch peer, "
             f"{'output' if denoise else 'logits'} max relative error: {checks}.", "",
             "Peers (same architecture): " + "; ".join(f"{m}: {p}" for m, p in PEERS.items()) + "; "
             + "; ".join(f"{m}: {n}" for m, n in NO_PEER_NOTE.items()) + ".", "",
             "| res | model | images/s | activation MiB | x timm DeiT eager | x timm DeiT compile "
             "| x same-arch eager | x same-arch compile |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        res = row["res"]
        deit_eager, deit_comp = rate_of(row.get("timm_eager")), rate_of(row.get("timm_compile"))
        for model, peer in row["peers"].items():
            name = f"timm {TIMM_MODEL} (SDPA)" if model == "deit_tiny" else f"torch peer of {model}"
            eager, comp = rate_of(peer.get("eager")), rate_of(peer.get("compile"))
            for mode, case in (("eager", peer.get("eager")), ("torch.compile", peer.get("compile"))):
                if case is None:
                    continue
                rate = rate_of(case)
                if rate is None:
                    lines.append(f"| {res} | {name} {mode} | {case.get('status')} | | | | | |")
                    continue
                lines.append(f"| {res} | {name} {mode} | {rate:.3g} | {case['activation_mib']:.0f} | "
                             f"{fmt(rate / deit_eager if deit_eager else None)} | "
                             f"{fmt(rate / deit_comp if deit_comp else None)} | "
                             f"{fmt(rate / eager if eager else None)} | {fmt(rate / comp if comp else None)} |")
        for case in row["linvis"]:
            if case.get("status") != "ok":
                lines.append(f"| {res} | linvis {case['model']} | {case.get('status')} | | | | | |")
                continue
            r = row["ratios"].get(case["model"], {})
            # Weights kept in oneDNN's layout for inference are weight memory, constant in the image size: shown
            # beside the activations rather than in them.
            packed = case.get("packed_weight_bytes", 0) / 2 ** 20
            act = (case["peak_mem_bytes"] - case["base_mem_bytes"]) / 2 ** 20 - packed
            act_cell = f"{act:.0f}" + (f" (+{packed:.0f} packed weights)" if packed >= 0.5 else "")
            same_eager = fmt(r.get("vs_peer_eager"))
            same_comp = fmt(r.get("vs_peer_compile"))
            model = case["model"]
            if model in NO_PEER_NOTE:
                same_eager = NO_PEER_NOTE[model]
            elif model in meta["check_failed"]:
                check = meta["checks"][model]
                why = check.get("why") or f"rel err {check['rel_err']:.2e}"
                same_eager = f"peer not reported: check failed ({why})"
            elif model not in PEERS:
                same_eager = "no peer"
            elif r.get("vs_peer_eager") is None and row["peers"].get(model, {}).get("eager"):
                same_eager = f"peer eager {row['peers'][model]['eager'].get('status')}"
            lines.append(f"| {res} | linvis {model} ({case['impl']}) | {case['images_per_s']:.3g} | {act_cell} | "
                         f"{fmt(r.get('vs_timm_deit_eager'))} | {fmt(r.get('vs_timm_deit_compile'))} | "
                         f"{same_eager} | {same_comp} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--linvis", default="build/linvis")
    parser.add_argument("--models", default="",
                        help="default: deit_tiny,vit3_tiny,hvit3_tiny,vittt_tiny,t5_tiny,vil_tiny (classify), "
                             "dit_s2,dit3_s2,dit5_s2 (denoise)")
    parser.add_argument("--task", choices=["classify", "denoise"], default="classify",
                        help="denoise: one guided denoising step of the generation models (res: the latent side)")
    parser.add_argument("--impl", default="", help="passed to linvis bench (default: its own, auto)")
    parser.add_argument("--res", default="224,512,1024")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--train", action="store_true", help="time training steps instead of inference")
    parser.add_argument("--model-kwargs", default="", help="passed to linvis bench, e.g. 'grad_checkpointing=true'")
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                        help="bf16: both sides time bfloat16 parameters and inputs (the same-weights check stays "
                             "in float32)")
    parser.add_argument("--check-tol", type=float, default=1e-4)
    parser.add_argument("--json", help="write all raw results here")
    parser.add_argument("--markdown", help="write the table here")
    # internal: child processes
    parser.add_argument("--child", choices=["time", "export", "compare"], help=argparse.SUPPRESS)
    parser.add_argument("--peer", default="deit_tiny", choices=sorted(PEERS), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["eager", "compile"], default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.res = int(args.res.split(",")[0])
        {"time": child_time, "export": child_export, "compare": child_compare}[args.child](args)
        return 0

    import timm
    import torch

    denoise = args.task == "denoise"
    if not args.models:
        args.models = ",".join(DIT_MODELS) if denoise else "deit_tiny,vit3_tiny,hvit3_tiny,vittt_tiny,t5_tiny,vil_tiny"
    models = [m for m in args.models.split(",") if m]
    if denoise != all(m in DIT_MODELS for m in models):
        parser.error(f"--task denoise takes the generation models ({', '.join(DIT_MODELS)}) and only them")
    if denoise and args.train:
        parser.error("--task denoise times inference only")
    # timm's DeiT is every classifier's common reference: it is checked (and timed) even if deit_tiny is not asked
    # for. The generation models are compared with their own peers only.
    peer_list = ([] if denoise else ["deit_tiny"]) + [m for m in models if m in PEERS and m != "deit_tiny"]
    checks, failed = {}, []
    for model in peer_list:
        print(f"check: linvis {model} vs {PEERS[model]}", file=sys.stderr)
        check = check_same_outputs(args, model) or {"rel_err": float("inf"), "why": "no result"}
        checks[model] = check
        if not check["rel_err"] <= args.check_tol:
            print(f"linvis {model} and {PEERS[model]} disagree on the same weights: {check}", file=sys.stderr)
            failed.append(model)
    if "deit_tiny" in failed:
        print("the common reference (timm DeiT) failed its check: no numbers", file=sys.stderr)
        return 1
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    meta = {"cpu": cpu_model(), "isa": linvis_isa(args.linvis), "threads": args.threads,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "timm": timm.__version__,
            "linvis_rev": rev or "unknown", "torch_sgemm": sgemm_gflops(args.threads),
            "linvis_sgemm": linvis_sgemm(args), "check_rel_err": checks.get("deit_tiny", {}).get("rel_err"),
            "checks": checks, "check_failed": failed, "train": bool(args.train), "task": args.task,
            "dtype": args.dtype, "matrix_engine": linvis_matrix_engine(args.linvis),
            "linvis_model_kwargs": args.model_kwargs, "peers": PEERS, "no_peer": NO_PEER_NOTE}
    rows = []
    for res in [int(r) for r in args.res.split(",")]:
        print(f"res {res}: linvis bench", file=sys.stderr)
        row = {"res": res, "linvis": linvis_bench(args, res), "peers": {}}
        for model in peer_list:
            if model in failed:
                continue
            row["peers"][model] = {}
            for mode in ["eager"] + ([] if args.no_compile else ["compile"]):
                print(f"res {res}: {PEERS[model]} {mode}", file=sys.stderr)
                row["peers"][model][mode] = time_peer(args, model, res, mode)
        row["timm_eager"] = row["peers"].get("deit_tiny", {}).get("eager")
        row["timm_compile"] = row["peers"].get("deit_tiny", {}).get("compile")
        row["ratios"] = ratios(row, models)
        rows.append(row)
    table = markdown(rows, meta)
    sys.stdout.write(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
