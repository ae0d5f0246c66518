// torch.save zip reader and a tolerant pickle machine; see include/linvis/io/torch_checkpoint.h.
#include "linvis/io/torch_checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>

#include <caffe2/serialize/inline_container.h>
#include <c10/util/Exception.h>

#include "linvis/core/error.h"

namespace linvis::io {

// ------------------------------------------------------------------ Value helpers

Value::~Value() {
    std::vector<ValuePtr> pending;
    auto detach_children = [&pending](Value& v) {
        for (auto& item : v.items) pending.push_back(std::move(item));
        for (auto& entry : v.entries) {
            pending.push_back(std::move(entry.first));
            pending.push_back(std::move(entry.second));
        }
        if (v.args) pending.push_back(std::move(v.args));
        if (v.state) pending.push_back(std::move(v.state));
        v.items.clear();
        v.entries.clear();
    };
    detach_children(*this);
    while (!pending.empty()) {
        ValuePtr node = std::move(pending.back());
        pending.pop_back();
        // Last owner: empty it first so its own destructor has nothing to recurse into.
        if (node && node.use_count() == 1) detach_children(*node);
    }
}

const Value* Value::find(const std::string& key) const {
    for (const auto& [k, v] : entries)
        if (k && k->kind == Kind::String && k->text == key) return v.get();
    return nullptr;
}

const Value* Value::attribute(const std::string& name) const {
    if (kind != Kind::Object) return nullptr;
    if (state && state->kind == Kind::Dict)
        if (const Value* v = state->find(name)) return v;
    // setstate with (dict, slots) tuples, as pickle does for objects with __slots__
    if (state && state->kind == Kind::Tuple)
        for (const auto& part : state->items)
            if (part && part->kind == Kind::Dict)
                if (const Value* v = part->find(name)) return v;
    return find(name);
}

namespace {

const char* kind_name(Value::Kind kind) {
    switch (kind) {
        case Value::Kind::None: return "None";
        case Value::Kind::Bool: return "bool";
        case Value::Kind::Int: return "int";
        case Value::Kind::Float: return "float";
        case Value::Kind::String: return "str";
        case Value::Kind::Bytes: return "bytes";
        case Value::Kind::List: return "list";
        case Value::Kind::Tuple: return "tuple";
        case Value::Kind::Set: return "set";
        case Value::Kind::Dict: return "dict";
        case Value::Kind::Tensor: return "tensor";
        case Value::Kind::Storage: return "storage";
        case Value::Kind::Global: return "global";
        case Value::Kind::Object: return "object";
    }
    return "?";
}

std::string quoted(const std::string& s, size_t max_len = 40) {
    std::string out = "'";
    for (size_t i = 0; i < s.size() && i < max_len; ++i) {
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c < 0x20 || c == 0x7f) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\x%02x", c);
            out += buf;
        } else {
            out += static_cast<char>(c);
        }
    }
    if (s.size() > max_len) out += "...";
    return out + "'";
}

}  // namespace

std::string describe(const Value& v) {
    switch (v.kind) {
        case Value::Kind::None: return "None";
        case Value::Kind::Bool: return v.boolean ? "bool True" : "bool False";
        case Value::Kind::Int: return str_cat("int ", v.integer);
        case Value::Kind::Float: return str_cat("float ", v.real);
        case Value::Kind::String: return str_cat("str ", quoted(v.text));
        case Value::Kind::Bytes: return str_cat("bytes(", v.text.size(), ")");
        case Value::Kind::List: return str_cat("list(", v.items.size(), ")");
        case Value::Kind::Tuple: return str_cat("tuple(", v.items.size(), ")");
        case Value::Kind::Set: return str_cat("set(", v.items.size(), ")");
        case Value::Kind::Dict:
            return str_cat(v.class_name.empty() ? "dict" : v.class_name, "(", v.entries.size(), ")");
        case Value::Kind::Tensor:
            return str_cat("tensor ", c10::toString(v.tensor.scalar_type()), " ", shape_string(v.tensor.sizes()));
        case Value::Kind::Storage: return str_cat("storage ", v.class_name, " (", v.tensor.numel(), " bytes)");
        case Value::Kind::Global: return str_cat("global ", v.class_name);
        case Value::Kind::Object: {
            std::string s = str_cat("object ", v.class_name);
            if (!v.entries.empty()) s += str_cat(" (", v.entries.size(), " items)");
            return s;
        }
    }
    return "?";
}

namespace {

void dump_into(std::ostringstream& out, const Value& v, int indent, int depth_left, int max_items) {
    const std::string pad(static_cast<size_t>(indent) * 2, ' ');
    out << describe(v) << "\n";
    if (depth_left <= 0) return;
    auto show_entries = [&](const std::vector<std::pair<ValuePtr, ValuePtr>>& entries) {
        int shown = 0;
        for (const auto& [k, val] : entries) {
            if (shown++ == max_items) {
                out << pad << "  ... " << (entries.size() - static_cast<size_t>(max_items)) << " more\n";
                break;
            }
            out << pad << "  " << (k->kind == Value::Kind::String ? k->text : describe(*k)) << ": ";
            dump_into(out, *val, indent + 1, depth_left - 1, max_items);
        }
    };
    auto show_items = [&](const std::vector<ValuePtr>& items) {
        int shown = 0;
        for (const auto& item : items) {
            if (shown++ == max_items) {
                out << pad << "  ... " << (items.size() - static_cast<size_t>(max_items)) << " more\n";
                break;
            }
            out << pad << "  - ";
            dump_into(out, *item, indent + 1, depth_left - 1, max_items);
        }
    };
    show_entries(v.entries);
    show_items(v.items);
    if (v.kind == Value::Kind::Object && v.state) {
        out << pad << "  <state> ";
        dump_into(out, *v.state, indent + 1, depth_left - 1, max_items);
    }
}

}  // namespace

std::string dump(const Value& value, int max_depth, int max_items) {
    std::ostringstream out;
    dump_into(out, value, 0, max_depth, max_items);
    return out.str();
}

// ------------------------------------------------------------------ unpickler

namespace {

ValuePtr make(Value::Kind kind) {
    auto v = std::make_shared<Value>();
    v->kind = kind;
    return v;
}

// dtype of a legacy typed-storage class ("torch.FloatStorage"); nullopt if unknown.
c10::optional<torch::ScalarType> storage_class_dtype(const std::string& class_name) {
    std::string name = class_name;
    for (const char* prefix : {"torch.cuda.", "torch."})
        if (name.rfind(prefix, 0) == 0) {
            name = name.substr(std::strlen(prefix));
            break;
        }
    static const std::map<std::string, torch::ScalarType> table = {
        {"DoubleStorage", torch::kFloat64},      {"FloatStorage", torch::kFloat32},
        {"HalfStorage", torch::kFloat16},        {"BFloat16Storage", torch::kBFloat16},
        {"LongStorage", torch::kInt64},          {"IntStorage", torch::kInt32},
        {"ShortStorage", torch::kInt16},         {"CharStorage", torch::kInt8},
        {"ByteStorage", torch::kUInt8},          {"BoolStorage", torch::kBool},
        {"ComplexFloatStorage", torch::kComplexFloat}, {"ComplexDoubleStorage", torch::kComplexDouble},
        {"UntypedStorage", torch::kUInt8},
    };
    auto it = table.find(name);
    if (it == table.end()) return c10::nullopt;
    return it->second;
}

// dtype of a torch dtype global ("torch.float32"), for _rebuild_tensor_v3.
c10::optional<torch::ScalarType> dtype_global(const std::string& class_name) {
    static const std::map<std::string, torch::ScalarType> table = {
        {"torch.float64", torch::kFloat64},   {"torch.double", torch::kFloat64},
        {"torch.float32", torch::kFloat32},   {"torch.float", torch::kFloat32},
        {"torch.float16", torch::kFloat16},   {"torch.half", torch::kFloat16},
        {"torch.bfloat16", torch::kBFloat16}, {"torch.int64", torch::kInt64},
        {"torch.long", torch::kInt64},        {"torch.int32", torch::kInt32},
        {"torch.int", torch::kInt32},         {"torch.int16", torch::kInt16},
        {"torch.short", torch::kInt16},       {"torch.int8", torch::kInt8},
        {"torch.uint8", torch::kUInt8},       {"torch.bool", torch::kBool},
        {"torch.complex64", torch::kComplexFloat}, {"torch.cfloat", torch::kComplexFloat},
        {"torch.complex128", torch::kComplexDouble}, {"torch.cdouble", torch::kComplexDouble},
    };
    auto it = table.find(class_name);
    if (it == table.end()) return c10::nullopt;
    return it->second;
}

const char* opcode_name(uint8_t op) {
    switch (op) {
        case 0x80: return "PROTO";
        case 0x95: return "FRAME";
        case '.': return "STOP";
        case '}': return "EMPTY_DICT";
        case ']': return "EMPTY_LIST";
        case ')': return "EMPTY_TUPLE";
        case '(': return "MARK";
        case 's': return "SETITEM";
        case 'u': return "SETITEMS";
        case 'a': return "APPEND";
        case 'e': return "APPENDS";
        case 'b': return "BUILD";
        case 'R': return "REDUCE";
        case 0x81: return "NEWOBJ";
        case 0x92: return "NEWOBJ_EX";
        case 'Q': return "BINPERSID";
        case 'h': return "BINGET";
        case 'j': return "LONG_BINGET";
        case 'g': return "GET";
        default: return nullptr;
    }
}

class Unpickler {
public:
    Unpickler(const std::string& data, const std::function<torch::Tensor(const std::string&)>& load_storage,
              const std::string& source, size_t start = 0, const char* what = "data.pkl")
        : data_(data), load_storage_(load_storage), source_(source), what_(what), pos_(start) {}

    // Legacy (pre-1.6) mode: persistent ids carry (storage_type, root_key, location, numel,
    // view_metadata) and the storages are allocated here, zero-filled, and filled by the caller
    // from the bytes that follow the pickles (legacy_storages()). `byte_budget` bounds the
    // allocation by what the file can hold.
    void set_legacy(size_t byte_budget) {
        legacy_ = true;
        legacy_budget_ = byte_budget;
    }
    struct LegacyStorage {
        torch::Tensor bytes;  // uint8, the root storage
        int64_t element_size = 1;
    };
    const std::map<std::string, LegacyStorage>& legacy_storages() const { return legacy_roots_; }
    // Offset just after the STOP opcode of the pickle run() read.
    size_t position() const { return pos_; }

    ValuePtr run() {
        while (true) {
            if (pos_ >= data_.size())
                fail_at(data_.size(), "truncated pickle: data ends without a STOP opcode");
            op_offset_ = pos_;
            const uint8_t op = static_cast<uint8_t>(data_[pos_++]);
            if (op == '.') {
                ValuePtr result = pop(op);
                return result;
            }
            step(op);
        }
    }

private:
    [[noreturn]] void fail_at(size_t offset, const std::string& what) const {
        fail(source_, ": ", what_, " offset ", offset, ": ", what);
    }
    [[noreturn]] void fail_op(uint8_t op, const std::string& what) const {
        const char* name = opcode_name(op);
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", op);
        fail_at(op_offset_, str_cat(name ? name : "opcode", " (", hex, "): ", what));
    }

    // Bounds-checked reads: a corrupt length can never make us allocate more than the file holds.
    std::string take(size_t n, uint8_t op) {
        if (n > data_.size() - pos_)
            fail_op(op, str_cat("truncated pickle: needs ", n, " bytes, only ", data_.size() - pos_, " left"));
        std::string out = data_.substr(pos_, n);
        pos_ += n;
        return out;
    }
    uint64_t read_uint(size_t n, uint8_t op) {
        const std::string b = take(n, op);
        uint64_t v = 0;
        for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
        return v;
    }
    std::string read_line(uint8_t op) {
        const size_t end = data_.find('\n', pos_);
        if (end == std::string::npos) fail_op(op, "truncated pickle: missing end of line");
        std::string out = data_.substr(pos_, end - pos_);
        pos_ = end + 1;
        return out;
    }

    size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
    ValuePtr pop(uint8_t op) {
        if (stack_.size() <= floor()) fail_op(op, "stack underflow");
        ValuePtr v = std::move(stack_.back());
        stack_.pop_back();
        return v;
    }
    ValuePtr& top(uint8_t op) {
        if (stack_.size() <= floor()) fail_op(op, "stack underflow");
        return stack_.back();
    }
    std::vector<ValuePtr> pop_mark(uint8_t op) {
        if (marks_.empty()) fail_op(op, "no MARK on the stack");
        const size_t m = marks_.back();
        marks_.pop_back();
        std::vector<ValuePtr> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
        stack_.resize(m);
        return items;
    }
    void push(ValuePtr v) { stack_.push_back(std::move(v)); }

    void push_int(int64_t i) {
        auto v = make(Value::Kind::Int);
        v->integer = i;
        push(v);
    }
    void push_text(Value::Kind kind, std::string s) {
        auto v = make(kind);
        v->text = std::move(s);
        push(v);
    }
    void push_global(const std::string& module, const std::string& name) {
        check_global_allowed(module, name);
        auto v = make(Value::Kind::Global);
        v->class_name = module + "." + name;
        push(v);
    }
    // Little-endian two's complement integer of n bytes (LONG1/LONG4).
    void push_long(const std::string& bytes) {
        if (bytes.size() <= 8) {
            uint64_t u = 0;
            for (size_t i = 0; i < bytes.size(); ++i)
                u |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
            if (!bytes.empty() && bytes.size() < 8 && (static_cast<uint8_t>(bytes.back()) & 0x80))
                u |= ~uint64_t{0} << (8 * bytes.size());  // sign-extend
            push_int(static_cast<int64_t>(u));
            return;
        }
        // Too large for int64: keep the raw bytes so nothing is silently rounded.
        auto v = make(Value::Kind::Object);
        v->class_name = "builtins.int";
        auto raw = make(Value::Kind::Bytes);
        raw->text = bytes;
        v->args = make(Value::Kind::Tuple);
        v->args->items.push_back(raw);
        push(v);
    }
    void memo_put(uint64_t index, uint8_t op) { memo_[index] = top(op); }
    void memo_get(uint64_t index, uint8_t op) {
        auto it = memo_.find(index);
        if (it == memo_.end()) fail_op(op, str_cat("memo index ", index, " is not defined"));
        push(it->second);
    }

    static ValuePtr tuple_of(std::vector<ValuePtr> items) {
        auto t = make(Value::Kind::Tuple);
        t->items = std::move(items);
        return t;
    }

    void set_items(const ValuePtr& target, std::vector<ValuePtr>& kv, uint8_t op) {
        if (kv.size() % 2 != 0) fail_op(op, "odd number of items for key/value pairs");
        if (target->kind != Value::Kind::Dict && target->kind != Value::Kind::Object)
            fail_op(op, str_cat("cannot set items on a ", kind_name(target->kind)));
        // Dict semantics: a key equal to an existing one overwrites its value in place. Keys are equal when they
        // are the same node (a memo reference, as Python's identity test) or scalars of one kind and value. The
        // index makes a merge linear: BUILD merges whole dicts, and a hostile pickle of 3 KB that merged a dict
        // into itself 28 times doubled float keys that were never matched, to 2^28 entries (a fuzz finding).
        std::unordered_map<std::string, size_t> index;
        index.reserve(target->entries.size() + kv.size() / 2);
        for (size_t e = 0; e < target->entries.size(); ++e) index.emplace(key_identity(*target->entries[e].first), e);
        for (size_t i = 0; i < kv.size(); i += 2) {
            const auto [slot, fresh] = index.emplace(key_identity(*kv[i]), target->entries.size());
            if (fresh)
                target->entries.emplace_back(kv[i], kv[i + 1]);
            else
                target->entries[slot->second].second = kv[i + 1];
        }
    }
    // What makes two dict keys the same key (see set_items): the scalar's kind and value, else the node itself.
    static std::string key_identity(const Value& key) {
        switch (key.kind) {
            case Value::Kind::None: return "n";
            case Value::Kind::Bool: return key.boolean ? "b1" : "b0";
            case Value::Kind::Int: return "i" + std::to_string(key.integer);
            case Value::Kind::String: return "s" + key.text;
            case Value::Kind::Bytes: return "y" + key.text;
            case Value::Kind::Float: {
                if (std::isnan(key.real)) break;  // NaN equals only itself
                const double value = key.real == 0.0 ? 0.0 : key.real;  // -0.0 == 0.0
                return "f" + std::string(reinterpret_cast<const char*>(&value), sizeof value);
            }
            default: break;
        }
        return "p" + std::to_string(reinterpret_cast<std::uintptr_t>(&key));
    }
    void append_items(const ValuePtr& target, std::vector<ValuePtr>& items, uint8_t op) {
        if (target->kind != Value::Kind::List && target->kind != Value::Kind::Object &&
            target->kind != Value::Kind::Set)
            fail_op(op, str_cat("cannot append to a ", kind_name(target->kind)));
        for (auto& item : items) target->items.push_back(item);
    }

    int64_t as_int(const ValuePtr& v, const char* what, uint8_t op) const {
        if (!v || v->kind != Value::Kind::Int) fail_op(op, str_cat(what, ": expected an int, got ", v ? describe(*v) : "nothing"));
        return v->integer;
    }
    std::vector<int64_t> as_int_tuple(const ValuePtr& v, const char* what, uint8_t op) const {
        if (!v || (v->kind != Value::Kind::Tuple && v->kind != Value::Kind::List))
            fail_op(op, str_cat(what, ": expected a tuple of ints, got ", v ? describe(*v) : "nothing"));
        std::vector<int64_t> out;
        for (const auto& item : v->items) out.push_back(as_int(item, what, op));
        return out;
    }

    // Tensor over `storage` like torch's _rebuild_tensor: as_strided on the typed storage.
    ValuePtr rebuild_tensor(const std::vector<ValuePtr>& a, c10::optional<torch::ScalarType> dtype_override,
                            uint8_t op) const {
        if (a.size() < 4) fail_op(op, str_cat("_rebuild_tensor needs at least 4 arguments, got ", a.size()));
        const ValuePtr& storage = a[0];
        if (!storage || storage->kind != Value::Kind::Storage)
            fail_op(op, str_cat("_rebuild_tensor: first argument must be a storage, got ",
                                storage ? describe(*storage) : "nothing"));
        const int64_t offset = as_int(a[1], "tensor storage offset", op);
        const std::vector<int64_t> sizes = as_int_tuple(a[2], "tensor size", op);
        const std::vector<int64_t> strides = as_int_tuple(a[3], "tensor stride", op);
        auto dtype = dtype_override ? dtype_override : storage_class_dtype(storage->class_name);
        if (!dtype) fail_op(op, str_cat("unsupported storage type ", storage->class_name));
        if (sizes.size() != strides.size())
            fail_op(op, str_cat("tensor size ", shape_string(sizes), " and stride ", shape_string(strides),
                                " have different lengths"));
        const torch::Tensor& raw = storage->tensor;  // uint8 bytes
        const int64_t element_size = static_cast<int64_t>(c10::elementSize(*dtype));
        if (raw.numel() % element_size != 0)
            fail_op(op, str_cat("storage of ", raw.numel(), " bytes is not a whole number of ",
                                c10::toString(*dtype), " elements"));
        const int64_t capacity = raw.numel() / element_size;
        // Highest element index the view touches, with overflow checks.
        if (offset < 0) fail_op(op, str_cat("negative storage offset ", offset));
        bool empty = false;
        int64_t last = offset;
        for (size_t d = 0; d < sizes.size(); ++d) {
            if (sizes[d] < 0 || strides[d] < 0)
                fail_op(op, str_cat("negative size or stride: size ", shape_string(sizes), " stride ",
                                    shape_string(strides)));
            if (sizes[d] == 0) empty = true;
        }
        if (!empty) {
            for (size_t d = 0; d < sizes.size(); ++d) {
                int64_t span = 0;
                if (__builtin_mul_overflow(sizes[d] - 1, strides[d], &span) ||
                    __builtin_add_overflow(last, span, &last))
                    fail_op(op, str_cat("tensor size ", shape_string(sizes), " stride ", shape_string(strides),
                                        " overflows"));
            }
            if (last >= capacity)
                fail_op(op, str_cat("tensor view (offset ", offset, ", size ", shape_string(sizes), ", stride ",
                                    shape_string(strides), ") reaches element ", last, " but storage ",
                                    storage->text, " holds only ", capacity, " ", c10::toString(*dtype),
                                    " elements"));
        } else if (offset > capacity) {
            fail_op(op, str_cat("storage offset ", offset, " beyond storage of ", capacity, " elements"));
        }
        torch::Tensor typed;
        if (capacity == 0) {
            typed = torch::empty({0}, torch::TensorOptions().dtype(*dtype));
        } else {
            torch::Tensor keep = raw;  // the typed view shares (and keeps alive) the record's bytes
            typed = torch::from_blob(
                raw.data_ptr(), {capacity}, [keep](void*) mutable { keep = torch::Tensor(); },
                torch::TensorOptions().dtype(*dtype));
        }
        auto v = make(Value::Kind::Tensor);
        v->tensor = typed.as_strided(sizes, strides, offset);
        return v;
    }

    // REDUCE: the functions torch.save uses for tensors are evaluated; any other callable
    // becomes a generic Object node.
    ValuePtr call(const ValuePtr& callable, const ValuePtr& args, uint8_t op, int depth = 0) const {
        if (depth > 8) fail_op(op, "nested rebuild calls too deep");
        if (args->kind != Value::Kind::Tuple)
            fail_op(op, str_cat("arguments must be a tuple, got ", describe(*args)));
        const auto& a = args->items;
        const std::string name = callable->kind == Value::Kind::Global ? callable->class_name : std::string();
        if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor")
            return rebuild_tensor(a, c10::nullopt, op);
        if (name == "torch._utils._rebuild_tensor_v3") {
            if (a.size() < 7 || a[6]->kind != Value::Kind::Global)
                fail_op(op, "_rebuild_tensor_v3 needs (storage, offset, size, stride, requires_grad, hooks, dtype)");
            auto dtype = dtype_global(a[6]->class_name);
            if (!dtype) fail_op(op, str_cat("unsupported dtype ", a[6]->class_name));
            return rebuild_tensor(a, dtype, op);
        }
        if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
            if (a.empty() || a[0]->kind != Value::Kind::Tensor)
                fail_op(op, str_cat(name, ": first argument must be a tensor"));
            return a[0];
        }
        if (name == "torch._tensor._rebuild_from_type_v2" || name == "torch._tensor._rebuild_from_type") {
            if (a.size() < 3) fail_op(op, str_cat(name, " needs (func, type, args, ...)"));
            return call(a[0], a[2], op, depth + 1);
        }
        // TorchScript's pickler (torch::pickle_save) tags typed containers and specialised lists
        if (name == "torch.jit._pickle.restore_type_tag" ||
            (name.rfind("torch.jit._pickle.build_", 0) == 0 && name != "torch.jit._pickle.build_tensor_from_id")) {
            if (a.empty()) fail_op(op, str_cat(name, " needs an argument"));
            return a[0];
        }
        if (name.rfind("torch._utils._rebuild_", 0) == 0)
            fail_op(op, str_cat("unsupported tensor kind ", name, " (quantized, sparse or device-only tensors)"));
        if (name == "collections.OrderedDict" || name == "builtins.dict" || name == "__builtin__.dict") {
            auto d = make(Value::Kind::Dict);
            d->class_name = name == "collections.OrderedDict" ? name : "";
            if (!a.empty() && (a[0]->kind == Value::Kind::List || a[0]->kind == Value::Kind::Tuple)) {
                for (const auto& pair : a[0]->items) {
                    if (pair->kind != Value::Kind::Tuple && pair->kind != Value::Kind::List)
                        fail_op(op, "OrderedDict argument must hold (key, value) pairs");
                    if (pair->items.size() != 2) fail_op(op, "OrderedDict argument must hold (key, value) pairs");
                    d->entries.emplace_back(pair->items[0], pair->items[1]);
                }
            }
            return d;
        }
        if (name == "builtins.set" || name == "builtins.frozenset" || name == "__builtin__.set") {
            auto s = make(Value::Kind::Set);
            if (!a.empty()) s->items = a[0]->items;
            return s;
        }
        // Protocol < 3 pickles bytes as _codecs.encode(latin-1 text, 'latin1') (and b'' as bytes()).
        if (name == "_codecs.encode" || name == "builtins.bytes" || name == "__builtin__.bytes" ||
            name == "builtins.bytearray" || name == "__builtin__.bytearray") {
            auto b = make(Value::Kind::Bytes);
            if (a.empty()) return b;
            if (a[0]->kind == Value::Kind::Bytes) {
                b->text = a[0]->text;
                return b;
            }
            if (a[0]->kind != Value::Kind::String) fail_op(op, str_cat(name, ": expected a str argument"));
            const std::string encoding = a.size() > 1 && a[1]->kind == Value::Kind::String ? a[1]->text : "";
            if (encoding != "latin1" && encoding != "latin-1")
                fail_op(op, str_cat(name, ": unsupported encoding ", quoted(encoding)));
            b->text = utf8_to_latin1(a[0]->text, op);
            return b;
        }
        if (name == "copyreg._reconstructor" || name == "copy_reg._reconstructor") {
            // (cls, base, state): protocol 0/1 object creation
            auto obj = make(Value::Kind::Object);
            obj->class_name = (!a.empty() && a[0]->kind == Value::Kind::Global) ? a[0]->class_name : "?";
            obj->args = tuple_of({});
            return obj;
        }
        auto obj = make(Value::Kind::Object);
        obj->class_name = name.empty() ? str_cat("<result of calling ", describe(*callable), ">") : name;
        obj->args = args;
        return obj;
    }

    // Code points of a UTF-8 string, each < 256, as bytes.
    std::string utf8_to_latin1(const std::string& text, uint8_t op) const {
        std::string out;
        for (size_t i = 0; i < text.size(); ++i) {
            const uint8_t c = static_cast<uint8_t>(text[i]);
            if (c < 0x80) {
                out.push_back(static_cast<char>(c));
            } else if ((c == 0xc2 || c == 0xc3) && i + 1 < text.size() &&
                       (static_cast<uint8_t>(text[i + 1]) & 0xc0) == 0x80) {
                out.push_back(static_cast<char>(((c & 0x1f) << 6) | (static_cast<uint8_t>(text[i + 1]) & 0x3f)));
                ++i;
            } else {
                fail_op(op, "latin-1 text holds a character above U+00FF or invalid UTF-8");
            }
        }
        return out;
    }

    ValuePtr new_object(const ValuePtr& cls, const ValuePtr& args, uint8_t op) const {
        if (cls->kind == Value::Kind::Global &&
            (cls->class_name == "collections.OrderedDict" || cls->class_name == "builtins.dict")) {
            auto d = make(Value::Kind::Dict);
            d->class_name = cls->class_name == "collections.OrderedDict" ? cls->class_name : "";
            return d;
        }
        auto obj = make(Value::Kind::Object);
        obj->class_name = cls->kind == Value::Kind::Global ? cls->class_name : str_cat("<", describe(*cls), ">");
        obj->args = args;
        return obj;
    }

    ValuePtr persistent_load(const ValuePtr& pid, uint8_t op) {
        if (pid->kind != Value::Kind::Tuple || pid->items.size() < 3 || pid->items[0]->kind != Value::Kind::String ||
            pid->items[0]->text != "storage")
            fail_op(op, str_cat("unsupported persistent id ", describe(*pid),
                                " (expected ('storage', type, key, location, numel))"));
        const auto& it = pid->items;
        if (it[1]->kind != Value::Kind::Global) fail_op(op, "persistent id: storage type is not a class");
        std::string key;
        if (it[2]->kind == Value::Kind::String) key = it[2]->text;
        else if (it[2]->kind == Value::Kind::Int) key = std::to_string(it[2]->integer);
        else fail_op(op, str_cat("persistent id: storage key must be a str, got ", describe(*it[2])));
        if (!storage_class_dtype(it[1]->class_name))
            fail_op(op, str_cat("unsupported storage type ", it[1]->class_name));
        if (legacy_) return persistent_load_legacy(it, key, op);
        auto cached = storages_.find(key);
        torch::Tensor raw;
        if (cached != storages_.end()) {
            raw = cached->second;
        } else {
            raw = load_storage_(key);
            if (!raw.defined() || raw.scalar_type() != torch::kUInt8 || raw.dim() != 1 || !raw.is_contiguous())
                fail_op(op, str_cat("storage '", key, "': the loader must return a contiguous 1-D uint8 tensor"));
            storages_[key] = raw;
        }
        if (it.size() >= 5 && it[4]->kind == Value::Kind::Int) {
            // numel counts elements of the typed storage (bytes for UntypedStorage)
            const int64_t numel = it[4]->integer;
            const int64_t esize = static_cast<int64_t>(c10::elementSize(*storage_class_dtype(it[1]->class_name)));
            int64_t need = 0;
            if (numel < 0 || __builtin_mul_overflow(numel, esize, &need) || need > raw.numel())
                fail_op(op, str_cat("storage '", key, "' (", it[1]->class_name, ") should hold ", numel,
                                    " elements but its record has ", raw.numel(), " bytes"));
        }
        auto v = make(Value::Kind::Storage);
        v->class_name = it[1]->class_name;
        v->text = key;
        v->tensor = raw;
        return v;
    }

    void step(uint8_t op) {
        switch (op) {
            case 0x80: {  // PROTO
                const uint64_t proto = read_uint(1, op);
                if (proto > 5) fail_op(op, str_cat("unsupported pickle protocol ", proto));
                break;
            }
            case 0x95: {  // FRAME: a length hint; check it, then read on
                const uint64_t n = read_uint(8, op);
                if (n > data_.size() - pos_)
                    fail_op(op, str_cat("truncated pickle: frame of ", n, " bytes, only ", data_.size() - pos_,
                                        " left"));
                break;
            }
            case '}': push(make(Value::Kind::Dict)); break;
            case ']': push(make(Value::Kind::List)); break;
            case ')': push(make(Value::Kind::Tuple)); break;
            case 0x8f: push(make(Value::Kind::Set)); break;  // EMPTY_SET
            case '(': marks_.push_back(stack_.size()); break;
            case 's': {  // SETITEM
                std::vector<ValuePtr> kv(2);
                kv[1] = pop(op);
                kv[0] = pop(op);
                set_items(top(op), kv, op);
                break;
            }
            case 'u': {  // SETITEMS
                auto kv = pop_mark(op);
                set_items(top(op), kv, op);
                break;
            }
            case 'a': {  // APPEND
                std::vector<ValuePtr> one{pop(op)};
                append_items(top(op), one, op);
                break;
            }
            case 'e': case 0x90: {  // APPENDS, ADDITEMS
                auto items = pop_mark(op);
                append_items(top(op), items, op);
                break;
            }
            case 'd': {  // DICT
                auto kv = pop_mark(op);
                auto d = make(Value::Kind::Dict);
                set_items(d, kv, op);
                push(d);
                break;
            }
            case 'l': {  // LIST
                auto l = make(Value::Kind::List);
                l->items = pop_mark(op);
                push(l);
                break;
            }
            case 't': push(tuple_of(pop_mark(op))); break;  // TUPLE
            case 0x91: {  // FROZENSET
                auto s = make(Value::Kind::Set);
                s->items = pop_mark(op);
                push(s);
                break;
            }
            case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
                const size_t n = static_cast<size_t>(op - 0x84);
                std::vector<ValuePtr> items(n);
                for (size_t i = n; i-- > 0;) items[i] = pop(op);
                push(tuple_of(std::move(items)));
                break;
            }
            case 'N': push(make(Value::Kind::None)); break;
            case 0x88: case 0x89: {  // NEWTRUE, NEWFALSE
                auto b = make(Value::Kind::Bool);
                b->boolean = op == 0x88;
                push(b);
                break;
            }
            case 'J': push_int(static_cast<int32_t>(static_cast<uint32_t>(read_uint(4, op)))); break;  // BININT
            case 'K': push_int(static_cast<int64_t>(read_uint(1, op))); break;                          // BININT1
            case 'M': push_int(static_cast<int64_t>(read_uint(2, op))); break;                          // BININT2
            case 0x8a: push_long(take(read_uint(1, op), op)); break;                                    // LONG1
            case 0x8b: {                                                                                 // LONG4
                const int32_t n = static_cast<int32_t>(static_cast<uint32_t>(read_uint(4, op)));
                if (n < 0) fail_op(op, "negative length");
                push_long(take(static_cast<size_t>(n), op));
                break;
            }
            case 'I': {  // INT (text; "01"/"00" are True/False)
                const std::string line = read_line(op);
                if (line == "01" || line == "00") {
                    auto b = make(Value::Kind::Bool);
                    b->boolean = line == "01";
                    push(b);
                } else {
                    push_int(parse_int(line, op));
                }
                break;
            }
            case 'L': {  // LONG (text, optional trailing L)
                std::string line = read_line(op);
                if (!line.empty() && line.back() == 'L') line.pop_back();
                push_int(parse_int(line, op));
                break;
            }
            case 'G': {  // BINFLOAT: big-endian IEEE double
                const std::string b = take(8, op);
                uint64_t u = 0;
                for (int i = 0; i < 8; ++i) u = (u << 8) | static_cast<uint8_t>(b[static_cast<size_t>(i)]);
                auto f = make(Value::Kind::Float);
                std::memcpy(&f->real, &u, sizeof u);
                push(f);
                break;
            }
            case 'F': {  // FLOAT (text)
                const std::string line = read_line(op);
                char* end = nullptr;
                const double d = std::strtod(line.c_str(), &end);
                if (line.empty() || end != line.c_str() + line.size()) fail_op(op, str_cat("bad float ", quoted(line)));
                auto f = make(Value::Kind::Float);
                f->real = d;
                push(f);
                break;
            }
            case 'X': push_text(Value::Kind::String, take(read_uint(4, op), op)); break;     // BINUNICODE
            case 0x8c: push_text(Value::Kind::String, take(read_uint(1, op), op)); break;    // SHORT_BINUNICODE
            case 0x8d: push_text(Value::Kind::String, take(read_uint(8, op), op)); break;    // BINUNICODE8
            case 'U': push_text(Value::Kind::Bytes, take(read_uint(1, op), op)); break;      // SHORT_BINSTRING
            case 'T': {                                                                      // BINSTRING
                const int32_t n = static_cast<int32_t>(static_cast<uint32_t>(read_uint(4, op)));
                if (n < 0) fail_op(op, "negative length");
                push_text(Value::Kind::Bytes, take(static_cast<size_t>(n), op));
                break;
            }
            case 'C': push_text(Value::Kind::Bytes, take(read_uint(1, op), op)); break;      // SHORT_BINBYTES
            case 'B': push_text(Value::Kind::Bytes, take(read_uint(4, op), op)); break;      // BINBYTES
            case 0x8e: case 0x96: push_text(Value::Kind::Bytes, take(read_uint(8, op), op)); break;  // BINBYTES8, BYTEARRAY8
            case 'V': push_text(Value::Kind::String, read_line(op)); break;  // UNICODE (raw-unicode-escape; ASCII kept)
            case 'S': {                                                       // STRING (quoted repr)
                std::string line = read_line(op);
                if (line.size() >= 2 && (line.front() == '\'' || line.front() == '"') && line.back() == line.front())
                    line = line.substr(1, line.size() - 2);
                push_text(Value::Kind::Bytes, line);
                break;
            }
            case 'q': memo_put(read_uint(1, op), op); break;   // BINPUT
            case 'r': memo_put(read_uint(4, op), op); break;   // LONG_BINPUT
            case 'p': memo_put(static_cast<uint64_t>(parse_int(read_line(op), op)), op); break;  // PUT
            case 0x94: memo_put(memo_.size(), op); break;      // MEMOIZE
            case 'h': memo_get(read_uint(1, op), op); break;   // BINGET
            case 'j': memo_get(read_uint(4, op), op); break;   // LONG_BINGET
            case 'g': memo_get(static_cast<uint64_t>(parse_int(read_line(op), op)), op); break;  // GET
            case 'c': {  // GLOBAL
                const std::string module = read_line(op);
                const std::string name = read_line(op);
                push_global(module, name);
                break;
            }
            case 0x93: {  // STACK_GLOBAL
                ValuePtr name = pop(op);
                ValuePtr module = pop(op);
                if (module->kind != Value::Kind::String || name->kind != Value::Kind::String)
                    fail_op(op, "STACK_GLOBAL needs two strings");
                push_global(module->text, name->text);
                break;
            }
            case 'R': {  // REDUCE
                ValuePtr args = pop(op);
                ValuePtr callable = pop(op);
                push(call(callable, args, op));
                break;
            }
            case 0x81: {  // NEWOBJ
                ValuePtr args = pop(op);
                ValuePtr cls = pop(op);
                push(new_object(cls, args, op));
                break;
            }
            case 0x92: {  // NEWOBJ_EX
                ValuePtr kwargs = pop(op);
                ValuePtr args = pop(op);
                ValuePtr cls = pop(op);
                ValuePtr obj = new_object(cls, args, op);
                if (obj->kind == Value::Kind::Object && !kwargs->entries.empty()) obj->state = kwargs;
                push(obj);
                break;
            }
            case 'o': {  // OBJ: MARK cls args... OBJ
                auto items = pop_mark(op);
                if (items.empty()) fail_op(op, "OBJ without a class");
                ValuePtr cls = items.front();
                items.erase(items.begin());
                push(new_object(cls, tuple_of(std::move(items)), op));
                break;
            }
            case 'i': {  // INST: module/name lines, MARK args...
                const std::string module = read_line(op);
                const std::string name = read_line(op);
                check_global_allowed(module, name);
                auto items = pop_mark(op);
                auto cls = make(Value::Kind::Global);
                cls->class_name = module + "." + name;
                push(new_object(cls, tuple_of(std::move(items)), op));
                break;
            }
            case 'b': {  // BUILD
                ValuePtr state = pop(op);
                ValuePtr& target = top(op);
                switch (target->kind) {
                    case Value::Kind::Object:
                    case Value::Kind::Dict:
                    case Value::Kind::List:
                    case Value::Kind::Set:
                        if (target->state && target->state->kind == Value::Kind::Dict &&
                            state->kind == Value::Kind::Dict) {
                            std::vector<ValuePtr> kv;
                            for (auto& e : state->entries) {
                                kv.push_back(e.first);
                                kv.push_back(e.second);
                            }
                            set_items(target->state, kv, op);
                        } else {
                            target->state = state;
                        }
                        break;
                    case Value::Kind::Tensor:  // tensor subclass/parameter state: no effect on the data
                        break;
                    default:
                        fail_op(op, str_cat("BUILD on a ", kind_name(target->kind)));
                }
                break;
            }
            case 'Q': {  // BINPERSID
                ValuePtr pid = pop(op);
                push(persistent_load(pid, op));
                break;
            }
            case '0': pop(op); break;  // POP
            case '1': pop_mark(op); break;  // POP_MARK
            case '2': push(top(op)); break;  // DUP
            case 'P':
                fail_op(op, "text persistent ids (PERSID) are not written by torch.save");
            case 0x97: case 0x98:
                fail_op(op, "out-of-band buffers (protocol 5 NEXT_BUFFER/READONLY_BUFFER) are not supported");
            case 0x82: case 0x83: case 0x84:
                fail_op(op, "extension registry opcodes (EXT1/2/4) are not supported");
            default: {
                char hex[8];
                std::snprintf(hex, sizeof hex, "0x%02x", op);
                fail_at(op_offset_, str_cat("unknown pickle opcode ", hex));
            }
        }
    }

    int64_t parse_int(const std::string& s, uint8_t op) const {
        if (s.empty()) fail_op(op, "empty integer");
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        if (errno != 0 || end != s.c_str() + s.size()) fail_op(op, str_cat("bad integer ", quoted(s)));
        return static_cast<int64_t>(v);
    }

    // The allow-list check (include/linvis/io/torch_checkpoint.h): refuses the file at the
    // opcode that names the global, before any object of it exists.
    void check_global_allowed(const std::string& module, const std::string& name) const {
        if (pickle_global_allowed(module, name)) return;
        fail_at(op_offset_, str_cat("refusing global '", module, ".", name,
                                    "': not in the allow-list of classes and functions a checkpoint may name "
                                    "(tensors, storages, containers, argparse/yacs configs, numpy scalars)"));
    }

    ValuePtr persistent_load_legacy(const std::vector<ValuePtr>& it, const std::string& key, uint8_t op) {
        // ('storage', storage_type, root_key, location, numel, view_metadata)
        if (it.size() < 5 || it[4]->kind != Value::Kind::Int)
            fail_op(op, "legacy persistent id needs ('storage', type, key, location, numel, view_metadata)");
        const int64_t esize = static_cast<int64_t>(c10::elementSize(*storage_class_dtype(it[1]->class_name)));
        const int64_t numel = it[4]->integer;
        int64_t bytes = 0;
        if (numel < 0 || __builtin_mul_overflow(numel, esize, &bytes) || static_cast<uint64_t>(bytes) > legacy_budget_)
            fail_op(op, str_cat("storage '", key, "' (", it[1]->class_name, ") claims ", numel,
                                " elements, more than the ", legacy_budget_, " bytes left in the file"));
        auto root = legacy_roots_.find(key);
        if (root == legacy_roots_.end()) {
            legacy_budget_ -= static_cast<uint64_t>(bytes);
            root = legacy_roots_.emplace(key, LegacyStorage{torch::zeros({bytes}, torch::kUInt8), esize}).first;
        } else if (root->second.element_size != esize || root->second.bytes.numel() != bytes) {
            fail_op(op, str_cat("storage '", key, "' is referenced with two different types or sizes"));
        }
        torch::Tensor raw = root->second.bytes;
        std::string name = key;
        if (it.size() >= 6 && it[5]->kind != Value::Kind::None) {
            // (view_key, offset, view_size) in elements of the root storage
            const ValuePtr& view = it[5];
            if (view->kind != Value::Kind::Tuple || view->items.size() != 3 ||
                view->items[0]->kind != Value::Kind::String)
                fail_op(op, str_cat("legacy storage view must be (key, offset, size), got ", describe(*view)));
            const int64_t offset = as_int(view->items[1], "storage view offset", op);
            const int64_t size = as_int(view->items[2], "storage view size", op);
            if (offset < 0 || size < 0 || offset > numel || size > numel - offset)
                fail_op(op, str_cat("storage view ", view->items[0]->text, " (offset ", offset, ", size ", size,
                                    ") lies outside storage '", key, "' of ", numel, " elements"));
            raw = raw.narrow(0, offset * esize, size * esize);
            name = view->items[0]->text;
        }
        auto v = make(Value::Kind::Storage);
        v->class_name = it[1]->class_name;
        v->text = name;
        v->tensor = raw;
        return v;
    }

    const std::string& data_;
    const std::function<torch::Tensor(const std::string&)>& load_storage_;
    const std::string& source_;
    const char* what_;
    size_t pos_ = 0;
    bool legacy_ = false;
    uint64_t legacy_budget_ = 0;
    std::map<std::string, LegacyStorage> legacy_roots_;
    size_t op_offset_ = 0;
    std::vector<ValuePtr> stack_;
    std::vector<size_t> marks_;
    std::unordered_map<uint64_t, ValuePtr> memo_;
    std::map<std::string, torch::Tensor> storages_;
};

std::string c10_message(const std::exception& e) {
    if (auto* ce = dynamic_cast<const c10::Error*>(&e)) {
        std::string msg = ce->what_without_backtrace();
        const size_t nl = msg.find('\n');
        return nl == std::string::npos ? msg : msg.substr(0, nl);
    }
    return e.what();
}

}  // namespace

ValuePtr unpickle(const std::string& bytes, const std::function<torch::Tensor(const std::string& key)>& load_storage,
                  const std::string& source) {
    Unpickler unpickler(bytes, load_storage, source);
    return unpickler.run();
}

// ------------------------------------------------------------------ archive

namespace {

// The legacy format's magic number 0x1950a86a20f9469cfc6c as the little-endian bytes of the
// pickled int (LONG1 of 10 bytes), and the protocol version torch writes after it.
const std::string kLegacyMagic("\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 10);
constexpr int64_t kLegacyProtocolVersion = 1001;

// Largest uncompressed size any record of the zip at `path` declares in the central directory.
// LibTorch's reader allocates a record's declared size before reading it, so a forged size
// (found by fuzz_pth: 4 GB declared in a 3.5 KB file) must be refused first. The directory is
// walked the way miniz does (end-of-directory record searched from the end, zip64 included);
// anything inconsistent is refused too.
uint64_t largest_zip_record(const std::string& path, std::ifstream& in, uint64_t file_size, std::string* which) {
    auto read_at = [&](uint64_t offset, size_t n) {
        LINVIS_CHECK(offset <= file_size && n <= file_size - offset, path, ": zip structure at offset ", offset,
                     " (", n, " bytes) lies beyond the end of the file (", file_size, " bytes)");
        std::string b(n, '\0');
        in.clear();
        in.seekg(static_cast<std::streamoff>(offset));
        in.read(b.data(), static_cast<std::streamsize>(n));
        LINVIS_CHECK(static_cast<size_t>(in.gcount()) == n, path, ": cannot read ", n, " bytes at offset ", offset);
        return b;
    };
    auto le = [](const std::string& b, size_t at, int n) {
        uint64_t v = 0;
        for (int i = 0; i < n; ++i) v |= uint64_t(static_cast<uint8_t>(b[at + static_cast<size_t>(i)])) << (8 * i);
        return v;
    };
    const uint64_t tail_size = std::min<uint64_t>(file_size, 22 + 65535);
    const std::string tail = read_at(file_size - tail_size, static_cast<size_t>(tail_size));
    size_t eocd = std::string::npos;
    for (size_t i = tail.size() >= 22 ? tail.size() - 22 + 1 : 0; i-- > 0;)
        if (le(tail, i, 4) == 0x06054b50) {
            eocd = i;
            break;
        }
    LINVIS_CHECK(eocd != std::string::npos, path, ": cannot read the zip archive: no end-of-central-directory record");
    uint64_t entries = le(tail, eocd + 10, 2), cd_size = le(tail, eocd + 12, 4), cd_offset = le(tail, eocd + 16, 4);
    if (entries == 0xffff || cd_size == 0xffffffff || cd_offset == 0xffffffff) {  // zip64
        const uint64_t eocd_pos = file_size - tail_size + eocd;
        LINVIS_CHECK(eocd_pos >= 20, path, ": cannot read the zip archive: zip64 locator missing");
        const std::string locator = read_at(eocd_pos - 20, 20);
        LINVIS_CHECK(le(locator, 0, 4) == 0x07064b50, path, ": cannot read the zip archive: zip64 locator missing");
        const std::string record = read_at(le(locator, 8, 8), 56);
        LINVIS_CHECK(le(record, 0, 4) == 0x06064b50, path, ": cannot read the zip archive: bad zip64 end record");
        entries = le(record, 32, 8);
        cd_size = le(record, 40, 8);
        cd_offset = le(record, 48, 8);
    }
    const std::string cd = read_at(cd_offset, static_cast<size_t>(std::min<uint64_t>(cd_size, file_size)));
    uint64_t largest = 0;
    size_t at = 0;
    for (uint64_t e = 0; e < entries; ++e) {
        LINVIS_CHECK(cd.size() >= 46 && at <= cd.size() - 46 && le(cd, at, 4) == 0x02014b50, path,
                     ": cannot read the zip archive: central directory entry ", e, " is malformed");
        uint64_t uncompressed = le(cd, at + 24, 4);
        const size_t name_len = le(cd, at + 28, 2), extra_len = le(cd, at + 30, 2), comment_len = le(cd, at + 32, 2);
        LINVIS_CHECK(name_len + extra_len + comment_len <= cd.size() - at - 46, path,
                     ": cannot read the zip archive: central directory entry ", e, " is truncated");
        const std::string name = cd.substr(at + 46, name_len);
        if (uncompressed == 0xffffffff) {  // the real size is in the zip64 extra field
            size_t x = at + 46 + name_len;
            const size_t end = x + extra_len;
            while (x + 4 <= end) {
                const uint64_t id = le(cd, x, 2), len = le(cd, x + 2, 2);
                if (x + 4 + len > end) break;
                if (id == 0x0001 && len >= 8) uncompressed = le(cd, x + 4, 8);
                x += 4 + len;
            }
        }
        if (uncompressed >= largest) {
            largest = uncompressed;
            *which = name;
        }
        at += 46 + name_len + extra_len + comment_len;
    }
    return largest;
}

CheckpointContents read_legacy_checkpoint(const std::string& path, const std::string& bytes) {
    // A named std::function: the Unpickler keeps a reference to it.
    const std::function<torch::Tensor(const std::string&)> no_storage = [&path](const std::string& key) -> torch::Tensor {
        fail(path, ": legacy torch.save header pickle references storage '", key, "'");
    };
    size_t pos = 0;
    ValuePtr magic;
    try {
        Unpickler first(bytes, no_storage, path, 0, "legacy magic-number pickle");
        magic = first.run();
        pos = first.position();
    } catch (const Error& e) {
        fail(path, ": not a zip archive (a torch.save checkpoint starts with 'PK\\x03\\x04') nor a legacy "
                   "(pre-1.6) torch.save file (its first pickle is unreadable: ",
             std::string(e.what()).substr(path.size() + 2), ")");
    }
    const bool magic_ok = magic->kind == Value::Kind::Object && magic->class_name == "builtins.int" && magic->args &&
                          magic->args->items.size() == 1 && magic->args->items[0]->text == kLegacyMagic;
    LINVIS_CHECK(magic_ok, path, ": not a zip archive (a torch.save checkpoint starts with 'PK\\x03\\x04') nor a "
                 "legacy (pre-1.6) torch.save file (first pickle is ", describe(*magic),
                 ", expected the magic number 0x1950a86a20f9469cfc6c)");
    auto next_pickle = [&](const char* what) {
        Unpickler u(bytes, no_storage, path, pos, what);
        ValuePtr v = u.run();
        pos = u.position();
        return v;
    };
    const ValuePtr version = next_pickle("legacy protocol-version pickle");
    LINVIS_CHECK(version->kind == Value::Kind::Int && version->integer == kLegacyProtocolVersion, path,
                 ": legacy torch.save protocol version is ", describe(*version), ", expected int ",
                 kLegacyProtocolVersion);
    const ValuePtr sys_info = next_pickle("legacy sys_info pickle");
    LINVIS_CHECK(sys_info->kind == Value::Kind::Dict, path, ": legacy torch.save sys_info is ", describe(*sys_info),
                 ", expected a dict");
    CheckpointContents contents;
    contents.path = path;
    contents.format_version = kLegacyProtocolVersion;
    if (const Value* little = sys_info->find("little_endian")) {
        LINVIS_CHECK(little->kind == Value::Kind::Bool && little->boolean, path,
                     ": legacy sys_info says little_endian=", describe(*little),
                     "; only little-endian checkpoints are supported");
        contents.byteorder = "little";
    }
    Unpickler objects(bytes, no_storage, path, pos, "legacy object pickle");
    objects.set_legacy(bytes.size() - pos);
    ValuePtr root = objects.run();
    pos = objects.position();
    const ValuePtr keys = next_pickle("legacy storage-key pickle");
    LINVIS_CHECK(keys->kind == Value::Kind::List, path, ": legacy storage keys are ", describe(*keys),
                 ", expected a list of str");
    const auto& storages = objects.legacy_storages();
    std::set<std::string> filled;
    for (const auto& key_value : keys->items) {
        LINVIS_CHECK(key_value->kind == Value::Kind::String, path, ": legacy storage key is ", describe(*key_value),
                     ", expected a str");
        const std::string& key = key_value->text;
        auto it = storages.find(key);
        LINVIS_CHECK(it != storages.end(), path, ": legacy storage key '", key,
                     "' is not referenced by the object pickle");
        LINVIS_CHECK(filled.insert(key).second, path, ": legacy storage '", key, "' is listed twice");
        LINVIS_CHECK(bytes.size() - pos >= 8, path, ": offset ", pos, ": truncated: storage '", key,
                     "' needs an 8-byte element count, only ", bytes.size() - pos, " bytes left");
        uint64_t count = 0;
        for (int i = 0; i < 8; ++i) count |= uint64_t(static_cast<uint8_t>(bytes[pos + i])) << (8 * i);
        pos += 8;
        const torch::Tensor& target = it->second.bytes;
        const uint64_t esize = static_cast<uint64_t>(it->second.element_size);
        LINVIS_CHECK(count <= UINT64_MAX / esize && count * esize == static_cast<uint64_t>(target.numel()), path,
                     ": offset ", pos - 8, ": storage '", key, "' holds ", count, " elements, the object pickle says ",
                     static_cast<uint64_t>(target.numel()) / esize);
        const size_t n = static_cast<size_t>(target.numel());
        LINVIS_CHECK(bytes.size() - pos >= n, path, ": offset ", pos, ": truncated: storage '", key, "' needs ", n,
                     " bytes, only ", bytes.size() - pos, " left");
        if (n > 0) std::memcpy(target.data_ptr<uint8_t>(), bytes.data() + pos, n);
        pos += n;
    }
    for (const auto& [key, storage] : storages)
        LINVIS_CHECK(filled.count(key), path, ": legacy storage '", key,
                     "' is used by a tensor but missing from the storage-key list (no data for it)");
    contents.num_storages = static_cast<int64_t>(storages.size());
    contents.root = std::move(root);
    return contents;
}

}  // namespace

bool pickle_global_allowed(const std::string& module, const std::string& name) {
    static const std::set<std::string> exact = {
        // tensors and parameters (torch.save's reduce functions)
        "torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
        "torch._tensor._rebuild_from_type", "torch._tensor._rebuild_from_type_v2", "torch.Tensor",
        "torch.nn.parameter.Parameter", "torch.Size", "torch.device", "torch.torch_version.TorchVersion",
        // TorchScript's pickler (torch::pickle_save)
        "torch.jit._pickle.restore_type_tag", "torch.jit._pickle.build_intlist", "torch.jit._pickle.build_doublelist",
        "torch.jit._pickle.build_boollist", "torch.jit._pickle.build_tensorlist",
        "torch.jit._pickle.build_genericlist",
        // containers and plain values
        "collections.OrderedDict", "builtins.dict", "builtins.list", "builtins.tuple", "builtins.set",
        "builtins.frozenset", "builtins.bytes", "builtins.bytearray", "builtins.int", "builtins.float",
        "builtins.complex", "builtins.str", "builtins.bool", "builtins.slice", "builtins.object",
        "__builtin__.dict", "__builtin__.list", "__builtin__.tuple", "__builtin__.set", "__builtin__.frozenset",
        "__builtin__.bytes", "__builtin__.bytearray", "__builtin__.int", "__builtin__.long", "__builtin__.float",
        "__builtin__.complex", "__builtin__.str", "__builtin__.unicode", "__builtin__.bool", "__builtin__.slice",
        "__builtin__.object", "_codecs.encode", "copyreg._reconstructor", "copy_reg._reconstructor",
        // training configs stored next to the weights
        "argparse.Namespace", "yacs.config.CfgNode", "pathlib.PosixPath", "pathlib.PurePosixPath",
        "pathlib.WindowsPath", "pathlib.PureWindowsPath",
        // numpy scalars and arrays (best accuracy, schedules)
        "numpy.dtype", "numpy.ndarray", "numpy.core.multiarray.scalar", "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray.scalar", "numpy._core.multiarray._reconstruct",
    };
    const std::string full = module + "." + name;
    if (exact.count(full)) return true;
    if (module == "torch" || module == "torch.cuda") return storage_class_dtype(full).has_value() ||
                                                            (module == "torch" && dtype_global(full).has_value());
    return false;
}

CheckpointContents read_torch_checkpoint(const std::string& path) {
    {
        std::ifstream in(path, std::ios::binary);
        LINVIS_CHECK(in.good(), path, ": cannot open file");
        char magic[4] = {0, 0, 0, 0};
        in.read(magic, 4);
        const std::streamsize got = in.gcount();
        LINVIS_CHECK(got > 0, path, ": file is empty");
        if (!(got == 4 && std::memcmp(magic, "PK\x03\x04", 4) == 0)) {
            in.clear();
            in.seekg(0, std::ios::end);
            const std::streamoff size = in.tellg();
            LINVIS_CHECK(size >= 0, path, ": cannot determine the file size");
            std::string bytes(static_cast<size_t>(size), '\0');
            in.seekg(0);
            in.read(bytes.data(), size);
            LINVIS_CHECK(in.gcount() == size, path, ": read ", in.gcount(), " of ", size, " bytes");
            return read_legacy_checkpoint(path, bytes);
        }
        in.clear();
        in.seekg(0, std::ios::end);
        const auto size = static_cast<uint64_t>(in.tellg());
        // A record cannot inflate to more than 1032 times its compressed bytes (deflate's limit),
        // and torch.save stores its records uncompressed.
        std::string record;
        const uint64_t largest = largest_zip_record(path, in, size, &record);
        LINVIS_CHECK(largest <= size * 1032 + 65536, path, ": zip record '", record, "' declares ", largest,
                     " bytes, impossible in a file of ", size, " bytes");
    }
    CheckpointContents contents;
    contents.path = path;
    std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
    try {
        reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
    } catch (const std::exception& e) {
        fail(path, ": cannot read the zip archive: ", c10_message(e));
    }
    auto read_record = [&](const std::string& name) -> std::tuple<at::DataPtr, size_t> {
        try {
            return reader->getRecord(name);
        } catch (const std::exception& e) {
            fail(path, ": cannot read record '", name, "': ", c10_message(e));
        }
    };
    try {
        contents.records = reader->getAllRecords();
        contents.format_version = static_cast<int64_t>(reader->version());
    } catch (const std::exception& e) {
        fail(path, ": cannot list the zip archive: ", c10_message(e));
    }
    // Some LibTorch versions list records with the archive folder ("archive/data.pkl"): strip it.
    for (const auto& name : contents.records) {
        const size_t at = name.rfind("/data.pkl");
        if (at != std::string::npos && at + 9 == name.size() && name.find('/') == at) {
            const std::string prefix = name.substr(0, at + 1);
            for (auto& record : contents.records)
                if (record.rfind(prefix, 0) == 0) record = record.substr(prefix.size());
            break;
        }
    }
    auto has = [&](const std::string& name) {
        try {
            return reader->hasRecord(name);
        } catch (const std::exception& e) {
            fail(path, ": cannot look up record '", name, "': ", c10_message(e));
        }
    };
    if (has("byteorder")) {
        auto [ptr, size] = read_record("byteorder");
        contents.byteorder.assign(static_cast<const char*>(ptr.get()), size);
        LINVIS_CHECK(contents.byteorder == "little", path, ": byteorder record says '", contents.byteorder,
                     "'; only little-endian checkpoints are supported");
    }
    LINVIS_CHECK(has("data.pkl"), path, ": no data.pkl record in the archive (", contents.records.size(),
                 " records); not a torch.save checkpoint");
    std::string pickle;
    {
        auto [ptr, size] = read_record("data.pkl");
        pickle.assign(static_cast<const char*>(ptr.get()), size);
    }
    auto load_storage = [&](const std::string& key) -> torch::Tensor {
        const std::string name = "data/" + key;
        LINVIS_CHECK(has(name), path, ": missing storage record '", name, "' referenced by data.pkl");
        auto [ptr, size] = read_record(name);
        ++contents.num_storages;
        if (size == 0) return torch::empty({0}, torch::kUInt8);
        auto holder = std::make_shared<at::DataPtr>(std::move(ptr));
        return torch::from_blob(
            holder->get(), {static_cast<int64_t>(size)}, [holder](void*) mutable { holder.reset(); },
            torch::TensorOptions().dtype(torch::kUInt8));
    };
    contents.root = unpickle(pickle, load_storage, path);
    return contents;
}

// ------------------------------------------------------------------ state dict extraction

std::map<std::string, torch::Tensor> extract_state_dict(const CheckpointContents& contents, bool prefer_ema,
                                                        std::string* chosen_key, StateDictReport* report) {
    const std::string& path = contents.path;
    LINVIS_CHECK(contents.root, path, ": checkpoint has no contents");
    const Value& root = *contents.root;
    LINVIS_CHECK(root.is_dict_like(), path, ": top level is ", describe(root), ", expected a dict");

    auto count_tensors = [](const Value& d) {
        int64_t n = 0;
        for (const auto& e : d.entries) n += e.second->kind == Value::Kind::Tensor;
        return n;
    };
    auto top_keys = [&]() {
        std::string s;
        for (const auto& e : root.entries)
            s += str_cat(s.empty() ? "" : ", ", e.first->kind == Value::Kind::String ? e.first->text : describe(*e.first),
                         " (", describe(*e.second), ")");
        return s;
    };

    StateDictReport local;
    StateDictReport& rep = report ? *report : local;
    rep = StateDictReport();
    const Value* chosen = nullptr;
    std::string key;
    const bool top_is_state_dict =
        !root.entries.empty() && count_tensors(root) == static_cast<int64_t>(root.entries.size());
    if (top_is_state_dict) {
        LINVIS_CHECK(!prefer_ema, path, ": EMA weights requested but the file is a plain state dict (",
                     root.entries.size(), " tensors)");
        chosen = &root;
    } else {
        const std::vector<std::string> candidates =
            prefer_ema ? std::vector<std::string>{"model_ema", "state_dict_ema", "ema"}
                       : std::vector<std::string>{"model", "state_dict", "model_state", "model_state_dict", "module"};
        for (const auto& c : candidates) {
            const Value* v = root.find(c);
            if (v && v->is_dict_like() && count_tensors(*v) > 0) {
                chosen = v;
                key = c;
                break;
            }
        }
        if (!chosen) {
            std::string wanted;
            for (const auto& c : candidates) wanted += str_cat(wanted.empty() ? "" : ", ", "'", c, "'");
            fail(path, ": no ", prefer_ema ? "EMA " : "", "state dict found: expected a dict of tensors under ",
                 wanted, "; top-level keys: ", top_keys());
        }
        for (const auto& [k, v] : root.entries) {
            const std::string name = k->kind == Value::Kind::String ? k->text : describe(*k);
            if (name != key) rep.dropped.push_back(str_cat(name, ": ", describe(*v)));
        }
    }

    std::map<std::string, torch::Tensor> out;
    std::map<std::string, std::string> origin;
    for (const auto& [k, v] : chosen->entries) {
        LINVIS_CHECK(k->kind == Value::Kind::String, path, ": state dict", key.empty() ? "" : " '" + key + "'",
                     " has a non-string key ", describe(*k));
        if (v->kind != Value::Kind::Tensor) {
            rep.non_tensors.push_back(str_cat(k->text, ": ", describe(*v)));
            continue;
        }
        std::string name = k->text;
        if (name.rfind("module.", 0) == 0) {
            name = name.substr(7);
            ++rep.prefix_stripped;
        }
        auto prev = origin.find(name);
        LINVIS_CHECK(prev == origin.end(), path, ": keys '", prev == origin.end() ? "" : prev->second, "' and '",
                     k->text, "' both become '", name, "' after removing the 'module.' prefix");
        origin[name] = k->text;
        out[name] = v->tensor;
    }
    rep.chosen_key = key;
    rep.kept = static_cast<int64_t>(out.size());
    if (chosen_key) *chosen_key = key;
    return out;
}

}  // namespace linvis::io
