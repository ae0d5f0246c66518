// Gaussian diffusion (spec dit_generation.md §3); see include/linvis/models/diffusion.h.
// Sources: facebookresearch/DiT@ed81ce2:diffusion/gaussian_diffusion.py, respace.py, __init__.py,
// diffusion_utils.py.
#include "linvis/models/diffusion.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "linvis/core/error.h"

namespace linvis::models {
namespace {

constexpr double kLn2 = 0.69314718055994530942;  // np.log(2.0)

std::vector<double> linear_betas(int64_t T) {
    // get_named_beta_schedule("linear"): np.linspace(scale * 1e-4, scale * 0.02, T) in float64,
    // computed as numpy does: arange * step + start, the last entry set to stop.
    const double scale = 1000.0 / static_cast<double>(T);
    const double start = scale * 0.0001, stop = scale * 0.02;
    std::vector<double> b(T);
    if (T == 1) {
        b[0] = start;
        return b;
    }
    const double step = (stop - start) / static_cast<double>(T - 1);
    for (int64_t i = 0; i < T; ++i) b[i] = static_cast<double>(i) * step + start;
    b[T - 1] = stop;
    return b;
}

torch::Tensor mean_flat(const torch::Tensor& x) {
    std::vector<int64_t> dims;
    for (int64_t d = 1; d < x.dim(); ++d) dims.push_back(d);
    return x.mean(dims);
}

torch::Tensor normal_kl(const torch::Tensor& mean1, const torch::Tensor& logvar1, const torch::Tensor& mean2,
                        const torch::Tensor& logvar2) {
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch::exp(logvar1 - logvar2) +
                  (mean1 - mean2).pow(2) * torch::exp(-logvar2));
}

torch::Tensor approx_standard_normal_cdf(const torch::Tensor& x) {
    return 0.5 * (1.0 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * torch::pow(x, 3))));
}

torch::Tensor discretized_gaussian_log_likelihood(const torch::Tensor& x, const torch::Tensor& means,
                                                  const torch::Tensor& log_scales) {
    torch::Tensor centered = x - means;
    torch::Tensor inv_stdv = torch::exp(-log_scales);
    torch::Tensor cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0));
    torch::Tensor cdf_min = approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0));
    torch::Tensor log_cdf_plus = torch::log(cdf_plus.clamp_min(1e-12));
    torch::Tensor log_one_minus_cdf_min = torch::log((1.0 - cdf_min).clamp_min(1e-12));
    torch::Tensor cdf_delta = cdf_plus - cdf_min;
    return torch::where(x < -0.999, log_cdf_plus,
                        torch::where(x > 0.999, log_one_minus_cdf_min, torch::log(cdf_delta.clamp_min(1e-12))));
}

std::vector<int64_t> parse_counts(const std::string& spec) {
    std::vector<int64_t> counts;
    size_t pos = 0;
    while (pos <= spec.size()) {
        const size_t comma = spec.find(',', pos);
        const std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        try {
            size_t used = 0;
            const long long v = std::stoll(item, &used);
            LINVIS_CHECK(used == item.size(), "");
            counts.push_back(v);
        } catch (const std::exception&) {
            fail("timestep respacing '", spec, "': expected 'ddimN' or comma-separated step counts, got item '", item,
                 "'");
        }
        if (comma == std::string::npos) break;
        pos = comma + 1;
    }
    return counts;
}

}  // namespace

std::vector<int64_t> space_timesteps(int64_t T, const std::string& spec) {
    LINVIS_CHECK(T >= 1, "space_timesteps: num_timesteps must be >= 1, got ", T);
    if (spec.empty()) {
        std::vector<int64_t> all(T);
        for (int64_t i = 0; i < T; ++i) all[i] = i;
        return all;
    }
    if (spec.rfind("ddim", 0) == 0) {
        int64_t desired = 0;
        try {
            size_t used = 0;
            desired = std::stoll(spec.substr(4), &used);
            LINVIS_CHECK(used == spec.size() - 4, "");
        } catch (const std::exception&) {
            fail("timestep respacing '", spec, "': expected ddimN with an integer N");
        }
        for (int64_t i = 1; i < T; ++i) {
            if ((T + i - 1) / i == desired) {
                std::vector<int64_t> steps;
                for (int64_t s = 0; s < T; s += i) steps.push_back(s);
                return steps;
            }
        }
        fail("timestep respacing '", spec, "': cannot create exactly ", desired, " steps with an integer stride over ",
             T, " steps");
    }
    const std::vector<int64_t> counts = parse_counts(spec);
    const int64_t sections = static_cast<int64_t>(counts.size());
    const int64_t size_per = T / sections, extra = T % sections;
    int64_t start = 0;
    std::set<int64_t> all;
    for (int64_t i = 0; i < sections; ++i) {
        const int64_t size = size_per + (i < extra ? 1 : 0);
        const int64_t count = counts[i];
        LINVIS_CHECK(count >= 0 && size >= count, "timestep respacing '", spec, "': cannot divide section of ", size,
                     " steps into ", count);
        const double stride = count <= 1 ? 1.0 : static_cast<double>(size - 1) / static_cast<double>(count - 1);
        double cur = 0.0;
        for (int64_t k = 0; k < count; ++k) {
            all.insert(start + static_cast<int64_t>(std::nearbyint(cur)));  // Python round: half to even
            cur += stride;
        }
        start += size;
    }
    return std::vector<int64_t>(all.begin(), all.end());
}

GaussianDiffusion::GaussianDiffusion(const std::string& respacing, bool learn_sigma, int64_t diffusion_steps)
    : learn_sigma_(learn_sigma) {
    const std::vector<double> base = linear_betas(diffusion_steps);
    std::vector<double> base_acp(base.size());
    double prod = 1.0;
    for (size_t i = 0; i < base.size(); ++i) base_acp[i] = prod = prod * (1.0 - base[i]);
    const std::vector<int64_t> use = space_timesteps(diffusion_steps, respacing);
    LINVIS_CHECK(!use.empty(), "timestep respacing '", respacing, "' keeps no steps");
    std::vector<double> betas;
    double last = 1.0;
    size_t u = 0;
    for (int64_t i = 0; i < diffusion_steps; ++i) {
        if (u < use.size() && use[u] == i) {
            betas.push_back(1.0 - base_acp[i] / last);
            last = base_acp[i];
            timestep_map_.push_back(i);
            ++u;
        }
    }
    build(betas);
}

void GaussianDiffusion::build(const std::vector<double>& b) {
    const size_t T = b.size();
    betas_ = b;
    log_betas_.resize(T);
    alphas_cumprod_.resize(T);
    alphas_cumprod_prev_.resize(T);
    alphas_cumprod_next_.resize(T);
    sqrt_alphas_cumprod_.resize(T);
    sqrt_one_minus_alphas_cumprod_.resize(T);
    sqrt_recip_alphas_cumprod_.resize(T);
    sqrt_recipm1_alphas_cumprod_.resize(T);
    posterior_variance_.resize(T);
    posterior_log_variance_clipped_.resize(T);
    posterior_mean_coef1_.resize(T);
    posterior_mean_coef2_.resize(T);
    fixed_large_variance_.resize(T);
    fixed_large_log_variance_.resize(T);
    double prod = 1.0;
    for (size_t i = 0; i < T; ++i) {
        const double alpha = 1.0 - b[i];
        prod = prod * alpha;
        alphas_cumprod_[i] = prod;
    }
    for (size_t i = 0; i < T; ++i) {
        const double acp = alphas_cumprod_[i];
        const double prev = i == 0 ? 1.0 : alphas_cumprod_[i - 1];
        const double alpha = 1.0 - b[i];
        log_betas_[i] = std::log(b[i]);
        alphas_cumprod_prev_[i] = prev;
        alphas_cumprod_next_[i] = i + 1 < T ? alphas_cumprod_[i + 1] : 0.0;
        sqrt_alphas_cumprod_[i] = std::sqrt(acp);
        sqrt_one_minus_alphas_cumprod_[i] = std::sqrt(1.0 - acp);
        sqrt_recip_alphas_cumprod_[i] = std::sqrt(1.0 / acp);
        sqrt_recipm1_alphas_cumprod_[i] = std::sqrt(1.0 / acp - 1.0);
        posterior_variance_[i] = b[i] * (1.0 - prev) / (1.0 - acp);
        posterior_mean_coef1_[i] = b[i] * std::sqrt(prev) / (1.0 - acp);
        posterior_mean_coef2_[i] = (1.0 - prev) * std::sqrt(alpha) / (1.0 - acp);
    }
    for (size_t i = 0; i < T; ++i) {
        // log(append(pv[1], pv[1:])); an empty array when T == 1 (then plvc is never usable).
        posterior_log_variance_clipped_[i] = T > 1 ? std::log(i == 0 ? posterior_variance_[1] : posterior_variance_[i])
                                                   : std::log(posterior_variance_[0]);
        fixed_large_variance_[i] = i == 0 ? (T > 1 ? posterior_variance_[1] : b[0]) : b[i];
        fixed_large_log_variance_[i] = std::log(fixed_large_variance_[i]);
    }
}

const std::vector<double>& GaussianDiffusion::array(const std::string& name) const {
    if (name == "betas") return betas_;
    if (name == "log_betas") return log_betas_;
    if (name == "alphas_cumprod") return alphas_cumprod_;
    if (name == "alphas_cumprod_prev") return alphas_cumprod_prev_;
    if (name == "alphas_cumprod_next") return alphas_cumprod_next_;
    if (name == "sqrt_alphas_cumprod") return sqrt_alphas_cumprod_;
    if (name == "sqrt_one_minus_alphas_cumprod") return sqrt_one_minus_alphas_cumprod_;
    if (name == "sqrt_recip_alphas_cumprod") return sqrt_recip_alphas_cumprod_;
    if (name == "sqrt_recipm1_alphas_cumprod") return sqrt_recipm1_alphas_cumprod_;
    if (name == "posterior_variance") return posterior_variance_;
    if (name == "posterior_log_variance_clipped") return posterior_log_variance_clipped_;
    if (name == "posterior_mean_coef1") return posterior_mean_coef1_;
    if (name == "posterior_mean_coef2") return posterior_mean_coef2_;
    fail("GaussianDiffusion: unknown array '", name, "'");
}

torch::Tensor GaussianDiffusion::extract(const std::vector<double>& arr, const torch::Tensor& t,
                                         const torch::Tensor& like) const {
    torch::Tensor table = torch::from_blob(const_cast<double*>(arr.data()), {static_cast<int64_t>(arr.size())},
                                           torch::kFloat64);
    torch::Tensor idx = t.to(torch::kCPU, torch::kInt64);
    LINVIS_CHECK(idx.numel() == 0 || (idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < num_timesteps()),
                 "diffusion: spaced timestep out of range [0, ", num_timesteps(), ")");
    torch::Tensor v = table.index_select(0, idx).to(torch::kFloat32).to(like.device());
    std::vector<int64_t> shape(like.dim(), 1);
    shape[0] = like.size(0);
    return v.view(shape).to(like.scalar_type());
}

torch::Tensor GaussianDiffusion::call_model(const DenoiseFn& model, const torch::Tensor& x,
                                            const torch::Tensor& t) const {
    torch::Tensor map = torch::tensor(timestep_map_, torch::kInt64);
    return model(x, map.index_select(0, t.to(torch::kCPU, torch::kInt64)).to(x.device()));
}

torch::Tensor GaussianDiffusion::q_sample(const torch::Tensor& x0, const torch::Tensor& t,
                                          const torch::Tensor& noise) const {
    return extract(sqrt_alphas_cumprod_, t, x0) * x0 + extract(sqrt_one_minus_alphas_cumprod_, t, x0) * noise;
}

GaussianDiffusion::MeanVariance GaussianDiffusion::p_mean_variance(const torch::Tensor& model_output,
                                                                   const torch::Tensor& x, const torch::Tensor& t,
                                                                   bool clip_denoised) const {
    const int64_t C = x.size(1);
    MeanVariance out;
    torch::Tensor eps;
    if (learn_sigma_) {
        LINVIS_CHECK(model_output.size(1) == 2 * C, "diffusion: the model output has ", model_output.size(1),
                     " channels, expected ", 2 * C, " (epsilon and the learned variance)");
        eps = model_output.narrow(1, 0, C);
        torch::Tensor v = model_output.narrow(1, C, C);
        torch::Tensor min_log = extract(posterior_log_variance_clipped_, t, x);
        torch::Tensor max_log = extract(log_betas_, t, x);
        torch::Tensor frac = (v + 1) / 2;
        out.log_variance = frac * max_log + (1 - frac) * min_log;
        out.variance = torch::exp(out.log_variance);
    } else {
        LINVIS_CHECK(model_output.size(1) == C, "diffusion: the model output has ", model_output.size(1),
                     " channels, expected ", C);
        eps = model_output;
        out.variance = extract(fixed_large_variance_, t, x) * torch::ones_like(x);
        out.log_variance = extract(fixed_large_log_variance_, t, x) * torch::ones_like(x);
    }
    torch::Tensor pred = extract(sqrt_recip_alphas_cumprod_, t, x) * x - extract(sqrt_recipm1_alphas_cumprod_, t, x) * eps;
    if (clip_denoised) pred = pred.clamp(-1, 1);
    out.pred_xstart = pred;
    out.mean = extract(posterior_mean_coef1_, t, x) * pred + extract(posterior_mean_coef2_, t, x) * x;
    return out;
}

GaussianDiffusion::Losses GaussianDiffusion::training_losses(const DenoiseFn& model, const torch::Tensor& x0,
                                                             const torch::Tensor& t, const torch::Tensor& noise) const {
    LINVIS_CHECK(noise.sizes() == x0.sizes(), "training_losses: noise shape ", shape_string(noise.sizes()),
                 " differs from x0 ", shape_string(x0.sizes()));
    torch::Tensor x_t = q_sample(x0, t, noise);
    torch::Tensor o = call_model(model, x_t, t);
    const int64_t C = x0.size(1);
    Losses L;
    torch::Tensor eps = learn_sigma_ ? o.narrow(1, 0, C) : o;
    if (learn_sigma_) {
        torch::Tensor frozen = torch::cat({eps.detach(), o.narrow(1, C, C)}, 1);
        MeanVariance p = p_mean_variance(frozen, x_t, t, false);
        torch::Tensor true_mean = extract(posterior_mean_coef1_, t, x_t) * x0 + extract(posterior_mean_coef2_, t, x_t) * x_t;
        torch::Tensor true_logvar = extract(posterior_log_variance_clipped_, t, x_t);
        torch::Tensor kl = mean_flat(normal_kl(true_mean, true_logvar, p.mean, p.log_variance)) / kLn2;
        torch::Tensor nll =
            mean_flat(-discretized_gaussian_log_likelihood(x0, p.mean, 0.5 * p.log_variance)) / kLn2;
        L.vb = torch::where(t.to(kl.device()) == 0, nll, kl);
    }
    L.mse = mean_flat((noise - eps).pow(2));
    L.loss = L.vb.defined() ? L.mse + L.vb : L.mse;
    return L;
}

torch::Tensor GaussianDiffusion::p_sample(const DenoiseFn& model, const torch::Tensor& x, const torch::Tensor& t,
                                          const torch::Tensor& noise, bool clip_denoised) const {
    MeanVariance out = p_mean_variance(call_model(model, x, t), x, t, clip_denoised);
    std::vector<int64_t> shape(x.dim(), 1);
    shape[0] = x.size(0);
    torch::Tensor mask = (t != 0).to(x.scalar_type()).to(x.device()).view(shape);
    return out.mean + mask * torch::exp(0.5 * out.log_variance) * noise;
}

torch::Tensor GaussianDiffusion::ddim_sample(const DenoiseFn& model, const torch::Tensor& x, const torch::Tensor& t,
                                             const torch::Tensor& noise, double eta, bool clip_denoised) const {
    MeanVariance out = p_mean_variance(call_model(model, x, t), x, t, clip_denoised);
    torch::Tensor eps = (extract(sqrt_recip_alphas_cumprod_, t, x) * x - out.pred_xstart) /
                        extract(sqrt_recipm1_alphas_cumprod_, t, x);
    torch::Tensor abar = extract(alphas_cumprod_, t, x);
    torch::Tensor abar_prev = extract(alphas_cumprod_prev_, t, x);
    torch::Tensor sigma = eta * torch::sqrt((1 - abar_prev) / (1 - abar)) * torch::sqrt(1 - abar / abar_prev);
    torch::Tensor mean_pred = out.pred_xstart * torch::sqrt(abar_prev) + torch::sqrt(1 - abar_prev - sigma.pow(2)) * eps;
    std::vector<int64_t> shape(x.dim(), 1);
    shape[0] = x.size(0);
    torch::Tensor mask = (t != 0).to(x.scalar_type()).to(x.device()).view(shape);
    return mean_pred + mask * sigma * noise;
}

torch::Tensor GaussianDiffusion::p_sample_loop(const DenoiseFn& model, const torch::Tensor& noise, bool clip_denoised,
                                               const Progress& progress) const {
    torch::Tensor img = noise;
    const int64_t S = num_timesteps();
    for (int64_t i = S - 1; i >= 0; --i) {
        torch::Tensor t = torch::full({img.size(0)}, i, torch::kInt64);
        torch::Tensor z = torch::randn_like(img);
        img = p_sample(model, img, t, z, clip_denoised);
        if (progress) progress(S - i, S);
    }
    return img;
}

torch::Tensor GaussianDiffusion::ddim_sample_loop(const DenoiseFn& model, const torch::Tensor& noise, double eta,
                                                  bool clip_denoised, const Progress& progress) const {
    torch::Tensor img = noise;
    const int64_t S = num_timesteps();
    for (int64_t i = S - 1; i >= 0; --i) {
        torch::Tensor t = torch::full({img.size(0)}, i, torch::kInt64);
        torch::Tensor z = torch::randn_like(img);
        img = ddim_sample(model, img, t, z, eta, clip_denoised);
        if (progress) progress(S - i, S);
    }
    return img;
}

}  // namespace linvis::models
