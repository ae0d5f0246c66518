// Class-conditional diffusion transformers (spec dit_generation.md §1-2): the softmax DiT
// (facebookresearch/DiT@ed81ce2:models.py), DiT3 ("DiTTT", LeapLabTHU/ViTTT@e347758:dittt/models.py:
// ViT3's TTT mixer plus a depthwise positional conv) and DiT5 (LeapLabTHU/Transformer-to-TTT@06493e4:
// DiT5/models.py: 0.5 neighbourhood attention + 0.5 TTT-MLP). One adaLN-Zero skeleton, three mixers.
//
// Registered as generative models (models/registry.h) `dit_{s,b,l,xl}{2,4,8}`, `dit3_...`, `dit5_...`;
// options input_size (latent side, default 32), in_channels (4), num_classes (1000), learn_sigma (true),
// class_dropout_prob (0.1; > 0 adds the null-label row num_classes), depth, hidden_size, num_heads,
// patch_size, mlp_ratio (4), impl, and for DiT5 nat_small_grid. Parameter names are the official state_dict keys.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "linvis/models/diffusion.h"
#include "linvis/models/model.h"
#include "linvis/ops/impl.h"
#include "linvis/ops/neighborhood_attention.h"

namespace linvis::models {

struct DitConfig {
    std::string family = "dit";  // "dit" (softmax), "dit3", "dit5"
    int64_t input_size = 32;     // latent side L
    int64_t patch_size = 2;
    int64_t in_channels = 4;
    int64_t hidden_size = 384;
    int64_t depth = 12;
    int64_t num_heads = 6;
    double mlp_ratio = 4.0;
    double class_dropout_prob = 0.1;
    int64_t num_classes = 1000;
    bool learn_sigma = true;
    ops::Impl impl = ops::Impl::Auto;  // passed to the softmax-attention, TTT and neighbourhood-attention ops
    // DiT5 on a token grid smaller than the 5x5 window: NATTEN (and so the official model) rejects it, and so
    // does forward unless this is set (model option nat_small_grid=whole|wrap; true means whole):
    // WholeAxis makes the window cover the whole short axis; FlatWrap computes what the NATTEN stand-in behind
    // ../shared/fixtures/generation computes there (ops::NatSmallGrid), which reproduces those fixtures.
    std::optional<ops::NatSmallGrid> nat_small_grid;
};

// The interface of a class-conditional diffusion network as the samplers and the CLI see it.
class DiffusionModel : public Model {
public:
    // x (B, in_channels, L, L) float, t (B,) int64 original timesteps 0..999, y (B,) int64 labels in
    // [0, num_classes] (num_classes = the null label, allowed when the model has its row)
    // -> (B, out_channels, L, L). In train mode labels are dropped to the null class with
    // probability class_dropout_prob (official LabelEmbedder.token_drop).
    virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y) = 0;
    // The official forward_with_cfg: the batch is 2n; runs the model on cat(x[:n], x[:n]) with the full
    // t and y (conditional labels first, null labels second), guides channels 0..2 only:
    // g = uncond + s (cond - uncond), returns cat([cat(g, g), out[:, 3:]], channel). As the official slice
    // out[:, :3], a model with fewer than 3 output channels has all of them guided.
    torch::Tensor forward_with_cfg(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y,
                                   double cfg_scale);

    virtual const DitConfig& config() const = 0;
    int64_t in_channels() const { return config().in_channels; }
    int64_t out_channels() const { return config().learn_sigma ? 2 * config().in_channels : config().in_channels; }
    int64_t input_size() const { return config().input_size; }
    int64_t num_classes() const { return config().num_classes; }
    // The null label (num_classes) exists only when class_dropout_prob > 0.
    bool has_null_label() const { return config().class_dropout_prob > 0; }

    // Throws a one-line linvis::Error when x, t, y do not fit the model (shape, dtype, label range).
    void check_inputs(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y) const;

    // The official initialize_weights (spec §2), also run by the constructor.
    virtual void initialize_weights() = 0;

    bool loads_ema_by_default() const override { return true; }
};

using DiffusionModelPtr = std::shared_ptr<DiffusionModel>;

DiffusionModelPtr make_dit(const DitConfig& config);
// A registered diffusion model by name (an error for any other name or kind).
DiffusionModelPtr create_diffusion_model(const std::string& name, const ModelConfig& config = ModelConfig());

// Parameters (state-dict numel, pos_embed included) of a registered diffusion model at its default options,
// without building the large ones: the count is linear in depth (built at depth 1 and 2).
int64_t count_diffusion_model_parameters(const std::string& name);

// pos_embed of §1.1: (N, C) float32 from float64 sin-cos, first half the column, second the row.
torch::Tensor dit_pos_embed(int64_t hidden_size, int64_t grid_size);
// The sinusoidal timestep features [cos | sin] (B, dim) of §1.1, float32.
torch::Tensor dit_timestep_embedding(const torch::Tensor& t, int64_t dim = 256);

// Keys of a DiT5 model that a softmax DiT does not provide (DiT5/train.py inheritance; per block
// attn.w1, attn.w2, attn.qk_scale_ttt, attn.qk_offset_ttt, attn.{q,k}_conv2d.{weight,bias}).
bool is_dit5_new_parameter(const std::string& key);

// Class-conditional sampling as the official sample.py (spec §3.7): from the noise z (n, C, L, L) and labels
// (n,), with guidance (cfg_scale != 1) the batch is doubled with the null label and the model runs
// forward_with_cfg, else plain forward; the DDPM sampler (p_sample_loop, respacing "<steps>") or DDIM
// (ddim_sample_loop with eta, respacing "ddim<steps>"), clip_denoised=False; the first n rows (what the
// sampler returns: all output channels of x_0, (n, C, L, L)). The per-step noise comes from the default
// generator. The sampler computes in float32 and returns float32; the network runs in its parameters' dtype (a
// model moved to bf16 samples in bf16). Throws a one-line error for a label out of range, noise of the wrong
// shape, or guidance without a null-label row.
struct SamplerConfig {
    std::string sampler = "ddpm";  // ddpm | ddim
    int64_t steps = 250;
    std::string respacing;         // explicit respacing; overrides sampler/steps when set
    double eta = 0.0;              // DDIM eta
    double cfg_scale = 4.0;        // 1: no guidance
    std::string respacing_spec() const {  // what GaussianDiffusion is built with
        return !respacing.empty() ? respacing : (sampler == "ddim" ? "ddim" : "") + std::to_string(steps);
    }
};
torch::Tensor sample_class_conditional(DiffusionModel& model, const torch::Tensor& noise,
                                       const std::vector<int64_t>& labels, const SamplerConfig& config,
                                       const GaussianDiffusion::Progress& progress = {});

}  // namespace linvis::models
