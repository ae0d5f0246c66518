// Plotting module: canvas primitives, text, line charts (linear / log axes, gaps, legend),
// heat maps (colormaps, bilinear upsampling, overlay blending), PNG output and errors.
//
// The gallery test at the end renders the pictures shown in docs/plotting.md; to refresh
// them run:  LINVIS_PLOT_GALLERY_DIR=docs/images build/tests/test_plot --gtest_filter='Plot.Gallery*'
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "linvis/core/error.h"
#include "linvis/plot/plot.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using linvis::Error;
using namespace linvis::plot;

using linvis::testing::TempDir;

namespace {

const double NaN = std::nan("");


// Restores the default font whatever the test does.
struct FontGuard {
    ~FontGuard() { set_font_path(default_font_path()); }
};

bool near(Color a, Color b, int tol) {
    return std::abs(a.r - b.r) <= tol && std::abs(a.g - b.g) <= tol && std::abs(a.b - b.b) <= tol;
}

bool is_dark(Color c) { return c.r < 110 && c.g < 110 && c.b < 110; }

int count_color(const Canvas& c, const Rect& r, Color col) {
    int n = 0;
    for (int y = std::max(0, int(r.y)); y < std::min(c.height(), int(r.bottom())); ++y)
        for (int x = std::max(0, int(r.x)); x < std::min(c.width(), int(r.right())); ++x) n += c.pixel(x, y) == col;
    return n;
}

int count_dark(const Canvas& c, const Rect& r) {
    int n = 0;
    for (int y = std::max(0, int(r.y)); y < std::min(c.height(), int(r.bottom())); ++y)
        for (int x = std::max(0, int(r.x)); x < std::min(c.width(), int(r.right())); ++x) n += is_dark(c.pixel(x, y));
    return n;
}

std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const Error& e) {
        return e.what();
    }
    return "<no error>";
}

}  // namespace

// ------------------------------------------------------------------ canvas

TEST(Plot, CanvasBackgroundAndFilledRect) {
    Canvas c(40, 30, Color{10, 20, 30});
    EXPECT_EQ(c.pixel(0, 0), (Color{10, 20, 30}));
    EXPECT_EQ(c.pixel(39, 29), (Color{10, 20, 30}));
    c.fill_rect({5, 5, 10, 4}, colors::white);
    EXPECT_EQ(c.pixel(5, 5), colors::white);
    EXPECT_EQ(c.pixel(14, 8), colors::white);
    EXPECT_EQ(c.pixel(15, 8), (Color{10, 20, 30}));
    EXPECT_EQ(c.pixel(14, 9), (Color{10, 20, 30}));
    // A half-covered column is blended half way: 10 + 0.5 * (255 - 10) = 132.5 -> 133 (rounded).
    c.fill_rect({20.5, 0, 3, 2}, colors::white);
    EXPECT_EQ(c.pixel(20, 0).r, 133);
    EXPECT_EQ(c.pixel(21, 0), colors::white);
    EXPECT_THROW(c.pixel(40, 0), Error);
    EXPECT_THROW(Canvas(0, 10), Error);
}

TEST(Plot, AntialiasedLinesAreCrispOnPixelCentresAndSmoothOnDiagonals) {
    Canvas c(50, 50);
    const Color red{200, 0, 0};
    c.draw_line({2, 10.5}, {47, 10.5}, red, 1.0);  // along the centres of row 10
    for (int x = 3; x < 47; ++x) {
        EXPECT_EQ(c.pixel(x, 10), red) << x;
        EXPECT_EQ(c.pixel(x, 9), colors::white) << x;
        EXPECT_EQ(c.pixel(x, 11), colors::white) << x;
    }
    c.draw_line({5, 20}, {45, 45}, red, 1.5);
    int partial = 0, full = 0;
    for (int y = 15; y < 50; ++y)
        for (int x = 0; x < 50; ++x) {
            Color p = c.pixel(x, y);
            full += p == red;
            partial += p != red && p != colors::white;
        }
    EXPECT_GT(full, 10);
    EXPECT_GT(partial, 30);  // antialiased edge pixels exist
}

TEST(Plot, DashedLineHasGapsSolidLineHasNone) {
    Canvas c(200, 20);
    c.draw_line({0, 5.5}, {200, 5.5}, colors::black, 2.0);
    c.draw_line({0, 14.5}, {200, 14.5}, colors::black, 2.0, Dash{6, 6});
    int solid_gaps = 0, dashed_gaps = 0, dashed_on = 0;
    for (int x = 2; x < 198; ++x) {
        solid_gaps += c.pixel(x, 5) == colors::white;
        dashed_gaps += c.pixel(x, 14) == colors::white;
        dashed_on += c.pixel(x, 14) == colors::black;
    }
    EXPECT_EQ(solid_gaps, 0);
    EXPECT_GT(dashed_gaps, 40);
    EXPECT_GT(dashed_on, 40);
}

TEST(Plot, MarkersAndCirclesCoverTheirCentre) {
    Canvas c(60, 20);
    const Color blue{0, 0, 200};
    int x = 5;
    for (Marker m : {Marker::Circle, Marker::Square, Marker::Triangle, Marker::Diamond}) {
        c.draw_marker(m, {x + 0.5, 10.5}, 8, blue);
        EXPECT_EQ(c.pixel(x, 10), blue) << int(m);
        EXPECT_EQ(c.pixel(x + 7, 10), colors::white) << int(m);
        x += 14;
    }
}

TEST(Plot, TextUsesDejaVuAndStaysInsideItsBox) {
    ASSERT_TRUE(using_truetype_font()) << font_status() << " (install fonts-dejavu-core)";
    Canvas c(200, 60);
    Rect box = c.draw_text("Throughput 224", 10, 30, 16, colors::black, HAlign::Left, VAlign::Baseline);
    TextSize m = measure_text("Throughput 224", 16);
    EXPECT_NEAR(box.w, m.width, 1e-9);
    EXPECT_GT(m.width, 80);
    EXPECT_LT(m.width, 160);
    EXPECT_GT(count_dark(c, box), 60);
    // Nothing drawn well outside the box.
    EXPECT_EQ(count_dark(c, {0, 0, 200, box.y - 2}), 0);
    EXPECT_EQ(count_dark(c, {box.right() + 2, 0, 200, 60}), 0);
    // Centred / right alignment move the box by half / all of its width.
    Canvas d(200, 60);
    Rect centred = d.draw_text("abc", 100, 30, 16, colors::black, HAlign::Center, VAlign::Middle);
    EXPECT_NEAR(centred.x + centred.w / 2, 100, 1e-9);
    Rect right = d.draw_text("abc", 100, 50, 16, colors::black, HAlign::Right, VAlign::Baseline);
    EXPECT_NEAR(right.right(), 100, 1e-9);
    // Rotated text is tall and narrow.
    Canvas e(60, 200);
    Rect rot = e.draw_text("vertical label", 30, 100, 14, colors::black, HAlign::Center, VAlign::Middle, true);
    EXPECT_GT(rot.h, 3 * rot.w);
    EXPECT_GT(count_dark(e, {rot.x - 1, rot.y - 1, rot.w + 2, rot.h + 2}), 40);
    EXPECT_EQ(count_dark(e, {0, 0, 60, rot.y - 3}), 0);
}

TEST(Plot, TextFallsBackToEasyFontWhenTheFontIsMissing) {
    FontGuard guard;
    set_font_path("/nonexistent/linvis-no-font.ttf");
    EXPECT_FALSE(using_truetype_font());
    EXPECT_NE(font_status().find("fallback"), std::string::npos);
    EXPECT_NE(font_status().find("/nonexistent/linvis-no-font.ttf"), std::string::npos);
    Canvas c(200, 40);
    Rect box = c.draw_text("Loss 0.25", 10, 20, 14, colors::black, HAlign::Left, VAlign::Middle);
    EXPECT_GT(box.w, 40);
    EXPECT_GT(count_dark(c, box), 40);  // text did not silently disappear
    set_font_path(default_font_path());
    EXPECT_TRUE(using_truetype_font());
}

// ------------------------------------------------------------------ ticks

TEST(Plot, NiceTicksAndLabels) {
    auto unit = nice_ticks(0, 1, 6);
    ASSERT_EQ(unit.size(), 6u);
    for (int i = 0; i < 6; ++i) EXPECT_NEAR(unit[i], 0.2 * i, 1e-12);
    auto t = nice_ticks(0, 97, 6);
    ASSERT_EQ(t.size(), 5u);
    EXPECT_DOUBLE_EQ(t[1], 20);
    EXPECT_DOUBLE_EQ(t.back(), 80);
    auto neg = nice_ticks(-3.7, 2.2, 5);
    EXPECT_EQ(neg, (std::vector<double>{-2, 0, 2}));
    EXPECT_EQ(log_ticks(0.8, 1500), (std::vector<double>{1, 10, 100, 1000}));
    EXPECT_EQ(log_ticks(30, 300), (std::vector<double>{50, 100, 200}));
    // Narrower than one 1..9 step: linear nice ticks instead of none.
    auto narrow = log_ticks(213.9, 214.4);
    ASSERT_GE(narrow.size(), 2u);
    for (double t : narrow) EXPECT_TRUE(t >= 213.9 && t <= 214.4) << t;
    EXPECT_EQ(format_tick(0.5, 0.25), "0.50");
    EXPECT_EQ(format_tick(40, 20), "40");
    EXPECT_EQ(format_tick(2e6, 1e6), "2e6");
    EXPECT_EQ(format_tick(2.5e-5, -1), "2.5e-5");
    EXPECT_EQ(format_tick(0, 0.1), "0");
    EXPECT_EQ(format_tick(1000, -1), "1000");
}

// ------------------------------------------------------------------ charts

TEST(Plot, HorizontalSeriesAppearsAtTheComputedPixelRow) {
    LineChart chart("flat");
    chart.add("flat", {0, 10}, {5, 5}).add("rising", {0, 10}, {0, 10}).legend(LegendPosition::None);
    Canvas c = chart.render(400, 300);
    const auto& L = chart.last_layout();
    EXPECT_EQ(c.pixel(0, 0), colors::white);
    EXPECT_EQ(c.pixel(399, 0), colors::white);
    EXPECT_EQ(c.pixel(0, 299), colors::white);
    EXPECT_EQ(c.pixel(399, 299), colors::white);
    int row = int(std::floor(L.to_px_y(5)));
    EXPECT_GT(row, L.plot.y + 0.3 * L.plot.h);
    EXPECT_LT(row, L.plot.y + 0.7 * L.plot.h);
    int hits = 0, tried = 0;
    double cross = L.to_px_x(5);  // where the rising line crosses
    for (int x = int(L.to_px_x(0)) + 2; x < int(L.to_px_x(10)) - 2; ++x) {  // the data's x extent
        if (std::fabs(x - cross) < 6) continue;
        ++tried;
        hits += c.pixel(x, row) == palette(0);
    }
    EXPECT_EQ(hits, tried);
    EXPECT_EQ(count_color(c, {L.plot.x + 2, row - 12.0, L.plot.w - 4, 6}, palette(0)), 0);
    // The rising line passes through the plot's lower-left and upper-right data corners.
    EXPECT_TRUE(near(c.pixel(int(L.to_px_x(1)), int(L.to_px_y(1))), palette(1), 60));
    EXPECT_TRUE(near(c.pixel(int(L.to_px_x(9)), int(L.to_px_y(9))), palette(1), 60));
}

TEST(Plot, LogScaleTicksArePowersOfTenEquallySpaced) {
    LineChart chart("log");
    chart.y_scale(Scale::Log10).add("decay", {1, 2, 3, 4}, {1000, 100, 10, 1}).legend(LegendPosition::None);
    Canvas c = chart.render(400, 400);
    const auto& L = chart.last_layout();
    ASSERT_EQ(L.y_ticks, (std::vector<double>{1, 10, 100, 1000}));
    double d1 = L.to_px_y(1) - L.to_px_y(10), d2 = L.to_px_y(10) - L.to_px_y(100), d3 = L.to_px_y(100) - L.to_px_y(1000);
    EXPECT_NEAR(d1, d2, 1e-9);
    EXPECT_NEAR(d2, d3, 1e-9);
    EXPECT_GT(d1, 50);
    // Grid lines at the powers of ten, at the right edge where the series is not.
    for (double t : {10.0, 100.0}) EXPECT_EQ(c.pixel(int(L.plot.right()) - 5, int(std::floor(L.to_px_y(t)))), colors::grid) << t;
    // Tick labels exist left of the axis next to each tick.
    for (double t : L.y_ticks) {
        double py = L.to_px_y(t);
        EXPECT_GT(count_dark(c, {L.plot.x - 45, py - 6, 36, 12}), 5) << t;
    }
    // Non-positive values cannot be placed on a log axis: they become gaps, not errors.
    LineChart with_zero;
    with_zero.y_scale(Scale::Log10).add("z", {1, 2, 3}, {10, 0, 100});
    EXPECT_NO_THROW(with_zero.render(200, 150));
    LineChart only_zero;
    only_zero.y_scale(Scale::Log10).add("z", {1, 2}, {0, -1});
    EXPECT_NE(error_of([&] { only_zero.render(200, 150); }).find("positive"), std::string::npos);
}

TEST(Plot, LegendHoldsTextAndSamplesInsideItsBox) {
    LineChart chart("legend");
    chart.add("alpha model", {0, 1, 2}, {0, 1, 2}).add("beta model", {0, 1, 2}, {0, 0.5, 1}, Marker::Square);
    Canvas c = chart.render(500, 350);
    const auto& L = chart.last_layout();
    ASSERT_GT(L.legend.w, 40);
    ASSERT_GT(L.legend.h, 20);
    // Inside the plot, and in the upper-left (the data occupy the lower-right half).
    EXPECT_GE(L.legend.x, L.plot.x);
    EXPECT_LE(L.legend.bottom(), L.plot.bottom());
    EXPECT_LT(L.legend.x + L.legend.w / 2, L.plot.x + L.plot.w / 2);
    EXPECT_LT(L.legend.y + L.legend.h / 2, L.plot.y + L.plot.h / 2);
    Rect text_area{L.legend.x + L.legend.w * 0.35, L.legend.y + 1, L.legend.w * 0.65 - 2, L.legend.h - 2};
    EXPECT_GT(count_dark(c, text_area), 40);
    Rect sample_area{L.legend.x + 1, L.legend.y + 1, L.legend.w * 0.3, L.legend.h - 2};
    EXPECT_GT(count_color(c, sample_area, palette(0)), 5);
    EXPECT_GT(count_color(c, sample_area, palette(1)), 5);
    // Border colour on the box edge.
    EXPECT_EQ(c.pixel(int(L.legend.x + L.legend.w / 2), int(L.legend.y)), colors::legend_border);
}

TEST(Plot, DenseTickLabelsAreThinnedNotOverlapped) {
    std::vector<double> xs;
    for (int i = 1; i <= 40; ++i) xs.push_back(i * 32);
    LineChart chart("dense");
    chart.add("s", xs, xs).x_ticks(xs).legend(LegendPosition::None);
    chart.render(360, 240);
    const auto& L = chart.last_layout();
    ASSERT_EQ(L.x_ticks.size(), 40u);
    ASSERT_EQ(L.x_tick_labels.size(), 40u);
    int shown = 0;
    double prev_right = -1e9;
    const double tick_size = 9;  // the smallest automatic tick font size
    for (size_t i = 0; i < L.x_ticks.size(); ++i) {
        if (L.x_tick_labels[i].empty()) continue;
        ++shown;
        double w = measure_text(L.x_tick_labels[i], tick_size).width;
        double cx = L.to_px_x(L.x_ticks[i]);
        EXPECT_GT(cx - w / 2, prev_right) << L.x_tick_labels[i];
        prev_right = cx + w / 2;
    }
    EXPECT_GE(shown, 3);
    EXPECT_LT(shown, 40);
    // Automatic linear ticks shrink in number instead.
    LineChart narrow("narrow");
    narrow.add("s", {0, 123456}, {0, 1}).legend(LegendPosition::None);
    narrow.render(220, 200);
    const auto& N = narrow.last_layout();
    EXPECT_GE(N.x_ticks.size(), 2u);
    EXPECT_LE(N.x_ticks.size(), 4u);
    for (const auto& s : N.x_tick_labels) EXPECT_FALSE(s.empty());
}

TEST(Plot, ResizeAveragesWhenShrinking) {
    // A 1-px checkerboard shrunk ~9x must become flat grey (plain bilinear sampling would not).
    Canvas board(64, 64);
    for (int y = 0; y < 64; ++y)
        for (int x = 0; x < 64; ++x) board.set_pixel(x, y, (x + y) % 2 ? colors::white : colors::black);
    Canvas small = board.resized(7, 7);
    for (int y = 0; y < 7; ++y)
        for (int x = 0; x < 7; ++x) EXPECT_NEAR(small.pixel(x, y).r, 128, 2);
    // Enlarging is plain bilinear: [0, 255] -> [0, 64, 191, 255].
    Canvas two(2, 1, colors::black);
    two.set_pixel(1, 0, colors::white);
    Canvas big = two.resized(4, 1);
    EXPECT_EQ(big.pixel(0, 0).r, 0);
    EXPECT_EQ(big.pixel(1, 0).r, 64);
    EXPECT_EQ(big.pixel(2, 0).r, 191);
    EXPECT_EQ(big.pixel(3, 0).r, 255);
}

TEST(Plot, GapsAndSinglePointsAreHandled) {
    LineChart chart("gaps");
    chart.add("gappy", {0, 1, 2, 3, 4}, {1, 1, NaN, 1, 1}).legend(LegendPosition::None).y_range(0, 2).grid(false);
    Series single;
    single.name = "one point";
    single.xs = {2};
    single.ys = {1.5};
    chart.add(single);
    Canvas c = chart.render(400, 300);
    const auto& L = chart.last_layout();
    int row = int(std::floor(L.to_px_y(1)));
    EXPECT_EQ(c.pixel(int(L.to_px_x(0.5)), row), palette(0));
    EXPECT_EQ(c.pixel(int(L.to_px_x(3.5)), row), palette(0));
    // No line across the gap (1, 3).
    EXPECT_EQ(c.pixel(int(L.to_px_x(2)), row), colors::white);
    EXPECT_EQ(c.pixel(int(L.to_px_x(1.6)), row), colors::white);
    // The single point is drawn as a marker.
    EXPECT_EQ(c.pixel(int(L.to_px_x(2)), int(L.to_px_y(1.5))), palette(1));
    // A chart of one single point also renders (degenerate ranges are widened).
    LineChart one;
    one.add("p", {224}, {100});
    Canvas o = one.render(300, 200);
    const auto& L1 = one.last_layout();
    EXPECT_LT(L1.x_lo, 224);
    EXPECT_GT(L1.x_hi, 224);
    EXPECT_EQ(o.pixel(int(L1.to_px_x(224)), int(L1.to_px_y(100))), palette(0));
}

TEST(Plot, RejectsEmptyOrMismatchedData) {
    LineChart empty("empty chart");
    EXPECT_NE(error_of([&] { empty.render(300, 200); }).find("empty chart"), std::string::npos);
    LineChart nan_only("nan chart");
    nan_only.add("n", {NaN, 1}, {1, NaN});
    EXPECT_NE(error_of([&] { nan_only.render(300, 200); }).find("no finite point"), std::string::npos);
    LineChart bad("mismatch");
    EXPECT_NE(error_of([&] { bad.add("s", {1, 2, 3}, {1, 2}); }).find("3 x values but 2 y values"), std::string::npos);
    EXPECT_THROW(bad.x_range(2, 1), Error);
    LineChart tiny("tiny");
    tiny.add("s", {0, 1}, {0, 1});
    EXPECT_THROW(tiny.render(20, 20), Error);
    EXPECT_THROW(Figure(0, 2), Error);
    Figure f(1, 2);
    EXPECT_THROW(f.set(1, 0, tiny), Error);
}

TEST(Plot, FigurePlacesChartsSideBySide) {
    Figure fig(1, 2);
    fig.title("two charts");
    LineChart& left = fig.set(0, 0, LineChart("left").add("a", {0, 1}, {0, 1}));
    LineChart& right = fig.set(0, 1, LineChart("right").add("b", {0, 1}, {1, 0}));
    Canvas c = fig.render(800, 300);
    const Rect& pl = left.last_layout().plot;
    const Rect& pr = right.last_layout().plot;
    EXPECT_GE(pl.x, 0);
    EXPECT_LE(pl.right(), 400);
    EXPECT_GE(pr.x, 400);
    EXPECT_LE(pr.right(), 800);
    EXPECT_GT(pl.y, 20);  // below the figure title
    EXPECT_GT(count_dark(c, {300, 0, 200, pl.y - 20}), 30);  // the title's pixels
    EXPECT_TRUE(near(c.pixel(int(left.last_layout().to_px_x(0.5)), int(left.last_layout().to_px_y(0.5))), palette(0), 60));
}

TEST(Plot, PngRoundTripIsExactAndAtomic) {
    TempDir dir;
    LineChart chart("round trip");
    chart.add("s", {0, 1, 2}, {2, 0, 1}, Marker::Circle);
    Canvas c = chart.render(321, 203);
    std::string path = (dir.path / "chart.png").string();
    c.save_png(path);
    Canvas back = load_png(path);
    ASSERT_EQ(back.width(), 321);
    ASSERT_EQ(back.height(), 203);
    EXPECT_TRUE(back.rgb() == c.rgb());
    // Overwriting works and leaves no temporary files behind.
    Canvas(10, 10, Color{1, 2, 3}).save_png(path);
    EXPECT_EQ(load_png(path).pixel(9, 9), (Color{1, 2, 3}));
    EXPECT_EQ(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator{}), 1);
}

TEST(Plot, UnwritableOrUnreadablePathThrowsNamingIt) {
    Canvas c(8, 8);
    const std::string bad = "/nonexistent-linvis-dir/sub/chart.png";
    std::string msg = error_of([&] { c.save_png(bad); });
    EXPECT_NE(msg.find(bad), std::string::npos) << msg;
    EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
    std::string msg2 = error_of([&] { load_png("/nonexistent-linvis-dir/x.png"); });
    EXPECT_NE(msg2.find("/nonexistent-linvis-dir/x.png"), std::string::npos) << msg2;
    EXPECT_THROW(Canvas().save_png("/tmp/x.png"), Error);
}

// ------------------------------------------------------------------ heat maps

TEST(Heatmap, ColormapEndsAndMonotoneLightness) {
    EXPECT_EQ(colormap_color(Colormap::Viridis, 0), (Color{0x44, 0x01, 0x54}));
    EXPECT_EQ(colormap_color(Colormap::Viridis, 1), (Color{0xFD, 0xE7, 0x25}));
    EXPECT_EQ(colormap_color(Colormap::Viridis, 0.5), (Color{0x21, 0x91, 0x8C}));
    EXPECT_EQ(colormap_color(Colormap::Viridis, -3), colormap_color(Colormap::Viridis, 0));  // clamped
    EXPECT_EQ(colormap_color(Colormap::CoolWarm, 0), (Color{59, 76, 192}));
    EXPECT_EQ(colormap_color(Colormap::CoolWarm, 1), (Color{180, 4, 38}));
    Color mid = colormap_color(Colormap::CoolWarm, 0.5);  // Moreland's neutral midpoint (L* = 88)
    EXPECT_NEAR(mid.r, 221, 1);
    EXPECT_NEAR(mid.g, 221, 1);
    EXPECT_NEAR(mid.b, 221, 1);
    EXPECT_EQ(colormap_color(Colormap::Gray, 1), colors::white);
    EXPECT_EQ(colormap_color(Colormap::Viridis, NaN), (Color{128, 128, 128}));
    // Viridis gets lighter monotonically; coolwarm lightens towards the middle then darkens.
    auto luma = [](Color c) { return 0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b; };
    double prev = -1;
    for (int i = 0; i <= 64; ++i) {
        double l = luma(colormap_color(Colormap::Viridis, i / 64.0));
        EXPECT_GT(l, prev) << i;
        prev = l;
    }
    EXPECT_GT(luma(colormap_color(Colormap::CoolWarm, 0.5)), luma(colormap_color(Colormap::CoolWarm, 0.25)));
    EXPECT_GT(luma(colormap_color(Colormap::CoolWarm, 0.5)), luma(colormap_color(Colormap::CoolWarm, 0.75)));
}

TEST(Heatmap, ViridisIsMatplotlibsPublishedTable) {
    // matplotlib/matplotlib@v3.11.2:lib/matplotlib/_cm_listed.py, _viridis_data (CC0): entries 0, 128, 255.
    const ColormapTable& v = viridis_table();
    EXPECT_EQ(v[0], (std::array<double, 3>{0.267004, 0.004874, 0.329415}));
    EXPECT_EQ(v[128], (std::array<double, 3>{0.127568, 0.566949, 0.550556}));
    EXPECT_EQ(v[255], (std::array<double, 3>{0.993248, 0.906157, 0.143936}));
    // matplotlib's lookup: t in [k / 256, (k + 1) / 256) takes entry k, rounded to bytes; the quarter
    // points are viridis' published 5-colour sampling.
    EXPECT_EQ(colormap_color(Colormap::Viridis, 0.25), (Color{0x3B, 0x52, 0x8B}));
    EXPECT_EQ(colormap_color(Colormap::Viridis, 0.75), (Color{0x5E, 0xC9, 0x62}));
    EXPECT_EQ(colormap_color(Colormap::Viridis, 127.5 / 256), (Color{33, 144, 141}));  // entry 127
    EXPECT_EQ(colormap_color(Colormap::Viridis, 1), (Color{253, 231, 37}));
    // Moreland's formula against matplotlib's coolwarm (256-entry lookup table, entries 64 and 192).
    EXPECT_TRUE(near(colormap_color(Colormap::CoolWarm, 64 / 255.0), Color{141, 176, 254}, 1));
    EXPECT_TRUE(near(colormap_color(Colormap::CoolWarm, 192 / 255.0), Color{244, 152, 122}, 1));
}

TEST(Heatmap, BilinearUpsamplingMatchesAlignCornersFalse) {
    std::vector<float> row{0.f, 1.f};
    auto up = upsample_bilinear(row.data(), 1, 2, 1, 4);
    EXPECT_EQ(up, (std::vector<float>{0.f, 0.25f, 0.75f, 1.f}));
    std::vector<float> m{0, 1, 2, 3};  // 2x2
    auto up2 = upsample_bilinear(m.data(), 2, 2, 4, 4);
    EXPECT_FLOAT_EQ(up2[0], 0);
    EXPECT_FLOAT_EQ(up2[15], 3);
    EXPECT_FLOAT_EQ(up2[1 * 4 + 1], 0.25f * 1 + 0.25f * 2);  // (0.25, 0.25) from the corner
    EXPECT_FLOAT_EQ(up2[1 * 4 + 2], 0.75f * 1 + 0.25f * 2);
    // Same as LibTorch's interpolate.
    auto src = torch::rand({1, 1, 3, 5});
    auto ref = torch::nn::functional::interpolate(
        src, torch::nn::functional::InterpolateFuncOptions().size(std::vector<int64_t>{7, 12}).mode(torch::kBilinear).align_corners(false));
    auto ours = upsample_bilinear(src.contiguous().data_ptr<float>(), 3, 5, 7, 12);
    auto ours_t = torch::from_blob(ours.data(), {1, 1, 7, 12}).clone();
    EXPECT_LT((ours_t - ref).abs().max().item<float>(), 1e-6f);
}

TEST(Heatmap, MinMapsToFirstColourMaxToLast) {
    Canvas img(40, 40, Color{0, 0, 0});
    std::vector<float> map{0.f, 0.5f, 0.25f, 2.f};  // 2x2, min 0 top-left, max 2 bottom-right
    Canvas out = heatmap_overlay(img, map.data(), 2, 2, 1.0, Colormap::Viridis);
    EXPECT_EQ(out.pixel(0, 0), colormap_color(Colormap::Viridis, 0));
    EXPECT_EQ(out.pixel(39, 39), colormap_color(Colormap::Viridis, 1));
    Canvas cw = heatmap_overlay(img, map.data(), 2, 2, 1.0, Colormap::CoolWarm);
    EXPECT_EQ(cw.pixel(0, 0), (Color{59, 76, 192}));
    EXPECT_EQ(cw.pixel(39, 39), (Color{180, 4, 38}));
    // An explicit range clamps: with [-1, 1], value 0 is the middle and 2 the top.
    Canvas ranged = heatmap_overlay(img, map.data(), 2, 2, 1.0, Colormap::Viridis, {-1.0, 1.0});
    EXPECT_EQ(ranged.pixel(0, 0), colormap_color(Colormap::Viridis, 0.5));
    EXPECT_EQ(ranged.pixel(39, 39), colormap_color(Colormap::Viridis, 1));
    // colorize: one pixel per value.
    Canvas raw = colorize(map.data(), 2, 2, Colormap::Viridis);
    EXPECT_EQ(raw.pixel(1, 0), colormap_color(Colormap::Viridis, 0.25));
}

TEST(Heatmap, OverlayBlendMathOnAConstantImage) {
    const Color base{200, 100, 50};
    Canvas img(16, 12, base);
    std::vector<float> map(3 * 4, 0.3f);
    map[5] = NaN;  // NaN cells leave the image untouched where they are the only source
    const double alpha = 0.3;
    ValueRange range{0.0, 1.0};
    Canvas out = heatmap_overlay(img, map.data(), 3, 4, alpha, Colormap::Viridis, range);
    Color cm = colormap_color(Colormap::Viridis, double(0.3f));
    auto expect = [&](uint8_t i, uint8_t c) { return int(std::lround((1 - alpha) * i + alpha * c)); };
    int blended = 0, untouched = 0;
    for (int y = 0; y < 12; ++y)
        for (int x = 0; x < 16; ++x) {
            Color p = out.pixel(x, y);
            if (p == base) {
                ++untouched;
                continue;
            }
            ++blended;
            EXPECT_EQ(p.r, expect(base.r, cm.r));
            EXPECT_EQ(p.g, expect(base.g, cm.g));
            EXPECT_EQ(p.b, expect(base.b, cm.b));
        }
    // The NaN cell removes the pixels whose bilinear support touches it (its 2x2 neighbourhood
    // of cells, 8x8 pixels here); the corners far from it are blended.
    EXPECT_EQ(untouched, 64);
    EXPECT_EQ(blended, 16 * 12 - 64);
    EXPECT_NE(out.pixel(0, 0), base);
    EXPECT_NE(out.pixel(15, 11), base);
    EXPECT_THROW(heatmap_overlay(img, map.data(), 3, 4, 1.5), Error);
    std::vector<float> all_nan(4, NaN);
    EXPECT_NE(error_of([&] { heatmap_overlay(img, all_nan.data(), 2, 2); }).find("no finite value"), std::string::npos);
}

TEST(Heatmap, TensorOverlayMatchesBufferOverlayAndChecksShapes) {
    auto image = torch::randint(0, 256, {24, 32, 3}, torch::kUInt8);
    auto map = torch::rand({3, 4}, torch::kFloat64);
    Canvas from_tensor = heatmap_overlay(image, map, 0.4, Colormap::CoolWarm);
    auto mapf = map.to(torch::kFloat).contiguous();
    Canvas from_buffer = heatmap_overlay(image.contiguous().data_ptr<uint8_t>(), 24, 32, mapf.data_ptr<float>(), 3, 4, 0.4,
                                         Colormap::CoolWarm);
    EXPECT_TRUE(from_tensor.rgb() == from_buffer.rgb());
    EXPECT_EQ(canvas_from_tensor(image).pixel(31, 23).g, image[23][31][1].item<int>());
    std::string msg = error_of([&] { heatmap_overlay(torch::zeros({3, 24, 32}, torch::kUInt8), map); });
    EXPECT_NE(msg.find("[3, 24, 32]"), std::string::npos) << msg;
    EXPECT_THROW(heatmap_overlay(image.to(torch::kFloat), map), Error);
    EXPECT_THROW(heatmap_overlay(image, torch::rand({2, 3, 4})), Error);
}

TEST(Heatmap, PanelGridWithTitlesAndColourBars) {
    Canvas img(64, 64, Color{255, 255, 255});
    std::vector<float> map(4 * 4);
    for (int i = 0; i < 16; ++i) map[i] = float(i);
    Figure fig(1, 2);
    fig.title("grid");
    HeatmapPanel& over = fig.set(0, 0, HeatmapPanel(img, map, 4, 4).title("over image").alpha(1.0));
    HeatmapPanel& alone = fig.set(0, 1, HeatmapPanel(map, 4, 4).title("map only").colorbar(true, "score"));
    Canvas c = fig.render(600, 320);
    const Rect& r = over.last_image_rect();
    ASSERT_GT(r.w, 100);
    EXPECT_NEAR(r.w, r.h, 1);  // aspect ratio kept
    // alpha 1: the image rect shows the colormap: min at the top-left, max at the bottom-right.
    EXPECT_EQ(c.pixel(int(r.x) + 1, int(r.y) + 1), colormap_color(Colormap::Viridis, 0));
    EXPECT_EQ(c.pixel(int(r.right()) - 2, int(r.bottom()) - 2), colormap_color(Colormap::Viridis, 1));
    // The colour bar to the right: near-max colour at its top, near-min at its bottom.
    bool found_top = false, found_bottom = false;
    for (int x = int(r.right()) + 2; x < int(r.right()) + 40 && x < 300; ++x) {
        Color top = c.pixel(x, int(r.y) + 1), bot = c.pixel(x, int(r.bottom()) - 2);
        Color cmax = colormap_color(Colormap::Viridis, 1), cmin = colormap_color(Colormap::Viridis, 0);
        found_top |= std::abs(top.r - cmax.r) <= 6 && std::abs(top.g - cmax.g) <= 6 && std::abs(top.b - cmax.b) <= 6;
        found_bottom |= std::abs(bot.r - cmin.r) <= 6 && std::abs(bot.g - cmin.g) <= 6 && std::abs(bot.b - cmin.b) <= 6;
    }
    EXPECT_TRUE(found_top);
    EXPECT_TRUE(found_bottom);
    // Titles above the pictures.
    Rect cell = fig.cell(0, 0, 600, 320);
    EXPECT_GT(count_dark(c, {cell.x, cell.y, cell.w, r.y - cell.y - 1}), 20);
    // The map-only panel shows crisp cells: the 4x4 grid's cell (0, 0) is uniform.
    const Rect& a = alone.last_image_rect();
    EXPECT_EQ(c.pixel(int(a.x) + 2, int(a.y) + 2), c.pixel(int(a.x + a.w / 4) - 3, int(a.y + a.h / 4) - 3));
    EXPECT_EQ(c.pixel(int(a.x) + 2, int(a.y) + 2), colormap_color(Colormap::Viridis, 0));
    EXPECT_THROW(HeatmapPanel(map, 3, 4), Error);
}

// ------------------------------------------------------------------ gallery (docs/images)

namespace gallery {

Figure throughput_figure() {
    std::vector<double> res{224, 384, 512, 768, 1024};
    LineChart thr("Throughput (DEMO DATA, not measured)");
    thr.x_label("resolution (px)").y_label("images / s").y_scale(Scale::Log10).x_ticks(res);
    thr.add("ViT-S (softmax attention)", res, {1210, 318, 131, 31, 9.6}, Marker::Circle);
    thr.add("ViL-S (mLSTM)", res, {780, 262, 148, 64, 35}, Marker::Square);
    thr.add("ViT3-S (linear attention)", res, {1010, 345, 196, 88, 49}, Marker::Triangle);
    LineChart mem("Peak memory, batch 64 (DEMO DATA)");
    mem.x_label("resolution (px)").y_label("peak memory (GiB)").x_ticks(res).y_include_zero();
    mem.add("ViT-S (softmax attention)", res, {2.1, 7.4, 15.8, 52.0, NaN}, Marker::Circle);
    mem.add("ViL-S (mLSTM)", res, {2.6, 7.0, 12.1, 26.5, 46.3}, Marker::Square);
    mem.add("ViT3-S (linear attention)", res, {1.9, 5.4, 9.4, 20.8, 36.6}, Marker::Triangle);
    Figure fig(1, 2);
    fig.set(0, 0, thr);
    fig.set(0, 1, mem);
    return fig;
}

LineChart log_chart() {
    std::vector<double> n, quad, lin, nlogn;
    for (double t = 196; t <= 16384 * 1.01; t *= 2) {
        n.push_back(t);
        quad.push_back(t * t * 384 * 2 / 1e9);
        lin.push_back(t * 384 * 384 * 2 / 1e9);
        nlogn.push_back(t * std::log2(t) * 384 * 4 / 1e9);
    }
    LineChart c("Token mixing cost vs sequence length (formula, d = 384)");
    c.x_label("tokens").y_label("GFLOPs per layer").x_scale(Scale::Log10).y_scale(Scale::Log10);
    c.add("softmax attention  2·N²·d", n, quad, Marker::Circle);
    Series s; s.name = "linear attention  2·N·d²"; s.xs = n; s.ys = lin; s.marker = Marker::Diamond;
    c.add(s);
    Series d; d.name = "N·log₂N reference"; d.xs = n; d.ys = nlogn; d.dashed = true; d.color = Color{120, 120, 120};
    c.add(d);
    return c;
}

Figure training_figure() {
    std::vector<double> ep, tl, vl, ta, va, lr;
    for (int e = 1; e <= 30; ++e) {
        ep.push_back(e);
        double k = std::exp(-e / 7.0);
        tl.push_back(0.32 + 1.9 * k + 0.02 * std::sin(e * 1.7));
        vl.push_back(0.38 + 1.7 * k + 0.03 * std::sin(e * 1.3 + 1) + 0.002 * e);
        ta.push_back(100 * (0.90 - 0.62 * k) + 0.3 * std::sin(e * 2.1));
        va.push_back(100 * (0.87 - 0.58 * k) + 0.5 * std::sin(e * 1.1));
        double warm = 3;
        lr.push_back(e <= warm ? 1e-3 * e / warm : 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + std::cos(M_PI * (e - warm) / (30 - warm))));
    }
    va[11] = NaN;  // a skipped evaluation leaves a gap
    LineChart loss("Loss"), acc("Top-1 accuracy"), sched("Learning rate");
    loss.x_label("epoch").y_label("cross-entropy").add("train", ep, tl).add("val", ep, vl, Marker::Circle);
    acc.x_label("epoch").y_label("accuracy (%)").add("train", ep, ta).add("val", ep, va, Marker::Circle);
    sched.x_label("epoch").y_label("lr").add("lr (warmup + cosine)", ep, lr);
    Figure fig(1, 3);
    fig.title("Training curves (DEMO DATA: synthetic Fashion-MNIST-like run)");
    fig.set(0, 0, loss);
    fig.set(0, 1, acc);
    fig.set(0, 2, sched);
    return fig;
}

// A synthetic 224x224 photo-like image: sky gradient, ground, a sun and a "dog-shaped" blob.
Canvas synthetic_image(int size = 224) {
    Canvas img(size, size);
    for (int y = 0; y < size; ++y)
        for (int x = 0; x < size; ++x) {
            double t = double(y) / size;
            Color c = y < size * 0.62 ? Color{uint8_t(120 + 80 * t), uint8_t(170 + 50 * t), 235}
                                      : Color{uint8_t(90 + 20 * std::sin(x * 0.3)), uint8_t(140 + 15 * std::sin(y * 0.5)), 70};
            img.set_pixel(x, y, c);
        }
    img.fill_circle({size * 0.78, size * 0.2}, size * 0.08, {250, 220, 90});
    img.fill_circle({size * 0.4, size * 0.6}, size * 0.16, {150, 100, 60});
    img.fill_circle({size * 0.58, size * 0.48}, size * 0.09, {160, 110, 66});
    img.fill_rect({size * 0.28, size * 0.68, size * 0.05, size * 0.14}, {130, 86, 50});
    img.fill_rect({size * 0.48, size * 0.68, size * 0.05, size * 0.14}, {130, 86, 50});
    return img;
}

Figure heatmap_figure() {
    Canvas img = synthetic_image();
    const int g = 14;
    std::vector<float> obj(g * g), sun(g * g), diff(g * g), grid(g * g);
    for (int y = 0; y < g; ++y)
        for (int x = 0; x < g; ++x) {
            double cx = (x + 0.5) / g, cy = (y + 0.5) / g;
            obj[y * g + x] = float(std::exp(-(std::pow(cx - 0.45, 2) + std::pow(cy - 0.57, 2)) / 0.02));
            sun[y * g + x] = float(std::exp(-(std::pow(cx - 0.78, 2) + std::pow(cy - 0.2, 2)) / 0.005));
            diff[y * g + x] = float(obj[y * g + x] - 0.8 * sun[y * g + x]);
            grid[y * g + x] = float(((x * 7 + y * 3) % 11) / 10.0);
        }
    Figure fig(2, 2);
    fig.title("Heat maps over a synthetic 224x224 image (14x14 patch grid)");
    fig.set(0, 0, HeatmapPanel(img, obj, g, g).title("object saliency (viridis, alpha 0.5)"));
    fig.set(0, 1, HeatmapPanel(img, sun, g, g).title("sun patch attention").alpha(0.6));
    fig.set(1, 0, HeatmapPanel(img, diff, g, g).title("signed relevance (coolwarm)").colormap(Colormap::CoolWarm)
                      .range({-1.0, 1.0}));
    fig.set(1, 1, HeatmapPanel(grid, g, g).title("raw 14x14 map (no image)").colorbar(true, "score"));
    return fig;
}
}  // namespace gallery

TEST(Plot, GalleryRendersUnderSizeBudget) {
    TempDir tmp;
    const char* env = std::getenv("LINVIS_PLOT_GALLERY_DIR");
    fs::path dir = env && *env ? fs::path(env) : tmp.path;
    struct Item {
        std::string name;
        int w, h;
        std::function<Canvas(int, int)> render;
    };
    std::vector<Item> items{
        {"plot_throughput.png", 1100, 460, [](int w, int h) { return gallery::throughput_figure().render(w, h); }},
        {"plot_log_scale.png", 720, 480, [](int w, int h) { return gallery::log_chart().render(w, h); }},
        {"plot_training.png", 1200, 400, [](int w, int h) { return gallery::training_figure().render(w, h); }},
        {"plot_heatmaps.png", 760, 700, [](int w, int h) { return gallery::heatmap_figure().render(w, h); }},
    };
    for (const auto& it : items) {
        std::string path = (dir / it.name).string();
        it.render(it.w, it.h).save_png(path);
        EXPECT_LT(fs::file_size(path), 150u * 1024u) << path;
        Canvas back = load_png(path);
        EXPECT_EQ(back.width(), it.w) << path;
        EXPECT_EQ(back.height(), it.h) << path;
    }
}
