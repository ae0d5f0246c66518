// Segmentation data sets, augmentation, metrics and the training loop (include/linvis/train/segmentation.h).
#include "linvis/train/segmentation.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/io/atomic_file.h"
#include "linvis/io/image.h"
#include "linvis/train/checkpoint.h"
#include "linvis/train/optim.h"
#include "linvis/train/trainer.h"

namespace linvis::train {
namespace {

namespace fs = std::filesystem;
namespace F = torch::nn::functional;

bool is_image_file(const fs::path& p) {
    std::string ext = p.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    return ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".bmp";
}

const char* const kFashionNames[] = {"background", "t-shirt/top", "trouser", "pullover", "dress", "coat",
                                     "sandal",     "shirt",       "sneaker", "bag",      "ankle boot"};

torch::Tensor resize_float(const torch::Tensor& x_nchw, int64_t h, int64_t w, bool nearest) {
    auto options = F::InterpolateFuncOptions().size(std::vector<int64_t>{h, w});
    if (nearest) return F::interpolate(x_nchw, options.mode(torch::kNearest));
    return F::interpolate(x_nchw, options.mode(torch::kBilinear).align_corners(false));
}

}  // namespace

// ---------------------------------------------------------------- folder

SegmentationFolder::SegmentationFolder(const std::string& root, const std::string& split, int64_t num_classes,
                                       bool reduce_zero_label)
    : root_(root), split_(split), num_classes_(num_classes), reduce_zero_label_(reduce_zero_label) {
    LINVIS_CHECK(num_classes > 0 && num_classes <= kIgnoreIndex, root,
                 ": num_classes must be in [1, 255], got ", num_classes);
    const fs::path image_dir = fs::path(root) / "images" / split;
    const fs::path label_dir = fs::path(root) / "annotations" / split;
    LINVIS_CHECK(fs::is_directory(image_dir), image_dir.string(), ": no such directory (expected ROOT/images/",
                 split, " and ROOT/annotations/", split, ")");
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(image_dir))
        if (entry.is_regular_file() && is_image_file(entry.path())) files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    LINVIS_CHECK(!files.empty(), image_dir.string(), ": no image files (.jpg, .jpeg, .png, .bmp)");
    for (const auto& f : files) {
        const fs::path label = label_dir / (f.stem().string() + ".png");
        LINVIS_CHECK(fs::is_regular_file(label), label.string(), ": missing label map for ", f.string());
        images_.push_back(f.string());
        labels_.push_back(label.string());
    }
}

std::vector<std::string> SegmentationFolder::class_names() const {
    std::vector<std::string> names;
    for (int64_t i = 0; i < num_classes_; ++i) names.push_back(std::to_string(i));
    return names;
}

SegSample SegmentationFolder::get(int64_t index) const {
    LINVIS_CHECK(index >= 0 && index < size(), name(), ": index ", index, " out of range [0, ", size(), ")");
    const std::string& image_path = images_[size_t(index)];
    const std::string& label_path = labels_[size_t(index)];
    SegSample s;
    s.image = io::read_image(image_path);
    // A single-channel PNG decodes to three equal channels: its grey value is the class id.
    const torch::Tensor raw = io::read_image(label_path);
    LINVIS_CHECK(raw.size(0) == s.image.size(0) && raw.size(1) == s.image.size(1), label_path,
                 ": label map is ", raw.size(1), "x", raw.size(0), " but its image ", image_path, " is ",
                 s.image.size(1), "x", s.image.size(0));
    torch::Tensor label = raw.select(2, 0).to(torch::kInt64);
    if (reduce_zero_label_) {  // mmseg: 0 -> 255, k -> k - 1, 255 stays 255
        label = label - 1;
        label.masked_fill_(label < 0, kIgnoreIndex);
        label.masked_fill_(label == kIgnoreIndex - 1, kIgnoreIndex);
    }
    const torch::Tensor bad = (label >= num_classes_) & (label != kIgnoreIndex);
    if (bad.any().item<bool>()) {
        const int64_t value = label.masked_select(bad)[0].item<int64_t>();
        fail(label_path, ": class id ", value, " outside [0, ", num_classes_, ") and not the ignore index ",
             kIgnoreIndex, reduce_zero_label_ ? " (after reduce_zero_label)" : "");
    }
    s.label = label.contiguous();
    return s;
}

// ---------------------------------------------------------------- Fashion-MNIST scenes

SegSample make_fashion_scene(const InMemoryDataset& items, int64_t size, uint64_t seed, int64_t index) {
    LINVIS_CHECK(size >= 32, "fashion-scenes: size must be >= 32, got ", size);
    std::mt19937_64 rng(sample_seed(seed, 0, index));
    auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
    auto uniform_int = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };

    // Background: a dim smooth colour gradient plus low-amplitude noise, all below the item threshold.
    torch::Tensor image = torch::empty({size, size, 3}, torch::kFloat32);
    {
        const float base[3] = {float(uniform(0, 40)), float(uniform(0, 40)), float(uniform(0, 40))};
        const float gx = float(uniform(-20, 20)), gy = float(uniform(-20, 20));
        auto yy = torch::linspace(0, 1, size).view({size, 1});
        auto xx = torch::linspace(0, 1, size).view({1, size});
        torch::Generator gen = at::detail::createCPUGenerator(rng());
        for (int c = 0; c < 3; ++c)
            image.select(2, c).copy_(base[c] + gx * xx + gy * yy + torch::rand({size, size}, gen) * 15.0f);
    }
    torch::Tensor label = torch::zeros({size, size}, torch::kInt64);
    const int64_t n_items = uniform_int(8, 16);
    const torch::Tensor& pool = items.images();   // (N, 28, 28, 1)
    const torch::Tensor& classes = items.labels();
    for (int64_t k = 0; k < n_items; ++k) {
        const int64_t item = uniform_int(0, items.size() - 1);
        const int64_t side = std::max<int64_t>(8, int64_t(std::lround(28.0 * uniform(1.0, 2.0) * double(size) / 256.0)));
        const int64_t y0 = uniform_int(-side / 4, size - side + side / 4);
        const int64_t x0 = uniform_int(-side / 4, size - side + side / 4);
        const float tint[3] = {float(uniform(0.35, 1.0)), float(uniform(0.35, 1.0)), float(uniform(0.35, 1.0))};
        torch::Tensor glyph = pool[item].permute({2, 0, 1}).unsqueeze(0).to(torch::kFloat32);  // (1, 1, 28, 28)
        glyph = resize_float(glyph, side, side, true)[0][0];                                     // (side, side)
        const int64_t cls = classes[item].item<int64_t>() + 1;
        // Clip to the canvas.
        const int64_t ya = std::max<int64_t>(0, y0), yb = std::min<int64_t>(size, y0 + side);
        const int64_t xa = std::max<int64_t>(0, x0), xb = std::min<int64_t>(size, x0 + side);
        if (ya >= yb || xa >= xb) continue;
        torch::Tensor g = glyph.slice(0, ya - y0, yb - y0).slice(1, xa - x0, xb - x0);
        torch::Tensor mask = g > 40.0f;
        torch::Tensor region = image.slice(0, ya, yb).slice(1, xa, xb);
        for (int c = 0; c < 3; ++c) {
            torch::Tensor ch = region.select(2, c);
            ch.copy_(torch::where(mask, g * tint[c], ch));
        }
        torch::Tensor lregion = label.slice(0, ya, yb).slice(1, xa, xb);
        lregion.masked_fill_(mask, cls);
    }
    return {image.round().clamp(0, 255).to(torch::kUInt8).contiguous(), label};
}

FashionScenes::FashionScenes(std::shared_ptr<InMemoryDataset> items, int64_t size, int64_t count, uint64_t seed)
    : items_(std::move(items)), size_(size), count_(count), seed_(seed) {
    LINVIS_CHECK(items_ != nullptr && items_->size() > 0, "fashion-scenes: no Fashion-MNIST items");
    LINVIS_CHECK(count > 0, "fashion-scenes: count must be > 0, got ", count);
    LINVIS_CHECK(size >= 32, "fashion-scenes: size must be >= 32, got ", size);
}

std::string FashionScenes::name() const {
    return "fashion-scenes " + std::to_string(size_) + "px x " + std::to_string(count_) + " (seed " +
           std::to_string(seed_) + ")";
}

std::vector<std::string> FashionScenes::class_names() const {
    return std::vector<std::string>(std::begin(kFashionNames), std::end(kFashionNames));
}

SegSample FashionScenes::get(int64_t index) const {
    LINVIS_CHECK(index >= 0 && index < count_, name(), ": index ", index, " out of range [0, ", count_, ")");
    return make_fashion_scene(*items_, size_, seed_, index);
}

// ---------------------------------------------------------------- augmentation

SegSample augment_sample(const SegSample& sample, const SegAugment& a, std::mt19937_64& rng) {
    const int64_t h = sample.image.size(0), w = sample.image.size(1);
    const double ratio = std::uniform_real_distribution<double>(a.min_scale, a.max_scale)(rng);
    const double factor = double(a.scale) * ratio / double(std::max(h, w));
    const int64_t nh = std::max<int64_t>(1, std::lround(h * factor)), nw = std::max<int64_t>(1, std::lround(w * factor));
    torch::Tensor image = resize_float(sample.image.permute({2, 0, 1}).unsqueeze(0).to(torch::kFloat32), nh, nw, false)[0];
    torch::Tensor label = resize_float(sample.label.unsqueeze(0).unsqueeze(0).to(torch::kFloat32), nh, nw, true)[0][0];
    // Pad to at least crop x crop, then crop.
    const int64_t ph = std::max<int64_t>(a.crop, nh), pw = std::max<int64_t>(a.crop, nw);
    if (ph != nh || pw != nw) {
        image = F::pad(image, F::PadFuncOptions({0, pw - nw, 0, ph - nh}));
        label = F::pad(label.unsqueeze(0), F::PadFuncOptions({0, pw - nw, 0, ph - nh}).value(double(kIgnoreIndex)))[0];
    }
    const int64_t y = std::uniform_int_distribution<int64_t>(0, ph - a.crop)(rng);
    const int64_t x = std::uniform_int_distribution<int64_t>(0, pw - a.crop)(rng);
    image = image.slice(1, y, y + a.crop).slice(2, x, x + a.crop);
    label = label.slice(0, y, y + a.crop).slice(1, x, x + a.crop);
    if (a.flip && std::bernoulli_distribution(0.5)(rng)) {
        image = image.flip({2});
        label = label.flip({1});
    }
    return {image.round().clamp(0, 255).to(torch::kUInt8).permute({1, 2, 0}).contiguous(),
            label.to(torch::kInt64).contiguous()};
}

torch::Tensor normalize_image(const torch::Tensor& image_hwc) {
    const auto mean = torch::tensor({0.485f, 0.456f, 0.406f}).view({3, 1, 1});
    const auto std = torch::tensor({0.229f, 0.224f, 0.225f}).view({3, 1, 1});
    return (image_hwc.permute({2, 0, 1}).to(torch::kFloat32) / 255.0f - mean) / std;
}

// ---------------------------------------------------------------- metrics

SegmentationMetrics::SegmentationMetrics(int64_t num_classes, int64_t ignore_index)
    : num_classes_(num_classes), ignore_index_(ignore_index),
      confusion_(torch::zeros({num_classes, num_classes}, torch::kInt64)) {
    LINVIS_CHECK(num_classes > 0, "segmentation metrics: num_classes must be > 0, got ", num_classes);
}

void SegmentationMetrics::update(const torch::Tensor& prediction, const torch::Tensor& target) {
    LINVIS_CHECK(prediction.sizes() == target.sizes(), "segmentation metrics: prediction ",
                 shape_string(prediction.sizes()), " and target ", shape_string(target.sizes()), " differ");
    const torch::Tensor t = target.reshape(-1).to(torch::kInt64), p = prediction.reshape(-1).to(torch::kInt64);
    const torch::Tensor valid = t != ignore_index_;
    const torch::Tensor tv = t.masked_select(valid), pv = p.masked_select(valid);
    if (tv.numel() == 0) return;
    LINVIS_CHECK(tv.min().item<int64_t>() >= 0 && tv.max().item<int64_t>() < num_classes_,
                 "segmentation metrics: target class outside [0, ", num_classes_, ")");
    LINVIS_CHECK(pv.min().item<int64_t>() >= 0 && pv.max().item<int64_t>() < num_classes_,
                 "segmentation metrics: predicted class outside [0, ", num_classes_, ")");
    confusion_ += torch::bincount(tv * num_classes_ + pv, {}, num_classes_ * num_classes_).view({num_classes_, num_classes_});
}

std::vector<double> SegmentationMetrics::per_class_iou() const {
    const auto c = confusion_.to(torch::kFloat64);
    const auto tp = c.diagonal();
    const auto uni = c.sum(1) + c.sum(0) - tp;
    std::vector<double> out;
    for (int64_t k = 0; k < num_classes_; ++k) {
        const double u = uni[k].item<double>();
        out.push_back(u > 0 ? tp[k].item<double>() / u : std::numeric_limits<double>::quiet_NaN());
    }
    return out;
}

void SegmentationMetrics::sum_over_ranks(Distributed* dist) {
    if (dist == nullptr || dist->world_size() == 1) return;
    torch::Tensor counts = confusion_.to(torch::kFloat64);  // exact below 2^53 pixels
    dist->all_reduce_sum(counts);
    confusion_ = counts.to(torch::kInt64);
}

double SegmentationMetrics::mean_iou() const {
    double sum = 0;
    int64_t n = 0;
    for (double v : per_class_iou())
        if (!std::isnan(v)) sum += v, ++n;
    return n ? sum / double(n) : std::numeric_limits<double>::quiet_NaN();
}

double SegmentationMetrics::pixel_accuracy() const {
    const int64_t total = confusion_.sum().item<int64_t>();
    return total ? double(confusion_.diagonal().sum().item<int64_t>()) / double(total)
                 : std::numeric_limits<double>::quiet_NaN();
}

// ---------------------------------------------------------------- evaluation

SegEvalResult evaluate_segmentation(models::SegmentationModel& model, const SegmentationDataset& data,
                                    int64_t batch_size, int64_t limit, bool progress, Distributed* dist) {
    torch::NoGradGuard no_grad;
    const bool was_training = model.is_training();
    model.eval();
    const auto [rank, world] = process_place(dist);
    SegmentationMetrics metrics(data.num_classes());
    const int64_t n = limit > 0 ? std::min(limit, data.size()) : data.size();
    double loss_sum = 0, labelled = 0;
    for (int64_t next = rank; next < n;) {  // this rank's images: rank, rank + world, ...
        std::vector<torch::Tensor> images, labels;
        for (; next < n && int64_t(images.size()) < batch_size; next += world) {
            SegSample s = data.get(next);
            if (!images.empty() && s.label.sizes() != labels[0].sizes()) break;  // batch only equal sizes
            images.push_back(normalize_image(s.image));
            labels.push_back(s.label);
        }
        const torch::Tensor target = torch::stack(labels);
        const torch::Tensor logits = model.forward(torch::stack(images));
        loss_sum += F::cross_entropy(logits, target,
                                     F::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex).reduction(torch::kSum))
                        .item<double>();
        labelled += (target != kIgnoreIndex).sum().item<double>();
        metrics.update(logits.argmax(1), target);
        distributed_heartbeat();
        if (progress) std::fprintf(stderr, "\reval %lld/%lld", static_cast<long long>(std::min(next, n)), static_cast<long long>(n));
    }
    if (progress) std::fprintf(stderr, "\n");
    model.train(was_training);
    metrics.sum_over_ranks(dist);
    std::vector<double> sums{loss_sum, labelled};
    train::sum_over_ranks(dist, sums);
    SegEvalResult r;
    r.miou = metrics.mean_iou();
    r.pixel_accuracy = metrics.pixel_accuracy();
    r.per_class_iou = metrics.per_class_iou();
    r.loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
    r.images = n;
    return r;
}

// ---------------------------------------------------------------- training

namespace {

// User + system CPU time of this process (all its threads), in seconds.
double process_cpu_seconds() {
    struct rusage usage {};
    getrusage(RUSAGE_SELF, &usage);
    return double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
           1e-6 * double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

}  // namespace

SegmentationTrainer::SegmentationTrainer(models::SegmentationModelPtr model, SegTrainConfig config)
    : model_(std::move(model)), config_(std::move(config)) {
    LINVIS_CHECK(config_.steps > 0, "--steps must be > 0, got ", config_.steps);
    LINVIS_CHECK(config_.batch_size >= 2, "--batch-size must be >= 2 (BatchNorm in the head), got ", config_.batch_size);
    LINVIS_CHECK(!config_.output_dir.empty(), "--output is required");
}

double SegmentationTrainer::lr_at(int64_t step) const {
    if (step < config_.warmup_steps)
        return config_.lr * double(step + 1) / double(config_.warmup_steps);
    const double progress = std::min(1.0, double(step) / double(config_.steps));
    return (config_.lr - config_.min_lr) * std::pow(1.0 - progress, config_.poly_power) + config_.min_lr;
}

SegEvalResult SegmentationTrainer::fit(const SegmentationDataset& train, const SegmentationDataset* eval) {
    Distributed* dist = config_.distributed.get();
    const auto [rank, world] = process_place(dist);
    const bool main_rank = rank == 0;  // the only rank that writes files and prints
    LINVIS_CHECK(config_.batch_size % world == 0, "--batch-size ", config_.batch_size,
                 " (the global batch) must be divisible by the number of processes, ", world);
    if (main_rank) fs::create_directories(config_.output_dir);
    const std::string checkpoint = (fs::path(config_.output_dir) / "checkpoint.pt").string();
    const std::string metrics_path = (fs::path(config_.output_dir) / "metrics.jsonl").string();
    // Backbone at lr * backbone_lr_mult, neck and head at lr (optim.h's boosted parameters are the backbone).
    OptimizerConfig oc;
    oc.lr = config_.lr;
    oc.weight_decay = config_.weight_decay;
    oc.eps = config_.eps;
    for (const auto& p : model_->named_parameters())
        if (p.key().rfind("backbone.", 0) == 0) oc.boosted_parameters.insert(p.key());
    oc.lr_multiplier = config_.backbone_lr_mult;
    std::vector<ParamGroupInfo> groups;
    auto optimizer = make_adamw(*model_, oc, &groups);

    std::string history;  // metrics.jsonl lines so far
    if (config_.resume && fs::exists(checkpoint)) {
        TrainingState st = load_checkpoint(checkpoint, *model_, *optimizer, nullptr);
        LINVIS_CHECK(st.config_json == config_.config_json, checkpoint,
                     ": written by a different run configuration; resume with the same options");
        step_ = st.step;
        std::ifstream in(metrics_path);
        history.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        if (main_rank) std::cerr << "resumed from " << checkpoint << " at step " << step_ << "\n";
    }
    if (world > 1) broadcast_module(*dist, *model_);  // every rank starts from rank 0's weights
    auto log = [&](const nlohmann::json& j) {
        if (!main_rank) return;
        history += j.dump() + "\n";
        io::write_file_atomically(metrics_path, history);
    };
    auto save = [&] {
        if (!main_rank) return;
        TrainingState st;
        st.step = step_;
        st.config_json = config_.config_json;
        save_checkpoint(checkpoint, st, *model_, *optimizer, nullptr);
        if (save_weights) save_weights((fs::path(config_.output_dir) / "last.safetensors").string(), *model_);
    };
    auto run_eval = [&](bool final_eval) -> SegEvalResult {
        const flops::WeightsInTraining training;  // no packed copies kept into the next steps
        SegEvalResult r = evaluate_segmentation(*model_, *eval, 2, config_.eval_limit, config_.progress && main_rank, dist);
        log({{"step", step_}, {"eval_miou", r.miou}, {"eval_pixel_accuracy", r.pixel_accuracy},
             {"eval_loss", r.loss}, {"per_class_iou", r.per_class_iou}, {"final", final_eval}});
        if (main_rank)
            std::fprintf(stderr, "step %lld: eval mIoU %.2f%%, pixel accuracy %.2f%%, loss %.4f\n",
                         static_cast<long long>(step_), 100 * r.miou, 100 * r.pixel_accuracy, r.loss);
        return r;
    };

    const InterruptHandler interrupt_handler;
    std::unique_ptr<GradientReducer> reducer;
    if (world > 1) reducer = std::make_unique<GradientReducer>(*model_, config_.distributed);
    const BatchNormSync batch_norm_sync(config_.distributed);
    model_->set_batch_rows(rank, world);
    model_->train();
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = process_cpu_seconds();
    double smoothed = 0;
    while (step_ < config_.steps) {
        // Every rank stops after the same step: on Ctrl-C at any rank, or once rank 0 is over a budget.
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double cpu = process_cpu_seconds() - cpu0;
        const bool over_budget = (config_.time_budget_s > 0 && elapsed > config_.time_budget_s) ||
                                 (config_.cpu_budget_s > 0 && cpu > config_.cpu_budget_s);
        std::vector<double> stop{interrupt_requested() ? 1.0 : 0.0, main_rank && over_budget ? 1.0 : 0.0};
        train::sum_over_ranks(dist, stop);
        if (stop[0] > 0) {
            save();
            if (main_rank)
                std::fprintf(stderr, "interrupted: saved %s at step %lld; continue with --resume\n", checkpoint.c_str(),
                             static_cast<long long>(step_));
            if (dist) dist->barrier();  // the checkpoint is complete before any worker exits
            clear_interrupt();
            interrupted_ = true;
            return {};
        }
        if (stop[1] > 0) {
            if (main_rank)
                std::fprintf(stderr, "budget reached at step %lld: %.0f s, %.0f CPU s of training\n",
                             static_cast<long long>(step_), elapsed, cpu);
            break;
        }
        // The global batch of a step is a pure function of (seed, step), so resuming repeats it exactly;
        // rank r computes its slots r, r + W, ... (the single-process batch split over the ranks).
        std::vector<torch::Tensor> images, labels;
        for (int64_t b = rank; b < config_.batch_size; b += world) {
            const int64_t slot = step_ * config_.batch_size + b;
            std::mt19937_64 rng(sample_seed(config_.seed, slot / train.size() + 1, slot % train.size()));
            const int64_t index = int64_t(rng() % uint64_t(train.size()));
            SegSample s = augment_sample(train.get(index), config_.augment, rng);
            images.push_back(normalize_image(s.image));
            labels.push_back(s.label);
        }
        const double lr = lr_at(step_);
        apply_learning_rate(*optimizer, groups, lr);
        optimizer->zero_grad();
        const torch::Tensor target = torch::stack(labels);
        torch::manual_seed(mix_seed(config_.seed, uint64_t(step_), 1));  // the step's dropout draws, alike on every rank
        const torch::Tensor logits = model_->forward(torch::stack(images));
        // The mean over the labelled pixels of the global batch: this rank's sum over the global count
        // (times the world size, which the gradient averaging over the ranks divides out again).
        const torch::Tensor loss_sum =
            F::cross_entropy(logits, target, F::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex).reduction(torch::kSum));
        std::vector<double> totals{(target != kIgnoreIndex).sum().item<double>(), loss_sum.item<double>()};
        train::sum_over_ranks(dist, totals);
        const double labelled = std::max(totals[0], 1.0);  // a batch of only ignored pixels trains nothing
        const double l = totals[1] / labelled;
        LINVIS_CHECK(std::isfinite(l), "segmentation training: the loss became ", l, " at step ", step_,
                     " (the last checkpoint is ", checkpoint, ")");
        const torch::Tensor loss = loss_sum * (double(world) / labelled);
        if (reducer) reducer->prepare(true);
        loss.backward();
        distributed_heartbeat();
        if (reducer) reducer->finish();
        if (config_.clip_grad > 0) clip_gradients(*model_, config_.clip_grad);
        optimizer->step();
        ++step_;
        smoothed = smoothed == 0 ? l : 0.9 * smoothed + 0.1 * l;
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        nlohmann::json line = {{"step", step_}, {"loss", l}, {"lr", lr}, {"seconds", secs},
                               {"cpu_seconds", process_cpu_seconds() - cpu0}};
        if (world > 1) line["world_size"] = world;
        log(line);
        if (config_.progress && main_rank)
            std::fprintf(stderr, "step %lld/%lld  loss %.4f (avg %.4f)  lr %.2e  %.1f s\n", static_cast<long long>(step_),
                         static_cast<long long>(config_.steps), l, smoothed, lr, secs);
        if (step_ % config_.checkpoint_every == 0) save();
        if (eval && config_.eval_every > 0 && step_ % config_.eval_every == 0 && step_ < config_.steps) run_eval(false);
    }
    save();
    SegEvalResult result = eval ? run_eval(true) : SegEvalResult{};
    if (dist) dist->barrier();  // every file is written before any worker reports success
    return result;
}

}  // namespace linvis::train
