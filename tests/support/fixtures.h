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

// |actual - expected| <= rel * max|expected| elementwise, same shape (the fixtures README's tolerance,
// 1e-4 relative to the largest magnitude).
inline ::testing::AssertionResult matches_fixture(const torch::Tensor& actual, const torch::Tensor& expected,
                                                  double rel = 1e-4) {
    if (actual.sizes() != expected.sizes())
        return ::testing::AssertionFailure() << "shape " << actual.sizes() << " vs " << expected.sizes();
    const double scale = expected.abs().max().item<double>();
    const double err = (actual.to(torch::kFloat64) - expected.to(torch::kFloat64)).abs().max().item<double>();
    if (!(err <= rel * scale))
        return ::testing::AssertionFailure() << "max abs err " << err << " > " << rel << " * " << scale;
    return ::testing::AssertionSuccess();
}

// Every generation fixture (DiT, DiT3, DiT5, the VAE) is reproduced to this, relative to its largest
// magnitude. DiT5's tiny fixtures run at a 4x4 token grid, below NATTEN's 5x5 window; the model option
// nat_small_grid=wrap computes what the fixtures' NATTEN stand-in did there (ops::NatSmallGrid::FlatWrap).
constexpr double kGenerationFixtureTolerance = 1e-4;

}  // namespace linvis::testing

// Skips the test (with the reason) when no fixtures directory sits beside the checkout; a present
// directory with a missing or different file fails.
#define LINVIS_REQUIRE_FIXTURES()                                                                      \
    do {                                                                                               \
        if (::linvis::testing::fixtures_dir().empty())                                                 \
            GTEST_SKIP() << "no ../shared/fixtures beside the checkout and LINVIS_FIXTURES unset";     \
    } while (0)
