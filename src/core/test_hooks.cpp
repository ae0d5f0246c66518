#include "linvis/core/test_hooks.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace linvis {
namespace {

struct StopRequest {
    bool active = false;
    std::string name;
    long count = 0;
};

const StopRequest& stop_request() {
    static const StopRequest request = [] {
        StopRequest r;
        const char* env = std::getenv("LINVIS_TEST_STOP_AT");
        if (env == nullptr) return r;
        const std::string spec = env;
        const size_t colon = spec.rfind(':');
        if (colon == std::string::npos || colon == 0) return r;
        char* end = nullptr;
        const long n = std::strtol(spec.c_str() + colon + 1, &end, 10);
        if (end == spec.c_str() + colon + 1 || *end != '\0' || n < 1) return r;
        r.active = true;
        r.name = spec.substr(0, colon);
        r.count = n;
        return r;
    }();
    return request;
}

}  // namespace

void test_stop_point(const std::string& name) {
    const StopRequest& request = stop_request();
    if (!request.active || name != request.name) return;
    static std::mutex mutex;
    static long calls = 0;
    std::lock_guard<std::mutex> lock(mutex);
    if (++calls != request.count) return;
    std::fprintf(stderr, "linvis: stopped at test point %s #%ld\n", name.c_str(), calls);
    std::fflush(stderr);
    std::raise(SIGSTOP);
}

}  // namespace linvis
