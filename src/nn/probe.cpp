#include "linvis/nn/probe.h"

namespace linvis::nn {
namespace {
thread_local Probe* active_probe = nullptr;
}

Probe::Probe(std::set<std::string> wanted) : wanted_(std::move(wanted)), previous_(active_probe) {
    active_probe = this;
}

Probe::~Probe() { active_probe = previous_; }

void Probe::record(const std::string& name, const torch::Tensor& value) { tensors_[name] = value; }

void Probe::record_function(const std::string& name, Function function) { functions_[name] = std::move(function); }

torch::Tensor Probe::tensor(const std::string& name) const {
    auto it = tensors_.find(name);
    return it == tensors_.end() ? torch::Tensor() : it->second;
}

Probe::Function Probe::function(const std::string& name) const {
    auto it = functions_.find(name);
    return it == functions_.end() ? Function() : it->second;
}

Probe* Probe::active() { return active_probe; }

Probe* probing(const std::string& name) {
    Probe* probe = Probe::active();
    return probe != nullptr && probe->wants(name) ? probe : nullptr;
}

}  // namespace linvis::nn
