#include "linvis/tools/args.h"

#include <iostream>
#include <sstream>

#include "linvis/core/error.h"

namespace linvis::tools {

ArgParser::ArgParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {
    flag("--help", "show this help and exit");
}

ArgParser& ArgParser::option(const std::string& name, const std::string& placeholder,
                             const std::string& help, const std::string& default_value, bool required) {
    specs_.push_back({name, placeholder, help, default_value, required, false, false});
    return *this;
}

ArgParser& ArgParser::multi_option(const std::string& name, const std::string& placeholder,
                                   const std::string& help) {
    specs_.push_back({name, placeholder, help, "", false, true, false});
    return *this;
}

ArgParser& ArgParser::flag(const std::string& name, const std::string& help) {
    specs_.push_back({name, "", help, "", false, false, true});
    return *this;
}

ArgParser& ArgParser::positional(const std::string& name, const std::string& help, bool required,
                                 bool variadic) {
    positional_specs_.push_back({name, help, required, variadic});
    return *this;
}

const ArgParser::Spec& ArgParser::spec(const std::string& name) const {
    for (const auto& s : specs_)
        if (s.name == name) return s;
    fail("internal: option ", name, " of '", command_, "' was never declared");
}

bool ArgParser::parse(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    return parse(static_cast<int>(argv.size()), argv.data(), 0);
}

bool ArgParser::parse(int argc, const char* const* argv, int first) {
    values_.clear();
    positional_values_.clear();
    for (int i = first; i < argc; ++i) {
        std::string token = argv[i];
        if (token.rfind("--", 0) == 0 && token.size() > 2) {
            std::string name = token, inline_value;
            bool has_inline = false;
            if (auto eq = token.find('='); eq != std::string::npos) {
                name = token.substr(0, eq);
                inline_value = token.substr(eq + 1);
                has_inline = true;
            }
            const Spec* found = nullptr;
            for (const auto& s : specs_)
                if (s.name == name) found = &s;
            if (found == nullptr)
                fail("unknown option '", name, "' (see 'linvis ", command_, " --help')");
            if (found->is_flag) {
                if (has_inline) fail(name, " takes no value");
                values_[name] = {"1"};
                continue;
            }
            std::vector<std::string>& slot = values_[name];
            if (!found->multi) slot.clear();
            if (has_inline) {
                slot.push_back(inline_value);
            } else {
                int taken = 0;
                while (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
                    slot.push_back(argv[++i]);
                    ++taken;
                    if (!found->multi) break;
                }
                if (taken == 0)
                    fail("option ", name, " needs a value (", found->placeholder, ")");
            }
        } else {
            positional_values_.push_back(token);
        }
    }
    if (get_flag("--help")) {
        std::cout << usage();
        return false;
    }
    for (const auto& s : specs_)
        if (s.required && !has(s.name))
            fail("missing required option ", s.name, " ", s.placeholder);
    size_t required_positionals = 0;
    bool variadic = false;
    for (const auto& p : positional_specs_) {
        if (p.required) ++required_positionals;
        variadic = variadic || p.variadic;
    }
    if (positional_values_.size() < required_positionals)
        fail("missing argument ", positional_specs_[positional_values_.size()].name);
    if (!variadic && positional_values_.size() > positional_specs_.size())
        fail("unexpected argument '", positional_values_[positional_specs_.size()], "'");
    return true;
}

std::string ArgParser::usage() const {
    std::ostringstream out;
    out << "usage: linvis " << command_;
    for (const auto& p : positional_specs_) {
        std::string shown = p.name + (p.variadic ? "..." : "");
        out << ' ' << (p.required ? shown : "[" + shown + "]");
    }
    out << " [options]\n\n" << summary_ << "\n";
    if (!positional_specs_.empty()) {
        out << "\narguments:\n";
        for (const auto& p : positional_specs_) out << "  " << p.name << "\n      " << p.help << "\n";
    }
    out << "\noptions:\n";
    for (const auto& s : specs_) {
        out << "  " << s.name;
        if (!s.is_flag) out << ' ' << s.placeholder << (s.multi ? " [...]" : "");
        out << "\n      " << s.help;
        if (s.required) out << " (required)";
        else if (!s.default_value.empty()) out << " [default: " << s.default_value << "]";
        out << "\n";
    }
    return out.str();
}

bool ArgParser::has(const std::string& name) const {
    spec(name);
    return values_.count(name) != 0;
}

std::string ArgParser::get(const std::string& name) const {
    const Spec& s = spec(name);
    auto it = values_.find(name);
    if (it == values_.end() || it->second.empty()) return s.default_value;
    return it->second.back();
}

std::vector<std::string> ArgParser::get_all(const std::string& name) const {
    spec(name);
    auto it = values_.find(name);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
}

int64_t ArgParser::get_int(const std::string& name) const {
    const std::string text = get(name);
    try {
        size_t used = 0;
        const long long value = std::stoll(text, &used);
        if (used != text.size()) throw std::invalid_argument(text);
        return value;
    } catch (const std::exception&) {
        fail(name, " expects an integer, got '", text, "'");
    }
}

double ArgParser::get_double(const std::string& name) const {
    const std::string text = get(name);
    try {
        size_t used = 0;
        const double value = std::stod(text, &used);
        if (used != text.size()) throw std::invalid_argument(text);
        return value;
    } catch (const std::exception&) {
        fail(name, " expects a number, got '", text, "'");
    }
}

bool ArgParser::get_flag(const std::string& name) const { return has(name); }

std::vector<std::string> ArgParser::get_list(const std::string& name) const {
    std::vector<std::string> items;
    for (const auto& value : get_all(name).empty() ? std::vector<std::string>{get(name)} : get_all(name)) {
        std::stringstream in(value);
        std::string item;
        while (std::getline(in, item, ','))
            if (!item.empty()) items.push_back(item);
    }
    return items;
}

std::vector<int64_t> ArgParser::get_int_list(const std::string& name) const {
    std::vector<int64_t> numbers;
    for (const auto& item : get_list(name)) {
        try {
            size_t used = 0;
            numbers.push_back(std::stoll(item, &used));
            if (used != item.size()) throw std::invalid_argument(item);
        } catch (const std::exception&) {
            fail(name, " expects comma-separated integers, got '", item, "'");
        }
    }
    return numbers;
}

std::map<std::string, std::string> parse_key_values(const std::vector<std::string>& items,
                                                    const std::string& what) {
    std::map<std::string, std::string> out;
    for (const auto& item : items) {
        const auto eq = item.find('=');
        if (eq == std::string::npos || eq == 0)
            fail(what, ": expected key=value, got '", item, "'");
        out[item.substr(0, eq)] = item.substr(eq + 1);
    }
    return out;
}

}  // namespace linvis::tools
