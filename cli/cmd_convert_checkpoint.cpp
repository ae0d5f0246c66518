// linvis convert-checkpoint: official PyTorch checkpoint (.pth/.th/.pt) -> safetensors.
#include <iostream>

#include "command.h"
#include "common.h"
#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/torch_checkpoint.h"
#include "linvis/models/pretrained.h"
#include "linvis/models/registry.h"

namespace linvis::cli {
namespace {

void print_list(const std::string& title, const std::vector<std::string>& items, size_t limit = 30) {
    if (items.empty()) return;
    std::cout << title << " (" << items.size() << "):\n";
    for (size_t i = 0; i < items.size() && i < limit; ++i) std::cout << "  " << items[i] << "\n";
    if (items.size() > limit) std::cout << "  ... " << (items.size() - limit) << " more\n";
}

struct ConvertOptions {
    std::string in, out;
    std::string model;  // map names to it and check shapes when set
    std::map<std::string, std::string> kwargs;
    bool ema = false;
    bool non_strict = false;
    bool dry_run = false;
};

int run_convert_checkpoint(int argc, const char* const* argv) {
    ConvertOptions o;
    CommandApp app("convert-checkpoint",
                   "Read an official PyTorch checkpoint (torch.save zip: .pth/.th/.pt, including files that also "
                   "pickle optimizer state, yacs configs or argparse Namespaces), pick the model (or EMA) state dict, "
                   "optionally map and check it against a linvis model, and write safetensors.");
    app.add_option("IN", o.in, "checkpoint written by torch.save")->required();
    app.add_option("OUT", o.out, "output .safetensors file")->required();
    CLI::Option* model = add_model_option(app, o.model);
    add_model_kwargs_option(app, o.kwargs)->needs(model);
    add_weights_flags(app, o.ema, o.non_strict);
    app.add_flag("--dry-run", o.dry_run, "read, map and check, print the report, write nothing");
    if (!parse(app, argc, argv)) return 0;
    const std::string& in = o.in;
    const std::string& out = o.out;
    const io::CheckpointContents contents = io::read_torch_checkpoint(in);
    io::StateDictReport extract;
    std::string chosen;
    // Diffusion models (DiT's find_model) take the EMA weights of a train.py checkpoint when it has them.
    const bool generative = app.count("--model") > 0 && models::has_generative_model(o.model);
    bool ema = o.ema;
    if (!ema && generative && models::generative_model_kind(o.model) == "diffusion") {
        try {
            io::extract_state_dict(contents, true, nullptr);
            ema = true;
        } catch (const Error&) {
        }
    }
    std::map<std::string, torch::Tensor> tensors = io::extract_state_dict(contents, ema, &chosen, &extract);

    std::cout << "checkpoint  " << in << " (format version " << contents.format_version << ", "
              << contents.num_storages << " storages)\n"
              << "state dict  " << (chosen.empty() ? "<top level>" : "'" + chosen + "'") << ": " << extract.kept
              << " tensors";
    if (extract.prefix_stripped > 0) std::cout << ", 'module.' removed from " << extract.prefix_stripped << " keys";
    std::cout << "\n";
    print_list("dropped top-level entries", extract.dropped);
    print_list("dropped non-tensor entries of the state dict", extract.non_tensors);

    std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                   {"source", in},
                                                   {"source_key", chosen.empty() ? "<top level>" : chosen}};
    if (app.count("--model") > 0) {
        const std::string& name = o.model;
        models::ModelConfig config(o.kwargs);
        std::shared_ptr<models::Model> model = generative ? models::create_generative_model(name, config)
                                                          : std::shared_ptr<models::Model>(models::create_model(name, config));
        models::ModelMappingReport mapping;
        tensors = models::map_state_dict_to_model(tensors, *model, !o.non_strict, &mapping);
        std::vector<std::string> renames;
        for (const auto& [from, to] : mapping.renamed) renames.push_back(from + " -> " + to);
        std::cout << "model       " << name << ": " << tensors.size() << " tensors match, " << renames.size()
                  << " renamed\n";
        print_list("renames", renames, 10);
        print_list("dropped by the model's key mapping", mapping.dropped);
        print_list("adapted to the model's resolution", mapping.adapted);
        print_list("missing (left at initialisation)", mapping.missing);
        print_list("unexpected (not written)", mapping.unexpected);
        print_list("shape mismatches (not written)", mapping.mismatched);
        metadata["model"] = name;
        for (const auto& [k, v] : config.values()) metadata["model_kwargs." + k] = v;
    }
    if (o.dry_run) {
        std::cout << "dry run: nothing written\n";
        return 0;
    }
    io::save_safetensors(out, tensors, metadata);
    std::cout << "wrote       " << out << " (" << tensors.size() << " tensors)\n";
    return 0;
}

CommandRegistrar registrar("convert-checkpoint",
                           "convert an official PyTorch checkpoint (.pth/.th/.pt) to safetensors",
                           run_convert_checkpoint);

}  // namespace
}  // namespace linvis::cli
