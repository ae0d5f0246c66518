// safetensors reader/writer: byte-exact layout, round trips of every dtype, and one test per
// malformed-file case (generated here and kept as golden files in tests/data/safetensors/).
//
// Regenerate the golden files after changing a case: LINVIS_WRITE_GOLDEN=1 build/tests/test_safetensors
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/io/safetensors.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using linvis::Error;
using namespace linvis::io;

using linvis::testing::write_file;

using linvis::testing::TempDir;

namespace {

const fs::path kGoldenDir = fs::path(LINVIS_TEST_DATA_DIR) / "safetensors";

bool write_golden() { return std::getenv("LINVIS_WRITE_GOLDEN") != nullptr; }

std::string le64(uint64_t v) {
    std::string out;
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return out;
}

// A file whose header is `json` verbatim (no padding added) followed by `data_bytes` bytes 0, 1, 2, ...
std::string file_with(const std::string& json, size_t data_bytes) {
    std::string out = le64(json.size()) + json;
    for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<char>(i & 0xff));
    return out;
}

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t begin,
                  uint64_t end) {
    return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
           std::to_string(begin) + "," + std::to_string(end) + "]}";
}

std::string read_bytes(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream out;
    out << in.rdbuf();
    return out.str();
}



// Same dtype, shape and bytes (NaN payloads and -0.0 included).
::testing::AssertionResult same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
    if (a.scalar_type() != b.scalar_type())
        return ::testing::AssertionFailure() << "dtype " << a.scalar_type() << " vs " << b.scalar_type();
    if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << "shape " << a.sizes() << " vs " << b.sizes();
    auto ca = a.contiguous(), cb = b.contiguous();
    const size_t n = static_cast<size_t>(ca.numel()) * ca.element_size();
    if (n > 0 && std::memcmp(ca.data_ptr(), cb.data_ptr(), n) != 0) return ::testing::AssertionFailure() << "bytes differ";
    return ::testing::AssertionSuccess();
}

std::string expect_error(const std::function<void()>& body) {
    try {
        body();
    } catch (const Error& e) {
        return e.what();
    }
    ADD_FAILURE() << "no linvis::Error thrown";
    return "";
}

// --------------------------------------------------------------- golden valid files

struct GoodCase {
    std::string name;
    std::function<std::string()> bytes;
};

std::map<std::string, torch::Tensor> all_dtype_tensors() {
    std::map<std::string, torch::Tensor> t;
    t["f64"] = torch::tensor({1.5, -2.25, 1e300, -0.0}, torch::kFloat64);
    t["f32"] = torch::arange(6, torch::kFloat32).reshape({2, 3}) * 0.5f - 1.0f;
    t["f16"] = torch::tensor({0.5, -65504.0, 1e-4}, torch::kFloat64).to(torch::kHalf);
    t["bf16"] = torch::tensor({3.0, -1e30, 0.125}, torch::kFloat64).to(torch::kBFloat16);
    t["i64"] = torch::tensor({std::numeric_limits<int64_t>::min(), int64_t{0}, std::numeric_limits<int64_t>::max()},
                             torch::kInt64);
    t["i32"] = torch::tensor({std::numeric_limits<int32_t>::min(), 7, std::numeric_limits<int32_t>::max()}, torch::kInt32);
    t["i16"] = torch::tensor({-32768, 12, 32767}, torch::kInt16);
    t["i8"] = torch::tensor({-128, 0, 127}, torch::kInt8);
    t["u8"] = torch::tensor({0, 128, 255}, torch::kUInt8);
    t["bool"] = torch::tensor({true, false, true});
    t["scalar"] = torch::tensor(42.0f);
    t["zero_size"] = torch::zeros({3, 0, 2}, torch::kFloat32);
    return t;
}

std::vector<GoodCase> good_cases() {
    return {
        {"tiny_f32", [] { return serialize_safetensors({{"attn.0", torch::arange(6, torch::kFloat32).reshape({1, 2, 3})}}); }},
        {"padded_f32", [] { return serialize_safetensors({{"attn0", torch::arange(6, torch::kFloat32).reshape({1, 1, 2, 3})}}); }},
        {"empty", [] { return serialize_safetensors({}); }},
        {"metadata_only", [] { return serialize_safetensors({}, {{"format", "pt"}}); }},
        {"all_dtypes", [] { return serialize_safetensors(all_dtype_tensors(), {{"format", "pt"}, {"source", "linvis tests"}}); }},
        // A hand-written file another writer could produce: name order, whitespace around the object.
        {"foreign_order", [] {
             return file_with(" \n{" + entry("a", "F32", "[1]", 4, 8) + "," + entry("b", "I16", "[2]", 0, 4) + "}\t  ", 8);
         }},
    };
}

// --------------------------------------------------------------- malformed files

struct BadCase {
    std::string name;
    std::string description;
    std::string bytes;
    std::string expected;  // substring of the error message
};

std::vector<BadCase> bad_cases() {
    const std::string w1 = entry("w", "F32", "[1]", 0, 4);
    std::string deep = "{\"w\":";
    for (int i = 0; i < 40; ++i) deep += "[";
    for (int i = 0; i < 40; ++i) deep += "]";
    deep += "}";
    std::string alias = "{";
    for (int i = 0; i < 10; ++i) alias += (i ? "," : "") + entry("t" + std::to_string(i), "F32", "[4]", 0, 16);
    alias += "}";
    std::string truncated = file_with("{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 8, 16) + "}", 16);
    truncated.resize(truncated.size() - 3);

    return {
        {"empty_file", "0 bytes", "", "file is 0 bytes, shorter than the 8-byte header length field"},
        {"too_short", "5 bytes, no complete length field", "\x01\x02\x03\x04\x05", "file is 5 bytes"},
        {"header_too_large", "N = 100000001 (> 100 MB limit)", le64(100000001) + "{}      ", "exceeds the limit of 100000000 bytes"},
        {"header_length_u64_max", "N = 2^64-1", le64(~uint64_t{0}) + "{}      ", "exceeds the limit"},
        {"header_beyond_file", "N = 64 but only 8 header bytes follow", le64(64) + "{}      ", "reaches beyond the end of the file"},
        {"header_zero_length", "N = 0", le64(0), "does not start with '{'"},
        {"header_not_object_start", "header is a JSON array", file_with("[1,2]   ", 0), "does not start with '{'"},
        {"header_bom", "UTF-8 byte order mark before the object", file_with("\xEF\xBB\xBF{}  ", 0), "does not start with '{'"},
        {"invalid_json", "header JSON cut off", file_with("{\"w\":{\"dtype\":\"F32\",", 0), "header is not valid JSON"},
        {"header_not_utf8", "tensor name with byte 0xff", file_with("{" + entry("\xff", "F32", "[1]", 0, 4) + "}", 4), "header is not valid JSON"},
        {"header_trailing_garbage", "non-whitespace after the object", file_with("{} x", 0), "header is not valid JSON"},
        {"deep_nesting", "40 nested arrays", file_with(deep, 0), "deeper than 32 levels"},
        {"entry_not_object", "tensor entry is a number", file_with("{\"w\":5}", 0), "tensor 'w': header entry is an integer, expected an object"},
        {"duplicate_tensor", "tensor name appears twice", file_with("{" + w1 + "," + w1 + "}", 4), "duplicate key 'w' in the header"},
        {"duplicate_field", "field dtype appears twice in one entry",
         file_with("{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4),
         "duplicate key 'dtype' inside header entry 'w'"},
        {"duplicate_metadata_key", "metadata key appears twice", file_with("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0),
         "duplicate key 'k' inside header entry '__metadata__'"},
        {"unknown_dtype", "dtype F17", file_with("{" + entry("w", "F17", "[1]", 0, 4) + "}", 4), "tensor 'w': unknown dtype 'F17'"},
        {"dtype_lowercase", "dtype f32 (names are case-sensitive)", file_with("{" + entry("w", "f32", "[1]", 0, 4) + "}", 4), "unknown dtype 'f32'"},
        {"dtype_not_string", "dtype is a number", file_with("{\"w\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,4]}}", 4), "dtype is an integer"},
        {"missing_shape", "entry without shape", file_with("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4), "missing field 'shape'"},
        {"missing_data_offsets", "entry without data_offsets", file_with("{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 0), "missing field 'data_offsets'"},
        {"extra_field", "entry with an extra field", file_with("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"offset\":0}}", 4), "unexpected field 'offset'"},
        {"shape_not_array", "shape is a number", file_with("{\"w\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}}", 16), "shape is an integer, expected an array"},
        {"shape_negative", "shape [-1]", file_with("{" + entry("w", "F32", "[-1]", 0, 0) + "}", 0), "shape entry 0 is negative (-1)"},
        {"shape_float", "shape [2.0]", file_with("{" + entry("w", "F32", "[2.0]", 0, 8) + "}", 8), "shape entry 0 is not an integer (2.0)"},
        {"shape_string", "shape [\"2\"]", file_with("{" + entry("w", "F32", "[\"2\"]", 0, 8) + "}", 8), "shape entry 0 is a string"},
        {"shape_overflow", "shape [2^32, 2^32]: element count overflows", file_with("{" + entry("w", "F32", "[4294967296,4294967296]", 0, 4) + "}", 4), "overflows 64-bit arithmetic"},
        {"shape_bytes_overflow", "shape [2^62] of F32: byte count overflows", file_with("{" + entry("w", "F32", "[4611686018427387904]", 0, 4) + "}", 4), "overflows 64-bit arithmetic"},
        {"shape_overflow_reference", "shape [2, 2^64-2] (the reference's overflow vector)", file_with("{" + entry("w", "F32", "[2,18446744073709551614]", 0, 4) + "}", 4), "overflows 64-bit arithmetic"},
        {"shape_dim_too_large", "shape [0, 2^63]: zero-size but a dimension beyond int64", file_with("{" + entry("w", "F32", "[0,9223372036854775808]", 0, 0) + "}", 0), "shape entry 1 (9223372036854775808) is too large"},
        {"subbyte_misaligned", "3 F4 values = 12 bits", file_with("{" + entry("w", "F4", "[3]", 0, 1) + "}", 1), "not a whole number of bytes"},
        {"size_mismatch", "shape [2,3] F32 needs 24 bytes, offsets span 20", file_with("{" + entry("w", "F32", "[2,3]", 0, 20) + "}", 20), "needs 24 bytes but data_offsets [0, 20] span 20 bytes"},
        {"offsets_not_pair", "data_offsets [0]", file_with("{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0]}}", 0), "data_offsets is an array of 1 values"},
        {"offsets_negative", "data_offsets [-4, 0]", file_with("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4), "data_offsets BEGIN is negative (-4)"},
        {"offsets_float", "data_offsets [0, 4.5]", file_with("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.5]}}", 4), "data_offsets END is not an integer"},
        {"offsets_begin_after_end", "data_offsets [8, 4]", file_with("{" + entry("w", "F32", "[0]", 8, 4) + "}", 8), "data_offsets [8, 4] have BEGIN after END"},
        {"offsets_out_of_range", "data_offsets [0, 8] but 4 data bytes", file_with("{" + entry("w", "F32", "[2]", 0, 8) + "}", 4), "data_offsets [0, 8] reach beyond the data buffer (4 bytes)"},
        {"offsets_gap", "4 unused bytes between two tensors", file_with("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "F32", "[1]", 8, 12) + "}", 12), "gap in the data buffer: bytes [4, 8) before tensor 'b'"},
        {"offsets_not_from_zero", "first tensor starts at 4", file_with("{" + entry("a", "F32", "[1]", 4, 8) + "}", 8), "gap in the data buffer: bytes [0, 4) before tensor 'a'"},
        {"offsets_overlap", "two tensors share bytes [4, 8)", file_with("{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 4, 12) + "}", 12), "tensor 'b': data_offsets [4, 12] overlap tensor 'a'"},
        {"offsets_alias", "ten tensors all at [0, 16] (allocation amplification attack)", file_with(alias, 16), "overlap tensor 't0'"},
        {"trailing_bytes", "4 data bytes after the last tensor", file_with("{" + w1 + "}", 8), "the data buffer has 8 bytes but the tensors cover only the first 4"},
        {"truncated", "valid file with its last 3 bytes cut off", truncated, "reach beyond the data buffer (13 bytes): the file is truncated"},
        {"metadata_value_not_string", "__metadata__ value is a number", file_with("{\"__metadata__\":{\"k\":1}}", 0), "\"__metadata__\" value for key 'k' is an integer, expected a string"},
        {"metadata_value_object", "__metadata__ value is an object", file_with("{\"__metadata__\":{\"k\":{\"a\":\"b\"}}}", 0), "value for key 'k' is an object, expected a string"},
        {"metadata_not_object", "__metadata__ is an array", file_with("{\"__metadata__\":[\"a\"]}", 0), "\"__metadata__\" is an array, expected an object"},
    };
}

fs::path bad_dir() { return kGoldenDir / "bad"; }
fs::path good_dir() { return kGoldenDir / "good"; }

}  // namespace

// ===================================================================== layout

TEST(Safetensors, ByteExactTinyFile) {
    // Hand-computed: the JSON below is 64 bytes (a multiple of 8, so no padding), then six f32.
    const std::string json = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
    ASSERT_EQ(json.size(), 64u);
    std::string expected = std::string("\x40\0\0\0\0\0\0\0", 8) + json;
    const float values[6] = {0, 1, 2, 3, 4, 5};
    expected.append(reinterpret_cast<const char*>(values), sizeof(values));
    // 0.0f, 1.0f = 00 00 80 3f little-endian: checks the data is written little-endian.
    EXPECT_EQ(expected.substr(72 + 4, 4), std::string("\x00\x00\x80\x3f", 4));
    const std::string out = serialize_safetensors({{"attn.0", torch::arange(6, torch::kFloat32).reshape({1, 2, 3})}});
    EXPECT_EQ(out, expected);
}

TEST(Safetensors, ByteExactPaddedHeader) {
    // 65 JSON bytes -> 7 spaces of padding -> N = 72.
    const std::string json = R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
    ASSERT_EQ(json.size(), 65u);
    const std::string out = serialize_safetensors({{"attn0", torch::arange(6, torch::kFloat32).reshape({1, 1, 2, 3})}});
    ASSERT_EQ(out.size(), 8u + 72u + 24u);
    EXPECT_EQ(out.substr(0, 8), std::string("\x48\0\0\0\0\0\0\0", 8));
    EXPECT_EQ(out.substr(8, 72), json + std::string(7, ' '));
}

TEST(Safetensors, ByteExactEmptyAndMetadataOnly) {
    EXPECT_EQ(serialize_safetensors({}), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
    // {"__metadata__":{"format":"pt"}} is 32 bytes: no padding.
    EXPECT_EQ(serialize_safetensors({}, {{"format", "pt"}}),
              std::string("\x20\0\0\0\0\0\0\0", 8) + R"({"__metadata__":{"format":"pt"}})");
}

TEST(Safetensors, HeaderPaddedToMultipleOf8ForEveryNameLength) {
    for (int len = 1; len <= 17; ++len) {
        const std::string name(static_cast<size_t>(len), 'x');
        const std::string out = serialize_safetensors({{name, torch::ones({3}, torch::kInt8)}});
        uint64_t n = 0;
        for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(out[i]);
        EXPECT_EQ(n % 8, 0u) << "name length " << len;
        EXPECT_EQ(out.size(), 8 + n + 3);
        const size_t close = out.rfind('}', 8 + n - 1);
        EXPECT_EQ(out.substr(close + 1, 8 + n - close - 1), std::string(8 + n - close - 1, ' '));
        EXPECT_LT(8 + n - close - 1, 8u);
    }
}

TEST(Safetensors, WriterOrdersByDtypeDescendingThenName) {
    std::map<std::string, torch::Tensor> t = {
        {"b", torch::zeros({1}, torch::kFloat32)}, {"a", torch::zeros({1}, torch::kFloat32)},
        {"flag", torch::zeros({1}, torch::kBool)}, {"idx", torch::zeros({1}, torch::kInt64)},
        {"h", torch::zeros({1}, torch::kBFloat16)}, {"g", torch::zeros({1}, torch::kFloat16)},
        {"d", torch::zeros({1}, torch::kFloat64)}, {"u", torch::zeros({1}, torch::kUInt8)},
        {"s", torch::zeros({1}, torch::kInt16)},   {"i", torch::zeros({1}, torch::kInt32)},
        {"c", torch::zeros({1}, torch::kInt8)},
    };
    const std::string bytes = serialize_safetensors(t);
    const SafetensorsHeader header =
        parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "mem");
    std::vector<std::string> order;
    for (const auto& e : header.tensors) order.push_back(e.name);
    EXPECT_EQ(order, (std::vector<std::string>{"idx", "d", "a", "b", "i", "h", "g", "s", "c", "u", "flag"}));
    // Natural alignment of every tensor relative to the 8-aligned data start.
    EXPECT_EQ(header.data_start % 8, 0u);
    for (const auto& e : header.tensors) EXPECT_EQ(e.begin % (dtype_bits(e.dtype) / 8), 0u) << e.name;
}

// ===================================================================== round trips

TEST(Safetensors, RoundTripEveryDtypeScalarAndZeroSize) {
    TempDir dir;
    const auto path = (dir.path / "all.safetensors").string();
    auto tensors = all_dtype_tensors();
    tensors["nan_inf"] = torch::tensor({NAN, INFINITY, -INFINITY}, torch::kFloat32);
    tensors["random"] = torch::randn({4, 5, 6}, torch::kFloat64);
    tensors["empty_i64"] = torch::empty({0}, torch::kInt64);
    save_safetensors(path, tensors, {{"format", "pt"}});
    const SafetensorsFile file = SafetensorsFile::open(path);
    EXPECT_EQ(file.entries().size(), tensors.size());
    const auto loaded = file.load_all();
    ASSERT_EQ(loaded.size(), tensors.size());
    for (const auto& [name, t] : tensors) {
        ASSERT_TRUE(loaded.count(name)) << name;
        EXPECT_TRUE(same_bytes(loaded.at(name), t)) << name;
    }
    EXPECT_EQ(loaded.at("scalar").dim(), 0);
    EXPECT_EQ(loaded.at("scalar").item<float>(), 42.0f);
    EXPECT_EQ(loaded.at("zero_size").sizes(), (std::vector<int64_t>{3, 0, 2}));
    EXPECT_EQ(loaded.at("i64").data_ptr<int64_t>()[0], std::numeric_limits<int64_t>::min());
    const TensorInfo* scalar = file.header().find("scalar");
    ASSERT_NE(scalar, nullptr);
    EXPECT_TRUE(scalar->shape.empty());
    EXPECT_EQ(scalar->byte_size(), 4u);
}

TEST(Safetensors, MetadataRoundTripWithEscapesAndUnicode) {
    TempDir dir;
    const auto path = (dir.path / "m.safetensors").string();
    const std::map<std::string, std::string> meta = {
        {"format", "pt"}, {"note", "a \"quoted\" \\ value\nwith newline\t"}, {"\xC3\xBCnicode", "\xE2\x9C\x93"}};
    save_safetensors(path, {{"w", torch::ones({2})}}, meta);
    const SafetensorsFile file = SafetensorsFile::open(path);
    EXPECT_TRUE(file.header().has_metadata);
    EXPECT_EQ(file.metadata(), meta);
}

TEST(Safetensors, NonContiguousAndViewsAreWrittenDense) {
    TempDir dir;
    const auto path = (dir.path / "v.safetensors").string();
    auto base = torch::arange(12, torch::kFloat32).reshape({3, 4});
    auto transposed = base.t();
    auto strided = base.index({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)});
    ASSERT_FALSE(transposed.is_contiguous());
    save_safetensors(path, {{"t", transposed}, {"s", strided}});
    const SafetensorsFile file = SafetensorsFile::open(path);
    EXPECT_TRUE(torch::equal(file.tensor("t"), transposed));
    EXPECT_TRUE(torch::equal(file.tensor("s"), strided));
    EXPECT_EQ(file.header().data_length, (12u + 6u) * 4u);
}

TEST(Safetensors, ReaderAcceptsForeignOrderAndWhitespacePaddedHeader) {
    TempDir dir;
    const auto path = (dir.path / "f.safetensors").string();
    // b (I16 x2) at [0,4), a (F32 x1) at [4,8); JSON in name order with whitespace around it.
    write_file(path, file_with(" \n{" + entry("a", "F32", "[1]", 4, 8) + "," + entry("b", "I16", "[2]", 0, 4) + "}\t  ", 8));
    const SafetensorsFile file = SafetensorsFile::open(path);
    ASSERT_EQ(file.entries().size(), 2u);
    EXPECT_EQ(file.entries()[0].name, "b");  // offset order
    const auto b = file.tensor("b");
    EXPECT_EQ(b.scalar_type(), torch::kInt16);
    EXPECT_EQ(b[0].item<int64_t>(), 0x0100);  // bytes 00 01 little-endian
    EXPECT_EQ(b[1].item<int64_t>(), 0x0302);
    EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b"}));
}

TEST(Safetensors, BoolBytesOtherThanOneReadAsTrue) {
    TempDir dir;
    const auto path = (dir.path / "b.safetensors").string();
    const std::string json = R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})";
    const std::string bytes = le64(json.size()) + json + std::string("\x00\x02\x01", 3);
    write_file(path, bytes);
    const auto m = SafetensorsFile::open(path).tensor("m");
    EXPECT_EQ(m.scalar_type(), torch::kBool);
    EXPECT_TRUE(torch::equal(m, torch::tensor({false, true, true})));
}

TEST(Safetensors, MissingKeyAndUnsupportedDtypeNameFileAndKey) {
    TempDir dir;
    const auto path = (dir.path / "u.safetensors").string();
    write_file(path, file_with("{" + entry("u", "U16", "[2]", 0, 4) + "," + entry("w", "F32", "[1]", 4, 8) + "}", 8));
    const SafetensorsFile file = SafetensorsFile::open(path);  // valid safetensors
    EXPECT_EQ(file.entries()[0].dtype, DType::U16);
    std::string msg = expect_error([&] { file.tensor("nope"); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("no tensor named 'nope'"), std::string::npos) << msg;
    msg = expect_error([&] { file.tensor("u"); });
    EXPECT_NE(msg.find(path + ": tensor 'u': dtype U16"), std::string::npos) << msg;
    EXPECT_NO_THROW(file.tensor("w"));
}

TEST(Safetensors, WriterRejectsUnsupportedDtypeAndReservedName) {
    std::string msg = expect_error([] { serialize_safetensors({{"z", torch::zeros({2}, torch::kComplexFloat)}}); });
    EXPECT_NE(msg.find("tensor 'z'"), std::string::npos) << msg;
    msg = expect_error([] { serialize_safetensors({{"__metadata__", torch::zeros({2})}}); });
    EXPECT_NE(msg.find("reserved"), std::string::npos) << msg;
    msg = expect_error([] { serialize_safetensors({{"\xff", torch::zeros({2})}}); });
    EXPECT_NE(msg.find("not valid UTF-8"), std::string::npos) << msg;
}

TEST(Safetensors, AtomicOverwriteKeepsOpenMappingValidAndLeavesNoTempFiles) {
    TempDir dir;
    const auto path = (dir.path / "w.safetensors").string();
    save_safetensors(path, {{"w", torch::full({1000}, 1.0f)}});
    const SafetensorsFile old_file = SafetensorsFile::open(path);
    save_safetensors(path, {{"w", torch::full({10}, 2.0f)}});
    // The old mapping still shows the old, complete file.
    EXPECT_TRUE(torch::equal(old_file.tensor("w"), torch::full({1000}, 1.0f)));
    EXPECT_TRUE(torch::equal(SafetensorsFile::open(path).tensor("w"), torch::full({10}, 2.0f)));
    int files = static_cast<int>(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()));
    EXPECT_EQ(files, 1);
    // A failed write leaves the previous file untouched and no temporary behind.
    EXPECT_THROW(save_safetensors(path, {{"z", torch::zeros({2}, torch::kComplexFloat)}}), Error);
    EXPECT_TRUE(torch::equal(SafetensorsFile::open(path).tensor("w"), torch::full({10}, 2.0f)));
    files = static_cast<int>(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()));
    EXPECT_EQ(files, 1);
}

TEST(Safetensors, ErrorsStayShortForHugeHostileTokens) {
    // An unterminated 100 kB string and a 100 kB tensor name with control bytes.
    const std::string unterminated = file_with("{\"" + std::string(100000, 'a'), 0);
    std::string msg = expect_error([&] {
        parse_safetensors_header(reinterpret_cast<const uint8_t*>(unterminated.data()), unterminated.size(), "f");
    });
    EXPECT_NE(msg.find("f: header is not valid JSON"), std::string::npos) << msg.substr(0, 300);
    EXPECT_LT(msg.size(), 400u);
    const std::string name = std::string(100000, 'n') + "\\u000a";  // JSON escape of a newline
    const std::string bad_dtype = file_with("{" + entry(name, "F99", "[1]", 0, 4) + "}", 4);
    msg = expect_error([&] {
        parse_safetensors_header(reinterpret_cast<const uint8_t*>(bad_dtype.data()), bad_dtype.size(), "f");
    });
    EXPECT_NE(msg.find("unknown dtype 'F99'"), std::string::npos) << msg.substr(0, 300);
    EXPECT_LT(msg.size(), 400u);
    EXPECT_EQ(msg.find('\n'), std::string::npos);
}

TEST(Safetensors, OpenReportsMissingFileAndDirectory) {
    TempDir dir;
    const auto missing = (dir.path / "nope.safetensors").string();
    std::string msg = expect_error([&] { SafetensorsFile::open(missing); });
    EXPECT_NE(msg.find(missing + ": cannot open"), std::string::npos) << msg;
    msg = expect_error([&] { SafetensorsFile::open(dir.path.string()); });
    EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
}

// ===================================================================== golden files

TEST(Safetensors, GoldenGoodFilesMatchWriterAndParse) {
    if (write_golden()) fs::create_directories(good_dir());
    for (const auto& c : good_cases()) {
        const fs::path path = good_dir() / (c.name + ".safetensors");
        if (write_golden()) write_file(path, c.bytes());
        ASSERT_TRUE(fs::exists(path)) << path << " (regenerate with LINVIS_WRITE_GOLDEN=1)";
        EXPECT_EQ(read_bytes(path), c.bytes()) << path;
        EXPECT_NO_THROW(SafetensorsFile::open(path.string()).load_all()) << path;
    }
    const auto loaded = SafetensorsFile::open((good_dir() / "all_dtypes.safetensors").string()).load_all();
    for (const auto& [name, t] : all_dtype_tensors()) EXPECT_TRUE(same_bytes(loaded.at(name), t)) << name;
}

TEST(Safetensors, GoldenBadFilesMatchGeneratorAndReadme) {
    std::string readme =
        "# Malformed safetensors files\n\n"
        "Generated by tests/test_safetensors.cpp (`LINVIS_WRITE_GOLDEN=1 build/tests/test_safetensors`), which\n"
        "also checks that these files still match the generator. Opening each must fail with a linvis::Error\n"
        "whose message starts with the file path and contains the expected text.\n\n"
        "| file | case | expected error text |\n| --- | --- | --- |\n";
    for (const auto& c : bad_cases()) {
        std::string expected = c.expected;
        for (size_t p = 0; (p = expected.find('|', p)) != std::string::npos; p += 2) expected.replace(p, 1, "\\|");
        readme += "| " + c.name + ".safetensors | " + c.description + " | `" + expected + "` |\n";
    }
    if (write_golden()) {
        fs::create_directories(bad_dir());
        for (const auto& c : bad_cases()) write_file(bad_dir() / (c.name + ".safetensors"), c.bytes);
        write_file(bad_dir() / "README.md", readme);
    }
    EXPECT_EQ(read_bytes(bad_dir() / "README.md"), readme);
    size_t files = 0;
    for (const auto& e : fs::directory_iterator(bad_dir())) files += e.path().extension() == ".safetensors";
    EXPECT_EQ(files, bad_cases().size()) << "stale golden files in " << bad_dir();
}

class SafetensorsBadFile : public ::testing::TestWithParam<BadCase> {};

TEST_P(SafetensorsBadFile, RejectedWithErrorNamingFileAndProblem) {
    const BadCase& c = GetParam();
    TempDir dir;
    const std::string generated = (dir.path / (c.name + ".safetensors")).string();
    write_file(generated, c.bytes);
    const std::string golden = (bad_dir() / (c.name + ".safetensors")).string();
    for (const std::string& path : {generated, golden}) {
        const std::string msg = expect_error([&] { SafetensorsFile::open(path); });
        EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << "error does not start with the file path: " << msg;
        EXPECT_NE(msg.find(c.expected), std::string::npos) << "expected '" << c.expected << "' in: " << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << "error is not one line: " << msg;
    }
    EXPECT_EQ(read_bytes(golden), c.bytes) << "golden file out of date (LINVIS_WRITE_GOLDEN=1)";
    // The buffer-level parser the fuzzer calls reports the same problem.
    const std::string msg = expect_error([&] {
        parse_safetensors_header(reinterpret_cast<const uint8_t*>(c.bytes.data()), c.bytes.size(), "buffer");
    });
    EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
}

INSTANTIATE_TEST_SUITE_P(Safetensors, SafetensorsBadFile, ::testing::ValuesIn(bad_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

// ===================================================================== CLI

namespace {
int run_command(const std::string& command, std::string* output) {
    FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
    if (pipe == nullptr) return -1;
    char buffer[4096];
    size_t got = 0;
    while ((got = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output->append(buffer, got);
    const int status = ::pclose(pipe);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
}  // namespace

TEST(Safetensors, InspectCliListsTensorsAndRejectsBadFile) {
    const std::string good = (good_dir() / "all_dtypes.safetensors").string();
    std::string out;
    ASSERT_EQ(run_command(std::string(LINVIS_CLI_PATH) + " inspect " + good, &out), 0) << out;
    EXPECT_NE(out.find("bf16"), std::string::npos) << out;
    EXPECT_NE(out.find("[3, 0, 2]"), std::string::npos) << out;
    EXPECT_NE(out.find("format = pt"), std::string::npos) << out;
    // 4+6+3+3+3+3+3+3+3+3+1+0 elements.
    EXPECT_NE(out.find("parameters  35\n"), std::string::npos) << out;

    out.clear();
    ASSERT_EQ(run_command(std::string(LINVIS_CLI_PATH) + " inspect --format json " + good, &out), 0) << out;
    EXPECT_NE(out.find("\"parameters\": 35"), std::string::npos) << out;
    EXPECT_NE(out.find("\"dtype\": \"BF16\""), std::string::npos) << out;

    const std::string bad = (bad_dir() / "offsets_overlap.safetensors").string();
    out.clear();
    EXPECT_EQ(run_command(std::string(LINVIS_CLI_PATH) + " inspect " + bad, &out), 1) << out;
    EXPECT_NE(out.find(bad), std::string::npos) << out;
    EXPECT_NE(out.find("overlap"), std::string::npos) << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
}
