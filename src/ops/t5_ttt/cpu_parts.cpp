// The parts shared by the fused CPU T⁵ and DiT⁵ TTT attentions (see cpu_parts.h).
#include "ops/t5_ttt/cpu_parts.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>

namespace linvis::ops::fused_detail::t5_parts {

using torch::Tensor;

Tensor f32_rows(const Tensor& t) {
    Tensor x = t.scalar_type() == torch::kFloat32 ? t : t.to(torch::kFloat32);
    if (x.stride(-1) != 1) x = x.contiguous();
    return x;
}

Tokens tokens_of(const Tensor& t) { return {const_cast<float*>(t.data_ptr<float>()), t.stride(0), t.stride(1)}; }
Image image_of(const Tokens& t, int64_t b, const Dims& s) { return {t.row(b, 0), s.W * t.sn, t.sn, s.H, s.W, s.C}; }
MutImage mut_image_of(const Tokens& t, int64_t b, const Dims& s) {
    return {t.row(b, 0), s.W * t.sn, t.sn, s.H, s.W, s.C};
}

HeadWeights::HeadWeights(const std::vector<Tensor>& weights, const std::vector<bool>& transposed, int64_t d)
    : transposes_(weights.size()), dd_(d * d) {
    for (size_t i = 0; i < weights.size(); ++i) {
        rows_.push_back(weights[i].to(torch::kFloat32).contiguous());
        ptr_.push_back(rows_[i].data_ptr<float>());
        if (i >= transposed.size() || !transposed[i]) continue;
        const int64_t heads = rows_[i].numel() / dd_;
        transposes_[i].resize(heads * dd_);
        for (int64_t hh = 0; hh < heads; ++hh) transpose(w(i, hh), d, d, d, transposes_[i].data() + hh * dd_);
    }
}

void updated_weights(const std::vector<const float*>& parts, int64_t parts_per_head, const HeadWeights& hw,
                     const Dims& s, float* wn, float* g, float* wnT) {
    const int64_t dd = s.d * s.d, BH = s.B * s.h, count = static_cast<int64_t>(parts.size()) * BH;
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> sum(g == nullptr ? dd : 0);
        for (int64_t m = begin; m < end; ++m) {
            const int64_t i = m / BH, bh = m % BH;
            float* __restrict acc = g != nullptr ? g + m * dd : sum.data();
            reduce_partials(parts[i] + bh * parts_per_head * dd, 1, parts_per_head, dd, acc);
            const float* __restrict w = hw.w(i, bh % s.h);
            float* __restrict o = wn + m * dd;
            for (int64_t j = 0; j < dd; ++j) o[j] = w[j] - acc[j];
            if (wnT != nullptr) transpose(o, s.d, s.d, s.d, wnT + m * dd);
        }
    });
}

void negated_with_transposes(const std::vector<float>& dw_updated, int64_t count, int64_t d, std::vector<float>& dG,
                             std::vector<float>& dGT) {
    const int64_t dd = d * d;
    dG.resize(count * dd);
    dGT.resize(count * dd);
    for (int64_t i = 0; i < count; ++i) {
        for (int64_t j = 0; j < dd; ++j) dG[i * dd + j] = -dw_updated[i * dd + j];
        transpose(dG.data() + i * dd, d, d, d, dGT.data() + i * dd);
    }
}

Tensor weight_gradients(const std::vector<float>& dw_updated, const std::vector<float>& direct, int64_t weights,
                        const Dims& s) {
    const int64_t dd = s.d * s.d, BH = s.B * s.h;
    Tensor dw = torch::zeros({weights, 1, s.h, s.d, s.d}, torch::kFloat32);
    float* out = dw.data_ptr<float>();
    for (int64_t i = 0; i < weights; ++i)
        for (int64_t bh = 0; bh < BH; ++bh)
            for (int64_t j = 0; j < dd; ++j)
                out[(i * s.h + bh % s.h) * dd + j] +=
                    dw_updated[(i * BH + bh) * dd + j] + direct[(i * BH + bh) * dd + j];
    return dw;
}

std::vector<float> taps_of(const Tensor& w, int64_t C) {
    Tensor wf = w.to(torch::kFloat32).contiguous();
    const float* p = wf.data_ptr<float>();
    std::vector<float> taps(9 * C);
    for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < 9; ++t) taps[t * C + c] = p[c * 9 + t];
    return taps;
}

Prepared prepare(const Tensor& q, const Tensor& k, const Tensor& v, int64_t heads, int64_t H, int64_t W) {
    Prepared in{f32_rows(q), f32_rows(k), f32_rows(v), {}};
    const int64_t B = q.size(0), N = q.size(1), C = q.size(2), d = C / heads;
    Dims& s = in.s;
    s = Dims{B, N, C, heads, d, H, W, std::pow(static_cast<double>(d), -0.5)};
    // Blocks of equal length: two blocks of 98 tokens at 224 px, where 104 + 92 left one core idle 6 % of the time.
    const int64_t blocks = std::max(kMinBlocks, (N + kTokenBlock - 1) / kTokenBlock);
    s.block = std::max<int64_t>(1, (N + blocks - 1) / blocks);
    s.blocks = (N + s.block - 1) / s.block;
    s.per_group = (s.blocks + kGroupsPerHead - 1) / kGroupsPerHead;
    s.groups = (s.blocks + s.per_group - 1) / s.per_group;
    return in;
}


namespace {

// sum[c] += e and sumsq[c] += e^2 with e = x[c] - shift[c], over `count` rows (row stride ld), in double.
LINVIS_SIMD_INLINE void shifted_moments_body(const float* x, int64_t count, int64_t ld, int64_t C,
                                             const float* __restrict shift, double* __restrict sum,
                                             double* __restrict sumsq) {
    for (int64_t n = 0; n < count; ++n) {
        const float* __restrict r = x + n * ld;
        for (int64_t c = 0; c < C; ++c) {
            const double e = static_cast<double>(r[c]) - shift[c];
            sum[c] += e;
            sumsq[c] += e * e;
        }
    }
}
LINVIS_SIMD_CLONES(shifted_moments,
                   (const float* x, int64_t count, int64_t ld, int64_t C, const float* shift, double* sum,
                    double* sumsq),
                   (x, count, ld, C, shift, sum, sumsq))

// out[n*ldo + c] = (x[n*ld + c] - mean[c]) * rstd[c] over `count` rows.
LINVIS_SIMD_INLINE void normalise_rows_body(const float* x, int64_t count, int64_t ld, int64_t C,
                                            const float* __restrict mean, const float* __restrict rstd, float* out,
                                            int64_t ldo) {
    for (int64_t n = 0; n < count; ++n) {
        const float* __restrict r = x + n * ld;
        float* __restrict o = out + n * ldo;
        for (int64_t c = 0; c < C; ++c) o[c] = (r[c] - mean[c]) * rstd[c];
    }
}
LINVIS_SIMD_CLONES(normalise_rows,
                   (const float* x, int64_t count, int64_t ld, int64_t C, const float* mean, const float* rstd,
                    float* out, int64_t ldo),
                   (x, count, ld, C, mean, rstd, out, ldo))

}  // namespace

void key_stats(const Tokens& k, const Dims& s, double eps, const float* channel_scale, float* mean, float* rstd,
               float* inv_std) {
    const GridTasks g(s.B, s.H, s.W, kTokenBlock);
    std::vector<double> sums(g.count() * s.C, 0.0), squares(g.count() * s.C, 0.0);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task), n0 = g.y0(task) * s.W;
            shifted_moments(k.row(b, n0), g.y1(task) * s.W - n0, k.sn, s.C, k.row(b, 0), sums.data() + task * s.C,
                            squares.data() + task * s.C);
        }
    });
    const double inv_n = 1.0 / static_cast<double>(s.N);
    for (int64_t b = 0; b < s.B; ++b) {
        const float* shift = k.row(b, 0);
        for (int64_t c = 0; c < s.C; ++c) {
            double sum = 0.0, sq = 0.0;
            for (int64_t ch = 0; ch < g.chunks; ++ch) {  // task order: the same result for any thread count
                sum += sums[(b * g.chunks + ch) * s.C + c];
                sq += squares[(b * g.chunks + ch) * s.C + c];
            }
            const double e_mean = sum * inv_n, var = std::max(sq * inv_n - e_mean * e_mean, 0.0);
            const double a = channel_scale != nullptr ? channel_scale[c] : 1.0;
            const double inv = 1.0 / std::sqrt(a * a * var + eps);
            mean[b * s.C + c] = static_cast<float>(shift[c] + e_mean);
            rstd[b * s.C + c] = static_cast<float>(a * inv);
            if (inv_std != nullptr) inv_std[b * s.C + c] = static_cast<float>(inv);
        }
    }
}

void query_locality(const Tokens& q, const std::vector<float>& qtaps, const float* qbias, const Dims& s,
                    const Tokens& q2) {
    const std::vector<float> taps = residual_taps(qtaps.data(), s.C);
    const GridTasks g(s.B, s.H, s.W, kTokenBlock);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task);
            stencil_apply(image_of(q, b, s), taps.data(), false, mut_image_of(q2, b, s), g.y0(task), g.y1(task),
                          false, qbias);
        }
    });
}

void key_locality(const Tokens& k, const float* mean, const float* rstd, const std::vector<float>& ktaps,
                  const float* kbias, const Dims& s, const Tokens& kn, const Tokens& k2) {
    const GridTasks g(s.B, s.H, s.W, kTokenBlock);
    at::parallel_for(0, g.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = g.sample(task), n0 = g.y0(task) * s.W;
            normalise_rows(k.row(b, n0), g.y1(task) * s.W - n0, k.sn, s.C, mean + b * s.C, rstd + b * s.C,
                           kn.row(b, n0), kn.sn);
        }
    });
    query_locality(kn, ktaps, kbias, s, k2);  // the same residual depthwise conv, on normalised keys
}

LINVIS_SIMD_INLINE void scale_rows_body(int64_t T, int64_t d, const float* __restrict src, float factor, float* dst,
                                         int64_t ldd) {
    for (int64_t t = 0; t < T; ++t) {
        float* __restrict o = dst + t * ldd;
        for (int64_t j = 0; j < d; ++j) o[j] = src[t * d + j] * factor;
    }
}
LINVIS_SIMD_CLONES(scale_rows, (int64_t T, int64_t d, const float* src, float factor, float* dst, int64_t ldd),
                  (T, d, src, factor, dst, ldd))


ConvGradients residual_conv_backward(const Tokens& X, const Tokens& DY, const std::vector<float>& taps, const Dims& s,
                                     const Tokens& DX) {
    const int64_t C = s.C;
    const GridTasks gt(s.B, s.H, s.W, kTokenBlock);
    std::vector<float> w_parts(gt.count() * 9 * C, 0.0f);
    std::vector<double> b_parts(gt.count() * C, 0.0);
    at::parallel_for(0, gt.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = gt.sample(task), y0 = gt.y0(task), y1 = gt.y1(task);
            stencil_apply(image_of(DY, b, s), taps.data(), true, mut_image_of(DX, b, s), y0, y1, false);
            stencil_reduce(image_of(X, b, s), image_of(DY, b, s), w_parts.data() + task * 9 * C, y0, y1);
            double* r = b_parts.data() + task * C;
            for (int64_t n = y0 * s.W; n < y1 * s.W; ++n) {
                const float* dy = DY.row(b, n);
                float* dx = DX.row(b, n);
                for (int64_t c = 0; c < C; ++c) {
                    dx[c] += dy[c];
                    r[c] += dy[c];
                }
            }
        }
    });
    ConvGradients g{torch::zeros({C, 1, 3, 3}, torch::kFloat32), torch::zeros({C}, torch::kFloat32)};
    float *dw = g.weight.data_ptr<float>(), *db = g.bias.data_ptr<float>();
    for (int64_t task = 0; task < gt.count(); ++task)  // task order: the same result for any thread count
        for (int64_t c = 0; c < C; ++c) {
            for (int64_t t = 0; t < 9; ++t) dw[c * 9 + t] += w_parts[task * 9 * C + t * C + c];
            db[c] += static_cast<float>(b_parts[task * C + c]);
        }
    return g;
}

ConvGradients key_side_backward(const Tokens& K, const Tokens& KN, const Tokens& DK2, const Tokens& DKN,
                                const std::vector<float>& ktaps, const float* rstd, const Dims& s,
                                const float* inv_std, AffineGradients* affine) {
    const int64_t C = s.C;
    const GridTasks gt(s.B, s.H, s.W, kTokenBlock);
    std::vector<float> kw_parts(gt.count() * 9 * C, 0.0f);
    std::vector<double> kred(gt.count() * 3 * C, 0.0);  // per task: Σdk2, Σdkn, Σdkn*kn
    at::parallel_for(0, gt.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = gt.sample(task), y0 = gt.y0(task), y1 = gt.y1(task);
            stencil_apply(image_of(DK2, b, s), ktaps.data(), true, mut_image_of(DKN, b, s), y0, y1, false);
            stencil_reduce(image_of(KN, b, s), image_of(DK2, b, s), kw_parts.data() + task * 9 * C, y0, y1);
            double* r = kred.data() + task * 3 * C;
            for (int64_t n = y0 * s.W; n < y1 * s.W; ++n) {
                const float *k2g = DK2.row(b, n), *knr = KN.row(b, n);
                float* dknr = DKN.row(b, n);
                for (int64_t c = 0; c < C; ++c) {
                    dknr[c] += k2g[c];
                    r[c] += k2g[c];
                    r[C + c] += dknr[c];
                    r[2 * C + c] += static_cast<double>(dknr[c]) * knr[c];
                }
            }
        }
    });
    ConvGradients g{torch::zeros({C, 1, 3, 3}, torch::kFloat32), torch::zeros({C}, torch::kFloat32)};
    float *dkw = g.weight.data_ptr<float>(), *dkb = g.bias.data_ptr<float>();
    std::vector<double> mean_dkn(s.B * C, 0.0), mean_dknkn(s.B * C, 0.0);
    for (int64_t task = 0; task < gt.count(); ++task) {
        const int64_t b = gt.sample(task);
        const double* r = kred.data() + task * 3 * C;
        for (int64_t c = 0; c < C; ++c) {
            for (int64_t t = 0; t < 9; ++t) dkw[c * 9 + t] += kw_parts[task * 9 * C + t * C + c];
            dkb[c] += static_cast<float>(r[c]);
            mean_dkn[b * C + c] += r[C + c] / static_cast<double>(s.N);
            mean_dknkn[b * C + c] += r[2 * C + c] / static_cast<double>(s.N);
        }
    }
    // Instance norm backward: dk = rstd * (dkn - mean(dkn) - kn * mean(dkn * kn)), written over dk2.
    std::vector<double> affine_parts(affine != nullptr ? gt.count() * 2 * C : 0, 0.0);  // per task: Σdu*k, Σdu
    at::parallel_for(0, gt.count(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = gt.sample(task);
            const float* rs = rstd + b * C;
            double* r = affine != nullptr ? affine_parts.data() + task * 2 * C : nullptr;
            for (int64_t n = gt.y0(task) * s.W; n < gt.y1(task) * s.W; ++n) {
                const float *g = DKN.row(b, n), *knr = KN.row(b, n);
                float* o = DK2.row(b, n);
                for (int64_t c = 0; c < C; ++c) {
                    const float x = g[c] - static_cast<float>(mean_dkn[b * C + c]) -
                                    knr[c] * static_cast<float>(mean_dknkn[b * C + c]);
                    if (r != nullptr) {
                        const double du = static_cast<double>(inv_std[b * C + c]) * x;
                        r[c] += du * K.row(b, n)[c];
                        r[C + c] += du;
                    }
                    o[c] = rs[c] * x;
                }
            }
        }
    });
    if (affine != nullptr) {
        affine->scale.assign(C, 0.0);
        affine->offset.assign(C, 0.0);
        for (int64_t task = 0; task < gt.count(); ++task)
            for (int64_t c = 0; c < C; ++c) {
                affine->scale[c] += affine_parts[task * 2 * C + c];
                affine->offset[c] += affine_parts[task * 2 * C + C + c];
            }
    }
    return g;
}

}  // namespace linvis::ops::fused_detail::t5_parts
