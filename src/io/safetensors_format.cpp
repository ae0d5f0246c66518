// safetensors header parsing/validation and writer layout; standard library + nlohmann-json
// only (no LibTorch), so that fuzz/fuzz_safetensors.cpp can build this file with clang alone.
#include "linvis/io/safetensors_format.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "linvis/core/error.h"

namespace linvis::io {
namespace {

using json = nlohmann::json;

struct DTypeFact {
    DType dtype;
    const char* name;
    int bits;
};

constexpr DTypeFact kDTypes[] = {
    {DType::BOOL, "BOOL", 8},         {DType::F4, "F4", 4},
    {DType::F6_E2M3, "F6_E2M3", 6},   {DType::F6_E3M2, "F6_E3M2", 6},
    {DType::U8, "U8", 8},             {DType::I8, "I8", 8},
    {DType::F8_E5M2, "F8_E5M2", 8},   {DType::F8_E4M3, "F8_E4M3", 8},
    {DType::F8_E8M0, "F8_E8M0", 8},   {DType::F8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {DType::F8_E5M2FNUZ, "F8_E5M2FNUZ", 8}, {DType::I16, "I16", 16},
    {DType::U16, "U16", 16},          {DType::F16, "F16", 16},
    {DType::BF16, "BF16", 16},        {DType::I32, "I32", 32},
    {DType::U32, "U32", 32},          {DType::F32, "F32", 32},
    {DType::C64, "C64", 64},          {DType::F64, "F64", 64},
    {DType::I64, "I64", 64},          {DType::U64, "U64", 64},
};

const DTypeFact& fact(DType dtype) {
    for (const auto& f : kDTypes) {
        if (f.dtype == dtype) return f;
    }
    fail("internal error: dtype enumerator ", static_cast<int>(dtype), " has no name");
}

// Header strings come from untrusted files: quote them with control and non-ASCII bytes
// escaped and long ones shortened, so an error message stays one readable line.
std::string quote_name(const std::string& text, size_t max_chars = 120) {
    std::string out = "'";
    size_t count = 0;
    for (unsigned char c : text) {
        if (count++ == max_chars) {
            out += str_cat("...' (", text.size(), " bytes)");
            return out;
        }
        if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
            out += static_cast<char>(c);
        } else {
            static const char* hex = "0123456789abcdef";
            out += "\\x";
            out += hex[c >> 4];
            out += hex[c & 15];
        }
    }
    return out + "'";
}

// nlohmann's messages may echo raw header bytes (a whole unterminated string token, up to
// the 100 MB header limit): keep printable ASCII only, and at most `max_chars` of it.
std::string printable(const std::string& text, size_t max_chars = 240) {
    std::string out;
    for (unsigned char c : text) {
        if (out.size() == max_chars) return out + "...";
        out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
    }
    return out;
}

const char* json_kind(const json& value) {
    if (value.is_null()) return "null";
    if (value.is_boolean()) return "a boolean";
    if (value.is_number_float()) return "a non-integer number";
    if (value.is_number()) return "an integer";
    if (value.is_string()) return "a string";
    if (value.is_array()) return "an array";
    if (value.is_object()) return "an object";
    return "an unsupported JSON value";
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// A JSON integer >= 0 that fits uint64 ("-0" counts as 0). Floats (1.0, 1e3) and integers
// beyond 64 bits (which nlohmann stores as floats) are rejected.
bool as_uint64(const json& value, uint64_t* out) {
    if (value.is_number_unsigned()) {
        *out = value.get<uint64_t>();
        return true;
    }
    if (value.is_number_integer() && value.get<int64_t>() == 0) {
        *out = 0;
        return true;
    }
    return false;
}

std::string describe_number_problem(const json& value) {
    if (value.is_number_integer() && !value.is_number_unsigned()) return "is negative (" + value.dump() + ")";
    if (value.is_number_float()) return "is not an integer (" + printable(value.dump()) + ")";
    return std::string("is ") + json_kind(value) + ", expected an integer >= 0";
}

constexpr int kMaxNestingDepth = 32;

struct NestingTooDeep {};

// Parses the header JSON; records the first duplicate key at any nesting level (nlohmann
// itself silently keeps the last value of a duplicated key).
json parse_header_json(const char* begin, const char* end, const std::string& source) {
    struct Frame {
        std::set<std::string> keys;
        std::string name;  // the key this object is the value of ("" for the root)
        std::string last_key;
    };
    std::vector<Frame> frames;
    bool duplicate = false;
    std::string duplicate_key, duplicate_parent;
    bool duplicate_at_root = false;

    json::parser_callback_t callback = [&](int depth, json::parse_event_t event, json& parsed) {
        switch (event) {
            case json::parse_event_t::object_start:
            case json::parse_event_t::array_start:
                if (depth >= kMaxNestingDepth) throw NestingTooDeep{};
                if (event == json::parse_event_t::object_start) {
                    Frame frame;
                    if (!frames.empty()) frame.name = frames.back().last_key;
                    frames.push_back(std::move(frame));
                }
                break;
            case json::parse_event_t::key:
                if (!frames.empty()) {
                    Frame& frame = frames.back();
                    frame.last_key = parsed.get<std::string>();
                    if (!frame.keys.insert(frame.last_key).second && !duplicate) {
                        duplicate = true;
                        duplicate_key = frame.last_key;
                        duplicate_parent = frame.name;
                        duplicate_at_root = frames.size() == 1;
                    }
                }
                break;
            case json::parse_event_t::object_end:
                if (!frames.empty()) frames.pop_back();
                break;
            default:
                break;
        }
        return true;
    };

    json root;
    try {
        root = json::parse(begin, end, callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
    } catch (const NestingTooDeep&) {
        fail(source, ": header nests JSON arrays/objects deeper than ", kMaxNestingDepth,
             " levels (the format needs 3)");
    } catch (const json::exception& e) {
        fail(source, ": header is not valid JSON: ", printable(e.what()));
    }
    if (duplicate) {
        if (duplicate_at_root) {
            fail(source, ": duplicate key ", quote_name(duplicate_key),
                 " in the header (each tensor name may appear only once)");
        }
        fail(source, ": duplicate key ", quote_name(duplicate_key), " inside header entry ", quote_name(duplicate_parent));
    }
    return root;
}

void parse_metadata(const json& value, const std::string& source, SafetensorsHeader* header) {
    if (value.is_null()) return;  // the reference reader treats null as "no metadata"
    LINVIS_CHECK(value.is_object(), source, ": \"__metadata__\" is ", json_kind(value),
                 ", expected an object of string values");
    for (const auto& item : value.items()) {
        LINVIS_CHECK(item.value().is_string(), source, ": \"__metadata__\" value for key ", quote_name(item.key()),
                     " is ", json_kind(item.value()), ", expected a string");
        header->metadata[item.key()] = item.value().get<std::string>();
    }
    header->has_metadata = true;
}

TensorInfo parse_entry(const std::string& name, const json& value, const std::string& source) {
    const std::string where = source + ": tensor " + quote_name(name);
    LINVIS_CHECK(value.is_object(), where, ": header entry is ", json_kind(value),
                 ", expected an object with dtype, shape and data_offsets");
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
        LINVIS_CHECK(value.contains(field), where, ": header entry is missing field '", field, "'");
    }
    for (const auto& item : value.items()) {
        const std::string& key = item.key();
        LINVIS_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", where,
                     ": header entry has unexpected field ", quote_name(key),
                     " (allowed: dtype, shape, data_offsets)");
    }

    TensorInfo info;
    info.name = name;
    const json& dtype = value["dtype"];
    LINVIS_CHECK(dtype.is_string(), where, ": dtype is ", json_kind(dtype), ", expected a string such as \"F32\"");
    LINVIS_CHECK(dtype_from_name(dtype.get<std::string>(), &info.dtype), where, ": unknown dtype ",
                 quote_name(dtype.get<std::string>()));

    const json& shape = value["shape"];
    LINVIS_CHECK(shape.is_array(), where, ": shape is ", json_kind(shape), ", expected an array of integers");
    std::vector<uint64_t> dims;
    for (size_t i = 0; i < shape.size(); ++i) {
        uint64_t dim = 0;
        LINVIS_CHECK(as_uint64(shape[i], &dim), where, ": shape entry ", i, " ", describe_number_problem(shape[i]));
        dims.push_back(dim);
    }

    const json& offsets = value["data_offsets"];
    LINVIS_CHECK(offsets.is_array() && offsets.size() == 2, where, ": data_offsets is ",
                 offsets.is_array() ? str_cat("an array of ", offsets.size(), " values") : json_kind(offsets),
                 ", expected [BEGIN, END]");
    const char* ends[2] = {"BEGIN", "END"};
    uint64_t range[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
        LINVIS_CHECK(as_uint64(offsets[i], &range[i]), where, ": data_offsets ", ends[i], " ",
                     describe_number_problem(offsets[i]));
    }
    info.begin = range[0];
    info.end = range[1];
    LINVIS_CHECK(info.begin <= info.end, where, ": data_offsets [", info.begin, ", ", info.end,
                 "] have BEGIN after END");

    uint64_t numel = 1, bits = 0;
    bool ok = true;
    for (uint64_t dim : dims) ok = ok && checked_mul(numel, dim, &numel);
    ok = ok && checked_mul(numel, static_cast<uint64_t>(dtype_bits(info.dtype)), &bits);
    LINVIS_CHECK(ok, where, ": shape ", shape_string(dims), " x ", dtype_name(info.dtype),
                 " size overflows 64-bit arithmetic");
    for (size_t i = 0; i < dims.size(); ++i) {
        LINVIS_CHECK(dims[i] <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), where,
                     ": shape entry ", i, " (", dims[i], ") is too large (limit 2^63-1)");
        info.shape.push_back(static_cast<int64_t>(dims[i]));
    }
    LINVIS_CHECK(bits % 8 == 0, where, ": shape ", shape_string(dims), " of ", dtype_name(info.dtype), " holds ",
                 bits, " bits, not a whole number of bytes");
    LINVIS_CHECK(bits / 8 == info.end - info.begin, where, ": shape ", shape_string(dims), " of ",
                 dtype_name(info.dtype), " needs ", bits / 8, " bytes but data_offsets [", info.begin, ", ",
                 info.end, "] span ", info.end - info.begin, " bytes");
    return info;
}

void append_le64(std::string* out, uint64_t value) {
    for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

// A JSON string literal; throws on invalid UTF-8 instead of writing a file no reader accepts.
std::string json_string(const std::string& text, const std::string& what) {
    try {
        return json(text).dump();
    } catch (const json::exception&) {
        fail("safetensors writer: ", what, " ", quote_name(text), " is not valid UTF-8");
    }
}

}  // namespace

const char* dtype_name(DType dtype) { return fact(dtype).name; }

int dtype_bits(DType dtype) { return fact(dtype).bits; }

bool dtype_from_name(const std::string& name, DType* dtype) {
    for (const auto& f : kDTypes) {
        if (name == f.name) {
            *dtype = f.dtype;
            return true;
        }
    }
    return false;
}

uint64_t TensorInfo::numel() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
}

const TensorInfo* SafetensorsHeader::find(const std::string& name) const {
    for (const auto& t : tensors) {
        if (t.name == name) return &t;
    }
    return nullptr;
}

SafetensorsHeader parse_safetensors_header(const uint8_t* data, size_t size, const std::string& source) {
    LINVIS_CHECK(size >= 8, source, ": file is ", size,
                 " bytes, shorter than the 8-byte header length field (truncated or not a safetensors file)");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
    LINVIS_CHECK(n <= kMaxHeaderBytes, source, ": header length ", n, " bytes exceeds the limit of ",
                 kMaxHeaderBytes, " bytes");
    LINVIS_CHECK(n <= size - 8, source, ": header length ", n, " bytes reaches beyond the end of the file (",
                 size, " bytes, so at most ", size - 8, " header bytes)");

    SafetensorsHeader header;
    header.header_length = n;
    header.data_start = 8 + n;
    header.data_length = size - header.data_start;

    const char* text = reinterpret_cast<const char*>(data + 8);
    size_t first = 0;
    while (first < n && (text[first] == ' ' || text[first] == '\t' || text[first] == '\n' || text[first] == '\r')) {
        ++first;
    }
    LINVIS_CHECK(first < n && text[first] == '{', source,
                 ": header does not start with '{' (a safetensors header is a JSON object)");
    json root = parse_header_json(text, text + n, source);
    LINVIS_CHECK(root.is_object(), source, ": header is ", json_kind(root), ", expected a JSON object");

    for (const auto& item : root.items()) {
        if (item.key() == "__metadata__") {
            parse_metadata(item.value(), source, &header);
        } else {
            header.tensors.push_back(parse_entry(item.key(), item.value(), source));
        }
    }

    for (const auto& t : header.tensors) {
        LINVIS_CHECK(t.end <= header.data_length, source, ": tensor ", quote_name(t.name), ": data_offsets [", t.begin,
                     ", ", t.end, "] reach beyond the data buffer (", header.data_length,
                     " bytes): the file is truncated or the offsets are wrong");
    }
    // Older writers used other orders: validate the tiling in offset order.
    std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
        return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
    });
    uint64_t covered = 0;
    const TensorInfo* previous = nullptr;
    for (const auto& t : header.tensors) {
        if (t.begin < covered) {
            fail(source, ": tensor ", quote_name(t.name), ": data_offsets [", t.begin, ", ", t.end,
                 "] overlap tensor ", quote_name(previous->name), " [", previous->begin, ", ", previous->end,
                 "] (tensors may not share bytes)");
        }
        LINVIS_CHECK(t.begin == covered, source, ": gap in the data buffer: bytes [", covered, ", ", t.begin,
                     ") before tensor ", quote_name(t.name), " belong to no tensor");
        covered = t.end;
        previous = &t;
    }
    LINVIS_CHECK(covered == header.data_length, source, ": the data buffer has ", header.data_length,
                 " bytes but the tensors cover only the first ", covered,
                 " (trailing bytes belong to no tensor)");
    return header;
}

SafetensorsLayout plan_safetensors_layout(std::vector<TensorInfo> tensors,
                                          const std::map<std::string, std::string>& metadata) {
    std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
        if (a.dtype != b.dtype) return static_cast<int>(a.dtype) > static_cast<int>(b.dtype);
        return a.name < b.name;
    });
    std::set<std::string> names;
    for (const auto& t : tensors) {
        LINVIS_CHECK(names.insert(t.name).second, "safetensors writer: duplicate tensor name ", quote_name(t.name));
    }
    SafetensorsLayout layout;
    std::string body = "{";
    if (!metadata.empty()) {
        body += "\"__metadata__\":{";
        bool first = true;
        for (const auto& [key, value] : metadata) {
            if (!first) body += ",";
            first = false;
            body += json_string(key, "metadata key") + ":" + json_string(value, "metadata value");
        }
        body += "}";
    }
    uint64_t offset = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
        TensorInfo& t = tensors[i];
        LINVIS_CHECK(t.name != "__metadata__", "safetensors writer: '__metadata__' is reserved and cannot name a tensor");
        uint64_t numel = 1, bits = 0;
        bool ok = true;
        for (int64_t d : t.shape) {
            LINVIS_CHECK(d >= 0, "safetensors writer: tensor ", quote_name(t.name), " has a negative dimension in shape ",
                         shape_string(t.shape));
            ok = ok && checked_mul(numel, static_cast<uint64_t>(d), &numel);
        }
        ok = ok && checked_mul(numel, static_cast<uint64_t>(dtype_bits(t.dtype)), &bits);
        LINVIS_CHECK(ok && bits % 8 == 0, "safetensors writer: tensor ", quote_name(t.name), " shape ",
                     shape_string(t.shape), " of ", dtype_name(t.dtype), " is not a whole number of bytes");
        t.begin = offset;
        LINVIS_CHECK(!__builtin_add_overflow(offset, bits / 8, &t.end), "safetensors writer: data size overflows");
        offset = t.end;

        if (body.size() > 1) body += ",";
        body += json_string(t.name, "tensor name") + ":{\"dtype\":\"" + dtype_name(t.dtype) + "\",\"shape\":[";
        for (size_t d = 0; d < t.shape.size(); ++d) {
            if (d) body += ',';
            body += std::to_string(t.shape[d]);
        }
        body += "],\"data_offsets\":[" + std::to_string(t.begin) + "," + std::to_string(t.end) + "]}";
    }
    body += "}";
    body.append((8 - body.size() % 8) % 8, ' ');
    LINVIS_CHECK(body.size() <= kMaxHeaderBytes, "safetensors writer: header of ", body.size(),
                 " bytes exceeds the limit of ", kMaxHeaderBytes, " bytes");
    append_le64(&layout.prefix, body.size());
    layout.prefix += body;
    layout.tensors = std::move(tensors);
    layout.data_length = offset;
    return layout;
}

}  // namespace linvis::io
