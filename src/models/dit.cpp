// DiT, DiT3 and DiT5 (spec dit_generation.md §1-2; facebookresearch/DiT@ed81ce2:models.py,
// LeapLabTHU/ViTTT@e347758:dittt/models.py, LeapLabTHU/Transformer-to-TTT@06493e4:DiT5/models.py).
// The mixers reuse the ops of ViT3 (nn::Vit3Ttt -> ops::vit3_ttt_mix) and T5/DiT5
// (ops::dit5_mixed_attention); the softmax mixer is ops::softmax_attention.
#include "linvis/models/dit.h"

#include <cctype>
#include <cmath>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/precision.h"
#include "linvis/models/registry.h"
#include "linvis/nn/common.h"
#include "linvis/nn/vit.h"
#include "linvis/nn/vit3_layers.h"
#include "linvis/ops/attention.h"
#include "linvis/ops/depthwise_conv.h"
#include "linvis/ops/neighborhood_attention.h"
#include "linvis/ops/t5_ttt.h"

namespace linvis::models {
namespace {

constexpr int64_t kNatKernel = 5;

constexpr double kNormEps = 1e-6;

// x + gate.unsqueeze(1) * branch, gate (B, C): one addcmul, into x itself where no graph records it (x is the
// block's own residual stream, which nothing else holds).
torch::Tensor add_gated(torch::Tensor x, const torch::Tensor& gate, const torch::Tensor& branch) {
    if (nn::can_overwrite({x, gate, branch})) return x.addcmul_(gate.unsqueeze(1), branch);
    return torch::addcmul(x, gate.unsqueeze(1), branch);
}

torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x) {
    return flops::linear(x, l->weight, l->bias);
}

torch::nn::Conv2d depthwise3x3(int64_t channels) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, channels, 3).padding(1).groups(channels).bias(true));
}

// Sequential(SiLU, Linear(in -> out)): key `<name>.1.*`.
torch::nn::Sequential silu_linear(int64_t in, int64_t out) {
    return torch::nn::Sequential(torch::nn::SiLU(), nn::uninitialised_linear(in, out));
}

torch::nn::Linear seq_linear(const torch::nn::Sequential& s, size_t index) {
    return torch::nn::Linear(std::dynamic_pointer_cast<torch::nn::LinearImpl>(s->ptr(index)));
}

// A silu_linear Sequential applied to x with its product on flops::linear, as every other product: through the
// Sequential, LibTorch's linear handed these few rows (one per sample) to OpenBLAS, whose own threads then woke
// and yielded beside the OpenMP pool (perf, dit3_s2 guided step at L = 64: 8 % of the samples in the kernel's
// scheduler and sched_yield, 1.4 % after; the step's speed moved within the machine's noise).
torch::Tensor silu_then_linear(const torch::nn::Sequential& s, const torch::Tensor& x) {
    return linear(seq_linear(s, 1), torch::silu(x));
}

// ---------------------------------------------------------------- mixers

class DitMixer : public torch::nn::Module {
public:
    // u: the block's modulated input (B, N, C) on a G x G grid (the mixer's first product takes it through
    // NormedInput::linear) -> (B, N, C).
    virtual torch::Tensor forward(const nn::NormedInput& u, int64_t grid) = 0;
};

// timm Attention(qkv_bias=True): rows of qkv [q | k | v], head i = channels i*d...
class SoftmaxMixer : public DitMixer {
public:
    SoftmaxMixer(int64_t dim, int64_t heads, ops::Impl impl) : heads_(heads), impl_(impl) {
        qkv = register_module("qkv", nn::uninitialised_linear(dim, 3 * dim));
        proj = register_module("proj", nn::uninitialised_linear(dim, dim));
    }
    torch::Tensor forward(const nn::NormedInput& u, int64_t) override {
        const int64_t B = u.input().size(0), N = u.input().size(1), C = u.input().size(2), d = C / heads_;
        // unbind: one stacking pass in the backward instead of three zeroed selects summed (as DeiT's attention).
        const std::vector<torch::Tensor> p =
            u.linear(qkv, nn::elementwise_impl(impl_)).reshape({B, N, 3, heads_, d}).permute({2, 0, 3, 1, 4}).unbind(0);
        torch::Tensor o = ops::softmax_attention(p[0], p[1], p[2], std::pow(static_cast<double>(d), -0.5), {}, impl_);
        return linear(proj, o.transpose(1, 2).reshape({B, N, C}));
    }
    torch::nn::Linear qkv{nullptr}, proj{nullptr};

private:
    int64_t heads_;
    ops::Impl impl_;
};

// DiTTT: the ViT3 TTT module, called as TTT.forward(u, G, G) without RoPE (s = 1/3 both branches).
class Dit3Mixer : public DitMixer {
public:
    Dit3Mixer(int64_t dim, int64_t heads, ops::Impl impl) {
        ttt = nn::Vit3Ttt(dim, heads, true, impl);
        // The TTT module's own names (w1, w2, w3, qkv, proj) directly under `attn`.
        for (auto& p : ttt->named_parameters(false)) register_parameter(p.key(), p.value());
        register_module("qkv", ttt->qkv);
        register_module("proj", ttt->proj);
    }
    torch::Tensor forward(const nn::NormedInput& u, int64_t grid) override { return ttt->forward(u, grid, grid); }
    nn::Vit3Ttt ttt{nullptr};
};

// DiT5 MixedAttention: out = proj(0.5 NA(q, k, v) + 0.5 TTT-MLP(q, k, v)).
class Dit5Mixer : public DitMixer {
public:
    Dit5Mixer(int64_t dim, int64_t heads, ops::Impl impl, std::optional<ops::NatSmallGrid> small_grid)
        : heads_(heads), impl_(impl), small_grid_(small_grid) {
        const int64_t d = dim / heads;
        w1 = register_parameter("w1", torch::empty({1, heads, d, d}));
        w2 = register_parameter("w2", torch::empty({1, heads, d, d}));
        nn::trunc_normal_(w1, 0.02);
        nn::trunc_normal_(w2, 0.02);
        qk_scale_ttt = register_parameter("qk_scale_ttt", torch::ones({1, 1, dim, 2}));
        qk_offset_ttt = register_parameter("qk_offset_ttt", torch::zeros({1, 1, dim, 2}));
        qkv = register_module("qkv", nn::uninitialised_linear(dim, 3 * dim));
        proj = register_module("proj", nn::uninitialised_linear(dim, dim));
        q_conv2d = register_module("q_conv2d", depthwise3x3(dim));
        k_conv2d = register_module("k_conv2d", depthwise3x3(dim));
    }
    torch::Tensor forward(const nn::NormedInput& u, int64_t grid) override {
        LINVIS_CHECK(grid >= kNatKernel || small_grid_, "dit5: the token grid ", grid, "x", grid,
                     " (input_size / patch_size) is smaller than the 5x5 neighbourhood-attention window, which NATTEN "
                     "rejects (model option nat_small_grid=whole: the window covers the whole axis instead)");
        std::vector<torch::Tensor> c = u.linear(qkv, nn::elementwise_impl(impl_)).chunk(3, -1);
        const ops::Dit5TttParams params{w1, w2, qk_scale_ttt, qk_offset_ttt, q_conv2d->weight, q_conv2d->bias,
                                        k_conv2d->weight, k_conv2d->bias};
        // q, k and v stay column chunks of the product: both branches' kernels read them through their row stride.
        const torch::Tensor &q = c[0], &k = c[1], &v = c[2];
        torch::Tensor mixed = ops::dit5_mixed_attention(q, k, v, params, heads_, grid, grid, kNatKernel,
                                                        small_grid_.value_or(ops::NatSmallGrid::WholeAxis), impl_);
        return linear(proj, mixed);
    }
    torch::Tensor w1, w2, qk_scale_ttt, qk_offset_ttt;
    torch::nn::Linear qkv{nullptr}, proj{nullptr};
    torch::nn::Conv2d q_conv2d{nullptr}, k_conv2d{nullptr};

private:
    int64_t heads_;
    ops::Impl impl_;
    std::optional<ops::NatSmallGrid> small_grid_;
};

// ---------------------------------------------------------------- skeleton

class GeluTanhMlp : public torch::nn::Module {
public:
    GeluTanhMlp(int64_t dim, int64_t hidden, ops::Impl impl) : impl_(impl) {
        fc1 = register_module("fc1", nn::uninitialised_linear(dim, hidden));
        fc2 = register_module("fc2", nn::uninitialised_linear(hidden, dim));
    }
    torch::Tensor forward(const nn::NormedInput& x) {
        return nn::gelu_mlp(x, fc1, fc2, ops::GeluForm::Tanh, nn::elementwise_impl(impl_));
    }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};

private:
    ops::Impl impl_;
};

class DitBlock : public torch::nn::Module {
public:
    DitBlock(const DitConfig& c) : dit3_(c.family == "dit3"), impl_(c.impl) {
        const int64_t C = c.hidden_size;
        if (dit3_) cpe = register_module("cpe", depthwise3x3(C));
        if (c.family == "dit")
            attn = register_module("attn", std::make_shared<SoftmaxMixer>(C, c.num_heads, c.impl));
        else if (c.family == "dit3")
            attn = register_module("attn", std::make_shared<Dit3Mixer>(C, c.num_heads, c.impl));
        else
            attn = register_module("attn", std::make_shared<Dit5Mixer>(C, c.num_heads, c.impl, c.nat_small_grid));
        mlp = register_module("mlp", std::make_shared<GeluTanhMlp>(C, static_cast<int64_t>(C * c.mlp_ratio), c.impl));
        adaLN_modulation = register_module("adaLN_modulation", silu_linear(C, 6 * C));
    }
    torch::Tensor forward(torch::Tensor x, const torch::Tensor& cond, int64_t grid) {
        if (dit3_) x = ops::depthwise_conv2d_tokens(x, grid, grid, cpe->weight, cpe->bias, ops::DwEpilogue::Residual, impl_);
        std::vector<torch::Tensor> m = silu_then_linear(adaLN_modulation, cond).chunk(6, 1);
        torch::Tensor branch = attn->forward(nn::NormedInput::modulated(x, m[0], m[1], kNormEps), grid);
        x = add_gated(std::move(x), m[2], branch);
        branch = mlp->forward(nn::NormedInput::modulated(x, m[3], m[4], kNormEps));
        return add_gated(std::move(x), m[5], branch);
    }
    torch::nn::Conv2d cpe{nullptr};
    std::shared_ptr<DitMixer> attn;
    std::shared_ptr<GeluTanhMlp> mlp;
    torch::nn::Sequential adaLN_modulation{nullptr};

private:
    bool dit3_;
    ops::Impl impl_;
};

class TimestepEmbedder : public torch::nn::Module {
public:
    explicit TimestepEmbedder(int64_t C) {
        mlp = register_module("mlp", torch::nn::Sequential(nn::uninitialised_linear(256, C), torch::nn::SiLU(),
                                                           nn::uninitialised_linear(C, C)));
    }
    torch::Tensor forward(const torch::Tensor& t) {
        // The sinusoids are computed in float32 (as the official code does) and given to the MLP in its dtype.
        const torch::nn::Linear first = seq_linear(mlp, 0);
        const torch::Tensor t_freq = dit_timestep_embedding(t, 256).to(first->weight.scalar_type());
        return linear(seq_linear(mlp, 2), torch::silu(linear(first, t_freq)));
    }
    torch::nn::Sequential mlp{nullptr};
};

class LabelEmbedder : public torch::nn::Module {
public:
    LabelEmbedder(int64_t num_classes, int64_t C, double dropout) : num_classes_(num_classes), dropout_(dropout) {
        embedding_table = register_module("embedding_table",
                                          torch::nn::Embedding(num_classes + (dropout > 0 ? 1 : 0), C));
    }
    torch::Tensor forward(torch::Tensor y) {
        if (is_training() && dropout_ > 0) {
            torch::Tensor drop = torch::rand({y.size(0)}, torch::TensorOptions().device(y.device())) < dropout_;
            y = torch::where(drop, torch::full_like(y, num_classes_), y);
        }
        return embedding_table->forward(y);
    }
    torch::nn::Embedding embedding_table{nullptr};

private:
    int64_t num_classes_;
    double dropout_;
};

class FinalLayer : public torch::nn::Module {
public:
    FinalLayer(int64_t C, int64_t patch, int64_t out_channels, ops::Impl impl) : impl_(impl) {
        linear = register_module("linear", nn::uninitialised_linear(C, patch * patch * out_channels));
        adaLN_modulation = register_module("adaLN_modulation", silu_linear(C, 2 * C));
    }
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cond) {
        std::vector<torch::Tensor> m = silu_then_linear(adaLN_modulation, cond).chunk(2, 1);
        return nn::NormedInput::modulated(x, m[0], m[1], kNormEps).linear(linear, nn::elementwise_impl(impl_));
    }
    torch::nn::Linear linear{nullptr};
    torch::nn::Sequential adaLN_modulation{nullptr};

private:
    ops::Impl impl_;
};

class DitModel : public DiffusionModel {
public:
    explicit DitModel(const DitConfig& c) : config_(c) {
        const std::string& f = c.family;
        LINVIS_CHECK(f == "dit" || f == "dit3" || f == "dit5", "DiT: unknown family '", f, "' (dit, dit3, dit5)");
        LINVIS_CHECK(c.patch_size >= 1 && c.input_size >= c.patch_size && c.input_size % c.patch_size == 0, f,
                     ": option input_size: the latent side ", c.input_size, " is not divisible by the patch size ",
                     c.patch_size);
        LINVIS_CHECK(c.num_heads >= 1 && c.hidden_size % c.num_heads == 0, f, ": option hidden_size ", c.hidden_size,
                     " is not divisible by num_heads ", c.num_heads);
        LINVIS_CHECK(c.hidden_size % 4 == 0, f, ": option hidden_size must be a multiple of 4 (sin-cos pos_embed), got ",
                     c.hidden_size);
        LINVIS_CHECK(c.depth >= 1 && c.in_channels >= 1 && c.num_classes >= 1, f,
                     ": depth, in_channels and num_classes must be >= 1");
        grid_ = c.input_size / c.patch_size;
        const int64_t C = c.hidden_size;
        x_embedder = register_module("x_embedder", nn::PatchEmbed(c.in_channels, C, c.patch_size));
        t_embedder = register_module("t_embedder", std::make_shared<TimestepEmbedder>(C));
        y_embedder = register_module("y_embedder", std::make_shared<LabelEmbedder>(c.num_classes, C, c.class_dropout_prob));
        pos_embed = register_parameter("pos_embed", torch::zeros({1, grid_ * grid_, C}), /*requires_grad=*/false);
        blocks = register_module("blocks", torch::nn::ModuleList());
        for (int64_t i = 0; i < c.depth; ++i) {
            auto b = std::make_shared<DitBlock>(c);
            blocks->push_back(b);
            block_ptrs_.push_back(b);
        }
        final_layer = register_module("final_layer",
                                      std::make_shared<FinalLayer>(C, c.patch_size, out_channels(), c.impl));
        initialize_weights();
    }

    const DitConfig& config() const override { return config_; }

    void initialize_weights() override {
        torch::NoGradGuard g;
        // 1. every Linear: xavier_uniform, bias 0.
        for (auto& m : modules(/*include_self=*/false))
            if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(m.get())) {
                torch::nn::init::xavier_uniform_(l->weight);
                if (l->bias.defined()) l->bias.zero_();
            }
        // 2. pos_embed
        pos_embed.copy_(dit_pos_embed(config_.hidden_size, grid_).unsqueeze(0));
        // 3. patch embed as a Linear on its (C, in*p*p) view
        torch::nn::init::xavier_uniform_(x_embedder->proj->weight.view({x_embedder->proj->weight.size(0), -1}));
        x_embedder->proj->bias.zero_();
        // 4.-5.
        torch::nn::init::normal_(y_embedder->embedding_table->weight, 0.0, 0.02);
        torch::nn::init::normal_(seq_linear(t_embedder->mlp, 0)->weight, 0.0, 0.02);
        torch::nn::init::normal_(seq_linear(t_embedder->mlp, 2)->weight, 0.0, 0.02);
        // 6. zero the adaLN modulations and the output layer
        for (const auto& b : block_ptrs_) {
            seq_linear(b->adaLN_modulation, 1)->weight.zero_();
            seq_linear(b->adaLN_modulation, 1)->bias.zero_();
        }
        seq_linear(final_layer->adaLN_modulation, 1)->weight.zero_();
        seq_linear(final_layer->adaLN_modulation, 1)->bias.zero_();
        final_layer->linear->weight.zero_();
        final_layer->linear->bias.zero_();
    }

    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y) override {
        check_inputs(x, t, y);
        const int64_t B = x.size(0), p = config_.patch_size, oc = out_channels();
        // The conv's map as tokens is a transposed view, and a sum's output takes its first operand's layout: from
        // that view the whole residual stream would stay transposed, and every LayerNorm and product copy it (3 of
        // the 94 ms of dit_s2's guided step at L = 32, AVX-512 Xeon), as it does in the official code.
        torch::Tensor h = nn::map_to_tokens(x_embedder->forward(x)).contiguous() + pos_embed;
        torch::Tensor cond = t_embedder->forward(t) + y_embedder->forward(y);
        for (const auto& b : block_ptrs_) h = b->forward(h, cond, grid_);
        h = final_layer->forward(h, cond);  // (B, N, p*p*oc)
        // unpatchify: channel fastest, (B, G, G, p, p, oc) -> (B, oc, G*p, G*p)
        return h.reshape({B, grid_, grid_, p, p, oc})
            .permute({0, 5, 1, 3, 2, 4})
            .reshape({B, oc, grid_ * p, grid_ * p});
    }

    nn::PatchEmbed x_embedder{nullptr};
    std::shared_ptr<TimestepEmbedder> t_embedder;
    std::shared_ptr<LabelEmbedder> y_embedder;
    torch::Tensor pos_embed;
    torch::nn::ModuleList blocks{nullptr};
    std::shared_ptr<FinalLayer> final_layer;

private:
    DitConfig config_;
    int64_t grid_ = 0;
    std::vector<std::shared_ptr<DitBlock>> block_ptrs_;
};

struct DitSize {
    const char* name;
    int64_t depth, hidden, heads;
};
constexpr DitSize kSizes[] = {{"s", 12, 384, 6}, {"b", 12, 768, 12}, {"l", 24, 1024, 16}, {"xl", 28, 1152, 16}};

// Model option nat_small_grid: false/no/0 (NATTEN's rejection), true/yes/1/whole, wrap.
std::optional<ops::NatSmallGrid> parse_nat_small_grid(const std::string& value) {
    if (value == "false" || value == "no" || value == "0") return std::nullopt;
    if (value == "true" || value == "yes" || value == "1" || value == "whole") return ops::NatSmallGrid::WholeAxis;
    if (value == "wrap") return ops::NatSmallGrid::FlatWrap;
    LINVIS_CHECK(false, "model option nat_small_grid: expected false, whole or wrap, got '", value, "'");
    return std::nullopt;
}

DiffusionModelPtr make_registered(const ModelConfig& cfg, const std::string& family, const DitSize& size,
                                  int64_t patch) {
    DitConfig c;
    c.family = family;
    c.patch_size = cfg.get_int("patch_size", patch);
    c.depth = cfg.get_int("depth", size.depth);
    c.hidden_size = cfg.get_int("hidden_size", size.hidden);
    c.num_heads = cfg.get_int("num_heads", size.heads);
    c.input_size = cfg.get_int("input_size", 32);
    c.in_channels = cfg.get_int("in_channels", 4);
    c.num_classes = cfg.get_int("num_classes", 1000);
    c.learn_sigma = cfg.get_bool("learn_sigma", true);
    c.class_dropout_prob = cfg.get_double("class_dropout_prob", 0.1);
    c.mlp_ratio = cfg.get_double("mlp_ratio", 4.0);
    c.impl = ops::parse_impl(cfg.get_string("impl", "auto"));
    if (family == "dit5") c.nat_small_grid = parse_nat_small_grid(cfg.get_string("nat_small_grid", "false"));
    return make_dit(c);
}

const char* family_title(const std::string& f) {
    return f == "dit" ? "DiT (softmax, Peebles & Xie 2023)"
                      : f == "dit3" ? "DiT3 (DiTTT: ViT3's TTT mixer + cpe)" : "DiT5 (0.5 NA + 0.5 TTT-MLP, T5 paper)";
}

struct Registrations {
    std::vector<std::unique_ptr<GenerativeModelRegistrar>> all;
    Registrations() {
        for (const std::string family : {"dit", "dit3", "dit5"})
            for (const DitSize& s : kSizes)
                for (const int64_t p : {2, 4, 8}) {
                    const std::string name = family + "_" + s.name + std::to_string(p);
                    const std::string desc = str_cat(family_title(family), " ", s.name, "/", p, ": depth ", s.depth,
                                                     ", width ", s.hidden, ", ", s.heads, " heads; latent 32x32x4");
                    all.push_back(std::make_unique<GenerativeModelRegistrar>(
                        name, family, "diffusion", desc, [family, s, p](const ModelConfig& c) -> std::shared_ptr<Model> {
                            return make_registered(c, family, s, p);
                        }));
                }
    }
};
const Registrations registrations;

}  // namespace

torch::Tensor DiffusionModel::forward_with_cfg(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y,
                                               double cfg_scale) {
    LINVIS_CHECK(x.dim() >= 1 && x.size(0) % 2 == 0, "forward_with_cfg: the batch must be even (conditional half, "
                                                     "then the null-label half), got ", x.size(0));
    const int64_t n = x.size(0) / 2;
    torch::Tensor half = x.narrow(0, 0, n);
    torch::Tensor out = forward(torch::cat({half, half}, 0), t, y);
    // The official slice out[:, :3]: channels 0..2 whatever the model's channel count (a 1-channel pixel model
    // with learned sigma has [eps | v] there, and both are guided, as the official code would).
    const int64_t guided = std::min<int64_t>(3, out.size(1));
    torch::Tensor eps = out.narrow(1, 0, guided), rest = out.narrow(1, guided, out.size(1) - guided);
    torch::Tensor cond = eps.narrow(0, 0, n), uncond = eps.narrow(0, n, n);
    torch::Tensor g = uncond + cfg_scale * (cond - uncond);
    return torch::cat({torch::cat({g, g}, 0), rest}, 1);
}

torch::Tensor sample_class_conditional(DiffusionModel& model, const torch::Tensor& noise,
                                       const std::vector<int64_t>& labels, const SamplerConfig& config,
                                       const GaussianDiffusion::Progress& progress) {
    const int64_t n = static_cast<int64_t>(labels.size()), C = model.in_channels(), L = model.input_size(),
                  K = model.num_classes();
    LINVIS_CHECK(config.sampler == "ddpm" || config.sampler == "ddim", "sampler: expected ddpm or ddim, got '",
                 config.sampler, "'");
    LINVIS_CHECK(n >= 1, "sampling: no labels");
    for (const int64_t l : labels)
        LINVIS_CHECK(l >= 0 && l < K, "sampling: label ", l, " out of range [0, ", K - 1, "]");
    LINVIS_CHECK(noise.defined() && noise.dim() == 4 && noise.size(0) == n && noise.size(1) == C && noise.size(2) == L &&
                     noise.size(3) == L,
                 "sampling: expected noise of shape (", n, ", ", C, ", ", L, ", ", L, "), got ",
                 noise.defined() ? noise.sizes() : c10::IntArrayRef{});
    const bool guided = config.cfg_scale != 1.0;
    LINVIS_CHECK(!guided || model.has_null_label(), "cfg_scale ", config.cfg_scale,
                 ": the model has no null-label row (class_dropout_prob 0); use cfg_scale 1");
    torch::Tensor z = noise.to(torch::kFloat32);
    torch::Tensor y = torch::tensor(labels, torch::kInt64);
    if (guided) {
        z = torch::cat({z, z}, 0);
        y = torch::cat({y, torch::full({n}, K, torch::kInt64)}, 0);
    }
    const GaussianDiffusion diffusion(config.respacing_spec(), model.config().learn_sigma);
    // The sampler's arithmetic in float32, the network in its parameters' dtype (bf16 sampling).
    const torch::ScalarType network_dtype = model.parameters().front().scalar_type();
    const DenoiseFn fn = [&](const torch::Tensor& x_f32, const torch::Tensor& t) {
        const torch::Tensor x = x_f32.to(network_dtype);
        const torch::Tensor out = guided ? model.forward_with_cfg(x, t, y, config.cfg_scale) : model.forward(x, t, y);
        return out.to(torch::kFloat32);
    };
    torch::NoGradGuard no_grad;
    torch::Tensor samples = config.sampler == "ddim" ? diffusion.ddim_sample_loop(fn, z, config.eta, false, progress)
                                                     : diffusion.p_sample_loop(fn, z, false, progress);
    if (guided) samples = samples.narrow(0, 0, n);
    return samples.contiguous();
}

void DiffusionModel::check_inputs(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y) const {
    const DitConfig& c = config();
    LINVIS_CHECK(x.defined() && x.dim() == 4 && x.size(1) == c.in_channels && x.size(2) == c.input_size &&
                     x.size(3) == c.input_size,
                 c.family, ": x: expected (B, ", c.in_channels, ", ", c.input_size, ", ", c.input_size, "), got ",
                 shape_or_undefined(x));
    LINVIS_CHECK(x.is_floating_point(), c.family, ": x must be a floating-point tensor");
    const int64_t B = x.size(0);
    LINVIS_CHECK(t.defined() && t.dim() == 1 && t.size(0) == B && !t.is_floating_point(), c.family,
                 ": t: expected (", B, ",) integer timesteps, got ",
                 t.defined() ? str_cat(shape_string(t.sizes()), " ", t.dtype()) : std::string("undefined"));
    LINVIS_CHECK(y.defined() && y.dim() == 1 && y.size(0) == B && !y.is_floating_point(), c.family,
                 ": y: expected (", B, ",) integer labels, got ",
                 y.defined() ? str_cat(shape_string(y.sizes()), " ", y.dtype()) : std::string("undefined"));
    if (B > 0) {
        const int64_t max_label = has_null_label() ? c.num_classes : c.num_classes - 1;
        const int64_t lo = y.min().item<int64_t>(), hi = y.max().item<int64_t>();
        LINVIS_CHECK(lo >= 0 && hi <= max_label, c.family, ": label ", lo < 0 ? lo : hi, " out of range [0, ",
                     max_label, "] (", c.num_classes, " classes",
                     has_null_label() ? str_cat(", ", c.num_classes, " = the null label") : std::string(), ")");
        const int64_t tlo = t.min().item<int64_t>();
        LINVIS_CHECK(tlo >= 0, c.family, ": timestep ", tlo, " is negative");
    }
}

DiffusionModelPtr make_dit(const DitConfig& config) { return std::make_shared<DitModel>(config); }

DiffusionModelPtr create_diffusion_model(const std::string& name, const ModelConfig& config) {
    const std::string kind = generative_model_kind(name);
    LINVIS_CHECK(kind.empty() || kind == "diffusion", "model '", name, "' is a ", kind, " model, not a diffusion model");
    auto model = std::dynamic_pointer_cast<DiffusionModel>(create_generative_model(name, config));
    LINVIS_CHECK(model != nullptr, "model '", name, "' is not a diffusion model");
    return model;
}

int64_t count_diffusion_model_parameters(const std::string& name) {
    auto one = create_diffusion_model(name, ModelConfig().set("depth", std::string("1")));
    const int64_t c1 = count_parameters(*one);
    const int64_t c2 = count_parameters(*create_diffusion_model(name, ModelConfig().set("depth", std::string("2"))));
    int64_t depth = 0;
    for (const DitSize& s : kSizes)
        if (name.size() > 1 && name.substr(name.find('_') + 1, std::string(s.name).size()) == s.name &&
            std::isdigit(static_cast<unsigned char>(name[name.find('_') + 1 + std::string(s.name).size()])))
            depth = s.depth;
    LINVIS_CHECK(depth > 0, "count_diffusion_model_parameters: '", name, "' is not a registered DiT size");
    return c1 + (depth - 1) * (c2 - c1);
}

torch::Tensor dit_pos_embed(int64_t hidden_size, int64_t grid_size) {
    const int64_t half = hidden_size / 2, quarter = half / 2;
    auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
    torch::Tensor omega = 1.0 / torch::pow(10000.0, torch::arange(quarter, f64) / static_cast<double>(quarter));
    torch::Tensor pos = torch::arange(grid_size, f64);
    torch::Tensor out = torch::outer(pos, omega);                       // (G, D'/2)
    torch::Tensor emb1 = torch::cat({torch::sin(out), torch::cos(out)}, 1);  // (G, half)
    // token n = i*G + j: first half the column j, second half the row i
    torch::Tensor col = emb1.unsqueeze(0).expand({grid_size, grid_size, half});
    torch::Tensor row = emb1.unsqueeze(1).expand({grid_size, grid_size, half});
    return torch::cat({col, row}, 2).reshape({grid_size * grid_size, hidden_size}).to(torch::kFloat32);
}

torch::Tensor dit_timestep_embedding(const torch::Tensor& t, int64_t dim) {
    const int64_t half = dim / 2;
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(t.device());
    torch::Tensor freqs = torch::exp(-std::log(10000.0) * torch::arange(0, half, f32) / static_cast<double>(half));
    torch::Tensor args = t.to(torch::kFloat32).unsqueeze(1) * freqs.unsqueeze(0);
    torch::Tensor emb = torch::cat({torch::cos(args), torch::sin(args)}, -1);
    if (dim % 2) emb = torch::cat({emb, torch::zeros_like(emb.narrow(1, 0, 1))}, -1);
    return emb;
}

bool is_dit5_new_parameter(const std::string& key) {
    static const char* const kNew[] = {".attn.w1", ".attn.w2", ".attn.qk_scale_ttt", ".attn.qk_offset_ttt",
                                       ".attn.q_conv2d.weight", ".attn.q_conv2d.bias", ".attn.k_conv2d.weight",
                                       ".attn.k_conv2d.bias"};
    if (key.rfind("blocks.", 0) != 0) return false;
    for (const char* s : kNew) {
        const std::string suffix(s);
        if (key.size() >= suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0)
            return true;
    }
    return false;
}

}  // namespace linvis::models
