// linvis error handling: one exception type whose message names what went wrong.
//
// Every user-facing failure (bad file, bad tensor key, shape mismatch, bad option)
// throws linvis::Error. Messages follow one pattern so that a person can act on
// them: "<where>: <what>: expected <x>, got <y>", e.g.
//   "model.safetensors: tensor 'blocks.0.attn.qkv.weight': expected shape [576, 192], got [192, 192]".
// The CLI catches Error, prints the message on one line and exits with status 1.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace linvis {

class Error : public std::runtime_error {
public:
    explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& out, const T& first, const Rest&... rest) {
    out << first;
    append_all(out, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<< into one string.
template <typename... Parts>
std::string str_cat(const Parts&... parts) {
    std::ostringstream out;
    detail::append_all(out, parts...);
    return out.str();
}

// Throws linvis::Error with the concatenation of the arguments.
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
    throw Error(str_cat(parts...));
}

// "[2, 3, 4]" for any container of integers (std::vector, c10::IntArrayRef, ...).
template <typename Sizes>
std::string shape_string(const Sizes& sizes) {
    std::ostringstream out;
    out << '[';
    bool first = true;
    for (auto s : sizes) {
        if (!first) out << ", ";
        out << s;
        first = false;
    }
    out << ']';
    return out.str();
}

// shape_string of a tensor's sizes, or "undefined" for an undefined tensor (any type with defined() and sizes()).
template <typename Tensor>
std::string shape_or_undefined(const Tensor& t) {
    return t.defined() ? shape_string(t.sizes()) : std::string("undefined");
}

}  // namespace linvis

// Throws linvis::Error built from the remaining arguments when `cond` is false.
#define LINVIS_CHECK(cond, ...)                  \
    do {                                         \
        if (!(cond)) ::linvis::fail(__VA_ARGS__); \
    } while (0)
