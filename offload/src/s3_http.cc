// The S3 driver's HTTP layer: endpoints, connections (plain or TLS) and the keep-alive pool
// that sends one request and reads its answer, with a deadline per operation. The protocol on
// top of it is in s3_store.cc.
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include <algorithm>
#include <limits>
#include <optional>

#include "s3_internal.h"

namespace strata::offload::s3_detail {

namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

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

namespace {

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

}  // namespace

HttpPool::HttpPool(Endpoint endpoint, const S3Options& options)
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

HttpPool::~HttpPool() = default;  // here, where Connection is complete

void HttpPool::drop_idle() {
  std::lock_guard lock(mu_);
  idle_.clear();
}

Response HttpPool::exchange(const std::string& method, const std::string& host, const std::string& target,
                            const Headers& headers, std::span<const std::byte> body, bool* reused,
                            std::span<std::byte> into) {
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

std::unique_ptr<Connection> HttpPool::take(bool* reused) {
  std::lock_guard lock(mu_);
  *reused = !idle_.empty();
  if (idle_.empty()) return nullptr;
  auto c = std::move(idle_.back());
  idle_.pop_back();
  return c;
}

void HttpPool::give_back(std::unique_ptr<Connection> c) {
  std::lock_guard lock(mu_);
  if (idle_.size() < 64) idle_.push_back(std::move(c));
}

std::unique_ptr<Connection> HttpPool::connect(const std::string& host_header) {
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

}  // namespace strata::offload::s3_detail
