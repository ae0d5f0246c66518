// The linvis command line on CLI11: the parser of one subcommand, the checks its options use, and the
// options several commands share, each declared once here with one help text.
//
// A bad command line stops with one line naming the option, what it accepts and what it got, thrown as
// linvis::Error so that main() reports it like any other error, with exit status 1:
//   linvis bench: error: --batch expects an integer, got 'two'
//   linvis explain: error: --what must be erf, gradmap or attention, got 'heat'
// The checks below throw that error themselves: a message returned to CLI11 would come out as "--batch: ...".
#pragma once

#include <climits>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

namespace linvis::cli {

// The parser of `linvis <command>`: "usage: linvis <command> ..." help with every option's default, a scalar
// option given twice keeps the last value, a flag takes no value.
class CommandApp : public CLI::App {
public:
    CommandApp(const std::string& command, const std::string& description);
};

// Parses argv[1..argc) (argv[0] is the command name). Returns false when --help was given: the help is
// printed. Throws linvis::Error for an unknown option ("unknown option '--x' (see 'linvis <command> --help')"),
// an argument too many, a missing value or required option, and for what the checks below reject.
bool parse(CommandApp& app, int argc, const char* const* argv);

// ---------------------------------------------------------------- checks

// Integers and reals are read in base 10 as a whole ("010" is ten, "0x10" and "3x" are errors) and must lie in
// [min, max]: "--batch expects an integer >= 1, got '0'".
CLI::Validator integer_check(const std::string& option, long long min = LLONG_MIN, long long max = LLONG_MAX);
CLI::Validator real_check(const std::string& option, double min = std::numeric_limits<double>::lowest(),
                          double max = std::numeric_limits<double>::max());

// A number option bound to `field` (int, int64_t or double).
template <typename T>
CLI::Option* add_number(CLI::App& app, const std::string& name, T& field, const std::string& help,
                        T min = std::numeric_limits<T>::lowest(), T max = std::numeric_limits<T>::max()) {
    static_assert(std::is_arithmetic_v<T>, "add_number takes int, int64_t or double");
    using limits = std::numeric_limits<T>;
    CLI::Option* option = app.add_option(name, field, help);
    if constexpr (std::is_integral_v<T>) {
        // The type's own limits are no bound to name in a message (CLI11 reports an overflowing int).
        return option->transform(integer_check(name, min == limits::lowest() ? LLONG_MIN : min,
                                               max == limits::max() ? LLONG_MAX : max));
    } else {
        return option->transform(real_check(name, min, max));
    }
}

// A choice among `choices`, shown as a|b|c in the help; anything else is "--format must be text or json, got 'xml'".
// The default is what `field` holds.
CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& field,
                        const std::vector<std::string>& choices, const std::string& help);
// "a, b or c", as the messages name choices.
std::string choice_list(const std::vector<std::string>& choices);

// A comma-separated list in one argument ("--res 224,512", "--models a,b@fused"); empty items are skipped and,
// given twice, the last list counts. Integers are checked as integer_check does.
CLI::Option* add_list(CLI::App& app, const std::string& name, std::vector<int64_t>& field, const std::string& help);
CLI::Option* add_list(CLI::App& app, const std::string& name, std::vector<std::string>& field,
                      const std::string& help);

// ---------------------------------------------------------------- shared options

// --threads N: LibTorch and BLAS threads; 0 (or less) means all cores.
CLI::Option* add_threads_option(CLI::App& app, int& threads);
// --seed N: seed of the random initialisation (and of data order and augmentation in training).
CLI::Option* add_seed_option(CLI::App& app, int64_t& seed);
// --opt-eps E: AdamW's epsilon (timm's name), > 0. A larger one turns the steps of parameters whose gradients are
// far below it from +-lr into lr * gradient / eps.
CLI::Option* add_opt_eps_option(CLI::App& app, double& eps);
// --format: the output format among `choices` (text|json, or table|json for bench).
CLI::Option* add_format_option(CLI::App& app, std::string& format,
                               const std::vector<std::string>& choices = {"text", "json"});
// --dtype: compute dtype among `choices`.
CLI::Option* add_dtype_option(CLI::App& app, std::string& dtype, const std::vector<std::string>& choices);
// --impl auto|reference|fused, handed to the models as the model option `impl` (auto: the model's own default).
CLI::Option* add_impl_option(CLI::App& app, std::string& impl);
extern const std::vector<std::string> kImplChoices;
// --model-kwargs K=V ...: model options, every value up to the next option; given twice, the lists add up.
// "--model-kwargs: expected key=value, got 'depth'" for an item without '='.
CLI::Option* add_model_kwargs_option(CLI::App& app, std::map<std::string, std::string>& kwargs,
                                     const std::string& name = "--model-kwargs");
// --ema and --non-strict: which tensors of a weights file or PyTorch checkpoint are taken.
void add_weights_flags(CLI::App& app, bool& ema, bool& non_strict);

}  // namespace linvis::cli
