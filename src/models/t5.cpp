// T5 classification model (official T5/models.py, spec vit3_t5_official.md B2, B5, B6): DeiT
// without class token (196 positions, mean pooling) whose attention is T5's TTT attention, on the
// plain-ViT skeleton (plain_vit.h).
#include <cmath>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/deit_t5.h"
#include "linvis/models/registry.h"
#include "linvis/nn/probe.h"
#include "linvis/ops/t5_ttt.h"
#include "plain_vit.h"

namespace linvis::models {
namespace {

// T5/models.py Attention: own parameters w1, w2, w3 (1, h, d, d); children qkv, proj, q_conv2d,
// k_conv2d (depthwise 3x3 with bias over all C channels). Between qkv and proj: ops::t5_ttt_attention.
class T5AttentionImpl : public nn::Mixer {
public:
    T5AttentionImpl(int64_t dim, int64_t heads, ops::Impl impl) : heads_(heads), impl_(impl) {
        const int64_t C = dim, d = C / heads;
        w1 = register_parameter("w1", torch::zeros({1, heads_, d, d}));
        w2 = register_parameter("w2", torch::zeros({1, heads_, d, d}));
        w3 = register_parameter("w3", torch::zeros({1, heads_, d, d}));
        nn::trunc_normal_(w1, 0.02);
        nn::trunc_normal_(w2, 0.02);
        nn::trunc_normal_(w3, 0.02);
        qkv = register_module("qkv", nn::vit_linear(C, 3 * C));
        proj = register_module("proj", nn::vit_linear(C, C));
        auto dw = torch::nn::Conv2dOptions(C, C, 3).padding(1).groups(C).bias(true);
        q_conv2d = register_module("q_conv2d", torch::nn::Conv2d(dw));
        k_conv2d = register_module("k_conv2d", torch::nn::Conv2d(dw));
    }

    torch::Tensor forward(const nn::NormedInput& x, int64_t height, int64_t width) override {
        const ops::T5TttParams params{w1, w2, w3, q_conv2d->weight, q_conv2d->bias, k_conv2d->weight, k_conv2d->bias};
        torch::Tensor packed = x.linear(qkv, nn::elementwise_impl(impl_));
        if (nn::Probe* probe = nn::Probe::active(); probe && (probe->wants("attn.v") || probe->wants("attn.of_v")))
            record_probe(*probe, packed, params, height, width);
        torch::Tensor out = ops::t5_ttt_attention_qkv(packed, params, heads_, height, width, impl_);
        return flops::linear(out, proj->weight, proj->bias);
    }

    torch::Tensor w1, w2, w3;
    torch::nn::Linear qkv{nullptr}, proj{nullptr};
    torch::nn::Conv2d q_conv2d{nullptr}, k_conv2d{nullptr};

private:
    // The values and the attention output as a function of them (q, k fixed): its Jacobian is T5's
    // implicit attention (paper Eq. 13).
    void record_probe(nn::Probe& probe, const torch::Tensor& packed, const ops::T5TttParams& params, int64_t height,
                      int64_t width) const {
        std::vector<torch::Tensor> c = packed.detach().chunk(3, -1);
        probe.record("attn.v", ops::split_heads(c[2], heads_));
        ops::T5TttParams fixed{params.w1.detach(), params.w2.detach(), params.w3.detach(), params.q_conv_weight.detach(),
                               params.q_conv_bias.detach(), params.k_conv_weight.detach(), params.k_conv_bias.detach()};
        const int64_t heads = heads_;
        // The reference: plain autograd through every step, for an exact Jacobian.
        probe.record_function("attn.of_v", [q = c[0], k = c[1], fixed, heads, height, width](const torch::Tensor& v) {
            return ops::split_heads(
                ops::t5_ttt_attention(q, k, ops::merge_heads(v), fixed, heads, height, width, ops::Impl::Reference),
                heads);
        });
    }

    int64_t heads_;
    ops::Impl impl_;
};

ModelPtr make_t5(const ModelConfig& config, const std::string& name, int64_t dim, int64_t heads) {
    return make_timm_vit(config, name, dim, heads, /*class_token=*/false, [](int64_t d, int64_t h, ops::Impl impl) {
        return std::make_shared<T5AttentionImpl>(d, h, impl);
    });
}

const ModelRegistrar t5_tiny("t5_tiny", "t5", "T5-T (Transformer to TTT, DeiT-Ti shape, official T5_tiny): 6.21M params, 1.34 GMACs at 224",
                             [](const ModelConfig& c) { return make_t5(c, "t5_tiny", 192, 3); });
const ModelRegistrar t5_small("t5_small", "t5", "T5-S (Transformer to TTT, DeiT-S shape, official T5_small): 23.03M params, 4.77 GMACs at 224",
                              [](const ModelConfig& c) { return make_t5(c, "t5_small", 384, 6); });

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<std::string> t5_new_parameter_names(const VisionModel& model) {
    static const char* const kNew[] = {".attn.w1", ".attn.w2", ".attn.w3", ".attn.q_conv2d.weight",
                                       ".attn.q_conv2d.bias", ".attn.k_conv2d.weight", ".attn.k_conv2d.bias"};
    std::vector<std::string> names;
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
        const std::string& key = item.key();
        if (key.rfind("blocks.", 0) != 0) continue;
        for (const char* suffix : kNew)
            if (ends_with(key, suffix)) {
                names.push_back(key);
                break;
            }
    }
    LINVIS_CHECK(!names.empty(), "t5_new_parameter_names: the model has no T5 attention parameters "
                                 "(blocks.{i}.attn.w1/w2/w3, attn.q_conv2d, attn.k_conv2d)");
    return names;
}

}  // namespace linvis::models
