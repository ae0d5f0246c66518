// The VAE decoder (include/linvis/models/vae.h) against diffusers' AutoencoderKL.decode
// (../shared/fixtures/generation/vae_tiny.*), its three key-naming schemes and the sd-vae-ft size.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <regex>

#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "linvis/models/pretrained.h"
#include "linvis/models/registry.h"
#include "linvis/models/vae.h"
#include "support/fixtures.h"
#include "support/temp_dir.h"

using linvis::testing::matches_fixture;

namespace {

using linvis::models::ModelConfig;

const ModelConfig kTiny(std::map<std::string, std::string>{{"block_out_channels", "32,32,64,64"}});

torch::Tensor decode_with(const std::string& weights) {
    auto vae = linvis::models::create_vae_decoder("sd_vae_decoder", kTiny);
    linvis::models::load_model_weights(*vae, weights);
    vae->eval();
    torch::NoGradGuard g;
    auto f = linvis::testing::load_fixture("generation/vae_tiny.io.safetensors");
    return vae->decode(f["latent"] / linvis::models::kSdVaeScale);
}

TEST(Vae, DecodeMatchesDiffusers) {
    LINVIS_REQUIRE_FIXTURES();
    auto f = linvis::testing::load_fixture("generation/vae_tiny.io.safetensors");
    EXPECT_TRUE(matches_fixture(decode_with(linvis::testing::fixtures_dir() + "/generation/vae_tiny.weights.safetensors"),
                                 f["image"]));
}

// The same weights renamed to the old diffusers attention names and to the CompVis/LDM names
// (reversed up-block index, nin_shortcut, norm_out, 1x1-conv attention weights) decode identically.
TEST(Vae, LegacyKeySchemesLoad) {
    LINVIS_REQUIRE_FIXTURES();
    auto f = linvis::testing::load_fixture("generation/vae_tiny.io.safetensors");
    auto w = linvis::testing::load_fixture("generation/vae_tiny.weights.safetensors");
    std::map<std::string, torch::Tensor> old_diffusers, ldm;
    const std::string attn = "decoder.mid_block.attentions.0.";
    for (const auto& [k, v] : w) {
        std::string o = k;
        for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
                 {"to_q.", "query."}, {"to_k.", "key."}, {"to_v.", "value."}, {"to_out.0.", "proj_attn."}})
            if (o.rfind(attn + from, 0) == 0) o = attn + to + o.substr(attn.size() + from.size());
        old_diffusers[o] = v;

        std::string l = k;
        torch::Tensor lv = v;
        std::smatch m;
        static const std::regex up(R"(^decoder\.up_blocks\.(\d)\.(resnets|upsamplers)\.(\d)\.(.*)$)");
        if (std::regex_match(k, m, up)) {
            const int i = 3 - std::stoi(m[1].str());
            l = m[2].str() == "resnets" ? "decoder.up." + std::to_string(i) + ".block." + m[3].str() + "." + m[4].str()
                                        : "decoder.up." + std::to_string(i) + ".upsample." + m[4].str();
        }
        for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
                 {"decoder.mid_block.resnets.0.", "decoder.mid.block_1."},
                 {"decoder.mid_block.resnets.1.", "decoder.mid.block_2."},
                 {attn + "group_norm.", "decoder.mid.attn_1.norm."},
                 {attn + "to_q.", "decoder.mid.attn_1.q."},
                 {attn + "to_k.", "decoder.mid.attn_1.k."},
                 {attn + "to_v.", "decoder.mid.attn_1.v."},
                 {attn + "to_out.0.", "decoder.mid.attn_1.proj_out."},
                 {"decoder.conv_norm_out.", "decoder.norm_out."}})
            if (l.rfind(from, 0) == 0) l = to + l.substr(from.size());
        if (auto p = l.find(".conv_shortcut."); p != std::string::npos) l = l.substr(0, p) + ".nin_shortcut." + l.substr(p + 15);
        if (l.rfind("decoder.mid.attn_1.", 0) == 0 && v.dim() == 2) lv = v.reshape({v.size(0), v.size(1), 1, 1});
        ldm["first_stage_model." + l] = lv;
    }
    ASSERT_TRUE(ldm.count("first_stage_model.decoder.up.1.block.0.nin_shortcut.weight"));  // up_blocks.2: 64 -> 32
    ASSERT_EQ(ldm["first_stage_model.decoder.mid.attn_1.q.weight"].dim(), 4);
    linvis::testing::TempDir dir;
    const std::string p1 = dir.file("old.safetensors"), p2 = dir.file("ldm.safetensors");
    linvis::io::save_safetensors(p1, old_diffusers);
    linvis::io::save_safetensors(p2, ldm);
    EXPECT_TRUE(matches_fixture(decode_with(p1), f["image"]));
    EXPECT_TRUE(matches_fixture(decode_with(p2), f["image"]));
}

// post_quant_conv + decoder of sd-vae-ft-mse: 49,490,199 parameters (spec §5).
TEST(Vae, SdVaeFtSize) {
    auto vae = linvis::models::create_vae_decoder("sd_vae_decoder");
    EXPECT_EQ(linvis::models::count_parameters(*vae), 49490199);
    EXPECT_EQ(vae->upsampling_factor(), 8);
}

TEST(Vae, BadInput) {
    auto vae = linvis::models::create_vae_decoder("sd_vae_decoder", kTiny);
    EXPECT_THROW(vae->decode(torch::randn({1, 3, 4, 4})), linvis::Error);
    EXPECT_THROW(linvis::models::create_vae_decoder("sd_vae_decoder", ModelConfig().set("block_out_channels", std::string("30,64"))),
                 linvis::Error);
    EXPECT_THROW(linvis::models::create_vae_decoder("dit_s2"), linvis::Error);
}

}  // namespace
