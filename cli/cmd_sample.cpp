// linvis sample and linvis eval --task diffusion. sample: class-conditional samples from a diffusion model (DiT, DiT3, DiT5) as the official
// sample.py draws them (spec dit_generation.md §3.7): noise z (n, C, L, L), the batch doubled with the
// null label for classifier-free guidance (forward_with_cfg, first half kept), the DDPM (p_sample_loop,
// respacing "<steps>") or DDIM (respacing "ddim<steps>") sampler with clip_denoised=False, then
// safetensors ('samples', 'labels') or a labelled PNG grid (decoded by the VAE for latent models).
#include <chrono>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "command.h"
#include "common.h"
#include "generation.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/io/atomic_file.h"
#include "linvis/io/safetensors.h"
#include "linvis/models/diffusion.h"
#include "linvis/models/dit.h"
#include "linvis/models/registry.h"
#include "linvis/models/vae.h"
#include "linvis/plot/plot.h"
#include "linvis/train/data_sources.h"
#include "linvis/train/sample_quality.h"

namespace linvis::cli {
namespace {

struct SampleOptions {
    ModelOptions model;
    models::SamplerConfig sampling;  // --sampler, --steps, --respacing, --eta, --cfg-scale
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
    std::string dtype = "f32";
};

// --dtype of sample and eval --task diffusion: the diffusion model's network.
void add_network_dtype_option(CLI::App& app, std::string& dtype) {
    add_dtype_option(app, dtype, {"f32", "bf16"})
        ->description("dtype of the diffusion network's parameters and activations (the sampler computes in "
                      "float32)");
}

// The sampler options of sample and eval --task diffusion, written into the library's SamplerConfig.
void add_sampling_options(CLI::App& app, models::SamplerConfig& o) {
    add_choice(app, "--sampler", o.sampler, {"ddpm", "ddim"}, "ddpm: ancestral p_sample_loop; ddim: eta --eta");
    add_number(app, "--steps", o.steps, "sampling steps (respacing '<N>' for ddpm, 'ddim<N>' for ddim)", int64_t{1},
               int64_t{1000});
    app.add_option("--respacing", o.respacing, "explicit timestep respacing (e.g. '250', 'ddim25', '10,15,20'); "
                                               "overrides --steps");
    add_number(app, "--eta", o.eta, "DDIM eta", 0.0, 1.0);
    add_number(app, "--cfg-scale", o.cfg_scale, "classifier-free guidance scale (1: no guidance, plain forward)", 0.0);
}

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

// "sampling [#####.....] 12/50" on stderr.
models::GaussianDiffusion::Progress sampling_progress_bar() {
    return [](int64_t done, int64_t total) {
        const int width = 30, filled = static_cast<int>(width * done / total);
        std::fprintf(stderr, "\rsampling [%s%s] %lld/%lld", std::string(filled, '#').c_str(),
                     std::string(width - filled, '.').c_str(), static_cast<long long>(done),
                     static_cast<long long>(total));
        if (done == total) std::fprintf(stderr, "\n");
        std::fflush(stderr);
    };
}

int run_sample(int argc, const char* const* argv) {
    SampleOptions o;
    CommandApp app("sample", "Draw class-conditional samples from a diffusion model (DiT, DiT3, DiT5) as the official "
                             "sample.py does, and write them as safetensors ('samples', 'labels') or a labelled PNG "
                             "grid.");
    add_model_options(app, o.model, true);
    add_sampling_options(app, o.sampling);
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
    add_network_dtype_option(app, o.dtype);
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(o.threads);
    const bool to_png = ends_with(o.output, ".png");
    LINVIS_CHECK(to_png || ends_with(o.output, ".safetensors"), "--output: expected a .safetensors or .png file, got '",
                 o.output, "'");
    LINVIS_CHECK(models::generative_model_kind(o.model.model) == "diffusion", "--model: '", o.model.model,
                 "' is not a diffusion model (see 'linvis models')");

    auto model = std::dynamic_pointer_cast<models::DiffusionModel>(build_generative_model(o.model));
    if (o.dtype == "bf16") model->to(torch::kBFloat16);
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
    const models::SamplerConfig& sampler = o.sampling;
    LINVIS_CHECK(sampler.cfg_scale == 1.0 || model->has_null_label(), "--cfg-scale ", sampler.cfg_scale, ": ", o.model.model,
                 " has no null-label row (class_dropout_prob 0); use --cfg-scale 1");
    const std::string respacing = sampler.respacing_spec();
    const torch::Tensor samples = models::sample_class_conditional(*model, z, labels, sampler,
                                                                   o.no_progress ? models::GaussianDiffusion::Progress{}
                                                                                 : sampling_progress_bar());
    const torch::Tensor label_tensor = torch::tensor(labels, torch::kInt64);

    if (!to_png) {
        io::save_safetensors(o.output, {{"samples", samples}, {"labels", label_tensor}},
                             {{"model", o.model.model}, {"sampler", o.sampling.sampler}, {"respacing", respacing},
                              {"cfg_scale", std::to_string(o.sampling.cfg_scale)}, {"seed", std::to_string(o.seed)},
                              {"dtype", o.dtype}});
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

// ---- linvis eval --task diffusion: sample K images per class and measure them with a linvis classifier
// (train/sample_quality.h): the Frechet distance between the classifier's penultimate features of the
// samples and of as many real test images, the same distance between real training and real test images
// (the floor a perfect model would reach with this count), and the classifier's accuracy on the samples
// against the labels they were conditioned on.

struct EvalDiffusionOptions {
    std::string task = "diffusion";
    ModelOptions model;
    std::string classifier = std::string(LINVIS_ASSETS_DIR) + "/fmnist_vittt_tiny.safetensors";
    models::SamplerConfig sampling;  // --sampler, --steps, --respacing, --eta, --cfg-scale
    int64_t samples_per_class = 100;
    int64_t batch_size = 100;
    int64_t seed = 0;
    std::string dataset = "fashion-mnist";
    std::string data_dir;
    std::string output;
    std::string grid;
    int64_t grid_per_class = 10;
    bool no_progress = false;
    int threads = 0;
    std::string dtype = "f32";
};

// A set of images in [-1, 1] through the classifier: features and logits.
train::ClassifierOutputs classify_diffusion_pixels(models::VisionModel& classifier, const WeightsDescription& described,
                                                   const torch::Tensor& images) {
    const torch::Tensor inputs =
        train::diffusion_pixels_to_classifier_input(images, described.img_size, described.mean, described.std);
    return train::classifier_outputs(classifier, inputs);
}

// One batch holding the whole source (it was built with a batch of its size).
void whole_source(train::BatchSource& source, torch::Tensor& images, torch::Tensor& labels) {
    source.start_epoch(0);
    LINVIS_CHECK(source.next(images, labels), "eval --task diffusion: the data set returned no images");
}

}  // namespace

int run_eval_diffusion(int argc, const char* const* argv) {
    EvalDiffusionOptions o;
    CommandApp app("eval", "Sample --samples-per-class images per class from a class-conditional diffusion model and "
                           "measure them with a classifier trained by linvis: the Frechet distance between the "
                           "classifier's penultimate features of the samples and of as many real test images (FID's "
                           "formula on linvis-classifier features, not Inception FID), the same distance between real "
                           "training and real test images (the floor), and the classifier's top-1 accuracy on the "
                           "samples against the labels they were conditioned on.");
    add_choice(app, "--task", o.task, {"classification", "diffusion", "segmentation"}, "what to evaluate");
    add_model_options(app, o.model, true);
    app.add_option("--classifier", o.classifier, "classifier weights written by 'linvis train' (their metadata names "
                                                 "the model, its normalisation and resolution)")
        ->type_name("FILE");
    add_sampling_options(app, o.sampling);
    add_number(app, "--samples-per-class", o.samples_per_class, "samples of each class (and K x classes real images)",
               int64_t{1});
    add_number(app, "--batch-size", o.batch_size, "samples drawn at once", int64_t{1});
    add_seed_option(app, o.seed);
    add_choice(app, "--dataset", o.dataset, {"fashion-mnist", "cifar10", "cifar100"}, "the real images");
    app.add_option("--data-dir", o.data_dir, "where the data set lives (default: Debian's Fashion-MNIST)")
        ->type_name("DIR");
    app.add_option("--output", o.output, "write the metrics as JSON to this file")->type_name("FILE");
    app.add_option("--grid", o.grid, "write a PNG grid of the samples (one row per class)")->type_name("FILE");
    add_number(app, "--grid-per-class", o.grid_per_class, "samples of each class in the --grid picture", int64_t{1});
    app.add_flag("--no-progress", o.no_progress, "no progress bar");
    add_threads_option(app, o.threads);
    add_network_dtype_option(app, o.dtype);
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(o.threads);
    LINVIS_CHECK(models::generative_model_kind(o.model.model) == "diffusion", "--model: '", o.model.model,
                 "' is not a diffusion model (see 'linvis models')");
    LINVIS_CHECK(o.grid.empty() || ends_with(o.grid, ".png"), "--grid: expected a .png file, got '", o.grid, "'");

    // The classifier: a model trained by linvis, described by its metadata.
    LINVIS_CHECK(ends_with(o.classifier, ".safetensors"), "--classifier ", o.classifier,
                 ": expected a .safetensors file written by 'linvis train'");
    const WeightsDescription described = describe_weights(o.classifier);
    LINVIS_CHECK(!described.model.empty() && !described.mean.empty() && !described.std.empty() && described.img_size > 0,
                 "--classifier ", o.classifier, ": not a classifier written by 'linvis train' (expected metadata "
                 "'model', 'mean', 'std' and 'img_size')");
    ModelOptions classifier_options;
    classifier_options.weights = o.classifier;
    complete_model_options_from_weights(classifier_options);
    LINVIS_CHECK(models::generative_model_kind(classifier_options.model).empty(), "--classifier ", o.classifier,
                 ": names the generative model '", classifier_options.model, "', expected a classifier");
    models::ModelPtr classifier = build_model(classifier_options);
    classifier->eval();

    auto model = std::dynamic_pointer_cast<models::DiffusionModel>(build_generative_model(o.model));
    if (o.dtype == "bf16") model->to(torch::kBFloat16);
    const int64_t C = model->in_channels(), L = model->input_size(), K = model->num_classes();
    LINVIS_CHECK(classifier->num_classes() == K, "--classifier ", o.classifier, ": expected a classifier of ", K,
                 " classes (as ", o.model.model, "), got ", classifier->num_classes());
    LINVIS_CHECK(described.mean.size() == 1 || static_cast<int64_t>(described.mean.size()) == C, "--classifier ",
                 o.classifier, ": normalises ", described.mean.size(), " channels, the diffusion model draws ", C);
    LINVIS_CHECK(o.sampling.cfg_scale == 1.0 || model->has_null_label(), "--cfg-scale ", o.sampling.cfg_scale, ": ",
                 o.model.model,
                 " has no null-label row (class_dropout_prob 0); use --cfg-scale 1");

    // The real images, through the pipeline diffusion training used (28 -> L, [-1, 1]): the first N test
    // images, and the first N training images for the floor.
    const int64_t N = o.samples_per_class * K;
    train::DataConfig data;
    data.dataset = o.dataset;
    data.data_dir = o.data_dir;
    data.img_size = L;
    data.minus_one_to_one = true;
    data.augment = train::DataConfig::Augment::None;
    data.limit_train = data.limit_eval = N;
    data.batch_size = data.eval_batch_size = N;
    data.seed = static_cast<uint64_t>(o.seed);
    train::DataSources sources = train::make_data_sources(data);
    LINVIS_CHECK(sources.in_chans == C && sources.num_classes == K, "--dataset ", o.dataset, ": ", sources.in_chans,
                 " channels and ", sources.num_classes, " classes, ", o.model.model, " has ", C, " and ", K);
    LINVIS_CHECK(sources.eval->num_examples() == N && sources.train->num_examples() == N, "--samples-per-class ",
                 o.samples_per_class, ": needs ", N, " real test images, ", o.dataset, " has ",
                 sources.eval->num_examples());
    torch::Tensor real_test, test_labels, real_train, train_labels;
    whole_source(*sources.eval, real_test, test_labels);
    whole_source(*sources.train, real_train, train_labels);

    // The samples: K per class, classes in order, noise from --seed.
    const models::SamplerConfig& sampler = o.sampling;
    std::vector<int64_t> labels;
    for (int64_t k = 0; k < K; ++k)
        for (int64_t i = 0; i < o.samples_per_class; ++i) labels.push_back(k);
    torch::manual_seed(static_cast<uint64_t>(o.seed));
    std::vector<torch::Tensor> parts;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < N; i += o.batch_size) {
        const int64_t n = std::min(o.batch_size, N - i);
        const std::vector<int64_t> batch_labels(labels.begin() + i, labels.begin() + i + n);
        if (!o.no_progress)
            std::fprintf(stderr, "samples %lld-%lld of %lld\n", static_cast<long long>(i + 1),
                         static_cast<long long>(i + n), static_cast<long long>(N));
        parts.push_back(models::sample_class_conditional(*model, torch::randn({n, C, L, L}), batch_labels, sampler,
                                                         o.no_progress ? models::GaussianDiffusion::Progress{}
                                                                       : sampling_progress_bar()));
    }
    const double sampling_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const torch::Tensor samples = torch::cat(parts, 0).narrow(1, 0, C);  // x_0 (a learned sigma adds C channels)
    const torch::Tensor label_tensor = torch::tensor(labels, torch::kInt64);
    LINVIS_CHECK(torch::isfinite(samples).all().item<bool>(), o.model.model, ": the samples are not finite");

    const train::ClassifierOutputs on_samples = classify_diffusion_pixels(*classifier, described, samples);
    const train::ClassifierOutputs on_test = classify_diffusion_pixels(*classifier, described, real_test);
    const train::ClassifierOutputs on_train = classify_diffusion_pixels(*classifier, described, real_train);
    const double fd = train::frechet_distance(on_samples.features, on_test.features);
    const double fd_floor = train::frechet_distance(on_train.features, on_test.features);
    const double accuracy = train::top1_accuracy(on_samples.logits, label_tensor);
    const double real_accuracy = train::top1_accuracy(on_test.logits, test_labels);
    std::vector<double> per_class;
    for (int64_t k = 0; k < K; ++k)
        per_class.push_back(train::top1_accuracy(on_samples.logits.narrow(0, k * o.samples_per_class, o.samples_per_class),
                                                 label_tensor.narrow(0, k * o.samples_per_class, o.samples_per_class)));

    nlohmann::json result = {{"model", o.model.model},
                             {"weights", o.model.weights},
                             {"classifier", o.classifier},
                             {"classifier_model", classifier_options.model},
                             {"feature_dim", on_samples.features.size(1)},
                             {"sampler", o.sampling.sampler},
                             {"respacing", sampler.respacing_spec()},
                             {"cfg_scale", o.sampling.cfg_scale},
                             {"seed", o.seed},
                             {"dtype", o.dtype},
                             {"samples_per_class", o.samples_per_class},
                             {"samples", N},
                             {"real_images", N},
                             {"frechet_distance", fd},
                             {"frechet_distance_real_train_vs_test", fd_floor},
                             {"classifier_accuracy", accuracy},
                             {"classifier_accuracy_per_class", per_class},
                             {"classifier_accuracy_real_test", real_accuracy},
                             {"sampling_seconds", sampling_seconds}};
    std::printf("%s (%s): %lld samples (%s, respacing %s, cfg %.2f)\n", o.model.model.c_str(), o.model.weights.c_str(),
                static_cast<long long>(N), o.sampling.sampler.c_str(), sampler.respacing_spec().c_str(), o.sampling.cfg_scale);
    std::printf("  Frechet distance on linvis-classifier features (%s, %lld-d; not Inception FID):\n",
                classifier_options.model.c_str(), static_cast<long long>(on_samples.features.size(1)));
    std::printf("    samples vs real test        %10.4f\n", fd);
    std::printf("    real train vs real test     %10.4f  (the floor at %lld images)\n", fd_floor, static_cast<long long>(N));
    std::printf("  classifier top-1 on the samples (vs their conditioning label): %.2f %%\n", accuracy);
    std::printf("  classifier top-1 on the %lld real test images (same resize path): %.2f %%\n",
                static_cast<long long>(N), real_accuracy);
    std::printf("  per class:");
    for (int64_t k = 0; k < K; ++k) std::printf(" %.0f", per_class[static_cast<size_t>(k)]);
    std::printf(" %%\n  sampling: %.1f s\n", sampling_seconds);
    if (!o.output.empty()) {
        io::write_file_atomically(o.output, result.dump(2) + "\n");
        std::printf("wrote %s\n", o.output.c_str());
    }
    if (!o.grid.empty()) {
        const int64_t per_row = std::min(o.grid_per_class, o.samples_per_class);
        std::vector<torch::Tensor> rows;
        std::vector<std::string> captions;
        for (int64_t k = 0; k < K; ++k) {
            rows.push_back(samples.narrow(0, k * o.samples_per_class, per_row));
            const std::string name = k < static_cast<int64_t>(described.classes.size())
                                         ? described.classes[static_cast<size_t>(k)]
                                         : "class " + std::to_string(k);
            for (int64_t i = 0; i < per_row; ++i) captions.push_back(name);
        }
        write_grid(o.grid, torch::cat(rows, 0), captions, per_row);
        std::printf("wrote %s\n", o.grid.c_str());
    }
    return 0;
}

namespace {

CommandRegistrar registrar("sample", "draw class-conditional samples from a diffusion model (DiT, DiT3, DiT5)",
                           run_sample);

}  // namespace
}  // namespace linvis::cli
