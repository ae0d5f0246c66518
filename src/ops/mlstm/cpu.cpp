// Fused CPU chunkwise mLSTM: forward and backward per (batch, head), chunk by chunk, with the
// chunk-local products done by small register-blocked GEMMs. Math: spec vil_official.md 4.3 with the
// stabiliser start m = -inf of the reference (src/ops/mlstm/reference.cpp), so the result equals the
// parallel form to rounding. Derivation of the backward and the memory formula: docs/perf_mlstm.md.
#include "ops/mlstm/cpu.h"
#include "ops/mlstm/checks.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "linvis/core/error.h"
#include "linvis/core/flops.h"
#include "ops/simd/simd.h"

namespace linvis::ops::cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Small dense products. C (M x N, row stride ldc) = [C +] A (M x K) * B (K x N).
// A's element (i, p) is A[i * ars + p * acs] (so a transposed A is just other strides); B is
// row-major with row stride ldb. Shapes here are chunk-sized (<= ~128), so no packing: the SIMD
// layer's register-blocked GEMM (ops/simd) of the target chosen once per op call.
struct Gemm {
    const simd::Kernels* k = nullptr;
    void operator()(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t acs, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate) const {
        k->gemm(M, N, K, A, ars, acs, B, ldb, C, ldc, accumulate);
    }
    void operator()(int64_t M, int64_t N, int64_t K, const double* A, int64_t ars, int64_t acs, const double* B,
                    int64_t ldb, double* C, int64_t ldc, bool accumulate) const {
        k->gemm_f64(M, N, K, A, ars, acs, B, ldb, C, ldc, accumulate);
    }
};

// y[i] = exp(x[i] - shift): the SIMD layer's exp for float, std::exp for double (the float64 path is the
// accuracy yardstick).
void exp_sub(const simd::Kernels* k, const float* x, float shift, float* y, int64_t n) { k->exp_sub(x, shift, y, n); }
void exp_sub(const simd::Kernels*, const double* x, double shift, double* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i] - shift);
}

template <typename T>
void transpose(const T* src, int64_t rows, int64_t cols, int64_t lds, T* dst, int64_t ldd) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

template <typename T>
T log_sigmoid(T x) {
    // min(x, 0) - log1p(exp(-|x|)): finite for every finite x.
    return std::min(x, T(0)) - std::log1p(std::exp(-std::abs(x)));
}

// ---------------------------------------------------------------------------------------------
// Per (batch, head) problem.

// Every sequence is read through its token stride (row t of q at q + t * ldq, unit stride inside a
// row), so a head of token-major (B, S, NH, D) memory or a chunk of a wider tensor needs no copy.
template <typename T>
struct Head {
    const T* q;   // S rows of DH, row stride ldq
    const T* k;   // S rows of DH (unscaled), row stride ldk
    const T* v;   // S rows of DV, row stride ldv
    const T* ig;  // S, stride ldi
    const T* fg;  // S, stride ldf
    int64_t ldq, ldk, ldv, ldi, ldf;
    int64_t S, DH, DV, L;
    T eps;
    Gemm gemm;
};

// Gate quantities of one chunk (4.3): b inclusive cumsum of log sigmoid(f), g = b[last],
// a_j = g - b_j + i_j.
template <typename T>
struct ChunkGates {
    std::vector<T> lf, b, a;
    T g = 0;
    void compute(const Head<T>& P, int64_t t0, int64_t Lc) {
        lf.resize(Lc);
        b.resize(Lc);
        a.resize(Lc);
        T acc = 0;
        for (int64_t j = 0; j < Lc; ++j) {
            lf[j] = log_sigmoid(P.fg[(t0 + j) * P.ldf]);
            acc += lf[j];
            b[j] = acc;
        }
        g = b[Lc - 1];
        for (int64_t j = 0; j < Lc; ++j) a[j] = g - b[j] + P.ig[(t0 + j) * P.ldi];
    }
};

// Recurrent state before a chunk: C (DH x DV), n (DH), stabiliser m and the global position whose
// log-weight attains m (where d m flows in the backward).
template <typename T>
struct StateRef {
    T* C;
    T* n;
    T m;
    int64_t argm;
};

// Scaled keys of a chunk: Ks = k / sqrt(DH) (Lc x DH), as the reference divides.
template <typename T>
void scaled_keys(const Head<T>& P, int64_t t0, int64_t Lc, T* Ks) {
    const T sq = static_cast<T>(std::sqrt(static_cast<double>(P.DH)));
    for (int64_t j = 0; j < Lc; ++j) {
        const T* k = P.k + (t0 + j) * P.ldk;
        for (int64_t d = 0; d < P.DH; ++d) Ks[j * P.DH + d] = k[d] / sq;
    }
}

// State after the chunk from the state before it (in place): m' = max(g + m, max_j a_j),
// C' = exp(g + m - m') C + sum_j exp(a_j - m') k_j v_j^T, n' likewise. W is Lc x DH scratch.
template <typename T>
void advance_state(const Head<T>& P, const ChunkGates<T>& G, int64_t t0, int64_t Lc, const T* Ks, T* C, T* n,
                   T& m, int64_t& argm, T* W) {
    const int64_t DH = P.DH, DV = P.DV;
    int64_t jmax = 0;
    for (int64_t j = 1; j < Lc; ++j)
        if (G.a[j] > G.a[jmax]) jmax = j;
    const T decayed = G.g + m;
    const T m_next = std::max(decayed, G.a[jmax]);
    const int64_t arg_next = decayed >= G.a[jmax] ? argm : t0 + jmax;
    const T gbar = std::exp(decayed - m_next);  // 0 for the first chunk (m = -inf)
    for (int64_t x = 0; x < DH * DV; ++x) C[x] *= gbar;
    for (int64_t d = 0; d < DH; ++d) n[d] *= gbar;
    for (int64_t j = 0; j < Lc; ++j) {
        const T abar = std::exp(G.a[j] - m_next);
        for (int64_t d = 0; d < DH; ++d) {
            W[j * DH + d] = abar * Ks[j * DH + d];
            n[d] += W[j * DH + d];
        }
    }
    // C += W^T V: A(i = d, p = j) = W[j * DH + d].
    P.gemm(DH, DV, Lc, W, 1, DH, P.v + t0 * P.ldv, P.ldv, C, DV, true);
    m = m_next;
    argm = arg_next;
}

// Intra-chunk part plus the state read-out for query rows of one chunk. Fills Sm (masked
// S * D), D, the row stabilisers and normalisers, Qbar = q * exp(m_inter - m) and num (= h * nrm).
template <typename T>
struct ChunkWork {
    std::vector<T> Ks, Kt, Sm, D, Qbar, num, W, tmp, Vt, dSm, Ct;
    std::vector<T> m_row, beta, den, nrm;
    std::vector<int64_t> arg_row;
    void reserve(int64_t L, int64_t DH, int64_t DV) {
        const int64_t Dm = std::max(DH, DV);
        Ks.resize(L * DH);
        Kt.resize(DH * L);
        Sm.resize(L * L);
        D.resize(L * L);
        Qbar.resize(L * DH);
        num.resize(L * DV);
        W.resize(L * Dm);
        tmp.resize(L * Dm);
        Vt.resize(DV * L);
        dSm.resize(L * L);
        Ct.resize(DH * DV);
        m_row.resize(L);
        beta.resize(L);
        den.resize(L);
        nrm.resize(L);
        arg_row.resize(L);
    }
};

constexpr int64_t kRowBlock = 16;  // row blocks of the causal (lower-triangular) chunk products

template <typename T>
void chunk_outputs(const Head<T>& P, const ChunkGates<T>& G, int64_t t0, int64_t Lc, const StateRef<T>& st,
                   ChunkWork<T>& w) {
    const int64_t DH = P.DH, DV = P.DV, L = P.L;  // L: leading dimension of the chunk matrices
    const T* q = P.q + t0 * P.ldq;
    const int64_t ldq = P.ldq;
    transpose(w.Ks.data(), Lc, DH, DH, w.Kt.data(), L);
    // S = Q Ks^T (Lc x Lc), into Sm; masked and weighted below. Causal: a block of rows
    // [r0, r0 + kRowBlock) needs only the columns j < r0 + kRowBlock.
    for (int64_t r0 = 0; r0 < Lc; r0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, Lc - r0);
        P.gemm(rows, r0 + rows, DH, q + r0 * ldq, ldq, 1, w.Kt.data(), L, w.Sm.data() + r0 * L, L, false);
    }
    const T* ig = P.ig + t0 * P.ldi;
    for (int64_t i = 0; i < Lc; ++i) {
        T* Drow = w.D.data() + i * L;
        T* Srow = w.Sm.data() + i * L;
        T m_intra = -std::numeric_limits<T>::infinity();
        int64_t jmax = 0;
        for (int64_t j = 0; j <= i; ++j) {
            Drow[j] = (G.b[i] - G.b[j]) + ig[j * P.ldi];  // log D_ij, as the reference: (b_i - b_j) + i_j
            if (Drow[j] > m_intra) {
                m_intra = Drow[j];
                jmax = j;
            }
        }
        const T m_inter = G.b[i] + st.m;
        const T m = std::max(m_inter, m_intra);
        w.m_row[i] = m;
        w.arg_row[i] = m_intra >= m_inter ? t0 + jmax : st.argm;
        w.beta[i] = std::exp(m_inter - m);
        exp_sub(P.gemm.k, Drow, m, Drow, i + 1);
        T rowsum = 0;
        for (int64_t j = 0; j <= i; ++j) {
            Srow[j] *= Drow[j];
            rowsum += Srow[j];
        }
        for (int64_t j = i + 1; j < Lc; ++j) {
            Drow[j] = 0;
            Srow[j] = 0;
        }
        T* qb = w.Qbar.data() + i * DH;
        T qn = 0;
        for (int64_t d = 0; d < DH; ++d) {
            qb[d] = q[i * ldq + d] * w.beta[i];
            qn += qb[d] * st.n[d];
        }
        w.den[i] = qn + rowsum;
        w.nrm[i] = std::max(std::abs(w.den[i]), std::exp(-m)) + P.eps;
    }
    // num = Qbar C + Sm V.
    P.gemm(Lc, DV, DH, w.Qbar.data(), DH, 1, st.C, DV, w.num.data(), DV, false);
    for (int64_t r0 = 0; r0 < Lc; r0 += kRowBlock) {  // Sm is zero right of the diagonal
        const int64_t rows = std::min(kRowBlock, Lc - r0);
        P.gemm(rows, DV, r0 + rows, w.Sm.data() + r0 * L, L, 1, P.v + t0 * P.ldv, P.ldv, w.num.data() + r0 * DV, DV,
               true);
    }
}

// sum_{e < n} f(e) with 8 independent partial sums: short dependency chains the compiler can
// vectorise (a single float accumulator is one latency-bound chain).
template <typename T, typename F>
T lane_sum(int64_t n, F f) {
    T acc[8] = {};
    int64_t e = 0;
    for (; e + 8 <= n; e += 8)
        for (int l = 0; l < 8; ++l) acc[l] += f(e + l);
    T s = 0;
    for (; e < n; ++e) s += f(e);
    for (int l = 0; l < 8; ++l) s += acc[l];
    return s;
}

// The output norm of one head (scale, shift: DV each; null scale: none).
template <typename T>
struct RowNorm {
    const T* scale = nullptr;
    const T* shift = nullptr;
    T eps = 0;
};

// h: S rows of DV with row stride ldh, each normalised by `norm` when it has a scale.
template <typename T>
void forward_head(const Head<T>& P, T* h, int64_t ldh, const RowNorm<T>& norm) {
    const int64_t DH = P.DH, DV = P.DV, L = P.L;
    ChunkWork<T> w;
    w.reserve(L, DH, DV);
    ChunkGates<T> G;
    std::vector<T> C(DH * DV, T(0)), n(DH, T(0));
    StateRef<T> st{C.data(), n.data(), -std::numeric_limits<T>::infinity(), 0};
    for (int64_t t0 = 0; t0 < P.S; t0 += L) {
        const int64_t Lc = std::min(L, P.S - t0);
        G.compute(P, t0, Lc);
        scaled_keys(P, t0, Lc, w.Ks.data());
        chunk_outputs(P, G, t0, Lc, st, w);
        for (int64_t i = 0; i < Lc; ++i) {
            const T inv = w.nrm[i];
            T* out = h + (t0 + i) * ldh;
            if (norm.scale == nullptr) {
                for (int64_t e = 0; e < DV; ++e) out[e] = w.num[i * DV + e] / inv;
                continue;
            }
            // As torch.layer_norm: mean, then the biased variance of the centred row.
            T* row = w.num.data() + i * DV;
            const T r = T(1) / inv;
            for (int64_t e = 0; e < DV; ++e) row[e] *= r;
            const T mean = lane_sum<T>(DV, [row](int64_t e) { return row[e]; }) / static_cast<T>(DV);
            const T var = lane_sum<T>(DV, [row, mean](int64_t e) { return (row[e] - mean) * (row[e] - mean); }) /
                          static_cast<T>(DV);
            const T rstd = T(1) / std::sqrt(var + norm.eps);
            for (int64_t e = 0; e < DV; ++e) out[e] = (row[e] - mean) * rstd * norm.scale[e] + norm.shift[e];
        }
        if (t0 + L < P.S) advance_state(P, G, t0, Lc, w.Ks.data(), st.C, st.n, st.m, st.argm, w.W.data());
    }
}

// Gradients of one (batch, head). dh (S rows of DV, row stride lddh) in; dq, dk, dv (S rows, row strides
// lddq, lddk, lddv) and dig, dfg (S, contiguous) out (overwritten).
template <typename T>
void backward_head(const Head<T>& P, const T* dh, int64_t lddh, T* dq, int64_t lddq, T* dk, int64_t lddk, T* dv,
                   int64_t lddv, T* dig, T* dfg) {
    const int64_t S = P.S, DH = P.DH, DV = P.DV, L = P.L;
    const int64_t NC = (S + L - 1) / L;
    const T sq = static_cast<T>(std::sqrt(static_cast<double>(DH)));
    ChunkWork<T> w;
    w.reserve(L, DH, DV);
    ChunkGates<T> G;

    // Pass 1: recompute the state before every chunk (transient, NC * DH * DV per head being processed).
    std::vector<T> Cs(NC * DH * DV), ns(NC * DH), ms(NC);
    std::vector<int64_t> args(NC);
    {
        std::vector<T> C(DH * DV, T(0)), n(DH, T(0));
        T m = -std::numeric_limits<T>::infinity();
        int64_t argm = 0;
        for (int64_t c = 0; c < NC; ++c) {
            const int64_t t0 = c * L, Lc = std::min(L, S - t0);
            std::copy(C.begin(), C.end(), Cs.begin() + c * DH * DV);
            std::copy(n.begin(), n.end(), ns.begin() + c * DH);
            ms[c] = m;
            args[c] = argm;
            if (c + 1 == NC) break;
            G.compute(P, t0, Lc);
            scaled_keys(P, t0, Lc, w.Ks.data());
            advance_state(P, G, t0, Lc, w.Ks.data(), C.data(), n.data(), m, argm, w.W.data());
        }
    }

    // Pass 2: chunks in reverse with dC, dn = gradient w.r.t. the state after the chunk.
    std::vector<T> dC(DH * DV, T(0)), dn(DH, T(0)), dCt(DV * DH);
    std::vector<T> G_hat(L * DV), delta(L), P_mat(L * L), abar(L), da(L), db(L), R(L), u(L * DH);
    std::vector<T> m_diff(S + 1, T(0));  // d m_i routed along the argmax path (difference array)
    std::fill(dig, dig + S, T(0));
    for (int64_t c = NC - 1; c >= 0; --c) {
        const int64_t t0 = c * L, Lc = std::min(L, S - t0);
        const bool has_next = c + 1 < NC;
        T* C = Cs.data() + c * DH * DV;
        T* n = ns.data() + c * DH;
        StateRef<T> st{C, n, ms[c], args[c]};
        G.compute(P, t0, Lc);
        scaled_keys(P, t0, Lc, w.Ks.data());
        chunk_outputs(P, G, t0, Lc, st, w);
        const T* q = P.q + t0 * P.ldq;
        const T* v = P.v + t0 * P.ldv;
        const T* Ks = w.Ks.data();

        // Output normalisation: h = num / nrm, nrm = max(|den|, exp(-m)) + eps.
        for (int64_t i = 0; i < Lc; ++i) {
            const T* dhi = dh + (t0 + i) * lddh;
            const T nrm = w.nrm[i];
            T hdot = 0;
            for (int64_t e = 0; e < DV; ++e) {
                G_hat[i * DV + e] = dhi[e] / nrm;
                hdot += dhi[e] * (w.num[i * DV + e] / nrm);
            }
            const T den = w.den[i];
            const bool den_wins = std::abs(den) > std::exp(-w.m_row[i]);
            delta[i] = den_wins ? -hdot / nrm * (den > 0 ? T(1) : den < 0 ? T(-1) : T(0)) : T(0);
            // The only dependence on the stabiliser: h_i = N_i / (max(|D_i|, 1) + eps e^{m_i}) unstabilised.
            const T dm = -hdot / nrm * P.eps;
            m_diff[t0 + i] += dm;
            m_diff[w.arg_row[i]] -= dm;
            dig[w.arg_row[i]] += dm;
        }

        // dSm = G_hat V^T + delta 1^T; P = dSm * Sm (d log D); dS = dSm * D.
        transpose(v, Lc, DV, P.ldv, w.Vt.data(), L);
        for (int64_t r0 = 0; r0 < Lc; r0 += kRowBlock) {  // only j <= i is used
            const int64_t rows = std::min(kRowBlock, Lc - r0);
            P.gemm(rows, r0 + rows, DV, G_hat.data() + r0 * DV, DV, 1, w.Vt.data(), L, w.dSm.data() + r0 * L, L,
                   false);
        }
        for (int64_t i = 0; i < Lc; ++i) {
            for (int64_t j = 0; j < Lc; ++j) {
                const int64_t x = i * L + j;
                if (j <= i) {
                    const T g = w.dSm[x] + delta[i];
                    P_mat[x] = g * w.Sm[x];
                    w.dSm[x] = g * w.D[x];
                } else {
                    P_mat[x] = 0;
                    w.dSm[x] = 0;
                }
            }
        }
        T* dqc = dq + t0 * lddq;
        T* dkc = dk + t0 * lddk;  // holds d(scaled k) until the end of this chunk
        T* dvc = dv + t0 * lddv;
        // Intra: dQ = dS Ks, dKs = dS^T Q, dV = Sm^T G_hat.
        for (int64_t r0 = 0; r0 < Lc; r0 += kRowBlock) {  // dS is zero right of the diagonal
            const int64_t rows = std::min(kRowBlock, Lc - r0);
            P.gemm(rows, DH, r0 + rows, w.dSm.data() + r0 * L, L, 1, Ks, DH, dqc + r0 * lddq, lddq, false);
        }
        P.gemm(Lc, DH, Lc, w.dSm.data(), 1, L, q, P.ldq, dkc, lddk, false);
        P.gemm(Lc, DV, Lc, w.Sm.data(), 1, L, G_hat.data(), DV, dvc, lddv, false);
        // Inter read-out: tmp = G_hat C^T + delta n^T; dq += beta tmp; R_i = Qbar_i . tmp_i (d log beta).
        transpose(C, DH, DV, DV, w.Ct.data(), DH);
        P.gemm(Lc, DH, DV, G_hat.data(), DV, 1, w.Ct.data(), DH, w.tmp.data(), DH, false);
        for (int64_t i = 0; i < Lc; ++i) {
            T r = 0;
            for (int64_t d = 0; d < DH; ++d) {
                const T t = w.tmp[i * DH + d] + delta[i] * n[d];
                dqc[i * lddq + d] += w.beta[i] * t;
                r += w.Qbar[i * DH + d] * t;
            }
            R[i] = r;
        }
        // State update of this chunk (only when a later chunk read it).
        T dg_state = 0;
        std::fill(da.begin(), da.end(), T(0));
        if (has_next) {
            // The forward's update weights: abar_j = exp(a_j - m'), gbar = exp(g + m - m').
            T amax = G.a[0];
            for (int64_t j = 1; j < Lc; ++j) amax = std::max(amax, G.a[j]);
            const T decayed = G.g + ms[c];
            const T m_next = std::max(decayed, amax);
            const T gbar = std::exp(decayed - m_next);
            for (int64_t j = 0; j < Lc; ++j) abar[j] = std::exp(G.a[j] - m_next);
            // u = V dC^T + dn (Lc x DH): dKs_j += abar_j u_j; da_j = abar_j Ks_j . u_j.
            transpose(dC.data(), DH, DV, DV, dCt.data(), DH);
            P.gemm(Lc, DH, DV, v, P.ldv, 1, dCt.data(), DH, u.data(), DH, false);
            for (int64_t j = 0; j < Lc; ++j) {
                T s = 0;
                for (int64_t d = 0; d < DH; ++d) {
                    const T uj = u[j * DH + d] + dn[d];
                    dkc[j * lddk + d] += abar[j] * uj;
                    s += Ks[j * DH + d] * uj;
                }
                da[j] = abar[j] * s;
            }
            // dV_j += abar_j Ks_j dC.
            P.gemm(Lc, DV, DH, Ks, DH, 1, dC.data(), DV, w.tmp.data(), DV, false);
            for (int64_t j = 0; j < Lc; ++j)
                for (int64_t e = 0; e < DV; ++e) dvc[j * lddv + e] += abar[j] * w.tmp[j * DV + e];
            T cdot = 0, ndot = 0;
            for (int64_t x = 0; x < DH * DV; ++x) cdot += dC[x] * C[x];
            for (int64_t d = 0; d < DH; ++d) ndot += dn[d] * n[d];
            dg_state = gbar * (cdot + ndot);
            for (int64_t x = 0; x < DH * DV; ++x) dC[x] *= gbar;
            for (int64_t d = 0; d < DH; ++d) dn[d] *= gbar;
        }
        // Gradient w.r.t. the state before this chunk: += Qbar^T G_hat, Qbar^T delta.
        P.gemm(DH, DV, Lc, w.Qbar.data(), 1, DH, G_hat.data(), DV, dC.data(), DV, true);
        for (int64_t i = 0; i < Lc; ++i)
            for (int64_t d = 0; d < DH; ++d) dn[d] += w.Qbar[i * DH + d] * delta[i];

        // Gates: log D_ij = b_i - b_j + i_j, a_j = g - b_j + i_j, g = b_last, log beta_i = b_i + const.
        T dg = dg_state;
        for (int64_t j = 0; j < Lc; ++j) dg += da[j];
        for (int64_t i = 0; i < Lc; ++i) {
            T rows = 0, cols = 0;
            for (int64_t j = 0; j <= i; ++j) rows += P_mat[i * L + j];
            for (int64_t r = i; r < Lc; ++r) cols += P_mat[r * L + i];
            db[i] = rows - cols - da[i] + R[i];
            dig[t0 + i] += cols + da[i];
        }
        db[Lc - 1] += dg;
        T acc = 0;
        for (int64_t r = Lc - 1; r >= 0; --r) {
            acc += db[r];
            dfg[t0 + r] = acc;  // d log sigmoid(f_r) so far
        }
        for (int64_t j = 0; j < Lc; ++j)
            for (int64_t d = 0; d < DH; ++d) dkc[j * lddk + d] /= sq;
    }
    // Stabiliser path: d lf_r += sum_{t >= r} m_diff[t]; then through log sigmoid.
    T acc = 0;
    for (int64_t r = S - 1; r >= 0; --r) {
        acc += m_diff[r];
        const T dlf = dfg[r] + acc;
        const T f = P.fg[r * P.ldf];
        dfg[r] = dlf / (T(1) + std::exp(f));  // d log sigmoid(f) / df = sigmoid(-f)
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-level driver.

// q, k, v (B, NH, S, D) with unit stride along D, gates (B, NH, S), all in the compute dtype and read
// through their strides: the heads of token-major (B, S, NH, D) memory or a chunk of a wider tensor as
// they are.
struct Prepared {
    torch::Tensor q, k, v, ig, fg;
};

// Sequence (b, h) of a (B, NH, S[, D]) tensor.
template <typename T>
T* head_ptr(const torch::Tensor& t, int64_t b, int64_t h) {
    return t.data_ptr<T>() + b * t.stride(0) + h * t.stride(1);
}

template <typename T>
Head<T> make_head(const Prepared& in, int64_t b, int64_t h, int64_t L, double eps, const simd::Kernels* kern) {
    Head<T> P;
    P.q = head_ptr<T>(in.q, b, h);
    P.k = head_ptr<T>(in.k, b, h);
    P.v = head_ptr<T>(in.v, b, h);
    P.ig = head_ptr<T>(in.ig, b, h);
    P.fg = head_ptr<T>(in.fg, b, h);
    P.ldq = in.q.stride(2);
    P.ldk = in.k.stride(2);
    P.ldv = in.v.stride(2);
    P.ldi = in.ig.stride(2);
    P.ldf = in.fg.stride(2);
    P.S = in.q.size(2);
    P.DH = in.q.size(3);
    P.DV = in.v.size(3);
    P.L = L;
    P.eps = static_cast<T>(eps);
    P.gemm.k = kern;
    return P;
}

// (B, NH, S, D) in token-major memory: (B, S, NH, D) contiguous, so that the caller's
// transpose(1, 2).reshape({B, S, NH * D}) is a view.
torch::Tensor empty_token_major(int64_t B, int64_t NH, int64_t S, int64_t D, const torch::TensorOptions& options) {
    return torch::empty_strided({B, NH, S, D}, {S * NH * D, D, NH * D, 1}, options);
}

// t in the compute dtype with unit stride along the last dim (a copy only when it has none).
torch::Tensor unit_rows(const torch::Tensor& t, torch::ScalarType compute) {
    torch::Tensor c = t.to(compute);
    return c.size(-1) <= 1 || c.stride(-1) == 1 ? c : c.contiguous();
}

// Forward multiply-adds, counted exactly as the reference chunkwise form counts its products (over
// NC = ceil(S / L) zero-padded chunks: intra-chunk L x L scores and read-out, the inter-chunk state
// updates, read-outs and normaliser), so that a model reports the same FLOPs with either
// implementation. The backward is not counted.
void count_flops(int64_t B, int64_t NH, int64_t S, int64_t DH, int64_t DV, int64_t L) {
    const int64_t NC = (S + L - 1) / L;
    const int64_t intra = NC * (L * L * DH + L * L * DV);
    const int64_t inter = (NC - 1) * L * DH * DV + NC * L * DH * DV + NC * L * DH;
    flops::add(B * NH * (intra + inter));
}

// scale, shift: (NH * DV) contiguous in the compute dtype, or undefined for no output norm.
torch::Tensor forward_impl(const Prepared& in, int64_t L, double eps, const torch::Tensor& scale = {},
                           const torch::Tensor& shift = {}, double norm_eps = 0) {
    const int64_t B = in.q.size(0), NH = in.q.size(1), S = in.q.size(2), DV = in.v.size(3);
    torch::Tensor h = empty_token_major(B, NH, S, DV, in.q.options());
    if (S == 0 || B * NH == 0) return h;
    const simd::Kernels* kern = &simd::kernels();
    AT_DISPATCH_FLOATING_TYPES(in.q.scalar_type(), "mlstm_fused_forward", [&] {
        at::parallel_for(0, B * NH, 1, [&](int64_t begin, int64_t end) {
            for (int64_t bh = begin; bh < end; ++bh) {
                const int64_t b = bh / NH, hd = bh % NH;
                RowNorm<scalar_t> norm;
                if (scale.defined()) {
                    norm.scale = scale.data_ptr<scalar_t>() + hd * DV;
                    norm.shift = shift.data_ptr<scalar_t>() + hd * DV;
                    norm.eps = static_cast<scalar_t>(norm_eps);
                }
                forward_head(make_head<scalar_t>(in, b, hd, L, eps, kern), head_ptr<scalar_t>(h, b, hd), h.stride(2),
                             norm);
            }
        });
    });
    count_flops(B, NH, S, in.q.size(3), DV, L);
    return h;
}

std::vector<torch::Tensor> backward_impl(const Prepared& in, const torch::Tensor& dh_in, int64_t L, double eps) {
    const int64_t B = in.q.size(0), NH = in.q.size(1), S = in.q.size(2), DH = in.q.size(3), DV = in.v.size(3);
    const torch::Tensor dh = unit_rows(dh_in, in.q.scalar_type());
    const auto opt = in.q.options();
    torch::Tensor dq = empty_token_major(B, NH, S, DH, opt), dk = empty_token_major(B, NH, S, DH, opt);
    torch::Tensor dv = empty_token_major(B, NH, S, DV, opt);
    torch::Tensor dig = torch::empty({B, NH, S}, opt), dfg = torch::empty({B, NH, S}, opt);
    if (S == 0 || B * NH == 0) return {dq, dk, dv, dig, dfg};
    const simd::Kernels* kern = &simd::kernels();
    AT_DISPATCH_FLOATING_TYPES(in.q.scalar_type(), "mlstm_fused_backward", [&] {
        at::parallel_for(0, B * NH, 1, [&](int64_t begin, int64_t end) {
            for (int64_t bh = begin; bh < end; ++bh) {
                const int64_t b = bh / NH, hd = bh % NH;
                backward_head(make_head<scalar_t>(in, b, hd, L, eps, kern), head_ptr<scalar_t>(dh, b, hd),
                              dh.stride(2), head_ptr<scalar_t>(dq, b, hd), dq.stride(2),
                              head_ptr<scalar_t>(dk, b, hd), dk.stride(2), head_ptr<scalar_t>(dv, b, hd),
                              dv.stride(2), head_ptr<scalar_t>(dig, b, hd), head_ptr<scalar_t>(dfg, b, hd));
            }
        });
    });
    return {dq, dk, dv, dig, dfg};
}

// Saves only the five inputs (views, no copies); everything else is recomputed in backward.
class MlstmChunkwiseFunction : public torch::autograd::Function<MlstmChunkwiseFunction> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& ig,
                                 const torch::Tensor& fg, int64_t chunk_size, double eps) {
        ctx->save_for_backward({q, k, v, ig, fg});
        ctx->saved_data["chunk_size"] = chunk_size;
        ctx->saved_data["eps"] = eps;
        return forward_impl(Prepared{q, k, v, ig, fg}, chunk_size, eps);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grad_outputs) {
        const auto saved = ctx->get_saved_variables();
        const int64_t chunk_size = ctx->saved_data["chunk_size"].toInt();
        const double eps = ctx->saved_data["eps"].toDouble();
        torch::Tensor dh = grad_outputs[0];
        if (!dh.defined()) dh = torch::zeros({saved[0].size(0), saved[0].size(1), saved[0].size(2), saved[2].size(3)},
                                             saved[0].options());
        auto grads = backward_impl(Prepared{saved[0], saved[1], saved[2], saved[3], saved[4]}, dh, chunk_size, eps);
        return {grads[0], grads[1], grads[2], grads[3], grads[4], torch::Tensor(), torch::Tensor()};
    }
};

// Gate pre-activations as a (B, NH, S) view, checked as the reference checks them.
torch::Tensor gate_vector(const torch::Tensor& gate, const torch::Tensor& q, const char* name) {
    return mlstm_checks::gate_as_column(gate, q, name).squeeze(-1);
}

}  // namespace

double mlstm_fused_gemm_gflops(int64_t L, int64_t DH, int64_t DV, double seconds) {
    const Gemm gemm{&simd::kernels()};
    const int64_t D = std::max(DH, DV);
    std::vector<float> A(L * D, 0.5f), B(D * D, 0.25f), Bt(D * L, 0.25f), C(std::max(L, D) * D, 0.f);
    double macs = 0;
    const auto start = std::chrono::steady_clock::now();
    double elapsed = 0;
    while (elapsed < seconds) {
        for (int rep = 0; rep < 20; ++rep) {
            gemm(L, L, DH, A.data(), DH, 1, Bt.data(), L, C.data(), L, false);          // Q K^T
            gemm(L, DV, DH, A.data(), DH, 1, B.data(), DV, C.data(), DV, false);        // Qbar C
            gemm(L, DV, L, A.data(), L, 1, B.data(), DV, C.data(), DV, true);           // Sm V
            gemm(DH, DV, L, A.data(), 1, DH, B.data(), DV, C.data(), DV, true);         // W^T V
            macs += static_cast<double>(L) * L * DH + 2.0 * L * DH * DV + static_cast<double>(L) * L * DV;
        }
        elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    return 2.0 * macs / elapsed * 1e-9;
}

torch::Tensor mlstm_chunkwise_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                                    int64_t chunk_size, double eps, const MlstmOutputNorm* out_norm) {
    mlstm_checks::check_qkv(q, k, v);
    LINVIS_CHECK(q.device().is_cpu(), "mlstm (fused): only CPU tensors are supported, got ", q.device().str());
    LINVIS_CHECK(chunk_size > 0, "mlstm (fused): chunk_size: expected > 0, got ", chunk_size);
    const auto compute = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    // No layout copies: q, k, v and the gates are read through their strides (a copy only for a
    // dtype conversion or a non-unit stride along D), h is written token-major.
    Prepared in{unit_rows(q, compute), unit_rows(k, compute), unit_rows(v, compute),
                gate_vector(igate_preact, q, "igate_preact").to(compute),
                gate_vector(fgate_preact, q, "fgate_preact").to(compute)};
    const int64_t L = std::min<int64_t>(chunk_size, std::max<int64_t>(q.size(2), 1));
    torch::Tensor h;
    const bool needs_grad = torch::GradMode::is_enabled() &&
                            (in.q.requires_grad() || in.k.requires_grad() || in.v.requires_grad() ||
                             in.ig.requires_grad() || in.fg.requires_grad() ||
                             (out_norm && (out_norm->scale.requires_grad() || out_norm->shift.requires_grad())));
    if (out_norm && !needs_grad) {  // inference: each row normalised as it is written
        const int64_t NH = q.size(1), DV = v.size(3);
        LINVIS_CHECK(out_norm->scale.numel() == NH * DV && out_norm->shift.numel() == NH * DV,
                     "mlstm output norm: scale and shift: expected NH * DHV = ", NH * DV, " elements, got ",
                     out_norm->scale.numel(), " and ", out_norm->shift.numel());
        return forward_impl(in, L, eps, out_norm->scale.to(compute).contiguous(),
                            out_norm->shift.to(compute).contiguous(), out_norm->eps)
            .to(q.scalar_type());
    }
    if (needs_grad)
        h = MlstmChunkwiseFunction::apply(in.q, in.k, in.v, in.ig, in.fg, L, eps);
    else
        h = forward_impl(in, L, eps);  // inference: nothing is saved
    h = h.to(q.scalar_type());
    return out_norm ? mlstm_output_norm(h, *out_norm) : h;
}

}  // namespace linvis::ops::cpu
