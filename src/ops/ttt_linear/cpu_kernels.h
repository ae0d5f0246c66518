// Body of the fused TTT-Linear scan (docs/perf_ttt_linear.md). Deliberately without an include
// guard: cpu.cpp includes it once per SIMD target (Highway's foreach_target, see ops/simd/simd.h)
// inside linvis::ops::cpu::HWY_NAMESPACE, where V is the SIMD layer's vector type
// simd::HWY_NAMESPACE::Vec<T> (float, or double for float64). Every function is a template on V
// (V::T is the compute type, V::W its lane count), so the same source is compiled for every target.
//
// V provides: T, W, Mask, mask(n) (first n lanes), load(p, mask) (masked lanes read 0),
// store(p, mask), set1(x), zero(), keep(mask, v) (zero outside mask), fma(a, b, c) = a*b + c,
// reduce(v) (sum of all lanes), transpose_block (W x W, strided), and + - *. A row of d values is walked
// with for_each_vector, whose mask is WholeVector (plain loads and stores) on all but a partial last vector.

// ---------------------------------------------------------------- small dense products

using simd::GemmInit;
using simd::HWY_NAMESPACE::for_each_vector;

// C (M x N, row-major, ldc) (+)= A (M x Kc, strides ars/acs) * B (Kc x N, row-major, ldb), see GemmInit:
// the SIMD layer's register-blocked GEMM (ops/simd/gemm-inl.h); a transposed A is just other strides.
template <class V>
inline void gemm_acc(int64_t M, int64_t N, int64_t Kc, const typename V::T* A, int64_t ars, int64_t acs,
                     const typename V::T* B, int64_t ldb, typename V::T* C, int64_t ldc,
                     GemmInit init = GemmInit::Accumulate, const typename V::T* row = nullptr) {
    simd::HWY_NAMESPACE::gemm<V>(M, N, Kc, A, ars, acs, B, ldb, C, ldc, init, row);
}

// dst (cols x rows) = src (rows x cols) transposed, both contiguous: the SIMD layer's block transpose.
template <class V>
inline void transpose(const typename V::T* src, int64_t rows, int64_t cols, typename V::T* dst) {
    simd::HWY_NAMESPACE::transpose_blocks<V>(src, rows, cols, cols, dst, rows);
}

// acc (d) += sum over rows of src (rows x d).
template <class V>
inline void add_column_sums(const typename V::T* src, int64_t rows, int64_t d, typename V::T* acc) {
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        V s = V::load(acc + c, m);
        for (int64_t i = 0; i < rows; ++i) s = s + V::load(src + i * d + c, m);
        s.store(acc + c, m);
    });
}

template <class V>
inline typename V::T dot(const typename V::T* a, const typename V::T* b, int64_t d) {
    V s = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        s = V::fma(V::load(a + c, m), V::load(b + c, m), s);
    });
    return V::reduce(s);
}

// ---------------------------------------------------------------- row-wise LayerNorm pieces
// Biased variance, std = sqrt(var + eps), x_hat = (z - mu) / std (spec 2.7 steps 3 and 7).

// Inner gradient of 1/2 ||gamma x_hat(z) + beta - (v - k)||^2 wrt z (one row). Overwrites z with
// x_hat; writes g = y - target and G; returns std.
template <class V>
typename V::T inner_grad_row(typename V::T* z, const typename V::T* k, const typename V::T* v,
                                              const typename V::T* gamma, const typename V::T* beta, int64_t d,
                                              typename V::T eps, typename V::T* g, typename V::T* G) {
    using T = typename V::T;
    const T inv_d = T(1) / static_cast<T>(d);
    V s = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) { s = s + V::load(z + c, m); });
    const V mu = V::set1(V::reduce(s) * inv_d);
    V sq = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V dz = V::keep(m, V::load(z + c, m) - mu);
        sq = V::fma(dz, dz, sq);
    });
    const T std = std::sqrt(V::reduce(sq) * inv_d + eps);
    const V inv_std = V::set1(T(1) / std);
    V sum_gh = V::zero(), sum_ghx = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V x = V::keep(m, (V::load(z + c, m) - mu) * inv_std);
        const V ga = V::load(gamma + c, m);
        const V gv = V::fma(ga, x, V::load(beta + c, m)) - (V::load(v + c, m) - V::load(k + c, m));
        const V gh = ga * gv;
        sum_gh = sum_gh + gh;
        sum_ghx = V::fma(gh, x, sum_ghx);
        x.store(z + c, m);
        gv.store(g + c, m);
    });
    const V mean_gh = V::set1(V::reduce(sum_gh) * inv_d);
    const V mean_ghx = V::set1(V::reduce(sum_ghx) * inv_d);
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V x = V::load(z + c, m);
        const V gh = V::load(gamma + c, m) * V::load(g + c, m);
        ((gh - mean_gh - x * mean_ghx) * inv_std).store(G + c, m);
    });
    return std;
}

// out = q + gamma x_hat(zb) + beta (one row). Overwrites zb with x_hat; returns std.
template <class V>
typename V::T ln_forward_row(typename V::T* zb, const typename V::T* q, const typename V::T* gamma,
                                              const typename V::T* beta, int64_t d, typename V::T eps,
                                              typename V::T* out) {
    using T = typename V::T;
    const T inv_d = T(1) / static_cast<T>(d);
    V s = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) { s = s + V::load(zb + c, m); });
    const V mu = V::set1(V::reduce(s) * inv_d);
    V sq = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V dz = V::keep(m, V::load(zb + c, m) - mu);
        sq = V::fma(dz, dz, sq);
    });
    const T std = std::sqrt(V::reduce(sq) * inv_d + eps);
    const V inv_std = V::set1(T(1) / std);
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V x = (V::load(zb + c, m) - mu) * inv_std;
        x.store(zb + c, m);
        (V::load(q + c, m) + V::fma(V::load(gamma + c, m), x, V::load(beta + c, m))).store(out + c, m);
    });
    return std;
}

// Backward of out = q + gamma x_hat + beta through x_hat (one row): dzb; accumulates dgamma, dbeta.
template <class V>
void ln_backward_row(const typename V::T* dout, const typename V::T* x, typename V::T std,
                                      const typename V::T* gamma, int64_t d, typename V::T* dzb,
                                      typename V::T* dgamma, typename V::T* dbeta) {
    using T = typename V::T;
    const T inv_d = T(1) / static_cast<T>(d);
    V s = V::zero(), sx = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V go = V::load(dout + c, m);
        const V x_c = V::load(x + c, m);
        const V dx = go * V::load(gamma + c, m);
        s = s + dx;
        sx = V::fma(dx, x_c, sx);
        V::fma(go, x_c, V::load(dgamma + c, m)).store(dgamma + c, m);
        (V::load(dbeta + c, m) + go).store(dbeta + c, m);
    });
    const V mean = V::set1(V::reduce(s) * inv_d);
    const V mean_x = V::set1(V::reduce(sx) * inv_d);
    const V inv_std = V::set1(T(1) / std);
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V dx = V::load(dout + c, m) * V::load(gamma + c, m);
        ((dx - mean - V::load(x + c, m) * mean_x) * inv_std).store(dzb + c, m);
    });
}

// Vector-Jacobian product of inner_grad_row (the second-order term): given dG, with
// u = gamma g, G = (u - mean u - x mean(u x)) / std, g = gamma x + beta - (v - k):
//   du = (dG - mean dG - x mean(dG x)) / std          (the map u -> G is symmetric)
//   dx = -(mean(u x) dG + u mean(dG x)) / std + gamma du gamma,   dstd = -(dG . G) / std
//   dz = (dx - mean dx - x mean(dx x)) / std + dstd x / d
// Writes dz and dg = gamma du (so d target = -dg); accumulates dgamma += du g + dg x, dbeta += dg.
template <class V>
void inner_grad_backward_row(const typename V::T* dG, const typename V::T* x, typename V::T std,
                                              const typename V::T* g, const typename V::T* G,
                                              const typename V::T* gamma, int64_t d, typename V::T* dz,
                                              typename V::T* dg, typename V::T* dgamma, typename V::T* dbeta) {
    using T = typename V::T;
    const T inv_d = T(1) / static_cast<T>(d);
    V s_dG = V::zero(), s_dGx = V::zero(), s_ux = V::zero(), s_dGG = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V dG_c = V::load(dG + c, m);
        const V x_c = V::load(x + c, m);
        s_dG = s_dG + dG_c;
        s_dGx = V::fma(dG_c, x_c, s_dGx);
        s_ux = V::fma(V::load(gamma + c, m) * V::load(g + c, m), x_c, s_ux);
        s_dGG = V::fma(dG_c, V::load(G + c, m), s_dGG);
    });
    const V mean_dG = V::set1(V::reduce(s_dG) * inv_d);
    const V mean_dGx = V::set1(V::reduce(s_dGx) * inv_d);
    const V mean_ux = V::set1(V::reduce(s_ux) * inv_d);
    const T inv_std_s = T(1) / std;
    const T dstd = -V::reduce(s_dGG) * inv_std_s;
    const V inv_std = V::set1(inv_std_s);
    // First pass: dx into dz (scratch), dg, the parameter gradients, and the sums for the LN backward.
    V s_dx = V::zero(), s_dxx = V::zero();
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V dG_c = V::load(dG + c, m);
        const V x_c = V::load(x + c, m);
        const V ga = V::load(gamma + c, m);
        const V g_c = V::load(g + c, m);
        const V u = ga * g_c;
        const V du = (dG_c - mean_dG - x_c * mean_dGx) * inv_std;
        const V dg_c = du * ga;
        const V dx = V::keep(m, V::fma(dg_c, ga, V::zero() - (mean_ux * dG_c + u * mean_dGx) * inv_std));
        dx.store(dz + c, m);
        dg_c.store(dg + c, m);
        V::fma(du, g_c, V::fma(dg_c, x_c, V::load(dgamma + c, m))).store(dgamma + c, m);
        (V::load(dbeta + c, m) + dg_c).store(dbeta + c, m);
        s_dx = s_dx + dx;
        s_dxx = V::fma(dx, x_c, s_dxx);
    });
    const V mean_dx = V::set1(V::reduce(s_dx) * inv_d);
    const V mean_dxx = V::set1(V::reduce(s_dxx) * inv_d);
    const V dstd_d = V::set1(dstd * inv_d);
    for_each_vector<V>(d, [&](int64_t c, auto m) {
        const V x_c = V::load(x + c, m);
        V::fma(dstd_d, x_c, (V::load(dz + c, m) - mean_dx - x_c * mean_dxx) * inv_std).store(dz + c, m);
    });
}

// ---------------------------------------------------------------- one mini-batch

// Workspace of one (sample, head) task: every intermediate of one mini-batch of M <= bmax tokens.
template <class V>
struct MiniBatchWork {
    using T = typename V::T;
    int64_t d = 0, bmax = 0;
    std::vector<T> q, k, v, kt, z, g, G, Gen, zb, out, S, c, Pn, lr, e;
    std::vector<T> std1, std2;
    std::vector<T> u;  // rows of u the folded convolutions read (ScanArgs::u), sized on first use
    // backward scratch
    std::vector<T> dout, dzb, dq, dk, dG, dz, dg, H, dP, dS, dlr, Wt, dWt, Gt;
    void init(int64_t d_, int64_t bmax_, bool backward) {
        d = d_;
        bmax = bmax_;
        const int64_t md = bmax * d, mm = bmax * bmax;
        for (auto* b : {&q, &k, &v, &kt, &z, &g, &G, &Gen, &zb, &out}) b->assign(md, T(0));
        for (auto* b : {&S, &c, &Pn}) b->assign(mm, T(0));
        for (auto* b : {&lr, &e, &std1, &std2}) b->assign(bmax, T(0));
        if (backward) {
            for (auto* b : {&dout, &dzb, &dq, &dk, &dG, &dz, &dg, &H, &Gt}) b->assign(md, T(0));
            for (auto* b : {&dP, &dS}) b->assign(mm, T(0));
            dlr.assign(bmax, T(0));
            Wt.assign(d * d, T(0));
            dWt.assign(d * d, T(0));
        }
    }
};

// Forward of one mini-batch (q, k, v, lr of M tokens already in `w`) from state (W, bias).
// Always computes the inner gradient G and the state-update rows Gen = -e_j G_j; with
// `outputs` also S = Q K^T, the coefficients c, Pn = -c (S + 1), Zb and out.
template <class V>
void mini_batch_forward(MiniBatchWork<V>& w, int64_t M, const typename V::T* W,
                                         const typename V::T* bias, const typename V::T* tau,
                                         const typename V::T* gamma, const typename V::T* beta, typename V::T eps,
                                         bool causal, bool outputs) {
    using T = typename V::T;
    const int64_t d = w.d;
    gemm_acc<V>(M, d, d, w.k.data(), d, 1, W, d, w.z.data(), d, GemmInit::Row, bias);
    for (int64_t i = 0; i < M; ++i)
        w.std1[i] = inner_grad_row<V>(w.z.data() + i * d, w.k.data() + i * d, w.v.data() + i * d, gamma, beta, d,
                                      eps, w.g.data() + i * d, w.G.data() + i * d);
    const T tau_last = tau[M - 1];
    for (int64_t j = 0; j < M; ++j) {
        w.e[j] = tau_last * w.lr[j];
        const T* Gj = w.G.data() + j * d;
        T* Genj = w.Gen.data() + j * d;
        for (int64_t c = 0; c < d; ++c) Genj[c] = -w.e[j] * Gj[c];
    }
    if (!outputs) return;
    transpose<V>(w.k.data(), M, d, w.kt.data());
    gemm_acc<V>(M, M, d, w.q.data(), d, 1, w.kt.data(), M, w.S.data(), M, GemmInit::Zero);
    for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < M; ++j) {
            // eta_ij = tau_i lr_j for j <= i (causal, tril with diagonal); tau_{M-1} lr_j (non-causal).
            const T cij = causal ? (j <= i ? tau[i] * w.lr[j] : T(0)) : w.e[j];
            w.c[i * M + j] = cij;
            w.Pn[i * M + j] = -cij * (w.S[i * M + j] + T(1));
        }
    gemm_acc<V>(M, d, d, w.q.data(), d, 1, W, d, w.zb.data(), d, GemmInit::Row, bias);
    gemm_acc<V>(M, d, M, w.Pn.data(), M, 1, w.G.data(), d, w.zb.data(), d);
    for (int64_t i = 0; i < M; ++i)
        w.std2[i] = ln_forward_row<V>(w.zb.data() + i * d, w.q.data() + i * d, gamma, beta, d, eps,
                                      w.out.data() + i * d);
}

// State update with the last row of eta: W += K^T Gen, bias += sum_j Gen_j.
template <class V>
void mini_batch_update(MiniBatchWork<V>& w, int64_t M, typename V::T* W, typename V::T* bias) {
    const int64_t d = w.d;
    gemm_acc<V>(d, d, M, w.k.data(), 1, d, w.Gen.data(), d, W, d);
    add_column_sums<V>(w.Gen.data(), M, d, bias);
}

// Adjoint of one mini-batch (after mini_batch_forward with outputs). In: w.dout, the adjoint
// (dW, dbias) of the state after the mini-batch. Out: w.dq, w.dk, w.dg (= -dV), w.dlr, the
// adjoint of the state before it (in place), dgamma/dbeta/dtau accumulated.
template <class V>
void mini_batch_backward(MiniBatchWork<V>& w, int64_t M, const typename V::T* W,
                                          typename V::T* dW, typename V::T* dbias, const typename V::T* tau,
                                          const typename V::T* gamma, bool causal, typename V::T* dgamma,
                                          typename V::T* dbeta, typename V::T* dtau) {
    using T = typename V::T;
    const int64_t d = w.d;
    T* dq = w.dq.data();
    T* dk = w.dk.data();
    // out = q + LN(Zb)
    for (int64_t i = 0; i < M; ++i)
        ln_backward_row<V>(w.dout.data() + i * d, w.zb.data() + i * d, w.std2[i], gamma, d, w.dzb.data() + i * d,
                           dgamma, dbeta);
    std::copy(w.dout.begin(), w.dout.begin() + M * d, dq);
    // Zb = Q W + bias + Pn G
    transpose<V>(W, d, d, w.Wt.data());
    gemm_acc<V>(M, d, d, w.dzb.data(), d, 1, w.Wt.data(), d, dq, d);
    transpose<V>(w.G.data(), M, d, w.Gt.data());
    gemm_acc<V>(M, M, d, w.dzb.data(), d, 1, w.Gt.data(), M, w.dP.data(), M, GemmInit::Zero);  // d Pn
    gemm_acc<V>(M, d, M, w.Pn.data(), 1, M, w.dzb.data(), d, w.dG.data(), d, GemmInit::Zero);  // Pn^T dZb
    // State update W' = W + K^T Gen, bias' = bias + sum Gen with Gen_j = -e_j G_j:
    // H = K dW' + dbias'; dG_j -= e_j H_j; de_j = -H_j . G_j; dK = Gen dW'^T.
    gemm_acc<V>(M, d, d, w.k.data(), d, 1, dW, d, w.H.data(), d, GemmInit::Row, dbias);
    transpose<V>(dW, d, d, w.dWt.data());
    gemm_acc<V>(M, d, d, w.Gen.data(), d, 1, w.dWt.data(), d, dk, d, GemmInit::Zero);
    T de_lr_sum = T(0);  // sum_j de_j lr_j (-> dtau_{M-1})
    for (int64_t j = 0; j < M; ++j) {
        const T* Hj = w.H.data() + j * d;
        const T de = -dot<V>(Hj, w.G.data() + j * d, d);
        T* dGj = w.dG.data() + j * d;
        for (int64_t c = 0; c < d; ++c) dGj[c] -= w.e[j] * Hj[c];
        w.dlr[j] = tau[M - 1] * de;
        de_lr_sum += de * w.lr[j];
    }
    // Pn = -c (S + 1): dc = -dPn (S + 1), dS = -dPn c.
    T dtau_last = de_lr_sum;
    for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < M; ++j) {
            const T dpn = w.dP[i * M + j];
            const bool active = causal ? j <= i : true;
            w.dS[i * M + j] = active ? -dpn * w.c[i * M + j] : T(0);
            if (!active) continue;
            const T dc = -dpn * (w.S[i * M + j] + T(1));
            if (causal) {
                w.dlr[j] += dc * tau[i];
                dtau[i] += dc * w.lr[j];
            } else {
                w.dlr[j] += dc * tau[M - 1];
                dtau_last += dc * w.lr[j];
            }
        }
    dtau[M - 1] += dtau_last;
    gemm_acc<V>(M, d, M, w.dS.data(), M, 1, w.k.data(), d, dq, d);  // dS K
    gemm_acc<V>(M, d, M, w.dS.data(), 1, M, w.q.data(), d, dk, d);  // dS^T Q
    // G = inner gradient of Z = K W + bias with target V - K.
    for (int64_t i = 0; i < M; ++i)
        inner_grad_backward_row<V>(w.dG.data() + i * d, w.z.data() + i * d, w.std1[i], w.g.data() + i * d,
                                   w.G.data() + i * d, gamma, d, w.dz.data() + i * d, w.dg.data() + i * d, dgamma,
                                   dbeta);
    gemm_acc<V>(M, d, d, w.dz.data(), d, 1, w.Wt.data(), d, dk, d);
    for (int64_t i = 0; i < M * d; ++i) dk[i] += w.dg[i];
    // Adjoint of the state before the mini-batch.
    gemm_acc<V>(d, d, M, w.q.data(), 1, d, w.dzb.data(), d, dW, d);
    gemm_acc<V>(d, d, M, w.k.data(), 1, d, w.dz.data(), d, dW, d);
    add_column_sums<V>(w.dzb.data(), M, d, dbias);
    add_column_sums<V>(w.dz.data(), M, d, dbias);
}

// ---------------------------------------------------------------- the scan of one (sample, head)

// Rows t0..t0+M-1 of a strided (B, nh, T, d) tensor of element type In (already offset to the
// (sample, head)) into a packed M x d buffer, converting to the compute type.
template <class V, typename In>
inline void load_rows(const In* src, const int64_t* s, int64_t t0, int64_t M, int64_t d,
                                       typename V::T* dst) {
    using T = typename V::T;
    for (int64_t i = 0; i < M; ++i) {
        const In* row = src + (t0 + i) * s[2];
        T* out = dst + i * d;
        if (s[3] == 1) {
            for (int64_t c = 0; c < d; ++c) out[c] = static_cast<T>(row[c]);
        } else {
            for (int64_t c = 0; c < d; ++c) out[c] = static_cast<T>(row[c * s[3]]);
        }
    }
}

template <class V, typename In>
inline void store_rows(const typename V::T* src, int64_t t0, int64_t M, int64_t d, In* dst,
                                        const int64_t* s) {
    for (int64_t i = 0; i < M; ++i) {
        In* row = dst + (t0 + i) * s[2];
        const typename V::T* in = src + i * d;
        for (int64_t c = 0; c < d; ++c) row[c * s[3]] = static_cast<In>(in[c]);
    }
}

// q (if with_q) and k of mini-batch [t0, t0 + M) of task (b, h) as the causal convolutions of u (ScanArgs::u) over
// the head's d channels: out[t] = bias + sum_s taps[s] u[t - (k-1) + s], u[< 0] = 0, the taps added in the order
// of the convolution op's kernel, and rounded through In as that op's result would be.
template <class V, typename In>
inline void conv_mini_batch(const ScanArgs& a, int64_t b, int64_t h, int64_t t0, int64_t M, MiniBatchWork<V>& w,
                            bool with_q) {
    using T = typename V::T;
    const int64_t d = a.d, K = a.conv_k, D = a.nh * d, rows = M + K - 1;
    if (static_cast<int64_t>(w.u.size()) < rows * d) w.u.resize(static_cast<size_t>(rows * d));
    // Row r of w.u is token t0 - (K-1) + r; those before token 0 are zeros.
    const int64_t zero_rows = std::min(rows, std::max<int64_t>(0, (K - 1) - t0));
    std::fill(w.u.begin(), w.u.begin() + zero_rows * d, T(0));
    const int64_t strides[4] = {a.us[0], 0, a.us[1], 1};  // (B, T, nh * d) as load_rows reads a (B, nh, T, d)
    load_rows<V, In>(static_cast<const In*>(a.u) + b * a.us[0] + h * d, strides, t0 - (K - 1) + zero_rows,
                     rows - zero_rows, d, w.u.data() + zero_rows * d);
    const T* q_taps = static_cast<const T*>(a.q_taps) + h * d;
    const T* k_taps = static_cast<const T*>(a.k_taps) + h * d;
    const T* q_bias = static_cast<const T*>(a.q_bias) + h * d;
    const T* k_bias = static_cast<const T*>(a.k_bias) + h * d;
    for (int64_t i = 0; i < M; ++i)
        for_each_vector<V>(d, [&](int64_t c, auto m) {
            V q = V::load(q_bias + c, m), k = V::load(k_bias + c, m);
            for (int64_t s = 0; s < K; ++s) {
                const V x = V::load(w.u.data() + (i + s) * d + c, m);
                q = V::fma(V::load(q_taps + s * D + c, m), x, q);
                k = V::fma(V::load(k_taps + s * D + c, m), x, k);
            }
            if (with_q) q.store(w.q.data() + i * d + c, m);
            k.store(w.k.data() + i * d + c, m);
        });
    if constexpr (std::is_same_v<In, c10::BFloat16>) {
        // Through the SIMD layer's conversions, a chunk at a time on the stack: element by element through
        // c10::BFloat16 this took 11 % of vittt_tiny's bf16 pass at 1024 px (AMX Xeon).
        static_assert(std::is_same_v<T, float>, "bf16 inputs are computed in float");
        constexpr int64_t kChunk = 512;
        uint16_t rounded[kChunk];
        for (float* x : {with_q ? w.q.data() : nullptr, w.k.data()}) {
            if (x == nullptr) continue;
            for (int64_t i = 0; i < M * d; i += kChunk) {
                const int64_t n = std::min(kChunk, M * d - i);
                a.kernels->narrow_to_bf16(x + i, rounded, n);
                a.kernels->widen_bf16(rounded, x + i, n);
            }
        }
    } else {
        static_assert(std::is_same_v<In, T>, "float32 and float64 inputs are computed in their own type");
    }
}

// Loads q, k, v, lr of mini-batch [t0, t0 + M) of task bh (q and k from u when the scan folds the convolutions).
template <class V, typename In>
inline void load_mini_batch(const ScanArgs& a, int64_t b, int64_t h, int64_t t0, int64_t M,
                                             MiniBatchWork<V>& w, bool with_q) {
    using T = typename V::T;
    if (a.u != nullptr) {
        conv_mini_batch<V, In>(a, b, h, t0, M, w, with_q);
    } else {
        const In* q = static_cast<const In*>(a.q) + b * a.qs[0] + h * a.qs[1];
        const In* k = static_cast<const In*>(a.k) + b * a.ks[0] + h * a.ks[1];
        if (with_q) load_rows<V, In>(q, a.qs, t0, M, a.d, w.q.data());
        load_rows<V, In>(k, a.ks, t0, M, a.d, w.k.data());
    }
    const In* v = static_cast<const In*>(a.v) + b * a.vs[0] + h * a.vs[1];
    load_rows<V, In>(v, a.vs, t0, M, a.d, w.v.data());
    const T* lr = static_cast<const T*>(a.lr) + (b * a.nh + h) * a.T;
    std::copy(lr + t0, lr + t0 + M, w.lr.data());
}

// Forward scan of tasks [begin, end) (task bh = b * nh + h): outputs, final states, checkpoints (if a.ckpt),
// norms. The tasks advance together, one mini-batch of each in turn: q, k and v are token-major, so the heads
// of one sample share every token's rows, and a thread that holds several of them reads those rows whole and
// in order. Scanning one head to the end before the next read 256 of every 768 bytes (vittt_tiny), and
// in the model's layout that made the scan 1.5x slower than on head-major copies of the same inputs.
template <class V, typename In>
void scan_forward(const ScanArgs& a, int64_t begin, int64_t end, MiniBatchWork<V>& w) {
    using T = typename V::T;
    const int64_t d = a.d, dd = d * d;
    for (int64_t bh = begin; bh < end; ++bh) {
        std::copy(static_cast<const T*>(a.w0) + bh * dd, static_cast<const T*>(a.w0) + (bh + 1) * dd,
                  static_cast<T*>(a.final_W) + bh * dd);
        std::copy(static_cast<const T*>(a.b0) + bh * d, static_cast<const T*>(a.b0) + (bh + 1) * d,
                  static_cast<T*>(a.final_b) + bh * d);
    }
    const T* tau = static_cast<const T*>(a.tau);
    const int64_t nmb = (a.T + a.bmax - 1) / a.bmax;
    const int64_t ngroups = (nmb + a.ckpt_every - 1) / a.ckpt_every;
    for (int64_t mb = 0; mb < nmb; ++mb) {
        const int64_t t0 = mb * a.bmax, M = std::min(a.bmax, a.T - t0);
        for (int64_t bh = begin; bh < end; ++bh) {
            const int64_t b = bh / a.nh, h = bh % a.nh;
            const T* gamma = static_cast<const T*>(a.gamma) + h * d;
            const T* beta = static_cast<const T*>(a.beta) + h * d;
            T* W = static_cast<T*>(a.final_W) + bh * dd;
            T* bias = static_cast<T*>(a.final_b) + bh * d;
            if (a.ckpt != nullptr && mb % a.ckpt_every == 0) {
                T* slot = static_cast<T*>(a.ckpt) + (bh * ngroups + mb / a.ckpt_every) * (dd + d);
                std::copy(W, W + dd, slot);
                std::copy(bias, bias + d, slot + dd);
            }
            load_mini_batch<V, In>(a, b, h, t0, M, w, true);
            mini_batch_forward<V>(w, M, W, bias, tau, gamma, beta, static_cast<T>(a.eps), a.causal, true);
            In* out = static_cast<In*>(a.out) + b * a.outs[0] + h * a.outs[1];
            store_rows<V, In>(w.out.data(), t0, M, d, out, a.outs);
            if (a.grad_norms != nullptr) {
                T* norms = static_cast<T*>(a.grad_norms) + bh * a.T + t0;
                for (int64_t i = 0; i < M; ++i)
                    norms[i] = std::sqrt(dot<V>(w.k.data() + i * d, w.k.data() + i * d, d)) *
                               std::sqrt(dot<V>(w.G.data() + i * d, w.G.data() + i * d, d));
            }
            mini_batch_update<V>(w, M, W, bias);
        }
    }
}

// Backward scan of task bh: groups of ckpt_every mini-batches in reverse; each group's states
// are recomputed from its checkpoint, then its mini-batches are back-propagated in reverse.
template <class V, typename In>
void scan_backward(const ScanArgs& a, int64_t bh, MiniBatchWork<V>& w, std::vector<typename V::T>& states) {
    using T = typename V::T;
    const int64_t b = bh / a.nh, h = bh % a.nh, d = a.d, dd = d * d;
    const T* gamma = static_cast<const T*>(a.gamma) + h * d;
    const T* beta = static_cast<const T*>(a.beta) + h * d;
    const T* tau = static_cast<const T*>(a.tau);
    const T eps = static_cast<T>(a.eps);
    T* dW = static_cast<T*>(a.dW0) + bh * dd;
    T* dbias = static_cast<T*>(a.db0) + bh * d;
    T* dgamma = static_cast<T*>(a.dgamma) + bh * d;
    T* dbeta = static_cast<T*>(a.dbeta) + bh * d;
    T* dtau = static_cast<T*>(a.dtau) + bh * a.bmax;
    T* dlr = static_cast<T*>(a.dlr) + bh * a.T;
    const In* dout = static_cast<const In*>(a.dout) + b * a.douts[0] + h * a.douts[1];
    In* dq = static_cast<In*>(a.dq) + b * a.dqs[0] + h * a.dqs[1];
    In* dk = static_cast<In*>(a.dk) + b * a.dks[0] + h * a.dks[1];
    In* dv = static_cast<In*>(a.dv) + b * a.dvs[0] + h * a.dvs[1];
    const int64_t nmb = (a.T + a.bmax - 1) / a.bmax;
    const int64_t ngroups = (nmb + a.ckpt_every - 1) / a.ckpt_every;
    const int64_t slot = dd + d;
    states.resize(static_cast<size_t>(a.ckpt_every * slot));
    for (int64_t grp = ngroups - 1; grp >= 0; --grp) {
        const int64_t first = grp * a.ckpt_every, last = std::min(nmb, first + a.ckpt_every);
        const T* ck = static_cast<const T*>(a.ckpt) + (bh * ngroups + grp) * slot;
        std::copy(ck, ck + slot, states.data());
        // States at the start of every mini-batch of the group.
        for (int64_t mb = first; mb + 1 < last; ++mb) {
            T* cur = states.data() + (mb - first) * slot;
            T* next = cur + slot;
            const int64_t t0 = mb * a.bmax, M = std::min(a.bmax, a.T - t0);
            load_mini_batch<V, In>(a, b, h, t0, M, w, false);
            mini_batch_forward<V>(w, M, cur, cur + dd, tau, gamma, beta, eps, a.causal, false);
            std::copy(cur, cur + slot, next);
            mini_batch_update<V>(w, M, next, next + dd);
        }
        for (int64_t mb = last - 1; mb >= first; --mb) {
            const T* cur = states.data() + (mb - first) * slot;
            const int64_t t0 = mb * a.bmax, M = std::min(a.bmax, a.T - t0);
            load_mini_batch<V, In>(a, b, h, t0, M, w, true);
            mini_batch_forward<V>(w, M, cur, cur + dd, tau, gamma, beta, eps, a.causal, true);
            load_rows<V, In>(dout, a.douts, t0, M, d, w.dout.data());
            mini_batch_backward<V>(w, M, cur, dW, dbias, tau, gamma, a.causal, dgamma, dbeta, dtau);
            store_rows<V, In>(w.dq.data(), t0, M, d, dq, a.dqs);
            store_rows<V, In>(w.dk.data(), t0, M, d, dk, a.dks);
            for (int64_t i = 0; i < M * d; ++i) w.dg[i] = -w.dg[i];
            store_rows<V, In>(w.dg.data(), t0, M, d, dv, a.dvs);
            std::copy(w.dlr.begin(), w.dlr.begin() + M, dlr + t0);
        }
    }
}
