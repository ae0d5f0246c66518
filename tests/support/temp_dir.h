// Test helpers for files: a fresh temporary directory per test, raw byte writers, and an
// expectation that a call throws linvis::Error naming given facts.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "linvis/core/error.h"

namespace linvis::testing {

// A uniquely named directory (mkdtemp) under the system temp dir, removed with its contents
// when the object goes out of scope.
class TempDir {
public:
    explicit TempDir(const std::string& prefix = "linvis") {
        std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
        if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
        path = pattern;
    }
    ~TempDir() {
        std::error_code ignored;
        std::filesystem::remove_all(path, ignored);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;

    std::string file(const std::string& name) const { return (path / name).string(); }

    std::filesystem::path path;
};

inline void write_file(const std::string& file, const std::string& bytes) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << "cannot write " << file;
}

inline void write_bytes(const std::string& file, const std::vector<uint8_t>& bytes) {
    write_file(file, std::string(bytes.begin(), bytes.end()));
}

// Runs `f` and expects a linvis::Error whose message contains every needle.
template <typename F>
void expect_error_containing(F&& f, const std::vector<std::string>& needles) {
    try {
        f();
        ADD_FAILURE() << "no linvis::Error thrown";
    } catch (const Error& e) {
        for (const auto& needle : needles)
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
                << "message '" << e.what() << "' lacks '" << needle << "'";
    }
}

}  // namespace linvis::testing
