#include "core/onednn_api.h"

#include <dlfcn.h>

#include <string>

#include "linvis/core/error.h"

namespace linvis::onednn {
namespace {

// The sanitizers' runtimes refuse RTLD_DEEPBIND (they stop the process); there libdnnl binds as a linked one would.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kOwnSymbolsFirst = 0;
#else
constexpr int kOwnSymbolsFirst = RTLD_DEEPBIND;
#endif

struct Loaded {
    CApi api;
    std::string error;
};

// The library: the one of the headers' major version already in the process if there is one (RTLD_NOLOAD), else
// loaded with its own symbols first, by name (the loader's search path), then from the directory it was found in
// when linvis was configured.
void* open_library(std::string& error) {
    const std::string soname = "libdnnl.so." + std::to_string(DNNL_VERSION_MAJOR);
    if (void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD)) return handle;
    if (void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL | kOwnSymbolsFirst)) return handle;
    error = dlerror();
    const std::string configured = std::string(LINVIS_DNNL_LIBRARY_DIR) + "/" + soname;
    if (void* handle = dlopen(configured.c_str(), RTLD_NOW | RTLD_LOCAL | kOwnSymbolsFirst)) return handle;
    error = soname + " could not be loaded (" + error + "; " + dlerror() + ")";
    return nullptr;
}

const Loaded& loaded() {
    static const Loaded result = [] {
        Loaded l;
        void* handle = open_library(l.error);
        if (handle == nullptr) return l;
#define LINVIS_ONEDNN_FIND(name)                                                                                      \
    l.api.name = reinterpret_cast<decltype(l.api.name)>(dlsym(handle, #name));                                        \
    if (l.api.name == nullptr && l.error.empty()) l.error = "libdnnl has no function " #name;
        LINVIS_ONEDNN_FUNCTIONS(LINVIS_ONEDNN_FIND)
#undef LINVIS_ONEDNN_FIND
        return l;
    }();
    return result;
}

// Loaded when liblinvis is, as a linked libdnnl would be: mapping it and its dependencies is then not part of the
// first product (nor of the memory a benchmark measures from there: 2.6 MiB beside a pip torch).
[[maybe_unused]] const Loaded& loaded_with_the_library = loaded();

}  // namespace

const std::string& load_error() { return loaded().error; }

const CApi& c_api() {
    const Loaded& l = loaded();
    LINVIS_CHECK(l.error.empty(), "oneDNN: ", l.error);
    return l.api;
}

}  // namespace linvis::onednn
