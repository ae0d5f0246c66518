// Input checks shared by the T5 / DiT5 TTT attention entry points and their references (internal).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "linvis/core/error.h"

namespace linvis::ops::t5_checks {

inline void check_shape(const char* op, const char* name, const torch::Tensor& t, std::vector<int64_t> expected) {
    LINVIS_CHECK(t.defined(), op, ": tensor '", name, "' is undefined; expected shape ", shape_string(expected));
    LINVIS_CHECK(t.sizes() == torch::IntArrayRef(expected), op, ": tensor '", name, "': expected shape ",
                 shape_string(expected), ", got ", shape_string(t.sizes()));
}

struct TokenShape {
    int64_t B, N, C, h, d;
};

inline TokenShape check_tokens(const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        int64_t num_heads, int64_t height, int64_t width) {
    LINVIS_CHECK(q.defined() && q.dim() == 3, op, ": q: expected (B, N, C), got ",
                 shape_or_undefined(q));
    const int64_t B = q.size(0), N = q.size(1), C = q.size(2);
    check_shape(op, "k", k, {B, N, C});
    check_shape(op, "v", v, {B, N, C});
    LINVIS_CHECK(num_heads >= 1 && C % num_heads == 0, op, ": channels ", C, " not divisible by num_heads ",
                 num_heads);
    LINVIS_CHECK(height >= 1 && width >= 1 && height * width == N, op, ": token grid ", height, "x", width,
                 " does not hold N = ", N, " tokens");
    return {B, N, C, num_heads, C / num_heads};
}

}  // namespace linvis::ops::t5_checks
