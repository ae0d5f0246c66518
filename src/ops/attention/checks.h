// Input checks shared by softmax_attention (src/ops/attention/attention.cpp) and linear_attention
// (src/ops/attention/reference.cpp). Internal.
#pragma once

#include <torch/torch.h>

#include "linvis/core/error.h"

namespace linvis::ops {

// q (B, h, N, d), k (B, h, M, d), v (B, h, M, dv), one dtype; throws linvis::Error naming `op`.
inline void check_qkv(const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    LINVIS_CHECK(q.defined() && k.defined() && v.defined(), op, ": q, k and v must be defined");
    LINVIS_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": expected q, k, v of rank 4 (B, h, N, d), got ",
                 shape_string(q.sizes()), ", ", shape_string(k.sizes()), ", ", shape_string(v.sizes()));
    LINVIS_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3), op,
                 ": k: expected shape [", q.size(0), ", ", q.size(1), ", M, ", q.size(3), "], got ",
                 shape_string(k.sizes()));
    LINVIS_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2), op,
                 ": v: expected shape [", k.size(0), ", ", k.size(1), ", ", k.size(2), ", dv], got ",
                 shape_string(v.sizes()));
    LINVIS_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
                 ": q, k, v must share one dtype");
}

}  // namespace linvis::ops
