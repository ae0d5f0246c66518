// Plain (isotropic) ViT³: vit3_tiny / vit3_small / vit3_base (spec vit3_t5_official.md A3,
// official vittt/models/vittt.py). timm-0.4.12 ViT with the TTT mixer and a depthwise CPE per
// block; no cls token and no absolute position embedding, so any input size whose sides are
// multiples of the patch size works without adapting weights. Built on the plain-ViT skeleton.
#include "linvis/models/registry.h"
#include "linvis/nn/vit3_layers.h"
#include "plain_vit.h"

namespace linvis::models {
namespace {

struct Vit3Size {
    int64_t embed_dim, depth, num_heads;
};

ModelFactory factory(const std::string& name, Vit3Size size) {
    return [name, size](const ModelConfig& config) -> ModelPtr {
        PlainVitOptions defaults;
        defaults.name = name;
        defaults.embed_dim = size.embed_dim;
        defaults.depth = size.depth;
        defaults.pos_embed = PosEmbedKind::None;
        defaults.pooling = Pooling::Mean;
        return make_transformer_vit(
            config, defaults, size.num_heads,
            [](int64_t d, int64_t h, ops::Impl impl) { return nn::Vit3Ttt(d, h, /*qkv_bias=*/true, impl).ptr(); },
            /*cpe=*/true);
    };
}

const ModelRegistrar reg_tiny("vit3_tiny", "vit3", "ViT³-T (arXiv 2512.01643): 192 wide, 12 blocks, 6 heads; 6.15M params",
                              factory("vit3_tiny", {192, 12, 6}));
const ModelRegistrar reg_small("vit3_small", "vit3",
                               "ViT³-S (arXiv 2512.01643): 384 wide, 12 blocks, 6 heads; 23.80M params",
                               factory("vit3_small", {384, 12, 6}));
const ModelRegistrar reg_base("vit3_base", "vit3",
                              "ViT³-B (arXiv 2512.01643): 768 wide, 12 blocks, 12 heads; 90.06M params",
                              factory("vit3_base", {768, 12, 12}));

}  // namespace
}  // namespace linvis::models
