// Runs the built linvis command line (or another built program) from a test and captures what it prints.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace linvis::testing {

struct CommandResult {
    int status = -1;     // exit status, -1 when the command did not exit normally
    std::string output;  // stdout and stderr together
};

// Runs `program` with `arguments` (one shell word string, e.g. "models --format json").
inline CommandResult run_program(const std::string& program, const std::string& arguments) {
    const std::string command = program + " " + arguments + " 2>&1";
    CommandResult result;
    FILE* pipe = popen(command.c_str(), "r");
    if (pipe == nullptr) return result;
    std::array<char, 4096> buffer{};
    size_t n;
    while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
    const int status = pclose(pipe);
    result.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return result;
}

// `arguments` follow the program name, e.g. "models --format json"; LINVIS_CLI_PATH is set by CMake.
inline CommandResult run_cli(const std::string& arguments) {
    return run_program(LINVIS_CLI_PATH, arguments);
}

}  // namespace linvis::testing
