#include "core/onednn_matmul.h"

#include <oneapi/dnnl/dnnl.hpp>

#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "linvis/core/error.h"

namespace linvis::onednn {
namespace {

using dt = dnnl::memory::data_type;

dnnl::engine& cpu_engine() {
    static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    return engine;
}

dnnl::stream& thread_stream() {
    thread_local dnnl::stream stream(cpu_engine());
    return stream;
}

dt to_dnnl(torch::ScalarType type) {
    switch (type) {
        case torch::kBFloat16: return dt::bf16;
        case torch::kFloat32: return dt::f32;
        default: LINVIS_CHECK(false, "oneDNN matmul: dtype: expected bf16 or float32, got ", c10::toString(type));
    }
    return dt::undef;
}

// A 2-D operand as oneDNN sees it: row-major (strides {ld, 1}) or column-major (strides {1, ld}).
struct Operand {
    torch::Tensor t;
    int64_t s0, s1;
};

Operand operand(const torch::Tensor& t) {
    if (t.is_contiguous()) return {t, t.size(1), 1};
    if (t.t().is_contiguous()) return {t, 1, t.size(0)};
    // Padded rows (a slice of a wider tensor) stay in place; anything else is copied.
    if (t.stride(1) == 1 && t.stride(0) >= t.size(1)) return {t, t.stride(0), 1};
    if (t.stride(0) == 1 && t.stride(1) >= t.size(0)) return {t, 1, t.stride(1)};
    return {t.contiguous(), t.size(1), 1};
}

// Everything a primitive depends on.
using Key = std::tuple<int64_t, int64_t, int64_t,  // M, N, K
                       int64_t, int64_t, int64_t, int64_t,  // strides of a and b
                       int, int, int, int, bool>;  // bias dtype (-1: none), dst dtype, activation, src dtype,
                                                   // accumulate

struct Entry {
    bool supported = false;
    dnnl::matmul primitive;
    size_t scratchpad_bytes = 0;
    std::string implementation;
};

Entry create(int64_t M, int64_t N, int64_t K, const Operand& a, const Operand& b, int bias_dt, dt dst_dt,
             Activation activation, dt src_dt, bool accumulate) {
    Entry entry;
    const dnnl::memory::desc a_md({M, K}, src_dt, {a.s0, a.s1});
    const dnnl::memory::desc b_md({K, N}, src_dt, {b.s0, b.s1});
    const dnnl::memory::desc bias_md =
        bias_dt < 0 ? dnnl::memory::desc() : dnnl::memory::desc({1, N}, static_cast<dt>(bias_dt), {N, 1});
    const dnnl::memory::desc c_md({M, N}, dst_dt, {N, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // the caller's buffer: concurrent calls stay apart
    dnnl::post_ops ops;
    if (accumulate) ops.append_sum(1.0f);
    if (activation != Activation::None) {
        const dnnl::algorithm algorithm = activation == Activation::GeluErf    ? dnnl::algorithm::eltwise_gelu_erf
                                          : activation == Activation::GeluTanh ? dnnl::algorithm::eltwise_gelu_tanh
                                                                               : dnnl::algorithm::eltwise_relu;
        ops.append_eltwise(1.0f, algorithm, 0.0f, 0.0f);
    }
    if (ops.len() > 0) attr.set_post_ops(ops);
    try {
        const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, cpu_engine());
        entry.implementation = pd.impl_info_str();
        // The reference implementation is a scalar loop: LibTorch's path is faster.
        if (entry.implementation.rfind("ref", 0) == 0) return entry;
        entry.primitive = dnnl::matmul(pd);
        entry.scratchpad_bytes = pd.scratchpad_desc().get_size();
        entry.supported = true;
    } catch (const dnnl::error& e) {
        LINVIS_CHECK(e.status == dnnl_unimplemented, "oneDNN matmul: creating the primitive for (", M, " x ", K,
                     ") . (", K, " x ", N, ") failed: ", e.what());
    }
    return entry;
}

// Least recently used entries are dropped past this many (a model at a few resolutions needs tens).
constexpr size_t kCapacity = 512;

class Cache {
public:
    Entry get(const Key& key, const std::function<Entry()>& make) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = index_.find(key);
            if (it != index_.end()) {
                order_.splice(order_.begin(), order_, it->second);
                return it->second->second;
            }
        }
        Entry entry = make();  // outside the lock: creation takes milliseconds
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = index_.find(key);
        if (it != index_.end()) return it->second->second;
        order_.emplace_front(key, entry);
        index_[key] = order_.begin();
        if (order_.size() > kCapacity) {
            index_.erase(order_.back().first);
            order_.pop_back();
        }
        return entry;
    }
    size_t size() {
        std::lock_guard<std::mutex> lock(mutex_);
        return order_.size();
    }

private:
    std::mutex mutex_;
    std::list<std::pair<Key, Entry>> order_;
    std::map<Key, std::list<std::pair<Key, Entry>>::iterator> index_;
};

Cache& cache() {
    static Cache c;
    return c;
}

const Entry& probe() {
    static const Entry entry = [] {
        const Operand a{torch::Tensor(), 64, 1}, b{torch::Tensor(), 64, 1};
        return create(64, 64, 64, a, b, -1, dt::bf16, Activation::None, dt::bf16, false);
    }();
    return entry;
}

}  // namespace

bool bf16_matmul_available() { return probe().supported; }

std::string bf16_matmul_implementation() { return probe().supported ? probe().implementation : "none"; }

size_t cached_primitives() { return cache().size(); }

bool matmul(const torch::Tensor& a_in, const torch::Tensor& b_in, const torch::Tensor& bias, torch::Tensor& out,
            Activation activation, bool accumulate) {
    LINVIS_CHECK(a_in.dim() == 2 && b_in.dim() == 2 && a_in.size(1) == b_in.size(0),
                 "oneDNN matmul: operands: expected (M x K) . (K x N), got ", a_in.sizes(), " . ", b_in.sizes());
    const torch::ScalarType type = a_in.scalar_type();
    LINVIS_CHECK((type == torch::kBFloat16 || type == torch::kFloat32) && b_in.scalar_type() == type,
                 "oneDNN matmul: operands: expected both bf16 or both float32, got ", c10::toString(type), " and ",
                 c10::toString(b_in.scalar_type()));
    const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(1);
    LINVIS_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N,
                 "oneDNN matmul: out: expected contiguous ", M, " x ", N, ", got ", out.sizes());
    if ((type == torch::kBFloat16 && !bf16_matmul_available()) || M == 0 || N == 0 || K == 0) return false;
    const dt src_dt = to_dnnl(type);
    const Operand a = operand(a_in), b = operand(b_in);
    const int bias_dt = bias.defined() ? static_cast<int>(to_dnnl(bias.scalar_type())) : -1;
    const dt dst_dt = to_dnnl(out.scalar_type());
    const Key key{M, N, K, a.s0, a.s1, b.s0, b.s1, bias_dt, static_cast<int>(dst_dt), static_cast<int>(activation),
                  static_cast<int>(src_dt), accumulate};
    const Entry entry =
        cache().get(key, [&] { return create(M, N, K, a, b, bias_dt, dst_dt, activation, src_dt, accumulate); });
    if (!entry.supported) return false;
    const torch::Tensor bias_c = bias.defined() ? bias.contiguous() : bias;
    dnnl::engine& engine = cpu_engine();
    const auto md = [](int64_t r, int64_t c, dt type, int64_t s0, int64_t s1) {
        return dnnl::memory::desc({r, c}, type, {s0, s1});
    };
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, dnnl::memory(md(M, K, src_dt, a.s0, a.s1), engine, a.t.data_ptr())},
        {DNNL_ARG_WEIGHTS, dnnl::memory(md(K, N, src_dt, b.s0, b.s1), engine, b.t.data_ptr())},
        {DNNL_ARG_DST, dnnl::memory(md(M, N, dst_dt, N, 1), engine, out.data_ptr())}};
    if (bias.defined())
        args.emplace(DNNL_ARG_BIAS, dnnl::memory(md(1, N, static_cast<dt>(bias_dt), N, 1), engine, bias_c.data_ptr()));
    torch::Tensor scratchpad;
    if (entry.scratchpad_bytes > 0) {
        scratchpad = torch::empty({static_cast<int64_t>(entry.scratchpad_bytes)}, torch::kUInt8);
        args.emplace(DNNL_ARG_SCRATCHPAD,
                     dnnl::memory(dnnl::memory::desc({static_cast<int64_t>(entry.scratchpad_bytes)}, dt::u8,
                                                     dnnl::memory::format_tag::a),
                                  engine, scratchpad.data_ptr()));
    }
    dnnl::stream& stream = thread_stream();
    entry.primitive.execute(stream, args);
    stream.wait();
    return true;
}

}  // namespace linvis::onednn
