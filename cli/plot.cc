#include "plot.h"

#include <png.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <nlohmann/json.hpp>

namespace strata::cli {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// --- The log ---------------------------------------------------------------------------------

[[noreturn]] void bad_line(const std::filesystem::path& p, size_t line, const std::string& why) {
  throw std::runtime_error(p.string() + ":" + std::to_string(line) + ": " + why);
}

// A missing key or null (how nlohmann::json writes NaN and infinities) is "no value".
double number_or_nan(const nlohmann::json& j, const char* key, const std::filesystem::path& p, size_t line) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return kNaN;
  if (!it->is_number()) bad_line(p, line, std::string("\"") + key + "\" is not a number");
  return it->get<double>();
}

int64_t step_of(const nlohmann::json& j, const std::filesystem::path& p, size_t line) {
  auto it = j.find("step");
  if (it == j.end()) bad_line(p, line, "no \"step\"");
  if (!it->is_number_integer()) bad_line(p, line, "\"step\" is not an integer");
  return it->get<int64_t>();
}

// --- Raster ----------------------------------------------------------------------------------

struct Rgb {
  uint8_t r, g, b;
};
constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrid{225, 225, 225}, kGray{110, 110, 110};
// Series colors (tests/cli/py/plot_check.py looks for them in each panel).
constexpr Rgb kBlue{31, 119, 180}, kOrange{255, 127, 14}, kGreen{44, 160, 44}, kRed{214, 39, 40},
    kPurple{148, 103, 189};

// 5 x 8 glyphs, one byte per row, bit 4 the leftmost pixel. Capitals and digits use rows 0-6
// (row 6 is the baseline); row 7 holds the descenders of g, j, p, q, y and the comma.
struct Glyph {
  char c;
  std::array<uint8_t, 8> rows;
};
// clang-format off
constexpr Glyph kFont[] = {
  {' ', {0b00000,0b00000,0b00000,0b00000,0b00000,0b00000,0b00000,0b00000}},
  {'0', {0b01110,0b10001,0b10011,0b10101,0b11001,0b10001,0b01110,0b00000}},
  {'1', {0b00100,0b01100,0b00100,0b00100,0b00100,0b00100,0b01110,0b00000}},
  {'2', {0b01110,0b10001,0b00001,0b00010,0b00100,0b01000,0b11111,0b00000}},
  {'3', {0b11111,0b00010,0b00100,0b00010,0b00001,0b10001,0b01110,0b00000}},
  {'4', {0b00010,0b00110,0b01010,0b10010,0b11111,0b00010,0b00010,0b00000}},
  {'5', {0b11111,0b10000,0b11110,0b00001,0b00001,0b10001,0b01110,0b00000}},
  {'6', {0b00110,0b01000,0b10000,0b11110,0b10001,0b10001,0b01110,0b00000}},
  {'7', {0b11111,0b00001,0b00010,0b00100,0b01000,0b01000,0b01000,0b00000}},
  {'8', {0b01110,0b10001,0b10001,0b01110,0b10001,0b10001,0b01110,0b00000}},
  {'9', {0b01110,0b10001,0b10001,0b01111,0b00001,0b00010,0b01100,0b00000}},
  {'A', {0b01110,0b10001,0b10001,0b11111,0b10001,0b10001,0b10001,0b00000}},
  {'B', {0b11110,0b10001,0b10001,0b11110,0b10001,0b10001,0b11110,0b00000}},
  {'C', {0b01110,0b10001,0b10000,0b10000,0b10000,0b10001,0b01110,0b00000}},
  {'D', {0b11100,0b10010,0b10001,0b10001,0b10001,0b10010,0b11100,0b00000}},
  {'E', {0b11111,0b10000,0b10000,0b11110,0b10000,0b10000,0b11111,0b00000}},
  {'F', {0b11111,0b10000,0b10000,0b11110,0b10000,0b10000,0b10000,0b00000}},
  {'G', {0b01110,0b10001,0b10000,0b10111,0b10001,0b10001,0b01111,0b00000}},
  {'H', {0b10001,0b10001,0b10001,0b11111,0b10001,0b10001,0b10001,0b00000}},
  {'I', {0b01110,0b00100,0b00100,0b00100,0b00100,0b00100,0b01110,0b00000}},
  {'J', {0b00111,0b00010,0b00010,0b00010,0b00010,0b10010,0b01100,0b00000}},
  {'K', {0b10001,0b10010,0b10100,0b11000,0b10100,0b10010,0b10001,0b00000}},
  {'L', {0b10000,0b10000,0b10000,0b10000,0b10000,0b10000,0b11111,0b00000}},
  {'M', {0b10001,0b11011,0b10101,0b10101,0b10001,0b10001,0b10001,0b00000}},
  {'N', {0b10001,0b10001,0b11001,0b10101,0b10011,0b10001,0b10001,0b00000}},
  {'O', {0b01110,0b10001,0b10001,0b10001,0b10001,0b10001,0b01110,0b00000}},
  {'P', {0b11110,0b10001,0b10001,0b11110,0b10000,0b10000,0b10000,0b00000}},
  {'Q', {0b01110,0b10001,0b10001,0b10001,0b10101,0b10010,0b01101,0b00000}},
  {'R', {0b11110,0b10001,0b10001,0b11110,0b10100,0b10010,0b10001,0b00000}},
  {'S', {0b01111,0b10000,0b10000,0b01110,0b00001,0b00001,0b11110,0b00000}},
  {'T', {0b11111,0b00100,0b00100,0b00100,0b00100,0b00100,0b00100,0b00000}},
  {'U', {0b10001,0b10001,0b10001,0b10001,0b10001,0b10001,0b01110,0b00000}},
  {'V', {0b10001,0b10001,0b10001,0b10001,0b10001,0b01010,0b00100,0b00000}},
  {'W', {0b10001,0b10001,0b10001,0b10101,0b10101,0b10101,0b01010,0b00000}},
  {'X', {0b10001,0b10001,0b01010,0b00100,0b01010,0b10001,0b10001,0b00000}},
  {'Y', {0b10001,0b10001,0b10001,0b01010,0b00100,0b00100,0b00100,0b00000}},
  {'Z', {0b11111,0b00001,0b00010,0b00100,0b01000,0b10000,0b11111,0b00000}},
  {'a', {0b00000,0b00000,0b01110,0b00001,0b01111,0b10001,0b01111,0b00000}},
  {'b', {0b10000,0b10000,0b10110,0b11001,0b10001,0b10001,0b11110,0b00000}},
  {'c', {0b00000,0b00000,0b01110,0b10000,0b10000,0b10001,0b01110,0b00000}},
  {'d', {0b00001,0b00001,0b01101,0b10011,0b10001,0b10001,0b01111,0b00000}},
  {'e', {0b00000,0b00000,0b01110,0b10001,0b11111,0b10000,0b01110,0b00000}},
  {'f', {0b00110,0b01001,0b01000,0b11100,0b01000,0b01000,0b01000,0b00000}},
  {'g', {0b00000,0b00000,0b01111,0b10001,0b10001,0b01111,0b00001,0b01110}},
  {'h', {0b10000,0b10000,0b10110,0b11001,0b10001,0b10001,0b10001,0b00000}},
  {'i', {0b00100,0b00000,0b01100,0b00100,0b00100,0b00100,0b01110,0b00000}},
  {'j', {0b00010,0b00000,0b00110,0b00010,0b00010,0b00010,0b10010,0b01100}},
  {'k', {0b10000,0b10000,0b10010,0b10100,0b11000,0b10100,0b10010,0b00000}},
  {'l', {0b01100,0b00100,0b00100,0b00100,0b00100,0b00100,0b01110,0b00000}},
  {'m', {0b00000,0b00000,0b11010,0b10101,0b10101,0b10101,0b10101,0b00000}},
  {'n', {0b00000,0b00000,0b10110,0b11001,0b10001,0b10001,0b10001,0b00000}},
  {'o', {0b00000,0b00000,0b01110,0b10001,0b10001,0b10001,0b01110,0b00000}},
  {'p', {0b00000,0b00000,0b11110,0b10001,0b10001,0b11110,0b10000,0b10000}},
  {'q', {0b00000,0b00000,0b01111,0b10001,0b10001,0b01111,0b00001,0b00001}},
  {'r', {0b00000,0b00000,0b10110,0b11001,0b10000,0b10000,0b10000,0b00000}},
  {'s', {0b00000,0b00000,0b01111,0b10000,0b01110,0b00001,0b11110,0b00000}},
  {'t', {0b01000,0b01000,0b11100,0b01000,0b01000,0b01001,0b00110,0b00000}},
  {'u', {0b00000,0b00000,0b10001,0b10001,0b10001,0b10011,0b01101,0b00000}},
  {'v', {0b00000,0b00000,0b10001,0b10001,0b10001,0b01010,0b00100,0b00000}},
  {'w', {0b00000,0b00000,0b10001,0b10001,0b10101,0b10101,0b01010,0b00000}},
  {'x', {0b00000,0b00000,0b10001,0b01010,0b00100,0b01010,0b10001,0b00000}},
  {'y', {0b00000,0b00000,0b10001,0b10001,0b10001,0b01111,0b00001,0b01110}},
  {'z', {0b00000,0b00000,0b11111,0b00010,0b00100,0b01000,0b11111,0b00000}},
  {'.', {0b00000,0b00000,0b00000,0b00000,0b00000,0b01100,0b01100,0b00000}},
  {',', {0b00000,0b00000,0b00000,0b00000,0b00000,0b01100,0b00100,0b01000}},
  {'-', {0b00000,0b00000,0b00000,0b11111,0b00000,0b00000,0b00000,0b00000}},
  {'+', {0b00000,0b00100,0b00100,0b11111,0b00100,0b00100,0b00000,0b00000}},
  {'/', {0b00000,0b00001,0b00010,0b00100,0b01000,0b10000,0b00000,0b00000}},
  {'(', {0b00010,0b00100,0b01000,0b01000,0b01000,0b00100,0b00010,0b00000}},
  {')', {0b01000,0b00100,0b00010,0b00010,0b00010,0b00100,0b01000,0b00000}},
  {':', {0b00000,0b01100,0b01100,0b00000,0b01100,0b01100,0b00000,0b00000}},
  {'%', {0b11000,0b11001,0b00010,0b00100,0b01000,0b10011,0b00011,0b00000}},
  {'_', {0b00000,0b00000,0b00000,0b00000,0b00000,0b00000,0b11111,0b00000}},
  {'=', {0b00000,0b00000,0b11111,0b00000,0b11111,0b00000,0b00000,0b00000}},
  {'?', {0b01110,0b10001,0b00001,0b00010,0b00100,0b00000,0b00100,0b00000}},
};
// clang-format on

const Glyph& glyph(char c) {
  for (const auto& g : kFont)
    if (g.c == c) return g;
  return glyph('?');
}

constexpr int kGlyphW = 5, kGlyphH = 8, kAdvance = kGlyphW + 1;

int text_width(const std::string& s, int scale) {
  return s.empty() ? 0 : (static_cast<int>(s.size()) * kAdvance - 1) * scale;
}

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) { clip_all(); }

  void clip(int x0, int y0, int x1, int y1) { cx0_ = x0, cy0_ = y0, cx1_ = x1, cy1_ = y1; }
  void clip_all() { clip(0, 0, w_ - 1, h_ - 1); }

  void set(int x, int y, Rgb c) {
    if (x < cx0_ || x > cx1_ || y < cy0_ || y > cy1_) return;
    uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c.r, p[1] = c.g, p[2] = c.b;
  }
  void fill(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  // Bresenham; `width` 2 stamps a 2 x 2 square at every step, so steep and flat lines alike
  // come out 2 px thick.
  void line(int x0, int y0, int x1, int y1, Rgb c, int width = 2) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (;;) {
      fill(x0, y0, x0 + width - 1, y0 + width - 1, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }
  // `y` is the top of the glyph cell.
  void text(int x, int y, const std::string& s, Rgb c, int scale) {
    for (char ch : s) {
      const Glyph& g = glyph(ch);
      for (int r = 0; r < kGlyphH; ++r)
        for (int col = 0; col < kGlyphW; ++col)
          if (g.rows[r] & (1 << (kGlyphW - 1 - col)))
            fill(x + col * scale, y + r * scale, x + col * scale + scale - 1, y + r * scale + scale - 1, c);
      x += kAdvance * scale;
    }
  }

  // A regular file (or a new one) is replaced whole: the image goes to a temporary file beside
  // it, renamed over it once complete, so a failed write leaves the previous plot. Anything else
  // (a pipe, /dev/stdout) is written in place and never removed or replaced; libpng's
  // png_image_write_to_file is not used because it unlinks its output when a write fails.
  void write_png(const std::filesystem::path& path) const {
    struct stat st;
    const bool in_place = ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode);
    const std::string target = in_place ? path.string() : path.string() + ".tmp" + std::to_string(::getpid());
    auto fail = [&](int err, const std::string& why) {
      if (!in_place) ::unlink(target.c_str());
      throw std::runtime_error("cannot write " + path.string() + ": " + (err ? std::strerror(err) : why));
    };
    FILE* f = std::fopen(target.c_str(), "wb");
    if (f == nullptr) fail(errno, "");
    png_image img;
    std::memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
    img.width = static_cast<png_uint_32>(w_);
    img.height = static_cast<png_uint_32>(h_);
    img.format = PNG_FORMAT_RGB;
    errno = 0;
    bool ok = png_image_write_to_stdio(&img, f, 0, px_.data(), w_ * 3, nullptr) != 0;
    std::string why = ok ? "" : img.message;
    ok = ok && std::fflush(f) == 0 && !std::ferror(f);
    int err = ok ? 0 : errno;
    if (std::fclose(f) != 0 && ok) ok = false, err = errno;
    png_image_free(&img);
    if (!ok) fail(err, why);
    if (!in_place && std::rename(target.c_str(), path.c_str()) != 0) fail(errno, "");
  }

 private:
  int w_, h_;
  std::vector<uint8_t> px_;
  int cx0_, cy0_, cx1_, cy1_;
};

// --- Axes ------------------------------------------------------------------------------------

// Ticks at multiples of 1, 2 or 5 x 10^k, about `target` of them in [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target, double min_step, double* step_out) {
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  double step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  step = std::max(step, min_step);
  std::vector<double> t;
  // Multiples of `step` by integer index, so 0 is exactly 0 and no error accumulates.
  for (double k = std::ceil(lo / step); k * step <= hi * (1 + 1e-12) && t.size() < 50; ++k)
    t.push_back(k == 0 ? 0.0 : k * step);
  *step_out = step;
  return t;
}

// Labels for ticks `step` apart: fixed-point with as many decimals as the step needs, or
// scientific where that is shorter (tiny learning rates, huge step counts).
std::vector<std::string> format_ticks(const std::vector<double>& ticks, double step) {
  double max_abs = 0;
  for (double v : ticks) max_abs = std::max(max_abs, std::abs(v));
  const int decimals = std::max(0, static_cast<int>(std::ceil(-std::log10(step) - 1e-9)));
  const int digits = max_abs > 0 ? static_cast<int>(std::floor(std::log10(max_abs)) - std::floor(std::log10(step) + 1e-9)) : 0;
  std::vector<std::string> fixed, sci;
  size_t fixed_w = 0, sci_w = 0;
  char buf[64];
  for (double v : ticks) {
    std::snprintf(buf, sizeof buf, "%.*f", std::min(decimals, 20), v);
    fixed.push_back(v == 0 ? "0" : buf);
    std::snprintf(buf, sizeof buf, "%.*e", std::clamp(digits, 0, 3), v);
    sci.push_back(v == 0 ? "0" : buf);
    fixed_w = std::max(fixed_w, fixed.back().size());
    sci_w = std::max(sci_w, sci.back().size());
  }
  return fixed_w <= sci_w ? fixed : sci;
}

struct Series {
  std::string name;
  Rgb color;
  std::vector<std::pair<double, double>> points;  // (step, value), by step; NaN values are gaps
  bool markers = false;      // a square at each point (eval loss)
  bool ticks_only = false;   // a short mark at the bottom at each step (skipped steps)
};

struct Panel {
  std::string title;
  std::vector<Series> series;
  bool from_zero = false;  // the y axis includes 0 (memory)
};

// Panel layout inside its cell, in pixels.
constexpr int kCellW = kPlotWidth / 2, kCellH = kPlotHeight / 2;
constexpr int kLeft = 112, kRight = 24, kTop = 66, kBottom = 54;
constexpr int kScale = 2;  // text: 10 x 16 px glyph cells

// Draws the legend: one row between the title and the plot area, moved left if it would overrun.
void draw_legend(Canvas& cv, const Panel& p, int ox, int oy, int left) {
  int legend_w = 0;
  for (const auto& s : p.series) legend_w += 26 + text_width(s.name, kScale) + 20;
  int lx = std::max(ox + 8, std::min(left, ox + kCellW - 8 - (legend_w - 20)));
  for (const auto& s : p.series) {
    const int ly = oy + 36;
    if (s.ticks_only) {
      cv.fill(lx + 9, ly + 1, lx + 10, ly + 12, s.color);
    } else {
      cv.line(lx, ly + 6, lx + 20, ly + 6, s.color);
      if (s.markers) cv.fill(lx + 7, ly + 3, lx + 13, ly + 9, s.color);
    }
    cv.text(lx + 26, ly, s.name, kBlack, kScale);
    lx += 26 + text_width(s.name, kScale) + 20;
  }
}

// The data ranges a panel shows, padded.
struct Ranges {
  double xlo, xhi, ylo, yhi;
  bool has_y;  // some series has a finite y value
};

// The ranges over the panel's finite values, padded (a default y range when there are none).
Ranges data_ranges(const Panel& p) {
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  for (const auto& s : p.series)
    for (auto [x, y] : s.points) {
      xlo = std::min(xlo, x), xhi = std::max(xhi, x);
      if (!s.ticks_only && std::isfinite(y)) ylo = std::min(ylo, y), yhi = std::max(yhi, y);
    }
  const bool has_y = std::isfinite(ylo);
  if (!has_y) ylo = 0, yhi = 1;
  if (p.from_zero) ylo = std::min(ylo, 0.0);
  if (yhi - ylo <= 0) {
    const double pad = ylo != 0 ? std::abs(ylo) * 0.1 : 1.0;
    ylo -= pad, yhi += pad;
  } else {
    const double pad = (yhi - ylo) * 0.05;
    // Padded below 0 too: a series at 0 would otherwise lie under the frame.
    yhi += pad, ylo -= pad;
  }
  if (xhi - xlo <= 0) {  // one step; relative padding too, as 2^62 + 1 == 2^62 in a double
    const double pad = std::max(1.0, std::abs(xlo) * 1e-6);
    xlo -= pad, xhi += pad;
  }
  const double xpad = (xhi - xlo) * 0.02;
  xlo -= xpad, xhi += xpad;
  return {xlo, xhi, ylo, yhi, has_y};
}

// A panel's plot area in pixels and its data ranges: maps a step and a value to pixels.
struct PlotArea {
  int left, right, top, bottom;
  Ranges r;
  int sx(double x) const { return left + static_cast<int>(std::lround((x - r.xlo) / (r.xhi - r.xlo) * (right - left))); }
  int sy(double y) const { return bottom - static_cast<int>(std::lround((y - r.ylo) / (r.yhi - r.ylo) * (bottom - top))); }
};

// Draws the y ticks, grid lines and labels right-aligned left of the axis (smaller if too wide).
void draw_y_axis(Canvas& cv, const PlotArea& a) {
  double ystep;
  const std::vector<double> yt = nice_ticks(a.r.ylo, a.r.yhi, 5, 0, &ystep);
  const std::vector<std::string> yl = format_ticks(yt, ystep);
  int yscale = kScale;
  for (const auto& l : yl)
    if (text_width(l, kScale) > kLeft - 14) yscale = 1;
  for (size_t i = 0; i < yt.size(); ++i) {
    const int y = a.sy(yt[i]);
    cv.fill(a.left, y, a.right, y, kGrid);
    cv.fill(a.left - 5, y, a.left - 1, y, kBlack);
    cv.text(a.left - 9 - text_width(yl[i], yscale), y - 7 * yscale / 2, yl[i], kGray, yscale);
  }
}

// Draws the x ticks, grid lines, labels and the axis title: as many ticks as fit without their
// labels touching; steps are integers.
void draw_x_axis(Canvas& cv, const PlotArea& a) {
  std::vector<double> xt;
  double xstep = 1;
  std::vector<std::string> xl;
  for (int target = 6; target >= 1; --target) {
    xt = nice_ticks(a.r.xlo, a.r.xhi, target, 1, &xstep);
    xl = format_ticks(xt, xstep);
    int widest = 0;
    for (const auto& l : xl) widest = std::max(widest, text_width(l, kScale));
    if (xt.size() < 2 || a.sx(xt[1]) - a.sx(xt[0]) >= widest + 16) break;
  }
  for (size_t i = 0; i < xt.size(); ++i) {
    const int x = a.sx(xt[i]);
    cv.fill(x, a.top, x, a.bottom, kGrid);
    cv.fill(x, a.bottom + 1, x, a.bottom + 5, kBlack);
    cv.text(x - text_width(xl[i], kScale) / 2, a.bottom + 9, xl[i], kGray, kScale);
  }
  cv.text((a.left + a.right - text_width("step", kScale)) / 2, a.bottom + 30, "step", kBlack, kScale);
}

// Draws the series, clipped to the plot area.
void draw_series(Canvas& cv, const Panel& p, const PlotArea& a) {
  cv.clip(a.left + 1, a.top + 1, a.right - 1, a.bottom - 1);
  for (const auto& s : p.series) {
    const auto& pts = s.points;
    for (size_t i = 0; i < pts.size(); ++i) {
      const auto [x, y] = pts[i];
      if (s.ticks_only) {
        cv.fill(a.sx(x), a.bottom - 14, a.sx(x) + 1, a.bottom - 1, s.color);
        continue;
      }
      if (!std::isfinite(y)) continue;
      const bool prev = i > 0 && std::isfinite(pts[i - 1].second);
      const bool next = i + 1 < pts.size() && std::isfinite(pts[i + 1].second);
      if (prev) cv.line(a.sx(pts[i - 1].first), a.sy(pts[i - 1].second), a.sx(x), a.sy(y), s.color);
      // A point with no neighbour to join would otherwise be invisible.
      if (s.markers || (!prev && !next)) cv.fill(a.sx(x) - 3, a.sy(y) - 3, a.sx(x) + 3, a.sy(y) + 3, s.color);
    }
  }
  cv.clip_all();
}

// Draws the frame around the plot area.
void draw_frame(Canvas& cv, const PlotArea& a) {
  cv.fill(a.left, a.top, a.right, a.top, kBlack);
  cv.fill(a.left, a.bottom, a.right, a.bottom, kBlack);
  cv.fill(a.left, a.top, a.left, a.bottom, kBlack);
  cv.fill(a.right, a.top, a.right, a.bottom, kBlack);
}

// Draws panel `p` into the cell whose top left corner is (ox, oy).
void draw_panel(Canvas& cv, const Panel& p, int ox, int oy) {
  const int left = ox + kLeft, right = ox + kCellW - kRight, top = oy + kTop, bottom = oy + kCellH - kBottom;
  cv.text(left, oy + 10, p.title, kBlack, kScale);
  draw_legend(cv, p, ox, oy, left);
  const PlotArea a{left, right, top, bottom, data_ranges(p)};
  draw_y_axis(cv, a);
  draw_x_axis(cv, a);
  draw_series(cv, p, a);
  if (!a.r.has_y) {
    const std::string msg = "no data";
    cv.text((left + right - text_width(msg, kScale)) / 2, (top + bottom) / 2 - 7, msg, kGray, kScale);
  }
  // The frame last, over grid lines and series.
  draw_frame(cv, a);
}

}  // namespace

TrainingLog read_training_log(const std::filesystem::path& jsonl) {
  std::error_code ec;
  if (std::filesystem::is_directory(jsonl, ec)) throw std::runtime_error("cannot read " + jsonl.string() + ": is a directory");
  std::ifstream in(jsonl);
  if (!in) throw std::runtime_error("cannot read " + jsonl.string() + ": " + std::strerror(errno));
  TrainingLog log;
  std::string text;
  for (size_t line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      bad_line(jsonl, line, std::string("not JSON (") + e.what() + ")");
    }
    if (!j.is_object()) bad_line(jsonl, line, "not a JSON object");
    if (auto ev = j.find("event"); ev != j.end()) {
      if (!ev->is_string()) bad_line(jsonl, line, "\"event\" is not a string");
      if (*ev == "start") {
        ++log.starts;
      } else if (*ev == "eval") {
        const int64_t step = step_of(j, jsonl, line);
        log.eval_loss[step] = number_or_nan(j, "eval_loss", jsonl, line);
      }  // other events (checkpoints, ...) do not go in the plot
      continue;
    }
    if (!j.contains("step")) bad_line(jsonl, line, "neither a step (no \"step\") nor an event (no \"event\")");
    StepPoint pt;
    pt.loss = number_or_nan(j, "loss", jsonl, line);
    pt.lr = number_or_nan(j, "lr", jsonl, line);
    pt.tokens_per_s = number_or_nan(j, "tokens_per_s", jsonl, line);
    pt.device_peak = number_or_nan(j, "device_peak", jsonl, line);
    pt.host_state = number_or_nan(j, "host_state", jsonl, line);
    pt.nvme_state = number_or_nan(j, "nvme_state", jsonl, line);
    if (auto sk = j.find("skipped"); sk != j.end() && !sk->is_null()) {
      if (!sk->is_boolean()) bad_line(jsonl, line, "\"skipped\" is not true or false");
      pt.skipped = sk->get<bool>();
    }
    log.steps[step_of(j, jsonl, line)] = pt;  // a resumed run's later line replaces the earlier
  }
  if (in.bad()) throw std::runtime_error("cannot read " + jsonl.string() + ": " + std::strerror(errno));
  if (log.steps.empty()) throw std::runtime_error(jsonl.string() + " has no step lines: nothing to plot");
  return log;
}

void render_training_log(const TrainingLog& log, const std::filesystem::path& png) {
  if (log.steps.empty()) throw std::runtime_error("nothing to plot into " + png.string() + ": no steps");
  auto series = [&](const std::string& name, Rgb color, double StepPoint::*field, double scale = 1) {
    Series s{name, color, {}};
    for (const auto& [step, pt] : log.steps) s.points.emplace_back(double(step), pt.*field * scale);
    return s;
  };
  constexpr double kGiB = 1.0 / (1ull << 30);

  Panel loss{"loss", {series("loss", kBlue, &StepPoint::loss)}};
  if (!log.eval_loss.empty()) {
    Series ev{"eval loss", kOrange, {}, true};
    for (const auto& [step, v] : log.eval_loss) ev.points.emplace_back(double(step), v);
    loss.series.push_back(std::move(ev));
  }
  Series skipped{"skipped", kRed, {}, false, true};
  for (const auto& [step, pt] : log.steps)
    if (pt.skipped) skipped.points.emplace_back(double(step), kNaN);
  if (!skipped.points.empty()) loss.series.push_back(std::move(skipped));

  const Panel panels[4] = {
      loss,
      {"learning rate", {series("lr", kGreen, &StepPoint::lr)}},
      {"tokens/s", {series("tokens/s", kPurple, &StepPoint::tokens_per_s)}},
      {"memory per tier (GiB)",
       {series("device peak", kBlue, &StepPoint::device_peak, kGiB),
        series("host state", kOrange, &StepPoint::host_state, kGiB),
        series("nvme state", kGreen, &StepPoint::nvme_state, kGiB)},
       true},
  };
  Canvas cv(kPlotWidth, kPlotHeight);
  for (int i = 0; i < 4; ++i) draw_panel(cv, panels[i], (i % 2) * kCellW, (i / 2) * kCellH);
  cv.write_png(png);
}

void plot_training_log(const std::filesystem::path& jsonl, const std::filesystem::path& png) {
  render_training_log(read_training_log(jsonl), png);
}

int plot_main(const std::vector<std::string>& args) {
  constexpr const char* kUsage = R"(usage: strata plot LOG.jsonl -o OUT.png

Draws a training run's log (`strata train --log`) into a 1200 x 900 PNG: loss and eval loss,
learning rate, tokens/s and memory per tier (device peak, host state, NVMe state) by step.
When a resumed run repeated steps, the later lines are drawn.
)";
  std::string log, out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    }
    if (a == "-o" || a == "--output") {
      if (i + 1 == args.size()) {
        std::cerr << "strata plot: " << a << " needs a file name\n" << kUsage;
        return 2;
      }
      out = args[++i];
    } else if (a.rfind("--output=", 0) == 0) {
      out = a.substr(9);
    } else if (a.size() > 1 && a[0] == '-') {
      std::cerr << "strata plot: unknown option " << a << "\n" << kUsage;
      return 2;
    } else if (log.empty()) {
      log = a;
    } else {
      std::cerr << "strata plot: one log at a time (" << log << ", " << a << ")\n" << kUsage;
      return 2;
    }
  }
  if (log.empty() || out.empty()) {
    std::cerr << "strata plot: " << (log.empty() ? "no log given" : "no output given (-o OUT.png)") << "\n" << kUsage;
    return 2;
  }
  try {
    const TrainingLog tl = read_training_log(log);
    render_training_log(tl, out);
    std::cerr << "strata plot: wrote " << out << " (" << tl.steps.size() << " steps, " << tl.eval_loss.size()
              << " eval points)\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "strata plot: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace strata::cli
