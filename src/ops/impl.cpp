#include "linvis/ops/impl.h"

#include <cstdlib>
#include <cstring>

#include "linvis/core/error.h"
#include "linvis/core/runtime.h"

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

bool fused_kernels_use_avx512() {
    static const bool cpu_has_avx512 = [] {
        const auto level = runtime::detect_simd();
        return level == runtime::SimdLevel::Avx512 || level == runtime::SimdLevel::Avx512Bf16;
    }();
    const char* force = std::getenv("LINVIS_FORCE_SCALAR");
    const bool forced_scalar = force != nullptr && *force != '\0' && std::strcmp(force, "0") != 0;
    return cpu_has_avx512 && !forced_scalar;
}

const char* fused_kernel_isa() { return fused_kernels_use_avx512() ? "AVX-512" : "portable"; }

}  // namespace linvis::ops
