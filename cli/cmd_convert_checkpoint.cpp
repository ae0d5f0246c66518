// linvis convert-checkpoint: official PyTorch checkpoint (.pth/.th/.pt) -> safetensors.
#include <iostream>

#include "command.h"
#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "linvis/io/torch_checkpoint.h"
#include "linvis/models/pretrained.h"
#include "linvis/models/registry.h"
#include "linvis/tools/args.h"

namespace linvis::cli {
namespace {

void print_list(const std::string& title, const std::vector<std::string>& items, size_t limit = 30) {
    if (items.empty()) return;
    std::cout << title << " (" << items.size() << "):\n";
    for (size_t i = 0; i < items.size() && i < limit; ++i) std::cout << "  " << items[i] << "\n";
    if (items.size() > limit) std::cout << "  ... " << (items.size() - limit) << " more\n";
}

int run_convert_checkpoint(int argc, const char* const* argv) {
    tools::ArgParser args("convert-checkpoint",
                          "Read an official PyTorch checkpoint (torch.save zip: .pth/.th/.pt, including files "
                          "that also pickle optimizer state, yacs configs or argparse Namespaces), pick the "
                          "model (or EMA) state dict, optionally map and check it against a linvis model, "
                          "and write safetensors.");
    args.positional("IN", "checkpoint written by torch.save")
        .positional("OUT", "output .safetensors file")
        .option("--model", "NAME", "linvis model to map names to and check shapes against (see `linvis models`)")
        .flag("--ema", "take the EMA weights (model_ema / state_dict_ema / ema)")
        .multi_option("--model-kwargs", "K=V", "options for the model, e.g. img_size=384")
        .flag("--non-strict", "write even if keys are missing, unexpected or mismatched (those are left out)")
        .flag("--dry-run", "read, map and check, print the report, write nothing");
    if (!args.parse(argc, argv, 1)) return 0;
    const std::string in = args.positionals().at(0);
    const std::string out = args.positionals().at(1);
    const io::CheckpointContents contents = io::read_torch_checkpoint(in);
    io::StateDictReport extract;
    std::string chosen;
    std::map<std::string, torch::Tensor> tensors =
        io::extract_state_dict(contents, args.get_flag("--ema"), &chosen, &extract);

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
    if (args.has("--model")) {
        const std::string name = args.get("--model");
        models::ModelConfig config(tools::parse_key_values(args.get_all("--model-kwargs"), "--model-kwargs"));
        models::ModelPtr model = models::create_model(name, config);
        models::ModelMappingReport mapping;
        tensors = models::map_state_dict_to_model(tensors, *model, !args.get_flag("--non-strict"), &mapping);
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
    } else if (args.has("--model-kwargs")) {
        fail("--model-kwargs needs --model");
    }
    if (args.get_flag("--dry-run")) {
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
