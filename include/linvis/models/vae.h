// The decoder of diffusers' AutoencoderKL as DiT uses it (stabilityai/sd-vae-ft-mse / -ema; spec
// dit_generation.md §5): post_quant_conv, conv_in, a mid block (resnet, single-head attention,
// resnet), up blocks of layers_per_block + 1 resnets with nearest x2 upsampling plus a conv, and
// GroupNorm + SiLU + conv_out. GroupNorm eps 1e-6 everywhere.
//
// Registered as the generative model `sd_vae_decoder` (kind "vae") with options block_out_channels
// (comma list, default 128,256,512,512), layers_per_block (2), latent_channels (4), out_channels (3),
// norm_num_groups (32). State-dict names are diffusers' current ones; map_checkpoint_key also accepts
// the old diffusers attention names (query/key/value/proj_attn) and the original CompVis/LDM names
// (decoder.mid.block_1, decoder.up.{3-i}.block.{j}, nin_shortcut, norm_out, 1x1-conv attention
// weights), and drops the encoder / quant_conv keys of a full autoencoder file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/models/model.h"

namespace linvis::models {

// DiT's hard-coded latent scale: images = decode(samples / kSdVaeScale).
constexpr double kSdVaeScale = 0.18215;

struct VaeDecoderConfig {
    std::vector<int64_t> block_out_channels{128, 256, 512, 512};
    int64_t layers_per_block = 2;
    int64_t latent_channels = 4;
    int64_t out_channels = 3;
    int64_t norm_num_groups = 32;
};

class VaeDecoder : public Model {
public:
    // z (B, latent_channels, h, w) (already divided by the scale) -> image (B, out_channels, h*2^k, w*2^k),
    // k = len(block_out_channels) - 1, roughly in [-1, 1].
    virtual torch::Tensor decode(const torch::Tensor& z) = 0;
    virtual const VaeDecoderConfig& config() const = 0;
    int64_t upsampling_factor() const { return int64_t{1} << (config().block_out_channels.size() - 1); }
};

using VaeDecoderPtr = std::shared_ptr<VaeDecoder>;

VaeDecoderPtr make_vae_decoder(const VaeDecoderConfig& config);
// `sd_vae_decoder` (or another registered VAE) by name.
VaeDecoderPtr create_vae_decoder(const std::string& name, const ModelConfig& config = ModelConfig());

}  // namespace linvis::models
