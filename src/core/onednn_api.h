// oneDNN's C API, loaded at run time instead of linked (private to core).
//
// liblinvis does not link libdnnl: it loads it with dlopen as it is loaded itself. Where LibTorch already holds it
// (Debian's libtorch_cpu 1.13 links it) that is the same library. Where it does not, libdnnl is loaded with
// RTLD_DEEPBIND, so that its own definitions come before those of the process: the libtorch_cpu of a pip torch 2.x
// carries a oneDNN 3.x of its own and exports the weak std::call_once helpers of its GEMM's kernel set-up under the
// same names as oneDNN 2.6's; bound to those, libdnnl never creates its kernels and its sgemm returns
// dnnl_unimplemented. A pointer per function, found by name, then serves every call.
//
// Code that calls oneDNN includes core/onednn_calls.h, which sends every call through c_api().
#pragma once

#include <string>

#include <oneapi/dnnl/dnnl.h>

// Every oneDNN C function linvis calls, directly or through oneDNN's C++ API.
#define LINVIS_ONEDNN_FUNCTIONS(X)                                                                                    \
    X(dnnl_engine_create)                                                                                             \
    X(dnnl_engine_destroy)                                                                                            \
    X(dnnl_matmul_desc_init)                                                                                          \
    X(dnnl_memory_create)                                                                                             \
    X(dnnl_memory_desc_equal)                                                                                         \
    X(dnnl_memory_desc_get_size)                                                                                      \
    X(dnnl_memory_desc_init_by_strides)                                                                               \
    X(dnnl_memory_desc_init_by_tag)                                                                                   \
    X(dnnl_memory_destroy)                                                                                            \
    X(dnnl_memory_get_engine)                                                                                         \
    X(dnnl_memory_get_memory_desc)                                                                                    \
    X(dnnl_post_ops_append_eltwise)                                                                                   \
    X(dnnl_post_ops_append_sum)                                                                                       \
    X(dnnl_post_ops_create)                                                                                           \
    X(dnnl_post_ops_destroy)                                                                                          \
    X(dnnl_post_ops_len)                                                                                              \
    X(dnnl_primitive_attr_create)                                                                                     \
    X(dnnl_primitive_attr_destroy)                                                                                    \
    X(dnnl_primitive_attr_set_post_ops)                                                                               \
    X(dnnl_primitive_attr_set_scratchpad_mode)                                                                        \
    X(dnnl_primitive_create)                                                                                          \
    X(dnnl_primitive_desc_destroy)                                                                                    \
    X(dnnl_primitive_desc_iterator_create)                                                                            \
    X(dnnl_primitive_desc_iterator_destroy)                                                                           \
    X(dnnl_primitive_desc_iterator_fetch)                                                                             \
    X(dnnl_primitive_desc_query)                                                                                      \
    X(dnnl_primitive_desc_query_md)                                                                                   \
    X(dnnl_primitive_destroy)                                                                                         \
    X(dnnl_primitive_execute)                                                                                         \
    X(dnnl_reorder_primitive_desc_create)                                                                             \
    X(dnnl_sgemm)                                                                                                     \
    X(dnnl_stream_create)                                                                                             \
    X(dnnl_stream_destroy)                                                                                            \
    X(dnnl_stream_wait)                                                                                               \
    X(dnnl_version)

namespace linvis::onednn {

// One pointer per function of LINVIS_ONEDNN_FUNCTIONS, with the function's own name and type.
struct CApi {
#define LINVIS_ONEDNN_POINTER(name) decltype(&::name) name = nullptr;
    LINVIS_ONEDNN_FUNCTIONS(LINVIS_ONEDNN_POINTER)
#undef LINVIS_ONEDNN_POINTER
};

// Empty when libdnnl is loaded and has every function; otherwise why not (the library tried, dlerror's message or
// the missing function). Loaded with liblinvis.
const std::string& load_error();

// The loaded functions. Throws, naming load_error(), when libdnnl could not be loaded.
const CApi& c_api();

}  // namespace linvis::onednn
