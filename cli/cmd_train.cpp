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
#include "linvis/tools/plot.h"
#include "linvis/train/data_sources.h"
#include "linvis/train/finetune.h"
#include "linvis/train/trainer.h"

namespace linvis::cli {
namespace {

namespace fs = std::filesystem;

void add_data_options(tools::ArgParser& args) {
    args.option("--dataset", "NAME", "fashion-mnist | cifar10 | cifar100 | folder:DIR (DIR/train, DIR/val)", "", true)
        .option("--data-dir", "DIR", "where cifar10/cifar100 (or a non-Debian Fashion-MNIST) live", "")
        .option("--img-size", "N", "input resolution (default: the data set's own, 224 for folders)", "0")
        .option("--limit-eval", "N", "evaluate on the first N images only (0: all)", "0")
        .option("--eval-batch-size", "N", "images per evaluation batch", "256")
        .option("--workers", "N", "image decoding threads for folders", "2")
        .option("--threads", "N", "threads for LibTorch and BLAS (0: all cores)", "0");
}

train::DataConfig data_config_from(const tools::ArgParser& args) {
    train::DataConfig c;
    c.dataset = args.get("--dataset");
    c.data_dir = args.get("--data-dir");
    c.img_size = args.get_int("--img-size");
    c.limit_eval = args.get_int("--limit-eval");
    c.eval_batch_size = args.get_int("--eval-batch-size");
    c.workers = static_cast<int>(args.get_int("--workers"));
    return c;
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
    namespace plot = tools::plot;
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

int run_train(int argc, const char* const* argv) {
    tools::ArgParser args("train", "Train a model with the DeiT recipe (AdamW, cosine schedule with warm-up, label "
                                   "smoothing, mixup/cutmix, drop path, EMA) on Fashion-MNIST, CIFAR or an "
                                   "ImageFolder tree. Writes checkpoint.pt every epoch (atomically), best/last "
                                   "weights as safetensors, metrics.jsonl and curves.png into --output.");
    args.option("--model", "NAME", "model name (see 'linvis models')", "", true)
        .multi_option("--model-kwargs", "K=V", "model options, e.g. depth=6 embed_dim=128 patch_size=2")
        .option("--output", "DIR", "output directory", "", true)
        .option("--epochs", "N", "epochs", "10")
        .option("--batch-size", "N", "images per batch", "128")
        .option("--accum-steps", "N", "gradient accumulation: optimiser step every N batches", "1")
        .option("--limit-train", "N", "train on the first N images only (0: all)", "0")
        .option("--lr", "F", "peak learning rate", "5e-4")
        .option("--min-lr", "F", "final learning rate", "1e-5")
        .option("--warmup-lr", "F", "learning rate at the start of warm-up", "1e-6")
        .option("--warmup-epochs", "F", "linear warm-up length", "1")
        .option("--weight-decay", "F", "AdamW weight decay (norms, biases, position embeddings excluded)", "0.05")
        .option("--smoothing", "F", "label smoothing", "0.1")
        .option("--mixup", "F", "mixup alpha (0: off)", "0.8")
        .option("--cutmix", "F", "cutmix alpha (0: off)", "1.0")
        .option("--mixup-prob", "F", "probability of mixing a batch", "1.0")
        .option("--mixup-switch-prob", "F", "probability of cutmix when both are on", "0.5")
        .option("--drop-path", "F", "stochastic depth rate (model option drop_path_rate)", "0.1")
        .option("--clip-grad", "F", "clip the global gradient norm (0: off)", "0")
        .option("--ema-decay", "F", "EMA of the weights (0: off; DeiT uses 0.99996)", "0")
        .option("--augment", "MODE", "full: random crop + flip (DeiT recipe for folders) | flip: horizontal flip only | none",
                "full")
        .flag("--no-augment", "same as --augment none")
        .option("--eval-every", "N", "evaluate after every N-th epoch (and always after the last)", "1")
        .flag("--bf16", "bfloat16 autocast")
        .option("--seed", "N", "seed of initialisation, data order and augmentation", "0")
        .flag("--resume", "continue from OUTPUT/checkpoint.pt exactly where it stopped")
        .option("--init-from", "FILE", "inherit every tensor whose name and shape match (T5 conversion)", "")
        .option("--new-lr-mult", "F", "lr multiplier of parameters not inherited with --init-from", "20")
        .flag("--freeze-inherited", "train only the parameters not inherited with --init-from")
        .flag("--no-progress", "no progress bar");
    add_data_options(args);
    if (!args.parse(argc, argv, 1)) return 0;
    runtime::configure_threads(static_cast<int>(args.get_int("--threads")));

    train::DataConfig data_config = data_config_from(args);
    data_config.batch_size = args.get_int("--batch-size");
    data_config.limit_train = args.get_int("--limit-train");
    data_config.seed = static_cast<uint64_t>(args.get_int("--seed"));
    data_config.augment =
        args.get_flag("--no-augment") ? train::DataConfig::Augment::None : train::parse_augment(args.get("--augment"));
    train::DataSources data = train::make_data_sources(data_config);
    std::cerr << data.description << "\n";

    auto kwargs = tools::parse_key_values(args.get_all("--model-kwargs"), "--model-kwargs");
    for (const auto& [key, value] : model_defaults_for(data, args.get("--model"))) kwargs.emplace(key, value);
    kwargs.emplace("drop_path_rate", args.get("--drop-path"));
    torch::manual_seed(data_config.seed);
    models::ModelPtr model = models::create_model(args.get("--model"), models::ModelConfig(kwargs));
    std::cerr << args.get("--model") << ": " << with_commas(models::count_parameters(*model)) << " parameters";
    for (const auto& [key, value] : kwargs) std::cerr << " " << key << "=" << value;
    std::cerr << "\n";

    train::TrainConfig config;
    config.epochs = args.get_int("--epochs");
    config.accumulation_steps = args.get_int("--accum-steps");
    config.optimizer.lr = args.get_double("--lr");
    config.optimizer.weight_decay = args.get_double("--weight-decay");
    config.min_lr = args.get_double("--min-lr");
    config.warmup_lr = args.get_double("--warmup-lr");
    config.warmup_epochs = args.get_double("--warmup-epochs");
    config.clip_grad = args.get_double("--clip-grad");
    config.ema_decay = args.get_double("--ema-decay");
    config.eval_every = args.get_int("--eval-every");
    config.mixup.mixup_alpha = args.get_double("--mixup");
    config.mixup.cutmix_alpha = args.get_double("--cutmix");
    config.mixup.prob = args.get_double("--mixup-prob");
    config.mixup.switch_prob = args.get_double("--mixup-switch-prob");
    config.mixup.label_smoothing = args.get_double("--smoothing");
    config.bf16 = args.get_flag("--bf16");
    config.seed = data_config.seed;
    config.output_dir = args.get("--output");
    config.resume = args.get_flag("--resume");
    config.progress = !args.get_flag("--no-progress");

    if (!args.get("--init-from").empty()) {
        // T5 protocol: inherit the softmax model's weights, train the new parameters faster.
        const auto weights = io::SafetensorsFile::open(args.get("--init-from")).load_all();
        const train::InheritanceReport report = train::inherit_weights(*model, weights);
        std::cerr << train::describe(report);
        config.optimizer.boosted_parameters.insert(report.new_parameters.begin(), report.new_parameters.end());
        for (const auto& mismatch : report.shape_mismatch)
            config.optimizer.boosted_parameters.insert(mismatch.substr(0, mismatch.find(':')));
        config.optimizer.lr_multiplier = args.get_double("--new-lr-mult");
        config.optimizer.train_only_boosted = args.get_flag("--freeze-inherited");
        if (data.eval) {
            const train::EvalResult before = train::evaluate(*model, *data.eval, config.bf16);
            std::cerr << "converted model before fine-tuning: top-1 " << before.top1 << "%, top-5 " << before.top5
                      << "%, loss " << before.loss << "\n";
        }
    }
    nlohmann::json run_config;
    for (const auto& token : std::vector<std::string>(argv + 1, argv + argc))
        if (token != "--resume" && token != "--no-progress") run_config.push_back(token);
    config.config_json = run_config.dump();

    train::Trainer trainer(model, config);
    trainer.save_weights = [&](const std::string& path, const torch::nn::Module& module) {
        io::save_weights(module, path, {{"model", args.get("--model")}});
    };
    const std::string curves = (fs::path(config.output_dir) / "curves.png").string();
    const std::string title = "linvis train: " + args.get("--model") + " on " + args.get("--dataset");
    trainer.on_epoch_end = [&](const std::vector<train::EpochRecord>& history) {
        draw_curves(curves, title, history);
    };
    const bool finished = trainer.fit(*data.train, data.eval.get());
    if (!finished) return 130;
    const auto& last = trainer.history().back();
    std::printf("trained %s for %lld epochs: ", args.get("--model").c_str(), static_cast<long long>(config.epochs));
    if (last.has_eval) std::printf("test top-1 %.2f%%, top-5 %.2f%%, loss %.4f", last.eval.top1, last.eval.top5, last.eval.loss);
    if (last.has_eval_ema) std::printf(" (EMA top-1 %.2f%%)", last.eval_ema.top1);
    std::printf("\noutputs in %s: best.safetensors, last.safetensors, checkpoint.pt, metrics.jsonl, curves.png\n",
                config.output_dir.c_str());
    return 0;
}

int run_eval(int argc, const char* const* argv) {
    tools::ArgParser args("eval", "Top-1/top-5 accuracy and cross-entropy of a model on a data set's evaluation "
                                  "split. With --format json the last line is a JSON object with top1, top5, "
                                  "loss and images.");
    add_model_options(args, true);
    add_data_options(args);
    args.option("--format", "text|json", "output format", "text").flag("--bf16", "bfloat16 autocast");
    if (!args.parse(argc, argv, 1)) return 0;
    const std::string format = args.get("--format");
    LINVIS_CHECK(format == "text" || format == "json", "--format must be text or json, got '", format, "'");
    runtime::configure_threads(static_cast<int>(args.get_int("--threads")));
    train::DataSources data = train::make_data_sources(data_config_from(args), false);
    if (format == "text") std::cerr << data.description << "\n";
    models::ModelPtr model = build_model_from_args(args, model_defaults_for(data, args.get("--model")));
    const train::EvalResult result = train::evaluate(*model, *data.eval, args.get_flag("--bf16"), format == "text");
    if (format == "json") {
        std::cout << nlohmann::json({{"model", args.get("--model")}, {"dataset", args.get("--dataset")},
                                     {"top1", result.top1}, {"top5", result.top5}, {"loss", result.loss},
                                     {"images", result.images}, {"skipped_images", result.skipped_images}})
                         .dump()
                  << "\n";
    } else {
        std::printf("%s on %s: top-1 %.2f%%  top-5 %.2f%%  loss %.4f  (%lld images)\n", args.get("--model").c_str(),
                    args.get("--dataset").c_str(), result.top1, result.top5, result.loss,
                    static_cast<long long>(result.images));
    }
    return 0;
}

CommandRegistrar train_registrar("train", "train a model (DeiT recipe) on Fashion-MNIST, CIFAR or an image folder",
                                 run_train);
CommandRegistrar eval_registrar("eval", "top-1/top-5 accuracy of a model on a data set", run_eval);

}  // namespace
}  // namespace linvis::cli
