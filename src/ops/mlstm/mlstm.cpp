// linvis::ops::mlstm_chunkwise and linvis::ops::mlstm: the choice between the reference forms and the
// fused CPU chunkwise kernel (include/linvis/ops/mlstm.h).
#include "linvis/ops/mlstm.h"

#include <string>

#include "linvis/core/error.h"
#include "ops/mlstm/cpu.h"
#include "ops/mlstm/reference.h"

namespace linvis::ops {

torch::Tensor mlstm_chunkwise(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& igate_preact, const torch::Tensor& fgate_preact,
                              int64_t chunk_size, double eps, Impl impl) {
    LINVIS_CHECK(q.defined(), "mlstm: q is undefined");
    const std::string unsupported = !q.device().is_cpu()     ? "CPU tensors only, got " + q.device().str()
                                    : !q.is_floating_point() ? std::string("floating-point tensors only")
                                                             : std::string();
    // Faster than the reference's many small products on the AVX-512 and AVX2 targets, and on the
    // scalar one except at the shortest sequences (docs/ops.md). Each checks its own inputs.
    if (use_fused(impl, "mlstm_chunkwise", unsupported, /*fused_is_faster=*/true))
        return cpu::mlstm_chunkwise_fused(q, k, v, igate_preact, fgate_preact, chunk_size, eps);
    return reference::mlstm_chunkwise(q, k, v, igate_preact, fgate_preact, chunk_size, eps);
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
