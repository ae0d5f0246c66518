// Canvas, text, PNG output, line charts, figures and heat maps (see linvis/tools/plot.h).
#include "linvis/tools/plot.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>

#include <stb_image.h>
#include <stb_image_write.h>
#include <stb_truetype.h>

// stb_easy_font is a header of static functions and tables; not all of them are used here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-variable"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#include <stb_easy_font.h>
#pragma GCC diagnostic pop

#include "linvis/core/error.h"
#include "linvis/io/atomic_file.h"

namespace linvis::tools::plot {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double clamp01(double v) { return v < 0 ? 0 : (v > 1 ? 1 : v); }

uint8_t to_byte(double v) {
    v = std::round(v);
    return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// ---------------------------------------------------------------- colour spaces

double srgb_to_linear(double c) {
    return c <= 0.04045 ? c / 12.92 : std::pow((c + 0.055) / 1.055, 2.4);
}
double linear_to_srgb(double c) {
    return c <= 0.0031308 ? 12.92 * c : 1.055 * std::pow(c, 1.0 / 2.4) - 0.055;
}

struct Vec3 {
    double a, b, c;
};

// Oklab (Ottosson 2020) from / to sRGB bytes.
Vec3 to_oklab(Color col) {
    double r = srgb_to_linear(col.r / 255.0), g = srgb_to_linear(col.g / 255.0),
           b = srgb_to_linear(col.b / 255.0);
    double l = std::cbrt(0.4122214708 * r + 0.5363325363 * g + 0.0514459929 * b);
    double m = std::cbrt(0.2119034982 * r + 0.6806995451 * g + 0.1073969566 * b);
    double s = std::cbrt(0.0883024619 * r + 0.2817188376 * g + 0.6299787005 * b);
    return {0.2104542553 * l + 0.7936177850 * m - 0.0040720468 * s,
            1.9779984951 * l - 2.4285922050 * m + 0.4505937099 * s,
            0.0259040371 * l + 0.7827717662 * m - 0.8086757660 * s};
}
Color from_oklab(Vec3 lab) {
    double l = lab.a + 0.3963377774 * lab.b + 0.2158037573 * lab.c;
    double m = lab.a - 0.1055613458 * lab.b - 0.0638541728 * lab.c;
    double s = lab.a - 0.0894841775 * lab.b - 1.2914855480 * lab.c;
    l = l * l * l, m = m * m * m, s = s * s * s;
    double r = 4.0767416621 * l - 3.3077115913 * m + 0.2309699292 * s;
    double g = -1.2684380046 * l + 2.6097574011 * m - 0.3413193965 * s;
    double b = -0.0041960863 * l - 0.7034186147 * m + 1.7076147010 * s;
    return {to_byte(255 * linear_to_srgb(clamp01(r))), to_byte(255 * linear_to_srgb(clamp01(g))),
            to_byte(255 * linear_to_srgb(clamp01(b)))};
}

// CIELAB (D65 white) from / to sRGB, for Moreland's Msh space.
double lab_f(double t) { return t > 216.0 / 24389.0 ? std::cbrt(t) : (24389.0 / 27.0 * t + 16.0) / 116.0; }
double lab_finv(double t) {
    double t3 = t * t * t;
    return t3 > 216.0 / 24389.0 ? t3 : (116.0 * t - 16.0) / (24389.0 / 27.0);
}
constexpr double kXn = 0.95047, kYn = 1.0, kZn = 1.08883;

Vec3 to_lab(Color col) {
    double r = srgb_to_linear(col.r / 255.0), g = srgb_to_linear(col.g / 255.0),
           b = srgb_to_linear(col.b / 255.0);
    double x = 0.4124564 * r + 0.3575761 * g + 0.1804375 * b;
    double y = 0.2126729 * r + 0.7151522 * g + 0.0721750 * b;
    double z = 0.0193339 * r + 0.1191920 * g + 0.9503041 * b;
    double fx = lab_f(x / kXn), fy = lab_f(y / kYn), fz = lab_f(z / kZn);
    return {116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)};
}
Color from_lab(Vec3 lab) {
    double fy = (lab.a + 16.0) / 116.0, fx = fy + lab.b / 500.0, fz = fy - lab.c / 200.0;
    double x = kXn * lab_finv(fx), y = kYn * lab_finv(fy), z = kZn * lab_finv(fz);
    double r = 3.2404542 * x - 1.5371385 * y - 0.4985314 * z;
    double g = -0.9692660 * x + 1.8760108 * y + 0.0415560 * z;
    double b = 0.0556434 * x - 0.2040259 * y + 1.0572252 * z;
    return {to_byte(255 * linear_to_srgb(clamp01(r))), to_byte(255 * linear_to_srgb(clamp01(g))),
            to_byte(255 * linear_to_srgb(clamp01(b)))};
}

// Msh: polar form of Lab (magnitude, saturation angle, hue angle).
Vec3 to_msh(Color c) {
    Vec3 lab = to_lab(c);
    double m = std::sqrt(lab.a * lab.a + lab.b * lab.b + lab.c * lab.c);
    return {m, m > 0 ? std::acos(lab.a / m) : 0.0, std::atan2(lab.c, lab.b)};
}
Color from_msh(Vec3 msh) {
    return from_lab({msh.a * std::cos(msh.b), msh.a * std::sin(msh.b) * std::cos(msh.c),
                     msh.a * std::sin(msh.b) * std::sin(msh.c)});
}

// Hue for an unsaturated colour next to a saturated one (Moreland 2009, "AdjustHue").
double adjust_hue(Vec3 saturated, double m_unsat) {
    if (saturated.a >= m_unsat) return saturated.c;
    double spin = saturated.b * std::sqrt(m_unsat * m_unsat - saturated.a * saturated.a) /
                  (saturated.a * std::sin(saturated.b));
    return saturated.c > -M_PI / 3 ? saturated.c + spin : saturated.c - spin;
}

// Moreland's diverging interpolation between two saturated end colours through a
// neutral midpoint of magnitude max(M1, M2, 88).
Color diverging(Color c1, Color c2, double t) {
    Vec3 a = to_msh(c1), b = to_msh(c2);
    double hue_gap = std::fabs(a.c - b.c);
    if (hue_gap > M_PI) hue_gap = 2 * M_PI - hue_gap;
    if (a.b > 0.05 && b.b > 0.05 && hue_gap > M_PI / 3) {
        double mid = std::max({a.a, b.a, 88.0});
        if (t < 0.5) {
            b = {mid, 0, 0};
            t = 2 * t;
        } else {
            a = {mid, 0, 0};
            t = 2 * t - 1;
        }
    }
    if (a.b < 0.05 && b.b > 0.05) a.c = adjust_hue(b, a.a);
    if (b.b < 0.05 && a.b > 0.05) b.c = adjust_hue(a, b.a);
    return from_msh({(1 - t) * a.a + t * b.a, (1 - t) * a.b + t * b.b, (1 - t) * a.c + t * b.c});
}

// ---------------------------------------------------------------- fonts

struct FontState {
    bool truetype = false;
    std::string path;
    std::string reason;  // why the fallback is in use
    std::vector<unsigned char> data;
    stbtt_fontinfo info{};
    double ascent_per_px = 0, descent_per_px = 0, digit_per_px = 0;  // per unit of pixel height
};

std::mutex g_font_mutex;
std::string g_font_path = default_font_path();
std::shared_ptr<const FontState> g_font;

std::shared_ptr<const FontState> load_font(const std::string& path) {
    auto f = std::make_shared<FontState>();
    f->path = path;
    if (path.empty()) {
        f->reason = "no font path set";
        return f;
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        f->reason = "cannot open " + path;
        return f;
    }
    f->data.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    int offset = f->data.empty() ? -1 : stbtt_GetFontOffsetForIndex(f->data.data(), 0);
    if (offset < 0 || !stbtt_InitFont(&f->info, f->data.data(), offset)) {
        f->reason = "not a TrueType font: " + path;
        f->data.clear();
        return f;
    }
    int ascent = 0, descent = 0, gap = 0;
    stbtt_GetFontVMetrics(&f->info, &ascent, &descent, &gap);
    double scale = stbtt_ScaleForPixelHeight(&f->info, 1.0f);
    f->ascent_per_px = ascent * scale;
    f->descent_per_px = -descent * scale;
    int x0, y0, x1, y1;
    f->digit_per_px = stbtt_GetCodepointBox(&f->info, '0', &x0, &y0, &x1, &y1) ? y1 * scale
                                                                               : 0.7 * f->ascent_per_px;
    f->truetype = true;
    return f;
}

std::shared_ptr<const FontState> current_font() {
    std::lock_guard<std::mutex> lock(g_font_mutex);
    if (!g_font) g_font = load_font(g_font_path);
    return g_font;
}

std::vector<uint32_t> decode_utf8(const std::string& s) {
    std::vector<uint32_t> out;
    for (size_t i = 0; i < s.size();) {
        unsigned char c = static_cast<unsigned char>(s[i]);
        int extra = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
        if (extra < 0 || i + extra >= s.size() + (extra == 0 ? 1 : 0)) {
            out.push_back('?');
            ++i;
            continue;
        }
        uint32_t cp = extra == 0 ? c : (c & (0x3F >> extra));
        bool ok = true;
        for (int k = 1; k <= extra; ++k) {
            unsigned char cc = static_cast<unsigned char>(s[i + k]);
            if ((cc >> 6) != 2) ok = false;
            cp = (cp << 6) | (cc & 0x3F);
        }
        // Single-line text: control characters (newline, tab) become spaces.
        out.push_back(!ok ? '?' : cp < 32 ? ' ' : cp);
        i += ok ? extra + 1 : 1;
    }
    return out;
}

// Text rasterised to a coverage mask; (origin_x, baseline) is the pen start in the mask.
struct TextMask {
    int w = 0, h = 0;
    std::vector<float> a;
    int origin_x = 0, baseline = 0;
    TextSize size;
    double digit_height = 0;
};

// The fallback font's glyphs are 7 units tall above the baseline; descenders reach 3 below.
constexpr double kEasyAscent = 7.0, kEasyDescent = 3.0;

TextMask render_text(const std::string& text, double size) {
    auto font = current_font();
    TextMask m;
    const int pad = 2;
    if (font->truetype) {
        const stbtt_fontinfo* info = &font->info;
        float scale = stbtt_ScaleForPixelHeight(info, static_cast<float>(size));
        std::vector<int> glyphs;
        for (uint32_t cp : decode_utf8(text)) {
            int g = stbtt_FindGlyphIndex(info, static_cast<int>(cp));
            glyphs.push_back(g);
        }
        std::vector<double> pen(glyphs.size());
        double x = 0;
        for (size_t i = 0; i < glyphs.size(); ++i) {
            if (i > 0) x += scale * stbtt_GetGlyphKernAdvance(info, glyphs[i - 1], glyphs[i]);
            pen[i] = x;
            int advance = 0, lsb = 0;
            stbtt_GetGlyphHMetrics(info, glyphs[i], &advance, &lsb);
            x += scale * advance;
        }
        m.size = {x, font->ascent_per_px * size, font->descent_per_px * size};
        m.digit_height = font->digit_per_px * size;
        m.origin_x = pad;
        m.baseline = pad + static_cast<int>(std::ceil(m.size.ascent));
        m.w = static_cast<int>(std::ceil(x)) + 2 * pad + 1;
        m.h = m.baseline + static_cast<int>(std::ceil(m.size.descent)) + pad;
        m.a.assign(static_cast<size_t>(m.w) * m.h, 0.f);
        std::vector<unsigned char> bitmap;
        for (size_t i = 0; i < glyphs.size(); ++i) {
            double gx = m.origin_x + pen[i];
            int ix = static_cast<int>(std::floor(gx));
            float shift = static_cast<float>(gx - ix);
            int x0, y0, x1, y1;
            stbtt_GetGlyphBitmapBoxSubpixel(info, glyphs[i], scale, scale, shift, 0.f, &x0, &y0, &x1, &y1);
            int bw = x1 - x0, bh = y1 - y0;
            if (bw <= 0 || bh <= 0) continue;
            bitmap.assign(static_cast<size_t>(bw) * bh, 0);
            stbtt_MakeGlyphBitmapSubpixel(info, bitmap.data(), bw, bh, bw, scale, scale, shift, 0.f, glyphs[i]);
            for (int yy = 0; yy < bh; ++yy) {
                int my = m.baseline + y0 + yy;
                if (my < 0 || my >= m.h) continue;
                for (int xx = 0; xx < bw; ++xx) {
                    int mx = ix + x0 + xx;
                    if (mx < 0 || mx >= m.w) continue;
                    float& dst = m.a[static_cast<size_t>(my) * m.w + mx];
                    dst = std::min(1.f, dst + bitmap[static_cast<size_t>(yy) * bw + xx] / 255.f);
                }
            }
        }
        return m;
    }
    // Fallback: stb_easy_font's segment glyphs, scaled; ASCII only.
    std::string ascii;
    for (uint32_t cp : decode_utf8(text)) ascii.push_back(cp >= 32 && cp < 127 ? static_cast<char>(cp) : '?');
    double unit = size / (kEasyAscent + kEasyDescent);
    double width_units = ascii.empty() ? 0 : stb_easy_font_width(ascii.data());
    m.size = {width_units * unit, kEasyAscent * unit, kEasyDescent * unit};
    m.digit_height = kEasyAscent * unit;
    m.origin_x = pad;
    m.baseline = pad + static_cast<int>(std::ceil(m.size.ascent));
    m.w = static_cast<int>(std::ceil(m.size.width)) + 2 * pad + 1;
    m.h = m.baseline + static_cast<int>(std::ceil(m.size.descent)) + pad;
    m.a.assign(static_cast<size_t>(m.w) * m.h, 0.f);
    if (ascii.empty()) return m;
    std::vector<char> quads(ascii.size() * 300 * 4);  // 4 vertices of 16 bytes per quad
    int nquads = stb_easy_font_print(0, 0, ascii.data(), nullptr, quads.data(), static_cast<int>(quads.size()));
    for (int q = 0; q < nquads; ++q) {
        float vx[4], vy[4];
        for (int v = 0; v < 4; ++v) {
            std::memcpy(&vx[v], quads.data() + (q * 4 + v) * 16, sizeof(float));
            std::memcpy(&vy[v], quads.data() + (q * 4 + v) * 16 + 4, sizeof(float));
        }
        double qx0 = m.origin_x + unit * *std::min_element(vx, vx + 4);
        double qx1 = m.origin_x + unit * *std::max_element(vx, vx + 4);
        double qy0 = m.baseline + unit * (*std::min_element(vy, vy + 4) - kEasyAscent);
        double qy1 = m.baseline + unit * (*std::max_element(vy, vy + 4) - kEasyAscent);
        for (int my = std::max(0, static_cast<int>(qy0)); my < std::min(m.h, static_cast<int>(std::ceil(qy1))); ++my) {
            double cy = std::min<double>(my + 1, qy1) - std::max<double>(my, qy0);
            for (int mx = std::max(0, static_cast<int>(qx0)); mx < std::min(m.w, static_cast<int>(std::ceil(qx1))); ++mx) {
                double cx = std::min<double>(mx + 1, qx1) - std::max<double>(mx, qx0);
                float& dst = m.a[static_cast<size_t>(my) * m.w + mx];
                dst = std::min(1.f, dst + static_cast<float>(std::max(0.0, cx) * std::max(0.0, cy)));
            }
        }
    }
    return m;
}

// Distance from p to segment ab.
double segment_distance(double px, double py, const Point& a, const Point& b) {
    double dx = b.x - a.x, dy = b.y - a.y;
    double len2 = dx * dx + dy * dy;
    double t = len2 > 0 ? ((px - a.x) * dx + (py - a.y) * dy) / len2 : 0.0;
    t = t < 0 ? 0 : (t > 1 ? 1 : t);
    double ex = a.x + t * dx - px, ey = a.y + t * dy - py;
    return std::sqrt(ex * ex + ey * ey);
}

// Splits a polyline into its "on" pieces for a dash pattern.
std::vector<std::vector<Point>> dash_pieces(const std::vector<Point>& pts, const Dash& dash) {
    std::vector<std::vector<Point>> out;
    double total = 0;
    for (double d : dash) total += d;
    if (dash.empty() || total <= 0) {
        out.push_back(pts);
        return out;
    }
    size_t k = 0;               // index in the pattern
    double left = dash[0];      // length left in the current pattern entry
    bool on = true;
    std::vector<Point> cur{pts[0]};
    for (size_t i = 1; i < pts.size(); ++i) {
        Point a = pts[i - 1], b = pts[i];
        double seg = std::hypot(b.x - a.x, b.y - a.y), pos = 0;
        while (seg - pos > left) {
            pos += left;
            Point p{a.x + (b.x - a.x) * pos / seg, a.y + (b.y - a.y) * pos / seg};
            if (on) {
                cur.push_back(p);
                out.push_back(cur);
                cur.clear();
            } else {
                cur = {p};
            }
            on = !on;
            k = (k + 1) % dash.size();
            left = dash[k];
        }
        left -= seg - pos;
        if (on) cur.push_back(b);
    }
    if (on && cur.size() >= 2) out.push_back(cur);
    return out;
}

}  // namespace

// ---------------------------------------------------------------- colours

Color palette(size_t index) {
    static const Color okabe_ito[] = {{0, 114, 178},   {213, 94, 0},   {0, 158, 115}, {204, 121, 167},
                                      {230, 159, 0},   {86, 180, 233}, {240, 228, 66}, {0, 0, 0}};
    return okabe_ito[index % palette_size()];
}
size_t palette_size() { return 8; }

Color parse_color(const std::string& hex) {
    std::string h = !hex.empty() && hex[0] == '#' ? hex.substr(1) : hex;
    LINVIS_CHECK(h.size() == 6 && h.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos,
                 "parse_color: expected \"#RRGGBB\", got \"", hex, "\"");
    auto byte = [&](int i) { return static_cast<uint8_t>(std::stoi(h.substr(i, 2), nullptr, 16)); };
    return {byte(0), byte(2), byte(4)};
}

Color colormap_color(Colormap cm, double t) {
    if (std::isnan(t)) return {128, 128, 128};
    t = clamp01(t);
    switch (cm) {
        case Colormap::Viridis: {
            // viridis at t = 0, 0.25, 0.5, 0.75, 1 (its published 5-colour sampling).
            static const Color anchors[] = {
                {0x44, 0x01, 0x54}, {0x3B, 0x52, 0x8B}, {0x21, 0x91, 0x8C}, {0x5E, 0xC9, 0x62}, {0xFD, 0xE7, 0x25}};
            double pos = t * 4;
            int i = std::min(3, static_cast<int>(pos));
            double f = pos - i;
            if (f == 0) return anchors[i];
            if (f == 1) return anchors[i + 1];
            Vec3 a = to_oklab(anchors[i]), b = to_oklab(anchors[i + 1]);
            return from_oklab({a.a + f * (b.a - a.a), a.b + f * (b.b - a.b), a.c + f * (b.c - a.c)});
        }
        case Colormap::CoolWarm: {
            // Moreland's end colours; the interpolation is exact at the ends.
            constexpr Color blue{59, 76, 192}, red{180, 4, 38};
            if (t == 0) return blue;
            if (t == 1) return red;
            return diverging(blue, red, t);
        }
        case Colormap::Gray: {
            uint8_t v = to_byte(255 * t);
            return {v, v, v};
        }
    }
    return {0, 0, 0};
}

std::string colormap_name(Colormap cm) {
    switch (cm) {
        case Colormap::Viridis: return "viridis";
        case Colormap::CoolWarm: return "coolwarm";
        case Colormap::Gray: return "gray";
    }
    return "?";
}

// ---------------------------------------------------------------- fonts (public)

std::string default_font_path() {
    const char* env = std::getenv("LINVIS_FONT");
    if (env && *env) return env;
    return "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
}

void set_font_path(const std::string& path) {
    std::lock_guard<std::mutex> lock(g_font_mutex);
    g_font_path = path;
    g_font.reset();
}

std::string font_status() {
    auto f = current_font();
    return f->truetype ? "truetype:" + f->path : "fallback:stb_easy_font (" + f->reason + ")";
}

bool using_truetype_font() { return current_font()->truetype; }

TextSize measure_text(const std::string& text, double size) {
    auto font = current_font();
    if (font->truetype) {
        const stbtt_fontinfo* info = &font->info;
        float scale = stbtt_ScaleForPixelHeight(info, static_cast<float>(size));
        double x = 0;
        int prev = -1;
        for (uint32_t cp : decode_utf8(text)) {
            int g = stbtt_FindGlyphIndex(info, static_cast<int>(cp));
            if (prev >= 0) x += scale * stbtt_GetGlyphKernAdvance(info, prev, g);
            int advance = 0, lsb = 0;
            stbtt_GetGlyphHMetrics(info, g, &advance, &lsb);
            x += scale * advance;
            prev = g;
        }
        return {x, font->ascent_per_px * size, font->descent_per_px * size};
    }
    std::string ascii;
    for (uint32_t cp : decode_utf8(text)) ascii.push_back(cp >= 32 && cp < 127 ? static_cast<char>(cp) : '?');
    double unit = size / (kEasyAscent + kEasyDescent);
    double w = ascii.empty() ? 0 : stb_easy_font_width(ascii.data());
    return {w * unit, kEasyAscent * unit, kEasyDescent * unit};
}

// ---------------------------------------------------------------- canvas

Canvas::Canvas(int width, int height, Color background) {
    LINVIS_CHECK(width >= 1 && height >= 1 && width <= 32768 && height <= 32768,
                 "plot::Canvas: size must be in [1, 32768] x [1, 32768], got ", width, " x ", height);
    width_ = width;
    height_ = height;
    clear_clip();
    rgb_.resize(static_cast<size_t>(width) * height * 3);
    fill(background);
}

Canvas Canvas::from_rgb(const uint8_t* rgb, int width, int height) {
    LINVIS_CHECK(rgb != nullptr, "plot::Canvas::from_rgb: null pixel buffer");
    Canvas c(width, height);
    std::memcpy(c.rgb_.data(), rgb, c.rgb_.size());
    return c;
}

Color Canvas::pixel(int x, int y) const {
    LINVIS_CHECK(x >= 0 && y >= 0 && x < width_ && y < height_, "plot::Canvas::pixel: (", x, ", ", y,
                 ") is outside the ", width_, " x ", height_, " canvas");
    const uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
    return {p[0], p[1], p[2]};
}

void Canvas::set_pixel(int x, int y, Color c) {
    if (x < clip_x0_ || y < clip_y0_ || x >= clip_x1_ || y >= clip_y1_) return;
    uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
    p[0] = c.r, p[1] = c.g, p[2] = c.b;
}

void Canvas::blend_pixel(int x, int y, Color c, double alpha) {
    if (x < clip_x0_ || y < clip_y0_ || x >= clip_x1_ || y >= clip_y1_) return;
    if (!(alpha > 0)) return;
    if (alpha >= 1) return set_pixel(x, y, c);
    uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
    p[0] = to_byte(p[0] + alpha * (c.r - p[0]));
    p[1] = to_byte(p[1] + alpha * (c.g - p[1]));
    p[2] = to_byte(p[2] + alpha * (c.b - p[2]));
}

void Canvas::set_clip(const Rect& r) {
    clip_x0_ = std::max(0, static_cast<int>(std::floor(r.x)));
    clip_y0_ = std::max(0, static_cast<int>(std::floor(r.y)));
    clip_x1_ = std::min(width_, static_cast<int>(std::ceil(r.right())));
    clip_y1_ = std::min(height_, static_cast<int>(std::ceil(r.bottom())));
}

void Canvas::clear_clip() {
    clip_x0_ = clip_y0_ = 0;
    clip_x1_ = width_;
    clip_y1_ = height_;
}

void Canvas::fill(Color c) {
    for (int y = 0; y < height_; ++y)
        for (int x = 0; x < width_; ++x) set_pixel(x, y, c);
}

void Canvas::fill_rect(const Rect& r, Color c, double alpha) {
    double x0 = r.x, x1 = r.right(), y0 = r.y, y1 = r.bottom();
    if (x1 < x0) std::swap(x0, x1);
    if (y1 < y0) std::swap(y0, y1);
    int ix0 = std::max(clip_x0_, static_cast<int>(std::floor(x0)));
    int ix1 = std::min(clip_x1_, static_cast<int>(std::ceil(x1)));
    int iy0 = std::max(clip_y0_, static_cast<int>(std::floor(y0)));
    int iy1 = std::min(clip_y1_, static_cast<int>(std::ceil(y1)));
    for (int y = iy0; y < iy1; ++y) {
        double cy = std::min<double>(y + 1, y1) - std::max<double>(y, y0);
        for (int x = ix0; x < ix1; ++x) {
            double cx = std::min<double>(x + 1, x1) - std::max<double>(x, x0);
            blend_pixel(x, y, c, alpha * cx * cy);
        }
    }
}

void Canvas::stroke_rect(const Rect& r, Color c, double line_width) {
    double h = line_width / 2;
    fill_rect({r.x - h, r.y - h, r.w + line_width, line_width}, c);
    fill_rect({r.x - h, r.bottom() - h, r.w + line_width, line_width}, c);
    fill_rect({r.x - h, r.y + h, line_width, r.h - line_width}, c);
    fill_rect({r.right() - h, r.y + h, line_width, r.h - line_width}, c);
}

void Canvas::draw_line(Point a, Point b, Color c, double line_width, const Dash& dash) {
    draw_polyline({a, b}, c, line_width, dash);
}

void Canvas::draw_polyline(const std::vector<Point>& points, Color c, double line_width, const Dash& dash) {
    if (points.empty()) return;
    for (const auto& p : points)
        if (!std::isfinite(p.x) || !std::isfinite(p.y)) fail("plot::Canvas::draw_polyline: non-finite point");
    if (points.size() == 1) return fill_circle(points[0], line_width / 2, c);
    double hw = line_width / 2, reach = hw + 1;
    double minx = points[0].x, maxx = minx, miny = points[0].y, maxy = miny;
    for (const auto& p : points) {
        minx = std::min(minx, p.x), maxx = std::max(maxx, p.x);
        miny = std::min(miny, p.y), maxy = std::max(maxy, p.y);
    }
    int bx0 = std::max(clip_x0_, static_cast<int>(std::floor(minx - reach)));
    int by0 = std::max(clip_y0_, static_cast<int>(std::floor(miny - reach)));
    int bx1 = std::min(clip_x1_, static_cast<int>(std::ceil(maxx + reach)));
    int by1 = std::min(clip_y1_, static_cast<int>(std::ceil(maxy + reach)));
    if (bx0 >= bx1 || by0 >= by1) return;
    int bw = bx1 - bx0;
    std::vector<float> cover(static_cast<size_t>(bw) * (by1 - by0), 0.f);
    for (const auto& piece : dash_pieces(points, dash)) {
        for (size_t i = 0; i + 1 < piece.size(); ++i) {
            const Point& a = piece[i];
            const Point& b = piece[i + 1];
            int x0 = std::max(bx0, static_cast<int>(std::floor(std::min(a.x, b.x) - reach)));
            int x1 = std::min(bx1, static_cast<int>(std::ceil(std::max(a.x, b.x) + reach)));
            int y0 = std::max(by0, static_cast<int>(std::floor(std::min(a.y, b.y) - reach)));
            int y1 = std::min(by1, static_cast<int>(std::ceil(std::max(a.y, b.y) + reach)));
            for (int y = y0; y < y1; ++y)
                for (int x = x0; x < x1; ++x) {
                    double cov = clamp01(hw + 0.5 - segment_distance(x + 0.5, y + 0.5, a, b));
                    float& dst = cover[static_cast<size_t>(y - by0) * bw + (x - bx0)];
                    dst = std::max(dst, static_cast<float>(cov));
                }
        }
    }
    for (int y = by0; y < by1; ++y)
        for (int x = bx0; x < bx1; ++x) blend_pixel(x, y, c, cover[static_cast<size_t>(y - by0) * bw + (x - bx0)]);
}

void Canvas::fill_circle(Point centre, double radius, Color c) {
    int x0 = static_cast<int>(std::floor(centre.x - radius - 1)), x1 = static_cast<int>(std::ceil(centre.x + radius + 1));
    int y0 = static_cast<int>(std::floor(centre.y - radius - 1)), y1 = static_cast<int>(std::ceil(centre.y + radius + 1));
    for (int y = y0; y < y1; ++y)
        for (int x = x0; x < x1; ++x) {
            double d = std::hypot(x + 0.5 - centre.x, y + 0.5 - centre.y);
            blend_pixel(x, y, c, clamp01(radius + 0.5 - d));
        }
}

void Canvas::fill_polygon(const std::vector<Point>& pts, Color c) {
    if (pts.size() < 3) return;
    double minx = pts[0].x, maxx = minx, miny = pts[0].y, maxy = miny;
    for (const auto& p : pts) {
        minx = std::min(minx, p.x), maxx = std::max(maxx, p.x);
        miny = std::min(miny, p.y), maxy = std::max(maxy, p.y);
    }
    auto inside = [&](double px, double py) {
        bool in = false;
        for (size_t i = 0, j = pts.size() - 1; i < pts.size(); j = i++) {
            if ((pts[i].y > py) != (pts[j].y > py) &&
                px < (pts[j].x - pts[i].x) * (py - pts[i].y) / (pts[j].y - pts[i].y) + pts[i].x)
                in = !in;
        }
        return in;
    };
    const int ss = 4;  // 4 x 4 samples per pixel
    for (int y = static_cast<int>(std::floor(miny)); y < static_cast<int>(std::ceil(maxy)); ++y)
        for (int x = static_cast<int>(std::floor(minx)); x < static_cast<int>(std::ceil(maxx)); ++x) {
            int hits = 0;
            for (int sy = 0; sy < ss; ++sy)
                for (int sx = 0; sx < ss; ++sx) hits += inside(x + (sx + 0.5) / ss, y + (sy + 0.5) / ss);
            blend_pixel(x, y, c, hits / double(ss * ss));
        }
}

void Canvas::draw_marker(Marker m, Point p, double size, Color c) {
    double r = size / 2;
    switch (m) {
        case Marker::None: return;
        case Marker::Circle: return fill_circle(p, r, c);
        case Marker::Square: return fill_rect({p.x - r * 0.85, p.y - r * 0.85, r * 1.7, r * 1.7}, c);
        case Marker::Triangle:
            return fill_polygon({{p.x, p.y - r * 1.1}, {p.x + r * 1.05, p.y + r * 0.75}, {p.x - r * 1.05, p.y + r * 0.75}}, c);
        case Marker::Diamond:
            return fill_polygon({{p.x, p.y - r * 1.2}, {p.x + r, p.y}, {p.x, p.y + r * 1.2}, {p.x - r, p.y}}, c);
    }
}

Rect Canvas::draw_text(const std::string& text, double x, double y, double size, Color c, HAlign h, VAlign v,
                       bool rotate_ccw) {
    TextMask m = render_text(text, size);
    const double tw = m.size.width, th = m.size.height();
    if (!rotate_ccw) {
        double left = h == HAlign::Left ? x : h == HAlign::Center ? x - tw / 2 : x - tw;
        double base = v == VAlign::Baseline ? y
                      : v == VAlign::Top    ? y + m.size.ascent
                      : v == VAlign::Bottom ? y - m.size.descent
                                            : y + m.digit_height / 2;
        int ox = static_cast<int>(std::lround(left)) - m.origin_x;
        int oy = static_cast<int>(std::lround(base)) - m.baseline;
        for (int yy = 0; yy < m.h; ++yy)
            for (int xx = 0; xx < m.w; ++xx) {
                float a = m.a[static_cast<size_t>(yy) * m.w + xx];
                if (a > 0) blend_pixel(ox + xx, oy + yy, c, a);
            }
        return {left, base - m.size.ascent, tw, th};
    }
    // Rotated 90 degrees counter-clockwise: the text's top faces left, it reads upwards.
    // The box is th wide and tw tall; mask (xx, yy) lands at (yy, -xx) relative to the anchor.
    double left = h == HAlign::Left ? x : h == HAlign::Center ? x - th / 2 : x - th;
    double top = v == VAlign::Top ? y : v == VAlign::Middle ? y - tw / 2 : y - tw;
    // Pen start (origin_x, baseline - ascent) goes to the box's bottom-left corner.
    int ox = static_cast<int>(std::lround(left)) - (m.baseline - static_cast<int>(std::lround(m.size.ascent)));
    int oy = static_cast<int>(std::lround(top + tw)) + m.origin_x;
    for (int yy = 0; yy < m.h; ++yy)
        for (int xx = 0; xx < m.w; ++xx) {
            float a = m.a[static_cast<size_t>(yy) * m.w + xx];
            if (a > 0) blend_pixel(ox + yy, oy - xx - 1, c, a);
        }
    return {left, top, th, tw};
}

void Canvas::blit(const Canvas& src, int x, int y) {
    for (int yy = 0; yy < src.height(); ++yy)
        for (int xx = 0; xx < src.width(); ++xx) set_pixel(x + xx, y + yy, src.pixel(xx, yy));
}

Canvas Canvas::resized(int width, int height) const {
    LINVIS_CHECK(!empty(), "plot::Canvas::resized: empty canvas");
    Canvas out(width, height);
    // Shrinking by more than 2x: average k x k blocks first so that bilinear sampling does not alias.
    int kx = std::max(1, width_ / (2 * width)), ky = std::max(1, height_ / (2 * height));
    int sw = width_ / kx, sh = height_ / ky;
    for (int c = 0; c < 3; ++c) {
        std::vector<float> chan(static_cast<size_t>(sw) * sh, 0.f);
        for (int y = 0; y < sh * ky; ++y)
            for (int x = 0; x < sw * kx; ++x)
                chan[static_cast<size_t>(y / ky) * sw + x / kx] += rgb_[(static_cast<size_t>(y) * width_ + x) * 3 + c];
        for (auto& v : chan) v /= static_cast<float>(kx * ky);
        std::vector<float> up = upsample_bilinear(chan.data(), sh, sw, height, width);
        for (size_t i = 0; i < up.size(); ++i) out.rgb_[i * 3 + c] = to_byte(up[i]);
    }
    return out;
}

void Canvas::save_png(const std::string& path) const {
    LINVIS_CHECK(!empty(), "plot: cannot write '", path, "': the canvas is empty");
    LINVIS_CHECK(!path.empty(), "plot: cannot write a PNG: empty output path");
    std::vector<unsigned char> png;
    auto sink = [](void* ctx, void* data, int size) {
        auto* out = static_cast<std::vector<unsigned char>*>(ctx);
        out->insert(out->end(), static_cast<unsigned char*>(data), static_cast<unsigned char*>(data) + size);
    };
    if (!stbi_write_png_to_func(sink, &png, width_, height_, 3, rgb_.data(), width_ * 3))
        fail("plot: cannot encode PNG for '", path, "'");
    try {
        io::write_file_atomically(path, std::string_view(reinterpret_cast<const char*>(png.data()), png.size()));
    } catch (const Error& e) {
        fail("plot: cannot write '", path, "': ", e.what());
    }
}

Canvas load_png(const std::string& path) {
    int w = 0, h = 0, n = 0;
    unsigned char* data = stbi_load(path.c_str(), &w, &h, &n, 3);
    if (!data) fail("plot: cannot read image '", path, "': ", stbi_failure_reason() ? stbi_failure_reason() : "unknown error");
    Canvas c;
    try {
        c = Canvas::from_rgb(data, w, h);
    } catch (...) {
        stbi_image_free(data);
        throw;
    }
    stbi_image_free(data);
    return c;
}

// ---------------------------------------------------------------- panels and ticks

Canvas Panel::render(int width, int height) const {
    Canvas c(width, height);
    draw(c, {0, 0, static_cast<double>(width), static_cast<double>(height)});
    return c;
}

void Panel::save_png(const std::string& path, int width, int height) const { render(width, height).save_png(path); }

std::vector<double> nice_ticks(double lo, double hi, int target) {
    if (!std::isfinite(lo) || !std::isfinite(hi)) return {};
    if (hi < lo) std::swap(lo, hi);
    if (hi == lo) return {lo};
    target = std::max(2, target);
    double raw = (hi - lo) / (target - 1);
    double mag = std::pow(10.0, std::floor(std::log10(raw)));
    double step = mag * 10;
    for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
        if (m * mag >= raw * (1 - 1e-9)) {
            step = m * mag;
            break;
        }
    std::vector<double> out;
    double eps = step * 1e-9;
    for (long long k = static_cast<long long>(std::ceil((lo - eps) / step)); k * step <= hi + eps; ++k) {
        double v = k * step;
        out.push_back(std::fabs(v) < eps ? 0.0 : v);
    }
    return out;
}

std::vector<double> log_ticks(double lo, double hi, int target) {
    if (!(lo > 0) || !(hi > 0) || !std::isfinite(lo) || !std::isfinite(hi)) return {};
    if (hi < lo) std::swap(lo, hi);
    const double tol = 1e-9;
    int e0 = static_cast<int>(std::ceil(std::log10(lo) - tol)), e1 = static_cast<int>(std::floor(std::log10(hi) + tol));
    std::vector<double> out;
    int n = e1 - e0 + 1;
    if (n >= 3) {
        int stride = std::max(1, (n + std::max(1, target) - 1) / std::max(1, target));
        for (int e = e0; e <= e1; ++e)
            if (((e % stride) + stride) % stride == 0) out.push_back(std::pow(10.0, e));
        return out;
    }
    for (const std::vector<double>& mults : {std::vector<double>{1, 2, 5}, std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9}}) {
        out.clear();
        for (int e = static_cast<int>(std::floor(std::log10(lo))) ; e <= static_cast<int>(std::ceil(std::log10(hi))); ++e)
            for (double m : mults) {
                double v = m * std::pow(10.0, e);
                if (v >= lo * (1 - tol) && v <= hi * (1 + tol)) out.push_back(v);
            }
        if (out.size() >= 3) break;
    }
    return out;
}

std::string format_tick(double value, double step) {
    if (value == 0) return "0";
    char buf[64];
    double a = std::fabs(value);
    if (a >= 1e6 || a < 1e-4) {
        std::snprintf(buf, sizeof buf, "%.3g", value);
        std::string s = buf;
        // "1e+06" -> "1e6", "2.5e-05" -> "2.5e-5"
        auto e = s.find('e');
        if (e != std::string::npos) {
            std::string mant = s.substr(0, e), ex = s.substr(e + 1);
            bool neg = ex[0] == '-';
            size_t first = ex.find_first_not_of("+-0");
            s = mant + "e" + (neg ? "-" : "") + (first == std::string::npos ? "0" : ex.substr(first));
        }
        return s;
    }
    int decimals = 0;
    if (step > 0 && std::isfinite(step)) {
        while (decimals < 8) {
            double scaled = step * std::pow(10.0, decimals);
            if (std::fabs(scaled - std::round(scaled)) < 1e-6 * std::max(1.0, scaled)) break;
            ++decimals;
        }
    } else {
        std::snprintf(buf, sizeof buf, "%.6g", value);
        return buf;
    }
    std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
    return buf;
}

namespace {

double axis_t(double v, Scale s) { return s == Scale::Log10 ? std::log10(v) : v; }

bool placeable(double v, Scale s) { return std::isfinite(v) && (s == Scale::Linear || v > 0); }

// Smaller text for small panels, clamped to a legible range.
double auto_size(double given, double base, double factor, double lo, double hi) {
    if (given > 0) return given;
    return std::clamp(base * factor, lo, hi);
}

// Shrinks `size` until `text` fits `max_width` (down to 7 px).
double fit_size(const std::string& text, double size, double max_width) {
    while (size > 7 && measure_text(text, size).width > max_width) size *= 0.92;
    return size;
}

// Data extent of an axis (placeable values only).
std::pair<double, double> data_extent(const std::vector<Series>& series, bool use_x, Scale xs, Scale ys) {
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (const auto& s : series)
        for (size_t i = 0; i < s.xs.size(); ++i) {
            if (!placeable(s.xs[i], xs) || !placeable(s.ys[i], ys)) continue;
            double v = use_x ? s.xs[i] : s.ys[i];
            lo = std::min(lo, v), hi = std::max(hi, v);
        }
    return {lo, hi};
}

// Padded axis limits from the data extent.
std::pair<double, double> padded_limits(double lo, double hi, Scale s, bool include_zero) {
    if (s == Scale::Log10) {
        double a = std::log10(lo), b = std::log10(hi);
        if (b - a < 1e-12) a -= 0.3, b += 0.3;
        double pad = 0.04 * (b - a);
        return {std::pow(10.0, a - pad), std::pow(10.0, b + pad)};
    }
    if (include_zero) lo = std::min(lo, 0.0), hi = std::max(hi, 0.0);
    if (hi - lo < 1e-12 * std::max(1.0, std::fabs(hi))) {
        double d = lo == 0 ? 1.0 : 0.1 * std::fabs(lo);
        lo -= d, hi += d;
    }
    double pad = 0.04 * (hi - lo);
    double plo = lo - pad, phi = hi + pad;
    if (include_zero && lo == 0) plo = 0;
    if (include_zero && hi == 0) phi = 0;
    return {plo, phi};
}

}  // namespace

LineChart& LineChart::x_range(double lo, double hi) {
    LINVIS_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo < hi, "plot::LineChart '", title_,
                 "': x range must satisfy lo < hi, got [", lo, ", ", hi, "]");
    x_range_ = std::make_pair(lo, hi);
    return *this;
}

LineChart& LineChart::y_range(double lo, double hi) {
    LINVIS_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo < hi, "plot::LineChart '", title_,
                 "': y range must satisfy lo < hi, got [", lo, ", ", hi, "]");
    y_range_ = std::make_pair(lo, hi);
    return *this;
}

LineChart& LineChart::add(Series s) {
    LINVIS_CHECK(s.xs.size() == s.ys.size(), "plot::LineChart '", title_, "': series '", s.name, "' has ",
                 s.xs.size(), " x values but ", s.ys.size(), " y values");
    series_.push_back(std::move(s));
    return *this;
}

LineChart& LineChart::add(const std::string& name, std::vector<double> xs, std::vector<double> ys, Marker marker) {
    Series s;
    s.name = name;
    s.xs = std::move(xs);
    s.ys = std::move(ys);
    s.marker = marker;
    return add(std::move(s));
}

double LineChart::Layout::to_px_x(double x) const {
    double a = axis_t(x_lo, x_scale), b = axis_t(x_hi, x_scale);
    return plot.x + (axis_t(x, x_scale) - a) / (b - a) * plot.w;
}

double LineChart::Layout::to_px_y(double y) const {
    double a = axis_t(y_lo, y_scale), b = axis_t(y_hi, y_scale);
    return plot.bottom() - (axis_t(y, y_scale) - a) / (b - a) * plot.h;
}

namespace {

// Chooses ticks for an axis of `length` pixels so that labels of the given extent
// (width for x, height for y) do not collide. Returns (ticks, labels; "" = unlabelled).
struct AxisTicks {
    std::vector<double> ticks;
    std::vector<std::string> labels;
};

AxisTicks choose_ticks(double lo, double hi, Scale scale, const std::vector<double>& explicit_ticks,
                       double length, double text_size, bool horizontal) {
    auto extent = [&](const std::string& s) {
        return horizontal ? measure_text(s, text_size).width + text_size * 0.8 : text_size * 1.6;
    };
    auto to_px = [&](double v) {
        return (axis_t(v, scale) - axis_t(lo, scale)) / (axis_t(hi, scale) - axis_t(lo, scale)) * length;
    };
    auto collides = [&](const AxisTicks& t) {
        double prev_end = -1e300;
        for (size_t i = 0; i < t.ticks.size(); ++i) {
            if (t.labels[i].empty()) continue;
            double c = to_px(t.ticks[i]), e = extent(t.labels[i]);
            if (c - e / 2 < prev_end) return true;
            prev_end = c + e / 2;
        }
        return false;
    };
    auto label_all = [&](std::vector<double> ticks, double step) {
        AxisTicks t;
        for (double v : ticks)
            if (v >= std::min(lo, hi) - 1e-9 * std::fabs(hi - lo) && v <= std::max(lo, hi) + 1e-9 * std::fabs(hi - lo)) {
                t.ticks.push_back(v);
                t.labels.push_back(format_tick(v, step));
            }
        return t;
    };
    AxisTicks t;
    if (explicit_ticks.empty() && scale == Scale::Linear) {
        int target = std::clamp(static_cast<int>(length / (horizontal ? 70.0 : 45.0)) + 1, 2, 9);
        for (; target >= 2; --target) {
            auto ticks = nice_ticks(lo, hi, target);
            double step = ticks.size() >= 2 ? ticks[1] - ticks[0] : 0;
            t = label_all(ticks, step);
            if (!collides(t)) return t;
        }
        return t;
    }
    if (!explicit_ticks.empty()) {
        t = label_all(explicit_ticks, -1);
    } else {
        auto ticks = log_ticks(lo, hi, 8);
        t = label_all(ticks, -1);
    }
    // Too dense: keep every k-th label (ticks stay).
    AxisTicks thinned = t;
    for (size_t stride = 2; collides(thinned) && stride <= t.ticks.size(); ++stride)
        for (size_t i = 0; i < t.ticks.size(); ++i) thinned.labels[i] = i % stride == 0 ? t.labels[i] : "";
    return thinned;
}

}  // namespace

void LineChart::draw(Canvas& canvas, const Rect& area) const {
    const std::string who = "plot::LineChart '" + title_ + "'";
    LINVIS_CHECK(!series_.empty(), who, ": no series to plot");
    auto [dx_lo, dx_hi] = data_extent(series_, true, x_scale_, y_scale_);
    auto [dy_lo, dy_hi] = data_extent(series_, false, x_scale_, y_scale_);
    LINVIS_CHECK(dx_lo <= dx_hi, who, ": no finite point to plot",
                 (x_scale_ == Scale::Log10 || y_scale_ == Scale::Log10) ? " (log axes need positive values)" : "");
    if (x_scale_ == Scale::Log10 && x_range_) LINVIS_CHECK(x_range_->first > 0, who, ": log x range must be positive");
    if (y_scale_ == Scale::Log10 && y_range_) LINVIS_CHECK(y_range_->first > 0, who, ": log y range must be positive");

    Layout L;
    L.x_scale = x_scale_;
    L.y_scale = y_scale_;
    std::tie(L.x_lo, L.x_hi) = x_range_ ? *x_range_ : padded_limits(dx_lo, dx_hi, x_scale_, false);
    std::tie(L.y_lo, L.y_hi) = y_range_ ? *y_range_ : padded_limits(dy_lo, dy_hi, y_scale_, y_include_zero_);

    const double base = std::min(area.w, area.h);
    const double title_size = auto_size(style_.title_size, base, 0.05, 11, 22);
    const double label_size = auto_size(style_.label_size, base, 0.042, 10, 18);
    const double tick_size = auto_size(style_.tick_size, base, 0.037, 9, 16);
    const double legend_size = auto_size(style_.legend_size, base, 0.037, 9, 16);
    const double pad = std::max(6.0, base * 0.025);
    const double tick_len = std::max(4.0, tick_size * 0.4);
    const double lw = style_.line_width > 0 ? style_.line_width : 2.0;

    canvas.set_clip(area);
    canvas.fill_rect(area, style_.background);

    // Vertical layout: title above, tick labels and x label below.
    double top = area.y + pad;
    double title_h = 0;
    double tsize = title_.empty() ? 0 : fit_size(title_, title_size, area.w - 2 * pad);
    if (!title_.empty()) title_h = measure_text(title_, tsize).height() + pad * 0.6;
    double plot_top = top + title_h + (title_.empty() ? tick_size * 0.6 : 0);
    double xlabel_size = x_label_.empty() ? 0 : fit_size(x_label_, label_size, area.w - 2 * pad);
    double bottom_margin = pad + tick_len + tick_size * 1.35 +
                           (x_label_.empty() ? 0 : measure_text(x_label_, xlabel_size).height() + pad * 0.4);
    double plot_bottom = area.bottom() - bottom_margin;
    double plot_h = plot_bottom - plot_top;
    LINVIS_CHECK(plot_h > 10, who, ": area ", area.w, " x ", area.h, " is too small for a chart");

    AxisTicks yt = choose_ticks(L.y_lo, L.y_hi, y_scale_, y_ticks_, plot_h, tick_size, false);
    double ylabels_w = 0;
    for (const auto& s : yt.labels) ylabels_w = std::max(ylabels_w, measure_text(s, tick_size).width);
    double ylabel_size = y_label_.empty() ? 0 : fit_size(y_label_, label_size, plot_h);
    double ylabel_w = y_label_.empty() ? 0 : measure_text(y_label_, ylabel_size).height() + pad * 0.5;
    double plot_left = area.x + pad + ylabel_w + ylabels_w + tick_len + tick_size * 0.4;
    double right_margin = pad + tick_size * 0.5;
    AxisTicks xt;
    for (int pass = 0; pass < 2; ++pass) {
        double plot_w = area.right() - right_margin - plot_left;
        LINVIS_CHECK(plot_w > 10, who, ": area ", area.w, " x ", area.h, " is too small for a chart");
        xt = choose_ticks(L.x_lo, L.x_hi, x_scale_, x_ticks_, plot_w, tick_size, true);
        // The last label must not run past the right edge.
        double need = 0;
        for (size_t i = 0; i < xt.ticks.size(); ++i) {
            if (xt.labels[i].empty()) continue;
            double px = plot_left + (axis_t(xt.ticks[i], x_scale_) - axis_t(L.x_lo, x_scale_)) /
                                        (axis_t(L.x_hi, x_scale_) - axis_t(L.x_lo, x_scale_)) * plot_w;
            need = std::max(need, px + measure_text(xt.labels[i], tick_size).width / 2 + pad * 0.5 - area.right());
        }
        if (need <= 0) break;
        right_margin += need;
    }
    // Snap the frame to pixel centres so that axes and grid lines are crisp.
    double x0 = std::floor(plot_left) + 0.5, x1 = std::floor(area.right() - right_margin) + 0.5;
    double y0 = std::floor(plot_top) + 0.5, y1 = std::floor(plot_bottom) + 0.5;
    L.plot = {x0, y0, x1 - x0, y1 - y0};
    L.x_ticks = xt.ticks;
    L.y_ticks = yt.ticks;
    L.x_tick_labels = xt.labels;
    L.y_tick_labels = yt.labels;

    auto snap = [](double v) { return std::floor(v) + 0.5; };
    // Grid.
    if (grid_) {
        for (double t : xt.ticks) {
            double px = snap(L.to_px_x(t));
            if (px > x0 + 0.5 && px < x1 - 0.5) canvas.draw_line({px, y0}, {px, y1}, colors::grid, 1.0);
        }
        for (double t : yt.ticks) {
            double py = snap(L.to_px_y(t));
            if (py > y0 + 0.5 && py < y1 - 0.5) canvas.draw_line({x0, py}, {x1, py}, colors::grid, 1.0);
        }
    }
    // Minor ticks on log axes.
    auto minor_ticks = [](double lo, double hi) {
        std::vector<double> out;
        for (int e = static_cast<int>(std::floor(std::log10(lo))); e <= static_cast<int>(std::ceil(std::log10(hi))); ++e)
            for (int m = 2; m <= 9; ++m) {
                double v = m * std::pow(10.0, e);
                if (v > lo && v < hi) out.push_back(v);
            }
        return out;
    };
    if (y_scale_ == Scale::Log10 && (L.y_hi / L.y_lo) < 1e6)
        for (double t : minor_ticks(L.y_lo, L.y_hi)) {
            double py = snap(L.to_px_y(t));
            canvas.draw_line({x0 - tick_len * 0.55, py}, {x0, py}, colors::axis, 1.0);
        }
    if (x_scale_ == Scale::Log10 && (L.x_hi / L.x_lo) < 1e6)
        for (double t : minor_ticks(L.x_lo, L.x_hi)) {
            double px = snap(L.to_px_x(t));
            canvas.draw_line({px, y1}, {px, y1 + tick_len * 0.55}, colors::axis, 1.0);
        }

    // Series, clipped to the plot area.
    canvas.set_clip({x0 - 0.5, y0 - 0.5, x1 - x0 + 1, y1 - y0 + 1});
    const double marker_size = style_.marker_size > 0 ? style_.marker_size : 3.2 * lw;
    std::vector<Point> occupied;  // pixel positions the legend should avoid
    for (size_t si = 0; si < series_.size(); ++si) {
        const Series& s = series_[si];
        Color col = s.color ? *s.color : palette(si);
        double slw = s.line_width > 0 ? s.line_width : lw;
        Dash dash = s.dashed ? Dash{2.2 * slw, 3.2 * slw} : Dash{};
        std::vector<std::vector<Point>> runs(1);
        for (size_t i = 0; i < s.xs.size(); ++i) {
            if (!placeable(s.xs[i], x_scale_) || !placeable(s.ys[i], y_scale_)) {
                if (!runs.back().empty()) runs.emplace_back();
                continue;
            }
            runs.back().push_back({L.to_px_x(s.xs[i]), L.to_px_y(s.ys[i])});
        }
        for (const auto& run : runs) {
            if (run.size() >= 2) {
                canvas.draw_polyline(run, col, slw, dash);
                for (size_t i = 0; i + 1 < run.size(); ++i) {
                    // Samples every ~3 px so that the legend placement sees the whole line.
                    int n = std::max(1, static_cast<int>(std::hypot(run[i + 1].x - run[i].x, run[i + 1].y - run[i].y) / 3));
                    for (int k = 0; k < n; ++k)
                        occupied.push_back({run[i].x + (run[i + 1].x - run[i].x) * k / n,
                                            run[i].y + (run[i + 1].y - run[i].y) * k / n});
                }
            }
            if (run.size() == 1 && s.marker == Marker::None) canvas.draw_marker(Marker::Circle, run[0], marker_size, col);
            for (const auto& p : run) {
                if (s.marker != Marker::None) canvas.draw_marker(s.marker, p, marker_size, col);
                occupied.push_back(p);
            }
        }
    }
    canvas.set_clip(area);

    // Frame and ticks.
    canvas.stroke_rect({x0, y0, x1 - x0, y1 - y0}, colors::axis, 1.0);
    for (size_t i = 0; i < xt.ticks.size(); ++i) {
        double px = snap(L.to_px_x(xt.ticks[i]));
        canvas.draw_line({px, y1}, {px, y1 + tick_len}, colors::axis, 1.0);
        if (!xt.labels[i].empty())
            canvas.draw_text(xt.labels[i], px, y1 + tick_len + tick_size * 0.25, tick_size, colors::text, HAlign::Center,
                             VAlign::Top);
    }
    for (size_t i = 0; i < yt.ticks.size(); ++i) {
        double py = snap(L.to_px_y(yt.ticks[i]));
        canvas.draw_line({x0 - tick_len, py}, {x0, py}, colors::axis, 1.0);
        if (!yt.labels[i].empty())
            canvas.draw_text(yt.labels[i], x0 - tick_len - tick_size * 0.3, py, tick_size, colors::text, HAlign::Right,
                             VAlign::Middle);
    }
    // Title and axis labels.
    if (!title_.empty()) {
        double cx = std::clamp((x0 + x1) / 2, area.x + pad + measure_text(title_, tsize).width / 2,
                               area.right() - pad - measure_text(title_, tsize).width / 2);
        canvas.draw_text(title_, cx, top, tsize, colors::text, HAlign::Center, VAlign::Top);
    }
    if (!x_label_.empty())
        canvas.draw_text(x_label_, (x0 + x1) / 2, area.bottom() - pad, xlabel_size, colors::text, HAlign::Center,
                         VAlign::Bottom);
    if (!y_label_.empty())
        canvas.draw_text(y_label_, area.x + pad, (y0 + y1) / 2, ylabel_size, colors::text, HAlign::Left, VAlign::Middle,
                         true);

    // Legend.
    L.legend = {};
    bool any_name = std::any_of(series_.begin(), series_.end(), [](const Series& s) { return !s.name.empty(); });
    if (legend_ != LegendPosition::None && any_name) {
        const double row_h = legend_size * 1.45, sample_w = legend_size * 2.2, inner = legend_size * 0.55;
        double name_w = 0;
        for (const auto& s : series_) name_w = std::max(name_w, measure_text(s.name, legend_size).width);
        double bw = inner * 2 + sample_w + legend_size * 0.5 + name_w;
        double bh = inner * 2 + row_h * series_.size() - (row_h - legend_size * 1.15);
        double inset = legend_size * 0.6;
        auto at = [&](LegendPosition p) {
            bool left = p == LegendPosition::TopLeft || p == LegendPosition::BottomLeft;
            bool upper = p == LegendPosition::TopLeft || p == LegendPosition::TopRight;
            return Rect{left ? x0 + inset : x1 - inset - bw, upper ? y0 + inset : y1 - inset - bh, bw, bh};
        };
        LegendPosition pos = legend_;
        if (pos == LegendPosition::Auto) {
            size_t best = std::numeric_limits<size_t>::max();
            for (auto p : {LegendPosition::TopRight, LegendPosition::TopLeft, LegendPosition::BottomRight,
                           LegendPosition::BottomLeft}) {
                Rect r = at(p);
                size_t hits = 0;
                for (const auto& q : occupied)
                    hits += q.x >= r.x - 3 && q.x <= r.right() + 3 && q.y >= r.y - 3 && q.y <= r.bottom() + 3;
                if (hits < best) best = hits, pos = p;
            }
        }
        Rect box = at(pos);
        box = {std::floor(box.x) + 0.5, std::floor(box.y) + 0.5, std::round(box.w), std::round(box.h)};
        canvas.fill_rect(box, style_.background, 0.92);
        canvas.stroke_rect(box, colors::legend_border, 1.0);
        for (size_t si = 0; si < series_.size(); ++si) {
            const Series& s = series_[si];
            Color col = s.color ? *s.color : palette(si);
            double slw = s.line_width > 0 ? s.line_width : lw;
            double cy = box.y + inner + legend_size * 0.575 + row_h * si;
            double sx0 = box.x + inner, sx1 = sx0 + sample_w;
            canvas.draw_line({sx0, cy}, {sx1, cy}, col, slw, s.dashed ? Dash{2.2 * slw, 3.2 * slw} : Dash{});
            if (s.marker != Marker::None) canvas.draw_marker(s.marker, {(sx0 + sx1) / 2, cy}, marker_size, col);
            canvas.draw_text(s.name, sx1 + legend_size * 0.5, cy, legend_size, colors::text, HAlign::Left, VAlign::Middle);
        }
        L.legend = box;
    }
    canvas.clear_clip();
    layout_ = L;
}

// ---------------------------------------------------------------- figure

Figure::Figure(int rows, int cols) : rows_(rows), cols_(cols) {
    LINVIS_CHECK(rows >= 1 && cols >= 1 && rows * cols <= 256, "plot::Figure: grid must be at least 1 x 1, got ",
                 rows, " x ", cols);
    cells_.resize(static_cast<size_t>(rows) * cols);
}

void Figure::place(int row, int col, std::shared_ptr<Panel> panel) {
    LINVIS_CHECK(row >= 0 && row < rows_ && col >= 0 && col < cols_, "plot::Figure: cell (", row, ", ", col,
                 ") is outside the ", rows_, " x ", cols_, " grid");
    cells_[static_cast<size_t>(row) * cols_ + col] = std::move(panel);
}

namespace {
double figure_title_size(int width, int height) { return std::clamp(std::min(width, height) * 0.05, 12.0, 26.0); }
}  // namespace

Rect Figure::cell(int row, int col, int width, int height) const {
    double top = 0;
    if (!title_.empty()) top = figure_title_size(width, height) * 1.6;
    double cw = static_cast<double>(width) / cols_, ch = (height - top) / rows_;
    return {std::floor(col * cw), std::floor(top + row * ch), std::floor((col + 1) * cw) - std::floor(col * cw),
            std::floor(top + (row + 1) * ch) - std::floor(top + row * ch)};
}

Canvas Figure::render(int width, int height) const {
    Canvas c(width, height);
    if (!title_.empty()) {
        double size = fit_size(title_, figure_title_size(width, height), width - 16);
        c.draw_text(title_, width / 2.0, size * 0.35, size, colors::text, HAlign::Center, VAlign::Top);
    }
    for (int r = 0; r < rows_; ++r)
        for (int k = 0; k < cols_; ++k)
            if (const auto& p = cells_[static_cast<size_t>(r) * cols_ + k]) p->draw(c, cell(r, k, width, height));
    return c;
}

void Figure::save_png(const std::string& path, int width, int height) const { render(width, height).save_png(path); }

// ---------------------------------------------------------------- heat maps

std::vector<float> upsample_bilinear(const float* map, int h, int w, int out_h, int out_w) {
    LINVIS_CHECK(map != nullptr && h >= 1 && w >= 1 && out_h >= 1 && out_w >= 1,
                 "plot::upsample_bilinear: expected a non-empty map and output size, got map ", h, " x ", w, " -> ",
                 out_h, " x ", out_w);
    auto coords = [](int out, int in) {
        std::vector<std::pair<int, float>> c(out);  // (lower index, weight of the upper)
        double scale = static_cast<double>(in) / out;
        for (int i = 0; i < out; ++i) {
            double src = std::max(0.0, (i + 0.5) * scale - 0.5);
            int i0 = std::min(static_cast<int>(src), in - 1);
            c[i] = {i0, i0 + 1 < in ? static_cast<float>(src - i0) : 0.f};
        }
        return c;
    };
    auto cy = coords(out_h, h), cx = coords(out_w, w);
    std::vector<float> out(static_cast<size_t>(out_h) * out_w);
    for (int y = 0; y < out_h; ++y) {
        int y0 = cy[y].first, y1 = std::min(y0 + 1, h - 1);
        float fy = cy[y].second;
        for (int x = 0; x < out_w; ++x) {
            int x0 = cx[x].first, x1 = std::min(x0 + 1, w - 1);
            float fx = cx[x].second;
            float top = map[y0 * w + x0] + fx * (map[y0 * w + x1] - map[y0 * w + x0]);
            float bot = map[y1 * w + x0] + fx * (map[y1 * w + x1] - map[y1 * w + x0]);
            // Blend only when needed so that a NaN neighbour with weight 0 does not spread.
            float v = fx == 0 ? map[y0 * w + x0] : top;
            float vb = fx == 0 ? map[y1 * w + x0] : bot;
            out[static_cast<size_t>(y) * out_w + x] = fy == 0 ? v : v + fy * (vb - v);
        }
    }
    return out;
}

namespace {

std::pair<double, double> resolve_range(const float* map, size_t n, const ValueRange& r, const char* who) {
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (size_t i = 0; i < n; ++i)
        if (std::isfinite(map[i])) lo = std::min<double>(lo, map[i]), hi = std::max<double>(hi, map[i]);
    if (r.lo) lo = *r.lo;
    if (r.hi) hi = *r.hi;
    LINVIS_CHECK(std::isfinite(lo) && std::isfinite(hi), who, ": the map has no finite value and no range was given");
    LINVIS_CHECK(lo <= hi, who, ": value range must satisfy lo <= hi, got [", lo, ", ", hi, "]");
    return {lo, hi};
}

// End label of a colour bar: 3 significant digits, with values that are zero at the
// bar's resolution (e.g. 1e-12 on a [0, 1] bar) shown as 0.
std::string colorbar_label(double v, double lo, double hi) {
    double span = std::max(std::fabs(hi - lo), std::max(std::fabs(lo), std::fabs(hi)) * 1e-6);
    if (span > 0 && std::fabs(v) < span * 1e-4) v = 0;
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", v);
    return buf;
}

// Linear map of [lo, hi] onto [0, 1]; a degenerate range maps everything to 0.5.
double normalise(double v, double lo, double hi) { return hi > lo ? (v - lo) / (hi - lo) : 0.5; }

void check_map(const float* map, int h, int w, const char* who) {
    LINVIS_CHECK(map != nullptr && h >= 1 && w >= 1, who, ": expected a non-empty (h, w) map, got ", h, " x ", w);
}

}  // namespace

Canvas colorize(const float* map, int h, int w, Colormap cm, const ValueRange& range) {
    check_map(map, h, w, "plot::colorize");
    auto [lo, hi] = resolve_range(map, static_cast<size_t>(h) * w, range, "plot::colorize");
    Canvas c(w, h);
    for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
            float v = map[y * w + x];
            c.set_pixel(x, y, colormap_color(cm, std::isfinite(v) ? normalise(v, lo, hi) : kNaN));
        }
    return c;
}

Canvas heatmap_overlay(const uint8_t* image, int height, int width, const float* map, int h, int w, double alpha,
                       Colormap cm, const ValueRange& range) {
    LINVIS_CHECK(image != nullptr && height >= 1 && width >= 1, "plot::heatmap_overlay: expected a non-empty image, got ",
                 height, " x ", width);
    check_map(map, h, w, "plot::heatmap_overlay");
    LINVIS_CHECK(alpha >= 0 && alpha <= 1, "plot::heatmap_overlay: alpha must be in [0, 1], got ", alpha);
    auto [lo, hi] = resolve_range(map, static_cast<size_t>(h) * w, range, "plot::heatmap_overlay");
    std::vector<float> up = upsample_bilinear(map, h, w, height, width);
    Canvas out = Canvas::from_rgb(image, width, height);
    for (int y = 0; y < height; ++y)
        for (int x = 0; x < width; ++x) {
            float v = up[static_cast<size_t>(y) * width + x];
            if (!std::isfinite(v)) continue;
            out.blend_pixel(x, y, colormap_color(cm, normalise(v, lo, hi)), alpha);
        }
    return out;
}

Canvas heatmap_overlay(const Canvas& image, const float* map, int h, int w, double alpha, Colormap cm,
                       const ValueRange& range) {
    return heatmap_overlay(image.rgb().data(), image.height(), image.width(), map, h, w, alpha, cm, range);
}

void draw_colorbar(Canvas& canvas, const Rect& area, Colormap cm, double lo, double hi, double text_size,
                   const std::string& label) {
    LINVIS_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo <= hi, "plot::draw_colorbar: bad range [", lo, ", ", hi, "]");
    if (text_size <= 0) text_size = std::clamp(area.h * 0.06, 9.0, 14.0);
    int x0 = static_cast<int>(std::round(area.x)), x1 = static_cast<int>(std::round(area.right()));
    int y0 = static_cast<int>(std::round(area.y)), y1 = static_cast<int>(std::round(area.bottom()));
    for (int y = y0; y < y1; ++y) {
        double t = 1.0 - (y + 0.5 - y0) / std::max(1, y1 - y0);
        Color c = colormap_color(cm, t);
        for (int x = x0; x < x1; ++x) canvas.set_pixel(x, y, c);
    }
    canvas.stroke_rect({x0 - 0.5, y0 - 0.5, static_cast<double>(x1 - x0 + 1), static_cast<double>(y1 - y0 + 1)},
                       colors::axis, 1.0);
    auto ypos = [&](double v) { return y1 - normalise(v, lo, hi) * (y1 - y0); };
    double tx = x1 + 3 + text_size * 0.35;
    auto label_of = [&](double v) { return colorbar_label(v, lo, hi); };
    double label_w = 0;
    auto tick = [&](double v, const std::string& s) {
        double py = std::floor(ypos(v)) + 0.5;
        canvas.draw_line({static_cast<double>(x1), py}, {x1 + 3.0, py}, colors::axis, 1.0);
        Rect r = canvas.draw_text(s, tx, py, text_size, colors::text, HAlign::Left, VAlign::Middle);
        label_w = std::max(label_w, r.w);
    };
    tick(lo, label_of(lo));
    if (hi > lo) {
        tick(hi, label_of(hi));
        // Intermediate nice values where they do not crowd the end labels.
        std::vector<double> inner = nice_ticks(lo, hi, 5);
        double step = inner.size() >= 2 ? inner[1] - inner[0] : -1;
        for (double v : inner)
            if (ypos(lo) - ypos(v) > text_size * 1.5 && ypos(v) - ypos(hi) > text_size * 1.5)
                tick(v, format_tick(v, step));
    }
    if (!label.empty())
        canvas.draw_text(label, tx + label_w + text_size * 0.5, (y0 + y1) / 2.0, text_size, colors::text, HAlign::Left,
                         VAlign::Middle, true);
}

HeatmapPanel::HeatmapPanel(std::vector<float> map, int h, int w) : map_(std::move(map)), h_(h), w_(w) {
    LINVIS_CHECK(h >= 1 && w >= 1 && map_.size() == static_cast<size_t>(h) * w, "plot::HeatmapPanel: map of ",
                 map_.size(), " values does not match ", h, " x ", w);
}

HeatmapPanel::HeatmapPanel(Canvas image, std::vector<float> map, int h, int w)
    : HeatmapPanel(std::move(map), h, w) {
    LINVIS_CHECK(!image.empty(), "plot::HeatmapPanel: empty image");
    image_ = std::move(image);
}

void HeatmapPanel::draw(Canvas& canvas, const Rect& area) const {
    LINVIS_CHECK(!map_.empty(), "plot::HeatmapPanel '", title_, "': no map");
    auto [lo, hi] = resolve_range(map_.data(), map_.size(), range_, "plot::HeatmapPanel");
    const double base = std::min(area.w, area.h);
    const double pad = std::max(4.0, base * 0.03);
    const double title_size = auto_size(style_.title_size, base, 0.07, 10, 18);
    const double tick_size = auto_size(style_.tick_size, base, 0.055, 8, 13);
    canvas.set_clip(area);
    canvas.fill_rect(area, style_.background);
    double top = area.y + pad;
    if (!title_.empty()) {
        double ts = fit_size(title_, title_size, area.w - 2 * pad);
        canvas.draw_text(title_, area.x + area.w / 2, top, ts, colors::text, HAlign::Center, VAlign::Top);
        top += measure_text(title_, ts).height() + pad * 0.5;
    }
    double bar_w = 0, bar_gap = 0, bar_labels = 0;
    if (colorbar_) {
        bar_w = std::max(8.0, base * 0.045);
        bar_gap = pad;
        for (double v : {lo, hi}) bar_labels = std::max(bar_labels, measure_text(colorbar_label(v, lo, hi), tick_size).width);
        for (double v : nice_ticks(lo, hi, 5))
            bar_labels = std::max(bar_labels, measure_text(format_tick(v, 1e-3), tick_size).width);
        bar_labels += 3 + tick_size * 0.35 + pad * 0.5;
        if (!colorbar_label_.empty()) bar_labels += tick_size * 1.6;
    }
    double avail_w = area.w - 2 * pad - bar_w - bar_gap - bar_labels, avail_h = area.bottom() - pad - top;
    LINVIS_CHECK(avail_w > 4 && avail_h > 4, "plot::HeatmapPanel '", title_, "': area ", area.w, " x ", area.h,
                 " is too small");
    double src_w = image_.empty() ? w_ : image_.width(), src_h = image_.empty() ? h_ : image_.height();
    double scale = std::min(avail_w / src_w, avail_h / src_h);
    int dw = std::max(1, static_cast<int>(std::floor(src_w * scale))), dh = std::max(1, static_cast<int>(std::floor(src_h * scale)));
    double used_w = dw + bar_gap + bar_w + bar_labels;
    int ix = static_cast<int>(std::round(area.x + (area.w - used_w) / 2));
    int iy = static_cast<int>(std::round(top + (avail_h - dh) / 2));
    Canvas picture;
    if (image_.empty()) {
        // Nearest-neighbour cells keep the patch grid visible.
        Canvas cells = colorize(map_.data(), h_, w_, cm_, {lo, hi});
        picture = Canvas(dw, dh);
        for (int y = 0; y < dh; ++y)
            for (int x = 0; x < dw; ++x)
                picture.set_pixel(x, y, cells.pixel(std::min(w_ - 1, x * w_ / dw), std::min(h_ - 1, y * h_ / dh)));
    } else {
        Canvas shown = (dw == image_.width() && dh == image_.height()) ? image_ : image_.resized(dw, dh);
        picture = heatmap_overlay(shown, map_.data(), h_, w_, alpha_, cm_, {lo, hi});
    }
    canvas.blit(picture, ix, iy);
    canvas.stroke_rect({ix - 0.5, iy - 0.5, dw + 1.0, dh + 1.0}, colors::axis, 1.0);
    image_rect_ = {static_cast<double>(ix), static_cast<double>(iy), static_cast<double>(dw), static_cast<double>(dh)};
    if (colorbar_)
        draw_colorbar(canvas, {ix + dw + bar_gap, static_cast<double>(iy), bar_w, static_cast<double>(dh)}, cm_, lo, hi,
                      tick_size, colorbar_label_);
    canvas.clear_clip();
}

}  // namespace linvis::tools::plot
