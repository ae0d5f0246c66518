// linvis command-line entry point: dispatches to the registered subcommands, turns
// every linvis::Error (and LibTorch error) into one line on stderr and exit status 1.

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include <torch/torch.h>

#include "command.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"
#include "linvis/core/tensor_arena.h"

namespace linvis::cli {

std::vector<Command>& commands() {
    static std::vector<Command> table;
    return table;
}

CommandRegistrar::CommandRegistrar(std::string name, std::string summary, CommandFn run) {
    commands().push_back({std::move(name), std::move(summary), std::move(run)});
}

namespace {

void print_help() {
    auto table = commands();
    std::sort(table.begin(), table.end(), [](const Command& a, const Command& b) { return a.name < b.name; });
    std::cout << "linvis " << LINVIS_VERSION
              << ": linear-time vision backbones (Vision-TTT, ViT3, ViL, T5) and the DeiT baseline\n\n"
              << "usage: linvis <command> [options]\n\ncommands:\n";
    for (const auto& c : table) {
        if (c.summary.empty()) continue;  // internal commands
        std::cout << "  " << c.name << std::string(c.name.size() < 20 ? 20 - c.name.size() : 1, ' ')
                  << c.summary << "\n";
    }
    std::cout << "\n'linvis <command> --help' describes a command's options.\n";
}

}  // namespace
}  // namespace linvis::cli

int main(int argc, char** argv) {
    using namespace linvis::cli;
    // The OpenMP wait and OpenBLAS's kernels are read at start-up: restart once with them set.
    linvis::runtime::restart_with_runtime_environment(argv);
    // Large tensors from one first-fit range: the same placement in every pass (core/tensor_arena.h).
    linvis::tensor_arena::install();
    if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
        std::string(argv[1]) == "help") {
        print_help();
        return argc < 2 ? 1 : 0;
    }
    std::string name = argv[1];
    if (name == "--version") name = "version";
    for (const auto& command : commands()) {
        if (command.name != name) continue;
        try {
            return command.run(argc - 1, argv + 1);
        } catch (const linvis::Error& e) {
            std::cerr << "linvis " << name << ": error: " << e.what() << "\n";
        } catch (const c10::Error& e) {
            std::cerr << "linvis " << name << ": error: " << e.what_without_backtrace() << "\n";
        } catch (const std::exception& e) {
            std::cerr << "linvis " << name << ": error: " << e.what() << "\n";
        }
        return 1;
    }
    std::cerr << "linvis: unknown command '" << name << "' (run 'linvis --help' for the list)\n";
    return 2;
}
