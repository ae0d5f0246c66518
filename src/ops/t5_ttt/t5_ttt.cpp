// linvis::ops::t5_ttt_attention(_qkv) and dit5_ttt_attention: input checks and the choice between the reference
// and the fused CPU kernels (include/linvis/ops/t5_ttt.h).
#include "linvis/ops/t5_ttt.h"

#include <string>

#include "linvis/core/error.h"
#include "ops/t5_ttt/checks.h"
#include "ops/t5_ttt/reference.h"
#include "ops/simd/simd.h"
#include "ops/ttt_swiglu_cpu/entry_points.h"

namespace linvis::ops {

using t5_checks::check_shape;
using t5_checks::check_tokens;
using t5_checks::TokenShape;

torch::Tensor t5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const T5TttParams& p, int64_t num_heads, int64_t height, int64_t width, Impl impl) {
    const char* op = "t5_ttt_attention";
    const TokenShape s = check_tokens(op, q, k, v, num_heads, height, width);
    check_shape(op, "w1", p.w1, {1, s.h, s.d, s.d});
    check_shape(op, "w2", p.w2, {1, s.h, s.d, s.d});
    check_shape(op, "w3", p.w3, {1, s.h, s.d, s.d});
    if (use_fused(impl, op, fused_detail::fused_unsupported(q), simd::vectorised())) {
        for (const auto* w : {&p.q_conv_weight, &p.k_conv_weight}) check_shape(op, "conv weight", *w, {s.C, 1, 3, 3});
        for (const auto* b : {&p.q_conv_bias, &p.k_conv_bias}) check_shape(op, "conv bias", *b, {s.C});
        return fused_detail::t5_ttt_attention_fused(q, k, v, p, num_heads, height, width);
    }
    return reference::t5_ttt_attention(q, k, v, p, num_heads, height, width);
}

torch::Tensor t5_ttt_attention_qkv(const torch::Tensor& qkv, const T5TttParams& p, int64_t num_heads,
                                   int64_t height, int64_t width, Impl impl) {
    LINVIS_CHECK(qkv.defined() && qkv.dim() == 3 && qkv.size(2) % 3 == 0,
                 "t5_ttt_attention_qkv: qkv: expected (B, N, 3C), got ",
                 shape_or_undefined(qkv));
    std::vector<torch::Tensor> c = qkv.chunk(3, -1);
    if (!use_fused(impl, "t5_ttt_attention_qkv", fused_detail::fused_unsupported(qkv), simd::vectorised()))
        return t5_ttt_attention(c[0], c[1], c[2], p, num_heads, height, width, Impl::Reference);
    // Same checks as t5_ttt_attention.
    const char* op = "t5_ttt_attention_qkv";
    const TokenShape s = check_tokens(op, c[0], c[1], c[2], num_heads, height, width);
    check_shape(op, "w1", p.w1, {1, s.h, s.d, s.d});
    check_shape(op, "w2", p.w2, {1, s.h, s.d, s.d});
    check_shape(op, "w3", p.w3, {1, s.h, s.d, s.d});
    for (const auto* w : {&p.q_conv_weight, &p.k_conv_weight}) check_shape(op, "conv weight", *w, {s.C, 1, 3, 3});
    for (const auto* b : {&p.q_conv_bias, &p.k_conv_bias}) check_shape(op, "conv bias", *b, {s.C});
    return fused_detail::t5_ttt_attention_qkv_fused(qkv, p, num_heads, height, width);
}

torch::Tensor dit5_ttt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const Dit5TttParams& p, int64_t num_heads, int64_t height, int64_t width,
                                 Impl impl) {
    const char* op = "dit5_ttt_attention";
    const TokenShape s = check_tokens(op, q, k, v, num_heads, height, width);
    check_shape(op, "w1", p.w1, {1, s.h, s.d, s.d});
    check_shape(op, "w2", p.w2, {1, s.h, s.d, s.d});
    check_shape(op, "qk_scale_ttt", p.qk_scale, {1, 1, s.C, 2});
    check_shape(op, "qk_offset_ttt", p.qk_offset, {1, 1, s.C, 2});
    if (use_fused(impl, op, fused_detail::fused_unsupported(q), simd::vectorised())) {
        for (const auto* w : {&p.q_conv_weight, &p.k_conv_weight}) check_shape(op, "conv weight", *w, {s.C, 1, 3, 3});
        for (const auto* b : {&p.q_conv_bias, &p.k_conv_bias}) check_shape(op, "conv bias", *b, {s.C});
        return fused_detail::dit5_ttt_attention_fused(q, k, v, p, num_heads, height, width);
    }
    return reference::dit5_ttt_attention(q, k, v, p, num_heads, height, width);
}

}  // namespace linvis::ops
