// Reference (plain LibTorch, autograd-differentiable) ViT³ TTT mixer; see vit3_ttt.h and
// spec vit3_t5_official.md A2. Op order in the official paths follows ttt_block.py so that
// float32 results agree with the PyTorch module bit for bit on the same kernels.
#include "linvis/ops/vit3_ttt.h"

#include <cmath>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/vit3_ttt/reference.h"

namespace linvis::ops {
namespace {

namespace F = torch::nn::functional;
using torch::Tensor;

// silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z))), in the official bracket order.
Tensor silu_grad_from(const Tensor& z, const Tensor& sig) { return sig * (1.0 + z * (1.0 - sig)); }

// Official gradient "clip": G / (||G||_2 over `dims` + 1).
Tensor normalize(const Tensor& g, std::vector<int64_t> dims) {
    return g / (torch::linalg_vector_norm(g, 2, dims, /*keepdim=*/true, c10::nullopt) + 1.0);
}

Tensor transpose_last(const Tensor& x) { return x.transpose(-2, -1); }

bool is_conv(Vit3InnerModel m) { return m == Vit3InnerModel::DWConv3x3 || m == Vit3InnerModel::Conv3x3; }

int64_t hidden_width(const Vit3TttOptions& o, int64_t d) {
    const int64_t r = static_cast<int64_t>(std::llround(o.hidden_ratio * static_cast<double>(d)));
    LINVIS_CHECK(r >= 1, "vit3_ttt: hidden_ratio ", o.hidden_ratio, " gives hidden width ", r, " for d=", d);
    return r;
}

size_t expected_weight_count(Vit3InnerModel m) {
    switch (m) {
        case Vit3InnerModel::FC:
        case Vit3InnerModel::SiLUFC:
        case Vit3InnerModel::DWConv3x3:
        case Vit3InnerModel::Conv3x3: return 1;
        case Vit3InnerModel::GatedFC:
        case Vit3InnerModel::MLP2: return 2;
        case Vit3InnerModel::MLP3:
        case Vit3InnerModel::SwiGLU: return 3;
    }
    return 0;
}

// ---- conv inner models: (B, h, n, d) tokens <-> per-(sample, head) images.

// x (B, h, n, d) -> (1, B*h*d, H, W), channel index (b*h + head)*d + c.
Tensor tokens_to_image(const Tensor& x, int64_t height, int64_t width) {
    const int64_t B = x.size(0), h = x.size(1), d = x.size(3);
    return transpose_last(x).reshape({1, B * h * d, height, width});
}
Tensor image_to_tokens(const Tensor& y, int64_t B, int64_t h, int64_t d) {
    return transpose_last(y.reshape({B, h, d, -1}));
}

Tensor conv_apply(const Tensor& x, const Tensor& w, Vit3InnerModel m, int64_t height, int64_t width) {
    const int64_t B = x.size(0), h = x.size(1), d = x.size(3);
    Tensor img = tokens_to_image(x, height, width);
    Tensor out;
    if (m == Vit3InnerModel::DWConv3x3) {
        Tensor kern = w.expand({B, h, d, 3, 3}).reshape({B * h * d, 1, 3, 3});
        out = flops::conv2d(img, kern, {}, {1, 1}, {1, 1}, {1, 1}, B * h * d);
    } else {
        Tensor kern = w.expand({B, h, d, d, 3, 3}).reshape({B * h * d, d, 3, 3});
        out = flops::conv2d(img, kern, {}, {1, 1}, {1, 1}, {1, 1}, B * h);
    }
    return image_to_tokens(out, B, h, d);
}

// dL/dW of a 3x3 conv (padding 1) for keys k and output gradient e, both (B, h, n, d).
Tensor conv_weight_grad(const Tensor& k, const Tensor& e, Vit3InnerModel m, int64_t height, int64_t width) {
    const int64_t B = k.size(0), h = k.size(1), n = k.size(2), d = k.size(3);
    Tensor img = transpose_last(k).reshape({B * h, d, height, width});
    // cols[bh, c*9 + ky*3 + kx, y*W + x] = kpad[bh, c, y + ky, x + kx]
    Tensor cols = F::unfold(img, F::UnfoldFuncOptions({3, 3}).padding(1));
    Tensor eg = transpose_last(e).reshape({B * h, d, n});
    if (m == Vit3InnerModel::DWConv3x3) {
        flops::add(B * h * d * 9 * n);
        return (cols.view({B * h, d, 9, n}) * eg.unsqueeze(2)).sum(-1).view({B, h, d, 3, 3});
    }
    return flops::matmul(eg, transpose_last(cols)).view({B, h, d, d, 3, 3});
}

// ---- token inner models: forward on keys keeping what the closed-form backward needs.

struct TokenForward {
    Tensor pred;
    std::vector<Tensor> saved;
};

TokenForward token_forward(const Tensor& x, const std::vector<Tensor>& w, Vit3InnerModel m) {
    // Inside the inner loop silu(z) is formed as z * sigmoid(z), as the official code does.
    switch (m) {
        case Vit3InnerModel::FC: return {flops::matmul(x, w[0]), {}};
        case Vit3InnerModel::SiLUFC: {
            Tensor z = flops::matmul(x, w[0]);
            Tensor sig = torch::sigmoid(z);
            return {z * sig, {z, sig}};
        }
        case Vit3InnerModel::GatedFC: {
            Tensor z1 = flops::matmul(x, w[0]);
            Tensor z2 = flops::matmul(x, w[1]);
            Tensor sig = torch::sigmoid(z2);
            Tensor a = z2 * sig;
            return {z1 * a, {z1, z2, sig, a}};
        }
        case Vit3InnerModel::MLP2: {
            Tensor z = flops::matmul(x, w[0]);
            Tensor sig = torch::sigmoid(z);
            Tensor a = z * sig;
            return {flops::matmul(a, w[1]), {z, sig, a}};
        }
        case Vit3InnerModel::MLP3: {
            Tensor z1 = flops::matmul(x, w[0]);
            Tensor s1 = torch::sigmoid(z1);
            Tensor a1 = z1 * s1;
            Tensor z2 = flops::matmul(a1, w[1]);
            Tensor s2 = torch::sigmoid(z2);
            Tensor a2 = z2 * s2;
            return {flops::matmul(a2, w[2]), {z1, s1, a1, z2, s2, a2}};
        }
        case Vit3InnerModel::SwiGLU: {
            Tensor z1 = flops::matmul(x, w[0]);
            Tensor z2 = flops::matmul(x, w[1]);
            Tensor sig = torch::sigmoid(z1);
            Tensor a1 = z1 * sig;
            Tensor a2 = a1 * z2;
            return {flops::matmul(a2, w[2]), {z1, z2, sig, a1, a2}};
        }
        default: fail("vit3_ttt: token_forward called for a conv inner model");
    }
}

// Closed-form dL/dW given e = dL/dpred.
std::vector<Tensor> token_backward(const Tensor& x, const Tensor& e, const std::vector<Tensor>& w,
                                   const TokenForward& fw, Vit3InnerModel m) {
    const Tensor xt = transpose_last(x);
    const auto& s = fw.saved;
    switch (m) {
        case Vit3InnerModel::FC: return {flops::matmul(xt, e)};
        case Vit3InnerModel::SiLUFC: return {flops::matmul(xt, e * silu_grad_from(s[0], s[1]))};
        case Vit3InnerModel::GatedFC:
            // G1 = kᵀ(e*a), G2 = kᵀ((e*z1) * silu'(z2)): the official op order.
            return {flops::matmul(xt, e * s[3]), flops::matmul(xt, e * s[0] * silu_grad_from(s[1], s[2]))};
        case Vit3InnerModel::MLP2: {
            Tensor g2 = flops::matmul(transpose_last(s[2]), e);
            Tensor da = flops::matmul(e, transpose_last(w[1]));
            Tensor g1 = flops::matmul(xt, da * silu_grad_from(s[0], s[1]));
            return {g1, g2};
        }
        case Vit3InnerModel::MLP3: {
            Tensor g3 = flops::matmul(transpose_last(s[5]), e);
            Tensor dz2 = flops::matmul(e, transpose_last(w[2])) * silu_grad_from(s[3], s[4]);
            Tensor g2 = flops::matmul(transpose_last(s[2]), dz2);
            Tensor dz1 = flops::matmul(dz2, transpose_last(w[1])) * silu_grad_from(s[0], s[1]);
            Tensor g1 = flops::matmul(xt, dz1);
            return {g1, g2, g3};
        }
        case Vit3InnerModel::SwiGLU: {
            Tensor g3 = flops::matmul(transpose_last(s[4]), e);
            Tensor da2 = flops::matmul(e, transpose_last(w[2]));
            Tensor g1 = flops::matmul(xt, da2 * s[1] * silu_grad_from(s[0], s[2]));
            Tensor g2 = flops::matmul(xt, da2 * s[3]);
            return {g1, g2, g3};
        }
        default: fail("vit3_ttt: token_backward called for a conv inner model");
    }
}

Tensor model_forward_on_keys(const Tensor& x, const std::vector<Tensor>& w, const Vit3TttOptions& o,
                             int64_t height, int64_t width) {
    if (is_conv(o.model)) return conv_apply(x, w[0], o.model, height, width);
    return token_forward(x, w, o.model).pred;
}

std::vector<Tensor> normalize_all(std::vector<Tensor> grads, Vit3InnerModel m) {
    for (auto& g : grads) g = is_conv(m) ? normalize(g, {-2, -1}) : normalize(g, {-2});
    return grads;
}

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<Tensor>& weights,
                  const Vit3TttOptions& o, int64_t height, int64_t width) {
    LINVIS_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
                 "vit3_ttt_generic: q, k, v must share shape (B, h, N, d), got ", shape_string(q.sizes()), ", ",
                 shape_string(k.sizes()), ", ", shape_string(v.sizes()));
    LINVIS_CHECK(q.size(2) == height * width, "vit3_ttt_generic: N = ", q.size(2), " but height*width = ",
                 height * width);
    LINVIS_CHECK(weights.size() == expected_weight_count(o.model), "vit3_ttt_generic: inner model ",
                 vit3_inner_model_name(o.model), " needs ", expected_weight_count(o.model), " weights, got ",
                 weights.size());
    const auto shapes = vit3_inner_weight_shapes(o, q.size(1), q.size(3));
    for (size_t i = 0; i < weights.size(); ++i) {
        const auto& w = weights[i];
        LINVIS_CHECK(w.dim() == static_cast<int64_t>(shapes[i].size()) + 1 &&
                         (w.size(0) == 1 || w.size(0) == q.size(0)) &&
                         w.sizes().slice(1) == c10::IntArrayRef(shapes[i]),
                     "vit3_ttt_generic: weight ", i, ": expected shape [1 or B, ", shape_string(shapes[i]).substr(1),
                     ", got ", shape_string(w.sizes()));
    }
    LINVIS_CHECK(o.epochs >= 1, "vit3_ttt_generic: epochs must be >= 1, got ", o.epochs);
    LINVIS_CHECK(o.num_minibatches >= 1 && o.num_minibatches <= q.size(2),
                 "vit3_ttt_generic: num_minibatches must be in [1, N=", q.size(2), "], got ", o.num_minibatches);
}

}  // namespace

// ---------------------------------------------------------------- official op

torch::Tensor vit3_rope_rotations(int64_t height, int64_t width, int64_t channels, double base) {
    LINVIS_CHECK(channels % 4 == 0, "vit3_rope_rotations: channels must be a multiple of 4, got ", channels);
    const int64_t k_max = channels / 4;
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    Tensor theta = torch::reciprocal(torch::pow(base, torch::arange(k_max, f32) / static_cast<double>(k_max)));
    auto grids = torch::meshgrid({torch::arange(height, f32), torch::arange(width, f32)}, "ij");
    Tensor angles = torch::cat({grids[0].unsqueeze(-1) * theta, grids[1].unsqueeze(-1) * theta}, -1);
    return torch::stack({torch::cos(angles), torch::sin(angles)}, -1).contiguous();
}

void check_rope_shapes(const Tensor& x, const Tensor& rotations, const char* op) {
    LINVIS_CHECK(x.dim() == 4 && rotations.dim() == 4 && rotations.size(0) == x.size(1) &&
                     rotations.size(1) == x.size(2) && rotations.size(2) * 2 == x.size(3) && rotations.size(3) == 2,
                 op, ": x ", shape_string(x.sizes()), " (B, H, W, C) does not match rotations ",
                 shape_string(rotations.sizes()), " (H, W, C/2, 2)");
}

torch::Tensor apply_rope_2d(const Tensor& x, const Tensor& rotations) {
    check_rope_shapes(x, rotations, "apply_rope_2d");
    const auto compute = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    Tensor xc = x.to(compute).contiguous();
    auto sizes = xc.sizes().vec();
    sizes.back() /= 2;
    sizes.push_back(2);
    Tensor rot = torch::view_as_complex(rotations.to(compute).contiguous());
    Tensor out = torch::view_as_real(torch::view_as_complex(xc.view(sizes)) * rot).flatten(-2);
    return out.to(x.scalar_type());
}

namespace reference {

// The official SwiGLU and depthwise-conv inner steps on checked inputs.
torch::Tensor vit3_ttt_swiglu_branch(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1,
                                     const Tensor& w2, double scale) {
    const double n = static_cast<double>(k.size(2));
    Tensor z1 = flops::matmul(k, w1);
    Tensor z2 = flops::matmul(k, w2);
    Tensor sig = torch::sigmoid(z2);
    Tensor a = z2 * sig;
    Tensor e = (-v / n) * scale;
    Tensor kt = transpose_last(k);
    Tensor g1 = flops::matmul(kt, e * a);
    Tensor g2 = flops::matmul(kt, e * z1 * silu_grad_from(z2, sig));
    g1 = normalize(g1, {-2});
    g2 = normalize(g2, {-2});
    Tensor w1_new = w1 - 1.0 * g1;
    Tensor w2_new = w2 - 1.0 * g2;
    return flops::matmul(q, w1_new) * torch::silu(flops::matmul(q, w2_new));
}


torch::Tensor vit3_ttt_dwconv_branch(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w3,
                                     double scale) {
    const int64_t B = q.size(0), d = q.size(1), H = q.size(2), W = q.size(3);
    Tensor e = (-v / static_cast<double>(H * W)) * scale;
    Tensor kpad = F::pad(k, F::PadFuncOptions({1, 1, 1, 1}));
    std::vector<Tensor> dots;
    dots.reserve(9);
    for (int64_t dy = -1; dy <= 1; ++dy)
        for (int64_t dx = -1; dx <= 1; ++dx)
            dots.push_back((kpad.narrow(2, 1 + dy, H).narrow(3, 1 + dx, W) * e).sum({-2, -1}));
    flops::add(B * d * 9 * H * W);
    Tensor g = torch::stack(dots, -1).reshape({B * d, 1, 3, 3});
    g = normalize(g, {-2, -1});
    Tensor w3_new = w3.repeat({B, 1, 1, 1}) - 1.0 * g;
    Tensor out = flops::conv2d(q.reshape({1, B * d, H, W}), w3_new, {}, {1, 1}, {1, 1}, {1, 1}, B * d);
    return out.reshape({B, d, H, W});
}

namespace {
// The band's k2 or q2 (channels [at, at + d) of t (B, R, W, .)) as (B, d, rows + 2, W + 2): the band's rows with one
// row above and below, each a halo row of t or a zero row where the grid ends, and zero columns on both sides.
Tensor padded_band_map(const Tensor& t, int64_t at, int64_t d, int64_t offset, int64_t rows) {
    const int64_t top = offset == 0 ? 1 : 0, bottom = t.size(1) == offset + rows ? 1 : 0;
    return F::pad(t.narrow(3, at, d).permute({0, 3, 1, 2}), F::PadFuncOptions({1, 1, top, bottom}));
}
}  // namespace

void vit3_bands_accumulate(const Tensor& kv, int64_t offset, int64_t rows, int64_t h, int64_t tokens,
                           const Tensor& w1, const Tensor& w2, Tensor& g1, Tensor& g2, Tensor& g3) {
    const int64_t B = kv.size(0), W = kv.size(2), d = kv.size(3) / (2 * (h + 1)), C = h * d, n = rows * W;
    const Tensor band = kv.narrow(1, offset, rows).reshape({B, n, 2 * C + 2 * d});
    auto heads = [&](int64_t at) { return band.narrow(2, at, C).reshape({B, n, h, d}).transpose(1, 2); };
    // The official op order of vit3_ttt_swiglu_branch, over the band's tokens, with the whole map's N.
    const Tensor k = heads(0), v = heads(C);
    const Tensor z1 = flops::matmul(k, w1), z2 = flops::matmul(k, w2), sig = torch::sigmoid(z2), a = z2 * sig;
    const Tensor e = (-v / static_cast<double>(tokens)) * kVit3InnerScale;
    const Tensor kt = transpose_last(k);
    g1 += flops::matmul(kt, e * a).to(g1.scalar_type());
    g2 += flops::matmul(kt, e * z1 * silu_grad_from(z2, sig)).to(g2.scalar_type());
    // Depthwise branch: the band's share of vit3_ttt_dwconv_branch's 9 shifted products.
    const Tensor kpad = padded_band_map(kv, 2 * C, d, offset, rows);
    const Tensor e2 = (-band.narrow(2, 2 * C + d, d).reshape({B, rows, W, d}).permute({0, 3, 1, 2}) /
                       static_cast<double>(tokens)) *
                      kVit3InnerScale;
    std::vector<Tensor> dots;
    for (int64_t dy = -1; dy <= 1; ++dy)
        for (int64_t dx = -1; dx <= 1; ++dx)
            dots.push_back((kpad.narrow(2, 1 + dy, rows).narrow(3, 1 + dx, W) * e2).sum({-2, -1}));
    flops::add(B * d * 9 * n);
    g3 += torch::stack(dots, 1).to(g3.scalar_type());
}

std::vector<Tensor> vit3_bands_step(const Tensor& w1, const Tensor& w2, const Tensor& w3, const Tensor& g1,
                                    const Tensor& g2, const Tensor& g3) {
    const int64_t B = g3.size(0), d = g3.size(2);
    auto as_w = [](const Tensor& g, const Tensor& w) { return g.to(w.scalar_type()); };
    Tensor g = normalize(as_w(g3, w3).permute({0, 2, 1}).reshape({B * d, 1, 3, 3}), {-2, -1});
    return {w1 - 1.0 * normalize(as_w(g1, w1), {-2}), w2 - 1.0 * normalize(as_w(g2, w2), {-2}),
            w3.repeat({B, 1, 1, 1}) - 1.0 * g};
}

Tensor vit3_bands_apply(const Tensor& q, int64_t offset, int64_t rows, int64_t h, const std::vector<Tensor>& updated) {
    const int64_t B = q.size(0), W = q.size(2), d = q.size(3) / (h + 1), C = h * d, n = rows * W;
    const Tensor q1 = q.narrow(1, offset, rows).reshape({B, n, C + d}).narrow(2, 0, C).reshape({B, n, h, d})
                          .transpose(1, 2);
    const Tensor x1 = flops::matmul(q1, updated[0]) * torch::silu(flops::matmul(q1, updated[1]));
    const Tensor q2 = padded_band_map(q, C, d, offset, rows).reshape({1, B * d, rows + 2, W + 2});
    const Tensor x2 = flops::conv2d(q2, updated[2], {}, {1, 1}, {0, 0}, {1, 1}, B * d);
    return torch::cat({x1.transpose(1, 2).reshape({B, n, C}), x2.reshape({B, d, n}).transpose(1, 2)}, -1);
}


}  // namespace reference

// ---------------------------------------------------------------- design space

Vit3InnerModel parse_vit3_inner_model(const std::string& name) {
    for (auto m : {Vit3InnerModel::FC, Vit3InnerModel::SiLUFC, Vit3InnerModel::GatedFC, Vit3InnerModel::MLP2,
                   Vit3InnerModel::MLP3, Vit3InnerModel::SwiGLU, Vit3InnerModel::DWConv3x3, Vit3InnerModel::Conv3x3})
        if (name == vit3_inner_model_name(m)) return m;
    fail("vit3 inner model: expected one of fc, silu_fc, gated_fc, mlp2, mlp3, swiglu, dwconv, conv; got '", name,
         "'");
}

Vit3InnerLoss parse_vit3_inner_loss(const std::string& name) {
    for (auto l : {Vit3InnerLoss::Dot, Vit3InnerLoss::MSE, Vit3InnerLoss::RMSE, Vit3InnerLoss::MAE,
                   Vit3InnerLoss::SmoothL1})
        if (name == vit3_inner_loss_name(l)) return l;
    fail("vit3 inner loss: expected one of dot, mse, rmse, mae, smooth_l1; got '", name, "'");
}

const char* vit3_inner_model_name(Vit3InnerModel m) {
    switch (m) {
        case Vit3InnerModel::FC: return "fc";
        case Vit3InnerModel::SiLUFC: return "silu_fc";
        case Vit3InnerModel::GatedFC: return "gated_fc";
        case Vit3InnerModel::MLP2: return "mlp2";
        case Vit3InnerModel::MLP3: return "mlp3";
        case Vit3InnerModel::SwiGLU: return "swiglu";
        case Vit3InnerModel::DWConv3x3: return "dwconv";
        case Vit3InnerModel::Conv3x3: return "conv";
    }
    return "?";
}

const char* vit3_inner_loss_name(Vit3InnerLoss l) {
    switch (l) {
        case Vit3InnerLoss::Dot: return "dot";
        case Vit3InnerLoss::MSE: return "mse";
        case Vit3InnerLoss::RMSE: return "rmse";
        case Vit3InnerLoss::MAE: return "mae";
        case Vit3InnerLoss::SmoothL1: return "smooth_l1";
    }
    return "?";
}

std::vector<std::vector<int64_t>> vit3_inner_weight_shapes(const Vit3TttOptions& o, int64_t h, int64_t d) {
    switch (o.model) {
        case Vit3InnerModel::FC:
        case Vit3InnerModel::SiLUFC: return {{h, d, d}};
        case Vit3InnerModel::GatedFC: return {{h, d, d}, {h, d, d}};
        case Vit3InnerModel::MLP2: {
            const int64_t r = hidden_width(o, d);
            return {{h, d, r}, {h, r, d}};
        }
        case Vit3InnerModel::MLP3: {
            const int64_t r = hidden_width(o, d);
            return {{h, d, r}, {h, r, r}, {h, r, d}};
        }
        case Vit3InnerModel::SwiGLU: {
            const int64_t r = hidden_width(o, d);
            return {{h, d, r}, {h, d, r}, {h, r, d}};
        }
        case Vit3InnerModel::DWConv3x3: return {{h, d, 3, 3}};
        case Vit3InnerModel::Conv3x3: return {{h, d, d, 3, 3}};
    }
    return {};
}

torch::Tensor vit3_inner_loss_grad(const Tensor& pred, const Tensor& target, Vit3InnerLoss loss, double scale,
                                   int64_t count) {
    const double n = static_cast<double>(count);
    switch (loss) {
        case Vit3InnerLoss::Dot: return (-target / n) * scale;
        case Vit3InnerLoss::MSE: return ((pred - target) / n) * scale;
        case Vit3InnerLoss::RMSE: {
            Tensor diff = pred - target;
            Tensor root = torch::sqrt((diff * diff).sum({-2, -1}, true) * (scale / n));
            return ((diff / n) * scale) / root;
        }
        case Vit3InnerLoss::MAE: return (torch::sign(pred - target) / n) * scale;
        case Vit3InnerLoss::SmoothL1: return (torch::clamp(pred - target, -1.0, 1.0) / n) * scale;
    }
    fail("vit3_inner_loss_grad: unknown loss");
}

torch::Tensor vit3_inner_loss_value(const Tensor& pred, const Tensor& target, Vit3InnerLoss loss, double scale,
                                    int64_t count) {
    const double n = static_cast<double>(count);
    Tensor diff = pred - target;
    switch (loss) {
        case Vit3InnerLoss::Dot: return (pred * target).sum() * (-scale / n);
        case Vit3InnerLoss::MSE: return (diff * diff).sum() * (scale / (2.0 * n));
        case Vit3InnerLoss::RMSE: return torch::sqrt((diff * diff).sum({-2, -1}) * (scale / n)).sum();
        case Vit3InnerLoss::MAE: return diff.abs().sum() * (scale / n);
        case Vit3InnerLoss::SmoothL1: {
            Tensor a = diff.abs();
            return torch::where(a < 1.0, 0.5 * diff * diff, a - 0.5).sum() * (scale / n);
        }
    }
    fail("vit3_inner_loss_value: unknown loss");
}

std::vector<torch::Tensor> vit3_inner_gradients(const Tensor& k, const Tensor& v, const std::vector<Tensor>& weights,
                                                const Vit3TttOptions& o, int64_t height, int64_t width,
                                                int64_t start, int64_t length) {
    const int64_t B = k.size(0), N = k.size(2), d = k.size(3);
    if (length < 0) length = N - start;
    LINVIS_CHECK(start >= 0 && length >= 1 && start + length <= N, "vit3_inner_gradients: token range [", start,
                 ", ", start + length, ") outside [0, ", N, ")");
    const double scale = o.loss_scale < 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : o.loss_scale;
    const bool conv = is_conv(o.model);
    // Token models train only on the keys of the range; conv models see all keys as conv input.
    Tensor keys = conv ? k : k.narrow(2, start, length);
    Tensor vals = v.narrow(2, start, length);

    if (o.use_autograd) {
        torch::AutoGradMode enable(true);
        std::vector<Tensor> per_sample;
        for (const auto& w : weights) {
            auto sizes = w.sizes().vec();
            sizes[0] = B;
            per_sample.push_back(w.requires_grad() ? w.expand(sizes)
                                                   : w.detach().expand(sizes).clone().set_requires_grad(true));
        }
        Tensor pred = model_forward_on_keys(keys, per_sample, o, height, width);
        if (conv) pred = pred.narrow(2, start, length);
        Tensor loss = vit3_inner_loss_value(pred, vals, o.loss, scale, length);
        auto grads = torch::autograd::grad({loss}, per_sample, {}, /*retain_graph=*/true, /*create_graph=*/true);
        return grads;
    }

    if (conv) {
        Tensor pred = conv_apply(keys, weights[0], o.model, height, width).narrow(2, start, length);
        Tensor e_range = vit3_inner_loss_grad(pred, vals, o.loss, scale, length);
        Tensor e = e_range;
        if (length != N) {
            auto pad = F::pad(e_range, F::PadFuncOptions({0, 0, start, N - start - length}));
            e = pad;
        }
        return {conv_weight_grad(keys, e, o.model, height, width)};
    }
    TokenForward fw = token_forward(keys, weights, o.model);
    Tensor e = vit3_inner_loss_grad(fw.pred, vals, o.loss, scale, length);
    // Every product above broadcasts over B, so the gradients are per sample: (B, ...).
    return token_backward(keys, e, weights, fw, o.model);
}

torch::Tensor vit3_inner_forward(const Tensor& x, const std::vector<Tensor>& w, const Vit3TttOptions& o,
                                 int64_t height, int64_t width) {
    switch (o.model) {
        case Vit3InnerModel::FC: return flops::matmul(x, w[0]);
        case Vit3InnerModel::SiLUFC: return torch::silu(flops::matmul(x, w[0]));
        case Vit3InnerModel::GatedFC: return flops::matmul(x, w[0]) * torch::silu(flops::matmul(x, w[1]));
        case Vit3InnerModel::MLP2: return flops::matmul(torch::silu(flops::matmul(x, w[0])), w[1]);
        case Vit3InnerModel::MLP3:
            return flops::matmul(torch::silu(flops::matmul(torch::silu(flops::matmul(x, w[0])), w[1])), w[2]);
        case Vit3InnerModel::SwiGLU:
            return flops::matmul(torch::silu(flops::matmul(x, w[0])) * flops::matmul(x, w[1]), w[2]);
        case Vit3InnerModel::DWConv3x3:
        case Vit3InnerModel::Conv3x3: return conv_apply(x, w[0], o.model, height, width);
    }
    fail("vit3_inner_forward: unknown inner model");
}

torch::Tensor vit3_ttt_generic(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<Tensor>& weights,
                               const Vit3TttOptions& o, int64_t height, int64_t width) {
    check_inputs(q, k, v, weights, o, height, width);
    const int64_t N = q.size(2);
    std::vector<Tensor> w = weights;
    for (int64_t epoch = 0; epoch < o.epochs; ++epoch) {
        for (int64_t i = 0; i < o.num_minibatches; ++i) {
            // Balanced contiguous ranges [i*N/k, (i+1)*N/k).
            const int64_t begin = i * N / o.num_minibatches, end = (i + 1) * N / o.num_minibatches;
            auto grads = vit3_inner_gradients(k, v, w, o, height, width, begin, end - begin);
            if (o.normalize_grad) grads = normalize_all(std::move(grads), o.model);
            for (size_t j = 0; j < w.size(); ++j) w[j] = w[j] - o.lr * grads[j];
        }
    }
    return vit3_inner_forward(q, w, o, height, width);
}

}  // namespace linvis::ops
