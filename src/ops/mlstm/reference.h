// Reference chunkwise mLSTM (internal; public entry: linvis::ops::mlstm_chunkwise, which chooses between
// this and the fused CPU kernel). The parallel and recurrent forms are public reference functions in
// include/linvis/ops/mlstm.h.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace linvis::ops::reference {

// Spec 4.3 with m0 = -inf; checks its inputs. bf16 / f16 computed in float32.
torch::Tensor mlstm_chunkwise(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                              int64_t chunk_size, double eps);

}  // namespace linvis::ops::reference
