// Subcommand table of the linvis CLI. Each cli/cmd_*.cpp file registers its command
// with a static CommandRegistrar; main.cpp dispatches on argv[1].
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace linvis::cli {

// argv[0] is the command name; the command parses the rest with its CommandApp (options.h).
using CommandFn = std::function<int(int argc, const char* const* argv)>;

struct Command {
    std::string name;
    std::string summary;
    CommandFn run;
};

std::vector<Command>& commands();

struct CommandRegistrar {
    CommandRegistrar(std::string name, std::string summary, CommandFn run);
};

}  // namespace linvis::cli
