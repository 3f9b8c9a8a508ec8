// What the S3 driver's tests against the server share (s3_conformance_test.cc, s3_faults_test.cc):
// the bucket, the server's options (tests/common/s3_server.h) and names unique in this process.
#pragma once

#include <unistd.h>

#include <atomic>
#include <string>

#include "s3_server.h"
#include "strata/offload/s3.h"

namespace strata::offload::s3_testing {

inline const char* const kBucket = strata::test::kS3Bucket;

inline const S3Options& server() { return strata::test::s3_server(); }

// One counter for the whole test program (an inline function's static), as when the tests were
// one file.
inline std::string unique(const std::string& tag) {
  static std::atomic<int> n{0};
  return tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

}  // namespace strata::offload::s3_testing
