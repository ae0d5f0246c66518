#include "options.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "linvis/core/error.h"

namespace linvis::cli {
namespace {

// Base 10 and the whole text, as std::stoll / std::stod read it.
template <typename T>
bool read_number(const std::string& text, T& value) {
    try {
        size_t used = 0;
        if constexpr (std::is_integral_v<T>)
            value = std::stoll(text, &used);
        else
            value = std::stod(text, &used);
        return used == text.size();
    } catch (const std::exception&) {
        return false;
    }
}

// "an integer", "an integer >= 1", "a number in [0, 1]": only the bounds that are set.
template <typename T>
std::string expected(const char* what, T min, T max, T no_min, T no_max) {
    if (min != no_min && max != no_max) return str_cat(what, " in [", min, ", ", max, "]");
    if (min != no_min) return str_cat(what, " >= ", min);
    if (max != no_max) return str_cat(what, " <= ", max);
    return what;
}

std::vector<std::string> split_list(const std::string& text) {
    std::vector<std::string> items;
    std::stringstream in(text);
    std::string item;
    while (std::getline(in, item, ','))
        if (!item.empty()) items.push_back(item);
    return items;
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
    std::string out;
    for (const auto& item : items) out += (out.empty() ? "" : separator) + item;
    return out;
}

std::map<std::string, std::string> parse_key_values(const std::vector<std::string>& items, const std::string& option) {
    std::map<std::string, std::string> out;
    for (const auto& item : items) {
        const auto eq = item.find('=');
        if (eq == std::string::npos || eq == 0) fail(option, ": expected key=value, got '", item, "'");
        out[item.substr(0, eq)] = item.substr(eq + 1);
    }
    return out;
}

}  // namespace

CommandApp::CommandApp(const std::string& command, const std::string& description)
    : CLI::App(description, "linvis " + command) {
    get_formatter()->label("Usage", "usage");
    option_defaults()->always_capture_default()->disable_flag_override()->multi_option_policy(
        CLI::MultiOptionPolicy::TakeLast);
    allow_extras();  // parse() reports them in linvis' words
}

bool parse(CommandApp& app, int argc, const char* const* argv) {
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
        std::cout << app.help();
        return false;
    } catch (const CLI::ParseError& e) {
        fail(e.what());
    }
    const std::vector<std::string> extras = app.remaining();
    if (extras.empty()) return true;
    const std::string& first = extras.front();
    if (first.size() > 1 && first[0] == '-')
        fail("unknown option '", first.substr(0, first.find('=')), "' (see '", app.get_name(), " --help')");
    fail("unexpected argument '", first, "'");
}

CLI::Validator integer_check(const std::string& option, long long min, long long max) {
    return CLI::Validator(
        [=](std::string& text) {
            long long value = 0;
            if (!read_number(text, value) || value < min || value > max)
                fail(option, " expects ", expected("an integer", min, max, LLONG_MIN, LLONG_MAX), ", got '", text,
                     "'");
            text = std::to_string(value);  // CLI11 would read "010" as octal
            return std::string();
        },
        "");
}

CLI::Validator real_check(const std::string& option, double min, double max) {
    return CLI::Validator(
        [=](std::string& text) {
            double value = 0;
            if (!read_number(text, value) || value < min || value > max)
                fail(option, " expects ", expected("a number", min, max, std::numeric_limits<double>::lowest(),
                                                   std::numeric_limits<double>::max()),
                     ", got '", text, "'");
            // Hexadecimal is exact: CLI11 reads through long double, which may round a decimal differently.
            char exact[64];
            std::snprintf(exact, sizeof(exact), "%a", value);
            text = exact;
            return std::string();
        },
        "");
}

std::string choice_list(const std::vector<std::string>& choices) {
    std::string out;
    for (size_t i = 0; i < choices.size(); ++i)
        out += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
    return out;
}

CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& field,
                        const std::vector<std::string>& choices, const std::string& help) {
    return app.add_option(name, field, help)
        ->type_name(join(choices, "|"))
        ->check(CLI::Validator(
            [=](const std::string& text) {
                if (std::find(choices.begin(), choices.end(), text) == choices.end())
                    fail(name, " must be ", choice_list(choices), ", got '", text, "'");
                return std::string();
            },
            ""));
}

CLI::Option* add_list(CLI::App& app, const std::string& name, std::vector<int64_t>& field, const std::string& help) {
    std::vector<std::string> shown;
    for (const int64_t value : field) shown.push_back(std::to_string(value));
    return app
        .add_option_function<std::string>(
            name,
            [&field, name](const std::string& text) {
                field.clear();
                for (const auto& item : split_list(text)) {
                    long long value = 0;
                    if (!read_number(item, value)) fail(name, " expects comma-separated integers, got '", item, "'");
                    field.push_back(value);
                }
            },
            help)
        ->type_name("N,...")
        ->default_str(join(shown, ","));
}

CLI::Option* add_list(CLI::App& app, const std::string& name, std::vector<std::string>& field,
                      const std::string& help) {
    return app
        .add_option_function<std::string>(
            name, [&field](const std::string& text) { field = split_list(text); }, help)
        ->type_name("A,...")
        ->default_str(join(field, ","));
}

CLI::Option* add_threads_option(CLI::App& app, int& threads) {
    return add_number(app, "--threads", threads, "threads for LibTorch and BLAS (0: all cores)");
}

CLI::Option* add_seed_option(CLI::App& app, int64_t& seed) {
    return add_number(app, "--seed", seed,
                      "seed of the random initialisation (and of data order and augmentation in training)");
}

CLI::Option* add_opt_eps_option(CLI::App& app, double& eps) {
    // 0 is refused: a parameter without gradient would get 0 / 0.
    return add_number(app, "--opt-eps", eps, "AdamW epsilon", 1e-30);
}

CLI::Option* add_format_option(CLI::App& app, std::string& format, const std::vector<std::string>& choices) {
    return add_choice(app, "--format", format, choices, "output format");
}

CLI::Option* add_dtype_option(CLI::App& app, std::string& dtype, const std::vector<std::string>& choices) {
    return add_choice(app, "--dtype", dtype, choices, "compute dtype of the parameters and activations");
}

const std::vector<std::string> kImplChoices = {"auto", "reference", "fused"};

CLI::Option* add_impl_option(CLI::App& app, std::string& impl) {
    return add_choice(app, "--impl", impl, kImplChoices,
                      "op implementation: auto (the model's own choice), reference, or fused (checked against "
                      "reference first)");
}

CLI::Option* add_model_kwargs_option(CLI::App& app, std::map<std::string, std::string>& kwargs,
                                     const std::string& name) {
    return app
        .add_option_function<std::vector<std::string>>(
            name, [&kwargs, name](const std::vector<std::string>& items) { kwargs = parse_key_values(items, name); },
            "model options, e.g. depth=6 embed_dim=128 img_size=384 num_classes=10")
        ->type_name("K=V")
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

void add_weights_flags(CLI::App& app, bool& ema, bool& non_strict) {
    app.add_flag("--ema", ema, "take the EMA weights of a training checkpoint (model_ema, state_dict_ema or ema)");
    app.add_flag("--non-strict", non_strict,
                 "take the tensors that match the model and report the rest instead of refusing");
}

}  // namespace linvis::cli
