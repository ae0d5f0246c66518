// The SIMD targets of the fused kernels (src/ops/simd/simd.h) that this CPU runs, and a scope that
// selects one through LINVIS_SIMD, so a test runs every path inside one process.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "../../src/ops/simd/simd.h"
#include "linvis/ops/impl.h"

namespace linvis::testing {

struct SimdTarget {
    const char* env;  // the LINVIS_SIMD value
    ops::simd::Target target;
};

// Every target this CPU runs, best first: avx512 (AVX-512 CPUs), avx2 (AVX2 CPUs), scalar (always).
inline std::vector<SimdTarget> simd_targets() {
    std::vector<SimdTarget> all;
    for (const SimdTarget t : {SimdTarget{"avx512", ops::simd::Target::Avx512}, SimdTarget{"avx2", ops::simd::Target::Avx2},
                               SimdTarget{"scalar", ops::simd::Target::Scalar}})
        if (ops::simd::target_supported(t.target)) all.push_back(t);
    return all;
}

// Sets LINVIS_SIMD (and clears LINVIS_FORCE_SCALAR) for its lifetime; restores both afterwards. Checks that
// the requested target is the one the kernels report.
class ScopedSimd {
public:
    explicit ScopedSimd(const SimdTarget& t) : simd_(get("LINVIS_SIMD")), force_(get("LINVIS_FORCE_SCALAR")) {
        unsetenv("LINVIS_FORCE_SCALAR");
        setenv("LINVIS_SIMD", t.env, 1);
        EXPECT_EQ(std::string(ops::fused_kernel_target()), ops::simd::target_name(t.target)) << "LINVIS_SIMD=" << t.env;
    }
    ~ScopedSimd() {
        put("LINVIS_SIMD", simd_);
        put("LINVIS_FORCE_SCALAR", force_);
    }
    ScopedSimd(const ScopedSimd&) = delete;
    ScopedSimd& operator=(const ScopedSimd&) = delete;

private:
    static std::optional<std::string> get(const char* name) {
        const char* v = std::getenv(name);
        return v ? std::optional<std::string>(v) : std::nullopt;
    }
    static void put(const char* name, const std::optional<std::string>& v) {
        if (v) setenv(name, v->c_str(), 1);
        else unsetenv(name);
    }
    std::optional<std::string> simd_, force_;
};

// Runs f() once per target with that target selected and a trace line naming it.
template <typename F>
void for_each_simd_target(F&& f) {
    for (const SimdTarget& t : simd_targets()) {
        SCOPED_TRACE(std::string("LINVIS_SIMD=") + t.env);
        ScopedSimd scope(t);
        f(t);
    }
}

}  // namespace linvis::testing
