// The S3 server the tests use (scripts/s3-server.sh): ctest starts one for all S3 tests (fixture
// "s3", tests/CMakeLists.txt) and passes its variables file in STRATA_S3_ENV; a test binary run
// by hand without it starts a private one and stops it at exit. Needs STRATA_SOURCE_DIR.
#pragma once

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>

#include "strata/offload/s3.h"
#include "test_util.h"

namespace strata::test {

inline const char* kS3Bucket = "strata-test";

// The server's options, once per process; the bucket kS3Bucket exists. Also exports the AWS_*
// variables, so that open_object_store("s3://...") reaches the same server.
inline const offload::S3Options& s3_server() {
  static offload::S3Options options = [] {
    std::string env_file;
    if (const char* given = std::getenv("STRATA_S3_ENV")) {
      env_file = given;
    } else {
      static TempDir dir;
      static const std::string script = std::string(STRATA_SOURCE_DIR) + "/scripts/s3-server.sh";
      static const std::string where = (dir / "s3").string();
      if (std::system((script + " start " + where + " 0 >/dev/null").c_str()) != 0)
        throw std::runtime_error("could not start an S3 server with " + script);
      env_file = where + "/env";
      std::atexit([] { std::system((script + " stop " + where).c_str()); });
    }
    std::ifstream in(env_file);
    std::string line;
    if (!std::getline(in, line)) throw std::runtime_error("no S3 server variables in " + env_file);
    std::map<std::string, std::string> vars;
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      const size_t eq = word.find('=');
      if (eq == std::string::npos) continue;
      vars[word.substr(0, eq)] = word.substr(eq + 1);
      setenv(word.substr(0, eq).c_str(), word.substr(eq + 1).c_str(), 1);
    }
    offload::S3Options o = offload::s3_options_from_environment(&vars, "/nonexistent");
    offload::s3_create_bucket(kS3Bucket, o);
    return o;
  }();
  return options;
}

}  // namespace strata::test
