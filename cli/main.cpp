// linvis command-line entry point: dispatches to the registered subcommands, turns
// every linvis::Error (and LibTorch error) into one line on stderr and exit status 1.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include <torch/torch.h>

#include "command.h"
#include "linvis/core/error.h"
#include "linvis/core/runtime.h"

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

// OpenMP workers that spin long while idle starve OpenBLAS's pthreads on a small machine, and workers
// that never spin make each oneDNN product pay a wake-up: the process restarts itself once with a short
// spin (runtime::configure_threads explains the numbers), since libgomp reads its environment when it
// starts. The same restart gives OpenBLAS the kernels of this CPU when it does not recognise it
// (runtime::openblas_coretype_override). A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept;
// LINVIS_NO_REEXEC=1 turns the restart off.
void configure_openmp_wait(char** argv) {
    if (std::getenv("LINVIS_NO_REEXEC") != nullptr) return;
    const std::string coretype = linvis::runtime::openblas_coretype_override();
    const bool user_policy = std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr;
    if (user_policy && coretype.empty()) return;
    if (!user_policy) setenv("GOMP_SPINCOUNT", linvis::runtime::kOpenmpSpinCount, 1);
    if (!coretype.empty()) setenv("OPENBLAS_CORETYPE", coretype.c_str(), 1);
    setenv("LINVIS_NO_REEXEC", "1", 1);
    execv("/proc/self/exe", argv);
    // execv only returns on failure: carry on with the default policy.
}

}  // namespace
}  // namespace linvis::cli

int main(int argc, char** argv) {
    using namespace linvis::cli;
    configure_openmp_wait(argv);
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
