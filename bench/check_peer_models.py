#!/usr/bin/env python3
"""Self-checks of bench/peer_models.py, independent of linvis (compare_torch.py checks them against linvis):

    VENV/bin/python bench/check_peer_models.py

* state dicts: entry counts, parameter counts and key shapes as the specs give them for the official modules
  (spec/vit3_t5_official.md A4, A7, B6; spec/vil_official.md 2, 3.1; spec/dit_generation.md 1.5, 1.6);
* DiT and DiT3 against the official code's outputs in ../shared/fixtures (when present), and DiT5's
  neighbourhood attention against a loop over its clamped windows;
* H-ViT3's RoPE against the real / imaginary formula, row frequencies first;
* ViT3's and T5's closed-form inner gradients: the attention output equals one built from the autograd gradients
  of the inner loss (float64);
* ViL's parallel stabilized mLSTM equals the plain recurrence C_t = f_t C_{t-1} + i_t v_t k_t^T / sqrt(DH),
  h_t = C_t q_t / max(|n_t . q_t|, 1) (float64, eps 0);
* batch independence (the per-sample grouped conv of ViT3, ViL's flips) and the position-embedding resize on load.
"""

import math
import os
import sys
import unittest

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_models  # noqa: E402


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


class StateDicts(unittest.TestCase):
    def check(self, name, entries, params, shapes, img_size=224):
        model = peer_models.create(name, img_size=img_size)
        sd = model.state_dict()
        self.assertEqual(len(sd), entries)
        self.assertEqual(sum(p.numel() for p in model.parameters()), params)
        for key, shape in shapes.items():
            self.assertEqual(tuple(sd[key].shape), shape, key)

    def test_vit3(self):
        self.check("vit3_tiny", 210, 6149416, {
            "patch_embed.proj.weight": (192, 3, 16, 16), "blocks.0.cpe.weight": (192, 1, 3, 3),
            "blocks.11.attn.w1": (1, 6, 32, 32), "blocks.0.attn.w3": (32, 1, 3, 3),
            "blocks.0.attn.qkv.weight": (672, 192), "blocks.0.attn.proj.weight": (192, 224),
            "blocks.0.mlp.fc1.weight": (768, 192), "norm.weight": (192,), "head.weight": (1000, 192)})

    def test_hvit3(self):
        self.check("hvit3_tiny", 410, 28703560, {
            "patch_embed.conv.0.conv.weight": (32, 3, 3, 3), "patch_embed.conv.3.conv.weight": (256, 32, 3, 3),
            "patch_embed.conv.4.conv.weight": (64, 256, 1, 1), "patch_embed.conv.4.norm.running_var": (64,),
            "layers.0.blocks.0.cpe.weight": (64, 1, 3, 3), "layers.0.blocks.0.rope.rotations": (56, 56, 32, 2),
            "layers.0.blocks.0.attn.w1": (1, 2, 32, 32), "layers.0.blocks.0.attn.qkv.weight": (288, 64),
            "layers.0.blocks.0.attn.proj.weight": (64, 96), "layers.0.blocks.0.mlp.dwc.weight": (256, 1, 3, 3),
            "layers.0.downsample.conv.0.conv.weight": (512, 64, 1, 1),
            "layers.0.downsample.conv.1.conv.weight": (512, 1, 3, 3),
            "layers.0.downsample.conv.2.conv.weight": (128, 512, 1, 1),
            "layers.1.blocks.0.rope.rotations": (28, 28, 64, 2), "layers.2.blocks.8.rope.rotations": (14, 14, 160, 2),
            "layers.3.blocks.3.rope.rotations": (7, 7, 256, 2), "norm.running_mean": (512,),
            "head.weight": (1000, 512)})

    def test_t5(self):
        self.check("t5_tiny", 235, 6205480, {
            "pos_embed": (1, 196, 192), "blocks.0.attn.w3": (1, 3, 64, 64), "blocks.0.attn.qkv.weight": (576, 192),
            "blocks.0.attn.q_conv2d.weight": (192, 1, 3, 3), "blocks.0.attn.k_conv2d.bias": (192,),
            "head.weight": (1000, 192)})

    def test_dit_family(self):
        # dit_generation.md 1.5 / 1.6: S/2 at 256 px (latent 32), pos_embed included.
        self.check("dit_s2", 132, 32963360, {
            "pos_embed": (1, 256, 384), "x_embedder.proj.weight": (384, 4, 2, 2), "t_embedder.mlp.0.weight": (384, 256),
            "y_embedder.embedding_table.weight": (1001, 384), "blocks.0.attn.qkv.weight": (1152, 384),
            "blocks.0.adaLN_modulation.1.weight": (2304, 384), "final_layer.linear.weight": (32, 384)}, img_size=32)
        self.check("dit3_s2", 192, 34788128, {
            "blocks.0.cpe.weight": (384, 1, 3, 3), "blocks.0.attn.w3": (64, 1, 3, 3),
            "blocks.0.attn.qkv.weight": (1344, 384), "blocks.0.attn.proj.weight": (384, 448)}, img_size=32)
        self.check("dit5_s2", 228, 33663776, {
            "blocks.0.attn.qk_scale_ttt": (1, 1, 384, 2), "blocks.0.attn.q_conv2d.weight": (384, 1, 3, 3),
            "blocks.0.attn.w2": (1, 6, 64, 64), "blocks.0.attn.qkv.weight": (1152, 384)}, img_size=32)

    def test_vil(self):
        p = "blocks.11.rowwise_from_bot_right."
        self.check("vil_tiny", 513, 6391528, {
            "pos_embed.embed": (1, 14, 14, 192), p + "norm.weight": (192,), p + "layer.learnable_skip": (384,),
            p + "layer.proj_up.weight": (768, 192), p + "layer.q_proj.weight": (96, 4, 4),
            p + "layer.v_proj.bias": (384,), p + "layer.conv.weight": (384, 1, 3, 3),
            p + "layer.mlstm_cell.igate.weight": (4, 1152), p + "layer.mlstm_cell.outnorm.weight": (384,),
            p + "layer.proj_down.weight": (192, 384), "legacy_norm.weight": (384,), "head.weight": (1000, 384)})


class InnerGradients(unittest.TestCase):
    def test_vit3_ttt_equals_autograd_inner_step(self):
        torch.manual_seed(0)
        m = peer_models.Vit3TTT(48, 3).double()
        B, h, w, C, d = 2, 5, 4, 48, 16
        N = h * w
        x = torch.randn(B, N, C, dtype=torch.float64)
        with torch.no_grad():
            expected = m(x, h, w)
        q1, k1, v1, q2, k2, v2 = m.qkv(x).detach().split([C, C, C, d, d, d], dim=-1)
        q1, k1, v1 = (t.reshape(B, N, 3, d).transpose(1, 2) for t in (q1, k1, v1))
        q2, k2, v2 = (t.reshape(B, h, w, d).permute(0, 3, 1, 2) for t in (q2, k2, v2))
        s = 1.0 / 3.0
        W1 = m.w1.detach().expand(B, -1, -1, -1).clone().requires_grad_()
        W2 = m.w2.detach().expand(B, -1, -1, -1).clone().requires_grad_()
        loss = -(s / N) * (((k1 @ W1) * F.silu(k1 @ W2)) * v1).sum()
        g1, g2 = torch.autograd.grad(loss, [W1, W2])
        W1 = W1 - g1 / (g1.norm(dim=-2, keepdim=True) + 1.0)
        W2 = W2 - g2 / (g2.norm(dim=-2, keepdim=True) + 1.0)
        W3 = m.w3.detach().repeat(B, 1, 1, 1).requires_grad_()
        y = F.conv2d(k2.reshape(1, B * d, h, w), W3, padding=1, groups=B * d).reshape(B, d, h, w)
        (g3,) = torch.autograd.grad(-(s / N) * (y * v2).sum(), [W3])
        W3 = W3 - g3 / (g3.flatten(1).norm(dim=1).view(-1, 1, 1, 1) + 1.0)
        x1 = ((q1 @ W1) * F.silu(q1 @ W2)).transpose(1, 2).reshape(B, N, C)
        x2 = F.conv2d(q2.reshape(1, B * d, h, w), W3, padding=1, groups=B * d).reshape(B, d, N).transpose(1, 2)
        reference = m.proj(torch.cat([x1, x2], dim=-1)).detach()
        self.assertLess(max_rel(expected, reference), 1e-12)

    def test_t5_attention_equals_autograd_inner_step(self):
        torch.manual_seed(0)
        m = peer_models.T5Attention(48, 3).double()
        B, N, C, d = 2, 16, 48, 16
        x = torch.randn(B, N, C, dtype=torch.float64)
        with torch.no_grad():
            expected = m(x)
            q, k, v = m.qkv(x).chunk(3, dim=-1)
            # key instance norm written out: (k - mean_N) / sqrt(biased var_N + 1)
            k = (k - k.mean(dim=1, keepdim=True)) / torch.sqrt(k.var(dim=1, unbiased=False, keepdim=True) + 1.0)
            heads = lambda t: t.reshape(B, N, 3, d).transpose(1, 2)  # noqa: E731
            q2 = peer_models._residual_conv_heads(heads(q), m.q_conv2d, 4, 4)
            k2 = peer_models._residual_conv_heads(heads(k), m.k_conv2d, 4, 4)
            v = heads(v)
        Ws = [p.detach().expand(B, -1, -1, -1).clone().requires_grad_() for p in (m.w1, m.w2, m.w3)]
        f = lambda t, W: (F.silu(t @ W[0]) * (t @ W[1])) @ W[2]  # noqa: E731
        grads = torch.autograd.grad(-(d ** -0.5 / N) * (f(k2, Ws) * v).sum(), Ws)
        fast = [W - g for W, g in zip(Ws, grads)]
        reference = m.proj(f(q2, fast).transpose(1, 2).reshape(B, N, C)).detach()
        self.assertLess(max_rel(expected, reference), 1e-12)


class Rope(unittest.TestCase):
    def test_rotation_by_row_then_column_frequencies(self):
        # The det/seg backbone's functional form (spec A6): x_re cos - x_im sin, x_im cos + x_re sin, with the
        # angle y theta_k for the first C/4 pairs and x theta_k for the last C/4.
        h, w, C = 3, 5, 16
        rope = peer_models.Rope(h, w, C)
        x = torch.randn(2, h, w, C)
        theta = 1.0 / (10000 ** (torch.arange(C // 4, dtype=torch.float32) / (C // 4)))
        ys = torch.arange(h, dtype=torch.float32).view(h, 1, 1).expand(h, w, 1)
        xs = torch.arange(w, dtype=torch.float32).view(1, w, 1).expand(h, w, 1)
        angle = torch.cat([ys * theta, xs * theta], dim=-1)
        re, im = x[..., 0::2], x[..., 1::2]
        expected = torch.stack([re * angle.cos() - im * angle.sin(), im * angle.cos() + re * angle.sin()], dim=-1)
        self.assertLess(max_rel(rope(x), expected.flatten(-2)), 1e-6)


class Mlstm(unittest.TestCase):
    def test_parallel_equals_recurrence(self):
        torch.manual_seed(0)
        B, NH, S, DH = 2, 4, 13, 8
        q, k, v = (torch.randn(B, NH, S, DH, dtype=torch.float64) for _ in range(3))
        ig, fg = (torch.randn(B, NH, S, 1, dtype=torch.float64) * 2 for _ in range(2))
        parallel = peer_models.parallel_stabilized_simple(q, k, v, ig, fg, eps=0.0)
        C = torch.zeros(B, NH, DH, DH, dtype=torch.float64)
        n = torch.zeros(B, NH, DH, dtype=torch.float64)
        out = []
        for t in range(S):
            f, i = torch.sigmoid(fg[:, :, t]), torch.exp(ig[:, :, t])  # (B, NH, 1)
            kt = k[:, :, t] / math.sqrt(DH)
            C = f[..., None] * C + i[..., None] * v[:, :, t, :, None] * kt[:, :, None, :]
            n = f * n + i * kt
            qt = q[:, :, t]
            num = (C @ qt[..., None])[..., 0]
            den = torch.maximum((n * qt).sum(-1, keepdim=True).abs(), torch.ones_like(f))
            out.append(num / den)
        self.assertLess(max_rel(parallel, torch.stack(out, dim=2)), 1e-10)


class Models(unittest.TestCase):
    def test_batch_independent(self):
        for name in peer_models.PEER_MODELS:
            torch.manual_seed(0)
            m = peer_models.create(name, img_size=64).double()
            x = torch.randn(3, 3, 64, 64, dtype=torch.float64)
            with torch.no_grad():
                both = m(x)
                alone = torch.cat([m(x[i:i + 1]) for i in range(3)])
            self.assertLess(max_rel(both, alone), 1e-10, name)

    def test_pos_embed_resized_on_load(self):
        for name, key in (("t5_tiny", "pos_embed"), ("vil_tiny", "pos_embed.embed")):
            sd = peer_models.create(name, img_size=224).state_dict()
            m = peer_models.create(name, img_size=288)
            m.load_state_dict(sd)
            self.assertEqual(m.state_dict()[key].numel(), 18 * 18 * 192, name)
            with torch.no_grad():
                self.assertEqual(tuple(m(torch.randn(1, 3, 288, 288)).shape), (1, 1000))


class DitFamily(unittest.TestCase):
    FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "fixtures", "generation")

    def test_official_outputs(self):
        # The official code's outputs (../shared/fixtures, tiny configs) where they are present. DiT5's fixtures
        # use a 4 x 4 grid, below NATTEN's 5 x 5 window (a wrapping stand-in), so only DiT and DiT3 are compared;
        # compare_torch.py checks DiT5 against linvis, which matches its fixtures.
        if not os.path.isdir(self.FIXTURES):
            self.skipTest("no ../shared/fixtures/generation")
        from safetensors.torch import load_file
        for family in ("dit", "dit3"):
            model = peer_models.Dit(family, input_size=8, patch=2, dim=96, depth=1, num_heads=3, num_classes=10)
            model.load_state_dict(load_file(os.path.join(self.FIXTURES, f"{family}_tiny.weights.safetensors")))
            model.eval()
            for name, call in (("run", lambda f: model(f["x"], f["t"], f["y"])),
                               ("cfg1.5", lambda f: model.forward_with_cfg(f["x"], f["t"], f["y"], 1.5))):
                f = load_file(os.path.join(self.FIXTURES, f"{family}_tiny.{name}.safetensors"))
                with torch.no_grad():
                    self.assertLess(max_rel(call(f), f["out"]), 1e-4, f"{family} {name}")

    def test_neighbourhood_windows_are_clamped(self):
        # Every query sees the 5 x 5 keys of its clamped window (NATTEN, dilation 1): a loop over the grid.
        torch.manual_seed(0)
        G, d = 7, 4
        q, k, v = (torch.randn(1, 1, G, G, d, dtype=torch.float64) for _ in range(3))
        out = peer_models._neighbourhood_attention(q, k, v)
        for i in range(G):
            for j in range(G):
                y0, x0 = min(max(i - 2, 0), G - 5), min(max(j - 2, 0), G - 5)
                keys = k[0, 0, y0:y0 + 5, x0:x0 + 5].reshape(25, d)
                vals = v[0, 0, y0:y0 + 5, x0:x0 + 5].reshape(25, d)
                expected = torch.softmax(keys @ q[0, 0, i, j], dim=0) @ vals
                self.assertLess(max_rel(out[0, 0, i, j], expected), 1e-12)


if __name__ == "__main__":
    unittest.main(verbosity=2)
