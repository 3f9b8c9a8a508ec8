// The S3 driver: an ObjectStore on a bucket and key prefix, over HTTP/1.1 with Boost.Beast.
//
// Protocol (how the guarantees of object_store.h are met on S3 and its look-alikes):
//   - put is one PutObject with the payload's SHA-256 signed (an S3 PUT replaces atomically);
//   - put_if_absent is PutObject with "If-None-Match: *" (412 when the key exists). When an
//     attempt was retried (its answer lost to a dropped connection or a timeout), a 412 may be
//     this call's own earlier success: the driver then reads the object and reports success
//     exactly when the bytes are this call's;
//   - get is a ranged GET; an answer shorter than asked (S3 cuts a range at the object's end) is
//     kInvalidArgument, never a short read;
//   - list is ListObjectsV2 with continuation tokens, list_page_keys per page;
//   - a multipart upload is Create/UploadPart/Complete/AbortMultipartUpload. A 200 answer to
//     Complete that carries an <Error> is an error (S3 sends those). An empty ETag in Complete's
//     answer (RGW 16.2 does that) is filled in with a HEAD. A Complete retried after its answer
//     was lost may find the upload gone (NoSuchUpload): it then counts as done when HEAD shows an
//     object of the parts' total size;
//   - retries: network errors, timeouts, HTTP 5xx and 429, and the codes SlowDown,
//     RequestTimeout, InternalError and ConditionalRequestConflict are retried up to
//     max_attempts times with full-jitter exponential backoff; each attempt is signed afresh.
//     A request on a pooled keep-alive connection that the server closed meanwhile is resent
//     once on a new connection without counting as an attempt;
//   - threads: the store holds a pool of idle connections; a request takes one (or opens one),
//     drives it on the calling thread with its own io_context (a deadline timer per operation),
//     and puts it back when the answer allowed keep-alive. Any number of threads may call at once;
//     concurrency is the callers' (put_object / get_object run parts on several threads).
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <boost/property_tree/ptree.hpp>
#include <boost/property_tree/xml_parser.hpp>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "strata/offload/s3.h"

namespace strata::offload {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using Kind = ObjectStoreError::Kind;
using Query = std::vector<std::pair<std::string, std::string>>;
using Headers = std::map<std::string, std::string>;

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

Endpoint parse_endpoint(const std::string& url) {
  Endpoint e;
  std::string rest;
  if (url.starts_with("https://")) {
    e.tls = true;
    rest = url.substr(8);
  } else if (url.starts_with("http://")) {
    rest = url.substr(7);
  } else {
    throw ObjectStoreError(Kind::kInvalidArgument,
                           "S3 endpoint '" + url + "' must start with http:// or https://");
  }
  if (const size_t slash = rest.find('/'); slash != std::string::npos) {
    if (rest.substr(slash) != "/") {
      throw ObjectStoreError(Kind::kInvalidArgument,
                             "S3 endpoint '" + url + "' has a path; give scheme://host[:port]");
    }
    rest.resize(slash);
  }
  const size_t colon = rest.rfind(':');
  if (colon != std::string::npos && rest.find(']') == std::string::npos) {
    e.host = rest.substr(0, colon);
    e.port = rest.substr(colon + 1);
    e.default_port = e.port == (e.tls ? "443" : "80");
  } else {
    e.host = rest;
    e.port = e.tls ? "443" : "80";
  }
  if (e.host.empty()) throw ObjectStoreError(Kind::kInvalidArgument, "S3 endpoint '" + url + "' has no host");
  return e;
}

// A connection owns its io_context; the calling thread runs it for each exchange. One deadline
// timer per operation (not per socket read: a timer re-armed on every 64 KiB read costs a
// timerfd_settime each time, a tenth of a download's CPU) closes the socket when it expires.
struct Connection {
  explicit Connection(ssl::context* tls_context) : deadline(ioc) {
    if (tls_context) {
      tls.emplace(ioc, *tls_context);
    } else {
      socket.emplace(ioc);
    }
  }
  tcp::socket& lowest() { return tls ? tls->next_layer() : *socket; }

  asio::io_context ioc;
  std::optional<tcp::socket> socket;
  std::optional<ssl::stream<tcp::socket>> tls;
  asio::steady_timer deadline;
  beast::flat_buffer buffer;
};

// Runs the operations `start` posts on the calling thread until they call `done` (which cancels
// the deadline) or `timeout` passes (the socket is closed: they fail). True if it timed out.
template <class Start>
bool run_with_deadline(Connection& c, std::chrono::milliseconds timeout, Start start) {
  bool timed_out = false;
  c.deadline.expires_after(timeout);
  c.deadline.async_wait([&](const boost::system::error_code& ec) {
    if (ec) return;  // cancelled: the operation finished first
    timed_out = true;
    boost::system::error_code ignored;
    c.lowest().close(ignored);
  });
  start([&c] { c.deadline.cancel(); });
  c.ioc.restart();
  c.ioc.run();
  return timed_out;
}

// The answer as exchange_on read it: a body of exactly `into.size()` bytes (Content-Length)
// with status 200 or 206 is read from the socket straight into `into` (body_in_destination);
// any other body (an error's XML, a listing) is parsed into `text`.
struct Answer {
  http::response_parser<http::empty_body> header;
  bool body_in_destination = false;
  bool in_step = true;  // false: the connection holds bytes past the answer (not to be reused)
  std::optional<http::response_parser<http::string_body>> into_text;
  const http::response_header<>& message() const {
    if (into_text) return into_text->get().base();
    return header.get().base();
  }
  bool keep_alive() const {
    if (into_text) return into_text->keep_alive();
    return in_step && header.keep_alive();
  }
};

template <class Stream>
beast::error_code exchange_on(Connection& c, Stream& stream,
                              http::request<http::span_body<const char>>& request, Answer& answer,
                              std::span<std::byte> into, std::chrono::milliseconds timeout, bool* got_bytes) {
  constexpr uint64_t kNoLimit = std::numeric_limits<std::uint64_t>::max();  // boost::none is broken in 1.74
  beast::error_code result;
  answer.header.body_limit(kNoLimit);
  if (request.method() == http::verb::head) answer.header.skip(true);
  const bool timed_out = run_with_deadline(c, timeout, [&](auto done) {
    http::async_write(stream, request, [&, done](beast::error_code ec, size_t) {
      if (ec) {
        result = ec;
        done();
        return;
      }
      http::async_read_header(stream, c.buffer, answer.header, [&, done](beast::error_code ec2, size_t) {
        *got_bytes = answer.header.got_some();
        if (ec2 || answer.header.is_done()) {
          result = ec2;
          done();
          return;
        }
        const int status = static_cast<int>(answer.header.get().result_int());
        const auto length = answer.header.content_length();
        const auto finish = [&, done](beast::error_code ec3, size_t) {
          result = ec3;
          done();
        };
        if (!into.empty() && (status == 200 || status == 206) && length && *length == into.size()) {
          // The body as it comes, past Beast's parser: what the header's read already buffered,
          // then the rest straight from the socket into `into` (the parser reads 64 KiB at a time
          // through its buffer and copies out: on a 16 MiB range, 256 reads and copies).
          const size_t have = std::min<size_t>(c.buffer.size(), into.size());
          answer.in_step = c.buffer.size() <= into.size();  // more than the body: out of step
          asio::buffer_copy(asio::buffer(into.data(), have), c.buffer.data());
          c.buffer.consume(have);
          answer.body_in_destination = true;
          // Asio's own completion conditions read at most 64 KiB at a time; this one lets each
          // read take whatever the socket holds.
          const auto as_much_as_there_is = [](const beast::error_code& ec, size_t) -> size_t {
            return ec ? 0 : size_t(1) << 30;
          };
          asio::async_read(stream, asio::buffer(into.data() + have, into.size() - have), as_much_as_there_is, finish);
        } else {
          answer.into_text.emplace(std::move(answer.header));
          answer.into_text->body_limit(kNoLimit);
          http::async_read(stream, c.buffer, *answer.into_text, finish);
        }
      });
    });
  });
  return timed_out ? beast::error_code(beast::error::timeout) : result;
}

class HttpPool {
 public:
  HttpPool(Endpoint endpoint, const S3Options& options)
      : endpoint_(std::move(endpoint)), options_(options) {
    if (endpoint_.tls) {
      tls_context_.emplace(ssl::context::tls_client);
      if (options_.verify_tls) {
        boost::system::error_code ec;
        if (options_.ca_bundle.empty()) {
          tls_context_->set_default_verify_paths(ec);
        } else {
          tls_context_->load_verify_file(options_.ca_bundle, ec);
        }
        if (ec) {
          throw ObjectStoreError(Kind::kInvalidArgument,
                                 "S3: cannot load the CAs to trust from " +
                                     (options_.ca_bundle.empty() ? std::string("the system's default paths")
                                                                 : options_.ca_bundle) +
                                     ": " + ec.message());
        }
        tls_context_->set_verify_mode(ssl::verify_peer);
      } else {
        tls_context_->set_verify_mode(ssl::verify_none);
      }
    }
  }

  // After the server closed one idle connection it has likely closed the others too.
  void drop_idle() {
    std::lock_guard lock(mu_);
    idle_.clear();
  }

  // One attempt: sends the request and reads the whole answer. Throws TransportError.
  // `reused` tells whether a pooled connection carried it.
  Response exchange(const std::string& method, const std::string& host, const std::string& target,
                    const Headers& headers, std::span<const std::byte> body, bool* reused,
                    std::span<std::byte> into = {}) {
    std::unique_ptr<Connection> c = take(reused);
    if (!c) c = connect(host);
    http::request<http::span_body<const char>> request;
    request.method_string(method);
    request.target(target);
    request.version(11);
    request.set(http::field::host, host);
    request.set(http::field::user_agent, "strata/0.1");
    for (const auto& [name, value] : headers) request.set(name, value);
    request.body() = {reinterpret_cast<const char*>(body.data()), body.size()};
    if (method == "PUT" || method == "POST" || !body.empty()) {
      request.content_length(body.size());
    }
    request.keep_alive(options_.reuse_connections);

    Answer answer;
    bool got_bytes = false;
    const beast::error_code ec =
        c->tls ? exchange_on(*c, *c->tls, request, answer, into, options_.request_timeout, &got_bytes)
               : exchange_on(*c, *c->socket, request, answer, into, options_.request_timeout, &got_bytes);
    if (ec) {
      const std::string what = ec == beast::error::timeout
                                   ? "no answer within " +
                                         std::to_string(options_.request_timeout.count()) + " ms"
                                   : ec.message();
      // A timeout is never "nothing happened": the server may have acted on the request.
      throw TransportError{method + " to " + host + ": " + what, !got_bytes && ec != beast::error::timeout};
    }
    Response response;
    const auto& message = answer.message();
    response.status = static_cast<int>(message.result_int());
    for (const auto& field : message) {
      std::string name(field.name_string());
      std::transform(name.begin(), name.end(), name.begin(), ::tolower);
      response.headers[name] = std::string(field.value());
    }
    response.body_in_destination = answer.body_in_destination;
    if (answer.into_text) response.body = std::move(answer.into_text->get().body());
    if (options_.reuse_connections && answer.keep_alive()) {
      c->buffer.clear();
      give_back(std::move(c));
    }
    return response;
  }

 private:
  std::unique_ptr<Connection> take(bool* reused) {
    std::lock_guard lock(mu_);
    *reused = !idle_.empty();
    if (idle_.empty()) return nullptr;
    auto c = std::move(idle_.back());
    idle_.pop_back();
    return c;
  }

  void give_back(std::unique_ptr<Connection> c) {
    std::lock_guard lock(mu_);
    if (idle_.size() < 64) idle_.push_back(std::move(c));
  }

  std::unique_ptr<Connection> connect(const std::string& host_header) {
    auto c = std::make_unique<Connection>(tls_context_ ? &*tls_context_ : nullptr);
    // The host to reach is the Host header's (virtual-hosted names the bucket there) without port.
    std::string host = host_header;
    if (!endpoint_.default_port) host.resize(host.size() - endpoint_.port.size() - 1);
    tcp::resolver resolver(c->ioc);
    beast::error_code ec;
    const auto addresses = resolver.resolve(host, endpoint_.port, ec);
    if (ec) throw TransportError{"resolve " + host + ": " + ec.message(), true};
    const bool connect_timed_out = run_with_deadline(*c, options_.connect_timeout, [&](auto done) {
      asio::async_connect(c->lowest(), addresses, [&, done](beast::error_code e, const tcp::endpoint&) {
        ec = e;
        done();
      });
    });
    if (connect_timed_out) ec = beast::error::timeout;
    if (ec) {
      throw TransportError{"connect to " + host + ":" + endpoint_.port + ": " +
                               (ec == beast::error::timeout ? "timed out" : ec.message()),
                           true};
    }
    // Nagle's algorithm would hold a request's last partial segment until the server acknowledges
    // the earlier ones, and servers delay their acknowledgements (40 ms on Linux): a stall per
    // request. Every request is written whole at once, so nothing is gained by holding.
    c->lowest().set_option(tcp::no_delay(true), ec);
    if (c->tls) {
      // SNI names a host, never an address (RFC 6066).
      boost::system::error_code not_ip;
      asio::ip::make_address(host, not_ip);
      if (not_ip && !SSL_set_tlsext_host_name(c->tls->native_handle(), host.c_str())) {
        throw TransportError{"TLS to " + host + ": cannot set the server name", true};
      }
      if (options_.verify_tls) c->tls->set_verify_callback(ssl::host_name_verification(host));
      const bool handshake_timed_out = run_with_deadline(*c, options_.connect_timeout, [&](auto done) {
        c->tls->async_handshake(ssl::stream_base::client, [&, done](beast::error_code e) {
          ec = e;
          done();
        });
      });
      if (handshake_timed_out) ec = beast::error::timeout;
      if (ec) {
        // A certificate that does not verify will not verify on a retry either.
        const bool refused = ec.category() == asio::error::get_ssl_category() &&
                             SSL_get_verify_result(c->tls->native_handle()) != X509_V_OK;
        throw TransportError{"TLS handshake with " + host + ": " + ec.message() +
                                 (refused ? " (the server's certificate is not trusted: AWS_CA_BUNDLE names the CAs to trust)" : ""),
                             true, refused};
      }
    }
    return c;
  }

  Endpoint endpoint_;
  S3Options options_;
  std::optional<ssl::context> tls_context_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Connection>> idle_;
};

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

S3ErrorInfo error_info(const Response& r) {
  S3ErrorInfo info;
  info.request_id = r.header("x-amz-request-id");
  if (auto xml = Xml::parse(r.body)) {
    if (auto error = xml->tree.get_child_optional("Error")) {
      info.code = error->get("Code", "");
      info.message = error->get("Message", "");
      if (info.request_id.empty()) info.request_id = error->get("RequestId", "");
    }
  }
  if (info.code.empty()) {
    switch (r.status) {
      case 403: info.code = "AccessDenied"; break;
      case 404: info.code = "NotFound"; break;
      case 412: info.code = "PreconditionFailed"; break;
      default: break;
    }
  }
  return info;
}

bool retryable(int status, const std::string& code) {
  return status >= 500 || status == 429 || code == "SlowDown" || code == "RequestTimeout" ||
         code == "InternalError" || code == "ConditionalRequestConflict";
}

Kind kind_of(int status, const std::string& code) {
  if (code == "QuotaExceeded" || code == "EntityTooLarge" || code == "InsufficientCapacity") {
    return Kind::kNoSpace;
  }
  if (status == 404) return Kind::kNotFound;
  if (status == 403 || status == 401) return Kind::kAccessDenied;
  if (status == 412) return Kind::kPreconditionFailed;
  if (status == 400 || status == 416 || status == 411) return Kind::kInvalidArgument;
  if (status >= 500 || status == 429) return Kind::kUnavailable;
  return Kind::kOther;
}

std::chrono::milliseconds backoff(const S3Options& o, int attempt) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const double cap = std::min<double>(static_cast<double>(o.backoff_cap.count()),
                                      static_cast<double>(o.backoff_base.count()) *
                                          static_cast<double>(1ull << std::min(attempt, 20)));
  return std::chrono::milliseconds(
      static_cast<int64_t>(std::uniform_real_distribution<double>(0, cap)(rng)));
}

class S3Store;

class S3Upload final : public MultipartUpload {
 public:
  S3Upload(S3Store& store, std::string key, std::string upload_id)
      : store_(store), key_(std::move(key)), upload_id_(std::move(upload_id)) {}
  ~S3Upload() override {
    try {
      abort();
    } catch (...) {
    }
  }
  void put_part(int number, std::span<const std::byte> data) override;
  ObjectInfo complete() override;
  void abort() override;

 private:
  S3Store& store_;
  std::string key_;
  std::string upload_id_;
  std::mutex mu_;
  std::map<int, std::pair<std::string, uint64_t>> parts_;  // number -> (etag, bytes)
  bool finished_ = false;
};

class S3Store final : public ObjectStore {
 public:
  S3Store(std::string bucket, std::string prefix, S3Options options)
      : bucket_(std::move(bucket)), prefix_(std::move(prefix)), options_(std::move(options)),
        endpoint_(parse_endpoint(options_.endpoint)), pool_(endpoint_, options_) {
    if (options_.unsigned_payload && !endpoint_.tls) {
      throw ObjectStoreError(Kind::kInvalidArgument,
                             "S3: unsigned payloads need https; " + options_.endpoint + " is http");
    }
    if (options_.max_attempts < 1) options_.max_attempts = 1;
    const bool amazon = endpoint_.host.ends_with(".amazonaws.com");
    virtual_hosted_ = options_.addressing == S3Options::Addressing::kVirtual ||
                      (options_.addressing == S3Options::Addressing::kAuto && amazon &&
                       bucket_.find('.') == std::string::npos);
  }

  std::string url() const override {
    return "s3://" + bucket_ + (prefix_.empty() ? "" : "/" + prefix_);
  }
  uint64_t min_part_bytes() const override { return 5ull << 20; }

  void put(const std::string& key, std::span<const std::byte> data) override {
    check_object_key(key);
    expect(send("PutObject", key, "PUT", object_path(key), {}, {}, data), {200}, "PutObject", key);
  }

  bool put_if_absent(const std::string& key, std::span<const std::byte> data) override {
    check_object_key(key);
    const Response r =
        send("PutObject", key, "PUT", object_path(key), {}, {{"If-None-Match", "*"}}, data);
    if (r.status == 200) return true;
    if (r.status != 412) expect(r, {200}, "PutObject (create-only)", key);
    if (!r.repeated) return false;
    // A retried create-only write: the earlier attempt may have been the one that created it.
    const auto info = head(key);
    if (!info || info->size != data.size()) return false;
    std::vector<std::byte> now(data.size());
    get(key, 0, now);
    return std::equal(now.begin(), now.end(), data.begin(), data.end());
  }

  std::optional<ObjectInfo> head(const std::string& key) override {
    check_object_key(key);
    const Response r = send("HeadObject", key, "HEAD", object_path(key), {}, {}, {});
    if (r.status == 404) return std::nullopt;
    expect(r, {200}, "HeadObject", key);
    return ObjectInfo{key, std::stoull(r.header("content-length").empty() ? "0" : r.header("content-length")),
                      unquote(r.header("etag"))};
  }

  void get(const std::string& key, uint64_t offset, std::span<std::byte> out) override {
    check_object_key(key);
    if (out.empty()) {
      const auto info = head(key);
      if (!info) fail_not_found("GetObject", key);
      if (offset > info->size) past_end(key, offset, 0, std::to_string(info->size));
      return;
    }
    const std::string range =
        "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + out.size() - 1);
    const Response r = send("GetObject", key, "GET", object_path(key), {}, {{"Range", range}}, {}, false, out);
    if (r.status == 416) past_end(key, offset, out.size(), total_of(r.header("content-range")));
    expect(r, {200, 206}, "GetObject", key);
    if (r.body_in_destination) {
      // A whole object (200) is only right when the range was all of it from the start.
      if (r.status == 200 && offset != 0) past_end(key, offset, out.size(), total_of(r.header("content-range")));
      return;
    }
    if (r.body.size() != out.size() || (r.status == 200 && offset != 0)) {
      past_end(key, offset, out.size(), total_of(r.header("content-range")));
    }
    std::memcpy(out.data(), r.body.data(), out.size());
  }

  std::vector<ObjectInfo> list(const std::string& prefix) override {
    std::vector<ObjectInfo> out;
    const std::string full = full_key_prefix() + prefix;
    std::string token;
    for (;;) {
      Query query{{"list-type", "2"}, {"prefix", full},
                  {"max-keys", std::to_string(std::max(1, options_.list_page_keys))}};
      if (!token.empty()) query.emplace_back("continuation-token", token);
      const Response r = send("ListObjectsV2", prefix, "GET", bucket_path(), query, {}, {});
      expect(r, {200}, "ListObjectsV2", prefix);
      const auto xml = Xml::parse(r.body);
      const auto result = xml ? xml->tree.get_child_optional("ListBucketResult") : boost::none;
      if (!result) bad_answer("ListObjectsV2", prefix, r);
      for (const auto& [name, child] : *result) {
        if (name != "Contents") continue;
        const std::string key = child.get("Key", "");
        if (!key.starts_with(full_key_prefix())) continue;
        out.push_back(ObjectInfo{key.substr(full_key_prefix().size()), child.get<uint64_t>("Size", 0),
                                 unquote(child.get("ETag", ""))});
      }
      if (result->get("IsTruncated", "false") != "true") break;
      token = result->get("NextContinuationToken", "");
      if (token.empty()) bad_answer("ListObjectsV2 (truncated without a continuation token)", prefix, r);
    }
    std::sort(out.begin(), out.end(),
              [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  void remove(const std::string& key) override {
    check_object_key(key);
    const Response r = send("DeleteObject", key, "DELETE", object_path(key), {}, {}, {});
    if (r.status == 404) return;
    expect(r, {200, 204}, "DeleteObject", key);
  }

  std::unique_ptr<MultipartUpload> start_multipart(const std::string& key) override {
    check_object_key(key);
    const Response r =
        send("CreateMultipartUpload", key, "POST", object_path(key), {{"uploads", ""}}, {}, {});
    expect(r, {200}, "CreateMultipartUpload", key);
    const auto xml = Xml::parse(r.body);
    const std::string id = xml ? xml->tree.get("InitiateMultipartUploadResult.UploadId", "") : "";
    if (id.empty()) bad_answer("CreateMultipartUpload (no UploadId)", key, r);
    return std::make_unique<S3Upload>(*this, key, id);
  }

  std::vector<PendingUpload> list_multipart_uploads(const std::string& prefix) override {
    std::vector<PendingUpload> out;
    const std::string full = full_key_prefix() + prefix;
    std::string key_marker, id_marker;
    for (;;) {
      Query query{{"uploads", ""}, {"prefix", full}};
      if (!key_marker.empty()) query.emplace_back("key-marker", key_marker);
      if (!id_marker.empty()) query.emplace_back("upload-id-marker", id_marker);
      const Response r = send("ListMultipartUploads", prefix, "GET", bucket_path(), query, {}, {});
      expect(r, {200}, "ListMultipartUploads", prefix);
      const auto xml = Xml::parse(r.body);
      const auto result = xml ? xml->tree.get_child_optional("ListMultipartUploadsResult") : boost::none;
      if (!result) bad_answer("ListMultipartUploads", prefix, r);
      for (const auto& [name, child] : *result) {
        if (name != "Upload") continue;
        const std::string key = child.get("Key", "");
        if (!key.starts_with(full_key_prefix())) continue;
        out.push_back({key.substr(full_key_prefix().size()), child.get("UploadId", "")});
      }
      if (result->get("IsTruncated", "false") != "true") break;
      key_marker = result->get("NextKeyMarker", "");
      id_marker = result->get("NextUploadIdMarker", "");
      if (key_marker.empty()) bad_answer("ListMultipartUploads (truncated without a next marker)", prefix, r);
    }
    std::sort(out.begin(), out.end(), [](const PendingUpload& a, const PendingUpload& b) {
      return a.key != b.key ? a.key < b.key : a.upload_id < b.upload_id;
    });
    return out;
  }

  void abort_multipart_upload(const PendingUpload& upload) override {
    check_object_key(upload.key);
    const Response r = send("AbortMultipartUpload", upload.key, "DELETE", object_path(upload.key),
                            {{"uploadId", upload.upload_id}}, {}, {});
    if (r.status == 404) return;  // NoSuchUpload: already gone
    expect(r, {200, 204}, "AbortMultipartUpload", upload.key);
  }

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
                std::span<const std::byte> body, bool error_in_body = false, std::span<std::byte> into = {}) {
    const std::string host = virtual_hosted_ ? bucket_ + "." + host_header() : host_header();
    std::string target = s3_uri_encode(path, true);
    for (size_t i = 0; i < query.size(); ++i) {
      target += (i ? "&" : "?") + s3_uri_encode(query[i].first, false) + "=" +
                s3_uri_encode(query[i].second, false);
    }
    const std::string payload_hash = options_.unsigned_payload
                                         ? "UNSIGNED-PAYLOAD"
                                         : sha256_hex(body.data(), body.size());
    std::string last_error;
    int last_status = 0;
    S3ErrorInfo last_info;
    bool resent_stale = false;
    int sends = 0;
    for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(backoff(options_, attempt - 1));
      S3Request request{method, host, path, query, headers, payload_hash};
      s3_sign(request, options_.credentials, options_.region, s3_amz_date_now());
      bool reused = false;
      try {
        ++sends;
        Response r = pool_.exchange(method, host, target, request.headers, body, &reused, into);
        r.repeated = sends > 1;
        S3ErrorInfo info;
        const bool body_error = error_in_body && r.status == 200 &&
                                r.body.find("<Error>") != std::string::npos;
        if (r.status >= 300 || body_error) info = error_info(r);
        if (!retryable(body_error ? 500 : r.status, info.code)) return r;
        last_error = describe_status(r, info);
        last_status = r.status;
        last_info = info;
      } catch (const TransportError& e) {
        if (e.permanent) {
          throw ObjectStoreError(Kind::kAccessDenied, std::string(op) + " " + url_of(key) + ": " + e.message);
        }
        // A keep-alive connection the server had closed before this request reached it: resend
        // once on a new connection, not counted as an attempt (and drop the other idle ones).
        if (reused && e.before_response && !resent_stale) {
          resent_stale = true;
          pool_.drop_idle();
          --sends;
          --attempt;
          continue;
        }
        last_error = e.message;
        last_status = 0;
        last_info = {};
      }
    }
    throw ObjectStoreError(Kind::kUnavailable,
                           std::string(op) + " " + url_of(key) + ": failed after " +
                               std::to_string(options_.max_attempts) + " attempts; last: " + last_error,
                           last_status, last_info.code, last_info.request_id);
  }

  [[noreturn]] void fail_status(const Response& r, const char* op, const std::string& key) const {
    const S3ErrorInfo info = error_info(r);
    throw ObjectStoreError(kind_of(r.status, info.code),
                           std::string(op) + " " + url_of(key) + ": " + describe_status(r, info),
                           r.status, info.code, info.request_id);
  }

  void expect(const Response& r, std::initializer_list<int> ok, const char* op,
              const std::string& key) const {
    if (std::find(ok.begin(), ok.end(), r.status) == ok.end()) fail_status(r, op, key);
  }

  [[noreturn]] void bad_answer(const char* op, const std::string& key, const Response& r) const {
    throw ObjectStoreError(Kind::kOther, std::string(op) + " " + url_of(key) +
                                             ": unexpected answer (HTTP " + std::to_string(r.status) +
                                             "): " + r.body.substr(0, 300),
                           r.status, "", r.header("x-amz-request-id"));
  }

  static std::string unquote(std::string s) {
    if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
    return s;
  }

 private:
  static std::string describe_status(const Response& r, const S3ErrorInfo& info) {
    std::string text = "HTTP " + std::to_string(r.status);
    if (!info.code.empty()) text += " " + info.code;
    if (!info.message.empty()) text += " (" + info.message + ")";
    if (!info.request_id.empty()) text += ", request id " + info.request_id;
    return text;
  }

  [[noreturn]] void fail_not_found(const char* op, const std::string& key) const {
    throw ObjectStoreError(Kind::kNotFound, std::string(op) + " " + url_of(key) + ": no such key",
                           404, "NoSuchKey");
  }

  [[noreturn]] void past_end(const std::string& key, uint64_t offset, uint64_t size,
                             const std::string& total) const {
    throw ObjectStoreError(Kind::kInvalidArgument,
                           "GetObject " + url_of(key) + ": bytes [" + std::to_string(offset) + ", " +
                               std::to_string(offset + size) + ") are past the end of a " +
                               (total.empty() ? std::string("shorter") : total + "-byte") + " object");
  }

  static std::string total_of(const std::string& content_range) {
    const size_t slash = content_range.rfind('/');
    return slash == std::string::npos ? "" : content_range.substr(slash + 1);
  }

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

void S3Upload::put_part(int number, std::span<const std::byte> data) {
  if (number < 1 || number > 10000) {
    throw ObjectStoreError(Kind::kInvalidArgument, "UploadPart " + store_.url_of(key_) +
                                                       ": part number " + std::to_string(number) +
                                                       " is outside 1..10000");
  }
  const Response r = store_.send(
      "UploadPart", key_, "PUT", store_.object_path(key_),
      {{"partNumber", std::to_string(number)}, {"uploadId", upload_id_}}, {}, data);
  store_.expect(r, {200}, "UploadPart", key_);
  const std::string etag = r.header("etag");
  if (etag.empty()) store_.bad_answer("UploadPart (no ETag)", key_, r);
  std::lock_guard lock(mu_);
  parts_[number] = {etag, data.size()};
}

ObjectInfo S3Upload::complete() {
  std::lock_guard lock(mu_);
  if (finished_) {
    throw ObjectStoreError(Kind::kInvalidArgument, "CompleteMultipartUpload " + store_.url_of(key_) +
                                                       ": the upload was already finished");
  }
  if (parts_.empty() || parts_.rbegin()->first != int(parts_.size())) {
    throw ObjectStoreError(Kind::kInvalidArgument,
                           "CompleteMultipartUpload " + store_.url_of(key_) + ": parts 1.." +
                               std::to_string(parts_.empty() ? 0 : parts_.rbegin()->first) +
                               " are not all there (" + std::to_string(parts_.size()) + " uploaded)");
  }
  std::string xml = "<CompleteMultipartUpload>";
  uint64_t total = 0;
  for (const auto& [number, part] : parts_) {
    xml += "<Part><PartNumber>" + std::to_string(number) + "</PartNumber><ETag>" + part.first +
           "</ETag></Part>";
    total += part.second;
  }
  xml += "</CompleteMultipartUpload>";
  const Response r = store_.send("CompleteMultipartUpload", key_, "POST", store_.object_path(key_),
                                 {{"uploadId", upload_id_}}, {{"Content-Type", "application/xml"}},
                                 std::as_bytes(std::span(xml)), /*error_in_body=*/true);
  if (r.status == 404 && r.repeated && error_info(r).code == "NoSuchUpload") {
    // The answer to an earlier attempt was lost; the upload completed then if the object is there.
    if (auto info = store_.head(key_); info && info->size == total) {
      finished_ = true;
      return *info;
    }
  }
  store_.expect(r, {200}, "CompleteMultipartUpload", key_);
  if (r.body.find("<Error>") != std::string::npos) store_.fail_status(r, "CompleteMultipartUpload", key_);
  finished_ = true;
  std::string etag;
  if (auto parsed = Xml::parse(r.body)) etag = parsed->tree.get("CompleteMultipartUploadResult.ETag", "");
  if (etag.empty()) {
    // RGW 16.2 answers Complete with an empty <ETag>; HEAD has it.
    if (auto info = store_.head(key_)) return *info;
    store_.bad_answer("CompleteMultipartUpload (the object is not there afterwards)", key_, r);
  }
  return ObjectInfo{key_, total, S3Store::unquote(etag)};
}

void S3Upload::abort() {
  std::lock_guard lock(mu_);
  if (finished_) return;
  finished_ = true;
  const Response r = store_.send("AbortMultipartUpload", key_, "DELETE", store_.object_path(key_),
                                 {{"uploadId", upload_id_}}, {}, {});
  if (r.status == 404) return;
  store_.expect(r, {200, 204}, "AbortMultipartUpload", key_);
}

}  // namespace

std::unique_ptr<ObjectStore> open_s3_store(const std::string& bucket, const std::string& prefix,
                                           const S3Options& options) {
  if (bucket.empty()) throw ObjectStoreError(Kind::kInvalidArgument, "S3: empty bucket name");
  if (!prefix.empty()) check_object_key(prefix);
  return std::make_unique<S3Store>(bucket, prefix, options);
}

void s3_create_bucket(const std::string& bucket, const S3Options& options) {
  S3Options path_style = options;
  path_style.addressing = S3Options::Addressing::kPath;
  S3Store store(bucket, "", path_style);
  const Response r = store.send("CreateBucket", "", "PUT", "/" + bucket, {}, {}, {});
  if (r.status == 200) return;
  if (r.status == 409 && error_info(r).code == "BucketAlreadyOwnedByYou") return;
  store.fail_status(r, "CreateBucket", "");
}

}  // namespace strata::offload
