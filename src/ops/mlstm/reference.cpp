// Reference mLSTM forms in plain LibTorch ops (autograd-capable). See linvis/ops/mlstm.h.
#include "linvis/ops/mlstm.h"

#include <cmath>
#include <limits>
#include <vector>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/mlstm/checks.h"
#include "ops/mlstm/reference.h"

namespace linvis::ops {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using mlstm_checks::check_qkv;
using mlstm_checks::gate_as_column;

bool is_reduced(const torch::Tensor& t) {
    return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}

}  // namespace

MlstmMode parse_mlstm_mode(const std::string& name) {
    if (name == "parallel") return MlstmMode::Parallel;
    if (name == "chunkwise") return MlstmMode::Chunkwise;
    if (name == "recurrent") return MlstmMode::Recurrent;
    fail("mlstm mode: expected parallel|chunkwise|recurrent, got '", name, "'");
}

const char* mlstm_mode_name(MlstmMode mode) {
    switch (mode) {
        case MlstmMode::Parallel: return "parallel";
        case MlstmMode::Chunkwise: return "chunkwise";
        case MlstmMode::Recurrent: return "recurrent";
    }
    return "?";
}

torch::Tensor mlstm_parallel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact, double eps) {
    check_qkv(q, k, v);
    // bf16/fp16: gate arithmetic in float32 and matrix products in the input dtype, as under the
    // official bf16 autocast (1.16.6); otherwise everything in the input dtype.
    const bool reduced = is_reduced(q);
    const torch::Tensor ig = gate_as_column(igate_preact, q, "igate_preact").to(reduced ? torch::kFloat32 : q.scalar_type());
    const torch::Tensor fg = gate_as_column(fgate_preact, q, "fgate_preact").to(reduced ? torch::kFloat32 : q.scalar_type());
    const int64_t B = q.size(0), NH = q.size(1), S = q.size(2), DH = q.size(3);

    // The op sequence mirrors parallel_stabilized_simple so that the rounding matches (1.16.5).
    torch::Tensor log_fgates = torch::log_sigmoid(fg);                                     // (B,NH,S,1)
    torch::Tensor ltr = torch::tril(torch::ones({S, S}, q.options().dtype(torch::kBool)));
    torch::Tensor log_fgates_cumsum =
        torch::cat({torch::zeros({B, NH, 1, 1}, fg.options()), torch::cumsum(log_fgates, -2)}, -2);  // (B,NH,S+1,1)
    torch::Tensor rep = log_fgates_cumsum.repeat({1, 1, 1, S + 1});                       // (B,NH,S+1,S+1)
    torch::Tensor log_fg_full = rep - rep.transpose(-2, -1);                               // [a,b] = cs[a]-cs[b]
    using torch::indexing::None;
    using torch::indexing::Slice;
    torch::Tensor log_fg_matrix =
        torch::where(ltr, log_fg_full.index({Slice(), Slice(), Slice(1, None), Slice(1, None)}), -kInf);
    torch::Tensor log_D = log_fg_matrix + ig.transpose(-2, -1);                            // (B,NH,S,S)
    torch::Tensor max_log_D = std::get<0>(torch::max(log_D, -1, true));                    // (B,NH,S,1)
    torch::Tensor D = torch::exp(log_D - max_log_D);
    torch::Tensor keys_scaled = k / std::sqrt(static_cast<double>(DH));
    torch::Tensor qk = flops::matmul(q, keys_scaled.transpose(-2, -1));                    // (B,NH,S,S)
    torch::Tensor C = qk * D;
    torch::Tensor normalizer = torch::maximum(C.sum(-1, true).abs(), torch::exp(-max_log_D));
    torch::Tensor C_normalized = C / (normalizer + eps);
    return flops::matmul(C_normalized.to(v.scalar_type()), v);                              // (B,NH,S,DHV)
}

MlstmState mlstm_initial_state(int64_t batch, int64_t heads, int64_t dim_qk, int64_t dim_v,
                               const torch::TensorOptions& options, double m0) {
    return {torch::zeros({batch, heads, dim_qk, dim_v}, options), torch::zeros({batch, heads, dim_qk}, options),
            torch::full({batch, heads, 1}, m0, options)};
}

std::pair<torch::Tensor, MlstmState> mlstm_recurrent_step(const torch::Tensor& q, const torch::Tensor& k,
                                                          const torch::Tensor& v, const torch::Tensor& igate_preact,
                                                          const torch::Tensor& fgate_preact,
                                                          const MlstmState& state, double eps) {
    LINVIS_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                     v.size(1) == q.size(1),
                 "mlstm_recurrent_step: expected q, k (B, NH, DHQK) and v (B, NH, DHV), got ", shape_string(q.sizes()),
                 ", ", shape_string(k.sizes()), ", ", shape_string(v.sizes()));
    const int64_t B = q.size(0), NH = q.size(1), DH = q.size(2), DV = v.size(2);
    const std::vector<int64_t> gate_shape{B, NH, 1};
    LINVIS_CHECK(igate_preact.sizes() == gate_shape && fgate_preact.sizes() == gate_shape,
                 "mlstm_recurrent_step: gates: expected shape ", shape_string(gate_shape), ", got ",
                 shape_string(igate_preact.sizes()), " and ", shape_string(fgate_preact.sizes()));
    LINVIS_CHECK(state.C.sizes() == std::vector<int64_t>({B, NH, DH, DV}) &&
                     state.n.sizes() == std::vector<int64_t>({B, NH, DH}) && state.m.sizes() == gate_shape,
                 "mlstm_recurrent_step: state: expected C [", B, ", ", NH, ", ", DH, ", ", DV, "], n [", B, ", ", NH,
                 ", ", DH, "], m [", B, ", ", NH, ", 1], got ", shape_string(state.C.sizes()), ", ",
                 shape_string(state.n.sizes()), ", ", shape_string(state.m.sizes()));

    torch::Tensor log_f = torch::log_sigmoid(fgate_preact);                 // (B,NH,1)
    torch::Tensor m_new = torch::maximum(log_f + state.m, igate_preact);    // (B,NH,1)
    torch::Tensor f_act = torch::exp(log_f + state.m - m_new);
    torch::Tensor i_act = torch::exp(igate_preact - m_new);
    torch::Tensor k_scaled = k / std::sqrt(static_cast<double>(DH));
    torch::Tensor kv = flops::matmul(k_scaled.unsqueeze(-1), v.unsqueeze(-2));  // (B,NH,DH,DV)
    torch::Tensor C_new = f_act.unsqueeze(-1) * state.C + i_act.unsqueeze(-1) * kv;
    torch::Tensor n_new = f_act * state.n + i_act * k_scaled;
    torch::Tensor q_row = q.unsqueeze(-2);                                 // (B,NH,1,DH)
    torch::Tensor h_num = flops::matmul(q_row, C_new).squeeze(-2);         // (B,NH,DV)
    torch::Tensor qn = flops::matmul(q_row, n_new.unsqueeze(-1)).squeeze(-1);  // (B,NH,1)
    torch::Tensor h_den = torch::maximum(qn.abs(), torch::exp(-m_new)) + eps;
    return {h_num / h_den, MlstmState{C_new, n_new, m_new}};
}

torch::Tensor mlstm_recurrent(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact, double eps,
                              const MlstmState* initial, MlstmState* final_state) {
    check_qkv(q, k, v);
    if (is_reduced(q)) {
        // bf16/fp16: the state is kept in float32 (as mlstm_kernels' inference_state_dtype).
        auto f32 = [](const torch::Tensor& t) { return t.to(torch::kFloat32); };
        return mlstm_recurrent(f32(q), f32(k), f32(v), f32(igate_preact), f32(fgate_preact), eps, initial, final_state)
            .to(q.scalar_type());
    }
    const torch::Tensor ig = gate_as_column(igate_preact, q, "igate_preact");
    const torch::Tensor fg = gate_as_column(fgate_preact, q, "fgate_preact");
    const int64_t B = q.size(0), NH = q.size(1), S = q.size(2), DH = q.size(3), DV = v.size(3);
    MlstmState state = initial ? *initial : mlstm_initial_state(B, NH, DH, DV, q.options());
    std::vector<torch::Tensor> outputs;
    outputs.reserve(static_cast<size_t>(S));
    for (int64_t t = 0; t < S; ++t) {
        auto step = mlstm_recurrent_step(q.select(2, t), k.select(2, t), v.select(2, t), ig.select(2, t),
                                         fg.select(2, t), state, eps);
        outputs.push_back(step.first);
        state = std::move(step.second);
    }
    if (final_state) *final_state = state;
    if (S == 0) return torch::zeros({B, NH, 0, DV}, v.options());
    return torch::stack(outputs, 2);
}

namespace reference {

torch::Tensor mlstm_chunkwise(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                              int64_t chunk_size, double eps) {
    check_qkv(q, k, v);
    if (is_reduced(q)) {
        // bf16/fp16: computed in float32 (states and gates as in mlstm_kernels), output in the input dtype.
        auto f32 = [](const torch::Tensor& t) { return t.to(torch::kFloat32); };
        return reference::mlstm_chunkwise(f32(q), f32(k), f32(v), f32(igate_preact), f32(fgate_preact), chunk_size, eps)
            .to(q.scalar_type());
    }
    LINVIS_CHECK(chunk_size > 0, "mlstm_chunkwise: chunk_size: expected > 0, got ", chunk_size);
    torch::Tensor ig = gate_as_column(igate_preact, q, "igate_preact").squeeze(-1);  // (B,NH,S)
    torch::Tensor fg = gate_as_column(fgate_preact, q, "fgate_preact").squeeze(-1);
    const int64_t B = q.size(0), NH = q.size(1), S = q.size(2), DH = q.size(3), DV = v.size(3);
    if (S == 0) return torch::zeros({B, NH, 0, DV}, v.options());
    const int64_t L = chunk_size;
    const int64_t NC = (S + L - 1) / L;
    const int64_t pad = NC * L - S;
    torch::Tensor qp = q, kp = k, vp = v;
    if (pad > 0) {
        // Padding at the end of a causal sequence changes no earlier output.
        namespace F = torch::nn::functional;
        qp = F::pad(q, F::PadFuncOptions({0, 0, 0, pad}));
        kp = F::pad(k, F::PadFuncOptions({0, 0, 0, pad}));
        vp = F::pad(v, F::PadFuncOptions({0, 0, 0, pad}));
        ig = F::pad(ig, F::PadFuncOptions({0, pad}));
        fg = F::pad(fg, F::PadFuncOptions({0, pad}));
    }
    torch::Tensor Q = qp.reshape({B, NH, NC, L, DH});
    torch::Tensor K = (kp / std::sqrt(static_cast<double>(DH))).reshape({B, NH, NC, L, DH});
    torch::Tensor V = vp.reshape({B, NH, NC, L, DV});
    torch::Tensor I = ig.reshape({B, NH, NC, L});
    torch::Tensor b = torch::cumsum(torch::log_sigmoid(fg).reshape({B, NH, NC, L}), -1);  // inclusive, per chunk
    using torch::indexing::Slice;
    torch::Tensor g = b.select(-1, L - 1);                                     // (B,NH,NC) decay over the chunk
    torch::Tensor a = g.unsqueeze(-1) - b + I;                                 // decay j -> chunk end, + input gate

    // Inter-chunk recurrence: states before every chunk.
    std::vector<torch::Tensor> C_states, n_states, m_states;
    C_states.reserve(static_cast<size_t>(NC));
    n_states.reserve(static_cast<size_t>(NC));
    m_states.reserve(static_cast<size_t>(NC));
    torch::Tensor C_k = torch::zeros({B, NH, DH, DV}, q.options());
    torch::Tensor n_k = torch::zeros({B, NH, DH}, q.options());
    torch::Tensor m_k = torch::full({B, NH}, -kInf, q.options());
    for (int64_t c = 0; c < NC; ++c) {
        C_states.push_back(C_k);
        n_states.push_back(n_k);
        m_states.push_back(m_k);
        if (c + 1 == NC) break;  // the state after the last chunk is not needed
        torch::Tensor a_c = a.select(2, c);                                    // (B,NH,L)
        torch::Tensor g_c = g.select(2, c);                                    // (B,NH)
        torch::Tensor m_next = torch::maximum(g_c + m_k, std::get<0>(torch::max(a_c, -1)));
        torch::Tensor a_bar = torch::exp(a_c - m_next.unsqueeze(-1));
        torch::Tensor g_bar = torch::exp(g_c + m_k - m_next);
        torch::Tensor K_c = K.select(2, c);                                    // (B,NH,L,DH)
        torch::Tensor K_weighted = K_c * a_bar.unsqueeze(-1);
        C_k = g_bar.unsqueeze(-1).unsqueeze(-1) * C_k + flops::matmul(K_weighted.transpose(-2, -1), V.select(2, c));
        n_k = g_bar.unsqueeze(-1) * n_k + K_weighted.sum(-2);
        m_k = m_next;
    }
    torch::Tensor C_all = torch::stack(C_states, 2);                           // (B,NH,NC,DH,DV)
    torch::Tensor n_all = torch::stack(n_states, 2);                           // (B,NH,NC,DH)
    torch::Tensor m_all = torch::stack(m_states, 2);                           // (B,NH,NC)

    // Intra-chunk parallel part under the combined stabiliser.
    torch::Tensor ltr = torch::tril(torch::ones({L, L}, q.options().dtype(torch::kBool)));
    torch::Tensor log_D = torch::where(ltr, b.unsqueeze(-1) - b.unsqueeze(-2) + I.unsqueeze(-2), -kInf);  // (B,NH,NC,L,L)
    torch::Tensor m_intra = std::get<0>(torch::max(log_D, -1));                // (B,NH,NC,L)
    torch::Tensor m_inter = b + m_all.unsqueeze(-1);                           // (B,NH,NC,L)
    torch::Tensor m_comb = torch::maximum(m_inter, m_intra);
    torch::Tensor D = torch::exp(log_D - m_comb.unsqueeze(-1));
    torch::Tensor C_intra = flops::matmul(Q, K.transpose(-2, -1)) * D;         // (B,NH,NC,L,L)
    torch::Tensor Q_inter = Q * torch::exp(m_inter - m_comb).unsqueeze(-1);    // (B,NH,NC,L,DH)
    torch::Tensor numerator = flops::matmul(Q_inter, C_all) + flops::matmul(C_intra, V);  // (B,NH,NC,L,DV)
    torch::Tensor denominator =
        flops::matmul(Q_inter, n_all.unsqueeze(-1)).squeeze(-1) + C_intra.sum(-1);  // (B,NH,NC,L)
    torch::Tensor normalizer = torch::maximum(denominator.abs(), torch::exp(-m_comb)) + eps;
    torch::Tensor h = (numerator / normalizer.unsqueeze(-1)).reshape({B, NH, NC * L, DV});
    return pad > 0 ? h.slice(2, 0, S) : h;
}

}  // namespace reference

}  // namespace linvis::ops
