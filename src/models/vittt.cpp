// Vision-TTT (Kong et al., seeds 000/002) as pinned down by spec/vittt.md: patch embedding,
// absolute position embedding (no class token), Vittt blocks, final LayerNorm, mean pool,
// linear head, on the plain-ViT skeleton (plain_vit.h). Registers vittt_tiny / vittt_small /
// vittt_base. Details: docs/vittt.md.
#include <algorithm>

#include "linvis/models/registry.h"
#include "linvis/nn/vittt_block.h"
#include "plain_vit.h"

namespace linvis::models {
namespace {

ModelPtr create_vittt(const ModelConfig& config, const std::string& name, int64_t embed_dim) {
    PlainVitOptions defaults;
    defaults.name = name;
    defaults.embed_dim = embed_dim;
    defaults.pos_embed = PosEmbedKind::Tokens;
    defaults.pooling = Pooling::Mean;
    const PlainVitOptions o = read_plain_vit_options(config, defaults);
    nn::VitttBlockOptions block;
    block.branch.dim = o.embed_dim;
    block.branch.num_heads = config.get_int("num_heads", std::max<int64_t>(1, o.embed_dim / 64));  // head dim 64
    block.branch.mini_batch_size = config.get_int("mini_batch_size", block.branch.mini_batch_size);
    block.branch.learnable_w0 = config.get_bool("learnable_w0", block.branch.learnable_w0);
    block.branch.impl = o.impl;
    block.mlp_hidden = 8 * o.embed_dim / 3;
    block.shared_directions = config.get_bool("shared_directions", block.shared_directions);
    // Block-level checkpointing recomputes whole blocks already: the scans inside need not be recomputed twice.
    block.recompute_scans = config.get_bool("recompute_scans", !o.grad_checkpointing);
    return std::make_shared<PlainVit>(o, [block](int64_t, double drop_path) mutable {
        block.drop_path = drop_path;
        return std::make_shared<nn::VitttBlockImpl>(block);
    });
}

const ModelRegistrar register_tiny("vittt_tiny", "vittt", "Vision-TTT tiny (Kong et al. 2026): D 192, 12 blocks, 3 heads",
                                   [](const ModelConfig& c) { return create_vittt(c, "vittt_tiny", 192); });
const ModelRegistrar register_small("vittt_small", "vittt",
                                    "Vision-TTT small (Kong et al. 2026): D 384, 12 blocks, 6 heads",
                                    [](const ModelConfig& c) { return create_vittt(c, "vittt_small", 384); });
const ModelRegistrar register_base("vittt_base", "vittt", "Vision-TTT base (Kong et al. 2026): D 768, 12 blocks, 12 heads",
                                   [](const ModelConfig& c) { return create_vittt(c, "vittt_base", 768); });

}  // namespace
}  // namespace linvis::models
