// AutoencoderKL decoder (spec dit_generation.md §5; huggingface/diffusers 0.42 models/autoencoders/vae.py
// Decoder, unets/unet_2d_blocks.py UNetMidBlock2D / UpDecoderBlock2D, resnet.py ResnetBlock2D,
// upsampling.py Upsample2D, attention_processor.py Attention; legacy names as
// ModelMixin._fix_state_dict_keys_on_load and convert_ldm_vae_checkpoint map them).
#include "linvis/models/vae.h"

#include <cmath>
#include <regex>
#include <sstream>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"

namespace linvis::models {
namespace {

constexpr double kEps = 1e-6;

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).padding(k / 2).bias(true));
}
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

class UpBlock : public torch::nn::Module {
public:
    UpBlock(int64_t in, int64_t out, int64_t layers, int64_t groups, bool upsample) {
        resnets = register_module("resnets", torch::nn::ModuleList());
        for (int64_t i = 0; i < layers; ++i) {
            auto r = std::make_shared<ResnetBlock>(i == 0 ? in : out, out, groups);
            resnets->push_back(r);
            blocks.push_back(r);
        }
        if (upsample) {
            upsamplers = register_module("upsamplers", torch::nn::ModuleList());
            up = std::make_shared<Upsampler>(out);
            upsamplers->push_back(up);
        }
    }
    torch::Tensor forward(torch::Tensor x) {
        for (const auto& r : blocks) x = r->forward(x);
        return up ? up->forward(x) : x;
    }
    torch::nn::ModuleList resnets{nullptr}, upsamplers{nullptr};
    std::vector<std::shared_ptr<ResnetBlock>> blocks;
    std::shared_ptr<Upsampler> up;
};

class Decoder : public torch::nn::Module {
public:
    explicit Decoder(const VaeDecoderConfig& c) {
        const auto& ch = c.block_out_channels;
        const int64_t n = static_cast<int64_t>(ch.size());
        const int64_t top = ch.back(), g = c.norm_num_groups;
        conv_in = register_module("conv_in", conv(c.latent_channels, top, 3));
        up_blocks = register_module("up_blocks", torch::nn::ModuleList());
        int64_t prev = top;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t out = ch[n - 1 - i];
            auto b = std::make_shared<UpBlock>(prev, out, c.layers_per_block + 1, g, i != n - 1);
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
    std::vector<std::shared_ptr<UpBlock>> ups;
    std::shared_ptr<MidBlock> mid_block;
    torch::nn::GroupNorm conv_norm_out{nullptr};
};

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

class SdVaeDecoder : public VaeDecoder {
public:
    explicit SdVaeDecoder(const VaeDecoderConfig& c) : config_(c) {
        LINVIS_CHECK(!c.block_out_channels.empty(), "sd_vae_decoder: option block_out_channels is empty");
        for (const int64_t ch : c.block_out_channels)
            LINVIS_CHECK(ch > 0 && ch % c.norm_num_groups == 0, "sd_vae_decoder: option block_out_channels: ", ch,
                         " is not a multiple of norm_num_groups ", c.norm_num_groups);
        LINVIS_CHECK(c.layers_per_block >= 0 && c.latent_channels >= 1 && c.out_channels >= 1,
                     "sd_vae_decoder: layers_per_block, latent_channels and out_channels must be positive");
        post_quant_conv = register_module("post_quant_conv", conv(c.latent_channels, c.latent_channels, 1));
        decoder = register_module("decoder", std::make_shared<Decoder>(c));
    }
    const VaeDecoderConfig& config() const override { return config_; }

    torch::Tensor decode(const torch::Tensor& z) override {
        LINVIS_CHECK(z.defined() && z.dim() == 4 && z.size(1) == config_.latent_channels, "sd_vae_decoder: latent: expected (B, ",
                     config_.latent_channels, ", h, w), got ", z.defined() ? shape_string(z.sizes()) : std::string("undefined"));
        return decoder->forward(run_conv(post_quant_conv, z));
    }

    std::string map_checkpoint_key(const std::string& raw) const override {
        std::string key = raw;
        if (starts_with(key, "first_stage_model.")) key = key.substr(18);
        if (starts_with(key, "vae.")) key = key.substr(4);
        if (!starts_with(key, "decoder.") && !starts_with(key, "post_quant_conv.")) return "";  // encoder, quant_conv, loss
        const int64_t n = static_cast<int64_t>(config_.block_out_channels.size());
        static const std::regex ldm_up(R"(^decoder\.up\.(\d+)\.(block|upsample)\.(.*)$)");
        std::smatch m;
        if (std::regex_match(key, m, ldm_up)) {
            const int64_t i = n - 1 - std::stoll(m[1].str());
            key = m[2].str() == "block" ? str_cat("decoder.up_blocks.", i, ".resnets.", m[3].str())
                                        : str_cat("decoder.up_blocks.", i, ".upsamplers.0.", m[3].str());
        }
        auto replace_prefix = [&](const std::string& from, const std::string& to) {
            if (starts_with(key, from)) key = to + key.substr(from.size());
        };
        replace_prefix("decoder.mid.block_1.", "decoder.mid_block.resnets.0.");
        replace_prefix("decoder.mid.block_2.", "decoder.mid_block.resnets.1.");
        replace_prefix("decoder.mid.attn_1.norm.", "decoder.mid_block.attentions.0.group_norm.");
        replace_prefix("decoder.mid.attn_1.q.", "decoder.mid_block.attentions.0.to_q.");
        replace_prefix("decoder.mid.attn_1.k.", "decoder.mid_block.attentions.0.to_k.");
        replace_prefix("decoder.mid.attn_1.v.", "decoder.mid_block.attentions.0.to_v.");
        replace_prefix("decoder.mid.attn_1.proj_out.", "decoder.mid_block.attentions.0.to_out.0.");
        replace_prefix("decoder.norm_out.", "decoder.conv_norm_out.");
        // old diffusers attention names
        replace_prefix("decoder.mid_block.attentions.0.query.", "decoder.mid_block.attentions.0.to_q.");
        replace_prefix("decoder.mid_block.attentions.0.key.", "decoder.mid_block.attentions.0.to_k.");
        replace_prefix("decoder.mid_block.attentions.0.value.", "decoder.mid_block.attentions.0.to_v.");
        replace_prefix("decoder.mid_block.attentions.0.proj_attn.", "decoder.mid_block.attentions.0.to_out.0.");
        const size_t pos = key.find(".nin_shortcut.");
        if (pos != std::string::npos) key = key.substr(0, pos) + ".conv_shortcut." + key.substr(pos + 14);
        return key;
    }

    torch::Tensor adapt_checkpoint_tensor(const std::string& key, const torch::Tensor& value) const override {
        // LDM / old files store the attention projections as 1x1 convs (C, C, 1, 1) or (C, C, 1).
        if (starts_with(key, "decoder.mid_block.attentions.0.to_") && value.dim() > 2 &&
            key.size() > 7 && key.compare(key.size() - 7, 7, ".weight") == 0)
            return value.reshape({value.size(0), value.size(1)});
        return value;
    }

    torch::nn::Conv2d post_quant_conv{nullptr};
    std::shared_ptr<Decoder> decoder;

private:
    VaeDecoderConfig config_;
};

std::vector<int64_t> parse_int_list(const std::string& option, const std::string& text) {
    std::vector<int64_t> out;
    std::string item;
    std::stringstream in(text);
    while (std::getline(in, item, ',')) {
        try {
            size_t used = 0;
            out.push_back(std::stoll(item, &used));
            LINVIS_CHECK(used == item.size(), "");
        } catch (const std::exception&) {
            fail("sd_vae_decoder: option ", option, ": expected comma-separated integers, got '", text, "'");
        }
    }
    return out;
}

const GenerativeModelRegistrar sd_vae_decoder(
    "sd_vae_decoder", "vae", "vae",
    "Stable Diffusion VAE decoder (diffusers AutoencoderKL, sd-vae-ft-mse/ema; latent scale 0.18215): 8x upsampling",
    [](const ModelConfig& cfg) -> std::shared_ptr<Model> {
        VaeDecoderConfig c;
        c.block_out_channels = parse_int_list("block_out_channels", cfg.get_string("block_out_channels", "128,256,512,512"));
        c.layers_per_block = cfg.get_int("layers_per_block", c.layers_per_block);
        c.latent_channels = cfg.get_int("latent_channels", c.latent_channels);
        c.out_channels = cfg.get_int("out_channels", c.out_channels);
        c.norm_num_groups = cfg.get_int("norm_num_groups", c.norm_num_groups);
        return make_vae_decoder(c);
    });

}  // namespace

VaeDecoderPtr make_vae_decoder(const VaeDecoderConfig& config) { return std::make_shared<SdVaeDecoder>(config); }

VaeDecoderPtr create_vae_decoder(const std::string& name, const ModelConfig& config) {
    const std::string kind = generative_model_kind(name);
    LINVIS_CHECK(kind.empty() || kind == "vae", "model '", name, "' is a ", kind, " model, not a VAE decoder");
    auto model = std::dynamic_pointer_cast<VaeDecoder>(create_generative_model(name, config));
    LINVIS_CHECK(model != nullptr, "model '", name, "' is not a VAE decoder");
    return model;
}

}  // namespace linvis::models
