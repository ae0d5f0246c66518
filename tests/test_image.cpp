// Image decoding/encoding (linvis/io/image.h) and evaluation transforms (linvis/io/transforms.h).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "linvis/core/error.h"
#include "linvis/io/image.h"
#include "linvis/io/transforms.h"
#include "support/temp_dir.h"
#include "support/testing.h"

namespace fs = std::filesystem;
using linvis::Error;
using namespace linvis::io;

using linvis::testing::TempDir;
using linvis::testing::expect_error_containing;
using linvis::testing::write_bytes;

namespace {

const fs::path kImageDir = fs::path(LINVIS_TEST_DATA_DIR) / "images";

std::vector<uint8_t> file_bytes(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    EXPECT_TRUE(in.good()) << path;
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Offset of the first marker segment `marker` (FF xx) after SOI, walking the segment lengths.
size_t find_segment(const std::vector<uint8_t>& jpeg, uint8_t marker) {
    size_t pos = 2;
    while (pos + 4 <= jpeg.size() && jpeg[pos] == 0xff && jpeg[pos + 1] != marker)
        pos += 2 + ((size_t(jpeg[pos + 2]) << 8) | jpeg[pos + 3]);
    EXPECT_TRUE(pos + 4 <= jpeg.size() && jpeg[pos + 1] == marker) << "no marker FF " << std::hex << int(marker);
    return pos;
}

// A smooth colour image (JPEG-friendly), uint8 (h, w, 3).
torch::Tensor smooth_image(int64_t h, int64_t w) {
    auto y = torch::arange(h, torch::kFloat32).view({h, 1, 1}) / float(h - 1);
    auto x = torch::arange(w, torch::kFloat32).view({1, w, 1}) / float(w - 1);
    auto c = torch::tensor({0.2f, 0.5f, 0.8f}).view({1, 1, 3});
    auto img = 40 + 170 * (0.5 * x + 0.3 * y + 0.2 * c);
    return img.round().to(torch::kUInt8);
}

// The antialiased (PIL-style) separable filter, written out independently in double:
// output i samples the input around centre (i + 0.5) * scale with the kernel widened by
// max(scale, 1), truncated at the borders and renormalised.
double keys_cubic(double x) {
    const double a = -0.5;
    x = std::abs(x);
    if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
    if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
    return 0;
}

std::vector<std::vector<std::pair<int64_t, double>>> aa_weights(int64_t in, int64_t out) {
    const double scale = double(in) / double(out);
    const double widen = std::max(scale, 1.0);
    const double support = 2.0 * widen;
    std::vector<std::vector<std::pair<int64_t, double>>> rows(out);
    for (int64_t i = 0; i < out; ++i) {
        const double center = (i + 0.5) * scale;
        const int64_t lo = std::max<int64_t>(int64_t(center - support + 0.5), 0);
        const int64_t hi = std::min<int64_t>(int64_t(center + support + 0.5), in);
        double total = 0;
        for (int64_t j = lo; j < hi; ++j) {
            const double w = keys_cubic((j - center + 0.5) / widen);
            rows[i].push_back({j, w});
            total += w;
        }
        for (auto& entry : rows[i]) entry.second /= total;
    }
    return rows;
}

// (H, W) double -> (out_h, out_w), width pass then height pass.
torch::Tensor reference_bicubic_aa(const torch::Tensor& plane, int64_t out_h, int64_t out_w) {
    const int64_t h = plane.size(0), w = plane.size(1);
    auto src = plane.to(torch::kFloat64).contiguous();
    auto a = src.accessor<double, 2>();
    auto tmp = torch::zeros({h, out_w}, torch::kFloat64);
    auto t = tmp.accessor<double, 2>();
    const auto wx = aa_weights(w, out_w);
    for (int64_t y = 0; y < h; ++y)
        for (int64_t i = 0; i < out_w; ++i)
            for (auto [j, wt] : wx[i]) t[y][i] += wt * a[y][j];
    auto out = torch::zeros({out_h, out_w}, torch::kFloat64);
    auto o = out.accessor<double, 2>();
    const auto wy = aa_weights(h, out_h);
    for (int64_t i = 0; i < out_h; ++i)
        for (auto [j, wt] : wy[i])
            for (int64_t x = 0; x < out_w; ++x) o[i][x] += wt * t[j][x];
    return out;
}

}  // namespace

// ------------------------------------------------------------------ decoding / encoding

TEST(Image, PngAndBmpRoundTripExactly) {
    TempDir dir;
    const auto image = demo_image(37, 53);
    for (const char* name : {"a.png", "a.bmp"}) {
        write_image(dir.file(name), image);
        const auto decoded = read_image(dir.file(name));
        EXPECT_EQ(decoded.sizes(), (std::vector<int64_t>{37, 53, 3})) << name;
        EXPECT_EQ(decoded.scalar_type(), torch::kUInt8);
        EXPECT_TRUE(torch::equal(decoded, image)) << name;
    }
    // The memory path gives the same pixels.
    EXPECT_TRUE(torch::equal(decode_image(encode_image(image, ImageFormat::Png)), image));
}

TEST(Image, JpegDecodesWithinCompressionTolerance) {
    TempDir dir;
    const auto image = smooth_image(48, 64);
    write_image(dir.file("a.jpg"), image, 95);
    const auto decoded = read_image(dir.file("a.jpg"));
    ASSERT_EQ(decoded.sizes(), image.sizes());
    const auto diff = (decoded.to(torch::kInt32) - image.to(torch::kInt32)).abs();
    EXPECT_LT(diff.to(torch::kFloat32).mean().item<float>(), 1.5f);
    EXPECT_LE(diff.max().item<int>(), 8);
    // A low quality differs more: the decoder really decodes what was written.
    const auto rough = decode_image(encode_image(image, ImageFormat::Jpeg, 5));
    EXPECT_GT((rough.to(torch::kInt32) - image.to(torch::kInt32)).abs().sum().item<int64_t>(),
              diff.sum().item<int64_t>());
}

TEST(Image, GrayscaleAndAlphaBecomeRgb) {
    const auto rgb = demo_image(20, 30);
    const auto gray = rgb.select(2, 1).contiguous();  // (H, W)
    for (auto format : {ImageFormat::Png, ImageFormat::Bmp}) {
        const auto decoded = decode_image(encode_image(gray, format));
        ASSERT_EQ(decoded.sizes(), (std::vector<int64_t>{20, 30, 3})) << image_format_name(format);
        for (int c = 0; c < 3; ++c) EXPECT_TRUE(torch::equal(decoded.select(2, c), gray)) << image_format_name(format);
    }
    // RGBA and gray+alpha: alpha is dropped, colour kept (PIL convert("RGB")).
    const auto alpha = torch::full({20, 30, 1}, 7, torch::kUInt8);
    const auto rgba = torch::cat({rgb, alpha}, 2);
    EXPECT_TRUE(torch::equal(decode_image(encode_image(rgba, ImageFormat::Png)), rgb));
    const auto gray_alpha = torch::cat({gray.unsqueeze(2), alpha}, 2);
    EXPECT_TRUE(torch::equal(decode_image(encode_image(gray_alpha, ImageFormat::Png)),
                             gray.unsqueeze(2).expand({20, 30, 3})));
}

TEST(Image, MissingEmptyAndDirectoryNameTheFile) {
    TempDir dir;
    expect_error_containing([&] { read_image(dir.file("nope.png")); }, {dir.file("nope.png"), "no such file"});
    write_bytes(dir.file("empty.jpg"), {});
    expect_error_containing([&] { read_image(dir.file("empty.jpg")); }, {dir.file("empty.jpg"), "empty"});
    fs::create_directories(dir.file("sub.png"));
    expect_error_containing([&] { read_image(dir.file("sub.png")); }, {dir.file("sub.png"), "directory"});
    write_bytes(dir.file("text.png"), {'h', 'e', 'l', 'l', 'o'});
    expect_error_containing([&] { read_image(dir.file("text.png")); },
                            {dir.file("text.png"), "not a JPEG, PNG or BMP", "68 65 6c 6c"});
}

TEST(Image, TruncatedFilesAreRejected) {
    TempDir dir;
    const auto image = demo_image(40, 40);
    for (auto format : {ImageFormat::Png, ImageFormat::Jpeg, ImageFormat::Bmp}) {
        auto bytes = encode_image(image, format);
        const std::string name = dir.file(std::string("cut.") + image_format_name(format));
        // Cut at several points, from inside the header to just before the end.
        for (double fraction : {0.05, 0.5, 0.9}) {
            const auto cut = std::vector<uint8_t>(bytes.begin(), bytes.begin() + std::ptrdiff_t(bytes.size() * fraction));
            write_bytes(name, cut);
            expect_error_containing([&] { read_image(name); }, {name});
        }
        write_bytes(name, std::vector<uint8_t>(bytes.begin(), bytes.end() - 1));
        expect_error_containing([&] { read_image(name); }, {name, "truncated"});
    }
}

TEST(Image, CorruptFilesAreRejectedWithReason) {
    TempDir dir;
    const auto image = demo_image(40, 40);
    // A flipped byte inside PNG data: the chunk CRC no longer matches.
    auto png = encode_image(image, ImageFormat::Png);
    png[png.size() / 2] ^= 0x5a;
    write_bytes(dir.file("bad.png"), png);
    expect_error_containing([&] { read_image(dir.file("bad.png")); }, {dir.file("bad.png"), "CRC mismatch"});
    // A JPEG with a whole container but no frame: libjpeg's own reason is reported.
    const std::vector<uint8_t> no_frame = {0xff, 0xd8, 0xff, 0xd9};
    expect_error_containing([&] { decode_image(no_frame, "frameless.jpg"); }, {"frameless.jpg", "cannot decode JPEG: "});
    // Garbage where a JPEG marker must be.
    auto jpeg = encode_image(image, ImageFormat::Jpeg);
    const size_t second_marker = 4 + ((size_t(jpeg[4]) << 8) | jpeg[5]);  // after SOI and the first segment
    ASSERT_LT(second_marker, jpeg.size());
    ASSERT_EQ(jpeg[second_marker], 0xff);
    jpeg[second_marker] = 0x12;
    expect_error_containing([&] { decode_image(jpeg, "garbled.jpg"); }, {"garbled.jpg", "corrupt JPEG"});
}

// tests/data/images/make_images.py wrote each JPEG with Pillow and saved Pillow's decoding of it
// (Image.open(f).convert("RGB")) losslessly beside it: baseline 4:2:0, progressive 4:4:4, 4:2:2 with
// restart markers, grayscale, and Adobe CMYK (stored inverted). All on 27x41 pixels (partial MCUs).
TEST(Image, JpegPixelsAreThoseOfPillow) {
    int files = 0;
    for (const auto& entry : fs::directory_iterator(kImageDir)) {
        if (entry.path().extension() != ".jpg") continue;
        ++files;
        const auto decoded = read_image(entry.path().string());
        const auto pillow = read_image(fs::path(entry.path()).replace_extension(".pillow.png").string());
        ASSERT_EQ(decoded.sizes(), (std::vector<int64_t>{27, 41, 3})) << entry.path();
        EXPECT_TRUE(torch::equal(decoded, pillow))
            << entry.path() << ": largest difference "
            << (decoded.to(torch::kInt32) - pillow.to(torch::kInt32)).abs().max().item<int>();
    }
    EXPECT_EQ(files, 5);
}

// Huffman tables that cannot be: Debian's stb_image overran its tables or aborted the process on
// such files (a fuzz finding); they must be a linvis::Error naming the file.
TEST(Image, MalformedJpegHuffmanTablesAreErrors) {
    const auto jpeg = file_bytes(kImageDir / "rgb_q75_420.jpg");
    const size_t dht = find_segment(jpeg, 0xc4);
    const size_t counts = dht + 5;  // FF C4, length (2), class/id (1), then 16 code counts
    // More than 256 codes in one table.
    auto too_many = jpeg;
    too_many[counts + 14] = 255;
    too_many[counts + 15] = 255;
    expect_error_containing([&] { decode_image(too_many, "too_many.jpg"); },
                            {"too_many.jpg", "cannot decode JPEG", "Huffman"});
    // Three codes of one bit (the counts still sum to the table's length, so the segment is whole).
    auto overfull = jpeg;
    int moved = 3;
    overfull[counts] = 3;
    for (size_t i = 1; i < 16 && moved > 0; ++i) {
        const int take = std::min<int>(moved, overfull[counts + i]);
        overfull[counts + i] = uint8_t(overfull[counts + i] - take);
        moved -= take;
    }
    ASSERT_EQ(moved, 0);
    expect_error_containing([&] { decode_image(overfull, "overfull.jpg"); },
                            {"overfull.jpg", "cannot decode JPEG", "Huffman"});
}

// The pixel limit is the caller's: a few kB can announce a huge image that decodes validly. Here an
// arithmetic-coded JPEG (SOF9) whose scan holds a 41x27 image's Huffman data announces 2100x2100 pixels:
// libjpeg-turbo's arithmetic decoder reads missing data as zeros (as T.81 lets encoders drop trailing zeros).
TEST(Image, PixelLimitIsCheckedBeforeDecoding) {
    auto jpeg = file_bytes(kImageDir / "rgb_q75_420.jpg");
    const size_t sof = find_segment(jpeg, 0xc0);
    jpeg[sof + 1] = 0xc9;
    for (const size_t field : {sof + 5, sof + 7}) {  // height, width
        jpeg[field] = uint8_t(2100 >> 8);
        jpeg[field + 1] = uint8_t(2100 & 0xff);
    }
    const int64_t limit = int64_t(1) << 22;  // 2048 x 2048
    EXPECT_EQ(decode_image(jpeg, "big.jpg").sizes(), torch::IntArrayRef({2100, 2100, 3}));
    expect_error_containing([&] { decode_image(jpeg, "big.jpg", limit); },
                            {"big.jpg", "JPEG image of 2100x2100 pixels", "limit of 4194304 pixels"});
    const auto png = encode_image(smooth_image(48, 64), ImageFormat::Png);
    EXPECT_EQ(decode_image(png, "small.png", 64 * 48).sizes(), torch::IntArrayRef({48, 64, 3}));
    expect_error_containing([&] { decode_image(png, "small.png", 64 * 48 - 1); },
                            {"small.png", "PNG image of 64x48 pixels", "limit of 3071 pixels"});
    for (const int64_t bad : {int64_t(0), kMaxImagePixels + 1})
        expect_error_containing([&] { decode_image(png, "small.png", bad); },
                                {"small.png", "pixel limit must be 1..268435456, got " + std::to_string(bad)});
}

// A scan whose data stops early but whose file still ends with EOI would decode to a picture with a
// grey remainder: an error, like a truncated file.
TEST(Image, JpegScanEndingEarlyIsAnError) {
    const auto jpeg = file_bytes(kImageDir / "rgb_q75_420.jpg");
    const size_t sos = find_segment(jpeg, 0xda);
    const size_t scan_data = sos + 2 + ((size_t(jpeg[sos + 2]) << 8) | jpeg[sos + 3]);
    std::vector<uint8_t> short_scan(jpeg.begin(), jpeg.begin() + std::ptrdiff_t(scan_data + 40));
    if (short_scan.back() == 0xff) short_scan.pop_back();  // keep the marker walk's view simple
    short_scan.push_back(0xff);
    short_scan.push_back(0xd9);
    expect_error_containing([&] { decode_image(short_scan, "short_scan.jpg"); },
                            {"short_scan.jpg", "cannot decode JPEG", "premature end of data segment"});
}

// Progressive files with thousands of scans (each a pass over the image) are refused early.
TEST(Image, JpegWithTooManyScansIsAnError) {
    const auto jpeg = file_bytes(kImageDir / "rgb_q90_444_progressive.jpg");
    // The first scan (DC, first pass) repeated: each copy is well formed and decodes from its own bytes.
    const size_t sos = find_segment(jpeg, 0xda);
    size_t end = sos + 2 + ((size_t(jpeg[sos + 2]) << 8) | jpeg[sos + 3]);
    while (!(jpeg[end] == 0xff && jpeg[end + 1] != 0x00 && (jpeg[end + 1] < 0xd0 || jpeg[end + 1] > 0xd7))) ++end;
    const std::vector<uint8_t> scan(jpeg.begin() + std::ptrdiff_t(sos), jpeg.begin() + std::ptrdiff_t(end));
    std::vector<uint8_t> many(jpeg.begin(), jpeg.begin() + std::ptrdiff_t(end));
    for (int i = 0; i < 1000; ++i) many.insert(many.end(), scan.begin(), scan.end());
    many.insert(many.end(), jpeg.begin() + std::ptrdiff_t(end), jpeg.end());
    expect_error_containing([&] { decode_image(many, "many_scans.jpg"); },
                            {"many_scans.jpg", "cannot decode JPEG", "more than 1000 scans"});
    // The same file with a few repeats is still decoded (libjpeg warns about the progression; ignored).
    std::vector<uint8_t> few(jpeg.begin(), jpeg.begin() + std::ptrdiff_t(end));
    for (int i = 0; i < 3; ++i) few.insert(few.end(), scan.begin(), scan.end());
    few.insert(few.end(), jpeg.begin() + std::ptrdiff_t(end), jpeg.end());
    EXPECT_EQ(decode_image(few, "few_scans.jpg").sizes(), (std::vector<int64_t>{27, 41, 3}));
}

TEST(Image, EncodeRejectsBadInputs) {
    EXPECT_THROW(encode_image(torch::zeros({4, 4, 3}), ImageFormat::Png), Error);                 // float
    EXPECT_THROW(encode_image(torch::zeros({4, 4, 5}, torch::kUInt8), ImageFormat::Png), Error);  // 5 channels
    EXPECT_THROW(encode_image(torch::zeros({4, 4, 4}, torch::kUInt8), ImageFormat::Jpeg), Error); // RGBA JPEG
    TempDir dir;
    expect_error_containing([&] { write_image(dir.file("x.gif"), demo_image(8, 8)); }, {"x.gif", "extension"});
    expect_error_containing([&] { write_png(dir.file("missing_dir/x.png"), demo_image(8, 8)); },
                            {"missing_dir/x.png", "cannot open"});
}

TEST(Image, WritePngOfFloatHeatMap) {
    TempDir dir;
    const auto heat = torch::linspace(0, 1, 12).view({1, 3, 4}).expand({3, 3, 4});  // (C, H, W)
    const auto pixels = to_uint8_image(heat);
    ASSERT_EQ(pixels.sizes(), (std::vector<int64_t>{3, 4, 3}));
    EXPECT_EQ(pixels[0][0][0].item<int>(), 0);
    EXPECT_EQ(pixels[2][3][1].item<int>(), 255);
    EXPECT_EQ(pixels[0][1][2].item<int>(), 23);  // 255 / 11 = 23.18
    write_png(dir.file("heat.png"), pixels);
    EXPECT_TRUE(torch::equal(read_image(dir.file("heat.png")), pixels));
}

TEST(Image, DemoImageIsDeterministicAndStructured) {
    const auto a = demo_image(), b = demo_image();
    ASSERT_EQ(a.sizes(), (std::vector<int64_t>{256, 320, 3}));
    EXPECT_TRUE(torch::equal(a, b));
    // Features at positions given by the construction: checker cell (0, 0) light,
    // the next cell dark, the disc's centre blue, the bottom-right corner from the gradient.
    EXPECT_EQ(a[0][0][0].item<int>(), 235);
    EXPECT_EQ(a[0][16][0].item<int>(), 25);
    EXPECT_EQ(a[192][80][2].item<int>(), 200);
    EXPECT_EQ(a[255][319][0].item<int>(), 255);
    EXPECT_EQ(a[255][319][1].item<int>(), 255);
    EXPECT_GT(a.to(torch::kFloat32).std().item<float>(), 40.0f);
    EXPECT_THROW(demo_image(4, 4), Error);
}

// ------------------------------------------------------------------ transforms

TEST(Transforms, ShorterSideSizeFollowsTorchvision) {
    EXPECT_EQ(shorter_side_size(480, 640, 256), (std::pair<int64_t, int64_t>{256, 341}));  // 341.33
    EXPECT_EQ(shorter_side_size(640, 480, 256), (std::pair<int64_t, int64_t>{341, 256}));
    EXPECT_EQ(shorter_side_size(375, 500, 256), (std::pair<int64_t, int64_t>{256, 341}));
    EXPECT_EQ(shorter_side_size(100, 100, 256), (std::pair<int64_t, int64_t>{256, 256}));
    EXPECT_EQ(shorter_side_size(300, 599, 256), (std::pair<int64_t, int64_t>{256, 511}));  // 511.15
    EXPECT_THROW(shorter_side_size(0, 5, 256), Error);
}

TEST(Transforms, CenterCropOffsetsRoundHalfToEven) {
    using P = std::pair<int64_t, int64_t>;
    EXPECT_EQ(center_crop_offsets(256, 256, 224, 224), (P{16, 16}));
    EXPECT_EQ(center_crop_offsets(257, 259, 224, 224), (P{16, 18}));  // 16.5 -> 16, 17.5 -> 18
    EXPECT_EQ(center_crop_offsets(225, 227, 224, 224), (P{0, 2}));    // 0.5 -> 0, 1.5 -> 2
    EXPECT_EQ(center_crop_offsets(5, 6, 2, 2), (P{2, 2}));            // 1.5 -> 2, 2
}

TEST(Transforms, CenterCropTakesTheRightPixelsAndPads) {
    const auto x = torch::arange(2 * 5 * 7, torch::kFloat32).view({2, 5, 7});
    const auto c = center_crop(x, 2, 4);
    // Offsets: top round(1.5) = 2, left round(1.5) = 2.
    EXPECT_TRUE(torch::equal(c, x.narrow(1, 2, 2).narrow(2, 2, 4)));
    // Larger than the image: zero padding floor(d/2) before, ceil(d/2) after.
    const auto p = center_crop(torch::ones({1, 2, 3}), 5, 4);
    ASSERT_EQ(p.sizes(), (std::vector<int64_t>{1, 5, 4}));
    const auto expected = torch::tensor({0.f, 0.f, 0.f, 0.f,  //
                                         1.f, 1.f, 1.f, 0.f,  //
                                         1.f, 1.f, 1.f, 0.f,  //
                                         0.f, 0.f, 0.f, 0.f,  //
                                         0.f, 0.f, 0.f, 0.f})
                              .view({1, 5, 4});
    EXPECT_TRUE(torch::equal(p, expected)) << p;
}

TEST(Transforms, ConstantImageNormalisesToHandValues) {
    // Resizing a constant keeps it constant (weights sum to one), so every output pixel is
    // (v / 255 - mean) / std per channel.
    const auto image = torch::stack({torch::full({300, 400}, 128, torch::kUInt8), torch::full({300, 400}, 0, torch::kUInt8),
                                     torch::full({300, 400}, 255, torch::kUInt8)},
                                    2);
    const EvalTransform transform;
    const auto out = transform(image);
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 224, 224}));
    EXPECT_EQ(out.scalar_type(), torch::kFloat32);
    const double expected[3] = {(128.0 / 255 - 0.485) / 0.229, (0.0 - 0.456) / 0.224, (1.0 - 0.406) / 0.225};
    // By hand: 0.0740645, -2.0357143, 2.64.
    EXPECT_NEAR(expected[0], 0.0740645, 1e-6);
    EXPECT_NEAR(expected[1], -2.0357143, 1e-6);
    EXPECT_NEAR(expected[2], 2.64, 1e-6);
    for (int c = 0; c < 3; ++c) {
        EXPECT_NEAR(out[c].min().item<float>(), expected[c], 2e-6) << c;
        EXPECT_NEAR(out[c].max().item<float>(), expected[c], 2e-6) << c;
    }
}

TEST(Transforms, EvalTransformParameters) {
    EvalTransform t;
    EXPECT_EQ(t.effective_resize_size(), 256);  // floor(224 / 0.875)
    t.crop_size = 384;
    t.crop_pct = 1.0;
    EXPECT_EQ(t.effective_resize_size(), 384);
    t.crop_pct = 0.875;
    EXPECT_EQ(t.effective_resize_size(), 438);  // floor(438.86)
    t.resize_size = 400;
    EXPECT_EQ(t.effective_resize_size(), 400);

    EvalTransform small;
    small.crop_size = 32;
    small.resize_size = 40;
    small.kernel = ResizeKernel::Torch;
    const auto out = small(demo_image(50, 90));  // -> 40 x 72 -> crop 32 x 32 at (4, 20)
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 32, 32}));
    // Same result built from the parts.
    auto chw = resize(demo_image(50, 90).permute({2, 0, 1}), 40, 72);
    const auto manual = normalize(chw.narrow(1, 4, 32).narrow(2, 20, 32).to(torch::kFloat32).div(255.0),
                                  {0.485, 0.456, 0.406}, {0.229, 0.224, 0.225});
    EXPECT_TRUE(torch::equal(out, manual));

    EvalTransform bad;
    bad.crop_pct = 1.5;
    EXPECT_THROW(bad(demo_image(50, 50)), Error);
    bad = EvalTransform{};
    bad.std = {0.2, 0.0, 0.2};
    EXPECT_THROW(bad(demo_image(50, 50)), Error);
    EXPECT_THROW(EvalTransform{}(torch::zeros({10, 10, 3})), Error);  // float input
    EXPECT_EQ(parse_interpolation("bilinear"), Interpolation::Bilinear);
    EXPECT_THROW(parse_interpolation("lanczos"), Error);
}

TEST(Transforms, BicubicAntialiasMatchesIndependentReference) {
    torch::manual_seed(3);
    const auto plane = torch::rand({29, 41}, torch::kFloat64) * 255;
    for (auto [oh, ow] : std::vector<std::pair<int64_t, int64_t>>{{11, 16}, {29, 20}, {50, 70}, {13, 90}}) {
        const auto expected = reference_bicubic_aa(plane, oh, ow);
        const auto got64 = resize(plane.unsqueeze(0), oh, ow).squeeze(0);
        EXPECT_TRUE(linvis::testing::all_close(got64, expected, 0, 1e-9)) << oh << "x" << ow;
        const auto got32 = resize(plane.to(torch::kFloat32).unsqueeze(0), oh, ow).squeeze(0);
        // float32 rounding on a 0..255 scale: measured up to 5.3e-4.
        EXPECT_TRUE(linvis::testing::all_close(got32, expected, 0, 1e-3)) << oh << "x" << ow;
    }
    // Without antialias the kernel is not widened: downscaling gives a different answer.
    const auto plain = resize(plane.unsqueeze(0), 11, 16, Interpolation::Bicubic, false).squeeze(0);
    EXPECT_GT((plain - reference_bicubic_aa(plane, 11, 16)).abs().max().item<double>(), 1.0);
}

TEST(Transforms, BicubicReproducesLinearRamp) {
    // Input pixel j (centre j + 0.5) holds j. Output pixel i of a resize by factor s has its
    // centre at (i + 0.5) * s, so an exact linear interpolator gives (i + 0.5) * s - 0.5. The
    // a = -0.5 cubic reproduces linear functions; check away from the truncated borders.
    const int64_t n = 40;
    const auto ramp = torch::arange(n, torch::kFloat64).view({1, 1, n}).expand({1, 3, n}).contiguous();
    for (int64_t out : {20, 80, 10}) {
        const double s = double(n) / double(out);
        const auto got = resize(ramp, 3, out).select(1, 1).squeeze(0);  // middle row
        const int64_t margin = int64_t(std::ceil(2 * std::max(s, 1.0) / s)) + 1;
        for (int64_t i = margin; i < out - margin; ++i)
            EXPECT_NEAR(got[i].item<double>(), (i + 0.5) * s - 0.5, 1e-9) << "out " << out << " i " << i;
    }
}

// Pillow's Image.resize on a 13x17 "L" image with pixel (y, x) = (37x + 91y + 29((xy) mod 7)) mod 256.
// Expected values produced by Pillow 10.4, 11.3 and 12.0 (identical); see docs/data.md.
struct PilGolden {
    const char* name;
    int64_t height, width;
    Interpolation interpolation;
    std::vector<int> pixels;
};

const std::vector<PilGolden>& pil_goldens() {
    static const std::vector<PilGolden> goldens = {
    {"bicubic_down", 6, 8, Interpolation::Bicubic,
     {
        89, 114, 163, 116, 113, 144, 148, 112, 84, 122, 150, 94, 115, 149, 120, 91, 136, 96, 118, 143, 96, 86,
        158, 121, 147, 156, 55, 118, 144, 79, 94, 143, 104, 137, 141, 123, 127, 150, 134, 128, 155, 175, 117,
        134, 174, 148, 108, 115}},
    {"bicubic_mixed", 20, 11, Interpolation::Bicubic,
     {
        4, 58, 129, 196, 116, 19, 95, 160, 207, 30, 55, 57, 124, 91, 183, 143, 92, 108, 127, 212, 78, 134, 120,
        184, 68, 164, 164, 162, 131, 99, 198, 133, 202, 122, 115, 152, 145, 124, 91, 164, 144, 129, 124, 108,
        97, 77, 158, 152, 85, 72, 139, 150, 123, 95, 64, 64, 76, 117, 171, 69, 84, 102, 129, 157, 65, 71, 54,
        126, 101, 168, 115, 66, 147, 109, 181, 66, 122, 103, 128, 75, 181, 182, 89, 140, 93, 223, 119, 134, 174,
        110, 43, 182, 221, 139, 84, 76, 242, 185, 114, 133, 202, 10, 65, 86, 160, 8, 30, 83, 134, 99, 116, 242,
        46, 11, 40, 170, 63, 20, 20, 113, 133, 136, 205, 143, 37, 106, 166, 222, 56, 74, 138, 194, 146, 104,
        185, 66, 144, 103, 171, 136, 78, 156, 104, 130, 91, 187, 98, 142, 91, 135, 179, 87, 143, 95, 87, 194,
        154, 127, 102, 150, 167, 164, 114, 97, 212, 76, 132, 119, 144, 153, 94, 122, 144, 165, 100, 146, 109,
        74, 128, 134, 182, 67, 102, 144, 161, 134, 81, 189, 97, 206, 90, 135, 134, 155, 175, 65, 191, 99, 168,
        185, 200, 97, 96, 190, 203, 160, 76, 112, 127, 132, 253, 177, 114, 74, 221, 230, 140, 107, 34, 148}},
    {"bilinear", 7, 30, Interpolation::Bilinear,
     {
        56, 67, 85, 114, 139, 108, 94, 114, 140, 171, 192, 206, 121, 64, 81, 105, 136, 122, 91, 109, 132, 163,
        188, 206, 154, 70, 78, 97, 129, 148, 109, 100, 85, 92, 106, 143, 153, 105, 122, 190, 155, 95, 105, 108,
        93, 92, 102, 133, 170, 125, 101, 169, 180, 118, 105, 114, 102, 91, 102, 108, 116, 99, 73, 102, 137, 125,
        103, 62, 100, 204, 198, 165, 139, 112, 85, 91, 130, 132, 120, 79, 67, 171, 213, 180, 151, 124, 97, 80,
        119, 144, 95, 131, 188, 200, 198, 127, 67, 30, 35, 74, 86, 91, 95, 114, 171, 164, 93, 77, 82, 46, 24,
        63, 87, 92, 96, 101, 154, 192, 121, 77, 155, 133, 96, 121, 155, 161, 164, 165, 127, 60, 76, 111, 138,
        148, 112, 112, 148, 162, 167, 167, 154, 87, 66, 102, 132, 159, 128, 102, 138, 160, 130, 111, 81, 116,
        156, 121, 116, 173, 161, 96, 120, 165, 147, 125, 94, 102, 149, 136, 101, 155, 187, 122, 107, 154, 156,
        138, 108, 89, 136, 165, 146, 156, 173, 166, 159, 186, 196, 171, 139, 105, 89, 79, 119, 153, 170, 173,
        162, 179, 206, 183, 155, 120, 96, 85, 108, 148, 104, 69, 126, 162}},
    {"nearest", 5, 40, Interpolation::Nearest,
     {
        91, 91, 157, 157, 157, 223, 223, 33, 33, 99, 99, 99, 165, 165, 231, 231, 94, 94, 94, 160, 160, 226, 226,
        226, 36, 36, 102, 102, 168, 168, 168, 234, 234, 97, 97, 163, 163, 163, 229, 229, 17, 17, 141, 141, 141,
        9, 9, 186, 186, 54, 54, 54, 231, 231, 99, 99, 20, 20, 20, 144, 144, 12, 12, 12, 189, 189, 57, 57, 234,
        234, 234, 102, 102, 23, 23, 147, 147, 147, 15, 15, 34, 34, 245, 245, 245, 253, 253, 5, 5, 13, 13, 13,
        21, 21, 29, 29, 37, 37, 37, 248, 248, 0, 0, 0, 8, 8, 16, 16, 24, 24, 24, 32, 32, 40, 40, 251, 251, 251,
        3, 3, 51, 51, 146, 146, 146, 241, 241, 80, 80, 228, 228, 228, 67, 67, 162, 162, 54, 54, 54, 149, 149,
        244, 244, 244, 83, 83, 231, 231, 70, 70, 70, 165, 165, 57, 57, 152, 152, 152, 247, 247, 233, 233, 130,
        130, 130, 80, 80, 233, 233, 183, 183, 183, 80, 80, 30, 30, 236, 236, 236, 133, 133, 83, 83, 83, 236,
        236, 186, 186, 83, 83, 83, 33, 33, 239, 239, 136, 136, 136, 86, 86}},
    };
    return goldens;
}

TEST(Transforms, PilResizeMatchesPillowBitForBit) {
    auto source = torch::empty({13, 17, 1}, torch::kUInt8);
    for (int y = 0; y < 13; ++y)
        for (int x = 0; x < 17; ++x) source[y][x][0] = (x * 37 + y * 91 + (x * y) % 7 * 29) % 256;
    for (const auto& golden : pil_goldens()) {
        const auto got = resize_pil(source, golden.height, golden.width, golden.interpolation);
        ASSERT_EQ(got.sizes(), (std::vector<int64_t>{golden.height, golden.width, 1})) << golden.name;
        const auto expected = torch::tensor(golden.pixels, torch::kInt32).view({golden.height, golden.width, 1});
        EXPECT_TRUE(torch::equal(got.to(torch::kInt32), expected)) << golden.name << "\n" << got.squeeze(2);
    }
    // Channels are independent: three copies give three identical planes.
    const auto rgb = resize_pil(source.expand({13, 17, 3}), 6, 8);
    for (int c = 0; c < 3; ++c) EXPECT_TRUE(torch::equal(rgb.select(2, c), resize_pil(source, 6, 8).select(2, 0)));
    EXPECT_THROW(resize_pil(source.to(torch::kFloat32), 6, 8), Error);
}

TEST(Transforms, PilAndTorchKernelsAgreeClosely) {
    // Same filter, different arithmetic: PIL's fixed point and uint8 intermediate against float.
    const auto image = demo_image(120, 160);
    const auto pil = resize_pil(image, 96, 128);
    const auto torch_kernel = resize(image.permute({2, 0, 1}), 96, 128).permute({1, 2, 0});
    const auto diff = (pil.to(torch::kInt32) - torch_kernel.to(torch::kInt32)).abs();
    EXPECT_LE(diff.max().item<int>(), 3);
    EXPECT_LT(diff.to(torch::kFloat32).mean().item<float>(), 0.1f);
    // EvalTransform: the Pil kernel (default) is resize_pil + crop + ToTensor + Normalize.
    EvalTransform t;
    t.crop_size = 64;
    t.resize_size = 80;
    const auto out = t(image);  // 120x160 -> 80x106 -> crop at (8, 21)
    const auto manual = normalize(resize_pil(image, 80, 106).permute({2, 0, 1}).narrow(1, 8, 64).narrow(2, 21, 64)
                                      .to(torch::kFloat32).div(255.0),
                                  t.mean, t.std);
    EXPECT_TRUE(torch::equal(out, manual));
    t.kernel = ResizeKernel::Torch;
    EXPECT_FALSE(torch::equal(t(image), out));
    EXPECT_LT((t(image) - out).abs().max().item<float>(), 3.5f / 255.0f / 0.224f);
}

TEST(Transforms, Uint8ResizeRoundsAndClampsLikeTorchvision) {
    // Black and white halves: bicubic overshoots at the step on both sides.
    auto image = demo_image(33, 47).permute({2, 0, 1}).contiguous();
    image.narrow(2, 0, 20).fill_(0);
    image.narrow(2, 20, 10).fill_(255);
    const auto as_u8 = resize(image, 20, 29);
    ASSERT_EQ(as_u8.scalar_type(), torch::kUInt8);
    const auto as_float = resize(image.to(torch::kFloat32), 20, 29);
    EXPECT_TRUE(torch::equal(as_u8, as_float.clamp(0, 255).round().to(torch::kUInt8)));
    // Sharp edges overshoot: the float result leaves [0, 255], the uint8 one is clamped.
    EXPECT_TRUE(as_float.max().item<float>() > 255.0f || as_float.min().item<float>() < 0.0f);
    // bfloat16 is computed in float32 and rounded to bfloat16.
    const auto bf = resize(image.to(torch::kBFloat16), 20, 29);
    EXPECT_EQ(bf.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(linvis::testing::all_close(bf.to(torch::kFloat32), as_float, 1e-2, 1e-2));
    // Same size: unchanged.
    EXPECT_TRUE(torch::equal(resize(image, 33, 47), image));
}

TEST(Transforms, LoadImageBatchStacksAndNamesBadFiles) {
    TempDir dir;
    write_image(dir.file("a.png"), demo_image(60, 80));
    write_image(dir.file("b.bmp"), demo_image(90, 50));
    EvalTransform t;
    t.crop_size = 48;
    const auto batch = load_image_batch({dir.file("a.png"), dir.file("b.bmp")}, t);
    ASSERT_EQ(batch.sizes(), (std::vector<int64_t>{2, 3, 48, 48}));
    EXPECT_TRUE(torch::equal(batch[1], t(read_image(dir.file("b.bmp")))));
    expect_error_containing([&] { load_image_batch({dir.file("a.png"), dir.file("c.png")}, t); }, {dir.file("c.png")});
}
