// Helpers shared by the sources of the plotting library (private to src/plot).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

namespace linvis::plot::detail {

inline double clamp01(double v) { return v < 0 ? 0 : (v > 1 ? 1 : v); }

// Rounds to nearest and saturates to [0, 255].
inline uint8_t to_byte(double v) {
    v = std::round(v);
    return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// `given` when set (> 0), else base * factor clamped to [lo, hi]: smaller text for small panels.
double auto_size(double given, double base, double factor, double lo, double hi);

// Shrinks `size` until `text` fits `max_width` (down to 7 px).
double fit_size(const std::string& text, double size, double max_width);

}  // namespace linvis::plot::detail
