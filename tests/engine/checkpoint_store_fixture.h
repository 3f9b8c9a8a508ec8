// Shared by the object-storage checkpoint suites (checkpoint_store_test.cc,
// checkpoint_tiered_saves_test.cc): fresh names in the test bucket, and a file's bytes.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "s3_server.h"

namespace strata::test {

// `tag` made unique in this process (one counter for every suite that includes this header).
inline std::string unique(const std::string& tag) {
  static std::atomic<int> n{0};
  return tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

// A store URL of its own in the bucket of the S3 server the fixture "s3" started.
inline std::string s3_store_url(const std::string& tag) {
  s3_server();
  return std::string("s3://") + kS3Bucket + "/" + unique(tag);
}

inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace strata::test
