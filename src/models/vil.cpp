// Vision-LSTM v2 (VisionLSTM2, the released vil2-tiny/small/base checkpoints): spec
// vil_official.md sections 1-3. Registered as vil_tiny, vil_small, vil_base.
//
// Model options: num_classes (1000), img_size (224), in_chans (3), patch_size (16),
// embed_dim (192/384/768), depth (12: number of block *pairs*, i.e. 24 mLSTM sub-blocks),
// drop_path_rate (0), mlstm_mode (parallel|chunkwise|recurrent, default parallel = the official
// form with impl=reference, chunkwise otherwise), chunk_size (64), impl (auto | reference | fused;
// auto and fused run the fused chunkwise kernel, and fused rejects mode parallel or recurrent).
#include <regex>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/models/registry.h"
#include "linvis/nn/vil.h"
#include "linvis/ops/impl.h"
#include "linvis/ops/mlstm.h"
#include "plain_vit.h"

namespace linvis::models {
namespace {

// VisionLSTM2 on the plain-ViT skeleton: blocks are mLSTM block pairs (alternating scan directions),
// a 2-D learnable position embedding, bilateral pooling and the raw training checkpoints' names.
class VisionLstm2 : public PlainVit {
public:
    using PlainVit::PlainVit;

    // Raw training-checkpoint names (3.2) -> hub names; hub names pass unchanged; causal_mask is dropped.
    std::string map_checkpoint_key(const std::string& key) const override {
        static const std::regex block_re(R"(^xlstm\.blocks\.(\d+)\.(xlstm_norm|xlstm)\.(.+)$)");
        std::smatch m;
        if (key.find("causal_mask") != std::string::npos) return "";
        if (std::regex_match(key, m, block_re)) {
            const int64_t i = std::stoll(m[1].str());
            const std::string dir = i % 2 == 0 ? "rowwise_from_top_left" : "rowwise_from_bot_right";
            const std::string prefix = "blocks." + std::to_string(i / 2) + "." + dir + ".";
            if (m[2].str() == "xlstm_norm") return prefix + "norm." + m[3].str();
            std::string rest = m[3].str();
            if (rest.rfind("conv1d.", 0) == 0) rest = "conv." + rest.substr(7);
            return prefix + "layer." + rest;
        }
        if (key.rfind("xlstm.post_blocks_norm.", 0) == 0) return "norm." + key.substr(23);
        if (key.rfind("head.0.", 0) == 0) return "legacy_norm." + key.substr(7);
        if (key.rfind("head.1.", 0) == 0) return "head." + key.substr(7);
        return PlainVit::map_checkpoint_key(key);
    }

};

ModelPtr create_vil(const ModelConfig& cfg, const std::string& name, int64_t embed_dim) {
    PlainVitOptions defaults;
    defaults.name = name;
    defaults.embed_dim = embed_dim;
    defaults.pos_embed = PosEmbedKind::Grid;
    defaults.pooling = Pooling::Bilateral;
    defaults.drop_path_decay = false;  // drop_path_decay=False in the official configs
    defaults.head_init_std = 2e-5;
    const PlainVitOptions o = read_plain_vit_options(cfg, defaults);
    LINVIS_CHECK(o.embed_dim % 2 == 0, name, ": embed_dim must be even, got ", o.embed_dim);
    // The fused kernel is the chunkwise form, so impl auto or fused selects it unless a mode is named.
    const ops::MlstmMode mode = ops::parse_mlstm_mode(
        cfg.get_string("mlstm_mode", o.impl == ops::Impl::Reference ? "parallel" : "chunkwise"));
    LINVIS_CHECK(o.impl != ops::Impl::Fused || mode == ops::MlstmMode::Chunkwise,
                 "vil: impl 'fused' needs mlstm_mode 'chunkwise', got mlstm_mode '", ops::mlstm_mode_name(mode), "'");
    const int64_t chunk_size = cfg.get_int("chunk_size", ops::kMlstmDefaultChunkSize);
    LINVIS_CHECK(chunk_size > 0, "vil: chunk_size: expected > 0, got ", chunk_size);
    // Block-level checkpointing recomputes whole blocks already: the cells inside need not be recomputed twice.
    const bool recompute_scans = cfg.get_bool("recompute_scans", !o.grad_checkpointing);
    auto model = std::make_shared<VisionLstm2>(
        o,
        [&](int64_t, double drop_path) {
            auto pair = std::make_shared<nn::VilBlockPairImpl>(o.embed_dim, drop_path, mode, chunk_size, o.impl);
            for (nn::VilBlock* sub : {&pair->rowwise_from_top_left, &pair->rowwise_from_bot_right})
                (*sub)->layer->recompute_scans = recompute_scans;
            return pair;
        },
        torch::nn::AnyModule(nn::ResidualLayerNorm(o.embed_dim, 1e-6)));  // hub eps (1.13)
    // VitPatchEmbed: xavier_uniform on the flattened kernel, zero bias.
    torch::NoGradGuard no_grad;
    auto& proj = model->patch_embed->proj;
    torch::nn::init::xavier_uniform_(proj->weight.view({o.embed_dim, -1}));
    proj->bias.zero_();
    return model;
}

const ModelRegistrar kTiny("vil_tiny", "vil", "Vision-LSTM ViL-T (VisionLSTM2, 6.4M params, Alkin et al. 2024)",
                           [](const ModelConfig& c) { return create_vil(c, "vil_tiny", 192); });
const ModelRegistrar kSmall("vil_small", "vil", "Vision-LSTM ViL-S (VisionLSTM2, 23.4M params, Alkin et al. 2024)",
                            [](const ModelConfig& c) { return create_vil(c, "vil_small", 384); });
const ModelRegistrar kBase("vil_base", "vil", "Vision-LSTM ViL-B (VisionLSTM2, 89.3M params, Alkin et al. 2024)",
                           [](const ModelConfig& c) { return create_vil(c, "vil_base", 768); });

}  // namespace
}  // namespace linvis::models
