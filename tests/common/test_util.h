// Helpers shared by the test suites.
#pragma once

#include <ftw.h>
#include <stdlib.h>

#include <cstdio>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace strata::test {

// A file's bytes ("" when it cannot be read).
inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// What `f` throws, or "no error".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

// A fresh directory removed with its contents at the end of the test. $STRATA_TEST_DIR chooses
// the parent (default: the system temp directory).
class TempDir {
 public:
  TempDir() {
    const char* parent = std::getenv("STRATA_TEST_DIR");
    std::string tmpl = (parent ? std::filesystem::path(parent)
                               : std::filesystem::temp_directory_path()) /
                       "strata-test-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp " + tmpl);
    path_ = tmpl;
  }
  // Removed with nftw, not std::filesystem::remove_all: libtorch.so exports its own copy of
  // libstdc++'s filesystem library and its remove_all crashes when it interposes ours.
  ~TempDir() {
    nftw(path_.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
         16, FTW_DEPTH | FTW_PHYS);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

inline void fill_random(std::byte* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng());
}

}  // namespace strata::test
