// The S3 driver: options, where they come from, request signing, and the store.
//
// Options come from the standard AWS sources, in the order the AWS CLI uses:
//   credentials  AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), else the
//                profile's entry in the shared credentials file (AWS_SHARED_CREDENTIALS_FILE or
//                ~/.aws/credentials), else in the config file (AWS_CONFIG_FILE or ~/.aws/config);
//   profile      AWS_PROFILE, else AWS_DEFAULT_PROFILE, else "default";
//   region       AWS_REGION, else AWS_DEFAULT_REGION, else the profile's `region`, else us-east-1;
//   endpoint     AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else the profile's `endpoint_url`,
//                else https://s3.<region>.amazonaws.com;
//   addressing   STRATA_S3_ADDRESSING (path | virtual), else virtual-hosted on amazonaws.com
//                endpoints and path-style elsewhere (self-hosted servers rarely have wildcard DNS);
//   CAs          AWS_CA_BUNDLE, else the profile's `ca_bundle`, else the system's.
// Not supported (an error says so when nothing else gives credentials): instance metadata, SSO,
// credential_process, assume-role profiles.
//
// Signing is AWS Signature Version 4 with OpenSSL's HMAC-SHA256. Payloads are signed with their
// SHA-256; with `unsigned_payload` set, requests over https send UNSIGNED-PAYLOAD instead (TLS
// protects the bytes; the option is refused for http). tests/offload/s3_sigv4_test checks the
// signatures against botocore's signer on the same requests.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "strata/offload/object_store.h"

namespace strata::offload {

struct S3Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty when none
};

struct S3Options {
  std::string endpoint;  // "http://127.0.0.1:7480" or "https://s3.eu-west-1.amazonaws.com"
  std::string region = "us-east-1";
  S3Credentials credentials;
  enum class Addressing { kAuto, kPath, kVirtual } addressing = Addressing::kAuto;
  bool unsigned_payload = false;  // https only
  bool verify_tls = true;         // verify the server's certificate and host name
  std::string ca_bundle;          // PEM file of the CAs to trust; empty: the system's
  // Retries: attempts per request, sleeping a random time in [0, min(cap, base * 2^attempt)).
  int max_attempts = 8;
  std::chrono::milliseconds backoff_base{50};
  std::chrono::milliseconds backoff_cap{5000};
  // A connection attempt, and one request's send + answer, each give up after these.
  std::chrono::milliseconds connect_timeout{10000};
  std::chrono::milliseconds request_timeout{120000};
  bool reuse_connections = true;  // keep-alive pool; tests turn it off to control each request
  int list_page_keys = 1000;      // ListObjectsV2 max-keys
};

// Resolves the options from `env` (variable name -> value; the process environment when null)
// and the profile files under `home` (the HOME variable when empty). Throws
// ObjectStoreError(kInvalidArgument) naming what is missing or malformed.
S3Options s3_options_from_environment(const std::map<std::string, std::string>* env = nullptr,
                                      const std::string& home = {});

// One request as the signer sees it. `path` is the URL path before encoding ("/bucket/key");
// `query` holds decoded names and values; `headers` are the headers to sign (the signer adds
// host, x-amz-date, x-amz-content-sha256 and x-amz-security-token).
struct S3Request {
  std::string method;
  std::string host;  // with ":port" when the port is not the scheme's default
  std::string path;
  std::vector<std::pair<std::string, std::string>> query;
  std::map<std::string, std::string> headers;
  std::string payload_sha256;  // hex, or "UNSIGNED-PAYLOAD"
};

// Adds x-amz-date, x-amz-content-sha256, x-amz-security-token (when a session token is set) and
// Authorization to request.headers. `amz_date` is "YYYYMMDDTHHMMSSZ".
void s3_sign(S3Request& request, const S3Credentials& credentials, const std::string& region,
             const std::string& amz_date);
std::string s3_amz_date_now();
std::string sha256_hex(const void* data, size_t size);
// RFC 3986 percent-encoding as SigV4 wants it: unreserved bytes stay, '/' stays when
// keep_slash, every other byte is %XX in upper case.
std::string s3_uri_encode(std::string_view text, bool keep_slash);

// The S3 driver on bucket/prefix (prefix may be empty). Its protocol is written in s3_store.cc.
std::unique_ptr<ObjectStore> open_s3_store(const std::string& bucket, const std::string& prefix,
                                           const S3Options& options);
// Creates a bucket; an existing bucket owned by the caller is fine. For tests and tools.
void s3_create_bucket(const std::string& bucket, const S3Options& options);

}  // namespace strata::offload
