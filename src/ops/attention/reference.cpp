// Reference softmax attention (public entry with the dispatch: attention.cpp) and linear attention, which
// has no fused kernel, so its public entry is here (see include/linvis/ops/attention.h).
#include "linvis/ops/attention.h"

#include <limits>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "linvis/core/precision.h"
#include "ops/attention/checks.h"
#include "ops/attention/reference.h"

namespace linvis::ops {
namespace {

// Sum over chunks before each chunk: out[:, :, c] = sum_{c' < c} x[:, :, c'] along dim 2.
torch::Tensor exclusive_cumsum_dim2(const torch::Tensor& x) {
    const int64_t n = x.size(2);
    auto shifted = torch::cat({torch::zeros_like(x.narrow(2, 0, 1)), x.narrow(2, 0, n - 1)}, 2);
    return shifted.cumsum(2);
}

}  // namespace

torch::Tensor reference::softmax_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           double scale, const torch::Tensor& allowed) {
    // bf16 / f16: scores, softmax and the weighted sum in float32, one rounding at the end.
    const auto acc = precision::accumulation_dtype(q);
    if (acc != q.scalar_type())
        return reference::softmax_attention(q.to(acc), k.to(acc), v.to(acc), scale, allowed).to(q.scalar_type());
    // timm DeiT order: (q @ k^T) * scale, then softmax over keys.
    torch::Tensor attn = flops::matmul(q, k.transpose(-2, -1)) * scale;
    if (allowed.defined()) {
        LINVIS_CHECK(allowed.scalar_type() == torch::kBool, "softmax_attention: mask 'allowed' must be bool, got ",
                     allowed.scalar_type());
        auto expanded = allowed.expand_as(attn);
        LINVIS_CHECK(expanded.any(-1).all().item<bool>(),
                     "softmax_attention: mask 'allowed' leaves a query without any key");
        attn = attn.masked_fill(expanded.logical_not(), -std::numeric_limits<double>::infinity());
    }
    attn = attn.softmax(-1);
    return flops::matmul(attn, v);
}

torch::Tensor apply_feature_map(const torch::Tensor& x, FeatureMap map) {
    switch (map) {
        case FeatureMap::EluPlusOne: return torch::elu(x) + 1.0;
        case FeatureMap::Relu: return torch::relu(x);
        case FeatureMap::Identity: return x;
    }
    fail("apply_feature_map: unknown feature map");
}

torch::Tensor linear_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const LinearAttentionOptions& options, Impl impl) {
    use_fused(impl, "linear_attention", "this op has no fused kernel", false);
    check_qkv("linear_attention", q, k, v);
    LINVIS_CHECK(options.eps >= 0, "linear_attention: eps must be >= 0, got ", options.eps);
    const torch::Tensor phi_q = apply_feature_map(q, options.feature_map);
    const torch::Tensor phi_k = apply_feature_map(k, options.feature_map);

    if (!options.causal) {
        torch::Tensor state = flops::matmul(phi_k.transpose(-2, -1), v);  // (B, h, d, dv)
        torch::Tensor numerator = flops::matmul(phi_q, state);            // (B, h, N, dv)
        if (!options.normalize) return numerator;
        torch::Tensor key_sum = phi_k.sum(-2, /*keepdim=*/true);          // (B, h, 1, d)
        torch::Tensor denominator = (phi_q * key_sum).sum(-1, /*keepdim=*/true) + options.eps;
        return numerator / denominator;
    }

    LINVIS_CHECK(k.size(2) == q.size(2), "linear_attention: causal needs as many keys as queries, got ",
                 k.size(2), " keys and ", q.size(2), " queries");
    LINVIS_CHECK(options.chunk_size >= 1, "linear_attention: chunk_size must be >= 1, got ", options.chunk_size);
    const int64_t B = q.size(0), H = q.size(1), N = q.size(2), d = q.size(3), dv = v.size(3);
    const int64_t c = std::min(options.chunk_size, std::max<int64_t>(N, 1));
    const int64_t chunks = (N + c - 1) / c;
    const int64_t pad = chunks * c - N;
    // Padding sits after the last real token, so causality keeps it out of every real output.
    auto pad_tokens = [&](const torch::Tensor& x) {
        return pad == 0 ? x : torch::constant_pad_nd(x, {0, 0, 0, pad}, 0.0);
    };
    const torch::Tensor qc = pad_tokens(phi_q).reshape({B, H, chunks, c, d});
    const torch::Tensor kc = pad_tokens(phi_k).reshape({B, H, chunks, c, d});
    const torch::Tensor vc = pad_tokens(v).reshape({B, H, chunks, c, dv});

    const torch::Tensor causal_mask =
        torch::ones({c, c}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).tril();
    torch::Tensor scores = flops::matmul(qc, kc.transpose(-2, -1)).masked_fill(causal_mask.logical_not(), 0.0);
    torch::Tensor intra = flops::matmul(scores, vc);                                              // (B,h,n,c,dv)
    torch::Tensor states = exclusive_cumsum_dim2(flops::matmul(kc.transpose(-2, -1), vc));        // (B,h,n,d,dv)
    torch::Tensor numerator = flops::matmul(qc, states) + intra;
    torch::Tensor out;
    if (options.normalize) {
        torch::Tensor key_sums = exclusive_cumsum_dim2(kc.sum(-2));                               // (B,h,n,d)
        torch::Tensor denominator = (qc * key_sums.unsqueeze(-2)).sum(-1) + scores.sum(-1) + options.eps;
        out = numerator / denominator.unsqueeze(-1);
    } else {
        out = numerator;
    }
    return out.reshape({B, H, chunks * c, dv}).narrow(2, 0, N);
}

}  // namespace linvis::ops
