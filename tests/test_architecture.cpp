// The layering of docs/architecture.md, checked on the source tree: core -> io -> ops -> nn -> models
// -> train / tools -> plot, each layer including only layers above it, and no op reference including a
// kernel. Plotting is its own library: the built liblinvis holds none of it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

// plot (the linvis_plot library) ranks below every layer of liblinvis, so none of them can include it.
const std::map<std::string, int> kRank = {{"core", 0},   {"io", 1},    {"ops", 2},   {"nn", 3},
                                          {"models", 4}, {"train", 5}, {"tools", 5}, {"plot", 6}};

// Every linvis include of `file` that names a layer: "linvis/<layer>/..." or, from src/, "<layer>/...".
std::vector<std::pair<std::string, std::string>> layer_includes(const fs::path& file) {
    static const std::regex include(R"re(^\s*#\s*include\s+"(?:linvis/)?([a-z_]+)/([^"]*)")re");
    std::vector<std::pair<std::string, std::string>> found;
    std::ifstream in(file);
    std::string line;
    std::smatch m;
    while (std::getline(in, line))
        if (std::regex_search(line, m, include) && kRank.count(m[1].str())) found.emplace_back(m[1].str(), m[2].str());
    return found;
}

std::vector<std::pair<fs::path, std::string>> layered_files() {
    std::vector<std::pair<fs::path, std::string>> files;
    const fs::path root(LINVIS_SOURCE_DIR);
    for (const fs::path base : {root / "src", root / "include" / "linvis"}) {
        for (const auto& entry : fs::recursive_directory_iterator(base)) {
            if (!entry.is_regular_file()) continue;
            const std::string ext = entry.path().extension().string();
            if (ext != ".cpp" && ext != ".h") continue;
            const std::string layer = fs::relative(entry.path(), base).begin()->string();
            if (kRank.count(layer)) files.emplace_back(entry.path(), layer);
        }
    }
    return files;
}

}  // namespace

TEST(Architecture, LayersOnlyDependDownwards) {
    const auto files = layered_files();
    ASSERT_GT(files.size(), 50u) << "source tree not found at " << LINVIS_SOURCE_DIR;
    for (const auto& [file, layer] : files) {
        for (const auto& [included, rest] : layer_includes(file)) {
            const int from = kRank.at(layer), to = kRank.at(included);
            EXPECT_TRUE(to < from || included == layer)
                << file.string() << " (layer " << layer << ") includes " << included << "/" << rest;
        }
    }
}

TEST(Architecture, OpReferencesIncludeNoKernel) {
    int references = 0;
    for (const auto& [file, layer] : layered_files()) {
        if (layer != "ops" || file.stem() != "reference") continue;
        ++references;
        for (const auto& [included, rest] : layer_includes(file))
            EXPECT_TRUE(rest.find("cpu") == std::string::npos && rest.find("kernel") == std::string::npos)
                << file.string() << " includes " << included << "/" << rest;
    }
    EXPECT_GE(references, 7);
}

namespace {

std::string file_bytes(const char* path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST(Architecture, CoreLibraryHoldsNoPlotting) {
    const std::string core = file_bytes(LINVIS_CORE_LIBRARY), plot = file_bytes(LINVIS_PLOT_LIBRARY);
    ASSERT_FALSE(core.empty()) << LINVIS_CORE_LIBRARY;
    // "6linvis4plot" is how the namespace linvis::plot appears in mangled symbol names.
    EXPECT_NE(plot.find("6linvis4plot"), std::string::npos) << LINVIS_PLOT_LIBRARY;
    EXPECT_EQ(core.find("6linvis4plot"), std::string::npos) << LINVIS_CORE_LIBRARY << " holds plotting code";
    EXPECT_EQ(core.find("stbtt_"), std::string::npos) << LINVIS_CORE_LIBRARY << " uses stb_truetype";
}
