// linvis train/eval/predict --task segmentation: a features_only backbone + UperNet (or FPN) head on an
// ADE20K-style folder or on Fashion-MNIST scenes (include/linvis/train/segmentation.h, docs/dense.md).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>

#include <nlohmann/json.hpp>

#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/io/image.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/state_dict.h"
#include "linvis/models/registry.h"
#include "linvis/models/segmentation.h"
#include "linvis/plot/plot.h"
#include "linvis/train/segmentation.h"
#include "launch.h"
#include "segmentation.h"

namespace linvis::cli {

namespace fs = std::filesystem;

namespace {

struct SegDataOptions {
    std::string dataset;
    std::string data_dir = train::kDebianFashionMnistDir;
    int64_t img_size = 512;
    int64_t num_classes = 150;
    bool reduce_zero_label = false;
    int64_t train_scenes = 2000;
    int64_t eval_scenes = 100;
    int64_t eval_limit = 0;
    int threads = 0;
};

void add_seg_data_options(CLI::App& app, SegDataOptions& o) {
    app.add_option("--dataset", o.dataset,
                   "fashion-scenes (generated) | folder:ROOT (ROOT/images/<split>, ROOT/annotations/<split>)")
        ->type_name("NAME")
        ->required();
    app.add_option("--data-dir", o.data_dir, "Fashion-MNIST files for fashion-scenes")->type_name("DIR");
    add_number(app, "--img-size", o.img_size, "fashion-scenes side (256, 512, 1024, ...); folder: training scale",
               int64_t{32});
    add_number(app, "--num-classes", o.num_classes, "folder: classes after reduce_zero_label (ADE20K: 150)",
               int64_t{1});
    app.add_flag("--reduce-zero-label", o.reduce_zero_label, "folder: label 0 is ignored, k -> k-1 (ADE20K)");
    add_number(app, "--train-scenes", o.train_scenes, "fashion-scenes: training scenes", int64_t{1});
    add_number(app, "--eval-scenes", o.eval_scenes, "fashion-scenes: evaluation scenes", int64_t{1});
    add_number(app, "--eval-limit", o.eval_limit, "evaluate on the first N images only (0: all)");
    add_threads_option(app, o.threads);
}

// (train, eval) data sets. Fashion-MNIST scenes: training scenes from the train items (seed), evaluation
// scenes from the t10k items (seed + 1).
std::pair<std::shared_ptr<train::SegmentationDataset>, std::shared_ptr<train::SegmentationDataset>> make_seg_data(
    const SegDataOptions& o, uint64_t seed, bool need_train) {
    if (o.dataset == "fashion-scenes") {
        std::shared_ptr<train::SegmentationDataset> tr;
        if (need_train)
            tr = std::make_shared<train::FashionScenes>(train::load_fashion_mnist(o.data_dir, train::Split::Train),
                                                        o.img_size, o.train_scenes, seed);
        auto ev = std::make_shared<train::FashionScenes>(train::load_fashion_mnist(o.data_dir, train::Split::Test),
                                                         o.img_size, o.eval_scenes, seed + 1);
        return {tr, ev};
    }
    LINVIS_CHECK(o.dataset.rfind("folder:", 0) == 0, "--dataset: expected fashion-scenes or folder:ROOT, got ",
                 o.dataset);
    const std::string root = o.dataset.substr(7);
    std::shared_ptr<train::SegmentationDataset> tr;
    if (need_train) tr = std::make_shared<train::SegmentationFolder>(root, "training", o.num_classes, o.reduce_zero_label);
    auto ev = std::make_shared<train::SegmentationFolder>(root, "validation", o.num_classes, o.reduce_zero_label);
    return {tr, ev};
}

struct SegModelOptions {
    std::string model;
    std::map<std::string, std::string> kwargs;
    std::string head = "upernet";
    int64_t channels = 128;
};

std::map<std::string, std::string> metadata_of(const SegModelOptions& m, int64_t num_classes,
                                               const std::vector<std::string>& class_names) {
    return {{"model", m.model},
            {"class_names", nlohmann::json(class_names).dump()},
            {"task", "segmentation"},
            {"head", m.head},
            {"channels", std::to_string(m.channels)},
            {"num_classes", std::to_string(num_classes)},
            {"model_kwargs", nlohmann::json(m.kwargs).dump()}};
}

models::SegmentationModelPtr build_seg_model(const SegModelOptions& m, int64_t num_classes,
                                             const std::string& backbone_weights) {
    ModelOptions backbone;
    backbone.model = m.model;
    backbone.kwargs = m.kwargs;
    backbone.kwargs["features_only"] = "true";
    backbone.weights = backbone_weights;  // non-strict for features_only backbones, reported on stderr
    models::ModelPtr net = build_model(backbone);
    models::SegmentationConfig sc;
    sc.head = m.head;
    sc.channels = m.channels;
    sc.num_classes = num_classes;
    return std::make_shared<models::SegmentationModel>(net, sc);
}

// A segmentation model from weights saved by train --task segmentation (metadata names the architecture).
models::SegmentationModelPtr load_seg_model(const std::string& weights) {
    io::SafetensorsFile file = io::SafetensorsFile::open(weights);
    const auto& meta = file.metadata();
    auto get = [&](const char* key) {
        auto it = meta.find(key);
        LINVIS_CHECK(it != meta.end(), weights, ": no '", key,
                     "' metadata (not written by 'linvis train --task segmentation')");
        return it->second;
    };
    SegModelOptions m;
    m.model = get("model");
    m.head = get("head");
    m.channels = std::stoll(get("channels"));
    m.kwargs = nlohmann::json::parse(get("model_kwargs")).get<std::map<std::string, std::string>>();
    auto model = build_seg_model(m, std::stoll(get("num_classes")), "");
    io::load_state_dict(*model, file.load_all(), true, weights);
    model->eval();
    return model;
}

void print_result(const train::SegEvalResult& r, const std::vector<std::string>& names) {
    std::printf("mIoU %.2f%%  pixel accuracy %.2f%%  loss %.4f  (%lld images)\n", 100 * r.miou,
                100 * r.pixel_accuracy, r.loss, static_cast<long long>(r.images));
    for (size_t k = 0; k < r.per_class_iou.size(); ++k) {
        const std::string name = k < names.size() ? names[k] : std::to_string(k);
        if (std::isnan(r.per_class_iou[k]))
            std::printf("  %3zu %-14s   absent\n", k, name.c_str());
        else
            std::printf("  %3zu %-14s %6.2f%%\n", k, name.c_str(), 100 * r.per_class_iou[k]);
    }
}

}  // namespace

int run_train_segmentation(int argc, const char* const* argv) {
    SegDataOptions d;
    SegModelOptions m;
    train::SegTrainConfig c;
    std::string task = "segmentation", backbone_weights;
    int64_t seed = 0, crop = 0;
    bool no_progress = false, no_augment = false;
    CommandApp app("train", "Train a segmentation model: a features_only backbone + UperNet/FPN head, AdamW, linear "
                            "warm-up then poly decay, backbone lr multiplier, random scale/crop/flip. Writes "
                            "checkpoint.pt (atomic, --resume), last.safetensors and metrics.jsonl into --output.");
    add_choice(app, "--task", task, {"classification", "segmentation"}, "what to train");
    add_model_option(app, m.model)->required();
    add_model_kwargs_option(app, m.kwargs);
    add_choice(app, "--head", m.head, {"upernet", "fpn"}, "decode head");
    add_number(app, "--channels", m.channels, "decode-head width", int64_t{1});
    app.add_option("--backbone-weights", backbone_weights,
                   "initialise the backbone from a classification or det/seg checkpoint (non-strict, reported)")
        ->type_name("FILE");
    app.add_option("--output", c.output_dir, "output directory")->type_name("DIR")->required();
    add_number(app, "--steps", c.steps, "optimiser steps", int64_t{1});
    add_number(app, "--batch-size", c.batch_size, "images per step (>= 2)", int64_t{2});
    add_number(app, "--crop-size", crop, "training crop (0: --img-size)");
    add_number(app, "--lr", c.lr, "peak learning rate (head; the backbone gets lr * --backbone-lr-mult)");
    add_number(app, "--min-lr", c.min_lr, "final learning rate of the poly decay");
    add_number(app, "--backbone-lr-mult", c.backbone_lr_mult, "backbone learning-rate multiplier (0.1 for pretrained)");
    add_number(app, "--weight-decay", c.weight_decay, "AdamW weight decay");
    add_opt_eps_option(app, c.eps);
    add_number(app, "--warmup-steps", c.warmup_steps, "linear warm-up steps");
    add_number(app, "--clip-grad", c.clip_grad, "clip the global gradient norm (0: off)");
    add_number(app, "--eval-every", c.eval_every, "evaluate every N steps (0: at the end only)");
    add_number(app, "--checkpoint-every", c.checkpoint_every, "write checkpoint.pt every N steps", int64_t{1});
    add_number(app, "--time-budget", c.time_budget_s, "stop training after this many seconds (0: no limit)");
    add_number(app, "--cpu-budget", c.cpu_budget_s,
               "stop training after this many CPU seconds of the process (0: no limit); a budget that a busy "
               "machine does not shrink");
    app.add_flag("--no-augment", no_augment, "no random scale/flip (crop only)");
    add_seed_option(app, seed);
    app.add_flag("--resume", c.resume, "continue from OUTPUT/checkpoint.pt");
    app.add_flag("--no-progress", no_progress, "no per-step progress lines");
    add_seg_data_options(app, d);
    LaunchOptions launch;
    add_launch_options(app, launch);
    if (!parse(app, argc, argv)) return 0;
    c.seed = uint64_t(seed);
    c.progress = !no_progress;
    c.eval_limit = d.eval_limit;
    c.augment.scale = d.img_size;
    c.augment.crop = crop > 0 ? crop : d.img_size;
    if (no_augment) c.augment.min_scale = c.augment.max_scale = 1.0, c.augment.flip = false;
    // The run's identity for --resume: every option but --resume, --no-progress, the launch options and
    // --steps (a run may be lengthened, and continue with another number of processes).
    c.config_json = run_identity(argc, argv, "--steps");
    return run_data_parallel(argc, argv, launch, c.batch_size, d.threads,
                             [&](const std::shared_ptr<train::Distributed>& dist, bool main_rank) {
        c.distributed = dist;
        auto [train_data, eval_data] = make_seg_data(d, c.seed, true);
        torch::manual_seed(c.seed);
        auto model = build_seg_model(m, train_data->num_classes(), backbone_weights);
        model->train();
        if (main_rank) {
            std::cerr << "train: " << train_data->name() << " (" << train_data->size() << "), eval: "
                      << eval_data->name() << " (" << eval_data->size() << ")\n";
            std::cerr << m.model << " + " << m.head << " (" << m.channels << " channels"
                      << (model->plain_backbone() ? ", plain-backbone pyramid neck" : "") << "): "
                      << with_commas(models::count_parameters(*model)) << " parameters";
            if (dist) std::cerr << "; " << dist->world_size() << " processes, " << c.batch_size / dist->world_size()
                                << " images per process and step";
            std::cerr << "\n";
        }
        train::SegmentationTrainer trainer(model, c);
        const auto meta = metadata_of(m, train_data->num_classes(), train_data->class_names());
        trainer.save_weights = [&](const std::string& path, const torch::nn::Module& module) {
            io::save_weights(module, path, meta);
        };
        const train::SegEvalResult r = trainer.fit(*train_data, eval_data.get());
        if (trainer.interrupted()) return 130;
        if (main_rank) {
            std::printf("trained %s + %s for %lld steps on %s\n", m.model.c_str(), m.head.c_str(),
                        static_cast<long long>(trainer.step()), d.dataset.c_str());
            print_result(r, eval_data->class_names());
        }
        return 0;
    });
}

int run_eval_segmentation(int argc, const char* const* argv) {
    SegDataOptions d;
    std::string task = "segmentation", weights, format = "text", export_dir;
    int64_t seed = 0, batch = 2;
    CommandApp app("eval", "mIoU, per-class IoU and pixel accuracy of a segmentation model (weights written by "
                           "'linvis train --task segmentation') on the evaluation split, whole-image inference.");
    add_choice(app, "--task", task, {"classification", "segmentation"}, "what to evaluate");
    app.add_option("--weights", weights, "segmentation weights (.safetensors)")->type_name("FILE");
    app.add_option("--export", export_dir,
                   "instead of evaluating, write the evaluation images and label maps (--eval-limit of them) as "
                   "DIR/images/validation/*.png and DIR/annotations/validation/*.png (the ADE20K layout)")
        ->type_name("DIR");
    add_number(app, "--batch-size", batch, "images per batch", int64_t{1});
    add_seed_option(app, seed);
    add_format_option(app, format);
    add_seg_data_options(app, d);
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(d.threads);
    auto data = make_seg_data(d, uint64_t(seed), false).second;
    if (!export_dir.empty()) {
        const int64_t n = d.eval_limit > 0 ? std::min(d.eval_limit, data->size()) : data->size();
        fs::create_directories(fs::path(export_dir) / "images" / "validation");
        fs::create_directories(fs::path(export_dir) / "annotations" / "validation");
        for (int64_t i = 0; i < n; ++i) {
            const train::SegSample s = data->get(i);
            char stem[32];
            std::snprintf(stem, sizeof(stem), "%06lld.png", static_cast<long long>(i));
            io::write_png((fs::path(export_dir) / "images" / "validation" / stem).string(), s.image);
            io::write_png((fs::path(export_dir) / "annotations" / "validation" / stem).string(),
                          s.label.clamp(0, 255).to(torch::kUInt8));
        }
        std::cerr << "wrote " << n << " images and label maps under " << export_dir << "\n";
        return 0;
    }
    LINVIS_CHECK(!weights.empty(), "--weights is required (unless --export)");
    auto model = load_seg_model(weights);
    const train::SegEvalResult r = train::evaluate_segmentation(*model, *data, batch, d.eval_limit, format == "text");
    if (format == "json") {
        nlohmann::json per_class = nlohmann::json::array();
        for (double v : r.per_class_iou) per_class.push_back(std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v));
        std::cout << nlohmann::json({{"miou", r.miou}, {"pixel_accuracy", r.pixel_accuracy}, {"loss", r.loss},
                                     {"per_class_iou", per_class}, {"images", r.images}, {"dataset", d.dataset}})
                         .dump()
                  << "\n";
    } else {
        print_result(r, data->class_names());
    }
    return 0;
}

int run_predict_segmentation(int argc, const char* const* argv) {
    std::string task = "segmentation", weights, image_path, output;
    double alpha = 0.55;
    int threads = 0;
    CommandApp app("predict", "Segment an image and write it with the predicted mask overlaid (PNG): the input on "
                              "the left, the overlay (background left uncoloured) on the right, a legend below.");
    add_choice(app, "--task", task, {"classification", "segmentation"}, "what to predict");
    app.add_option("--weights", weights, "segmentation weights (.safetensors)")->type_name("FILE")->required();
    app.add_option("--image", image_path, "JPEG, PNG or BMP file")->type_name("FILE")->required();
    app.add_option("--output", output, "overlay PNG")->type_name("FILE")->required();
    add_number(app, "--alpha", alpha, "mask opacity");
    add_threads_option(app, threads);
    if (!parse(app, argc, argv)) return 0;
    runtime::configure_threads(threads);
    auto model = load_seg_model(weights);
    std::vector<std::string> names;
    {
        const auto meta = io::SafetensorsFile::open(weights).metadata();
        if (meta.count("class_names")) names = nlohmann::json::parse(meta.at("class_names")).get<std::vector<std::string>>();
    }
    const torch::Tensor image = io::read_image(image_path);
    torch::Tensor pred;
    {
        const c10::InferenceMode inference;
        pred = model->forward(train::normalize_image(image).unsqueeze(0)).argmax(1)[0].contiguous();
    }
    const int h = int(image.size(0)), w = int(image.size(1));
    const torch::Tensor rgb = image.contiguous();
    plot::Canvas left = plot::Canvas::from_rgb(rgb.data_ptr<uint8_t>(), w, h);
    plot::Canvas right = left;
    const auto* p = pred.data_ptr<int64_t>();
    std::vector<int64_t> counts(size_t(model->config().num_classes), 0);
    for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
            const int64_t k = p[int64_t(y) * w + x];
            ++counts[size_t(k)];
            if (k > 0) right.blend_pixel(x, y, plot::palette(size_t(k - 1)), alpha);
        }
    const int legend = 28;
    plot::Canvas out(2 * w + 10, h + legend, plot::colors::white);
    out.blit(left, 0, 0);
    out.blit(right, w + 10, 0);
    double x = 4;
    for (size_t k = 1; k < counts.size(); ++k) {
        if (counts[k] == 0) continue;
        out.fill_rect({x, double(h) + 8, 12, 12}, plot::palette(k - 1));
        const plot::Rect box = out.draw_text(k < names.size() ? names[k] : "class " + std::to_string(k), x + 16, double(h) + 19, 13, plot::colors::text);
        x = box.right() + 10;
    }
    out.save_png(output);
    std::cerr << "wrote " << output << "\n";
    return 0;
}

}  // namespace linvis::cli
