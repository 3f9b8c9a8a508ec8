// `strata plot`'s raster: the embedded 5 x 8 bitmap font, the Canvas's lines and text, and its
// encoding as PNG with libpng.
#include <png.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "plot_internal.h"

namespace strata::cli::plot_detail {
namespace {

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

}  // namespace

int text_width(const std::string& s, int scale) {
  return s.empty() ? 0 : (static_cast<int>(s.size()) * kAdvance - 1) * scale;
}

void Canvas::line(int x0, int y0, int x1, int y1, Rgb c, int width) {
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

void Canvas::text(int x, int y, const std::string& s, Rgb c, int scale) {
  for (char ch : s) {
    const Glyph& g = glyph(ch);
    for (int r = 0; r < kGlyphH; ++r)
      for (int col = 0; col < kGlyphW; ++col)
        if (g.rows[r] & (1 << (kGlyphW - 1 - col)))
          fill(x + col * scale, y + r * scale, x + col * scale + scale - 1, y + r * scale + scale - 1, c);
    x += kAdvance * scale;
  }
}

void Canvas::write_png(const std::filesystem::path& path) const {
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

}  // namespace strata::cli::plot_detail
