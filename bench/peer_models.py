"""The official architectures of linvis's vit3_tiny, hvit3_tiny, t5_tiny, vil_tiny and of the generation models
dit_s2, dit3_s2 and dit5_s2 as plain PyTorch (torch 2.x) modules.

Written for bench/compare_torch.py from the layer-by-layer descriptions in the project's specs, not copied from
the official repositories:
  * ViT3-T: LeapLabTHU/ViTTT vittt/models/vittt.py + ttt_block.py (spec/vit3_t5_official.md A2, A3, A7);
  * H-ViT3-T: LeapLabTHU/ViTTT vittt/models/h_vittt.py (spec/vit3_t5_official.md A2, A4, A7);
  * T5_tiny: LeapLabTHU/Transformer-to-TTT T5/models.py (spec/vit3_t5_official.md B2, B6);
  * ViL-T: NX-AI/vision-lstm vision_lstm/vision_lstm2.py, VisionLSTM2 with the hub names of the released
    vil2 checkpoints (spec/vil_official.md sections 1 and 3.1);
  * DiT-S/2, DiTTT-S/2, DiT5-S/2: facebookresearch/DiT models.py (timm's Attention and Mlp, as it imports them),
    LeapLabTHU/ViTTT dittt/models.py, LeapLabTHU/Transformer-to-TTT DiT5/models.py with NATTEN's neighbourhood
    attention as a pure-PyTorch gather (spec/dit_generation.md 1.1-1.6).
Each computes what the official module computes with the same ops in the same order (F.silu where the official
code calls silu, z * sigmoid(z) where it writes that, F.instance_norm, F.group_norm, grouped F.conv2d for the
per-sample kernels, torch.einsum for ViL's headwise projections), and its state_dict has the official key names
and shapes, so the same .pth loads into linvis (`linvis run --model vit3_tiny --weights file.pth`).

Resolution: every model is built for img_size (square, a multiple of 16), as the official code builds it with
img_size / input_shape. ViT3 has no position embedding. H-ViT3's RoPE buffers are built for img_size (the
official classification model builds them for 224; the det/seg backbone recomputes them for any grid). T5's pos_embed has (img_size/16)^2 tokens; a state dict
made at another resolution is resized on load (bicubic, antialias, as timm's resample_abs_pos_embed, which
linvis uses). ViL's pos_embed.embed is (1, h, w, D); a state dict made at another resolution is resized on load
with the official bicubic interpolate (align_corners False, no antialias), as VisionLSTM2.load_state_dict does,
and the sequence conv uses this model's own grid (the official model built with input_shape=(3, res, res)).

ViL's mLSTM runs the quadratic parallel form (parallel_stabilized_simple): the official VisionLSTM2 has no other
backend (spec/vil_official.md section 0 and 5.2), so its cost grows as S^2 with the token count S.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

PEER_MODELS = ("vit3_tiny", "hvit3_tiny", "t5_tiny", "vil_tiny")


def _trunc_normal(t, std):
    # timm's trunc_normal_(std=.02) cuts at the absolute bounds +-2, i.e. effectively untruncated.
    nn.init.trunc_normal_(t, std=std, a=-2.0, b=2.0)


def _init_linears(model):
    # The official init of every Linear (ViT3, H-ViT3, T5): trunc_normal std .02, bias 0.
    for m in model.modules():
        if isinstance(m, nn.Linear):
            _trunc_normal(m.weight, 0.02)
            nn.init.zeros_(m.bias)


class Mlp(nn.Module):
    """timm Mlp: fc1 -> GELU (exact erf) -> fc2 (dropouts are p = 0)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, dim, patch=16, in_chans=3):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------- ViT3


class Vit3TTT(nn.Module):
    """ttt_block.py TTT: a simplified-SwiGLU inner model over heads and a depthwise 3x3 inner model over a
    d-channel map, each trained one full-batch step on (k, v) with the negative dot-product loss, then applied
    to q (spec A2)."""

    def __init__(self, dim, num_heads, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        d = self.head_dim
        self.scale = 9 ** -0.5
        self.w1 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.zeros(d, 1, 3, 3))
        for w in (self.w1, self.w2, self.w3):
            _trunc_normal(w, 0.02)
        self.qkv = nn.Linear(dim, 3 * dim + 3 * d, bias=qkv_bias)
        self.proj = nn.Linear(dim + d, dim)

    def forward(self, x, h, w, rope=None):
        B, N, C = x.shape
        nh, d = self.num_heads, self.head_dim
        q1, k1, v1, q2, k2, v2 = self.qkv(x).split([C, C, C, d, d, d], dim=-1)
        if rope is not None:
            # H-ViT3: RoPE over the full C channels of q1 and k1, before the head split (A2 step 2, A4).
            q1 = rope(q1.reshape(B, h, w, C)).reshape(B, N, C)
            k1 = rope(k1.reshape(B, h, w, C)).reshape(B, N, C)
        q1, k1, v1 = (t.reshape(B, N, nh, d).transpose(1, 2) for t in (q1, k1, v1))
        q2, k2, v2 = (t.reshape(B, h, w, d).permute(0, 3, 1, 2) for t in (q2, k2, v2))

        # SwiGLU branch: F1(x) = (x W1) * silu(x W2), hand-derived gradients, column-norm clip, lr 1.
        z1 = k1 @ self.w1
        z2 = k1 @ self.w2
        sig = torch.sigmoid(z2)
        a = z2 * sig
        e = (-v1 / float(N)) * self.scale
        k1t = k1.transpose(-2, -1)
        g1 = k1t @ (e * a)
        g2 = k1t @ (e * z1 * (sig * (1.0 + z2 * (1.0 - sig))))
        g1 = g1 / (torch.linalg.vector_norm(g1, ord=2, dim=-2, keepdim=True) + 1.0)
        g2 = g2 / (torch.linalg.vector_norm(g2, ord=2, dim=-2, keepdim=True) + 1.0)
        w1 = self.w1 - 1.0 * g1
        w2 = self.w2 - 1.0 * g2

        # Depthwise 3x3 branch ('prod' gradient: 9 shifted products), Frobenius clip over each kernel.
        e2 = (-v2 / float(h * w)) * self.scale
        kp = F.pad(k2, (1, 1, 1, 1))
        dots = []
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                dots.append((kp[:, :, 1 + dy:1 + dy + h, 1 + dx:1 + dx + w] * e2).sum(dim=(-2, -1)))
        g3 = torch.stack(dots, dim=-1).reshape(B * d, 1, 3, 3)
        g3 = g3 / (torch.linalg.vector_norm(g3, ord=2, dim=(-2, -1), keepdim=True) + 1.0)
        w3 = self.w3.repeat(B, 1, 1, 1) - 1.0 * g3

        x1 = (q1 @ w1) * F.silu(q1 @ w2)
        x1 = x1.transpose(1, 2).reshape(B, N, C)
        x2 = F.conv2d(q2.reshape(1, B * d, h, w), w3, padding=1, groups=B * d)
        x2 = x2.reshape(B, d, N).transpose(1, 2)
        return self.proj(torch.cat([x1, x2], dim=-1))


class Vit3Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.cpe = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=True)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Vit3TTT(dim, num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        B, N, C = x.shape
        h = w = int(N ** 0.5)
        x = x + self.cpe(x.transpose(1, 2).reshape(B, C, h, w)).flatten(2).transpose(1, 2)
        x = x + self.attn(self.norm1(x), h, w)
        return x + self.mlp(self.norm2(x))


class Vit3(nn.Module):
    """vittt/models/vittt.py VisionTransformer (ViT3): patch embed, no cls token, no position embedding (CPE
    only), 12 blocks, LayerNorm, mean over tokens, head (spec A3)."""

    def __init__(self, img_size=224, embed_dim=192, depth=12, num_heads=6, num_classes=1000):
        super().__init__()
        self.img_size = img_size
        self.patch_embed = PatchEmbed(embed_dim)
        self.blocks = nn.ModuleList([Vit3Block(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        _init_linears(self)

    def forward(self, x):
        x = self.patch_embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(dim=1))


# ---------------------------------------------------------------------------------------------------- H-ViT3


class Rope(nn.Module):
    """h_vittt.py RoPE: a persistent buffer rotations (H, W, C/2, 2) of cos / sin; the first C/4 pairs turn with
    the row index, the last C/4 with the column index; the input is cast to float32 and multiplied as complex
    numbers (channel 2p real, 2p + 1 imaginary) (A4)."""

    def __init__(self, h, w, dim, base=10000):
        super().__init__()
        k_max = dim // 4
        theta = 1.0 / (base ** (torch.arange(k_max, dtype=torch.float32) / k_max))
        ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                                indexing="ij")
        angles = torch.cat([ys[..., None] * theta, xs[..., None] * theta], dim=-1)
        self.register_buffer("rotations", torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1))

    def forward(self, x):
        if x.dtype != torch.float32:
            x = x.float()
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * torch.view_as_complex(self.rotations)).flatten(-2)


class ConvLayer(nn.Module):
    """h_vittt.py ConvLayer: conv, then BatchNorm2d (eps 1e-5) and / or ReLU where given."""

    def __init__(self, cin, cout, kernel, stride=1, groups=1, bias=False, norm=True, act=True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=bias)
        self.norm = nn.BatchNorm2d(cout) if norm else None
        self.act = nn.ReLU() if act else None

    def forward(self, x):
        x = self.conv(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.act(x) if self.act is not None else x


class HVit3Stem(nn.Module):
    """Stride-4 conv stem: 3x3 s2, 3x3, 3x3, 3x3 s2 to 4 C0, 1x1 to C0 without ReLU (A4)."""

    def __init__(self, dim):
        super().__init__()
        half = dim // 2
        self.conv = nn.Sequential(
            ConvLayer(3, half, 3, stride=2), ConvLayer(half, half, 3), ConvLayer(half, half, 3),
            ConvLayer(half, 4 * dim, 3, stride=2), ConvLayer(4 * dim, dim, 1, act=False))

    def forward(self, x):
        return self.conv(x)


class PatchMerging(nn.Module):
    """1x1 to R = 4 dim_out with ReLU, depthwise 3x3 stride 2 with ReLU, 1x1 to dim_out with BatchNorm (A4)."""

    def __init__(self, dim, dim_out, ratio=4):
        super().__init__()
        hidden = ratio * dim_out
        self.conv = nn.Sequential(
            ConvLayer(dim, hidden, 1, bias=True, norm=False),
            ConvLayer(hidden, hidden, 3, stride=2, groups=hidden, bias=True, norm=False),
            ConvLayer(hidden, dim_out, 1, bias=True, act=False))

    def forward(self, x, h, w):
        B, N, C = x.shape
        x = self.conv(x.transpose(1, 2).reshape(B, C, h, w))
        return x.flatten(2).transpose(1, 2), x.shape[2], x.shape[3]


class ConvMlp(nn.Module):
    """h_vittt.py Mlp: fc1, GELU, x + depthwise 3x3 (with bias) over the hidden map, GELU, fc2 (A4)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.dwc = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=True)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x, h, w):
        B, N, _ = x.shape
        x = self.act(self.fc1(x))
        m = x.transpose(1, 2).reshape(B, -1, h, w)
        x = x + self.dwc(m).flatten(2).transpose(1, 2)
        return self.fc2(self.act(x))


class HVit3Block(nn.Module):
    """h_vittt.py TTTBlock, registered as cpe, norm1, rope, attn, norm2, mlp; LayerNorm eps 1e-5 (A4)."""

    def __init__(self, dim, num_heads, h, w, mlp_ratio=4.0):
        super().__init__()
        self.cpe = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=True)
        self.norm1 = nn.LayerNorm(dim)
        self.rope = Rope(h, w, dim)
        self.attn = Vit3TTT(dim, num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = ConvMlp(dim, int(dim * mlp_ratio))

    def forward(self, x, h, w):
        B, N, C = x.shape
        x = x + self.cpe(x.transpose(1, 2).reshape(B, C, h, w)).flatten(2).transpose(1, 2)
        x = x + self.attn(self.norm1(x), h, w, self.rope)
        return x + self.mlp(self.norm2(x), h, w)


class HVit3Stage(nn.Module):
    def __init__(self, dim, dim_out, depth, num_heads, h, w):
        super().__init__()
        self.blocks = nn.ModuleList([HVit3Block(dim, num_heads, h, w) for _ in range(depth)])
        self.downsample = PatchMerging(dim, dim_out) if dim_out else None

    def forward(self, x, h, w):
        for blk in self.blocks:
            x = blk(x, h, w)
        if self.downsample is not None:
            x, h, w = self.downsample(x, h, w)
        return x, h, w


class HVit3(nn.Module):
    """h_vittt.py ViTTT (H-ViT3-T): conv stem /4, four stages of TTT blocks (head dim 32) with RoPE and the conv
    MLP, patch merging between stages, BatchNorm1d, mean over tokens, head (A4, A7). The RoPE buffers are built
    for img_size (the official classification model is built for 224)."""

    def __init__(self, img_size=224, dims=(64, 128, 320, 512), depths=(1, 3, 9, 4), num_classes=1000):
        super().__init__()
        self.patch_embed = HVit3Stem(dims[0])
        grid = img_size // 4
        stages = []
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            side = grid >> i
            stages.append(HVit3Stage(dim, dims[i + 1] if i + 1 < len(dims) else None, depth, dim // 32, side, side))
        self.layers = nn.ModuleList(stages)
        self.norm = nn.BatchNorm1d(dims[-1])
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(dims[-1], num_classes)
        _init_linears(self)

    def forward(self, x):
        x = self.patch_embed(x)
        h, w = x.shape[2], x.shape[3]
        x = x.flatten(2).transpose(1, 2)
        for stage in self.layers:
            x, h, w = stage(x, h, w)
        x = self.avgpool(self.norm(x.transpose(1, 2))).flatten(1)
        return self.head(x)


# ---------------------------------------------------------------------------------------------------- T5


def _residual_conv_heads(t, conv, H, W):
    """T5 / DiT5: heads (B, h, N, d) -> (B, C, H, W) in the original channel order -> t + conv(t) -> heads."""
    B, nh, N, d = t.shape
    m = t.transpose(-2, -1).reshape(B, nh * d, H, W)
    m = m + conv(m)
    return m.reshape(B, nh, d, H * W).transpose(-2, -1)


class T5Attention(nn.Module):
    """T5/models.py Attention: key instance norm (eps 1.0), residual depthwise convs on q and k, a TTT-SwiGLU
    inner model f(x) = (silu(x W1) * (x W2)) W3 trained one step on the inner-product loss, applied to q (B2)."""

    def __init__(self, dim, num_heads, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        d = self.head_dim
        self.scale = d ** -0.5
        self.w1 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        for w in (self.w1, self.w2, self.w3):
            _trunc_normal(w, 0.02)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.q_conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=True)
        self.k_conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=True)

    def forward(self, x):
        B, N, C = x.shape
        H = W = int(math.sqrt(N))
        nh, d = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.reshape(B, N, nh, d).transpose(1, 2)
        k = F.instance_norm(k.transpose(1, 2).unsqueeze(-1), eps=1.0)
        k = k.reshape(B, nh, d, N).transpose(-2, -1)
        v = v.reshape(B, N, nh, d).transpose(1, 2)
        q2 = _residual_conv_heads(q, self.q_conv2d, H, W)
        k2 = _residual_conv_heads(k, self.k_conv2d, H, W)

        z1 = k2 @ self.w1
        z2 = k2 @ self.w2
        sig = torch.sigmoid(z1)
        a1 = z1 * sig
        a2 = a1 * z2
        e = (-v / float(N)) * self.scale
        da2 = e @ self.w3.transpose(-2, -1)
        k2t = k2.transpose(-2, -1)
        g1 = k2t @ (da2 * z2 * (sig * (1.0 + z1 * (1.0 - sig))))
        g2 = k2t @ (da2 * a1)
        g3 = a2.transpose(-2, -1) @ e
        w1 = self.w1 - g1
        w2 = self.w2 - g2
        w3 = self.w3 - g3

        o = (F.silu(q2 @ w1) * (q2 @ w2)) @ w3
        return self.proj(o.transpose(1, 2).reshape(B, N, C))


class T5Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = T5Attention(dim, num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class T5(nn.Module):
    """T5/models.py VisionTransformer (T5_tiny): DeiT-Ti shape without cls token, pos_embed (1, N, C), no CPE,
    mean over tokens (B2)."""

    def __init__(self, img_size=224, embed_dim=192, depth=12, num_heads=3, num_classes=1000):
        super().__init__()
        self.img_size = img_size
        self.grid = img_size // 16
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid, embed_dim))
        self.patch_embed = PatchEmbed(embed_dim)
        self.blocks = nn.ModuleList([T5Block(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        _trunc_normal(self.pos_embed, 0.02)
        _init_linears(self)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "pos_embed"
        value = state_dict.get(key)
        if value is not None and value.shape != self.pos_embed.shape:
            side = int(math.isqrt(value.shape[1]))
            grid = value.reshape(1, side, side, -1).permute(0, 3, 1, 2)
            grid = F.interpolate(grid.float(), size=(self.grid, self.grid), mode="bicubic", antialias=True,
                                 align_corners=False)
            state_dict[key] = grid.permute(0, 2, 3, 1).reshape(1, self.grid * self.grid, -1).to(value.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        x = self.patch_embed(x) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(dim=1))


# ---------------------------------------------------------------------------------------------------- ViL


class ResidualWeightLayerNorm(nn.Module):
    """vision_lstm2.LayerNorm: the stored weight is an offset, F.layer_norm applies 1 + weight (1.12)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), weight=1.0 + self.weight, bias=self.bias, eps=self.eps)


class MultiHeadLayerNorm(nn.Module):
    """Per-token, per-head LayerNorm through F.group_norm with weight 1 + w (1.9)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        B, NH, S, DH = x.shape
        y = x.transpose(1, 2).reshape(B * S, NH * DH)
        y = F.group_norm(y, num_groups=NH, weight=1.0 + self.weight, bias=self.bias, eps=self.eps)
        return y.view(B, S, NH, DH).transpose(1, 2)


class LinearHeadwiseExpand(nn.Module):
    """Block-diagonal linear with 4x4 blocks, weight (nh, out, in), as an einsum (1.6 step 6)."""

    def __init__(self, dim, block=4):
        super().__init__()
        self.num_heads = dim // block
        self.weight = nn.Parameter(torch.zeros(self.num_heads, block, block))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(*shape[:-1], self.num_heads, -1)
        x = torch.einsum("...hd,hod->...ho", x, self.weight)
        return x.reshape(shape) + self.bias


def parallel_stabilized_simple(q, k, v, igate_preact, fgate_preact, eps=1e-6):
    """The quadratic parallel stabilized mLSTM in the official op order (1.7): q, k, v (B, NH, S, DH); gate
    pre-activations (B, NH, S, 1)."""
    B, NH, S, DH = q.shape
    lf = F.logsigmoid(fgate_preact)
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=q.device))
    cs = torch.cat([torch.zeros(B, NH, 1, 1, dtype=q.dtype, device=q.device), torch.cumsum(lf, dim=-2)], dim=-2)
    rep = cs.repeat(1, 1, 1, S + 1)
    diff = rep - rep.transpose(-2, -1)
    log_f = torch.where(mask, diff[:, :, 1:, 1:], -float("inf"))
    log_d = log_f + igate_preact.transpose(-2, -1)
    m, _ = torch.max(log_d, dim=-1, keepdim=True)
    d_mat = torch.exp(log_d - m)
    k_scaled = k / math.sqrt(DH)
    c = (q @ k_scaled.transpose(-2, -1)) * d_mat
    n = torch.maximum(c.sum(dim=-1, keepdim=True).abs(), torch.exp(-m))
    return (c / (n + eps)) @ v


class MatrixLstmCell(nn.Module):
    def __init__(self, dim, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.igate = nn.Linear(3 * dim, num_heads)
        self.fgate = nn.Linear(3 * dim, num_heads)
        self.outnorm = MultiHeadLayerNorm(dim, eps=1e-5)
        nn.init.zeros_(self.fgate.weight)
        with torch.no_grad():
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, num_heads))
        nn.init.zeros_(self.igate.weight)
        nn.init.normal_(self.igate.bias, std=0.1)

    def forward(self, q, k, v):
        B, S, _ = q.shape
        gate_in = torch.cat([q, k, v], dim=-1)
        ig = self.igate(gate_in).transpose(-1, -2).unsqueeze(-1)
        fg = self.fgate(gate_in).transpose(-1, -2).unsqueeze(-1)
        q, k, v = (t.view(B, S, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        h = parallel_stabilized_simple(q, k, v, ig, fg)
        return self.outnorm(h).transpose(1, 2).reshape(B, S, -1)


class VilLayer(nn.Module):
    """ViLLayer (1.6): proj_up, depthwise 3x3 sequence conv + SiLU before q/k, headwise q/k/v, mLSTM cell,
    learnable skip, SiLU(z) output gate, proj_down; reversed blocks flip the sequence in and out."""

    def __init__(self, dim, grid, reverse):
        super().__init__()
        inner = 2 * dim
        self.grid = grid
        self.reverse = reverse
        self.learnable_skip = nn.Parameter(torch.ones(inner))
        self.proj_up = nn.Linear(dim, 2 * inner)
        self.q_proj = LinearHeadwiseExpand(inner)
        self.k_proj = LinearHeadwiseExpand(inner)
        self.v_proj = LinearHeadwiseExpand(inner)
        self.conv = nn.Conv2d(inner, inner, 3, padding=1, groups=inner, bias=True)
        self.mlstm_cell = MatrixLstmCell(inner, num_heads=4)
        self.proj_down = nn.Linear(inner, dim)
        small = math.sqrt(2 / (5 * dim))
        for t in (self.proj_up.weight, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight):
            nn.init.normal_(t, std=small)
        nn.init.normal_(self.proj_down.weight, std=2 / 1 / math.sqrt(dim))
        for b in (self.proj_up.bias, self.proj_down.bias):
            nn.init.zeros_(b)

    def forward(self, x):
        B, S, _ = x.shape
        if self.reverse:
            x = x.flip(dims=[1])
        x_mlstm, z = torch.chunk(self.proj_up(x), 2, dim=-1)
        h, w = self.grid
        conv_in = x_mlstm.reshape(B, h, w, -1).permute(0, 3, 1, 2)
        x_conv = self.conv(conv_in).permute(0, 2, 3, 1).reshape(B, S, -1)
        x_act = F.silu(x_conv)
        q = self.q_proj(x_act)
        k = self.k_proj(x_act)
        v = self.v_proj(x_mlstm)
        h_tilde = self.mlstm_cell(q, k, v)
        h_skip = h_tilde + self.learnable_skip * x_act
        y = self.proj_down(h_skip * F.silu(z))
        if self.reverse:
            y = y.flip(dims=[1])
        return y


class VilBlock(nn.Module):
    def __init__(self, dim, grid, reverse):
        super().__init__()
        self.norm = ResidualWeightLayerNorm(dim, eps=1e-5)
        self.layer = VilLayer(dim, grid, reverse)

    def forward(self, x):
        return x + self.layer(self.norm(x))


class VilBlockPair(nn.Module):
    def __init__(self, dim, grid):
        super().__init__()
        self.rowwise_from_top_left = VilBlock(dim, grid, reverse=False)
        self.rowwise_from_bot_right = VilBlock(dim, grid, reverse=True)

    def forward(self, x):
        return self.rowwise_from_bot_right(self.rowwise_from_top_left(x))


class VilPosEmbed(nn.Module):
    def __init__(self, grid, dim):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(1, grid[0], grid[1], dim))
        _trunc_normal(self.embed, 0.02)


class Vil(nn.Module):
    """VisionLSTM2 (vil2-tiny), pooling bilateral_flatten with legacy_norm (1.10, 1.11):
    conv16/16 -> + pos -> flatten -> 12 block pairs -> LN(1e-6, 1 + w) -> cat(first, last) -> LN(1e-5) -> head."""

    def __init__(self, img_size=224, embed_dim=192, depth=12, num_classes=1000):
        super().__init__()
        self.img_size = img_size
        self.grid = (img_size // 16, img_size // 16)
        self.patch_embed = PatchEmbed(embed_dim)
        nn.init.xavier_uniform_(self.patch_embed.proj.weight.view(embed_dim, -1))
        nn.init.zeros_(self.patch_embed.proj.bias)
        self.pos_embed = VilPosEmbed(self.grid, embed_dim)
        self.blocks = nn.ModuleList([VilBlockPair(embed_dim, self.grid) for _ in range(depth)])
        self.norm = ResidualWeightLayerNorm(embed_dim, eps=1e-6)
        self.legacy_norm = nn.LayerNorm(2 * embed_dim)
        self.head = nn.Linear(2 * embed_dim, num_classes)
        _trunc_normal(self.head.weight, 2e-5)
        nn.init.zeros_(self.head.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "pos_embed.embed"
        value = state_dict.get(key)
        if value is not None and value.shape != self.pos_embed.embed.shape:
            grid = F.interpolate(value.permute(0, 3, 1, 2), size=self.grid, mode="bicubic")
            state_dict[key] = grid.permute(0, 2, 3, 1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        x = self.patch_embed.proj(x).permute(0, 2, 3, 1)
        x = x + self.pos_embed.embed
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        for pair in self.blocks:
            x = pair(x)
        x = self.norm(x)
        x = torch.cat([x[:, 0], x[:, -1]], dim=1)
        return self.head(self.legacy_norm(x))


# ---------------------------------------------------------------------------------------------------- DiT family


def _sincos_1d(dim, pos):
    # dit_generation.md 1.1: omega_k = 1 / 10000^(k / (dim/2)), all sines first, then all cosines (float64).
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    out = pos.reshape(-1).to(torch.float64)[:, None] * omega[None, :]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def _sincos_2d(dim, grid):
    # Token n = i*G + j: the first half from the column j, the second from the row i.
    i, j = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    return torch.cat([_sincos_1d(dim // 2, j), _sincos_1d(dim // 2, i)], dim=1).float()


def _modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim, freq_dim=256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t):
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class LabelEmbedder(nn.Module):
    """Eval mode only (no label dropout); row num_classes is the guidance's null label."""

    def __init__(self, num_classes, dim):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, y):
        return self.embedding_table(y)


def _neighbourhood_attention(q, k, v, kernel=5):
    """NATTEN's na2d_qk / softmax / na2d_av (dilation 1, no RPB) on heads-first (B, h, G, G, d) tensors, written
    as the exact pure-PyTorch stand-in the fixtures used (../shared/fixtures/README.md): windows clamped inside
    the grid, start(i) = min(max(i - kernel//2, 0), G - kernel), neighbour index ky*kernel + kx."""
    G = q.shape[2]
    start = torch.clamp(torch.arange(G) - kernel // 2, min=0, max=G - kernel)
    idx = start[:, None] + torch.arange(kernel)[None, :]  # (G, kernel)
    rows = idx[:, None, :, None].expand(G, G, kernel, kernel)
    cols = idx[None, :, None, :].expand(G, G, kernel, kernel)
    k_nb = k[:, :, rows, cols]  # (B, h, G, G, kernel, kernel, d)
    v_nb = v[:, :, rows, cols]
    logits = (q[:, :, :, :, None, None, :] * k_nb).sum(-1).flatten(-2)
    attn = logits.softmax(dim=-1).reshape(logits.shape[:-1] + (kernel, kernel))
    return (attn[..., None] * v_nb).sum(dim=(-3, -2))


class Dit5Attention(nn.Module):
    """DiT5/models.py MixedAttention (dit_generation.md 1.4): 0.5 x neighbourhood attention of the raw q, k, v +
    0.5 x a TTT-MLP branch (per-channel scale/offset, key instance norm eps 1.0, residual depthwise convs, one
    step of f(x) = silu(x W1) W2 on the L2 loss), then proj."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        d = self.head_dim
        self.scale = d ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.w1 = nn.Parameter(0.02 * torch.randn(1, num_heads, d, d))
        self.w2 = nn.Parameter(0.02 * torch.randn(1, num_heads, d, d))
        self.qk_scale_ttt = nn.Parameter(torch.ones(1, 1, dim, 2))
        self.qk_offset_ttt = nn.Parameter(torch.zeros(1, 1, dim, 2))
        self.q_conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=True)
        self.k_conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=True)

    def forward(self, x):
        B, N, C = x.shape
        G = int(math.sqrt(N))
        nh, d = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # TTT branch
        qt = q * self.qk_scale_ttt[..., 0] + self.qk_offset_ttt[..., 0]
        kt = k * self.qk_scale_ttt[..., 1] + self.qk_offset_ttt[..., 1]
        qh = qt.reshape(B, N, nh, d).transpose(1, 2)
        vh = v.reshape(B, N, nh, d).transpose(1, 2)
        kh = F.instance_norm(kt.transpose(1, 2).unsqueeze(-1), eps=1.0).reshape(B, nh, d, N).transpose(-2, -1)
        q2 = _residual_conv_heads(qh, self.q_conv2d, G, G)
        k2 = _residual_conv_heads(kh, self.k_conv2d, G, G)
        z = k2 @ self.w1
        sig = torch.sigmoid(z)
        a = z * sig
        y = a @ self.w2
        e = (y - vh) / float(N) * self.scale
        g1 = k2.transpose(-2, -1) @ ((e @ self.w2.transpose(-2, -1)) * (sig * (1.0 + z * (1.0 - sig))))
        g2 = a.transpose(-2, -1) @ e
        x_ttt = F.silu(q2 @ (self.w1 - g1)) @ (self.w2 - g2)
        x_ttt = x_ttt.transpose(1, 2).reshape(B, N, C)
        # Neighbourhood attention branch on the raw q, k, v, heads first (B, h, G, G, d).
        grid = [t.reshape(B, G, G, nh, d).permute(0, 3, 1, 2, 4) for t in (q, k, v)]
        x_na = _neighbourhood_attention(grid[0] * self.scale, grid[1], grid[2])
        x_na = x_na.permute(0, 2, 3, 1, 4).reshape(B, N, C)
        return self.proj(0.5 * x_na + 0.5 * x_ttt)


class DitBlock(nn.Module):
    """adaLN-Zero block (dit_generation.md 1.1) with the family's mixer; DiT3 adds the cpe before it."""

    def __init__(self, family, dim, num_heads):
        super().__init__()
        from timm.models.vision_transformer import Attention, Mlp as TimmMlp

        self.family = family
        if family == "dit3":
            self.cpe = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=True)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        if family == "dit":
            self.attn = Attention(dim, num_heads=num_heads, qkv_bias=True)  # timm's, as models.py imports it
        elif family == "dit3":
            self.attn = Vit3TTT(dim, num_heads, qkv_bias=True)
        else:
            self.attn = Dit5Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = TimmMlp(in_features=dim, hidden_features=4 * dim, act_layer=lambda: nn.GELU(approximate="tanh"),
                           drop=0)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        if self.family == "dit3":
            B, N, C = x.shape
            G = int(math.sqrt(N))
            x = x + self.cpe(x.transpose(1, 2).reshape(B, C, G, G)).flatten(2).transpose(1, 2)
        u = _modulate(self.norm1(x), shift_msa, scale_msa)
        if self.family == "dit3":
            G = int(math.sqrt(x.shape[1]))
            mixed = self.attn(u, G, G)
        else:
            mixed = self.attn(u)
        x = x + gate_msa.unsqueeze(1) * mixed
        return x + gate_mlp.unsqueeze(1) * self.mlp(_modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, dim, patch, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch * patch * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class Dit(nn.Module):
    """facebookresearch/DiT models.py DiT (learn_sigma: 8 output channels) with the DiT, DiT3 (LeapLabTHU/ViTTT
    dittt) or DiT5 (LeapLabTHU/Transformer-to-TTT DiT5) block; state-dict names as the official modules'."""

    def __init__(self, family, input_size=32, patch=2, dim=384, depth=12, num_heads=6, num_classes=1000):
        super().__init__()
        self.patch, self.out_channels = patch, 8
        self.x_embedder = PatchEmbed(dim, patch=patch, in_chans=4)
        self.t_embedder = TimestepEmbedder(dim)
        self.y_embedder = LabelEmbedder(num_classes, dim)
        grid = input_size // patch
        self.pos_embed = nn.Parameter(_sincos_2d(dim, grid).unsqueeze(0), requires_grad=False)
        self.blocks = nn.ModuleList([DitBlock(family, dim, num_heads) for _ in range(depth)])
        self.final_layer = FinalLayer(dim, patch, self.out_channels)
        for m in self.modules():  # initialize_weights: xavier-uniform Linears, zero biases
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        for block in self.blocks:  # adaLN-Zero
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        for m in (self.final_layer.adaLN_modulation[-1], self.final_layer.linear):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        x = self.final_layer(x, c)
        B, N, _ = x.shape
        G, p, oc = int(math.sqrt(N)), self.patch, self.out_channels
        x = x.reshape(B, G, G, p, p, oc).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(B, oc, G * p, G * p)

    def forward_with_cfg(self, x, t, y, cfg_scale):
        return guided(self.forward, x, t, y, cfg_scale)


def guided(forward, x, t, y, cfg_scale):
    """DiT's forward_with_cfg around `forward` (the model, or the model compiled): the first half of the batch run
    twice (with y's labels, then its null labels), channels 0-2 guided, the rest as the model gives them."""
    half = x[: len(x) // 2]
    out = forward(torch.cat([half, half], dim=0), t, y)
    eps, rest = out[:, :3], out[:, 3:]
    cond, uncond = torch.split(eps, len(eps) // 2, dim=0)
    half_eps = uncond + cfg_scale * (cond - uncond)
    return torch.cat([torch.cat([half_eps, half_eps], dim=0), rest], dim=1)


DIT_PEERS = ("dit_s2", "dit3_s2", "dit5_s2")


def create(name, img_size=224):
    """A peer model by its linvis name, randomly initialised as the official code initialises it, in eval mode.
    For the DiT family img_size is the latent side L (input_size)."""
    if name in DIT_PEERS:
        return Dit(name.split("_")[0], input_size=img_size).eval()
    if name == "vit3_tiny":
        model = Vit3(img_size=img_size)
    elif name == "hvit3_tiny":
        model = HVit3(img_size=img_size)
    elif name == "t5_tiny":
        model = T5(img_size=img_size)
    elif name == "vil_tiny":
        model = Vil(img_size=img_size)
    else:
        raise ValueError(f"peer_models: no peer for model '{name}' (have {', '.join(PEER_MODELS + DIT_PEERS)})")
    return model.eval()
