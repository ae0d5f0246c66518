// Interpretability maps: ERF, Gradient Magnitude Map, attention (explicit and implicit).
// See include/linvis/tools/explain.h and docs/explain.md.
#include "linvis/tools/explain.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "linvis/core/error.h"
#include "linvis/nn/probe.h"

namespace linvis::tools::explain {
namespace {

// Puts a module in eval mode for the lifetime of the guard, then restores its mode.
class EvalModeGuard {
public:
    explicit EvalModeGuard(torch::nn::Module& module) : module_(module), was_training_(module.is_training()) {
        module_.eval();
    }
    ~EvalModeGuard() { module_.train(was_training_); }
    EvalModeGuard(const EvalModeGuard&) = delete;
    EvalModeGuard& operator=(const EvalModeGuard&) = delete;

private:
    torch::nn::Module& module_;
    bool was_training_;
};

// (3, H, W) -> (1, 3, H, W); (1, 3, H, W) unchanged.
torch::Tensor as_single_batch(const torch::Tensor& image, const char* what) {
    LINVIS_CHECK(image.defined(), what, ": image is undefined");
    if (image.dim() == 3) return image.unsqueeze(0);
    LINVIS_CHECK(image.dim() == 4 && image.size(0) == 1, what, ": image: expected (C, H, W) or (1, C, H, W), got ",
                 shape_string(image.sizes()));
    return image;
}

// Finds (prefix, h, w) with T - prefix = h * w square patches tiling an H x W image.
bool token_grid(int64_t T, int64_t H, int64_t W, int64_t prefix, int64_t& h, int64_t& w) {
    const int64_t n = T - prefix;
    if (n <= 0) return false;
    for (int64_t hh = 1; hh <= n; ++hh) {
        if (n % hh != 0) continue;
        const int64_t ww = n / hh;
        if (H % hh == 0 && W % ww == 0 && H / hh == W / ww) {
            h = hh;
            w = ww;
            return true;
        }
    }
    return false;
}

int64_t resolve_block(const models::VisionModel& model, int64_t block, const char* what) {
    const int64_t depth = model.num_blocks();
    LINVIS_CHECK(depth > 0, what, ": the model exposes no blocks to probe (plain ViT families do)");
    const int64_t b = block < 0 ? block + depth : block;
    LINVIS_CHECK(b >= 0 && b < depth, what, ": block ", block, " out of range for depth ", depth);
    return b;
}

// The model's embedding of `images` and the blocks before `block`: the input of block `block`.
models::VisionModel::Embedding input_of_block(models::VisionModel& model, const torch::Tensor& images,
                                              int64_t block) {
    models::VisionModel::Embedding e = model.embed(images);
    for (int64_t i = 0; i < block; ++i) e.tokens = model.forward_block(i, e.tokens, e.height, e.width);
    return e;
}

}  // namespace

// ------------------------------------------------------------------ ERF

torch::Tensor effective_receptive_field(models::VisionModel& model, const torch::Tensor& images,
                                        const ErfOptions& options) {
    LINVIS_CHECK(images.defined() && images.dim() == 4 && images.size(0) >= 1,
                 "effective_receptive_field: images: expected (B, C, H, W) with B >= 1, got ",
                 shape_or_undefined(images));
    LINVIS_CHECK(images.is_floating_point(), "effective_receptive_field: images must be floating point, got ",
                 images.dtype());
    LINVIS_CHECK(options.prefix_tokens >= -1, "effective_receptive_field: prefix_tokens must be >= -1, got ",
                 options.prefix_tokens);
    EvalModeGuard eval(model);
    torch::AutoGradMode grad_mode(true);
    const int64_t B = images.size(0), H = images.size(2), W = images.size(3);
    torch::Tensor total = torch::zeros({H, W}, torch::dtype(torch::kFloat64));
    for (int64_t b = 0; b < B; ++b) {
        torch::Tensor x = images.slice(0, b, b + 1).detach().clone().set_requires_grad(true);
        torch::Tensor f = model.forward_features(x);
        torch::Tensor centre;
        if (f.dim() == 4) {
            centre = f.index({0, torch::indexing::Slice(), f.size(2) / 2, f.size(3) / 2});
        } else {
            LINVIS_CHECK(f.dim() == 3, "effective_receptive_field: forward_features returned ",
                         shape_string(f.sizes()), "; expected (B, T, D) tokens or a (B, C, H, W) map");
            const int64_t T = f.size(1);
            int64_t h = 0, w = 0, prefix = -1;
            if (options.prefix_tokens >= 0) {
                LINVIS_CHECK(token_grid(T, H, W, options.prefix_tokens, h, w), "effective_receptive_field: ", T,
                             " tokens minus ", options.prefix_tokens, " prefix tokens do not form a patch grid of a ",
                             H, "x", W, " image");
                prefix = options.prefix_tokens;
            } else {
                for (int64_t p = 0; p <= std::min<int64_t>(8, T - 1) && prefix < 0; ++p)
                    if (token_grid(T, H, W, p, h, w)) prefix = p;
                LINVIS_CHECK(prefix >= 0, "effective_receptive_field: cannot place ", T,
                             " tokens on a patch grid of a ", H, "x", W, " image; set prefix_tokens");
            }
            centre = f.index({0, prefix + (h / 2) * w + w / 2});
        }
        torch::Tensor s = options.rectify_features ? torch::relu(centre).sum() : centre.sum();
        torch::Tensor g = torch::autograd::grad({s}, {x})[0][0];  // (C, H, W)
        total += (options.rectify_gradient ? torch::relu(g) : g.abs()).sum(0).to(torch::kFloat64);
    }
    return (total / static_cast<double>(B)).to(torch::kFloat32);
}

torch::Tensor erf_display_map(const torch::Tensor& map, double decades) {
    LINVIS_CHECK(map.defined() && map.numel() > 0, "erf_display_map: map is empty");
    LINVIS_CHECK(decades > 0, "erf_display_map: decades must be > 0, got ", decades);
    torch::Tensor m = map.detach().to(torch::kFloat64);
    LINVIS_CHECK(m.min().item<double>() >= 0.0, "erf_display_map: map has negative values (min ",
                 m.min().item<double>(), ")");
    const double peak = m.max().item<double>();
    if (!(peak > 0.0)) return torch::full(map.sizes(), -decades, torch::dtype(torch::kFloat32));
    torch::Tensor floor_value = torch::full({}, std::pow(10.0, -decades), torch::dtype(torch::kFloat64));
    return torch::log10(torch::maximum(m / peak, floor_value)).to(torch::kFloat32);
}

// ------------------------------------------------------------------ Gradient Magnitude Map

TttBranch parse_ttt_branch(const std::string& name) {
    if (name == "forth") return TttBranch::Forth;
    if (name == "back") return TttBranch::Back;
    fail("TTT branch must be 'forth' or 'back', got '", name, "'");
}

const char* ttt_branch_name(TttBranch branch) { return branch == TttBranch::Forth ? "forth" : "back"; }

torch::Tensor gradient_magnitude_map(models::VisionModel& model, const torch::Tensor& image, int64_t block,
                                     TttBranch branch, int64_t head) {
    torch::Tensor x = as_single_batch(image, "gradient_magnitude_map");
    const int64_t b = resolve_block(model, block, "gradient_magnitude_map");
    EvalModeGuard eval(model);
    torch::NoGradGuard no_grad;
    const models::VisionModel::Embedding e = input_of_block(model, x, b);
    const int64_t h = e.height, w = e.width;
    const std::string name = branch == TttBranch::Forth ? "ttt.grad_norms.forth" : "ttt.grad_norms.back";
    nn::Probe probe({name});
    model.forward_block(b, e.tokens, h, w);
    LINVIS_CHECK(probe.tensor(name).defined(), "gradient_magnitude_map: blocks.", b,
                 " is not a Vision-TTT block (use a vittt_* model)");
    torch::Tensor norms = probe.tensor(name)[0].to(torch::kFloat64);  // (nh, T)
    const int64_t nh = norms.size(0);
    LINVIS_CHECK(head >= -1 && head < nh, "gradient_magnitude_map: head ", head, " out of range for ", nh,
                 " heads (-1 combines them)");
    torch::Tensor per_token = head >= 0 ? norms[head] : norms.pow(2).sum(0).sqrt();
    return per_token.reshape({h, w}).to(torch::kFloat32);
}

// ------------------------------------------------------------------ attention

torch::Tensor softmax_attention_weights(const torch::Tensor& q, const torch::Tensor& k, double scale) {
    LINVIS_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                     q.size(3) == k.size(3),
                 "softmax_attention_weights: expected q (B, h, N, d) and k (B, h, M, d), got ", shape_string(q.sizes()),
                 " and ", shape_string(k.sizes()));
    return torch::softmax(torch::matmul(q, k.transpose(-2, -1)) * scale, -1);
}

torch::Tensor linear_attention_weights(const torch::Tensor& q, const torch::Tensor& k,
                                       const ops::LinearAttentionOptions& options) {
    LINVIS_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                     q.size(3) == k.size(3),
                 "linear_attention_weights: expected q (B, h, N, d) and k (B, h, M, d), got ", shape_string(q.sizes()),
                 " and ", shape_string(k.sizes()));
    LINVIS_CHECK(!options.causal || q.size(2) == k.size(2), "linear_attention_weights: causal needs N == M, got ",
                 q.size(2), " and ", k.size(2));
    torch::Tensor scores = torch::matmul(ops::apply_feature_map(q, options.feature_map),
                                         ops::apply_feature_map(k, options.feature_map).transpose(-2, -1));
    if (options.causal) scores = torch::tril(scores);
    if (!options.normalize) return scores;
    // phi(q_i) . sum_{l in S_i} phi(k_l) = sum_j scores_ij over the (masked) row.
    return scores / (scores.sum(-1, true) + options.eps);
}

torch::Tensor implicit_attention(const std::function<torch::Tensor(const torch::Tensor&)>& mixer,
                                 const torch::Tensor& v, int64_t query) {
    LINVIS_CHECK(v.defined() && v.dim() == 4 && v.is_floating_point(),
                 "implicit_attention: v: expected floating (B, h, M, dv), got ",
                 shape_or_undefined(v));
    torch::AutoGradMode grad_mode(true);
    torch::Tensor values = v.detach().clone().set_requires_grad(true);
    torch::Tensor o = mixer(values);
    LINVIS_CHECK(o.dim() == 4 && o.size(0) == v.size(0) && o.size(1) == v.size(1),
                 "implicit_attention: mixer output: expected (B, h, N, do) with B, h of v ", shape_string(v.sizes()),
                 ", got ", shape_string(o.sizes()));
    LINVIS_CHECK(query >= 0 && query < o.size(2), "implicit_attention: query ", query, " out of range for ", o.size(2),
                 " output tokens");
    const int64_t out_dim = o.size(3);
    torch::Tensor row = o.select(2, query);  // (B, h, do)
    torch::Tensor squared = torch::zeros(v.sizes().slice(0, 3), v.options());
    for (int64_t c = 0; c < out_dim; ++c) {
        // Samples and heads are independent, so one pass gives every (b, h) block's row c of J.
        torch::Tensor g = torch::autograd::grad({row.select(-1, c).sum()}, {values}, {}, /*retain_graph=*/true,
                                                /*create_graph=*/false, /*allow_unused=*/true)[0];
        if (g.defined()) squared += g.pow(2).sum(-1);
    }
    return (squared / static_cast<double>(out_dim)).sqrt().detach();
}

AttentionMap attention_map(models::VisionModel& model, const torch::Tensor& image, int64_t block, int64_t query_y,
                           int64_t query_x) {
    torch::Tensor x = as_single_batch(image, "attention_map");
    const int64_t b = resolve_block(model, block, "attention_map");
    EvalModeGuard eval(model);
    models::VisionModel::Embedding e;
    nn::Probe probe({"attn.weights", "attn.v", "attn.of_v"});
    {
        torch::NoGradGuard no_grad;
        e = input_of_block(model, x, b);
        LINVIS_CHECK(query_y >= 0 && query_y < e.height && query_x >= 0 && query_x < e.width, "attention_map: query (",
                     query_y, ", ", query_x, ") outside the ", e.height, "x", e.width, " patch grid");
        model.forward_block(b, e.tokens, e.height, e.width);
    }
    const int64_t query = e.prefix + query_y * e.width + query_x;
    AttentionMap result;
    torch::Tensor row;  // (h, M) over all keys
    if (probe.tensor("attn.weights").defined()) {
        row = probe.tensor("attn.weights")[0].select(1, query);
        result.method = "softmax attention weights softmax(q k^T / sqrt(d)) of the query patch, mean over heads "
                        "(class-token key left out)";
    } else if (probe.function("attn.of_v") && probe.tensor("attn.v").defined()) {
        row = implicit_attention(probe.function("attn.of_v"), probe.tensor("attn.v"), query)[0];
        result.method = "T5 implicit attention ||d o_i / d v_j||_F / sqrt(d) (T5 paper Eq. 13) of the query patch, "
                        "mean over heads";
    } else {
        fail("attention_map: blocks.", b, " reports no attention: only deit_* (softmax attention) and t5_* "
             "(implicit TTT attention) models are supported");
    }
    result.map = row.slice(1, e.prefix).mean(0).reshape({e.height, e.width}).to(torch::kFloat32).contiguous();
    return result;
}

}  // namespace linvis::tools::explain
