// Image decoding/encoding: JPEG decoding through libjpeg-turbo, PNG/BMP decoding and all encoding
// through Debian's libstb (which holds the stb_image and stb_image_write implementations, so neither
// *_IMPLEMENTATION macro is defined here).
#include "linvis/io/image.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <jerror.h>
#include <jpeglib.h>
#include <stb_image.h>
#include <stb_image_write.h>
#include <zlib.h>

#include "linvis/core/error.h"

namespace linvis::io {
namespace {

uint32_t be32(const uint8_t* p) {
    return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}
uint32_t be16(const uint8_t* p) { return (uint32_t(p[0]) << 8) | uint32_t(p[1]); }
uint32_t le32(const uint8_t* p) {
    return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
uint32_t le16(const uint8_t* p) { return uint32_t(p[0]) | (uint32_t(p[1]) << 8); }

const uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

// Walks the chunk list: every chunk must fit, carry a correct CRC, and IEND must come.
void check_png_container(const uint8_t* data, size_t size, const std::string& name) {
    size_t pos = 8;
    while (true) {
        LINVIS_CHECK(pos + 12 <= size, name, ": truncated PNG: the file ends at byte ", size,
                     " before the IEND chunk");
        const uint32_t length = be32(data + pos);
        LINVIS_CHECK(length <= 0x7fffffffu, name, ": corrupt PNG: chunk length ", length, " at byte ", pos);
        const uint8_t* type = data + pos + 4;
        const std::string type_name(reinterpret_cast<const char*>(type), 4);
        LINVIS_CHECK(pos + 12 + size_t(length) <= size, name, ": truncated PNG: chunk '", type_name, "' at byte ",
                     pos, " needs ", length, " data bytes, the file ends at byte ", size);
        const uint32_t stored_crc = be32(data + pos + 8 + length);
        const uint32_t crc = uint32_t(crc32(crc32(0L, Z_NULL, 0), type, 4 + length));
        LINVIS_CHECK(crc == stored_crc, name, ": corrupt PNG: CRC mismatch in chunk '", type_name, "' at byte ", pos);
        if (std::memcmp(type, "IEND", 4) == 0) return;
        pos += 12 + size_t(length);
    }
}

// Walks the marker segments and entropy-coded scans up to EOI. stb_image pads a truncated
// scan with zeros and reports success, so the end marker is the only reliable sign of a whole file.
void check_jpeg_container(const uint8_t* data, size_t size, const std::string& name) {
    size_t pos = 2;  // after SOI
    const auto truncated = [&](const char* where) {
        fail(name, ": truncated JPEG: the file ends at byte ", size, " ", where, " (no end-of-image marker)");
    };
    while (true) {
        if (pos >= size) truncated("between segments");
        LINVIS_CHECK(data[pos] == 0xff, name, ": corrupt JPEG: expected a marker at byte ", pos, ", found 0x",
                     std::hex, int(data[pos]));
        while (pos < size && data[pos] == 0xff) ++pos;  // fill bytes
        if (pos >= size) truncated("inside a marker");
        const uint8_t marker = data[pos++];
        if (marker == 0xd9) return;                                       // EOI
        if (marker == 0x01 || (marker >= 0xd0 && marker <= 0xd7)) continue;  // TEM, RSTn: no length
        if (pos + 2 > size) truncated("inside a segment header");
        const uint32_t length = be16(data + pos);
        LINVIS_CHECK(length >= 2, name, ": corrupt JPEG: segment length ", length, " at byte ", pos);
        if (pos + length > size) truncated("inside a segment");
        pos += length;
        if (marker != 0xda) continue;
        // SOS: entropy-coded data runs until a marker other than stuffing (FF 00) or RSTn.
        while (true) {
            if (pos + 1 >= size) truncated("inside the scan data");
            if (data[pos] != 0xff) {
                ++pos;
                continue;
            }
            const uint8_t next = data[pos + 1];
            if (next == 0x00 || (next >= 0xd0 && next <= 0xd7)) {
                pos += 2;
            } else if (next == 0xff) {
                ++pos;
            } else {
                break;  // a real marker: back to the segment loop
            }
        }
    }
}

// For uncompressed BMPs: the pixel rows announced by the header must all be present,
// since stb_image reads missing bytes as zeros.
void check_bmp_container(const uint8_t* data, size_t size, const std::string& name) {
    LINVIS_CHECK(size >= 26, name, ": truncated BMP: ", size, " bytes, the headers need at least 26");
    const uint64_t pixel_offset = le32(data + 10);
    const uint32_t header_size = le32(data + 14);
    int64_t width = 0, height = 0;
    uint32_t bits = 0, compression = 0;
    if (header_size == 12) {  // OS/2 BITMAPCOREHEADER
        width = le16(data + 18);
        height = le16(data + 20);
        bits = le16(data + 24);
    } else {
        LINVIS_CHECK(size >= 34, name, ": truncated BMP: ", size, " bytes, the info header needs at least 34");
        width = int32_t(le32(data + 18));
        height = int32_t(le32(data + 22));
        bits = le16(data + 28);
        compression = le32(data + 30);
    }
    // stb_image reads every compression value but RLE (1, 2) and embedded JPEG/PNG (4, 5) as raw rows,
    // unknown values included, so the rows must be in the file (a 100-byte file declaring 773x262144 was
    // decoded into 600 MB of zeros: a fuzz finding).
    const bool uncompressed = !(compression == 1 || compression == 2 || compression == 4 || compression == 5);
    if (!uncompressed || width <= 0 || height == 0 || bits == 0) return;  // left to stb_image to judge
    const uint64_t row_bytes = (uint64_t(bits) * uint64_t(width) + 31) / 32 * 4;
    const uint64_t needed = pixel_offset + row_bytes * uint64_t(height < 0 ? -height : height);
    LINVIS_CHECK(needed <= size, name, ": truncated BMP: the header announces ", width, "x",
                 (height < 0 ? -height : height), " pixels at ", bits, " bits, needing ", needed,
                 " bytes, the file has ", size);
}

// ---------------------------------------------------------------- JPEG through libjpeg-turbo
// libjpeg-turbo is what Pillow and torchvision decode with, so with its defaults (accurate integer
// IDCT, smooth chroma upsampling) the pixels are Pillow's, bit for bit (tests/data/images). It also
// rejects malformed Huffman tables, where Debian's stb_image overran its tables or aborted the process
// on an assertion (a fuzz finding).

// The most scans accepted in a progressive JPEG: real files have about 10; each scan is a pass over
// the whole image, so thousands of tiny forged scans would take minutes.
constexpr int kMaxJpegScans = 1000;

// libjpeg reports errors through callbacks; error_exit must not return, so it jumps back into
// the function that called libjpeg. Only plain C data live between the setjmp and the jump.
struct JpegErrorManager {
    jpeg_error_mgr base;
    std::jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void jpeg_raise(j_common_ptr cinfo) {
    auto* error = reinterpret_cast<JpegErrorManager*>(cinfo->err);
    cinfo->err->format_message(cinfo, error->message);
    std::longjmp(error->jump, 1);
}

// Warnings (level -1) that mean the scan data ran out before the image was complete are errors, as
// a truncated file is: the rest of the picture would be grey. Other warnings (extra bytes between
// markers, odd but decodable parameters) are ignored, as Pillow does. Trace messages are dropped.
void jpeg_warning(j_common_ptr cinfo, int level) {
    if (level >= 0) return;
    const int code = cinfo->err->msg_code;
    if (code == JWRN_HIT_MARKER || code == JWRN_JPEG_EOF) jpeg_raise(cinfo);
    ++cinfo->err->num_warnings;
}

void jpeg_progress(j_common_ptr cinfo) {
    if (!cinfo->is_decompressor) return;
    if (reinterpret_cast<j_decompress_ptr>(cinfo)->input_scan_number <= kMaxJpegScans) return;
    auto* error = reinterpret_cast<JpegErrorManager*>(cinfo->err);
    std::snprintf(error->message, sizeof error->message, "more than %d scans", kMaxJpegScans);
    std::longjmp(error->jump, 1);
}

struct JpegDecoder {
    jpeg_decompress_struct cinfo{};
    JpegErrorManager error{};
    jpeg_progress_mgr progress{};
    // jpeg_destroy_decompress accepts a zeroed, never created struct.
    ~JpegDecoder() { jpeg_destroy_decompress(&cinfo); }
};

// Reads the headers and chooses the output colour space: RGB for grayscale, YCbCr and RGB files,
// CMYK for CMYK and YCCK files (converted below). False (message in decoder.error) on errors.
bool read_jpeg_header(JpegDecoder& decoder, const uint8_t* data, size_t size) {
    jpeg_decompress_struct& cinfo = decoder.cinfo;
    cinfo.err = jpeg_std_error(&decoder.error.base);
    decoder.error.base.error_exit = jpeg_raise;
    decoder.error.base.emit_message = jpeg_warning;
    if (setjmp(decoder.error.jump)) return false;
    jpeg_create_decompress(&cinfo);
    decoder.progress.progress_monitor = jpeg_progress;
    cinfo.progress = &decoder.progress;
    jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
    jpeg_read_header(&cinfo, TRUE);
    const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
    cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
    return true;
}

// Before any pixel buffer is allocated: the size announced by the header.
void check_image_size(int64_t width, int64_t height, int64_t max_pixels, ImageFormat format, const std::string& name) {
    LINVIS_CHECK(width > 0 && height > 0 && width * height <= max_pixels, name, ": ", image_format_name(format),
                 " image of ", width, "x", height, " pixels is empty or larger than the limit of ", max_pixels,
                 " pixels");
}

// CMYK to RGB as Pillow's convert("RGB"): R = (255 - K) - (255 - K) * C / 255, rounded as its
// MULDIV255. Files with an Adobe marker store the inks inverted (Photoshop's convention).
void cmyk_row_to_rgb(const uint8_t* in, int64_t pixels, bool inverted, uint8_t* out) {
    for (int64_t i = 0; i < pixels; ++i, in += 4, out += 3) {
        const auto ink = [&](int c) { return inverted ? 255 - int(in[c]) : int(in[c]); };
        const int not_black = 255 - ink(3);
        for (int c = 0; c < 3; ++c) {
            const int product = ink(c) * not_black + 128;
            out[c] = uint8_t(not_black - (((product >> 8) + product) >> 8));
        }
    }
}

// Decodes into `rgb` (output_height rows of output_width * 3 bytes). CMYK files go through
// `cmyk_row` (output_width * 4 bytes, the caller's: nothing with a destructor may live between the
// setjmp and libjpeg's jump), one row at a time, so that no whole CMYK image is held.
bool read_jpeg_pixels(JpegDecoder& decoder, uint8_t* rgb, uint8_t* cmyk_row) {
    jpeg_decompress_struct& cinfo = decoder.cinfo;
    if (setjmp(decoder.error.jump)) return false;
    jpeg_start_decompress(&cinfo);
    const size_t row_bytes = size_t(cinfo.output_width) * 3;
    while (cinfo.output_scanline < cinfo.output_height) {
        uint8_t* out = rgb + size_t(cinfo.output_scanline) * row_bytes;
        JSAMPROW row = cmyk_row != nullptr ? cmyk_row : out;
        jpeg_read_scanlines(&cinfo, &row, 1);
        if (cmyk_row != nullptr) cmyk_row_to_rgb(cmyk_row, cinfo.output_width, cinfo.saw_Adobe_marker, out);
    }
    jpeg_finish_decompress(&cinfo);
    return true;
}

torch::Tensor decode_jpeg(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels) {
    JpegDecoder decoder;
    if (!read_jpeg_header(decoder, data, size))
        fail(name, ": cannot decode JPEG: ", decoder.error.message);
    const jpeg_decompress_struct& cinfo = decoder.cinfo;
    const int64_t width = cinfo.image_width, height = cinfo.image_height;
    check_image_size(width, height, max_pixels, ImageFormat::Jpeg, name);
    auto pixels = torch::empty({height, width, 3}, torch::kUInt8);
    std::vector<uint8_t> cmyk_row(cinfo.out_color_space == JCS_CMYK ? size_t(width) * 4 : 0);
    if (!read_jpeg_pixels(decoder, pixels.data_ptr<uint8_t>(), cmyk_row.empty() ? nullptr : cmyk_row.data()))
        fail(name, ": cannot decode JPEG: ", decoder.error.message);
    return pixels;
}

std::string lower(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    return s;
}

void append_bytes(void* context, void* data, int size) {
    auto* out = static_cast<std::vector<uint8_t>*>(context);
    const auto* bytes = static_cast<const uint8_t*>(data);
    out->insert(out->end(), bytes, bytes + size);
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
    std::FILE* file = std::fopen(path.c_str(), "wb");
    LINVIS_CHECK(file != nullptr, path, ": cannot open for writing: ", std::strerror(errno));
    const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), file);
    const int close_status = std::fclose(file);
    LINVIS_CHECK(written == bytes.size() && close_status == 0, path, ": write failed: ", std::strerror(errno));
}

// Exact floor(sqrt(v)): the float estimate is corrected so the result does not depend on libm.
int64_t isqrt(int64_t v) {
    auto r = int64_t(std::sqrt(double(v)));
    while (r * r > v) --r;
    while ((r + 1) * (r + 1) <= v) ++r;
    return r;
}

}  // namespace

const char* image_format_name(ImageFormat format) {
    switch (format) {
        case ImageFormat::Jpeg: return "JPEG";
        case ImageFormat::Png: return "PNG";
        case ImageFormat::Bmp: return "BMP";
    }
    return "?";
}

ImageFormat sniff_image_format(const uint8_t* data, size_t size, const std::string& name) {
    LINVIS_CHECK(size > 0, name, ": empty file (0 bytes), expected a JPEG, PNG or BMP image");
    if (size >= 3 && data[0] == 0xff && data[1] == 0xd8 && data[2] == 0xff) return ImageFormat::Jpeg;
    if (size >= 8 && std::memcmp(data, kPngSignature, 8) == 0) return ImageFormat::Png;
    if (size >= 2 && data[0] == 'B' && data[1] == 'M') return ImageFormat::Bmp;
    std::string first;
    for (size_t i = 0; i < std::min<size_t>(size, 4); ++i) {
        char hex[4];
        std::snprintf(hex, sizeof hex, "%02x", data[i]);
        if (i) first += ' ';
        first += hex;
    }
    fail(name, ": not a JPEG, PNG or BMP file (first bytes ", first, ")");
}

void check_pixel_limit(int64_t max_pixels, const std::string& name) {
    LINVIS_CHECK(max_pixels >= 1 && max_pixels <= kMaxImagePixels, name, ": the pixel limit must be 1..",
                 kMaxImagePixels, ", got ", max_pixels);
}

torch::Tensor decode_image(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels) {
    check_pixel_limit(max_pixels, name);
    const ImageFormat format = sniff_image_format(data, size, name);
    switch (format) {
        case ImageFormat::Png: check_png_container(data, size, name); break;
        case ImageFormat::Jpeg: check_jpeg_container(data, size, name); break;
        case ImageFormat::Bmp: check_bmp_container(data, size, name); break;
    }
    if (format == ImageFormat::Jpeg) return decode_jpeg(data, size, name, max_pixels);
    LINVIS_CHECK(size <= size_t(INT_MAX), name, ": ", size, " bytes is larger than the decoder accepts (2 GiB)");
    const int length = int(size);
    int width = 0, height = 0, channels = 0;
    if (!stbi_info_from_memory(data, length, &width, &height, &channels))
        fail(name, ": cannot decode ", image_format_name(format), ": ", stbi_failure_reason());
    check_image_size(width, height, max_pixels, format, name);
    uint8_t* pixels = stbi_load_from_memory(data, length, &width, &height, &channels, 3);
    if (pixels == nullptr) fail(name, ": cannot decode ", image_format_name(format), ": ", stbi_failure_reason());
    return torch::from_blob(
        pixels, {height, width, 3}, [](void* p) { stbi_image_free(p); }, torch::TensorOptions().dtype(torch::kUInt8));
}

torch::Tensor decode_image(const std::vector<uint8_t>& bytes, const std::string& name, int64_t max_pixels) {
    return decode_image(bytes.data(), bytes.size(), name, max_pixels);
}

torch::Tensor read_image(const std::string& path, int64_t max_pixels) {
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    LINVIS_CHECK(std::filesystem::exists(status), path, ": no such file");
    LINVIS_CHECK(!std::filesystem::is_directory(status), path, ": is a directory, expected an image file");
    std::FILE* file = std::fopen(path.c_str(), "rb");
    LINVIS_CHECK(file != nullptr, path, ": cannot open: ", std::strerror(errno));
    std::vector<uint8_t> bytes;
    uint8_t buffer[1 << 16];
    size_t got = 0;
    while ((got = std::fread(buffer, 1, sizeof buffer, file)) > 0) bytes.insert(bytes.end(), buffer, buffer + got);
    const bool read_error = std::ferror(file) != 0;
    const int saved_errno = errno;
    std::fclose(file);
    LINVIS_CHECK(!read_error, path, ": read failed: ", std::strerror(saved_errno));
    return decode_image(bytes, path, max_pixels);
}

std::vector<uint8_t> encode_image(const torch::Tensor& image, ImageFormat format, int jpeg_quality) {
    LINVIS_CHECK(image.scalar_type() == torch::kUInt8, "encode_image: expected a uint8 image, got ",
                 image.scalar_type(), " (use to_uint8_image for float images)");
    LINVIS_CHECK(image.dim() == 2 || image.dim() == 3, "encode_image: expected shape (H, W) or (H, W, C), got ",
                 shape_string(image.sizes()));
    const int64_t height = image.size(0), width = image.size(1);
    const int64_t channels = image.dim() == 3 ? image.size(2) : 1;
    LINVIS_CHECK(channels >= 1 && channels <= 4, "encode_image: expected 1 to 4 channels, got shape ",
                 shape_string(image.sizes()));
    LINVIS_CHECK(format == ImageFormat::Png || channels == 1 || channels == 3, "encode_image: ",
                 image_format_name(format), " takes 1 or 3 channels, got ", channels);
    LINVIS_CHECK(height > 0 && width > 0 && height < (1 << 16) && width < (1 << 16),
                 "encode_image: image size must be 1..65535 on each side, got ", shape_string(image.sizes()));
    LINVIS_CHECK(jpeg_quality >= 1 && jpeg_quality <= 100, "encode_image: JPEG quality must be 1..100, got ",
                 jpeg_quality);
    const torch::Tensor pixels = image.to(torch::kCPU).contiguous();
    const int w = int(width), h = int(height), c = int(channels);
    std::vector<uint8_t> out;
    int ok = 0;
    switch (format) {
        case ImageFormat::Png:
            ok = stbi_write_png_to_func(append_bytes, &out, w, h, c, pixels.data_ptr<uint8_t>(), w * c);
            break;
        case ImageFormat::Bmp: ok = stbi_write_bmp_to_func(append_bytes, &out, w, h, c, pixels.data_ptr<uint8_t>()); break;
        case ImageFormat::Jpeg:
            ok = stbi_write_jpg_to_func(append_bytes, &out, w, h, c, pixels.data_ptr<uint8_t>(), jpeg_quality);
            break;
    }
    LINVIS_CHECK(ok != 0 && !out.empty(), "encode_image: stb_image_write failed to encode ", image_format_name(format));
    return out;
}

void write_image(const std::string& path, const torch::Tensor& image, int jpeg_quality) {
    const std::string extension = lower(std::filesystem::path(path).extension().string());
    ImageFormat format;
    if (extension == ".png")
        format = ImageFormat::Png;
    else if (extension == ".bmp")
        format = ImageFormat::Bmp;
    else if (extension == ".jpg" || extension == ".jpeg")
        format = ImageFormat::Jpeg;
    else
        fail(path, ": unknown image extension '", extension, "', expected .png, .bmp, .jpg or .jpeg");
    write_file(path, encode_image(image, format, jpeg_quality));
}

void write_png(const std::string& path, const torch::Tensor& image) {
    write_file(path, encode_image(image, ImageFormat::Png));
}

torch::Tensor to_uint8_image(const torch::Tensor& image) {
    LINVIS_CHECK(image.is_floating_point(), "to_uint8_image: expected a float image, got ", image.scalar_type());
    LINVIS_CHECK(image.dim() == 2 || (image.dim() == 3 && image.size(0) >= 1 && image.size(0) <= 4),
                 "to_uint8_image: expected shape (H, W) or (C, H, W) with C = 1..4, got ", shape_string(image.sizes()));
    const torch::Tensor hwc = image.dim() == 3 ? image.permute({1, 2, 0}) : image;
    return (hwc.to(torch::kFloat32) * 255.0f).round().clamp(0, 255).to(torch::kUInt8).contiguous();
}

torch::Tensor demo_image(int64_t height, int64_t width) {
    LINVIS_CHECK(height >= 8 && width >= 8 && height <= 8192 && width <= 8192,
                 "demo_image: size must be 8..8192 on each side, got ", height, "x", width);
    torch::Tensor image = torch::empty({height, width, 3}, torch::kUInt8);
    uint8_t* out = image.data_ptr<uint8_t>();
    const int64_t ring_x = width * 7 / 10, ring_y = height * 6 / 10;
    const int64_t ring_width = std::max<int64_t>(2, std::min(height, width) / 32);
    const int64_t cell = std::max<int64_t>(2, std::min(height, width) / 16);
    const int64_t disc_x = width / 4, disc_y = height * 3 / 4, disc_r = std::min(height, width) / 8;
    for (int64_t y = 0; y < height; ++y) {
        for (int64_t x = 0; x < width; ++x) {
            int64_t r = 255 * x / (width - 1), g = 255 * y / (height - 1), b = 255 - (r + g) / 2;
            if (x < width / 2 && y < height / 2) {  // checkerboard quadrant: sharp edges
                const bool light = ((x / cell) + (y / cell)) % 2 == 0;
                r = g = b = light ? 235 : 25;
            }
            const int64_t dx = x - ring_x, dy = y - ring_y;
            const int64_t ring = isqrt(dx * dx + dy * dy) / ring_width;
            if (ring < 8 && ring % 2 == 0) {  // concentric rings: thin curved structure
                r = 250;
                g = 120 + 15 * ring;
                b = 20;
            }
            const int64_t ex = x - disc_x, ey = y - disc_y;
            if (ex * ex + ey * ey <= disc_r * disc_r) {  // a solid disc
                r = 30;
                g = 60;
                b = 200;
            }
            uint8_t* px = out + (y * width + x) * 3;
            px[0] = uint8_t(r);
            px[1] = uint8_t(g);
            px[2] = uint8_t(b);
        }
    }
    return image;
}

}  // namespace linvis::io
