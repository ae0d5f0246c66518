// Looking inside a forward pass without reaching into the modules: while a Probe is active on this
// thread, blocks and mixers report the intermediate tensors (and functions) it asks for by name.
// Tools run a model block by block (VisionModel::embed / forward_block) under a Probe; nothing is
// recorded, and nothing extra is computed, when no Probe asks.
//
// Names reported (the component that reports them):
//   "attn.weights"      (B, h, N, N) softmax attention weights           (DeiT's softmax attention)
//   "attn.v"            (B, h, N, d) values                               (DeiT, T5)
//   "attn.of_v"         function v (B, h, N, d) -> mixer output (B, h, N, d) with q, k fixed, whose
//                       Jacobian is T5's implicit attention (paper Eq. 13)   (T5's TTT attention)
//   "ttt.grad_norms.forth", "ttt.grad_norms.back"
//                       (B, nh, T) inner-gradient norms ||G_t|| of each TTT-Linear direction, raster
//                       order (Vision-TTT Eq. 6)                            (Vision-TTT blocks)
#pragma once

#include <functional>
#include <map>
#include <set>
#include <string>

#include <torch/torch.h>

namespace linvis::nn {

class Probe {
public:
    using Function = std::function<torch::Tensor(const torch::Tensor&)>;

    // Activates this probe on the calling thread until it is destroyed (probes nest; the innermost
    // one is active).
    explicit Probe(std::set<std::string> wanted);
    ~Probe();
    Probe(const Probe&) = delete;
    Probe& operator=(const Probe&) = delete;

    bool wants(const std::string& name) const { return wanted_.count(name) != 0; }
    void record(const std::string& name, const torch::Tensor& value);
    void record_function(const std::string& name, Function function);

    // The recorded tensor or function; undefined / empty when nothing reported it.
    torch::Tensor tensor(const std::string& name) const;
    Function function(const std::string& name) const;

    // The active probe of this thread, or nullptr.
    static Probe* active();

private:
    std::set<std::string> wanted_;
    std::map<std::string, torch::Tensor> tensors_;
    std::map<std::string, Function> functions_;
    Probe* previous_ = nullptr;
};

// The active probe when it wants `name`, else nullptr: `if (auto* p = probing("x")) p->record("x", t);`
Probe* probing(const std::string& name);

}  // namespace linvis::nn
