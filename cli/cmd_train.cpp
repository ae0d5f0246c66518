// linvis train / linvis eval: the papers' training recipe on real images, and evaluation.
#include <cstdio>
#include <filesystem>
#include <iostream>

#include <nlohmann/json.hpp>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/state_dict.h"
#include "linvis/models/deit_t5.h"
#include "linvis/models/registry.h"
#include "linvis/plot/plot.h"
#include "linvis/io/torch_checkpoint.h"
#include "linvis/models/dit.h"
#include "linvis/models/vae.h"
#include "linvis/train/data_sources.h"
#include "linvis/train/distributed.h"
#include "linvis/train/diffusion_trainer.h"
#include "linvis/train/finetune.h"
#include "linvis/train/trainer.h"
#include "generation.h"
#include "launch.h"
#include "segmentation.h"

namespace linvis::cli {
namespace {

namespace fs = std::filesystem;

// Options of train and eval: the data set, threads and autocast. The options write straight into `config`,
// whose defaults are the command line's.
struct DataOptions {
    train::DataConfig config;
    int threads = 0;
    bool bf16 = false;
};

void add_data_options(CLI::App& app, DataOptions& o) {
    app.add_option("--dataset", o.config.dataset,
                   "fashion-mnist | cifar10 | cifar100 | folder:DIR (DIR/train, DIR/val)")
        ->type_name("NAME")
        ->required();
    app.add_option("--data-dir", o.config.data_dir, "where cifar10/cifar100 (or a non-Debian Fashion-MNIST) live")
        ->type_name("DIR");
    add_number(app, "--img-size", o.config.img_size, "input resolution (0: the data set's own, 224 for folders)",
               int64_t{0});
    add_number(app, "--limit-eval", o.config.limit_eval, "evaluate on the first N images only (0: all)");
    add_number(app, "--eval-batch-size", o.config.eval_batch_size, "images per evaluation batch");
    add_number(app, "--workers", o.config.workers, "image decoding threads for folders");
    add_threads_option(app, o.threads);
    app.add_flag("--bf16", o.bf16, "bfloat16 autocast");
}

// Options the model needs to match the data, unless the user set them: classes, channels,
// resolution, and for images of 32 pixels or less a 4x4 patch (a 16x16 patch would leave one token).
std::map<std::string, std::string> model_defaults_for(const train::DataSources& data, const std::string& model) {
    std::map<std::string, std::string> d = {{"num_classes", std::to_string(data.num_classes)},
                                            {"in_chans", std::to_string(data.in_chans)},
                                            {"img_size", std::to_string(data.img_size)}};
    if (data.img_size <= 32 && model.rfind("hvit3", 0) != 0) d["patch_size"] = "4";
    return d;
}

void draw_curves(const std::string& path, const std::string& title, const std::vector<train::EpochRecord>& history) {
    std::vector<double> epochs, train_loss, train_acc, lr, eval_epochs, eval_loss, eval_acc;
    for (const auto& r : history) {
        epochs.push_back(static_cast<double>(r.epoch + 1));
        train_loss.push_back(r.train_loss);
        train_acc.push_back(r.train_acc);
        lr.push_back(r.lr);
        if (!r.has_eval) continue;  // --eval-every > 1: the evaluated epochs are joined
        eval_epochs.push_back(static_cast<double>(r.epoch + 1));
        eval_loss.push_back(r.eval.loss);
        eval_acc.push_back(r.eval.top1);
    }
    plot::Figure figure(1, 3);
    figure.title(title);
    auto& loss = figure.set(0, 0, plot::LineChart());
    loss.title("loss").x_label("epoch").y_label("cross-entropy");
    // The training loss is taken against smoothed (and, with mixup/cutmix, mixed) targets: it cannot reach 0.
    loss.add("train (smoothed targets)", epochs, train_loss).add("eval", eval_epochs, eval_loss);
    auto& acc = figure.set(0, 1, plot::LineChart());
    acc.title("accuracy").x_label("epoch").y_label("%");
    acc.add("train", epochs, train_acc).add("eval top-1", eval_epochs, eval_acc);
    auto& rate = figure.set(0, 2, plot::LineChart());
    rate.title("learning rate (end of epoch)").x_label("epoch").y_label("lr");
    rate.add("lr", epochs, lr);
    figure.save_png(path, 1500, 450);
}

struct TrainOptions {
    std::string model;
    std::map<std::string, std::string> kwargs;
    train::TrainConfig config;  // written by the options, with the command line's defaults
    std::string drop_path = "0.1";  // handed to the model as written
    std::string augment = "full";
    bool no_augment = false;
    int64_t seed = 0;
    std::string init_from;
    double new_lr_mult = 20;
    bool freeze_inherited = false;
    bool no_progress = false;
    LaunchOptions launch;
    DataOptions data;
};

int train_worker(TrainOptions& o, int argc, const char* const* argv, const std::shared_ptr<train::Distributed>& dist,
                 bool main_rank);

// linvis train --task diffusion: the official DiT recipe (models/dit.h, train/diffusion_trainer.h) in pixel space,
// or in the latent space of a VAE encoder (--vae, models/vae.h sd_vae_encoder).
struct DiffusionTrainOptions {
    std::string task = "diffusion";
    std::string model;
    std::map<std::string, std::string> kwargs;
    train::DiffusionTrainConfig config;
    int64_t seed = 0;
    std::string init_from;
    double ttt_lr_scale = 2.0;
    std::string vae;
    std::map<std::string, std::string> vae_kwargs;
    bool no_progress = false;
    LaunchOptions launch;
    DataOptions data;
};

int train_diffusion_worker(DiffusionTrainOptions& o, int argc, const char* const* argv,
                           const std::shared_ptr<train::Distributed>& dist, bool main_rank);

// FNV-1a (64 bit, hex) over the names and float32 bytes of a module's parameters and buffers, in order.
std::string weights_digest(const torch::nn::Module& module) {
    uint64_t h = 1469598103934665603ULL;
    auto feed = [&](const void* data, size_t n) {
        const auto* p = static_cast<const unsigned char*>(data);
        for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
    };
    auto feed_tensor = [&](const std::string& name, const torch::Tensor& t) {
        const torch::Tensor c = t.detach().to(torch::kFloat32).contiguous();
        feed(name.data(), name.size());
        feed(c.data_ptr(), static_cast<size_t>(c.numel()) * sizeof(float));
    };
    for (const auto& p : module.named_parameters(true)) feed_tensor(p.key(), p.value());
    for (const auto& b : module.named_buffers(true)) feed_tensor(b.key(), b.value());
    char text[17];
    std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(h));
    return text;
}

int run_train_diffusion(int argc, const char* const* argv) {
    DiffusionTrainOptions o;
    train::DiffusionTrainConfig& config = o.config;
    o.data.config.batch_size = 64;
    o.data.config.augment = train::DataConfig::Augment::Flip;
    CommandApp app("train", "Train a class-conditional diffusion model (DiT, DiT3, DiT5) with the official DiT recipe: "
                            "images in [-1, 1] with horizontal flips, uniform timesteps, mse + vb loss, AdamW (weight "
                            "decay 0, constant lr), label dropout 0.1, EMA 0.9999. Writes checkpoint.pt, last.safetensors, "
                            "ema.safetensors and metrics.jsonl into --output after every epoch. With --vae the model trains "
                            "on the VAE latents of 8 x input_size px images (latent space, as DiT train.py).");
    add_choice(app, "--task", o.task, {"classification", "diffusion"}, "what to train");
    add_model_option(app, o.model)->required();
    add_model_kwargs_option(app, o.kwargs);
    app.add_option("--output", config.output_dir, "output directory")->type_name("DIR")->required();
    add_number(app, "--epochs", config.epochs, "epochs", int64_t{1});
    add_number(app, "--batch-size", o.data.config.batch_size, "images per batch", int64_t{1});
    add_number(app, "--limit-train", o.data.config.limit_train, "train on the first N images only (0: all)");
    add_number(app, "--lr", config.lr, "AdamW learning rate (constant)", 0.0);
    add_number(app, "--ema-decay", config.ema_decay, "EMA decay of every parameter", 0.0, 1.0);
    add_seed_option(app, o.seed);
    app.add_flag("--resume", config.resume, "continue from OUTPUT/checkpoint.pt at the next epoch");
    app.add_option("--init-from", o.init_from, "DiT5 inheritance: a softmax DiT's weights (safetensors or a train.py "
                                               "checkpoint; its 'model' state dict first, as DiT5/train.py)")
        ->type_name("FILE");
    add_number(app, "--ttt-lr-scale", o.ttt_lr_scale, "with --init-from: lr multiplier of attn.w1 / attn.w2 (official 2.0)",
               0.0);
    app.add_option("--vae", o.vae, "latent-space training as DiT train.py: the AutoencoderKL weights (sd_vae_encoder: "
                                   "the encoder and quant_conv of a full autoencoder file); images of 8 x input_size px "
                                   "become vae.encode(x).latent_dist.sample() * 0.18215")
        ->type_name("FILE");
    add_model_kwargs_option(app, o.vae_kwargs, "--vae-kwargs")
        ->description("options of the VAE (as for sample --vae-kwargs), e.g. block_out_channels=32,32,64,64");
    app.add_flag("--no-progress", o.no_progress, "no progress bar");
    add_launch_options(app, o.launch);
    add_data_options(app, o.data);
    if (!parse(app, argc, argv)) return 0;
    LINVIS_CHECK(!o.vae.empty() || o.vae_kwargs.empty(), "--vae-kwargs needs --vae FILE");
    return run_data_parallel(argc, argv, o.launch, o.data.config.batch_size, o.data.threads,
                             [&](const std::shared_ptr<train::Distributed>& dist, bool main_rank) {
                                 return train_diffusion_worker(o, argc, argv, dist, main_rank);
                             });
}

int train_diffusion_worker(DiffusionTrainOptions& o, int argc, const char* const* argv,
                           const std::shared_ptr<train::Distributed>& dist, bool main_rank) {
    train::DiffusionTrainConfig& config = o.config;
    train::DataConfig& data_config = o.data.config;
    data_config.seed = static_cast<uint64_t>(o.seed);
    data_config.minus_one_to_one = true;
    // Latent space: the frozen VAE encoder; the images are 8 x input_size px (input_size from --model-kwargs
    // when --img-size is not given), the model reads latent_channels.
    models::VaeEncoderPtr vae;
    if (!o.vae.empty()) {
        ModelOptions vae_options;
        vae_options.model = "sd_vae_encoder";
        vae_options.kwargs = o.vae_kwargs;
        vae_options.weights = o.vae;
        vae = std::dynamic_pointer_cast<models::VaeEncoder>(build_generative_model(vae_options));
        const auto given = o.kwargs.find("input_size");
        if (data_config.img_size == 0 && given != o.kwargs.end())
            data_config.img_size = models::ModelConfig(std::map<std::string, std::string>{*given}).get_int("input_size", 0) *
                                   vae->downsampling_factor();
    }
    if (data_config.img_size == 0 && data_config.dataset == "fashion-mnist") data_config.img_size = 32;  // 28 -> 32
    train::DataSources data = train::make_data_sources(data_config);
    if (main_rank) std::cerr << data.description << "\n";

    auto kwargs = o.kwargs;
    kwargs.emplace("num_classes", std::to_string(data.num_classes));
    if (vae) {
        const models::VaeConfig& v = vae->config();
        const int64_t f = vae->downsampling_factor();
        LINVIS_CHECK(data.in_chans == v.in_channels || data.in_chans == 1, "--vae ", o.vae, ": the VAE reads ", v.in_channels,
                     "-channel images, the data set has ", data.in_chans, " channels");
        LINVIS_CHECK(data.img_size % f == 0, "--vae ", o.vae, ": the image size ", data.img_size,
                     " is not a multiple of the VAE's downsampling factor ", f, " (give --img-size ", f, " x input_size)");
        kwargs.emplace("in_channels", std::to_string(v.latent_channels));
        kwargs.emplace("input_size", std::to_string(data.img_size / f));
    } else {
        kwargs.emplace("in_channels", std::to_string(data.in_chans));
        kwargs.emplace("input_size", std::to_string(data.img_size));
    }
    torch::manual_seed(data_config.seed);
    models::DiffusionModelPtr model = models::create_diffusion_model(o.model, models::ModelConfig(kwargs));
    if (vae) {
        const int64_t f = vae->downsampling_factor();
        LINVIS_CHECK(model->in_channels() == vae->config().latent_channels, "--model-kwargs in_channels=",
                     model->in_channels(), ": latent-space training with --vae ", o.vae, " needs the VAE's latent_channels ",
                     vae->config().latent_channels);
        LINVIS_CHECK(model->input_size() * f == data.img_size, "--model-kwargs input_size=", model->input_size(),
                     ": latent-space training with --vae needs images of ", f, " x input_size = ",
                     model->input_size() * f, " px, got ", data.img_size, " (--img-size)");
    }
    if (main_rank) {
        std::cerr << o.model << ": " << with_commas(models::count_parameters(*model)) << " parameters";
        for (const auto& [key, value] : kwargs) std::cerr << " " << key << "=" << value;
        if (dist) std::cerr << "; " << dist->world_size() << " processes, " << data_config.batch_size / dist->world_size()
                            << " images per process and batch";
        std::cerr << "\n";
    }
    if (!o.init_from.empty()) {
        std::map<std::string, torch::Tensor> source;
        if (o.init_from.size() > 12 && o.init_from.substr(o.init_from.size() - 12) == ".safetensors") {
            source = io::SafetensorsFile::open(o.init_from).load_all();
        } else {
            const io::CheckpointContents contents = io::read_torch_checkpoint(o.init_from);
            std::string chosen;
            try {
                source = io::extract_state_dict(contents, false, &chosen);  // 'model', 'state_dict', ... or bare
            } catch (const Error&) {
                source = io::extract_state_dict(contents, true, &chosen);  // only 'ema'
            }
        }
        const train::DitInheritanceReport report = train::inherit_softmax_dit(*model, source);
        LINVIS_CHECK(!report.copied.empty(), "--init-from ", o.init_from, ": no tensor matches ", o.model,
                     " (expected a softmax DiT of the same size)");
        if (main_rank)
            std::cerr << "inherited " << report.copied.size() << " tensors from " << o.init_from << "; "
                  << report.initialised.size() << " keep their initialisation; " << report.skipped.size()
                  << " source tensors skipped\n";
        config.ttt_parameters = train::ttt_fast_weight_parameters(*model);
        config.ttt_lr_scale = o.ttt_lr_scale;
    }
    config.seed = data_config.seed;
    config.progress = !o.no_progress;
    config.distributed = dist;
    // The run's identity for --resume: a run may be extended by more --epochs, and continued with
    // another number of processes.
    config.config_json = run_identity(argc, argv, "--epochs");
    if (vae) {
        // The VAE belongs to the run: its path is in the command line, its encoder weights' digest here.
        nlohmann::json identity = nlohmann::json::parse(config.config_json);
        identity.push_back("vae_encoder_fnv1a=" + weights_digest(*vae));
        config.config_json = identity.dump();
        config.vae = vae;
    }
    train::DiffusionTrainer trainer(model, config);
    if (!trainer.fit(*data.train)) return 130;
    if (!main_rank) return 0;
    if (trainer.history().empty()) {
        std::printf("%s: already trained for %lld epochs (nothing to do)\n", config.output_dir.c_str(),
                    static_cast<long long>(config.epochs));
        return 0;
    }
    const auto& last = trainer.history().back();
    std::printf("trained %s for %lld epochs (%lld steps): loss %.5f (mse %.5f, vb %.5f)\n", o.model.c_str(),
                static_cast<long long>(config.epochs), static_cast<long long>(last.steps), last.loss, last.mse, last.vb);
    std::printf("outputs in %s: ema.safetensors (for sampling), last.safetensors, checkpoint.pt, metrics.jsonl\n",
                config.output_dir.c_str());
    return 0;
}

int run_train(int argc, const char* const* argv) {
    if (task_is(argc, argv, "diffusion")) return run_train_diffusion(argc, argv);
    if (task_is(argc, argv, "segmentation")) return run_train_segmentation(argc, argv);
    TrainOptions o;
    std::string task = "classification";
    train::TrainConfig& config = o.config;
    CommandApp app("train", "Train a model with the DeiT recipe (AdamW, cosine schedule with warm-up, label "
                            "smoothing, mixup/cutmix, drop path, EMA) on Fashion-MNIST, CIFAR or an ImageFolder "
                            "tree. Writes checkpoint.pt every epoch (atomically), best/last weights as safetensors, "
                            "metrics.jsonl and curves.png into --output.");
    add_choice(app, "--task", task, {"classification", "diffusion", "segmentation"},
               "what to train (see 'linvis train --task diffusion|segmentation --help')");
    add_model_option(app, o.model)->required();
    add_model_kwargs_option(app, o.kwargs);
    app.add_option("--output", config.output_dir, "output directory")->type_name("DIR")->required();
    add_number(app, "--epochs", config.epochs, "epochs");
    add_number(app, "--batch-size", o.data.config.batch_size, "images per batch");
    add_number(app, "--accum-steps", config.accumulation_steps,
               "gradient accumulation: optimiser step every N batches");
    add_number(app, "--limit-train", o.data.config.limit_train, "train on the first N images only (0: all)");
    add_number(app, "--lr", config.optimizer.lr, "peak learning rate");
    add_number(app, "--min-lr", config.min_lr, "final learning rate");
    add_number(app, "--warmup-lr", config.warmup_lr, "learning rate at the start of warm-up");
    add_number(app, "--warmup-epochs", config.warmup_epochs, "linear warm-up length");
    add_number(app, "--weight-decay", config.optimizer.weight_decay,
               "AdamW weight decay (norms, biases, position embeddings excluded)");
    add_opt_eps_option(app, config.optimizer.eps);
    add_number(app, "--smoothing", config.mixup.label_smoothing, "label smoothing");
    add_number(app, "--mixup", config.mixup.mixup_alpha, "mixup alpha (0: off)");
    add_number(app, "--cutmix", config.mixup.cutmix_alpha, "cutmix alpha (0: off)");
    add_number(app, "--mixup-prob", config.mixup.prob, "probability of mixing a batch");
    add_number(app, "--mixup-switch-prob", config.mixup.switch_prob, "probability of cutmix when both are on");
    app.add_option("--drop-path", o.drop_path, "stochastic depth rate (model option drop_path_rate)")
        ->type_name("FLOAT")
        ->check(real_check("--drop-path"));  // checked, not rewritten: check() hands the check a copy
    add_number(app, "--clip-grad", config.clip_grad, "clip the global gradient norm (0: off)");
    add_number(app, "--ema-decay", config.ema_decay, "EMA of the weights (0: off; DeiT uses 0.99996)");
    add_choice(app, "--augment", o.augment, {"full", "flip", "none"},
               "full: random crop + flip (DeiT recipe for folders) | flip: horizontal flip only | none");
    app.add_flag("--no-augment", o.no_augment, "same as --augment none");
    add_number(app, "--eval-every", config.eval_every, "evaluate after every N-th epoch (and always after the last)");
    add_seed_option(app, o.seed);
    app.add_flag("--resume", config.resume, "continue from OUTPUT/checkpoint.pt exactly where it stopped");
    app.add_option("--init-from", o.init_from, "inherit every tensor whose name and shape match (T5 conversion)")
        ->type_name("FILE");
    add_number(app, "--new-lr-mult", o.new_lr_mult, "lr multiplier of parameters not inherited with --init-from");
    app.add_flag("--freeze-inherited", o.freeze_inherited, "train only the parameters not inherited with --init-from");
    app.add_flag("--no-progress", o.no_progress, "no progress bar");
    add_launch_options(app, o.launch);
    add_data_options(app, o.data);
    if (!parse(app, argc, argv)) return 0;
    return run_data_parallel(argc, argv, o.launch, o.data.config.batch_size, o.data.threads,
                             [&](const std::shared_ptr<train::Distributed>& dist, bool main_rank) {
                                 return train_worker(o, argc, argv, dist, main_rank);
                             });
}

int train_worker(TrainOptions& o, int argc, const char* const* argv, const std::shared_ptr<train::Distributed>& dist,
                 bool main_rank) {
    train::TrainConfig& config = o.config;

    train::DataConfig& data_config = o.data.config;
    data_config.seed = static_cast<uint64_t>(o.seed);
    data_config.augment = o.no_augment ? train::DataConfig::Augment::None : train::parse_augment(o.augment);
    train::DataSources data = train::make_data_sources(data_config);
    if (main_rank) std::cerr << data.description << "\n";

    auto kwargs = o.kwargs;
    for (const auto& [key, value] : model_defaults_for(data, o.model)) kwargs.emplace(key, value);
    kwargs.emplace("drop_path_rate", o.drop_path);
    torch::manual_seed(data_config.seed);
    models::ModelPtr model = models::create_model(o.model, models::ModelConfig(kwargs));
    if (main_rank) {
        std::cerr << o.model << ": " << with_commas(models::count_parameters(*model)) << " parameters";
        for (const auto& [key, value] : kwargs) std::cerr << " " << key << "=" << value;
        if (dist) std::cerr << "; " << dist->world_size() << " processes, " << o.data.config.batch_size / dist->world_size()
                            << " images per process and batch";
        std::cerr << "\n";
    }

    config.bf16 = o.data.bf16;
    config.seed = data_config.seed;
    config.progress = !o.no_progress;
    config.log_epochs = main_rank;
    config.distributed = dist;

    if (!o.init_from.empty()) {
        // T5 protocol: inherit the softmax model's weights, train the new parameters faster.
        const auto weights = io::SafetensorsFile::open(o.init_from).load_all();
        const train::InheritanceReport report = train::inherit_weights(*model, weights);
        if (main_rank) std::cerr << train::describe(report);
        config.optimizer.boosted_parameters.insert(report.new_parameters.begin(), report.new_parameters.end());
        for (const auto& mismatch : report.shape_mismatch)
            config.optimizer.boosted_parameters.insert(mismatch.substr(0, mismatch.find(':')));
        config.optimizer.lr_multiplier = o.new_lr_mult;
        config.optimizer.train_only_boosted = o.freeze_inherited;
        if (data.eval && main_rank) {
            const train::EvalResult before = train::evaluate(*model, *data.eval, config.bf16);
            std::cerr << "converted model before fine-tuning: top-1 " << before.top1 << "%, top-5 " << before.top5
                      << "%, loss " << before.loss << "\n";
        }
    }
    config.config_json = run_identity(argc, argv);

    train::Trainer trainer(model, config);
    // The weights describe themselves (model_metadata in common.h): 'linvis predict --weights FILE IMAGE'
    // rebuilds the model, its input transform and its class names from them.
    std::map<std::string, std::string> model_kwargs = kwargs;
    model_kwargs.erase("drop_path_rate");  // training only
    const std::map<std::string, std::string> metadata =
        model_metadata(o.model, model_kwargs, data.class_names, data.mean, data.std, data.img_size, o.data.config.dataset);
    trainer.save_weights = [&](const std::string& path, const torch::nn::Module& module) {
        io::save_weights(module, path, metadata);
    };
    const std::string curves = (fs::path(config.output_dir) / "curves.png").string();
    const std::string title = "linvis train: " + o.model + " on " + o.data.config.dataset;
    trainer.on_epoch_end = [&](const std::vector<train::EpochRecord>& history) {
        draw_curves(curves, title, history);
    };
    const bool finished = trainer.fit(*data.train, data.eval.get());
    if (!finished) return 130;
    if (!main_rank) return 0;
    const auto& last = trainer.history().back();
    std::printf("trained %s for %lld epochs: ", o.model.c_str(), static_cast<long long>(config.epochs));
    if (last.has_eval) std::printf("test top-1 %.2f%%, top-5 %.2f%%, loss %.4f", last.eval.top1, last.eval.top5, last.eval.loss);
    if (last.has_eval_ema) std::printf(" (EMA top-1 %.2f%%)", last.eval_ema.top1);
    std::printf("\noutputs in %s: best.safetensors, last.safetensors, checkpoint.pt, metrics.jsonl, curves.png\n",
                config.output_dir.c_str());
    return 0;
}

struct EvalOptions {
    ModelOptions model;
    DataOptions data;
    std::string format = "text";
};

int run_eval(int argc, const char* const* argv) {
    if (task_is(argc, argv, "segmentation")) return run_eval_segmentation(argc, argv);
    if (task_is(argc, argv, "diffusion")) return run_eval_diffusion(argc, argv);
    EvalOptions o;
    CommandApp app("eval", "Top-1/top-5 accuracy and cross-entropy of a model on a data set's evaluation split. With "
                           "--format json the last line is a JSON object with top1, top5, loss and images.");
    add_model_options(app, o.model, true);
    add_data_options(app, o.data);
    add_format_option(app, o.format);
    if (!parse(app, argc, argv)) return 0;
    const std::string& format = o.format;
    runtime::configure_threads(o.data.threads);
    train::DataSources data = train::make_data_sources(o.data.config, false);
    if (format == "text") std::cerr << data.description << "\n";
    models::ModelPtr model = build_model(o.model, model_defaults_for(data, o.model.model));
    const train::EvalResult result = train::evaluate(*model, *data.eval, o.data.bf16, format == "text");
    if (format == "json") {
        std::cout << nlohmann::json({{"model", o.model.model}, {"dataset", o.data.config.dataset},
                                     {"top1", result.top1}, {"top5", result.top5}, {"loss", result.loss},
                                     {"images", result.images}, {"skipped_images", result.skipped_images}})
                         .dump()
                  << "\n";
    } else {
        std::printf("%s on %s: top-1 %.2f%%  top-5 %.2f%%  loss %.4f  (%lld images)\n", o.model.model.c_str(),
                    o.data.config.dataset.c_str(), result.top1, result.top5, result.loss,
                    static_cast<long long>(result.images));
    }
    return 0;
}

CommandRegistrar train_registrar("train", "train a model (DeiT recipe) on Fashion-MNIST, CIFAR or an image folder",
                                 run_train);
CommandRegistrar eval_registrar("eval", "top-1/top-5 accuracy of a model on a data set", run_eval);

}  // namespace
}  // namespace linvis::cli
