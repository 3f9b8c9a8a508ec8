// Private to `strata plot` (plot.cc, plot_canvas.cc, plot_render.cc): the palette and the RGB
// canvas that plot_render.cc draws the panels on and plot_canvas.cc rasterizes text into and
// encodes as PNG.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

namespace strata::cli::plot_detail {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Rgb {
  uint8_t r, g, b;
};
constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrid{225, 225, 225}, kGray{110, 110, 110};
// Series colors (tests/cli/py/plot_check.py looks for them in each panel).
constexpr Rgb kBlue{31, 119, 180}, kOrange{255, 127, 14}, kGreen{44, 160, 44}, kRed{214, 39, 40},
    kPurple{148, 103, 189};

// The width in pixels of `s` in the canvas's 5 x 8 font at `scale` (plot_canvas.cc).
int text_width(const std::string& s, int scale);

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
  void line(int x0, int y0, int x1, int y1, Rgb c, int width = 2);
  // `y` is the top of the glyph cell.
  void text(int x, int y, const std::string& s, Rgb c, int scale);

  // A regular file (or a new one) is replaced whole: the image goes to a temporary file beside
  // it, renamed over it once complete, so a failed write leaves the previous plot. Anything else
  // (a pipe, /dev/stdout) is written in place and never removed or replaced; libpng's
  // png_image_write_to_file is not used because it unlinks its output when a write fails.
  void write_png(const std::filesystem::path& path) const;

 private:
  int w_, h_;
  std::vector<uint8_t> px_;
  int cx0_, cy0_, cx1_, cy1_;
};

}  // namespace strata::cli::plot_detail
