// The S3 driver's request signatures (SigV4) against botocore's signer on the same requests
// (tests/offload/py/sigv4_oracle.py); skipped when STRATA_PYTHON is not set.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "strata/offload/s3.h"
#include "test_util.h"

namespace strata::offload {
namespace {

std::string json_escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

TEST(S3Sign, SignaturesEqualBotocoresOnTheSameRequests) {
  if (std::string(STRATA_PYTHON).empty()) GTEST_SKIP() << "no STRATA_PYTHON with botocore";
  strata::test::TempDir dir;
  const std::string cases = (dir / "cases.jsonl").string();
  std::ofstream out(cases);
  std::mt19937_64 rng(2026);
  const std::vector<std::string> paths = {"/bucket/plain.bin", "/bucket/dir/a b+c=d&e%f~g.bin",
                                          "/bucket/ünï/ключ", "/", "/bucket", "/bucket/q?x#y;z,@$!'()*"};
  const std::vector<std::vector<std::pair<std::string, std::string>>> queries = {
      {}, {{"uploads", ""}}, {{"partNumber", "7"}, {"uploadId", "2~abc/def+ghi="}},
      {{"list-type", "2"}, {"prefix", "ckpt/step 1/"}, {"max-keys", "7"}, {"continuation-token", "1/a=b&c"}},
      {{"b", "2"}, {"a", "1"}, {"a", "0"}}};
  int n = 0;
  for (const auto& method : {"GET", "PUT", "HEAD", "DELETE", "POST"}) {
    for (const auto& path : paths) {
      for (const auto& query : queries) {
        for (int variant = 0; variant < 2; ++variant) {
          const bool https = variant == 1;
          const bool unsigned_payload = https && (rng() & 1);
          const std::string host = https ? "s3.eu-west-1.amazonaws.com" : "127.0.0.1:7480";
          const std::string body = std::string(method) == "PUT" ? std::string(rng() % 100, 'x') + "body" : "";
          S3Request r{method, host, path, query, {}, unsigned_payload ? "UNSIGNED-PAYLOAD"
                                                                       : sha256_hex(body.data(), body.size())};
          if (rng() & 1) r.headers["Range"] = "bytes=" + std::to_string(rng() % 1000) + "-2000";
          if (rng() & 1) r.headers["If-None-Match"] = "*";
          if (rng() & 1) r.headers["Content-Type"] = "application/xml";
          S3Credentials c{"AKIDEXAMPLE" + std::to_string(n), "wJalrXUtnFEMI/K7MDENG+bPxRfiCY" + std::to_string(n),
                          (n % 3 == 0) ? "session/token+" + std::to_string(n) : ""};
          const std::string region = n % 2 ? "us-east-1" : "eu-west-1";
          const std::string date = "2026112" + std::to_string(n % 10) + "T0" + std::to_string(n % 10) + "1530Z";
          const auto headers_before = r.headers;
          s3_sign(r, c, region, date);
          std::string hex;
          for (unsigned char ch : body) {
            char b[3];
            std::snprintf(b, sizeof b, "%02x", ch);
            hex += b;
          }
          out << "{\"method\":\"" << method << "\",\"scheme\":\"" << (https ? "https" : "http")
              << "\",\"host\":\"" << host << "\",\"path\":\"" << json_escape(path) << "\",\"query\":[";
          for (size_t i = 0; i < query.size(); ++i) {
            out << (i ? "," : "") << "[\"" << json_escape(query[i].first) << "\",\"" << json_escape(query[i].second) << "\"]";
          }
          out << "],\"headers\":{";
          bool first = true;
          for (const auto& [k, v] : headers_before) {
            out << (first ? "" : ",") << "\"" << k << "\":\"" << json_escape(v) << "\"";
            first = false;
          }
          out << "},\"body_hex\":\"" << hex << "\",\"unsigned\":" << (unsigned_payload ? "true" : "false")
              << ",\"access_key\":\"" << c.access_key_id << "\",\"secret_key\":\"" << json_escape(c.secret_access_key)
              << "\",\"token\":\"" << json_escape(c.session_token) << "\",\"region\":\"" << region
              << "\",\"amz_date\":\"" << date << "\",\"authorization\":\"" << r.headers["Authorization"] << "\"}\n";
          ++n;
        }
      }
    }
  }
  out.close();
  const std::string command = std::string(STRATA_PYTHON) + " " + STRATA_TEST_PY_DIR + "/sigv4_oracle.py " +
                              cases + " > " + (dir / "result.txt").string() + " 2>&1";
  const int rc = std::system(command.c_str());
  std::ifstream result(dir / "result.txt");
  const std::string text((std::istreambuf_iterator<char>(result)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("checked " + std::to_string(n) + ", mismatches 0"), std::string::npos) << text;
}

}  // namespace
}  // namespace strata::offload
