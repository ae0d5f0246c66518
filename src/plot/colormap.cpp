// Colours: the Okabe-Ito palette, hex parsing and the colour maps (see linvis/plot/plot.h).
#include <algorithm>
#include <cmath>
#include <string>

#include "internal.h"
#include "linvis/core/error.h"
#include "linvis/plot/plot.h"

namespace linvis::plot {

using detail::clamp01;
using detail::to_byte;

namespace {

double srgb_to_linear(double c) {
    return c <= 0.04045 ? c / 12.92 : std::pow((c + 0.055) / 1.055, 2.4);
}
double linear_to_srgb(double c) {
    return c <= 0.0031308 ? 12.92 * c : 1.055 * std::pow(c, 1.0 / 2.4) - 0.055;
}

struct Vec3 {
    double a, b, c;
};

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

}  // namespace

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
            // matplotlib's lookup: N equal bins over [0, 1], t = 1 in the last.
            const ColormapTable& table = viridis_table();
            const auto& c = table[std::min(table.size() - 1, static_cast<size_t>(t * table.size()))];
            return {to_byte(255 * c[0]), to_byte(255 * c[1]), to_byte(255 * c[2])};
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

}  // namespace linvis::plot
