#include "core/onednn_matmul.h"

#include <torch/csrc/autograd/variable.h>

#include <cstdlib>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "core/onednn_calls.h"
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
                       int, int, int, int, bool, bool>;  // bias dtype (-1: none), dst dtype, activation, src dtype,
                                                         // accumulate, packed b

struct Entry {
    bool supported = false;
    dnnl::matmul primitive;
    size_t scratchpad_bytes = 0;
    std::string implementation;
    dnnl::memory::desc packed_weights;  // the layout b is reordered into (created with packed_b)
};

// packed_b: the primitive reads b in the blocked layout it chooses (format `any`, Entry::packed_weights), into which
// the caller reorders b (unsupported where that layout is not blocked); otherwise b is read in place with its strides.
Entry create(int64_t M, int64_t N, int64_t K, const Operand& a, const Operand& b, int bias_dt, dt dst_dt,
             Activation activation, dt src_dt, bool accumulate, bool packed_b) {
    Entry entry;
    const dnnl::memory::desc a_md({M, K}, src_dt, {a.s0, a.s1});
    const dnnl::memory::desc b_md = packed_b ? dnnl::memory::desc({K, N}, src_dt, dnnl::memory::format_tag::any)
                                             : dnnl::memory::desc({K, N}, src_dt, {b.s0, b.s1});
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
        if (packed_b) {
            // A plain layout (oneDNN 2.6's AVX2 matmul) would make the copy a transposition that saves nothing.
            entry.packed_weights = pd.weights_desc();
            if (entry.packed_weights.data.format_desc.blocking.inner_nblks == 0) return entry;
        }
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
        return create(64, 64, 64, a, b, -1, dt::bf16, Activation::None, dt::bf16, false, false);
    }();
    return entry;
}

// ---------------------------------------------------------------- packed weights
// Float32 and bf16 inference read each weight from a copy reordered once into the primitive's blocked layout (policy
// and the LINVIS_PACKED_WEIGHTS_MIB cap: linvis/core/flops.h). A copy is keyed by its weight's storage and layout and
// used only while that storage is alive (a weak reference: a new tensor at a freed weight's address is another
// storage) and unchanged (its version counter, which in-place updates such as load_state_dict's copy_ bump).

struct PackedWeight {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t version;  // the weight's version counter when copied
    dnnl::memory memory;
    size_t bytes;
};
// The weight's storage, its offset in it, the operand's strides (s0, s1) and shape (K, N).
using PackedKey = std::tuple<const c10::StorageImpl*, int64_t, int64_t, int64_t, int64_t, int64_t>;

size_t packed_budget_bytes() {
    static const size_t budget = [] {
        const char* value = std::getenv("LINVIS_PACKED_WEIGHTS_MIB");
        if (value == nullptr) return size_t{256} << 20;
        char* end = nullptr;
        const long long mib = std::strtoll(value, &end, 10);
        LINVIS_CHECK(end != value && *end == '\0' && mib >= 0,
                     "LINVIS_PACKED_WEIGHTS_MIB: expected a number of MiB >= 0, got '", value, "'");
        return static_cast<size_t>(mib) << 20;
    }();
    return budget;
}

class PackedWeights {
public:
    // b (an operand of shape K x N with strides s0, s1) in `layout`, reordered on first use or after a change;
    // an empty memory when b is not to be packed (see above) or the budget is spent.
    dnnl::memory get(const Operand& b, int64_t K, int64_t N, dt type, const dnnl::memory::desc& layout) {
        const c10::Storage& storage = b.t.storage();
        const PackedKey key{storage.unsafeGetStorageImpl(), b.t.storage_offset(), b.s0, b.s1, K, N};
        const int64_t version = b.t._version();
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = kept_.find(key);
        if (it != kept_.end() && (it->second.storage.expired() || it->second.memory.get_desc() != layout)) {
            bytes_ -= it->second.bytes;
            kept_.erase(it);
            it = kept_.end();
        }
        if (it == kept_.end()) {
            drop_expired();
            const size_t bytes = layout.get_size();
            if (bytes_ + bytes > packed_budget_bytes()) return dnnl::memory();
            // version + 1: reordered below.
            PackedWeight packed{storage.getWeakStorageImpl(), version + 1, dnnl::memory(layout, cpu_engine()), bytes};
            bytes_ += bytes;
            it = kept_.emplace(key, std::move(packed)).first;
        }
        if (it->second.version != version) {
            dnnl::memory plain(dnnl::memory::desc({K, N}, type, {b.s0, b.s1}), cpu_engine(), b.t.data_ptr());
            dnnl::reorder(plain, it->second.memory).execute(thread_stream(), plain, it->second.memory);
            thread_stream().wait();
            it->second.version = version;
        }
        return it->second.memory;
    }
    size_t bytes() {
        std::lock_guard<std::mutex> lock(mutex_);
        drop_expired();
        return bytes_;
    }
    // A product running on a copy keeps it alive (dnnl::memory is reference-counted).
    void clear() {
        std::lock_guard<std::mutex> lock(mutex_);
        kept_.clear();
        bytes_ = 0;
    }

private:
    void drop_expired() {
        for (auto it = kept_.begin(); it != kept_.end();) {
            if (!it->second.storage.expired()) {
                ++it;
                continue;
            }
            bytes_ -= it->second.bytes;
            it = kept_.erase(it);
        }
    }
    std::mutex mutex_;
    std::map<PackedKey, PackedWeight> kept_;
    size_t bytes_ = 0;
};

PackedWeights& packed_weights() {
    static PackedWeights p;
    return p;
}

// Products of fewer rows read their weights in place. From a weight in place oneDNN copies it into its layout on
// every call, which on few rows costs as much as the products: H-ViT3's last stage at 224 px (49 tokens) ran its
// products 16 % faster from packed weights (hvit3_tiny about 2 % faster). Below 16 rows (a classifier head's single
// row, DiT's adaLN products at batch 1 or 2) the copies would take memory (DiT-S's adaLN weights: 42 MiB, DiT-XL's:
// 890 MiB, past the cap) for about 0.1 ms a pass.
constexpr int64_t kMinPackedRows = 16;

// Whether b is a weight to keep packed: a float32 or bf16 product of at least kMinPackedRows rows outside a graph
// (bf16: the tiny models' passes 1.03-1.11x at 224 px on AMX, docs/performance.md), b with a version counter and
// not in a live graph. A weight in a live graph is being trained (a training step's
// recomputation in a checkpoint or a backward runs without a graph of its own): the optimizer changes it after the
// step, so a copy would be redone every step and kept between them.
bool packs(const torch::Tensor& b, torch::ScalarType type, int64_t M) {
    if ((type != torch::kFloat32 && type != torch::kBFloat16) || M < kMinPackedRows ||
        torch::GradMode::is_enabled() || b.is_inference() || packed_budget_bytes() == 0 ||
        weights_in_training_depth() > 0)
        return false;
    const torch::Tensor leaf = b.is_view() ? torch::Tensor(b._base()) : b;
    return !(leaf.requires_grad() && torch::autograd::impl::try_get_grad_accumulator(leaf) != nullptr);
}

}  // namespace

size_t packed_weight_bytes() { return packed_weights().bytes(); }
void release_packed_weights() { packed_weights().clear(); }

int& weights_in_training_depth() {
    thread_local int depth = 0;
    return depth;
}

const std::string& unusable_reason() {
    static const std::string reason = []() -> std::string {
        if (!load_error().empty()) return load_error();
        torch::NoGradGuard no_grad;
        // Shapes of a small ViT's products, large enough for oneDNN's JIT kernels rather than a small-size path.
        const int64_t M = 256, K = 192, N = 160;
        const torch::Tensor a = torch::linspace(-1.0, 1.0, M * K).reshape({M, K});
        const torch::Tensor b = torch::linspace(0.5, -0.5, K * N).reshape({K, N});
        const torch::Tensor bias = torch::linspace(-0.25, 0.25, N);
        const torch::Tensor expected = torch::mm(a.to(torch::kFloat64), b.to(torch::kFloat64));
        const auto wrong = [&](const torch::Tensor& got, const torch::Tensor& judge) {
            return !torch::allclose(got.to(torch::kFloat64), judge, 1e-4, 1e-4);
        };
        torch::Tensor c = torch::zeros({M, N});
        const dnnl_status_t status = dnnl_sgemm('N', 'N', M, N, K, 1.0f, a.data_ptr<float>(), K, b.data_ptr<float>(),
                                                N, 0.0f, c.data_ptr<float>(), N);
        if (status != dnnl_success) return "its sgemm returned status " + std::to_string(static_cast<int>(status));
        if (wrong(c, expected)) return std::string("its sgemm computed a wrong product");
        try {
            c.zero_();
            if (!matmul(a, b, bias, c, Activation::GeluErf)) return std::string();  // no kernel: LibTorch's path
            if (wrong(c, torch::gelu(expected + bias.to(torch::kFloat64))))
                return std::string("its matmul primitive computed a wrong product");
        } catch (const std::exception& e) {
            return std::string("its matmul primitive failed: ") + e.what();
        }
        return std::string();
    }();
    return reason;
}

bool bf16_matmul_available() { return unusable_reason().empty() && probe().supported; }

std::string bf16_matmul_implementation() { return bf16_matmul_available() ? probe().implementation : "none"; }

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
    const auto primitive = [&](bool packed_b) {
        const Key key{M, N, K, a.s0, a.s1, b.s0, b.s1, bias_dt, static_cast<int>(dst_dt), static_cast<int>(activation),
                      static_cast<int>(src_dt), accumulate, packed_b};
        return cache().get(key, [&] {
            return create(M, N, K, a, b, bias_dt, dst_dt, activation, src_dt, accumulate, packed_b);
        });
    };
    const bool pack = packs(b.t, type, M);
    Entry entry = primitive(pack);
    dnnl::memory packed_b;
    if (pack && entry.supported) packed_b = packed_weights().get(b, K, N, src_dt, entry.packed_weights);
    if (pack && !packed_b) entry = primitive(false);  // no blocked layout here, or the budget is spent
    if (!entry.supported) return false;
    const torch::Tensor bias_c = bias.defined() ? bias.contiguous() : bias;
    dnnl::engine& engine = cpu_engine();
    const auto md = [](int64_t r, int64_t c, dt type, int64_t s0, int64_t s1) {
        return dnnl::memory::desc({r, c}, type, {s0, s1});
    };
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, dnnl::memory(md(M, K, src_dt, a.s0, a.s1), engine, a.t.data_ptr())},
        {DNNL_ARG_WEIGHTS, packed_b ? packed_b : dnnl::memory(md(K, N, src_dt, b.s0, b.s1), engine, b.t.data_ptr())},
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
