#include "linvis/ops/impl.h"

#include "linvis/core/error.h"
#include "ops/simd/amx.h"
#include "ops/simd/simd.h"

namespace linvis::ops {

Impl parse_impl(const std::string& name) {
    if (name == "auto") return Impl::Auto;
    if (name == "reference") return Impl::Reference;
    if (name == "fused") return Impl::Fused;
    fail("impl: expected 'auto', 'reference' or 'fused', got '", name, "'");
}

const char* impl_name(Impl impl) {
    switch (impl) {
        case Impl::Auto: return "auto";
        case Impl::Reference: return "reference";
        case Impl::Fused: return "fused";
    }
    return "auto";
}

bool use_fused(Impl impl, const char* op, const std::string& unsupported, bool fused_is_faster) {
    switch (impl) {
        case Impl::Reference: return false;
        case Impl::Fused:
            LINVIS_CHECK(unsupported.empty(), op, ": impl 'fused' cannot take this input: ", unsupported,
                         " (impl 'auto' or 'reference' runs the reference)");
            return true;
        case Impl::Auto: return unsupported.empty() && fused_is_faster;
    }
    return false;
}

const char* fused_kernel_target() { return simd::target_name(simd::active_target()); }

const char* fused_matrix_engine() { return simd::amx_mode_name(simd::amx_mode()); }

}  // namespace linvis::ops
