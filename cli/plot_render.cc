// `strata plot`'s drawing: a training log's four panels (loss and eval loss, learning rate,
// tokens/s, memory per tier) with their axes, ticks, legends and series, on a Canvas
// (plot_canvas.cc) written as PNG.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plot.h"
#include "plot_internal.h"

namespace strata::cli {

using namespace plot_detail;

namespace {

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

}  // namespace strata::cli
