// Input checks shared by the mLSTM reference forms and the fused kernel (internal), so that both
// report a bad input with the same message.
#pragma once

#include <torch/torch.h>

#include "linvis/core/error.h"

namespace linvis::ops::mlstm_checks {

// q, k (B, NH, S, DHQK) and v (B, NH, S, DHV) of one floating-point dtype.
inline void check_qkv(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    LINVIS_CHECK(q.dim() == 4, "mlstm: q: expected (B, NH, S, DHQK), got shape ", shape_string(q.sizes()));
    LINVIS_CHECK(k.sizes() == q.sizes(), "mlstm: k: expected shape ", shape_string(q.sizes()), ", got ",
                 shape_string(k.sizes()));
    LINVIS_CHECK(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
                 "mlstm: v: expected shape [", q.size(0), ", ", q.size(1), ", ", q.size(2), ", DHV], got ",
                 shape_string(v.sizes()));
    LINVIS_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                 "mlstm: q, k, v must share one dtype");
    LINVIS_CHECK(q.is_floating_point(), "mlstm: q: expected a floating-point tensor");
}

// Gate pre-activations (B, NH, S) or (B, NH, S, 1) as (B, NH, S, 1), checked against q's (B, NH, S).
inline torch::Tensor gate_as_column(const torch::Tensor& gate, const torch::Tensor& q, const char* name) {
    torch::Tensor g = gate.dim() == 3 ? gate.unsqueeze(-1) : gate;
    LINVIS_CHECK(g.dim() == 4 && g.size(0) == q.size(0) && g.size(1) == q.size(1) && g.size(2) == q.size(2) &&
                     g.size(3) == 1,
                 "mlstm: ", name, ": expected shape [", q.size(0), ", ", q.size(1), ", ", q.size(2), ", 1], got ",
                 shape_string(gate.sizes()));
    return g;
}

}  // namespace linvis::ops::mlstm_checks
