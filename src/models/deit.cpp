// DeiT = timm VisionTransformer with softmax attention (deit_{tiny,small,base}_patch16_224), on the
// plain-ViT skeleton (plain_vit.h).
#include <cmath>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/deit_t5.h"
#include "linvis/models/registry.h"
#include "linvis/nn/probe.h"
#include "linvis/ops/attention.h"
#include "plain_vit.h"

namespace linvis::models {
namespace {

// timm Attention: qkv (C -> 3C, bias), reshape (B, N, 3, h, d), (q @ k^T) * d^-0.5, softmax, @ v, proj.
class SoftmaxAttentionImpl : public nn::Mixer {
public:
    SoftmaxAttentionImpl(int64_t dim, int64_t heads, ops::Impl impl)
        : heads_(heads), scale_(std::pow(static_cast<double>(dim / heads), -0.5)), impl_(impl) {
        qkv = register_module("qkv", nn::vit_linear(dim, 3 * dim));
        proj = register_module("proj", nn::vit_linear(dim, dim));
    }

    torch::Tensor forward(const nn::NormedInput& x, int64_t, int64_t) override {
        const int64_t B = x.input().size(0), N = x.input().size(1), C = x.input().size(2);
        // unbind, not three selects: its backward stacks the three gradients in one pass, where each select's
        // would zero a full (3, B, h, N, d) tensor and the three would then be added.
        const std::vector<torch::Tensor> qkv_heads = x.linear(qkv, nn::elementwise_impl(impl_))
                                                         .reshape({B, N, 3, heads_, C / heads_})
                                                         .permute({2, 0, 3, 1, 4})
                                                         .unbind(0);
        const torch::Tensor &q = qkv_heads[0], &k = qkv_heads[1], &v = qkv_heads[2];
        if (auto* probe = nn::probing("attn.weights"))
            probe->record("attn.weights", torch::softmax(torch::matmul(q, k.transpose(-2, -1)) * scale_, -1));
        if (auto* probe = nn::probing("attn.v")) probe->record("attn.v", v);
        torch::Tensor out = ops::softmax_attention(q, k, v, scale_, {}, impl_);
        return flops::linear(out.transpose(1, 2).reshape({B, N, C}), proj->weight, proj->bias);
    }

    torch::nn::Linear qkv{nullptr}, proj{nullptr};

private:
    int64_t heads_;
    double scale_;
    ops::Impl impl_;
};

ModelPtr make_deit(const ModelConfig& config, const std::string& name, int64_t dim, int64_t heads) {
    return make_timm_vit(config, name, dim, heads, /*class_token=*/true, [](int64_t d, int64_t h, ops::Impl impl) {
        return std::make_shared<SoftmaxAttentionImpl>(d, h, impl);
    });
}

const ModelRegistrar deit_tiny("deit_tiny", "deit", "DeiT-Ti (timm deit_tiny_patch16_224): 5.72M params, 1.25 GMACs at 224",
                               [](const ModelConfig& c) { return make_deit(c, "deit_tiny", 192, 3); });
const ModelRegistrar deit_small("deit_small", "deit", "DeiT-S (timm deit_small_patch16_224): 22.05M params, 4.60 GMACs at 224",
                                [](const ModelConfig& c) { return make_deit(c, "deit_small", 384, 6); });
const ModelRegistrar deit_base("deit_base", "deit", "DeiT-B (timm deit_base_patch16_224): 86.57M params, 17.56 GMACs at 224",
                               [](const ModelConfig& c) { return make_deit(c, "deit_base", 768, 12); });

}  // namespace
}  // namespace linvis::models
