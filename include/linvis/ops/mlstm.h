// The mLSTM cell (xLSTM matrix memory with exponential input gate and sigmoid forget gate)
// in its three computation forms: parallel (quadratic), recurrent (one token at a time) and
// chunkwise (parallel inside chunks, recurrent between them).
//
// Shapes: q, k (B, NH, S, DHQK); v (B, NH, S, DHV); the gate pre-activations igate / fgate are
// (B, NH, S, 1) as in the official code (B, NH, S is accepted too). Outputs h are (B, NH, S, DHV)
// in the dtype of q. Any strides: the fused kernel reads q, k, v (unit stride along D) and the gates
// through their strides, so the heads of token-major (B, S, NH * D) memory, e.g. a chunk of a wider
// projection viewed as (B, S, NH, D) and transposed, need no copy; it writes h token-major
// ((B, S, NH, DHV) memory), so that h.transpose(1, 2).reshape({B, S, NH * DHV}) is a view. All
// functions are plain LibTorch ops with autograd and count their matrix products with linvis::flops.
// Spec: shared/spec/vil_official.md sections 1.7 and 4.
//
// The key is scaled by 1/sqrt(DHQK) before it is used, in every form, as ViL's
// parallel_stabilized_simple does (1.16.3). The recurrent and chunkwise forms start from
// C = 0, n = 0, m = -inf (mlstm_initial_state): with that start their stabiliser m_t equals the
// row-wise maximum m_t = max_j logD_tj of the parallel form, so the normaliser
// max(|n_t . q_t|, exp(-m_t)) + eps is the same number in all forms and they agree to rounding,
// eps included. (mlstm_kernels starts from m = 0 instead; pass that state explicitly to mimic it.)
//
// Dtypes: float64 and float32 compute in the input dtype. bfloat16 / float16: the parallel form
// does the gate arithmetic in float32 and the two matrix products in the input dtype (as the
// official code under bf16 autocast); the chunkwise and recurrent forms compute in float32 (the
// state dtype of mlstm_kernels). Outputs have the dtype of q. Tolerances: docs/ops_mlstm.md.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "linvis/ops/impl.h"

namespace linvis::ops {

enum class MlstmMode { Parallel, Chunkwise, Recurrent };

// ViL's per-head LayerNorm of the output (MultiHeadLayerNorm, spec 1.9): every (token, head) row of
// DHV features is normalised (mean, biased variance, eps) and then scaled and shifted per channel,
// out[b, h, s, e] = normalised[b, h, s, e] * scale[h DHV + e] + shift[h DHV + e]; scale, shift (NH * DHV).
struct MlstmOutputNorm {
    torch::Tensor scale, shift;
    double eps = 1e-5;
};

// That norm of h (B, NH, S, DHV) with LibTorch ops (autograd; bf16 / f16 normalised in float32 and
// rounded once). Token-major h is normalised in its layout and returned token-major.
torch::Tensor mlstm_output_norm(const torch::Tensor& h, const MlstmOutputNorm& norm);

// "parallel" | "chunkwise" | "recurrent"; throws linvis::Error for anything else.
MlstmMode parse_mlstm_mode(const std::string& name);
const char* mlstm_mode_name(MlstmMode mode);

// Normaliser epsilon of ViL's mLSTM cell (added after the max, 1.7 step 12).
constexpr double kMlstmEps = 1e-6;
constexpr int64_t kMlstmDefaultChunkSize = 64;

// Parallel stabilised form, parallel_stabilized_simple of the official code in its exact op
// order (1.7): logsigmoid forget gates, zero-prefixed cumsum, repeat/subtract forget matrix,
// causal where(-inf), + input gate, row-wise max stabiliser m, D = exp(logD - m), k / sqrt(DHQK),
// C = (q k^T) * D, n = max(|rowsum C|, exp(-m)), h = C / (n + eps) @ v.
// Time and memory O(S^2) per head.
torch::Tensor mlstm_parallel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                             double eps = kMlstmEps);

// Recurrent state of one sequence position: C (B, NH, DHQK, DHV), n (B, NH, DHQK), m (B, NH, 1).
// C and n are stored divided by exp(m) (stabilised).
struct MlstmState {
    torch::Tensor C;
    torch::Tensor n;
    torch::Tensor m;
};

// C = 0, n = 0, m = m0 (default -inf, see the file comment; mlstm_kernels uses m0 = 0).
MlstmState mlstm_initial_state(int64_t batch, int64_t heads, int64_t dim_qk, int64_t dim_v,
                               const torch::TensorOptions& options,
                               double m0 = -std::numeric_limits<double>::infinity());

// One recurrent step (4.2, key scaled): q, k (B, NH, DHQK), v (B, NH, DHV), igate/fgate (B, NH, 1).
//   m_t = max(logsigmoid(f) + m_{t-1}, i);  f' = exp(logsigmoid(f) + m_{t-1} - m_t);  i' = exp(i - m_t)
//   C_t = f' C_{t-1} + i' (k/sqrt(DHQK)) v^T;  n_t = f' n_{t-1} + i' k/sqrt(DHQK)
//   h_t = q^T C_t / (max(|q . n_t|, exp(-m_t)) + eps)
// Returns h (B, NH, DHV) and the new state.
std::pair<torch::Tensor, MlstmState> mlstm_recurrent_step(const torch::Tensor& q, const torch::Tensor& k,
                                                          const torch::Tensor& v, const torch::Tensor& igate_preact,
                                                          const torch::Tensor& fgate_preact,
                                                          const MlstmState& state, double eps = kMlstmEps);

// mlstm_recurrent_step over the whole sequence, starting from `initial` (or
// mlstm_initial_state when null); the final state is written to `final_state` when given.
// Time O(S DHQK DHV), memory O(DHQK DHV) per head besides the outputs (and autograd's records).
torch::Tensor mlstm_recurrent(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                              double eps = kMlstmEps, const MlstmState* initial = nullptr,
                              MlstmState* final_state = nullptr);

// Chunkwise form (4.3) with chunk length `chunk_size` (any S: the sequence is zero-padded at the
// end to a multiple of the chunk, which leaves the causal outputs unchanged, and cut back).
// Inter-chunk: the states (C, n, m) before every chunk by the recurrence over chunks; intra-chunk:
// a stabilised L x L parallel part combined with the state term under the common stabiliser
// m_i = max(b_i + m_chunk, max_j logD_ij). Multiply-adds per head ~ S L (DHQK + DHV) (intra)
// + 2 S DHQK DHV (state update and read-out); memory O(S L + (S/L) DHQK DHV); no S x S matrix.
//
// impl = Impl::Fused runs the fused CPU kernel instead (src/ops/mlstm/cpu.cpp,
// docs/perf_mlstm.md): the same function, per (batch, head) chunk by chunk with small dense
// products, no padding (a shorter last chunk), a custom autograd function that saves only the
// inputs and recomputes the chunk states in backward. Memory O(S (DHQK + DHV) + L^2 + (S/L)
// DHQK DHV) per (batch, head) in flight; nothing is saved under NoGradGuard / InferenceMode.
// CPU tensors only.
torch::Tensor mlstm_chunkwise(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                              int64_t chunk_size = kMlstmDefaultChunkSize, double eps = kMlstmEps,
                              Impl impl = Impl::Auto);

// mlstm_output_norm(mlstm(...), norm) (ViL's cell output). The fused chunkwise kernel normalises each
// row while it writes h when autograd records nothing (inference): no separate pass over h.
torch::Tensor mlstm_normed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                           const MlstmOutputNorm& norm, MlstmMode mode, int64_t chunk_size = kMlstmDefaultChunkSize,
                           double eps = kMlstmEps, Impl impl = Impl::Auto);

// Dispatch on mode; chunk_size is used by the chunkwise form only. impl = Impl::Fused exists for
// the chunkwise form only: with mode parallel or recurrent it throws linvis::Error (no silent
// change of the form: the chunkwise form equals the parallel one only to rounding).
torch::Tensor mlstm(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact, MlstmMode mode,
                    int64_t chunk_size = kMlstmDefaultChunkSize, double eps = kMlstmEps,
                    Impl impl = Impl::Auto);

}  // namespace linvis::ops
