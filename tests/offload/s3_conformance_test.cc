// The S3 driver against a real S3 server (Ceph's RADOS Gateway, scripts/s3-server.sh): the
// conformance suite over http and over TLS, certificates, and the errors of a wrong secret, a
// missing bucket and unsigned payloads over http. The server: tests/common/s3_server.h.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>

#include "object_store_conformance.h"
#include "s3_fixture.h"
#include "s3_server.h"
#include "strata/offload/s3.h"

namespace strata::offload {
namespace {

using namespace s3_testing;
using test::ObjectStoreConformance;
using Kind = ObjectStoreError::Kind;

INSTANTIATE_TEST_SUITE_P(
    S3, ObjectStoreConformance,
    ::testing::Values(test::StoreMaker{
        "s3",
        [](const std::string& tag) {
          S3Options o = server();
          o.list_page_keys = 7;  // pagination on every listing of more than 7 keys
          return open_s3_store(kBucket, "conformance/" + tag, o);
        },
        16}),
    [](const auto& info) { return info.param.name; });

// The same server over https (scripts/s3-server.sh: a self-signed certificate for 127.0.0.1 and
// localhost, in STRATA_S3_CA).
S3Options https_options() {
  S3Options o = server();
  const char* endpoint = std::getenv("STRATA_S3_HTTPS_ENDPOINT");
  const char* ca = std::getenv("STRATA_S3_CA");
  if (!endpoint || !ca) throw std::runtime_error("the S3 server's variables have no https endpoint");
  o.endpoint = endpoint;
  o.ca_bundle = ca;
  return o;
}

// Over TLS, with UNSIGNED-PAYLOAD (allowed only there).
INSTANTIATE_TEST_SUITE_P(
    S3Tls, ObjectStoreConformance,
    ::testing::Values(test::StoreMaker{
        "s3_tls_unsigned_payload",
        [](const std::string& tag) {
          S3Options o = https_options();
          o.unsigned_payload = true;
          o.list_page_keys = 7;
          return open_s3_store(kBucket, "conformance-tls/" + tag, o);
        },
        16}),
    [](const auto& info) { return info.param.name; });

TEST(S3Tls, AnUntrustedCertificateIsRefusedAtOnceSayingWhatToDo) {
  S3Options o = https_options();
  o.ca_bundle.clear();  // the system's CAs do not know the test certificate
  auto store = open_s3_store(kBucket, unique("untrusted"), o);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    store->put("k", std::as_bytes(std::span("x", 1)));
    FAIL() << "a server with an untrusted certificate was accepted";
  } catch (const ObjectStoreError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.kind(), Kind::kAccessDenied) << what;
    EXPECT_NE(what.find("certificate verify failed"), std::string::npos) << what;
    EXPECT_NE(what.find("AWS_CA_BUNDLE"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3)) << "a refused certificate was retried";
  o.verify_tls = false;  // explicitly off: the same server is fine
  open_s3_store(kBucket, unique("unverified"), o)->put("k", std::as_bytes(std::span("x", 1)));
}

TEST(S3Tls, TheCertificatesHostNameIsChecked) {
  S3Options o = https_options();
  // The certificate names localhost and 127.0.0.1: both work.
  const std::string port = o.endpoint.substr(o.endpoint.rfind(':') + 1);
  o.endpoint = "https://localhost:" + port;
  open_s3_store(kBucket, unique("by-name"), o)->put("k", std::as_bytes(std::span("x", 1)));
  // A CA file that does not exist is a clear error before anything is sent.
  o.ca_bundle = "/nonexistent/ca.pem";
  try {
    open_s3_store(kBucket, unique("no-ca"), o);
    FAIL();
  } catch (const ObjectStoreError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/ca.pem"), std::string::npos) << e.what();
  }
}

TEST(S3Store, UnsignedPayloadsAreRefusedOverHttp) {
  S3Options o = server();
  o.unsigned_payload = true;
  try {
    open_s3_store(kBucket, "x", o);
    FAIL();
  } catch (const ObjectStoreError& e) {
    EXPECT_EQ(e.kind(), Kind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("need https"), std::string::npos) << e.what();
  }
}

TEST(S3Store, AWrongSecretIsAClearErrorWithTheRequestId) {
  S3Options o = server();
  o.credentials.secret_access_key = "wrong";
  auto store = open_s3_store(kBucket, unique("wrong-secret"), o);
  try {
    store->put("k", std::as_bytes(std::span("x", 1)));
    FAIL() << "a put with a wrong secret succeeded";
  } catch (const ObjectStoreError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.kind(), Kind::kAccessDenied) << what;
    EXPECT_EQ(e.http_status(), 403);
    EXPECT_EQ(e.code(), "SignatureDoesNotMatch");
    EXPECT_FALSE(e.request_id().empty());
    EXPECT_NE(what.find("PutObject s3://strata-test/wrong-secret"), std::string::npos) << what;
    EXPECT_NE(what.find("request id " + e.request_id()), std::string::npos) << what;
  }
}

TEST(S3Store, AMissingBucketIsNotFound) {
  auto store = open_s3_store("no-such-bucket-here", "", server());
  try {
    store->put("k", std::as_bytes(std::span("x", 1)));
    FAIL();
  } catch (const ObjectStoreError& e) {
    EXPECT_EQ(e.kind(), Kind::kNotFound) << e.what();
    EXPECT_EQ(e.code(), "NoSuchBucket") << e.what();
  }
  EXPECT_FALSE(open_s3_store("no-such-bucket-here", "", server())->head("k"));
}

TEST(S3Store, OpensFromAnS3UrlWithTheEnvironmentsOptions) {
  const S3Options& o = server();  // also exports AWS_ENDPOINT_URL and the credentials
  const std::string prefix = unique("by-url");
  auto store = open_object_store(std::string("s3://") + kBucket + "/" + prefix + "/");
  EXPECT_EQ(store->url(), std::string("s3://") + kBucket + "/" + prefix);
  store->put("x", std::as_bytes(std::span("abc", 3)));
  EXPECT_EQ(open_s3_store(kBucket, prefix, o)->get_all("x").size(), 3u);
}

}  // namespace
}  // namespace strata::offload
