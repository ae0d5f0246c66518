// Panels, ticks, line charts and figures (see linvis/plot/plot.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "internal.h"
#include "linvis/core/error.h"
#include "linvis/plot/plot.h"

namespace linvis::plot {

namespace detail {

double auto_size(double given, double base, double factor, double lo, double hi) {
    if (given > 0) return given;
    return std::clamp(base * factor, lo, hi);
}

double fit_size(const std::string& text, double size, double max_width) {
    while (size > 7 && measure_text(text, size).width > max_width) size *= 0.92;
    return size;
}

}  // namespace detail

using detail::auto_size;
using detail::fit_size;

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
    // A range narrower than one 1..9 step (a peak memory of 214.0 to 214.3 MiB) would get no tick
    // and no label: linear nice ticks then, which are positive here.
    if (out.size() < 2) {
        std::vector<double> linear = nice_ticks(lo, hi, target);
        if (linear.size() > out.size()) out = linear;
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

}  // namespace linvis::plot
