# Writes vae_tiny_encode.safetensors: the official diffusers AutoencoderKL encoder outputs for
# tests/test_vae.cpp (Vae.EncodeMatchesDiffusers and the legacy key schemes).
#
#   /work/venv-torch/bin/python tests/data/vae/make_encoder_reference.py \
#       ../shared/fixtures/generation/vae_tiny.weights.safetensors tests/data/vae/vae_tiny_encode.safetensors
#
# Made with torch 2.15.0 (CPU, fp32, TF32 off) and diffusers 0.42.1 from PyPI (not a linvis dependency).
# The weights file holds the full autoencoder (encoder, quant_conv, post_quant_conv, decoder) and its
# diffusers config in the metadata key 'config'.
import json
import sys

import torch
from diffusers import AutoencoderKL
from safetensors import safe_open
from safetensors.torch import load_file, save_file

weights_path, out_path = sys.argv[1], sys.argv[2]
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

with safe_open(weights_path, "pt") as f:
    config = json.loads(f.metadata()["config"])
config = {k: v for k, v in config.items() if not k.startswith("_")}
vae = AutoencoderKL(**config)
vae.load_state_dict(load_file(weights_path), strict=True)
vae.eval()

# A fixed (1, 3, 32, 48) image in [-1, 1]: smooth stripes plus seeded noise, so that every channel and
# both spatial axes vary (48 != 32 checks that width and height are not swapped).
ys = torch.linspace(0, 1, 32)[:, None]
xs = torch.linspace(0, 1, 48)[None, :]
g = torch.Generator().manual_seed(0)
base = torch.stack([torch.sin(6.0 * xs + 2.0 * ys), torch.cos(5.0 * ys - 3.0 * xs), torch.sin(9.0 * xs * ys)])
image = (0.7 * base + 0.3 * (torch.rand(3, 32, 48, generator=g) * 2 - 1)).clamp(-1, 1)[None].contiguous()

with torch.no_grad():
    dist = vae.encode(image).latent_dist
    eps = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(7))
    sample = dist.sample(generator=torch.Generator().manual_seed(7))  # mean + std * eps, the same draw
    assert torch.equal(sample, dist.mean + dist.std * eps)

tensors = {
    "image": image,
    "mean": dist.mean.contiguous(),
    "logvar": dist.logvar.contiguous(),  # already clamped to [-30, 20]
    "eps": eps.contiguous(),
    "sample": sample.contiguous(),
}
save_file(tensors, out_path, metadata={"torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
                                       "weights": "vae_tiny.weights.safetensors",
                                       "call": "vae.encode(image).latent_dist; sample = mean + std * eps"})
for k, v in tensors.items():
    print(k, tuple(v.shape), float(v.abs().max()))
