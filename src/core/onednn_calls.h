// oneDNN's C and C++ API with every call going to the library core/onednn_api.h loaded (private to core): include
// this header instead of <oneapi/dnnl/dnnl.h> or <oneapi/dnnl/dnnl.hpp>. From here on, each function of
// LINVIS_ONEDNN_FUNCTIONS, called directly or in the inline functions of oneDNN's C++ API, is the pointer of that
// name in c_api(). A function missing from the list leaves an undefined symbol, which the library's link
// (-Wl,--no-undefined) rejects.
#pragma once

#include "core/onednn_api.h"

#define LINVIS_ONEDNN_CALL(name) ::linvis::onednn::c_api().name
#define dnnl_engine_create LINVIS_ONEDNN_CALL(dnnl_engine_create)
#define dnnl_engine_destroy LINVIS_ONEDNN_CALL(dnnl_engine_destroy)
#define dnnl_matmul_desc_init LINVIS_ONEDNN_CALL(dnnl_matmul_desc_init)
#define dnnl_memory_create LINVIS_ONEDNN_CALL(dnnl_memory_create)
#define dnnl_memory_desc_equal LINVIS_ONEDNN_CALL(dnnl_memory_desc_equal)
#define dnnl_memory_desc_get_size LINVIS_ONEDNN_CALL(dnnl_memory_desc_get_size)
#define dnnl_memory_desc_init_by_strides LINVIS_ONEDNN_CALL(dnnl_memory_desc_init_by_strides)
#define dnnl_memory_desc_init_by_tag LINVIS_ONEDNN_CALL(dnnl_memory_desc_init_by_tag)
#define dnnl_memory_destroy LINVIS_ONEDNN_CALL(dnnl_memory_destroy)
#define dnnl_memory_get_engine LINVIS_ONEDNN_CALL(dnnl_memory_get_engine)
#define dnnl_memory_get_memory_desc LINVIS_ONEDNN_CALL(dnnl_memory_get_memory_desc)
#define dnnl_post_ops_append_eltwise LINVIS_ONEDNN_CALL(dnnl_post_ops_append_eltwise)
#define dnnl_post_ops_append_sum LINVIS_ONEDNN_CALL(dnnl_post_ops_append_sum)
#define dnnl_post_ops_create LINVIS_ONEDNN_CALL(dnnl_post_ops_create)
#define dnnl_post_ops_destroy LINVIS_ONEDNN_CALL(dnnl_post_ops_destroy)
#define dnnl_post_ops_len LINVIS_ONEDNN_CALL(dnnl_post_ops_len)
#define dnnl_primitive_attr_create LINVIS_ONEDNN_CALL(dnnl_primitive_attr_create)
#define dnnl_primitive_attr_destroy LINVIS_ONEDNN_CALL(dnnl_primitive_attr_destroy)
#define dnnl_primitive_attr_set_post_ops LINVIS_ONEDNN_CALL(dnnl_primitive_attr_set_post_ops)
#define dnnl_primitive_attr_set_scratchpad_mode LINVIS_ONEDNN_CALL(dnnl_primitive_attr_set_scratchpad_mode)
#define dnnl_primitive_create LINVIS_ONEDNN_CALL(dnnl_primitive_create)
#define dnnl_primitive_desc_destroy LINVIS_ONEDNN_CALL(dnnl_primitive_desc_destroy)
#define dnnl_primitive_desc_iterator_create LINVIS_ONEDNN_CALL(dnnl_primitive_desc_iterator_create)
#define dnnl_primitive_desc_iterator_destroy LINVIS_ONEDNN_CALL(dnnl_primitive_desc_iterator_destroy)
#define dnnl_primitive_desc_iterator_fetch LINVIS_ONEDNN_CALL(dnnl_primitive_desc_iterator_fetch)
#define dnnl_primitive_desc_query LINVIS_ONEDNN_CALL(dnnl_primitive_desc_query)
#define dnnl_primitive_desc_query_md LINVIS_ONEDNN_CALL(dnnl_primitive_desc_query_md)
#define dnnl_primitive_destroy LINVIS_ONEDNN_CALL(dnnl_primitive_destroy)
#define dnnl_primitive_execute LINVIS_ONEDNN_CALL(dnnl_primitive_execute)
#define dnnl_reorder_primitive_desc_create LINVIS_ONEDNN_CALL(dnnl_reorder_primitive_desc_create)
#define dnnl_sgemm LINVIS_ONEDNN_CALL(dnnl_sgemm)
#define dnnl_stream_create LINVIS_ONEDNN_CALL(dnnl_stream_create)
#define dnnl_stream_destroy LINVIS_ONEDNN_CALL(dnnl_stream_destroy)
#define dnnl_stream_wait LINVIS_ONEDNN_CALL(dnnl_stream_wait)
#define dnnl_version LINVIS_ONEDNN_CALL(dnnl_version)

#include <oneapi/dnnl/dnnl.hpp>
