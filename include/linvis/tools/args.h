// A small declarative command-line parser for the linvis subcommands.
//
// Each command declares its options (name, value placeholder, help, default) and
// positional arguments; parse() fills them from argv and throws linvis::Error with
// one clear line for an unknown flag, a missing value or a missing required option.
// Options may take several values ("--model-kwargs a=1 b=2"): values are collected
// until the next token that starts with "--".
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace linvis::tools {

class ArgParser {
public:
    ArgParser(std::string command, std::string summary);

    // An option that takes one value. An empty default with required=true makes it mandatory.
    ArgParser& option(const std::string& name, const std::string& placeholder, const std::string& help,
                      const std::string& default_value = "", bool required = false);
    // An option that takes one or more values.
    ArgParser& multi_option(const std::string& name, const std::string& placeholder,
                            const std::string& help);
    // A boolean switch.
    ArgParser& flag(const std::string& name, const std::string& help);
    // Positional arguments, in order; the last may be variadic ("IMAGE...").
    ArgParser& positional(const std::string& name, const std::string& help, bool required = true,
                          bool variadic = false);

    // Parses argv[first..argc). Returns false when --help was given (usage already printed).
    bool parse(int argc, const char* const* argv, int first = 0);
    bool parse(const std::vector<std::string>& args);

    std::string usage() const;

    bool has(const std::string& name) const;              // given on the command line (or flag set)
    std::string get(const std::string& name) const;       // value or default
    std::vector<std::string> get_all(const std::string& name) const;
    int64_t get_int(const std::string& name) const;
    double get_double(const std::string& name) const;
    bool get_flag(const std::string& name) const;
    // Comma-separated list of integers / strings ("224,384,512").
    std::vector<int64_t> get_int_list(const std::string& name) const;
    std::vector<std::string> get_list(const std::string& name) const;
    const std::vector<std::string>& positionals() const { return positional_values_; }

private:
    struct Spec {
        std::string name, placeholder, help, default_value;
        bool required = false, multi = false, is_flag = false;
    };
    struct Positional {
        std::string name, help;
        bool required = true, variadic = false;
    };
    const Spec& spec(const std::string& name) const;

    std::string command_, summary_;
    std::vector<Spec> specs_;
    std::vector<Positional> positional_specs_;
    std::map<std::string, std::vector<std::string>> values_;
    std::vector<std::string> positional_values_;
};

// Parses "k=v" strings into a map; throws on an entry without '='.
std::map<std::string, std::string> parse_key_values(const std::vector<std::string>& items,
                                                    const std::string& what);

}  // namespace linvis::tools
