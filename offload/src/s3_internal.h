// Private to the S3 driver (s3_http.cc, s3_store.cc, s3_multipart.cc): the HTTP layer's pool,
// the answers and errors it passes up, and the store class; nothing here is offload's API.
#pragma once

#include <boost/asio/ssl.hpp>
#include <boost/property_tree/ptree.hpp>
#include <boost/property_tree/xml_parser.hpp>

#include <chrono>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "strata/offload/s3.h"

namespace strata::offload::s3_detail {

namespace asio = boost::asio;
namespace ssl = asio::ssl;
using Kind = ObjectStoreError::Kind;
using Query = std::vector<std::pair<std::string, std::string>>;
using Headers = std::map<std::string, std::string>;

// --- The HTTP layer (s3_http.cc) ---------------------------------------------------------------

// A failure below HTTP: no answer (connect, send, receive, timeout).
struct TransportError {
  std::string message;
  bool before_response = false;  // nothing of an answer arrived
  bool permanent = false;        // retrying cannot help (the server's certificate is refused)
};

struct Response {
  int status = 0;
  Headers headers;  // lower-case names
  std::string body;
  bool body_in_destination = false;  // a 200/206 body went straight into the caller's buffer
  // An earlier send of this request may have reached the server (its answer was lost): a
  // conditional request's "precondition failed" may then be its own earlier success.
  bool repeated = false;
  std::string header(const char* name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

struct Endpoint {
  bool tls = false;
  std::string host;  // without port
  std::string port;
  bool default_port = true;
};

// Throws ObjectStoreError(kInvalidArgument) for a URL that is not scheme://host[:port].
Endpoint parse_endpoint(const std::string& url);

struct Connection;  // one socket (TLS or not) and its io_context; s3_http.cc

class HttpPool {
 public:
  HttpPool(Endpoint endpoint, const S3Options& options);
  ~HttpPool();

  // After the server closed one idle connection it has likely closed the others too.
  void drop_idle();

  // One attempt: sends the request and reads the whole answer. Throws TransportError.
  // `reused` tells whether a pooled connection carried it.
  Response exchange(const std::string& method, const std::string& host, const std::string& target,
                    const Headers& headers, std::span<const std::byte> body, bool* reused,
                    std::span<std::byte> into = {});

 private:
  std::unique_ptr<Connection> take(bool* reused);
  void give_back(std::unique_ptr<Connection> c);
  std::unique_ptr<Connection> connect(const std::string& host_header);

  Endpoint endpoint_;
  S3Options options_;
  std::optional<ssl::context> tls_context_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Connection>> idle_;
};

// --- Answers and errors (s3_store.cc) ----------------------------------------------------------

// The first child element `name` of an XML document's root, or "".
struct Xml {
  boost::property_tree::ptree tree;
  static std::optional<Xml> parse(const std::string& body) {
    if (body.empty()) return std::nullopt;
    try {
      Xml xml;
      std::istringstream in(body);
      boost::property_tree::read_xml(in, xml.tree);
      return xml;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
};

struct S3ErrorInfo {
  std::string code, message, request_id;
};

S3ErrorInfo error_info(const Response& r);
bool retryable(int status, const std::string& code);
Kind kind_of(int status, const std::string& code);
std::chrono::milliseconds backoff(const S3Options& o, int attempt);

// --- The store (s3_store.cc; its multipart upload in s3_multipart.cc) --------------------------

class S3Store final : public ObjectStore {
 public:
  S3Store(std::string bucket, std::string prefix, S3Options options);

  std::string url() const override {
    return "s3://" + bucket_ + (prefix_.empty() ? "" : "/" + prefix_);
  }
  uint64_t min_part_bytes() const override { return 5ull << 20; }

  void put(const std::string& key, std::span<const std::byte> data) override;
  bool put_if_absent(const std::string& key, std::span<const std::byte> data) override;
  std::optional<ObjectInfo> head(const std::string& key) override;
  void get(const std::string& key, uint64_t offset, std::span<std::byte> out) override;
  std::vector<ObjectInfo> list(const std::string& prefix) override;
  void remove(const std::string& key) override;
  std::unique_ptr<MultipartUpload> start_multipart(const std::string& key) override;
  std::vector<PendingUpload> list_multipart_uploads(const std::string& prefix) override;
  void abort_multipart_upload(const PendingUpload& upload) override;

  // --- shared with S3Upload ---

  std::string object_path(const std::string& key) const {
    return bucket_path() + (bucket_path() == "/" ? "" : "/") + full_key_prefix() + key;
  }

  // Sends with retries; returns the final answer (whatever its status) unless every attempt
  // failed to get one or the last one was a retryable error. A 200 whose body is an <Error>
  // (S3 does that for CompleteMultipartUpload) counts as that error when `error_in_body`. A
  // 200/206 body of exactly `into.size()` bytes goes into `into` (Response::body_in_destination).
  Response send(const char* op, const std::string& key, const std::string& method,
                const std::string& path, const Query& query, const Headers& headers,
                std::span<const std::byte> body, bool error_in_body = false, std::span<std::byte> into = {});

  [[noreturn]] void fail_status(const Response& r, const char* op, const std::string& key) const;

  void expect(const Response& r, std::initializer_list<int> ok, const char* op,
              const std::string& key) const;

  [[noreturn]] void bad_answer(const char* op, const std::string& key, const Response& r) const;

  static std::string unquote(std::string s) {
    if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
    return s;
  }

 private:
  static std::string describe_status(const Response& r, const S3ErrorInfo& info);

  [[noreturn]] void fail_not_found(const char* op, const std::string& key) const;

  [[noreturn]] void past_end(const std::string& key, uint64_t offset, uint64_t size,
                             const std::string& total) const;

  static std::string total_of(const std::string& content_range);

  std::string host_header() const {
    return endpoint_.default_port ? endpoint_.host : endpoint_.host + ":" + endpoint_.port;
  }
  std::string bucket_path() const { return virtual_hosted_ ? "/" : "/" + bucket_; }
  std::string full_key_prefix() const { return prefix_.empty() ? "" : prefix_ + "/"; }

  std::string bucket_;
  std::string prefix_;
  S3Options options_;
  Endpoint endpoint_;
  HttpPool pool_;
  bool virtual_hosted_ = false;
};

}  // namespace strata::offload::s3_detail
