// Canvas primitives, text and PNG files (see linvis/plot/plot.h).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>

#include <stb_truetype.h>

// stb_easy_font is a header of static functions and tables; not all of them are used here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-variable"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#include <stb_easy_font.h>
#pragma GCC diagnostic pop

#include "internal.h"
#include "linvis/core/error.h"
#include "linvis/io/atomic_file.h"
#include "linvis/io/image.h"
#include "linvis/plot/plot.h"

namespace linvis::plot {

using detail::clamp01;
using detail::to_byte;

namespace {

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
    // from_blob does not copy; encode_image only reads the pixels.
    auto pixels = torch::from_blob(const_cast<uint8_t*>(rgb_.data()), {height_, width_, 3}, torch::kUInt8);
    std::vector<uint8_t> png = io::encode_image(pixels, io::ImageFormat::Png);
    try {
        io::write_file_atomically(path, std::string_view(reinterpret_cast<const char*>(png.data()), png.size()));
    } catch (const Error& e) {
        fail("plot: cannot write '", path, "': ", e.what());
    }
}

Canvas load_png(const std::string& path) { return canvas_from_tensor(io::read_image(path)); }

}  // namespace linvis::plot
