// Heat maps: bilinear upsampling, colouring, overlays, colour bars and panels (see linvis/plot/plot.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "internal.h"
#include "linvis/core/error.h"
#include "linvis/plot/plot.h"

namespace linvis::plot {

using detail::auto_size;
using detail::fit_size;

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
            c.set_pixel(x, y, colormap_color(cm, std::isfinite(v) ? normalise(v, lo, hi) : std::nan("")));
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

}  // namespace linvis::plot
