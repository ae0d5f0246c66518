// Reference outputs of the official code (the shared fixtures directory next to the repository,
// ../shared/fixtures, or $LINVIS_FIXTURES): lookup and loading for the tests that reproduce them.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/io/safetensors.h"

namespace linvis::testing {

// The fixtures directory, or "" when this checkout has none beside it.
inline std::string fixtures_dir() {
    if (const char* env = std::getenv("LINVIS_FIXTURES"); env != nullptr && *env != '\0') return env;
    const std::filesystem::path dir = std::filesystem::path(LINVIS_SOURCE_DIR).parent_path() / "shared" / "fixtures";
    return std::filesystem::is_directory(dir) ? dir.string() : std::string();
}

// Every tensor of fixtures/<relative>. Fails the test if the fixtures exist but the file does not.
inline std::map<std::string, torch::Tensor> load_fixture(const std::string& relative) {
    const std::string path = fixtures_dir() + "/" + relative;
    return io::SafetensorsFile::open(path).load_all();
}

}  // namespace linvis::testing

// Skips the test (with the reason) when no fixtures directory sits beside the checkout; a present
// directory with a missing or different file fails.
#define LINVIS_REQUIRE_FIXTURES()                                                                      \
    do {                                                                                               \
        if (::linvis::testing::fixtures_dir().empty())                                                 \
            GTEST_SKIP() << "no ../shared/fixtures beside the checkout and LINVIS_FIXTURES unset";     \
    } while (0)
