// AutoencoderKL encoder and decoder (spec dit_generation.md §4.1, §5; huggingface/diffusers 0.42.1
// models/autoencoders/vae.py Encoder / Decoder / DiagonalGaussianDistribution, autoencoder_kl.py
// AutoencoderKL.encode (quant_conv), unets/unet_2d_blocks.py UNetMidBlock2D / DownEncoderBlock2D /
// UpDecoderBlock2D, resnet.py ResnetBlock2D, downsampling.py Downsample2D (padding 0: F.pad (0, 1, 0, 1)),
// upsampling.py Upsample2D, attention_processor.py Attention; legacy names as
// ModelMixin._fix_state_dict_keys_on_load and loaders/single_file_utils.py convert_ldm_vae_checkpoint map them).
#include "linvis/models/vae.h"

#include <cmath>
#include <regex>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"

namespace linvis::models {
namespace {

constexpr double kEps = 1e-6;

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(stride == 1 ? k / 2 : 0).bias(true));
}
// A stride-1 conv with 'same' padding.
torch::Tensor run_conv(const torch::nn::Conv2d& c, const torch::Tensor& x) {
    const int64_t k = c->weight.size(2);
    return flops::conv2d(x, c->weight, c->bias, {1, 1}, {k / 2, k / 2}, {1, 1}, 1);
}
torch::nn::GroupNorm group_norm(int64_t groups, int64_t channels) {
    return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels).eps(kEps).affine(true));
}

class ResnetBlock : public torch::nn::Module {
public:
    ResnetBlock(int64_t in, int64_t out, int64_t groups) {
        norm1 = register_module("norm1", group_norm(groups, in));
        conv1 = register_module("conv1", conv(in, out, 3));
        norm2 = register_module("norm2", group_norm(groups, out));
        conv2 = register_module("conv2", conv(out, out, 3));
        if (in != out) conv_shortcut = register_module("conv_shortcut", conv(in, out, 1));
    }
    torch::Tensor forward(const torch::Tensor& x) {
        torch::Tensor h = run_conv(conv1, torch::silu(norm1->forward(x)));
        h = run_conv(conv2, torch::silu(norm2->forward(h)));
        torch::Tensor shortcut = conv_shortcut ? run_conv(conv_shortcut, x) : x;
        return (shortcut + h) / 1.0;
    }
    torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
    torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
};

class MidAttention : public torch::nn::Module {
public:
    MidAttention(int64_t channels, int64_t groups) {
        group_norm = register_module("group_norm", models::group_norm(groups, channels));
        to_q = register_module("to_q", torch::nn::Linear(channels, channels));
        to_k = register_module("to_k", torch::nn::Linear(channels, channels));
        to_v = register_module("to_v", torch::nn::Linear(channels, channels));
        to_out = register_module("to_out", torch::nn::ModuleList());
        to_out->push_back(torch::nn::Linear(channels, channels));
        to_out->push_back(torch::nn::Dropout(0.0));
    }
    torch::Tensor forward(const torch::Tensor& x) {
        const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
        torch::Tensor h = group_norm->forward(x.view({B, C, H * W})).transpose(1, 2);  // (B, HW, C)
        torch::Tensor q = flops::linear(h, to_q->weight, to_q->bias);
        torch::Tensor k = flops::linear(h, to_k->weight, to_k->bias);
        torch::Tensor v = flops::linear(h, to_v->weight, to_v->bias);
        const double scale = 1.0 / std::sqrt(static_cast<double>(C));
        torch::Tensor a = (flops::matmul(q, k.transpose(1, 2)) * scale).softmax(-1);
        torch::Tensor o = flops::matmul(a, v);
        auto out_linear = to_out[0]->as<torch::nn::Linear>();
        o = flops::linear(o, out_linear->weight, out_linear->bias);
        return o.transpose(1, 2).reshape({B, C, H, W}) + x;
    }
    torch::nn::GroupNorm group_norm{nullptr};
    torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
    torch::nn::ModuleList to_out{nullptr};
};

class MidBlock : public torch::nn::Module {
public:
    MidBlock(int64_t channels, int64_t groups) {
        resnets = register_module("resnets", torch::nn::ModuleList());
        attentions = register_module("attentions", torch::nn::ModuleList());
        r0 = std::make_shared<ResnetBlock>(channels, channels, groups);
        r1 = std::make_shared<ResnetBlock>(channels, channels, groups);
        attn = std::make_shared<MidAttention>(channels, groups);
        resnets->push_back(r0);
        resnets->push_back(r1);
        attentions->push_back(attn);
    }
    torch::Tensor forward(const torch::Tensor& x) { return r1->forward(attn->forward(r0->forward(x))); }
    torch::nn::ModuleList resnets{nullptr}, attentions{nullptr};
    std::shared_ptr<ResnetBlock> r0, r1;
    std::shared_ptr<MidAttention> attn;
};

// Upsample2D: nearest x2, then a 3x3 conv.
class Upsampler : public torch::nn::Module {
public:
    explicit Upsampler(int64_t channels) { conv = register_module("conv", models::conv(channels, channels, 3)); }
    torch::Tensor forward(const torch::Tensor& x) {
        torch::Tensor up = torch::nn::functional::interpolate(
            x, torch::nn::functional::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0}).mode(
                   torch::kNearest));
        return run_conv(conv, up);
    }
    torch::nn::Conv2d conv{nullptr};
};

// Downsample2D with padding 0: zero padding of one column right and one row below, then a 3x3 stride-2 conv.
class Downsampler : public torch::nn::Module {
public:
    explicit Downsampler(int64_t channels) { conv = register_module("conv", models::conv(channels, channels, 3, 2)); }
    torch::Tensor forward(const torch::Tensor& x) {
        return flops::conv2d(torch::constant_pad_nd(x, {0, 1, 0, 1}, 0.0), conv->weight, conv->bias, {2, 2}, {0, 0},
                             {1, 1}, 1);
    }
    torch::nn::Conv2d conv{nullptr};
};

// UpDecoderBlock2D (resamplers "upsamplers") and DownEncoderBlock2D ("downsamplers"): resnets, then the
// optional resampler.
template <class Resampler>
class ResnetStack : public torch::nn::Module {
public:
    ResnetStack(int64_t in, int64_t out, int64_t layers, int64_t groups, bool resample, const char* resampler_name) {
        resnets = register_module("resnets", torch::nn::ModuleList());
        for (int64_t i = 0; i < layers; ++i) {
            auto r = std::make_shared<ResnetBlock>(i == 0 ? in : out, out, groups);
            resnets->push_back(r);
            blocks.push_back(r);
        }
        if (resample) {
            resamplers = register_module(resampler_name, torch::nn::ModuleList());
            resampler = std::make_shared<Resampler>(out);
            resamplers->push_back(resampler);
        }
    }
    torch::Tensor forward(torch::Tensor x) {
        for (const auto& r : blocks) x = r->forward(x);
        return resampler ? resampler->forward(x) : x;
    }
    torch::nn::ModuleList resnets{nullptr}, resamplers{nullptr};
    std::vector<std::shared_ptr<ResnetBlock>> blocks;
    std::shared_ptr<Resampler> resampler;
};

class Decoder : public torch::nn::Module {
public:
    explicit Decoder(const VaeConfig& c) {
        const auto& ch = c.block_out_channels;
        const int64_t n = static_cast<int64_t>(ch.size());
        const int64_t top = ch.back(), g = c.norm_num_groups;
        conv_in = register_module("conv_in", conv(c.latent_channels, top, 3));
        up_blocks = register_module("up_blocks", torch::nn::ModuleList());
        int64_t prev = top;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t out = ch[n - 1 - i];
            auto b = std::make_shared<ResnetStack<Upsampler>>(prev, out, c.layers_per_block + 1, g, i != n - 1, "upsamplers");
            up_blocks->push_back(b);
            ups.push_back(b);
            prev = out;
        }
        mid_block = register_module("mid_block", std::make_shared<MidBlock>(top, g));
        conv_norm_out = register_module("conv_norm_out", group_norm(g, ch.front()));
        conv_out = register_module("conv_out", conv(ch.front(), c.out_channels, 3));
    }
    torch::Tensor forward(const torch::Tensor& z) {
        torch::Tensor x = run_conv(conv_in, z);
        x = mid_block->forward(x);
        for (const auto& b : ups) x = b->forward(x);
        return run_conv(conv_out, torch::silu(conv_norm_out->forward(x)));
    }
    torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
    torch::nn::ModuleList up_blocks{nullptr};
    std::vector<std::shared_ptr<ResnetStack<Upsampler>>> ups;
    std::shared_ptr<MidBlock> mid_block;
    torch::nn::GroupNorm conv_norm_out{nullptr};
};

// diffusers Encoder with double_z: conv_out writes 2 * latent_channels (mean and logvar, before quant_conv).
class Encoder : public torch::nn::Module {
public:
    explicit Encoder(const VaeConfig& c) {
        const auto& ch = c.block_out_channels;
        const int64_t n = static_cast<int64_t>(ch.size());
        const int64_t top = ch.back(), g = c.norm_num_groups;
        conv_in = register_module("conv_in", conv(c.in_channels, ch.front(), 3));
        down_blocks = register_module("down_blocks", torch::nn::ModuleList());
        int64_t prev = ch.front();
        for (int64_t i = 0; i < n; ++i) {
            auto b = std::make_shared<ResnetStack<Downsampler>>(prev, ch[i], c.layers_per_block, g, i != n - 1, "downsamplers");
            down_blocks->push_back(b);
            downs.push_back(b);
            prev = ch[i];
        }
        mid_block = register_module("mid_block", std::make_shared<MidBlock>(top, g));
        conv_norm_out = register_module("conv_norm_out", group_norm(g, top));
        conv_out = register_module("conv_out", conv(top, 2 * c.latent_channels, 3));
    }
    torch::Tensor forward(const torch::Tensor& image) {
        torch::Tensor x = run_conv(conv_in, image);
        for (const auto& b : downs) x = b->forward(x);
        x = mid_block->forward(x);
        return run_conv(conv_out, torch::silu(conv_norm_out->forward(x)));
    }
    torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
    torch::nn::ModuleList down_blocks{nullptr};
    std::vector<std::shared_ptr<ResnetStack<Downsampler>>> downs;
    std::shared_ptr<MidBlock> mid_block;
    torch::nn::GroupNorm conv_norm_out{nullptr};
};

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
    return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

void check_vae_config(const std::string& model, const VaeConfig& c) {
    LINVIS_CHECK(!c.block_out_channels.empty(), model, ": option block_out_channels is empty");
    LINVIS_CHECK(c.norm_num_groups >= 1, model, ": option norm_num_groups must be >= 1, got ", c.norm_num_groups);
    for (const int64_t ch : c.block_out_channels)
        LINVIS_CHECK(ch > 0 && ch % c.norm_num_groups == 0, model, ": option block_out_channels: ", ch,
                     " is not a multiple of norm_num_groups ", c.norm_num_groups);
    LINVIS_CHECK(c.layers_per_block >= 0 && c.latent_channels >= 1 && c.in_channels >= 1 && c.out_channels >= 1, model,
                 ": layers_per_block, latent_channels, in_channels and out_channels must be positive");
}

// One key mapping for both halves. `part` is "encoder" or "decoder", `own_conv` its 1x1 conv
// ("quant_conv" / "post_quant_conv"); keys of the other half, of the other conv and of a loss are dropped.
std::string map_vae_key(const std::string& raw, const std::string& part, const std::string& own_conv, int64_t n_blocks) {
    std::string key = raw;
    if (starts_with(key, "first_stage_model.")) key = key.substr(18);
    if (starts_with(key, "vae.")) key = key.substr(4);
    if (!starts_with(key, part + ".") && !starts_with(key, own_conv + ".")) return "";
    static const std::regex ldm_up(R"(^decoder\.up\.(\d+)\.(block|upsample)\.(.*)$)");
    static const std::regex ldm_down(R"(^encoder\.down\.(\d+)\.(block|downsample)\.(.*)$)");
    std::smatch m;
    if (std::regex_match(key, m, ldm_up)) {  // the LDM up index is reversed
        const int64_t i = n_blocks - 1 - std::stoll(m[1].str());
        key = m[2].str() == "block" ? str_cat("decoder.up_blocks.", i, ".resnets.", m[3].str())
                                    : str_cat("decoder.up_blocks.", i, ".upsamplers.0.", m[3].str());
    } else if (std::regex_match(key, m, ldm_down)) {
        const std::string i = m[1].str();
        key = m[2].str() == "block" ? str_cat("encoder.down_blocks.", i, ".resnets.", m[3].str())
                                    : str_cat("encoder.down_blocks.", i, ".downsamplers.0.", m[3].str());
    }
    auto replace_prefix = [&](const std::string& from, const std::string& to) {
        if (starts_with(key, part + from)) key = part + to + key.substr(part.size() + from.size());
    };
    const std::string attn = ".mid_block.attentions.0.";
    replace_prefix(".mid.block_1.", ".mid_block.resnets.0.");
    replace_prefix(".mid.block_2.", ".mid_block.resnets.1.");
    replace_prefix(".mid.attn_1.norm.", attn + "group_norm.");
    replace_prefix(".mid.attn_1.q.", attn + "to_q.");
    replace_prefix(".mid.attn_1.k.", attn + "to_k.");
    replace_prefix(".mid.attn_1.v.", attn + "to_v.");
    replace_prefix(".mid.attn_1.proj_out.", attn + "to_out.0.");
    replace_prefix(".norm_out.", ".conv_norm_out.");
    // old diffusers attention names
    replace_prefix(attn + "query.", attn + "to_q.");
    replace_prefix(attn + "key.", attn + "to_k.");
    replace_prefix(attn + "value.", attn + "to_v.");
    replace_prefix(attn + "proj_attn.", attn + "to_out.0.");
    const size_t pos = key.find(".nin_shortcut.");
    if (pos != std::string::npos) key = key.substr(0, pos) + ".conv_shortcut." + key.substr(pos + 14);
    return key;
}

// LDM / old files store the attention projections as 1x1 convs (C, C, 1, 1) or (C, C, 1).
torch::Tensor adapt_vae_tensor(const std::string& key, const torch::Tensor& value) {
    if (key.find(".mid_block.attentions.0.to_") != std::string::npos && value.dim() > 2 && ends_with(key, ".weight"))
        return value.reshape({value.size(0), value.size(1)});
    return value;
}

class SdVaeDecoder : public VaeDecoder {
public:
    explicit SdVaeDecoder(const VaeConfig& c) : config_(c) {
        check_vae_config("sd_vae_decoder", c);
        post_quant_conv = register_module("post_quant_conv", conv(c.latent_channels, c.latent_channels, 1));
        decoder = register_module("decoder", std::make_shared<Decoder>(c));
    }
    const VaeConfig& config() const override { return config_; }

    torch::Tensor decode(const torch::Tensor& z) override {
        LINVIS_CHECK(z.defined() && z.dim() == 4 && z.size(1) == config_.latent_channels, "sd_vae_decoder: latent: expected (B, ",
                     config_.latent_channels, ", h, w), got ", shape_or_undefined(z));
        return decoder->forward(run_conv(post_quant_conv, z));
    }
    std::string map_checkpoint_key(const std::string& raw) const override {
        return map_vae_key(raw, "decoder", "post_quant_conv", static_cast<int64_t>(config_.block_out_channels.size()));
    }
    torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const override {
        return adapt_vae_tensor(key, value);
    }

    torch::nn::Conv2d post_quant_conv{nullptr};
    std::shared_ptr<Decoder> decoder;

private:
    VaeConfig config_;
};

class SdVaeEncoder : public VaeEncoder {
public:
    explicit SdVaeEncoder(const VaeConfig& c) : config_(c) {
        check_vae_config("sd_vae_encoder", c);
        encoder = register_module("encoder", std::make_shared<Encoder>(c));
        quant_conv = register_module("quant_conv", conv(2 * c.latent_channels, 2 * c.latent_channels, 1));
    }
    const VaeConfig& config() const override { return config_; }

    LatentDistribution encode(const torch::Tensor& image) override {
        LINVIS_CHECK(image.defined() && image.dim() == 4 && image.size(1) == config_.in_channels,
                     "sd_vae_encoder: image: expected (B, ", config_.in_channels, ", H, W), got ",
                     shape_or_undefined(image));
        const torch::Tensor moments = run_conv(quant_conv, encoder->forward(image));
        const auto halves = moments.chunk(2, 1);
        return LatentDistribution{halves[0], halves[1].clamp(-30.0, 20.0)};
    }
    std::string map_checkpoint_key(const std::string& raw) const override {
        return map_vae_key(raw, "encoder", "quant_conv", static_cast<int64_t>(config_.block_out_channels.size()));
    }
    torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const override {
        return adapt_vae_tensor(key, value);
    }

    std::shared_ptr<Encoder> encoder;
    torch::nn::Conv2d quant_conv{nullptr};

private:
    VaeConfig config_;
};

const GenerativeModelRegistrar sd_vae_decoder(
    "sd_vae_decoder", "vae", "vae",
    "Stable Diffusion VAE decoder (diffusers AutoencoderKL, sd-vae-ft-mse/ema; latent scale 0.18215): 8x upsampling",
    [](const ModelConfig& cfg) -> std::shared_ptr<Model> { return make_vae_decoder(read_vae_config("sd_vae_decoder", cfg)); });

const GenerativeModelRegistrar sd_vae_encoder(
    "sd_vae_encoder", "vae", "vae",
    "Stable Diffusion VAE encoder (diffusers AutoencoderKL + quant_conv, sd-vae-ft-mse/ema): image -> latent mean, logvar",
    [](const ModelConfig& cfg) -> std::shared_ptr<Model> { return make_vae_encoder(read_vae_config("sd_vae_encoder", cfg)); });

}  // namespace

VaeConfig read_vae_config(const std::string& model, const ModelConfig& cfg) {
    VaeConfig c;
    c.block_out_channels = cfg.get_int_list("block_out_channels", c.block_out_channels);
    c.layers_per_block = cfg.get_int("layers_per_block", c.layers_per_block);
    c.latent_channels = cfg.get_int("latent_channels", c.latent_channels);
    c.in_channels = cfg.get_int("in_channels", c.in_channels);
    c.out_channels = cfg.get_int("out_channels", c.out_channels);
    c.norm_num_groups = cfg.get_int("norm_num_groups", c.norm_num_groups);
    check_vae_config(model, c);  // the constructors check again (make_vae_* takes a config directly)
    return c;
}

torch::Tensor LatentDistribution::sample(const torch::Tensor& eps) const {
    LINVIS_CHECK(eps.sizes() == mean.sizes(), "LatentDistribution::sample: eps: expected ", shape_string(mean.sizes()),
                 ", got ", shape_string(eps.sizes()));
    return mean + std() * eps;
}

VaeDecoderPtr make_vae_decoder(const VaeConfig& config) { return std::make_shared<SdVaeDecoder>(config); }
VaeEncoderPtr make_vae_encoder(const VaeConfig& config) { return std::make_shared<SdVaeEncoder>(config); }

VaeDecoderPtr create_vae_decoder(const std::string& name, const ModelConfig& config) {
    const std::string kind = generative_model_kind(name);
    LINVIS_CHECK(kind.empty() || kind == "vae", "model '", name, "' is a ", kind, " model, not a VAE decoder");
    auto model = std::dynamic_pointer_cast<VaeDecoder>(create_generative_model(name, config));
    LINVIS_CHECK(model != nullptr, "model '", name, "' is not a VAE decoder");
    return model;
}

VaeEncoderPtr create_vae_encoder(const std::string& name, const ModelConfig& config) {
    const std::string kind = generative_model_kind(name);
    LINVIS_CHECK(kind.empty() || kind == "vae", "model '", name, "' is a ", kind, " model, not a VAE encoder");
    auto model = std::dynamic_pointer_cast<VaeEncoder>(create_generative_model(name, config));
    LINVIS_CHECK(model != nullptr, "model '", name, "' is not a VAE encoder");
    return model;
}

}  // namespace linvis::models
