#include "linvis/ops/impl.h"

#include "linvis/core/error.h"

namespace linvis::ops {

Impl parse_impl(const std::string& name) {
    if (name == "reference") return Impl::Reference;
    if (name == "fused") return Impl::Fused;
    fail("--impl: expected 'reference' or 'fused', got '", name, "'");
}

const char* impl_name(Impl impl) { return impl == Impl::Reference ? "reference" : "fused"; }

}  // namespace linvis::ops
