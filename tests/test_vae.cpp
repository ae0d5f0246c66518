// The VAE decoder and encoder (include/linvis/models/vae.h) against diffusers' AutoencoderKL.decode
// (../shared/fixtures/generation/vae_tiny.*) and AutoencoderKL.encode(image).latent_dist
// (tests/data/vae/vae_tiny_encode.safetensors, written by tests/data/vae/make_encoder_reference.py with
// diffusers 0.42.1 from the same vae_tiny weights), the three key-naming schemes and the sd-vae-ft sizes.
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

// The full autoencoder file renamed to the old diffusers attention names (query/key/value/proj_attn, in
// both mid blocks).
std::map<std::string, torch::Tensor> old_diffusers_names(const std::map<std::string, torch::Tensor>& w) {
    std::map<std::string, torch::Tensor> out;
    for (const auto& [k, v] : w) {
        std::string o = k;
        for (const std::string part : {"encoder", "decoder"}) {
            const std::string attn = part + ".mid_block.attentions.0.";
            for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
                     {"to_q.", "query."}, {"to_k.", "key."}, {"to_v.", "value."}, {"to_out.0.", "proj_attn."}})
                if (o.rfind(attn + from, 0) == 0) o = attn + to + o.substr(attn.size() + from.size());
        }
        out[o] = v;
    }
    return out;
}

// The same file with the CompVis/LDM names under first_stage_model. (reversed up-block index, down.{i}.block /
// downsample, nin_shortcut, norm_out, 1x1-conv attention weights).
std::map<std::string, torch::Tensor> ldm_names(const std::map<std::string, torch::Tensor>& w) {
    std::map<std::string, torch::Tensor> out;
    for (const auto& [k, v] : w) {
        std::string l = k;
        torch::Tensor lv = v;
        std::smatch m;
        static const std::regex up(R"(^decoder\.up_blocks\.(\d)\.(resnets|upsamplers)\.(\d)\.(.*)$)");
        static const std::regex down(R"(^encoder\.down_blocks\.(\d)\.(resnets|downsamplers)\.(\d)\.(.*)$)");
        if (std::regex_match(k, m, up)) {
            const int i = 3 - std::stoi(m[1].str());
            l = m[2].str() == "resnets" ? "decoder.up." + std::to_string(i) + ".block." + m[3].str() + "." + m[4].str()
                                        : "decoder.up." + std::to_string(i) + ".upsample." + m[4].str();
        } else if (std::regex_match(k, m, down)) {
            l = m[2].str() == "resnets" ? "encoder.down." + m[1].str() + ".block." + m[3].str() + "." + m[4].str()
                                        : "encoder.down." + m[1].str() + ".downsample." + m[4].str();
        }
        for (const std::string part : {"encoder", "decoder"}) {
            const std::string attn = part + ".mid_block.attentions.0.";
            for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
                     {part + ".mid_block.resnets.0.", part + ".mid.block_1."},
                     {part + ".mid_block.resnets.1.", part + ".mid.block_2."},
                     {attn + "group_norm.", part + ".mid.attn_1.norm."},
                     {attn + "to_q.", part + ".mid.attn_1.q."},
                     {attn + "to_k.", part + ".mid.attn_1.k."},
                     {attn + "to_v.", part + ".mid.attn_1.v."},
                     {attn + "to_out.0.", part + ".mid.attn_1.proj_out."},
                     {part + ".conv_norm_out.", part + ".norm_out."}})
                if (l.rfind(from, 0) == 0) l = to + l.substr(from.size());
            if (l.rfind(part + ".mid.attn_1.", 0) == 0 && v.dim() == 2) lv = v.reshape({v.size(0), v.size(1), 1, 1});
        }
        if (auto p = l.find(".conv_shortcut."); p != std::string::npos) l = l.substr(0, p) + ".nin_shortcut." + l.substr(p + 15);
        out["first_stage_model." + l] = lv;
    }
    return out;
}

// The fixture's full autoencoder in the three key-naming schemes: diffusers' current names (the file as
// it is), the old diffusers attention names and the LDM names, written into `dir`.
std::vector<std::string> weights_in_three_schemes(const linvis::testing::TempDir& dir) {
    auto w = linvis::testing::load_fixture("generation/vae_tiny.weights.safetensors");
    auto old_diffusers = old_diffusers_names(w);
    auto ldm = ldm_names(w);
    EXPECT_TRUE(old_diffusers.count("encoder.mid_block.attentions.0.query.weight"));
    EXPECT_TRUE(old_diffusers.count("decoder.mid_block.attentions.0.proj_attn.bias"));
    EXPECT_TRUE(ldm.count("first_stage_model.decoder.up.1.block.0.nin_shortcut.weight"));  // up_blocks.2: 64 -> 32
    EXPECT_TRUE(ldm.count("first_stage_model.encoder.down.2.block.0.nin_shortcut.weight"));  // 32 -> 64
    EXPECT_TRUE(ldm.count("first_stage_model.encoder.down.0.downsample.conv.weight"));
    EXPECT_TRUE(ldm.count("first_stage_model.encoder.norm_out.weight"));
    EXPECT_TRUE(ldm.count("first_stage_model.quant_conv.weight"));
    EXPECT_EQ(ldm["first_stage_model.decoder.mid.attn_1.q.weight"].dim(), 4);
    EXPECT_EQ(ldm["first_stage_model.encoder.mid.attn_1.proj_out.weight"].dim(), 4);
    EXPECT_EQ(ldm.size(), w.size());
    const std::string p1 = dir.file("old.safetensors"), p2 = dir.file("ldm.safetensors");
    linvis::io::save_safetensors(p1, old_diffusers);
    linvis::io::save_safetensors(p2, ldm);
    return {linvis::testing::fixtures_dir() + "/generation/vae_tiny.weights.safetensors", p1, p2};
}

// The same weights renamed to the old diffusers attention names and to the CompVis/LDM names decode identically.
TEST(Vae, LegacyKeySchemesLoad) {
    LINVIS_REQUIRE_FIXTURES();
    auto f = linvis::testing::load_fixture("generation/vae_tiny.io.safetensors");
    linvis::testing::TempDir dir;
    const auto paths = weights_in_three_schemes(dir);
    EXPECT_TRUE(matches_fixture(decode_with(paths[1]), f["image"]));
    EXPECT_TRUE(matches_fixture(decode_with(paths[2]), f["image"]));
}

std::map<std::string, torch::Tensor> encoder_reference() {
    return linvis::io::SafetensorsFile::open(std::string(LINVIS_TEST_DATA_DIR) + "/vae/vae_tiny_encode.safetensors").load_all();
}

// sd_vae_encoder vs diffusers' vae.encode(image).latent_dist on a (1, 3, 32, 48) image: mean, the clamped
// logvar and mean + std * eps for the reference's eps, to 1e-4 relative, from each key-naming scheme.
TEST(Vae, EncodeMatchesDiffusersInAllKeySchemes) {
    LINVIS_REQUIRE_FIXTURES();
    const auto ref = encoder_reference();
    ASSERT_EQ(ref.at("mean").sizes(), (std::vector<int64_t>{1, 4, 4, 6}));
    linvis::testing::TempDir dir;
    for (const std::string& path : weights_in_three_schemes(dir)) {
        SCOPED_TRACE(path);
        auto vae = linvis::models::create_vae_encoder("sd_vae_encoder", kTiny);
        linvis::models::load_model_weights(*vae, path);
        vae->eval();
        torch::NoGradGuard g;
        const linvis::models::LatentDistribution d = vae->encode(ref.at("image"));
        EXPECT_TRUE(matches_fixture(d.mean, ref.at("mean")));
        EXPECT_TRUE(matches_fixture(d.logvar, ref.at("logvar")));
        EXPECT_TRUE(matches_fixture(d.sample(ref.at("eps")), ref.at("sample")));
    }
}

// logvar is clamped to [-30, 20] (diffusers DiagonalGaussianDistribution): a quant_conv bias far outside
// gives exactly the bounds, and std = exp(0.5 logvar).
TEST(Vae, LogvarIsClamped) {
    auto vae = linvis::models::create_vae_encoder("sd_vae_encoder", kTiny);
    auto* qc = vae->named_parameters().find("quant_conv.bias");
    ASSERT_NE(qc, nullptr);
    torch::NoGradGuard g;
    qc->slice(0, 4, 6).fill_(100.0);
    qc->slice(0, 6, 8).fill_(-100.0);
    const auto d = vae->encode(torch::zeros({2, 3, 16, 16}));
    EXPECT_EQ(d.mean.sizes(), (std::vector<int64_t>{2, 4, 2, 2}));
    EXPECT_TRUE(torch::equal(d.logvar.slice(1, 0, 2), torch::full({2, 2, 2, 2}, 20.0)));
    EXPECT_TRUE(torch::equal(d.logvar.slice(1, 2, 4), torch::full({2, 2, 2, 2}, -30.0)));
    EXPECT_TRUE(torch::allclose(d.std(), torch::exp(0.5 * d.logvar)));
}

// post_quant_conv + decoder of sd-vae-ft-mse: 49,490,199 parameters (spec §5); encoder + quant_conv:
// 34,163,664 (diffusers 0.42.1 AutoencoderKL with that config: 83,653,863 in all).
TEST(Vae, SdVaeFtSize) {
    auto vae = linvis::models::create_vae_decoder("sd_vae_decoder");
    EXPECT_EQ(linvis::models::count_parameters(*vae), 49490199);
    EXPECT_EQ(vae->upsampling_factor(), 8);
    auto encoder = linvis::models::create_vae_encoder("sd_vae_encoder");
    EXPECT_EQ(linvis::models::count_parameters(*encoder), 34163664);
    EXPECT_EQ(encoder->downsampling_factor(), 8);
}

TEST(Vae, BadInput) {
    auto vae = linvis::models::create_vae_decoder("sd_vae_decoder", kTiny);
    EXPECT_THROW(vae->decode(torch::randn({1, 3, 4, 4})), linvis::Error);
    EXPECT_THROW(linvis::models::create_vae_decoder("sd_vae_decoder", ModelConfig().set("block_out_channels", std::string("30,64"))),
                 linvis::Error);
    EXPECT_THROW(linvis::models::create_vae_decoder("dit_s2"), linvis::Error);
    EXPECT_THROW(linvis::models::create_vae_decoder("sd_vae_encoder"), linvis::Error);
    auto encoder = linvis::models::create_vae_encoder("sd_vae_encoder", kTiny);
    EXPECT_THROW(encoder->encode(torch::randn({1, 4, 16, 16})), linvis::Error);
    EXPECT_THROW(encoder->encode(torch::randn({3, 16, 16})), linvis::Error);
    EXPECT_THROW(linvis::models::create_vae_encoder("sd_vae_decoder"), linvis::Error);
    EXPECT_THROW(linvis::models::create_vae_encoder("sd_vae_encoder", ModelConfig().set("double_z", std::string("false"))),
                 linvis::Error);
}

}  // namespace
