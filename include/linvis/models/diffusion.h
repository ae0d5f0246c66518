// The Gaussian diffusion exactly as DiT configures it (spec dit_generation.md §3; the code is
// facebookresearch/DiT@ed81ce2:diffusion/{gaussian_diffusion,respace,__init__,diffusion_utils}.py,
// identical in DiT3 and DiT5): linear beta schedule over T = 1000 steps, epsilon prediction,
// learned-range variance (learn_sigma) or fixed-large variance, MSE (+ vb) training loss, the
// ancestral (DDPM) and DDIM samplers, timestep respacing. Always the SpacedDiffusion path (even for
// ""): the schedule arrays are float64, rebuilt from the kept steps' alpha-bar ratios, indexed by the
// spaced step and cast to float32 after indexing; the network sees the original timesteps.
//
// It is mathematics on tensors, not training, so it lives in `models` where train, tools and cli
// can use it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace linvis::models {

// space_timesteps(T, spec): "ddimN" (the smallest stride i with len(range(0, T, i)) == N) or a comma
// list of per-section counts ("250", "10,15,20"); "" means all T steps. Returns the kept original
// steps in ascending order. Throws linvis::Error for an impossible spec.
std::vector<int64_t> space_timesteps(int64_t num_timesteps, const std::string& spec);

// The network as the diffusion calls it: x_t (B, C, H, W) and original timesteps (B,) int64 ->
// (B, C or 2C, H, W) (2C when the variance is learned: [eps | v]).
using DenoiseFn = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& t)>;

class GaussianDiffusion {
public:
    // create_diffusion(timestep_respacing, learn_sigma=learn_sigma, diffusion_steps=T).
    explicit GaussianDiffusion(const std::string& respacing = "", bool learn_sigma = true,
                               int64_t diffusion_steps = 1000);

    int64_t num_timesteps() const { return static_cast<int64_t>(betas_.size()); }
    const std::vector<int64_t>& timestep_map() const { return timestep_map_; }
    bool learn_sigma() const { return learn_sigma_; }

    // The float64 arrays of the (spaced) process, by name: betas, alphas_cumprod, alphas_cumprod_prev,
    // posterior_variance, posterior_log_variance_clipped, posterior_mean_coef1, posterior_mean_coef2,
    // sqrt_recip_alphas_cumprod, sqrt_recipm1_alphas_cumprod, ...
    const std::vector<double>& array(const std::string& name) const;

    // q(x_t | x_0): sqrt(abar) x0 + sqrt(1 - abar) noise; t spaced indices (B,).
    torch::Tensor q_sample(const torch::Tensor& x0, const torch::Tensor& t, const torch::Tensor& noise) const;

    struct MeanVariance {
        torch::Tensor mean, variance, log_variance, pred_xstart;
    };
    // From the network output on (x, spaced t).
    MeanVariance p_mean_variance(const torch::Tensor& model_output, const torch::Tensor& x, const torch::Tensor& t,
                                 bool clip_denoised = false) const;

    struct Losses {
        torch::Tensor loss, mse, vb;  // (B,) each; vb is empty without a learned variance
    };
    // training_losses(model, x0, t, noise): t spaced indices (B,) int64.
    Losses training_losses(const DenoiseFn& model, const torch::Tensor& x0, const torch::Tensor& t,
                           const torch::Tensor& noise) const;

    // One step of each sampler at spaced step t (B,); noise (drawn every step, as the official code)
    // is masked at t == 0.
    torch::Tensor p_sample(const DenoiseFn& model, const torch::Tensor& x, const torch::Tensor& t,
                           const torch::Tensor& noise, bool clip_denoised = false) const;
    torch::Tensor ddim_sample(const DenoiseFn& model, const torch::Tensor& x, const torch::Tensor& t,
                              const torch::Tensor& noise, double eta = 0.0, bool clip_denoised = false) const;

    // Full loops from x_T = noise over all (spaced) steps, S-1 down to 0. The per-step noise is
    // torch::randn_like(x) from the default generator. `progress(done, total)` after each step.
    using Progress = std::function<void(int64_t done, int64_t total)>;
    torch::Tensor p_sample_loop(const DenoiseFn& model, const torch::Tensor& noise, bool clip_denoised = false,
                                const Progress& progress = {}) const;
    torch::Tensor ddim_sample_loop(const DenoiseFn& model, const torch::Tensor& noise, double eta = 0.0,
                                   bool clip_denoised = false, const Progress& progress = {}) const;

    // The network called through the official _WrappedModel: model(x, timestep_map[t]).
    torch::Tensor call_model(const DenoiseFn& model, const torch::Tensor& x, const torch::Tensor& t) const;

private:
    void build(const std::vector<double>& betas);
    // arr[t] cast to float32, shaped (B, 1, 1, 1) to broadcast against x.
    torch::Tensor extract(const std::vector<double>& arr, const torch::Tensor& t, const torch::Tensor& like) const;

    bool learn_sigma_;
    std::vector<int64_t> timestep_map_;
    std::vector<double> betas_, log_betas_, alphas_cumprod_, alphas_cumprod_prev_, alphas_cumprod_next_,
        sqrt_alphas_cumprod_, sqrt_one_minus_alphas_cumprod_, sqrt_recip_alphas_cumprod_,
        sqrt_recipm1_alphas_cumprod_, posterior_variance_, posterior_log_variance_clipped_, posterior_mean_coef1_,
        posterior_mean_coef2_, fixed_large_variance_, fixed_large_log_variance_;
};

}  // namespace linvis::models
