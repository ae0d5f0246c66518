// The SIMD targets of the fused kernels (src/ops/simd/simd.h) that this CPU runs, and a scope that
// selects one through LINVIS_SIMD, so a test runs every path inside one process.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "../../src/ops/simd/amx.h"
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

// Sets LINVIS_AMX to `value` for its lifetime and restores it afterwards.
class ScopedAmx {
public:
    explicit ScopedAmx(const char* value) {
        if (const char* old = std::getenv("LINVIS_AMX")) old_ = old;
        setenv("LINVIS_AMX", value, 1);
    }
    ~ScopedAmx() {
        if (old_) setenv("LINVIS_AMX", old_->c_str(), 1);
        else unsetenv("LINVIS_AMX");
    }
    ScopedAmx(const ScopedAmx&) = delete;
    ScopedAmx& operator=(const ScopedAmx&) = delete;

private:
    std::optional<std::string> old_;
};

// Runs f(mode) once per AMX path with LINVIS_AMX set for it: the portable emulation on every CPU, and the tiles
// where this CPU has them (simd/amx.h); checks that each setting gives the path it names.
template <typename F>
void for_each_amx_path(F&& f) {
    std::vector<std::pair<const char*, ops::simd::AmxMode>> paths = {{"emulate", ops::simd::AmxMode::Emulated}};
    if (ops::simd::amx_supported() && ops::simd::active_target() == ops::simd::Target::Avx512)
        paths.emplace_back("auto", ops::simd::AmxMode::Tiles);
    else
        std::cout << "[skip] AMX tiles: this CPU (or LINVIS_SIMD) has none; the emulated tiles only\n";
    for (const auto& [env, mode] : paths) {
        SCOPED_TRACE(std::string("LINVIS_AMX=") + env);
        ScopedAmx scope(env);
        EXPECT_EQ(ops::simd::amx_mode(), mode);
        f(mode);
    }
}

}  // namespace linvis::testing
