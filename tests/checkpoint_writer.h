// Test-only writer of torch.save zip archives, so the checkpoint reader can be tested on
// files equivalent to what Python writes without Python: a tiny pickler that emits the same
// opcode sequences CPython's pickle (protocol 2, torch.save's default, or 4) produces for
// dicts, OrderedDicts, tensors, argparse.Namespace and yacs CfgNode, plus
// caffe2::serialize::PyTorchStreamWriter for the archive (data.pkl, byteorder, data/<key>,
// version).
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <caffe2/serialize/inline_container.h>
#include <torch/torch.h>

namespace linvis::testing {

class PickleWriter {
public:
    std::string bytes;

    PickleWriter& op(uint8_t code) {
        bytes.push_back(static_cast<char>(code));
        return *this;
    }
    PickleWriter& raw(const std::string& s) {
        bytes += s;
        return *this;
    }
    PickleWriter& le(uint64_t v, int n) {
        for (int i = 0; i < n; ++i) bytes.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
        return *this;
    }

    PickleWriter& proto(int p) { return op(0x80).le(static_cast<uint64_t>(p), 1); }
    PickleWriter& frame(uint64_t n) { return op(0x95).le(n, 8); }
    PickleWriter& stop() { return op('.'); }
    PickleWriter& mark() { return op('('); }
    PickleWriter& empty_dict() { return op('}'); }
    PickleWriter& empty_list() { return op(']'); }
    PickleWriter& empty_tuple() { return op(')'); }
    PickleWriter& empty_set() { return op(0x8f); }
    PickleWriter& setitem() { return op('s'); }
    PickleWriter& setitems() { return op('u'); }
    PickleWriter& append() { return op('a'); }
    PickleWriter& appends() { return op('e'); }
    PickleWriter& additems() { return op(0x90); }
    PickleWriter& tuple() { return op('t'); }
    PickleWriter& tuple_n(int n) { return op(static_cast<uint8_t>(0x84 + n)); }  // TUPLE1..3
    PickleWriter& none() { return op('N'); }
    PickleWriter& boolean(bool b) { return op(b ? 0x88 : 0x89); }
    PickleWriter& reduce() { return op('R'); }
    PickleWriter& build() { return op('b'); }
    PickleWriter& newobj() { return op(0x81); }
    PickleWriter& binpersid() { return op('Q'); }

    // Integers the way CPython's save_long chooses opcodes.
    PickleWriter& integer(int64_t v) {
        if (v >= 0 && v <= 0xff) return op('K').le(static_cast<uint64_t>(v), 1);
        if (v >= 0 && v <= 0xffff) return op('M').le(static_cast<uint64_t>(v), 2);
        if (v >= INT32_MIN && v <= INT32_MAX) return op('J').le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
        // LONG1 with the minimal two's complement length
        std::string b;
        uint64_t u = static_cast<uint64_t>(v);
        for (int i = 0; i < 8; ++i) b.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
        while (b.size() > 1) {
            const uint8_t last = static_cast<uint8_t>(b.back());
            const uint8_t prev = static_cast<uint8_t>(b[b.size() - 2]);
            if ((last == 0 && !(prev & 0x80)) || (last == 0xff && (prev & 0x80))) b.pop_back();
            else break;
        }
        return op(0x8a).le(b.size(), 1).raw(b);
    }
    PickleWriter& real(double d) {  // BINFLOAT, big-endian
        uint64_t u;
        std::memcpy(&u, &d, sizeof u);
        op('G');
        for (int i = 7; i >= 0; --i) bytes.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
        return *this;
    }
    // str: BINUNICODE (protocol 2) or SHORT_BINUNICODE (protocol 4, short strings)
    PickleWriter& str(const std::string& s, bool short_form = false) {
        if (short_form && s.size() < 256) return op(0x8c).le(s.size(), 1).raw(s);
        return op('X').le(s.size(), 4).raw(s);
    }
    PickleWriter& binbytes(const std::string& s) { return op('B').le(s.size(), 4).raw(s); }
    PickleWriter& short_binstring(const std::string& s) { return op('U').le(s.size(), 1).raw(s); }
    PickleWriter& global(const std::string& module, const std::string& name) {
        return op('c').raw(module + "\n" + name + "\n");
    }
    PickleWriter& stack_global(const std::string& module, const std::string& name) {
        str(module, true);
        memoize();
        str(name, true);
        memoize();
        return op(0x93);
    }

    // Memo: BINPUT/LONG_BINPUT with the next index (CPython numbers memo entries 0, 1, 2...).
    int put() {
        const int index = next_memo_++;
        if (index < 256) op('q').le(static_cast<uint64_t>(index), 1);
        else op('r').le(static_cast<uint64_t>(index), 4);
        return index;
    }
    int memoize() {
        op(0x94);
        return next_memo_++;
    }
    PickleWriter& get(int index) {
        if (index < 256) return op('h').le(static_cast<uint64_t>(index), 1);
        return op('j').le(static_cast<uint64_t>(index), 4);
    }
    void skip_memo(int n) { next_memo_ += n; }

private:
    int next_memo_ = 0;
};

// Legacy typed storage class names torch.save writes for each dtype.
inline std::string storage_class_name(torch::ScalarType dtype) {
    switch (dtype) {
        case torch::kFloat64: return "DoubleStorage";
        case torch::kFloat32: return "FloatStorage";
        case torch::kFloat16: return "HalfStorage";
        case torch::kBFloat16: return "BFloat16Storage";
        case torch::kInt64: return "LongStorage";
        case torch::kInt32: return "IntStorage";
        case torch::kInt16: return "ShortStorage";
        case torch::kInt8: return "CharStorage";
        case torch::kUInt8: return "ByteStorage";
        case torch::kBool: return "BoolStorage";
        default: throw std::runtime_error("checkpoint_writer: unsupported dtype");
    }
}

// Builds data.pkl plus storages. Tensors are written as
//   torch._utils._rebuild_tensor_v2(persistent('storage', torch.XStorage, key, 'cpu', numel),
//                                   offset, size, stride, False, collections.OrderedDict())
class CheckpointWriter {
public:
    PickleWriter p;

    // Registers a storage holding `values` (flattened, contiguous); returns its key.
    std::string add_storage(const torch::Tensor& values) {
        const torch::Tensor flat = values.contiguous().reshape({-1});
        const std::string key = std::to_string(next_key_++);
        storages_[key] = {std::string(static_cast<const char*>(flat.data_ptr()),
                                      static_cast<size_t>(flat.numel()) * flat.element_size()),
                          flat.scalar_type()};
        numel_[key] = flat.numel();
        return key;
    }

    // A tensor view (offset, sizes, strides in elements) over an existing storage.
    void tensor_view(const std::string& key, int64_t offset, const std::vector<int64_t>& sizes,
                     const std::vector<int64_t>& strides, bool as_parameter = false) {
        if (as_parameter) {
            p.global("torch._utils", "_rebuild_parameter");
            p.put();
        }
        p.global("torch._utils", "_rebuild_tensor_v2");
        p.put();
        p.mark();
        // persistent id tuple
        p.mark();
        p.str("storage");
        p.put();
        p.global("torch", storage_class_name(storages_.at(key).second));
        p.put();
        p.str(key);
        p.put();
        p.str("cpu");
        p.put();
        p.integer(numel_.at(key));
        p.tuple();
        p.put();
        p.binpersid();
        p.integer(offset);
        int_tuple(sizes);
        int_tuple(strides);
        p.boolean(false);
        p.global("collections", "OrderedDict");
        p.put();
        p.empty_tuple();
        p.reduce();
        p.put();
        p.tuple();
        p.put();
        p.reduce();
        p.put();
        if (as_parameter) {  // _rebuild_parameter(data, requires_grad, backward_hooks)
            p.boolean(true);
            p.global("collections", "OrderedDict");
            p.put();
            p.empty_tuple();
            p.reduce();
            p.put();
            p.tuple_n(3);
            p.put();
            p.reduce();
            p.put();
        }
    }

    // A whole tensor with its own storage (contiguous strides).
    void tensor(const torch::Tensor& t, bool as_parameter = false) {
        const std::string key = add_storage(t);
        tensor_view(key, 0, t.sizes().vec(), t.contiguous().strides().vec(), as_parameter);
    }

    // model.state_dict(): an OrderedDict with a _metadata attribute (REDUCE, SETITEMS, BUILD).
    void state_dict(const std::vector<std::pair<std::string, torch::Tensor>>& entries) {
        p.global("collections", "OrderedDict");
        p.put();
        p.empty_tuple();
        p.reduce();
        p.put();
        p.mark();
        for (const auto& [name, t] : entries) {
            p.str(name);
            p.put();
            tensor(t);
        }
        p.setitems();
        // state: {'_metadata': OrderedDict([('', {'version': 1})])}
        p.empty_dict();
        p.put();
        p.str("_metadata");
        p.put();
        p.global("collections", "OrderedDict");
        p.put();
        p.empty_tuple();
        p.reduce();
        p.put();
        p.str("");
        p.put();
        p.empty_dict();
        p.put();
        p.str("version");
        p.put();
        p.integer(1);
        p.setitem();
        p.setitem();
        p.setitem();
        p.build();
    }

    void int_tuple(const std::vector<int64_t>& values) {
        if (values.empty()) {
            p.empty_tuple();
            return;
        }
        if (values.size() <= 3) {
            for (auto v : values) p.integer(v);
            p.tuple_n(static_cast<int>(values.size()));
        } else {
            p.mark();
            for (auto v : values) p.integer(v);
            p.tuple();
        }
        p.put();
    }

    // Writes the archive. `skip_storage` leaves one storage record out (malformed-file tests).
    void save(const std::string& path, bool with_byteorder = true, const std::string& skip_storage = "") const {
        caffe2::serialize::PyTorchStreamWriter writer(path);
        writer.writeRecord("data.pkl", p.bytes.data(), p.bytes.size());
        if (with_byteorder) writer.writeRecord("byteorder", "little", 6);
        for (const auto& [key, storage] : storages_) {
            if (key == skip_storage) continue;
            writer.writeRecord("data/" + key, storage.first.data(), storage.first.size());
        }
        writer.writeEndOfFile();
    }

private:
    int next_key_ = 0;
    std::map<std::string, std::pair<std::string, torch::ScalarType>> storages_;
    std::map<std::string, int64_t> numel_;
};

using StateDictEntries = std::vector<std::pair<std::string, torch::Tensor>>;

// A checkpoint as facebookresearch/DiT's train.py saves it: {"model": model, "ema": ema} (protocol 2),
// with an empty "opt" dict when `with_optimizer`.
inline void save_model_and_ema(const std::string& path, const StateDictEntries& model, const StateDictEntries& ema,
                               bool with_optimizer) {
    CheckpointWriter w;
    auto& p = w.p;
    p.proto(2);
    p.empty_dict();
    p.put();
    p.mark();
    p.str("model");
    p.put();
    w.state_dict(model);
    p.str("ema");
    p.put();
    w.state_dict(ema);
    if (with_optimizer) {
        p.str("opt");
        p.put();
        p.empty_dict();
        p.put();
    }
    p.setitems();
    p.stop();
    w.save(path);
}

}  // namespace linvis::testing
