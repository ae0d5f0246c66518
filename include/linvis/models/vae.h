// diffusers' AutoencoderKL as DiT uses it (stabilityai/sd-vae-ft-mse / -ema; spec dit_generation.md §4.1, §5),
// as two registered generative models (kind "vae") that load from the same full autoencoder file:
//
// - `sd_vae_decoder`: post_quant_conv, conv_in, a mid block (resnet, single-head attention, resnet), up
//   blocks of layers_per_block + 1 resnets with nearest x2 upsampling plus a conv, and GroupNorm + SiLU +
//   conv_out. decode(z) takes z = latent / 0.18215.
// - `sd_vae_encoder` (diffusers Encoder with double_z, then quant_conv): conv_in, down blocks of
//   layers_per_block resnets each followed (except the last) by a downsampler (zero padding (0, 1, 0, 1),
//   then a 3x3 stride-2 conv without padding), the same mid block, GroupNorm + SiLU + conv_out to
//   2 * latent_channels, quant_conv (1x1) -> moments split into [mean | logvar]; DiagonalGaussian:
//   logvar clamped to [-30, 20], std = exp(0.5 logvar), sample = mean + std * eps. Training latents are
//   sample * 0.18215 (DiT train.py).
//
// Both share one implementation of the ResnetBlock2D, the mid-block attention and GroupNorm (eps 1e-6
// everywhere), and one key mapping. Each keeps its own half of a full autoencoder file and drops the
// rest (the other half, the loss). Options of both (so one --vae-kwargs serves sampling and training):
// block_out_channels (comma list, default 128,256,512,512), layers_per_block (2), latent_channels (4),
// in_channels (3), out_channels (3), norm_num_groups (32). State-dict names are diffusers' current ones;
// map_checkpoint_key also accepts the old diffusers attention names (query/key/value/proj_attn) and the
// original CompVis/LDM names ({encoder,decoder}.mid.block_1, mid.attn_1.{norm,q,k,v,proj_out} as 1x1
// convs, encoder.down.{i}.block.{j} / .downsample, decoder.up.{n-1-i}.block.{j} / .upsample (reversed
// index), nin_shortcut, norm_out), with or without a first_stage_model. / vae. prefix.
//
// `linvis run --model sd_vae_encoder` reads 'image' (B, in_channels, H, W) in [-1, 1] and writes 'mean',
// 'logvar' (clamped) and 'latent' = mean * 0.18215 (the distribution's mode, scaled as DiT trains on it,
// which `linvis run --model sd_vae_decoder` takes as its 'latent').
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/models/model.h"

namespace linvis::models {

// DiT's hard-coded latent scale: latents = encode(x).sample() * kSdVaeScale, images = decode(samples / kSdVaeScale).
constexpr double kSdVaeScale = 0.18215;

struct VaeConfig {
    std::vector<int64_t> block_out_channels{128, 256, 512, 512};
    int64_t layers_per_block = 2;
    int64_t latent_channels = 4;
    int64_t in_channels = 3;   // the encoder's image channels
    int64_t out_channels = 3;  // the decoder's image channels
    int64_t norm_num_groups = 32;
    // 2^(len(block_out_channels) - 1): image side / latent side.
    int64_t scale_factor() const { return int64_t{1} << (block_out_channels.size() - 1); }
};

// Reads the options above from a model config (errors name the option).
VaeConfig read_vae_config(const std::string& model, const ModelConfig& config);

class VaeDecoder : public Model {
public:
    // z (B, latent_channels, h, w) (already divided by the scale) -> image (B, out_channels, h*2^k, w*2^k),
    // k = len(block_out_channels) - 1, roughly in [-1, 1].
    virtual torch::Tensor decode(const torch::Tensor& z) = 0;
    virtual const VaeConfig& config() const = 0;
    int64_t upsampling_factor() const { return config().scale_factor(); }
};

// diffusers' DiagonalGaussianDistribution (latent_dist) of an image batch.
struct LatentDistribution {
    torch::Tensor mean;    // (B, latent_channels, h, w)
    torch::Tensor logvar;  // the same shape, clamped to [-30, 20]
    torch::Tensor std() const { return torch::exp(0.5 * logvar); }
    // mean + std * eps; eps is standard normal noise of mean's shape (the caller draws it, from its own seed).
    torch::Tensor sample(const torch::Tensor& eps) const;
};

class VaeEncoder : public Model {
public:
    // image (B, in_channels, H, W) in [-1, 1] -> the latent distribution, (H, W) halved (rounded down)
    // by each of the k = len(block_out_channels) - 1 downsamplers: (H / 2^k, W / 2^k) for multiples of 2^k.
    virtual LatentDistribution encode(const torch::Tensor& image) = 0;
    virtual const VaeConfig& config() const = 0;
    int64_t downsampling_factor() const { return config().scale_factor(); }
};

using VaeDecoderPtr = std::shared_ptr<VaeDecoder>;
using VaeEncoderPtr = std::shared_ptr<VaeEncoder>;

VaeDecoderPtr make_vae_decoder(const VaeConfig& config);
VaeEncoderPtr make_vae_encoder(const VaeConfig& config);
// `sd_vae_decoder` / `sd_vae_encoder` (or another registered VAE half) by name.
VaeDecoderPtr create_vae_decoder(const std::string& name, const ModelConfig& config = ModelConfig());
VaeEncoderPtr create_vae_encoder(const std::string& name, const ModelConfig& config = ModelConfig());

}  // namespace linvis::models
