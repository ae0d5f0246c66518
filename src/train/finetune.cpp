#include "linvis/train/finetune.h"

#include <set>
#include <sstream>

#include "linvis/core/error.h"

namespace linvis::train {

InheritanceReport inherit_weights(torch::nn::Module& target, const std::map<std::string, torch::Tensor>& source,
                                  bool allow_shape_mismatch) {
    InheritanceReport report;
    std::set<std::string> placed;
    torch::NoGradGuard no_grad;
    auto visit = [&](const std::string& name, torch::Tensor& destination, std::vector<std::string>& missing) {
        auto it = source.find(name);
        if (it == source.end()) {
            missing.push_back(name);
            return;
        }
        placed.insert(name);
        if (it->second.sizes() != destination.sizes()) {
            report.shape_mismatch.push_back(name + ": source " + shape_string(it->second.sizes()) + " vs target " +
                                            shape_string(destination.sizes()));
            return;
        }
        destination.copy_(it->second);
        report.copied.push_back(name);
    };
    for (auto& item : target.named_parameters(true)) visit(item.key(), item.value(), report.new_parameters);
    for (auto& item : target.named_buffers(true)) visit(item.key(), item.value(), report.new_buffers);
    for (const auto& [name, tensor] : source)
        if (!placed.count(name)) report.unused.push_back(name);
    if (!allow_shape_mismatch && !report.shape_mismatch.empty()) {
        std::string all;
        for (const auto& m : report.shape_mismatch) all += (all.empty() ? "" : "; ") + m;
        fail("weight inheritance: shape mismatch: ", all);
    }
    return report;
}

std::string describe(const InheritanceReport& report) {
    std::ostringstream out;
    auto list = [&](const char* title, const std::vector<std::string>& names) {
        out << title << " (" << names.size() << ")";
        for (size_t i = 0; i < names.size(); ++i) out << (i == 0 ? ": " : ", ") << names[i];
        out << "\n";
    };
    out << "inherited " << report.copied.size() << " tensors\n";
    list("new parameters", report.new_parameters);
    if (!report.new_buffers.empty()) list("new buffers", report.new_buffers);
    if (!report.shape_mismatch.empty()) list("shape mismatch (kept as initialised)", report.shape_mismatch);
    if (!report.unused.empty()) list("unused source tensors", report.unused);
    return out.str();
}

}  // namespace linvis::train
