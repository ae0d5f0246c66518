// linvis sample: class-conditional samples from a diffusion model (DiT, DiT3, DiT5) as the official
// sample.py draws them (spec dit_generation.md §3.7): noise z (n, C, L, L), the batch doubled with the
// null label for classifier-free guidance (forward_with_cfg, first half kept), the DDPM (p_sample_loop,
// respacing "<steps>") or DDIM (respacing "ddim<steps>") sampler with clip_denoised=False, then
// safetensors ('samples', 'labels') or a labelled PNG grid (decoded by the VAE for latent models).
#include <cstdio>
#include <iostream>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/io/safetensors.h"
#include "linvis/models/diffusion.h"
#include "linvis/models/dit.h"
#include "linvis/models/registry.h"
#include "linvis/models/vae.h"
#include "linvis/plot/plot.h"

namespace linvis::cli {
namespace {

struct SampleOptions {
    ModelOptions model;
    std::string sampler = "ddpm";
    int64_t steps = 250;
    std::string respacing;
    double eta = 0.0;
    double cfg_scale = 4.0;
    std::vector<int64_t> labels;
    int64_t seed = 0;
    std::string noise;
    std::string vae;
    std::map<std::string, std::string> vae_kwargs;
    std::vector<std::string> class_names;
    std::string output;
    int64_t nrow = 0;
    bool no_progress = false;
    int threads = 0;
};

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// save_image(normalize=True, value_range=(-1, 1)): clamp, (x + 1) / 2, floor(255 v + 0.5).
torch::Tensor to_uint8_hwc(const torch::Tensor& image_chw) {
    torch::Tensor v = (image_chw.to(torch::kFloat32).clamp(-1, 1) + 1) / 2;
    torch::Tensor u8 = torch::floor(v * 255 + 0.5).clamp(0, 255).to(torch::kUInt8);
    if (u8.size(0) == 1) u8 = u8.expand({3, u8.size(1), u8.size(2)});
    return u8.narrow(0, 0, 3).permute({1, 2, 0}).contiguous();
}

void write_grid(const std::string& path, const torch::Tensor& images, const std::vector<std::string>& captions,
                int64_t nrow) {
    const int64_t n = images.size(0), H = images.size(2), W = images.size(3);
    const int64_t cols = nrow > 0 ? nrow : std::min<int64_t>(n, 8);
    const int64_t rows = (n + cols - 1) / cols;
    // Small images (28-64 px) are enlarged so that the captions stay readable.
    const int scale = static_cast<int>(std::max<int64_t>(1, 96 / std::max(H, W)));
    const int cw = static_cast<int>(W) * scale, ch = static_cast<int>(H) * scale;
    const int pad = 4, caption = 16;
    plot::Canvas canvas(static_cast<int>(cols) * (cw + pad) + pad, static_cast<int>(rows) * (ch + caption + pad) + pad);
    for (int64_t i = 0; i < n; ++i) {
        plot::Canvas tile = plot::canvas_from_tensor(to_uint8_hwc(images[i]));
        if (scale > 1) {
            // nearest-neighbour enlargement keeps the pixels of small images sharp
            plot::Canvas big(cw, ch);
            for (int y = 0; y < ch; ++y)
                for (int x = 0; x < cw; ++x) big.set_pixel(x, y, tile.pixel(x / scale, y / scale));
            tile = big;
        }
        const int x0 = pad + static_cast<int>(i % cols) * (cw + pad);
        const int y0 = pad + static_cast<int>(i / cols) * (ch + caption + pad);
        canvas.draw_text(captions[i], x0 + cw / 2.0, y0 + caption - 4, 12, plot::colors::black, plot::HAlign::Center);
        canvas.blit(tile, x0, y0 + caption);
    }
    canvas.save_png(path);
}

int run_sample(int argc, const char* const* argv) {
    SampleOptions o;
    CommandApp app("sample", "Draw class-conditional samples from a diffusion model (DiT, DiT3, DiT5) as the official "
                             "sample.py does, and write them as safetensors ('samples', 'labels') or a labelled PNG "
                             "grid.");
    add_model_options(app, o.model, true);
    add_choice(app, "--sampler", o.sampler, {"ddpm", "ddim"}, "ddpm: ancestral p_sample_loop; ddim: eta --eta");
    add_number(app, "--steps", o.steps, "sampling steps (respacing '<N>' for ddpm, 'ddim<N>' for ddim)", int64_t{1},
               int64_t{1000});
    app.add_option("--respacing", o.respacing, "explicit timestep respacing (e.g. '250', 'ddim25', '10,15,20'); "
                                               "overrides --steps");
    add_number(app, "--eta", o.eta, "DDIM eta", 0.0, 1.0);
    add_number(app, "--cfg-scale", o.cfg_scale, "classifier-free guidance scale (1: no guidance, plain forward)", 0.0);
    add_list(app, "--labels", o.labels, "class labels, one sample each (default: the 'label' tensor of --noise, the "
                                        "official 8 ImageNet labels for 1000 classes, else one per class)");
    add_seed_option(app, o.seed);
    app.add_option("--noise", o.noise, "safetensors file with the initial noise 'noise' (n, C, L, L) and optionally "
                                       "the labels 'label' (n,), for samples reproducible across implementations")
        ->type_name("FILE");
    app.add_option("--vae", o.vae, "VAE decoder weights (sd_vae_decoder) to decode latent samples for a .png")
        ->type_name("FILE");
    add_model_kwargs_option(app, o.vae_kwargs, "--vae-kwargs")->description("options of the VAE decoder, e.g. block_out_channels=32,32,64,64");
    add_list(app, "--class-names", o.class_names, "caption of each class in the PNG grid");
    app.add_option("--output", o.output, "OUT.safetensors (samples) or OUT.png (a labelled grid)")
        ->type_name("FILE")
        ->required();
    add_number(app, "--nrow", o.nrow, "images per row of the grid (default min(n, 8))", int64_t{0});
    app.add_flag("--no-progress", o.no_progress, "no progress bar");
    add_threads_option(app, o.threads);
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(o.threads);
    const bool to_png = ends_with(o.output, ".png");
    LINVIS_CHECK(to_png || ends_with(o.output, ".safetensors"), "--output: expected a .safetensors or .png file, got '",
                 o.output, "'");
    LINVIS_CHECK(models::generative_model_kind(o.model.model) == "diffusion", "--model: '", o.model.model,
                 "' is not a diffusion model (see 'linvis models')");

    auto model = std::dynamic_pointer_cast<models::DiffusionModel>(build_generative_model(o.model));
    const int64_t C = model->in_channels(), L = model->input_size(), K = model->num_classes();

    torch::manual_seed(static_cast<uint64_t>(o.seed));
    torch::Tensor z;
    std::vector<int64_t> labels = o.labels;
    if (!o.noise.empty()) {
        io::SafetensorsFile file = io::SafetensorsFile::open(o.noise);
        LINVIS_CHECK(file.contains("noise"), o.noise, ": no tensor named 'noise'");
        z = file.tensor("noise").to(torch::kFloat32);
        if (labels.empty() && file.contains("label")) {
            torch::Tensor l = file.tensor("label").to(torch::kInt64).reshape({-1});
            labels.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
        }
    }
    if (labels.empty()) {
        if (K == 1000) labels = {207, 360, 387, 974, 88, 979, 417, 279};
        else
            for (int64_t k = 0; k < K; ++k) labels.push_back(k);
    }
    const int64_t n = static_cast<int64_t>(labels.size());
    for (const int64_t l : labels)
        LINVIS_CHECK(l >= 0 && l < K, "--labels: label ", l, " out of range [0, ", K - 1, "] (", o.model.model, " has ",
                     K, " classes)");
    if (z.defined()) {
        LINVIS_CHECK(z.dim() == 4 && z.size(0) == n && z.size(1) == C && z.size(2) == L && z.size(3) == L, o.noise,
                     ": tensor 'noise': expected shape (", n, ", ", C, ", ", L, ", ", L, "), got ",
                     shape_string(z.sizes()));
    } else {
        z = torch::randn({n, C, L, L});
    }
    const bool guided = o.cfg_scale != 1.0;
    LINVIS_CHECK(!guided || model->has_null_label(), "--cfg-scale ", o.cfg_scale, ": ", o.model.model,
                 " has no null-label row (class_dropout_prob 0); use --cfg-scale 1");
    torch::Tensor y = torch::tensor(labels, torch::kInt64);
    if (guided) {
        z = torch::cat({z, z}, 0);
        y = torch::cat({y, torch::full({n}, K, torch::kInt64)}, 0);
    }
    const std::string respacing =
        !o.respacing.empty() ? o.respacing : (o.sampler == "ddim" ? "ddim" : "") + std::to_string(o.steps);
    models::GaussianDiffusion diffusion(respacing, model->config().learn_sigma);
    models::DenoiseFn fn = [&](const torch::Tensor& x, const torch::Tensor& t) {
        return guided ? model->forward_with_cfg(x, t, y, o.cfg_scale) : model->forward(x, t, y);
    };
    models::GaussianDiffusion::Progress progress;
    if (!o.no_progress)
        progress = [](int64_t done, int64_t total) {
            const int width = 30, filled = static_cast<int>(width * done / total);
            std::fprintf(stderr, "\rsampling [%s%s] %lld/%lld", std::string(filled, '#').c_str(),
                         std::string(width - filled, '.').c_str(), static_cast<long long>(done),
                         static_cast<long long>(total));
            if (done == total) std::fprintf(stderr, "\n");
            std::fflush(stderr);
        };
    torch::Tensor samples;
    {
        torch::NoGradGuard no_grad;
        samples = o.sampler == "ddim" ? diffusion.ddim_sample_loop(fn, z, o.eta, false, progress)
                                      : diffusion.p_sample_loop(fn, z, false, progress);
    }
    if (guided) samples = samples.narrow(0, 0, n);
    samples = samples.contiguous();
    const torch::Tensor label_tensor = torch::tensor(labels, torch::kInt64);

    if (!to_png) {
        io::save_safetensors(o.output, {{"samples", samples}, {"labels", label_tensor}},
                             {{"model", o.model.model}, {"sampler", o.sampler}, {"respacing", respacing},
                              {"cfg_scale", std::to_string(o.cfg_scale)}, {"seed", std::to_string(o.seed)}});
        std::cout << "wrote " << o.output << ": samples " << shape_string(samples.sizes()) << "\n";
        return 0;
    }
    torch::Tensor images = samples;
    if (!o.vae.empty()) {
        ModelOptions vae_options;
        vae_options.model = "sd_vae_decoder";
        vae_options.kwargs = o.vae_kwargs;
        vae_options.weights = o.vae;
        auto vae = std::dynamic_pointer_cast<models::VaeDecoder>(build_generative_model(vae_options));
        torch::NoGradGuard no_grad;
        images = vae->decode(samples / models::kSdVaeScale);
    } else {
        LINVIS_CHECK(C == 1 || C == 3, "--output ", o.output, ": ", o.model.model, " samples have ", C,
                     " channels (a latent model): give --vae FILE to decode them, or write .safetensors");
    }
    std::vector<std::string> captions;
    for (const int64_t l : labels)
        captions.push_back(l < static_cast<int64_t>(o.class_names.size()) ? o.class_names[l] : "class " + std::to_string(l));
    write_grid(o.output, images, captions, o.nrow);
    std::cout << "wrote " << o.output << ": " << n << " samples " << shape_string(images.sizes()) << "\n";
    return 0;
}

CommandRegistrar registrar("sample", "draw class-conditional samples from a diffusion model (DiT, DiT3, DiT5)",
                           run_sample);

}  // namespace
}  // namespace linvis::cli
