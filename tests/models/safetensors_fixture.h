// What the safetensors tests share (safetensors_read_test.cc, safetensors_writer_test.cc,
// safetensors_sharded_test.cc, safetensors_oracle_test.cc): files' bytes in and out, the message
// of the SafetensorsError a call throws, and a fixture with a temporary directory.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>
#include <string>

#include "strata/models/safetensors.h"
#include "test_util.h"

namespace strata::models::safetensors_testing {

namespace fs = std::filesystem;

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << p;
}

inline std::string as_string(std::span<const std::byte> s) {
  return std::string(reinterpret_cast<const char*>(s.data()), s.size());
}

inline std::span<const std::byte> as_bytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const SafetensorsError& e) {
    return e.what();
  }
  return "<no SafetensorsError thrown>";
}

#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nwanted: " << (part)

inline std::string pattern(size_t n, uint64_t seed) {
  const auto v = test::random_bytes(n, seed);
  return std::string(reinterpret_cast<const char*>(v.data()), v.size());
}

class Safetensors : public ::testing::Test {
 protected:
  // Writes a file named `name` and returns the error message of opening it.
  std::string open_error(const std::string& name, const std::string& bytes) {
    spit(dir_ / name, bytes);
    return error_of([&] { SafetensorsFile f(dir_ / name); });
  }
  test::TempDir dir_;
};

}  // namespace strata::models::safetensors_testing
