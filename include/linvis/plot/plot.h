// The plotting library (target linvis_plot, kept out of liblinvis): an RGB canvas, line charts,
// heat maps and PNG output. It depends on liblinvis (images, tensors, the atomic writer), never the
// other way round; the linvis program and the tests link it.
//
// Used for the benchmark figures (throughput / peak memory vs resolution, one line per
// model), training curves (loss / accuracy / lr vs epoch) and interpretability pictures
// (a patch-grid heat map blended over the input image, with a colour bar).
//
// Coordinates are in pixels, x to the right, y downwards, with pixel (i, j) covering
// [i, i+1) x [j, j+1); its centre is (i + 0.5, j + 0.5). Shapes are antialiased by
// exact-enough coverage: each pixel is blended with coverage = clamp(w/2 + 0.5 - d, 0, 1),
// d being the distance from the pixel centre to the shape.
//
// Text uses stb_truetype with DejaVu Sans (Debian fonts-dejavu-core). When that font
// cannot be read, text falls back to stb_easy_font (ASCII only, blocky but legible),
// so labels never disappear silently; font_status() says which one is in use.
//
// All failures (empty data, mismatched lengths, unwritable or unreadable files) throw
// linvis::Error naming the chart / path and the problem.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace at {
class Tensor;
}

namespace linvis::plot {

// ------------------------------------------------------------------ colours

struct Color {
    uint8_t r = 0, g = 0, b = 0;
    bool operator==(const Color& o) const { return r == o.r && g == o.g && b == o.b; }
    bool operator!=(const Color& o) const { return !(*this == o); }
};

namespace colors {
constexpr Color white{255, 255, 255};
constexpr Color black{0, 0, 0};
constexpr Color text{34, 34, 34};
constexpr Color axis{64, 64, 64};
constexpr Color grid{228, 228, 228};
constexpr Color legend_border{190, 190, 190};
}  // namespace colors

// The i-th colour (cyclic) of the Okabe-Ito palette (Okabe & Ito 2008), which stays
// distinguishable under the common colour-vision deficiencies. Order: blue, vermillion,
// bluish green, reddish purple, orange, sky blue, yellow, black.
Color palette(size_t index);
size_t palette_size();

// "#RRGGBB" or "RRGGBB" -> Color; throws on anything else.
Color parse_color(const std::string& hex);

enum class Colormap {
    Viridis,   // perceptually uniform sequential (van der Walt & Smith), dark purple -> yellow
    CoolWarm,  // diverging blue -> light grey -> red (Moreland 2009, interpolated in Msh space)
    Gray,      // black -> white
};

// Colour of `cm` at t in [0, 1] (clamped). NaN maps to mid grey (128, 128, 128).
// Viridis is looked up like matplotlib does: entry min(255, floor(t * 256)) of its published table,
// rounded to bytes. CoolWarm is computed with Moreland's Msh formula from its two published end
// colours (within 1/255 of matplotlib's coolwarm, 4/255 near the red end where matplotlib
// interpolates linearly between Moreland's 33 samples).
Color colormap_color(Colormap cm, double t);
std::string colormap_name(Colormap cm);

// A colour map as published: 256 RGB entries in [0, 1].
using ColormapTable = std::array<std::array<double, 3>, 256>;
// matplotlib's viridis table (van der Walt & Smith; CC0 data), entry for entry.
const ColormapTable& viridis_table();

// ------------------------------------------------------------------ canvas

struct Rect {
    double x = 0, y = 0, w = 0, h = 0;
    double right() const { return x + w; }
    double bottom() const { return y + h; }
};

struct Point {
    double x = 0, y = 0;
};

enum class HAlign { Left, Center, Right };
// Baseline aligns the text's baseline; Middle centres the height of a digit on y.
enum class VAlign { Top, Middle, Baseline, Bottom };

enum class Marker { None, Circle, Square, Triangle, Diamond };

// Dash pattern in pixels: on, off, on, off ... Empty means solid.
using Dash = std::vector<double>;

struct TextSize {
    double width = 0;    // advance width in pixels
    double ascent = 0;   // pixels above the baseline
    double descent = 0;  // pixels below the baseline (positive)
    double height() const { return ascent + descent; }
};

class Canvas {
public:
    Canvas() = default;
    // Throws when width or height is not in [1, 32768].
    Canvas(int width, int height, Color background = colors::white);
    // From interleaved RGB rows (height * width * 3 bytes, row stride width * 3).
    static Canvas from_rgb(const uint8_t* rgb, int width, int height);

    int width() const { return width_; }
    int height() const { return height_; }
    bool empty() const { return width_ == 0 || height_ == 0; }
    const std::vector<uint8_t>& rgb() const { return rgb_; }
    std::vector<uint8_t>& rgb() { return rgb_; }

    // Throws when (x, y) is outside the canvas.
    Color pixel(int x, int y) const;
    // Ignored outside the canvas (drawing is clipped).
    void set_pixel(int x, int y, Color c);
    // pixel = (1 - alpha) * pixel + alpha * c, alpha clamped to [0, 1].
    void blend_pixel(int x, int y, Color c, double alpha);

    void fill(Color c);
    // Axis-aligned rectangle; fractional edges are covered partially.
    void fill_rect(const Rect& r, Color c, double alpha = 1.0);
    // Outline whose stroke is centred on the rectangle's edges.
    void stroke_rect(const Rect& r, Color c, double line_width = 1.0);
    // A straight segment with round caps; dashed when `dash` is not empty.
    void draw_line(Point a, Point b, Color c, double line_width = 1.0, const Dash& dash = {});
    // Connected segments with round joins, blended once (no darker overlaps at joins).
    void draw_polyline(const std::vector<Point>& points, Color c, double line_width = 1.0,
                       const Dash& dash = {});
    void fill_circle(Point centre, double radius, Color c);
    void fill_polygon(const std::vector<Point>& points, Color c);
    // A marker of the given diameter-like size (pixels) centred on `centre`.
    void draw_marker(Marker m, Point centre, double size, Color c);

    // Draws one line of UTF-8 text (control characters become spaces) with its anchor at
    // (x, y); size is the font's pixel height (ascent + descent). rotate_ccw draws it reading
    // bottom-to-top (for vertical axis labels), the anchor then refers to the rotated box.
    // Returns the box drawn (before clipping).
    Rect draw_text(const std::string& text, double x, double y, double size, Color c,
                   HAlign h = HAlign::Left, VAlign v = VAlign::Baseline, bool rotate_ccw = false);

    // Restricts all drawing to `r` (intersected with the canvas) until clear_clip().
    void set_clip(const Rect& r);
    void clear_clip();

    // Copies `src` with its top-left corner at (x, y), clipped.
    void blit(const Canvas& src, int x, int y);
    // Bilinear resampling to a new size (pixel-centre aligned, like align_corners=False);
    // shrinking by more than 2x averages pixel blocks first to avoid aliasing.
    Canvas resized(int width, int height) const;

    // Writes an 8-bit RGB PNG (io::encode_image) atomically (io::write_file_atomically). Throws
    // linvis::Error naming `path` when it cannot be written.
    void save_png(const std::string& path) const;

private:
    int width_ = 0, height_ = 0;
    int clip_x0_ = 0, clip_y0_ = 0, clip_x1_ = 0, clip_y1_ = 0;  // half-open pixel range
    std::vector<uint8_t> rgb_;
};

// Reads a PNG (or a JPEG / BMP; io::read_image) as RGB. Throws linvis::Error naming the path.
Canvas load_png(const std::string& path);

// Width / ascent / descent of `text` at pixel height `size` in the current font.
TextSize measure_text(const std::string& text, double size);

// Where fonts come from. The default TrueType path is $LINVIS_FONT when set, else DejaVu Sans
// from fonts-dejavu-core; set_font_path("") or an unreadable file selects the built-in
// stb_easy_font fallback. The font is loaded once and shared (thread-safe).
std::string default_font_path();
void set_font_path(const std::string& path);
// "truetype:<path>" or "fallback:stb_easy_font (<reason>)".
std::string font_status();
bool using_truetype_font();

// ------------------------------------------------------------------ figures

// Anything that draws itself into a rectangle of a canvas (a chart, a heat-map panel).
class Panel {
public:
    virtual ~Panel() = default;
    virtual void draw(Canvas& canvas, const Rect& area) const = 0;
    // Renders alone onto a white canvas of the given size.
    Canvas render(int width, int height) const;
    void save_png(const std::string& path, int width, int height) const;
};

// Font sizes (pixels) and spacing; 0 means "derived from the panel size".
struct Style {
    double title_size = 0;
    double label_size = 0;
    double tick_size = 0;
    double legend_size = 0;
    double line_width = 2.0;
    double marker_size = 0;  // 0: 3.2 * line_width
    Color background = colors::white;
};

enum class Scale { Linear, Log10 };
enum class LegendPosition { Auto, TopLeft, TopRight, BottomLeft, BottomRight, None };

struct Series {
    std::string name;
    std::vector<double> xs, ys;  // same length; non-finite y (or x) values leave a gap
    std::optional<Color> color;  // default: palette(index of the series)
    Marker marker = Marker::None;
    bool dashed = false;
    double line_width = 0;       // 0: the chart's style line width
};

// A 2-D line chart with linear or log10 axes, "nice" ticks, grid and legend.
//
// Axis limits are the finite data range padded by 4% (in log space for log axes), unless
// set explicitly. On a log axis non-positive values cannot be placed and are treated as
// gaps. A point with no finite neighbour (including a one-point series) is drawn as a
// marker so that it stays visible.
class LineChart : public Panel {
public:
    LineChart() = default;
    explicit LineChart(std::string title) : title_(std::move(title)) {}

    LineChart& title(std::string t) { title_ = std::move(t); return *this; }
    LineChart& x_label(std::string s) { x_label_ = std::move(s); return *this; }
    LineChart& y_label(std::string s) { y_label_ = std::move(s); return *this; }
    LineChart& x_scale(Scale s) { x_scale_ = s; return *this; }
    LineChart& y_scale(Scale s) { y_scale_ = s; return *this; }
    LineChart& x_range(double lo, double hi);
    LineChart& y_range(double lo, double hi);
    // Makes the linear y axis start at 0 (when all data are positive); off by default.
    LineChart& y_include_zero(bool on = true) { y_include_zero_ = on; return *this; }
    // Explicit tick positions (e.g. the measured resolutions 224, 384, 512, 768).
    LineChart& x_ticks(std::vector<double> ticks) { x_ticks_ = std::move(ticks); return *this; }
    LineChart& y_ticks(std::vector<double> ticks) { y_ticks_ = std::move(ticks); return *this; }
    LineChart& legend(LegendPosition p) { legend_ = p; return *this; }
    LineChart& grid(bool on) { grid_ = on; return *this; }
    LineChart& style(const Style& s) { style_ = s; return *this; }

    // Adds a series; throws when xs and ys differ in length.
    LineChart& add(Series s);
    LineChart& add(const std::string& name, std::vector<double> xs, std::vector<double> ys,
                   Marker marker = Marker::None);

    const std::vector<Series>& series() const { return series_; }

    // Throws linvis::Error when there is no finite point to plot.
    void draw(Canvas& canvas, const Rect& area) const override;

    // Where the last draw() put the plot area and how it maps data to pixels (for tests
    // and for annotating on top of a chart).
    struct Layout {
        Rect plot;            // the axes' inner rectangle
        Rect legend;          // legend box (w = h = 0 when none)
        double x_lo = 0, x_hi = 1, y_lo = 0, y_hi = 1;  // axis limits in data units
        Scale x_scale = Scale::Linear, y_scale = Scale::Linear;
        std::vector<double> x_ticks, y_ticks;            // major ticks drawn
        std::vector<std::string> x_tick_labels, y_tick_labels;  // per tick; "" where thinned out
        double to_px_x(double x) const;
        double to_px_y(double y) const;
    };
    const Layout& last_layout() const { return layout_; }

private:
    std::string title_, x_label_, y_label_;
    Scale x_scale_ = Scale::Linear, y_scale_ = Scale::Linear;
    std::optional<std::pair<double, double>> x_range_, y_range_;
    std::vector<double> x_ticks_, y_ticks_;
    bool y_include_zero_ = false;
    LegendPosition legend_ = LegendPosition::Auto;
    bool grid_ = true;
    Style style_;
    std::vector<Series> series_;
    mutable Layout layout_;
};

// "Nice" tick positions covering [lo, hi] with about `target` ticks on a linear axis:
// steps of 1, 2, 2.5 or 5 times a power of ten. Only ticks inside [lo, hi] are returned.
std::vector<double> nice_ticks(double lo, double hi, int target = 6);
// Ticks on a log10 axis covering [lo, hi] (lo > 0): the powers of ten inside; when fewer
// than two fit, also 2x and 5x multiples; when there are too many, every k-th power; when even
// the 1..9 multiples give fewer than two (a range like [213.9, 214.4]), nice_ticks.
std::vector<double> log_ticks(double lo, double hi, int target = 6);
// Tick label text: trailing zeros removed, "1e+06"-style only for very large / small values.
std::string format_tick(double value, double step);

// A grid of panels with an optional overall title. Empty cells stay blank.
class Figure {
public:
    Figure(int rows, int cols);
    Figure& title(std::string t) { title_ = std::move(t); return *this; }
    // Places a panel (copied) in cell (row, col); throws when the cell is out of range.
    template <typename P>
    P& set(int row, int col, P panel) {
        auto owned = std::make_shared<P>(std::move(panel));
        P& ref = *owned;
        place(row, col, std::move(owned));
        return ref;
    }
    int rows() const { return rows_; }
    int cols() const { return cols_; }
    // The cell rectangle of (row, col) on a canvas of the given size.
    Rect cell(int row, int col, int width, int height) const;
    Canvas render(int width, int height) const;
    void save_png(const std::string& path, int width, int height) const;

private:
    void place(int row, int col, std::shared_ptr<Panel> panel);
    int rows_, cols_;
    std::string title_;
    std::vector<std::shared_ptr<Panel>> cells_;
};

// ------------------------------------------------------------------ heat maps

// Value range used to normalise a map to [0, 1]; unset ends come from the map's finite
// min / max.
struct ValueRange {
    std::optional<double> lo, hi;
};

// Samples the (h, w) row-major map at the centre of every pixel of an (out_h, out_w) grid
// with bilinear interpolation, pixel-centre aligned and edge-clamped: the same as
// torch.nn.functional.interpolate(mode="bilinear", align_corners=False).
std::vector<float> upsample_bilinear(const float* map, int h, int w, int out_h, int out_w);

// Colours an (h, w) map with `cm` after normalising by `range`, one pixel per value.
Canvas colorize(const float* map, int h, int w, Colormap cm, const ValueRange& range = {});

// Blends a heat map over an image: out = (1 - alpha) * image + alpha * colormap(norm(map↑)),
// with map↑ the bilinear upsampling of the (h, w) map to the image size and norm() the
// linear map of `range` onto [0, 1] (clamped). Each channel is rounded to nearest.
// `image` is interleaved RGB uint8 of (height, width, 3). Pixels whose interpolation touches a
// NaN map value are left as they are.
Canvas heatmap_overlay(const uint8_t* image, int height, int width, const float* map, int h,
                       int w, double alpha = 0.5, Colormap cm = Colormap::Viridis,
                       const ValueRange& range = {});
Canvas heatmap_overlay(const Canvas& image, const float* map, int h, int w, double alpha = 0.5,
                       Colormap cm = Colormap::Viridis, const ValueRange& range = {});
// Tensor forms: image uint8 (H, W, 3) and map (h, w) of any floating type (CPU or not; both
// are copied to contiguous CPU). Throws naming the tensor and its shape / dtype otherwise.
Canvas canvas_from_tensor(const at::Tensor& image_hwc_uint8);
Canvas heatmap_overlay(const at::Tensor& image_hwc_uint8, const at::Tensor& map_hw,
                       double alpha = 0.5, Colormap cm = Colormap::Viridis,
                       const ValueRange& range = {});

// A vertical colour bar in `area`: gradient strip with tick labels at lo, hi (and the
// middle when it fits) to its right.
void draw_colorbar(Canvas& canvas, const Rect& area, Colormap cm, double lo, double hi,
                   double text_size = 0, const std::string& label = "");

// A heat map shown on its own or over an image, with a title and an optional colour bar.
class HeatmapPanel : public Panel {
public:
    HeatmapPanel() = default;
    // Only the map (shown with nearest-neighbour cells so the patch grid stays visible).
    HeatmapPanel(std::vector<float> map, int h, int w);
    // Map over an image.
    HeatmapPanel(Canvas image, std::vector<float> map, int h, int w);

    HeatmapPanel& title(std::string t) { title_ = std::move(t); return *this; }
    HeatmapPanel& alpha(double a) { alpha_ = a; return *this; }
    HeatmapPanel& colormap(Colormap cm) { cm_ = cm; return *this; }
    HeatmapPanel& range(ValueRange r) { range_ = r; return *this; }
    HeatmapPanel& colorbar(bool on, std::string label = "") {
        colorbar_ = on;
        colorbar_label_ = std::move(label);
        return *this;
    }
    HeatmapPanel& style(const Style& s) { style_ = s; return *this; }

    void draw(Canvas& canvas, const Rect& area) const override;
    // The rectangle the picture occupied at the last draw() (for tests).
    const Rect& last_image_rect() const { return image_rect_; }

private:
    Canvas image_;
    std::vector<float> map_;
    int h_ = 0, w_ = 0;
    std::string title_, colorbar_label_;
    double alpha_ = 0.5;
    Colormap cm_ = Colormap::Viridis;
    ValueRange range_;
    bool colorbar_ = true;
    Style style_;
    mutable Rect image_rect_;
};

}  // namespace linvis::plot
