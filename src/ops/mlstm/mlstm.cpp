// linvis::ops::mlstm_chunkwise and linvis::ops::mlstm: the choice between the reference forms and the
// fused CPU chunkwise kernel (include/linvis/ops/mlstm.h).
#include "linvis/ops/mlstm.h"

#include <string>
#include <vector>

#include "linvis/core/error.h"
#include "linvis/core/precision.h"
#include "ops/mlstm/cpu.h"
#include "ops/mlstm/reference.h"

namespace linvis::ops {
namespace {

// mlstm_chunkwise, then the output norm when one is given (the fused kernel applies it itself).
torch::Tensor chunkwise(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact, int64_t chunk_size,
                        double eps, Impl impl, const MlstmOutputNorm* norm) {
    LINVIS_CHECK(q.defined(), "mlstm: q is undefined");
    const std::string unsupported = !q.device().is_cpu()     ? "CPU tensors only, got " + q.device().str()
                                    : !q.is_floating_point() ? std::string("floating-point tensors only")
                                                             : std::string();
    // Faster than the reference's many small products on the AVX-512 and AVX2 targets, and on the
    // scalar one except at the shortest sequences (docs/ops.md). Each checks its own inputs.
    if (use_fused(impl, "mlstm_chunkwise", unsupported, /*fused_is_faster=*/true))
        return cpu::mlstm_chunkwise_fused(q, k, v, igate_preact, fgate_preact, chunk_size, eps, norm);
    torch::Tensor h = reference::mlstm_chunkwise(q, k, v, igate_preact, fgate_preact, chunk_size, eps);
    return norm ? mlstm_output_norm(h, *norm) : h;
}

}  // namespace

torch::Tensor mlstm_chunkwise(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                              int64_t chunk_size, double eps, Impl impl) {
    return chunkwise(q, k, v, igate_preact, fgate_preact, chunk_size, eps, impl, nullptr);
}

torch::Tensor mlstm_normed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                           const MlstmOutputNorm& norm, MlstmMode mode, int64_t chunk_size, double eps, Impl impl) {
    if (mode == MlstmMode::Chunkwise)
        return chunkwise(q, k, v, igate_preact, fgate_preact, chunk_size, eps, impl, &norm);
    return mlstm_output_norm(mlstm(q, k, v, igate_preact, fgate_preact, mode, chunk_size, eps, impl), norm);
}

torch::Tensor mlstm_output_norm(const torch::Tensor& h, const MlstmOutputNorm& norm) {
    LINVIS_CHECK(h.dim() == 4 && norm.scale.numel() == h.size(1) * h.size(3) &&
                     norm.shift.numel() == h.size(1) * h.size(3),
                 "mlstm output norm: expected h (B, NH, S, DHV) with scale and shift of NH * DHV elements, got h ",
                 shape_string(h.sizes()), ", scale ", shape_string(norm.scale.sizes()), ", shift ",
                 shape_string(norm.shift.sizes()));
    // The official group_norm over (B*S, NH*DH) with NH groups normalises each head's DH features of
    // a token: the same statistics as a layer_norm over the last dim, which needs no transpose copy and
    // is several times faster on CPU. Token-major h is normalised in that layout and returned in it.
    const int64_t NH = h.size(1), DH = h.size(3);
    const bool token_major = h.transpose(1, 2).is_contiguous();
    const torch::Tensor x = token_major ? h.transpose(1, 2) : h;
    const std::vector<int64_t> affine = token_major ? std::vector<int64_t>{NH, DH} : std::vector<int64_t>{NH, 1, DH};
    const torch::ScalarType acc = precision::accumulation_dtype(x);  // bf16 / f16: float32, rounded once
    torch::Tensor normed = torch::layer_norm(x.to(acc), {DH}, torch::Tensor(), torch::Tensor(), norm.eps);
    const torch::Tensor scale = norm.scale.view(affine), shift = norm.shift.view(affine);
    // In place (one pass shift + normed * scale over normed) when autograd records nothing.
    const bool records = torch::GradMode::is_enabled() &&
                         (normed.requires_grad() || scale.requires_grad() || shift.requires_grad());
    torch::Tensor out = records ? torch::addcmul(shift, normed, scale) : torch::addcmul_out(normed, shift, normed, scale);
    out = out.to(h.scalar_type());
    return token_major ? out.transpose(1, 2) : out;
}

torch::Tensor mlstm(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact, MlstmMode mode,
                    int64_t chunk_size, double eps, Impl impl) {
    LINVIS_CHECK(impl != Impl::Fused || mode == MlstmMode::Chunkwise, "mlstm: impl 'fused' exists for mode ",
                 "'chunkwise' only, got mode '", mlstm_mode_name(mode), "'");
    switch (mode) {
        case MlstmMode::Parallel: return mlstm_parallel(q, k, v, igate_preact, fgate_preact, eps);
        case MlstmMode::Chunkwise:
            return mlstm_chunkwise(q, k, v, igate_preact, fgate_preact, chunk_size, eps, impl);
        case MlstmMode::Recurrent: return mlstm_recurrent(q, k, v, igate_preact, fgate_preact, eps);
    }
    fail("mlstm: unknown mode");
}

}  // namespace linvis::ops
