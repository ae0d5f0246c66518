// linvis explain: interpretability pictures (ERF, Gradient Magnitude Map, attention) as a PNG.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/io/image.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/transforms.h"
#include "linvis/models/registry.h"
#include "linvis/tools/explain.h"
#include "linvis/plot/plot.h"

namespace linvis::cli {
namespace {

namespace explain = tools::explain;


std::vector<std::string> split_commas(const std::string& text) {
    std::vector<std::string> parts;
    std::stringstream stream(text);
    std::string item;
    while (std::getline(stream, item, ',')) parts.push_back(item);
    return parts;
}

// The normalised input back to uint8 (H, W, 3) for display.
torch::Tensor display_image(const torch::Tensor& normalised_chw, const io::EvalTransform& transform) {
    const int64_t channels = static_cast<int64_t>(transform.mean.size());
    torch::Tensor mean = torch::tensor(transform.mean, torch::kFloat32).view({channels, 1, 1});
    torch::Tensor std = torch::tensor(transform.std, torch::kFloat32).view({channels, 1, 1});
    torch::Tensor rgb = (normalised_chw.to(torch::kFloat32) * std + mean).clamp(0.0, 1.0).expand({3, -1, -1});
    return (rgb * 255.0).round().to(torch::kUInt8).permute({1, 2, 0}).contiguous();
}

std::vector<float> to_vector(const torch::Tensor& map) {
    torch::Tensor m = map.to(torch::kFloat32).contiguous();
    return std::vector<float>(m.data_ptr<float>(), m.data_ptr<float>() + m.numel());
}

plot::HeatmapPanel image_panel(const plot::Canvas& image, const std::string& title) {
    plot::HeatmapPanel panel(image, std::vector<float>{0.0f}, 1, 1);
    panel.title(title).alpha(0.0).colorbar(false);
    return panel;
}

struct ExplainOptions {
    ModelOptions model;  // --model may name several models (erf only)
    std::vector<std::string> images;
    std::string what, output;
    int64_t block = -1;
    std::string branch = "forth";
    int64_t head = -1;
    std::string query;  // Y,X; empty: the grid centre
    int64_t img_size = 224;
    double decades = 3;
    int64_t erf_cells = 56;
    std::string save_map;
    std::string panel_size = "340,360";
    int64_t seed = 0;
    int threads = 0;
};

int run_explain(int argc, const char* const* argv) {
    ExplainOptions o;
    CommandApp app("explain",
                   "Interpretability pictures of the papers: the effective receptive field of the central output "
                   "position (erf), the Gradient Magnitude Map of a Vision-TTT block (gradmap, Vision-TTT Eq. 6) and "
                   "the attention of one query patch (attention: DeiT softmax weights or the T5 implicit attention, "
                   "T5 Eq. 13). Without IMAGE the generated demo image is used. See docs/explain.md.");
    add_model_options(app, o.model, false, /*model_required=*/false);
    app.add_option("IMAGE", o.images, "JPEG, PNG or BMP files (erf averages over all of them)");
    add_choice(app, "--what", o.what, {"erf", "gradmap", "attention"}, "which map")->required();
    app.add_option("--output", o.output, "picture to write")->type_name("FILE.png")->required();
    add_number(app, "--block", o.block, "block index for gradmap / attention (negative counts from the end)");
    // The library names the branches (and words the error).
    app.add_option("--branch", o.branch, "TTT-Linear branch for gradmap")
        ->type_name("forth|back")
        ->check(CLI::Validator([](const std::string& name) { return (explain::parse_ttt_branch(name), ""); }, ""));
    add_number(app, "--head", o.head, "gradmap: one head, or -1 for the norm over all heads", int64_t{-1});
    app.add_option("--query", o.query, "attention: query patch (row, column); default the grid centre")
        ->type_name("Y,X");
    add_number(app, "--img-size", o.img_size, "crop size (the model is built for it)", int64_t{1});
    add_number(app, "--decades", o.decades, "erf: decades shown by the log colour scale");
    add_number(app, "--erf-cells", o.erf_cells,
               "erf: show the map as means over square pixel blocks, about N per side (0: every pixel)", int64_t{0});
    app.add_option("--save-map", o.save_map, "also write the raw map(s) as float32 tensors")
        ->type_name("FILE.safetensors");
    app.add_option("--panel-size", o.panel_size, "pixels of each panel of the picture")->type_name("W,H");
    add_seed_option(app, o.seed);
    add_threads_option(app, o.threads);
    if (!parse(app, argc, argv)) return 0;
    torch::manual_seed(static_cast<uint64_t>(o.seed));
    runtime::configure_threads(o.threads);

    const std::string& what = o.what;
    const std::string& output = o.output;
    LINVIS_CHECK(output.size() > 4 && output.substr(output.size() - 4) == ".png", "--output must name a .png file, got '",
                 output, "'");
    const std::string& branch_name = o.branch;
    const explain::TttBranch branch = explain::parse_ttt_branch(branch_name);
    const double decades = o.decades;
    LINVIS_CHECK(decades > 0 && decades <= 12, "--decades must be in (0, 12], got ", decades);
    const auto panel_size = split_commas(o.panel_size);
    int cell_width = 0, cell_height = 0;
    try {
        if (panel_size.size() == 2) {
            cell_width = std::stoi(panel_size[0]);
            cell_height = std::stoi(panel_size[1]);
        }
    } catch (const std::exception&) {
    }
    LINVIS_CHECK(cell_width >= 160 && cell_height >= 160 && cell_width <= 4000 && cell_height <= 4000,
                 "--panel-size must be W,H with each in [160, 4000], got '", o.panel_size, "'");
    const int64_t erf_cells = o.erf_cells;
    complete_model_options_from_weights(o.model);
    const std::vector<std::string> model_names = split_commas(o.model.model);
    LINVIS_CHECK(!model_names.empty(), "--model is empty");
    LINVIS_CHECK(model_names.size() == 1 || what == "erf", "--model: several models (", o.model.model,
                 ") only with --what erf");
    LINVIS_CHECK(model_names.size() == 1 || o.model.weights.empty(),
                 "--weights: give one model when loading weights");
    for (const auto& name : model_names)
        LINVIS_CHECK(models::has_model(name), "--model: unknown model '", name, "' (see 'linvis models')");

    const io::EvalTransform transform = input_transform(describe_weights(o.model.weights), o.img_size,
                                                        app.count("--img-size") > 0, 0.875, false);
    torch::Tensor images;
    if (o.images.empty())
        images = transform(io::demo_image()).unsqueeze(0);
    else
        images = io::load_image_batch(o.images, transform);
    const plot::Canvas input = plot::canvas_from_tensor(display_image(images[0], transform));
    const std::string input_title =
        o.images.empty() ? std::string("input (generated demo image)")
                                   : (images.size(0) > 1 ? "input 1 of " + std::to_string(images.size(0)) : "input");
    const std::string trained = o.model.weights.empty() ? " (untrained)" : "";
    const std::map<std::string, std::string> defaults = {{"img_size", std::to_string(transform.crop_size)}};
    std::map<std::string, torch::Tensor> saved;

    if (what == "erf") {
        std::vector<plot::HeatmapPanel> panels;
        for (const auto& name : model_names) {
            models::ModelPtr model;
            if (model_names.size() == 1) {
                model = build_model(o.model, defaults);
            } else {
                auto kwargs = o.model.kwargs;
                for (const auto& [key, value] : defaults) kwargs.emplace(key, value);
                model = models::create_model(name, models::ModelConfig(kwargs));
            }
            torch::Tensor erf = explain::effective_receptive_field(*model, images);
            saved["erf." + name] = erf;
            // Block means tame the pixel-level noise of a single-image ERF (and keep the PNG small).
            const int64_t block_size = erf_cells > 0 ? std::max<int64_t>(1, erf.size(0) / erf_cells) : 1;
            torch::Tensor pooled = block_size > 1 ? torch::avg_pool2d(erf.unsqueeze(0), {block_size, block_size},
                                                                      {block_size, block_size}, {0, 0}, true)[0]
                                                  : erf;
            torch::Tensor shown = explain::erf_display_map(pooled, decades);
            plot::HeatmapPanel panel(to_vector(shown), static_cast<int>(shown.size(0)), static_cast<int>(shown.size(1)));
            panel.title(name + trained + (block_size > 1 ? ", " + std::to_string(block_size) + "x" +
                                                               std::to_string(block_size) + "-pixel means"
                                                         : std::string()))
                .colormap(plot::Colormap::Viridis)
                .range({-decades, 0.0})
                .colorbar(true, "log10(ERF / max)");
            panels.push_back(panel);
            std::cerr << name << ": ERF over " << images.size(0) << " image(s), " << erf.size(0) << "x" << erf.size(1)
                      << ", max " << erf.max().item<float>() << "\n";
        }
        const bool with_input = model_names.size() == 1;
        plot::Figure figure(1, static_cast<int>(panels.size()) + (with_input ? 1 : 0));
        figure.title("Effective receptive field: |d sum relu(centre features) / d pixels|, " +
                     std::to_string(images.size(0)) + " image" + (images.size(0) > 1 ? "s" : ""));
        int col = 0;
        if (with_input) figure.set(0, col++, image_panel(input, input_title));
        for (auto& panel : panels) figure.set(0, col++, panel);
        figure.save_png(output, cell_width * figure.cols(), cell_height);
    } else {
        LINVIS_CHECK(images.size(0) == 1, "--what ", what, ": give one IMAGE, got ", images.size(0));
        models::ModelPtr model = build_model(o.model, defaults);
        int64_t block = o.block;
        int64_t depth = 0;
        for (const auto& item : model->named_children())
            if (item.key() == "blocks") depth = static_cast<int64_t>(item.value()->children().size());
        if (block < 0 && block + depth >= 0) block += depth;  // for the title; out-of-range is reported below
        torch::Tensor map;
        std::string map_title, bar_label, figure_title;
        plot::Canvas marked = input;
        if (what == "gradmap") {
            const int64_t head = o.head;
            map = explain::gradient_magnitude_map(*model, images[0], block, branch, head);
            map_title = "||G_t|| on the patch grid";
            bar_label = "||G_t||";
            figure_title = o.model.model + trained + ": Gradient Magnitude Map, block " + std::to_string(block) +
                           ", " + branch_name + " branch, " + (head < 0 ? std::string("all heads") :
                                                                           "head " + std::to_string(head));
        } else {
            const int64_t grid_guess = transform.crop_size / 16;
            int64_t qy = grid_guess / 2, qx = grid_guess / 2;
            const std::string& query = o.query;
            if (!query.empty()) {
                const auto parts = split_commas(query);
                LINVIS_CHECK(parts.size() == 2, "--query must be Y,X (two integers), got '", query, "'");
                try {
                    qy = std::stoll(parts[0]);
                    qx = std::stoll(parts[1]);
                } catch (const std::exception&) {
                    fail("--query must be Y,X (two integers), got '", query, "'");
                }
            }
            explain::AttentionMap attention = explain::attention_map(*model, images[0], block, qy, qx);
            map = attention.map;
            std::cerr << attention.method << "\n";
            map_title = "weights of the query's keys";
            bar_label = "weight";
            const bool implicit = attention.method.rfind("T5", 0) == 0;
            figure_title = o.model.model + trained + ": " + (implicit ? "implicit attention (T5 Eq. 13)"
                                                                            : "softmax attention") +
                           ", block " + std::to_string(block) + ", query (" + std::to_string(qy) + ", " +
                           std::to_string(qx) + "), mean over heads";
            // Outline the query patch on the input.
            const double cell_h = static_cast<double>(input.height()) / static_cast<double>(map.size(0));
            const double cell_w = static_cast<double>(input.width()) / static_cast<double>(map.size(1));
            marked.stroke_rect({qx * cell_w, qy * cell_h, cell_w, cell_h}, plot::Color{230, 30, 30}, 2.0);
        }
        saved[what] = map;
        const std::vector<float> values = to_vector(map);
        const int h = static_cast<int>(map.size(0)), w = static_cast<int>(map.size(1));
        plot::Figure figure(1, 3);
        figure.title(figure_title);
        figure.set(0, 0, image_panel(marked, what == "attention" ? "input, query patch outlined" : input_title));
        plot::HeatmapPanel overlay(input, values, h, w);
        overlay.title("overlay on the input").alpha(0.6).colorbar(false);
        figure.set(0, 1, overlay);
        plot::HeatmapPanel alone(values, h, w);
        alone.title(map_title).colorbar(true, bar_label);
        figure.set(0, 2, alone);
        figure.save_png(output, cell_width * 3, cell_height);
        std::cerr << what << ": " << h << "x" << w << " map, min " << map.min().item<float>() << ", max "
                  << map.max().item<float>() << "\n";
    }
    std::cout << "wrote " << output << "\n";
    const std::string& save_map = o.save_map;
    if (!save_map.empty()) {
        io::save_safetensors(save_map, saved, {{"what", what}, {"model", o.model.model}});
        std::cout << "wrote " << save_map << "\n";
    }
    return 0;
}

CommandRegistrar registrar("explain", "interpretability pictures: ERF, TTT gradient magnitude map, attention maps",
                           run_explain);

}  // namespace
}  // namespace linvis::cli
