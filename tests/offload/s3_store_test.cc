// The S3 driver against a real S3 server (Ceph's RADOS Gateway, scripts/s3-server.sh): the
// conformance suite, errors, retries through a fault-injecting proxy of our own, and the request
// signatures against botocore's signer.
//
// The server: tests/common/s3_server.h.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "object_store_conformance.h"
#include "s3_server.h"
#include "strata/offload/s3.h"
#include "test_util.h"

namespace strata::offload {
namespace {

using strata::test::random_bytes;
using test::ObjectStoreConformance;
using Kind = ObjectStoreError::Kind;
const char* kBucket = strata::test::kS3Bucket;

const S3Options& server() { return strata::test::s3_server(); }

std::string unique(const std::string& tag) {
  static std::atomic<int> n{0};
  return tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

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

// --- a fault-injecting proxy between the driver and the server --------------------------------

enum class Fault {
  kForward,          // pass the request on and its answer back
  kSlowDown,         // answer 503 SlowDown without passing it on
  kDropMidRequest,   // close after half the request's body arrived
  kHang,             // take the request and never answer
  kLoseAnswer,       // pass the request on, then close instead of passing the answer back
  kTruncateAnswer,   // pass the request on, then pass back the answer's first half and close
};

// One request per connection (the driver runs with reuse_connections = false). Plain blocking
// sockets, a thread per connection.
class FaultProxy {
 public:
  FaultProxy(int upstream_port, std::function<Fault(int)> plan)
      : upstream_port_(upstream_port), plan_(std::move(plan)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listener_, 64) != 0) {
      throw std::runtime_error("proxy: bind/listen failed");
    }
    socklen_t len = sizeof addr;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~FaultProxy() {
    stopping_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    ::close(listener_);
    acceptor_.join();
    std::vector<std::thread> workers;
    {
      std::lock_guard lock(mu_);  // not held while joining: a worker takes it on its way out
      for (int fd : hanging_) ::shutdown(fd, SHUT_RDWR);
      workers.swap(workers_);
    }
    for (auto& t : workers) t.join();
  }
  int port() const { return port_; }
  int connections() const { return count_.load(); }

 private:
  void accept_loop() {
    for (;;) {
      const int fd = ::accept(listener_, nullptr, nullptr);
      if (fd < 0) return;
      if (stopping_) {
        ::close(fd);
        return;
      }
      const int index = count_++;
      std::lock_guard lock(mu_);
      workers_.emplace_back([this, fd, index] { serve(fd, plan_(index)); });
    }
  }

  static bool read_request(int fd, std::string& request, bool half_body_only) {
    char buf[65536];
    size_t header_end = std::string::npos;
    size_t total = SIZE_MAX;
    while (request.size() < total) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return false;
      request.append(buf, static_cast<size_t>(n));
      if (header_end == std::string::npos && (header_end = request.find("\r\n\r\n")) != std::string::npos) {
        size_t length = 0;
        std::string lower = request.substr(0, header_end);
        for (auto& c : lower) c = static_cast<char>(std::tolower(c));
        if (const size_t at = lower.find("content-length:"); at != std::string::npos) {
          length = std::stoull(lower.substr(at + 15));
        }
        total = header_end + 4 + (half_body_only ? length / 2 : length);
      }
    }
    return true;
  }

  static void send_all(int fd, const std::string& data) {
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return;
      done += static_cast<size_t>(n);
    }
  }

  void serve(int fd, Fault fault) {
    std::string request;
    if (!read_request(fd, request, fault == Fault::kDropMidRequest) || fault == Fault::kDropMidRequest) {
      ::close(fd);
      return;
    }
    switch (fault) {
      case Fault::kSlowDown: {
        const std::string body =
            "<?xml version=\"1.0\"?><Error><Code>SlowDown</Code><Message>Please reduce your "
            "request rate.</Message><RequestId>proxy-1</RequestId></Error>";
        send_all(fd, "HTTP/1.1 503 Slow Down\r\nContent-Length: " + std::to_string(body.size()) +
                         "\r\nConnection: close\r\n\r\n" + body);
        break;
      }
      case Fault::kHang: {
        {
          std::lock_guard lock(mu_);
          hanging_.push_back(fd);
        }
        char c;
        while (::recv(fd, &c, 1, 0) > 0) {
        }  // until the client gives up (or the proxy stops)
        break;
      }
      case Fault::kForward:
      case Fault::kLoseAnswer:
      case Fault::kTruncateAnswer: {
        const int up = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        addr.sin_port = htons(static_cast<uint16_t>(upstream_port_));
        if (::connect(up, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
          send_all(up, request);
          std::string answer;
          char buf[65536];
          ssize_t n;
          while ((n = ::recv(up, buf, sizeof buf, 0)) > 0) answer.append(buf, static_cast<size_t>(n));
          if (fault == Fault::kForward) send_all(fd, answer);
          if (fault == Fault::kTruncateAnswer) send_all(fd, answer.substr(0, answer.size() / 2));
        }
        ::close(up);
        break;
      }
      case Fault::kDropMidRequest: break;
    }
    {
      std::lock_guard lock(mu_);
      hanging_.erase(std::remove(hanging_.begin(), hanging_.end(), fd), hanging_.end());
    }
    ::close(fd);
  }

  int upstream_port_;
  std::function<Fault(int)> plan_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> count_{0};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> workers_;
  std::vector<int> hanging_;
};

int server_port() {
  const std::string& e = server().endpoint;
  return std::stoi(e.substr(e.rfind(':') + 1));
}

S3Options through(const FaultProxy& proxy) {
  S3Options o = server();
  o.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
  o.reuse_connections = false;
  o.request_timeout = std::chrono::milliseconds(1500);
  o.backoff_base = std::chrono::milliseconds(5);
  o.backoff_cap = std::chrono::milliseconds(50);
  o.max_attempts = 5;
  return o;
}

TEST(S3Faults, SlowDownBurstsDroppedConnectionsAndHangsAreRetried) {
  // Connection i gets fault i of this list, then everything is forwarded.
  const std::vector<Fault> faults = {Fault::kSlowDown, Fault::kSlowDown, Fault::kDropMidRequest,
                                     Fault::kHang, Fault::kForward, Fault::kSlowDown};
  FaultProxy proxy(server_port(), [&](int i) { return i < int(faults.size()) ? faults[i] : Fault::kForward; });
  auto store = open_s3_store(kBucket, unique("faults"), through(proxy));
  const auto data = random_bytes(3 << 20, 5);
  store->put("object", data);  // attempts 1-4 fail (503, 503, dropped, timeout), the 5th succeeds
  EXPECT_EQ(proxy.connections(), 5);
  store->put("second", data);  // 503, then forwarded
  EXPECT_EQ(proxy.connections(), 7);
  EXPECT_EQ(open_s3_store(kBucket, "", server())->list(store->url().substr(5 + strlen(kBucket) + 1) + "/").size(), 2u);
  EXPECT_EQ(store->get_all("object"), data);
}

// A body that stops short (the connection closed halfway through a ranged read's answer) is
// retried, and when every answer stops short the read fails: a partial body is never a success.
TEST(S3Faults, AnAnswerCutShortIsRetriedAndNeverTakenForTheWholeBody) {
  const std::string prefix = unique("truncated");
  const auto data = random_bytes(6 << 20, 9);
  open_s3_store(kBucket, prefix, server())->put("object", data);
  FaultProxy proxy(server_port(), [](int i) { return i == 0 ? Fault::kTruncateAnswer : Fault::kForward; });
  auto store = open_s3_store(kBucket, prefix, through(proxy));
  std::vector<std::byte> out(4 << 20);
  store->get("object", 1 << 20, out);
  EXPECT_EQ(proxy.connections(), 2);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), data.begin() + (1 << 20)));

  FaultProxy always(server_port(), [](int) { return Fault::kTruncateAnswer; });
  auto cut = open_s3_store(kBucket, prefix, through(always));
  std::vector<std::byte> never(4 << 20);
  try {
    cut->get("object", 0, never);
    ADD_FAILURE() << "a body cut short was taken for the whole";
  } catch (const ObjectStoreError& e) {
    EXPECT_EQ(e.kind(), ObjectStoreError::Kind::kUnavailable) << e.what();
  }
  EXPECT_EQ(always.connections(), through(always).max_attempts);
}

TEST(S3Faults, AMultipartUploadSurvivesAPartDroppedMidwayAndAHungPart) {
  // One part at a time: connection 0 creates the upload, 1 is part 1 (dropped halfway), 2 its
  // retry, 3 is part 2 (never answered: the request times out), 4 its retry, then part 3.
  FaultProxy proxy(server_port(), [&](int i) {
    if (i == 1) return Fault::kDropMidRequest;
    if (i == 3) return Fault::kHang;
    return Fault::kForward;
  });
  auto store = open_s3_store(kBucket, unique("mpu-faults"), through(proxy));
  TransferOptions transfer{5 << 20, 1};
  const auto data = random_bytes((5 << 20) * 2 + 12345, 9);
  put_object(*store, "object", data, transfer);
  EXPECT_EQ(store->get_all("object"), data);
}

TEST(S3Faults, EveryAttemptFailingIsAnErrorNamingTheOperationAndTheLastCause) {
  FaultProxy proxy(server_port(), [](int) { return Fault::kSlowDown; });
  S3Options o = through(proxy);
  o.max_attempts = 3;
  auto store = open_s3_store(kBucket, "p", o);
  try {
    store->put("k", std::as_bytes(std::span("x", 1)));
    FAIL();
  } catch (const ObjectStoreError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.kind(), Kind::kUnavailable);
    EXPECT_NE(what.find("PutObject s3://strata-test/p/k: failed after 3 attempts"), std::string::npos) << what;
    EXPECT_NE(what.find("HTTP 503 SlowDown"), std::string::npos) << what;
  }
  EXPECT_EQ(proxy.connections(), 3);
}

TEST(S3Faults, ACreateOnlyWriteWhoseAnswerWasLostStillKnowsItWon) {
  // The first attempt reaches the server and creates the object, but its answer is lost; the
  // retry gets 412. The driver reads the object back: its own bytes, so the write succeeded.
  FaultProxy proxy(server_port(), [](int i) { return i == 0 ? Fault::kLoseAnswer : Fault::kForward; });
  auto store = open_s3_store(kBucket, unique("lost-answer"), through(proxy));
  EXPECT_TRUE(store->put_if_absent("manifest", std::as_bytes(std::span("ours", 4))));
  EXPECT_FALSE(store->put_if_absent("manifest", std::as_bytes(std::span("late", 4))));

  FaultProxy proxy2(server_port(), [](int i) { return i == 0 ? Fault::kLoseAnswer : Fault::kForward; });
  auto direct = open_s3_store(kBucket, unique("lost-answer-other"), server());
  direct->put("manifest", std::as_bytes(std::span("theirs", 6)));
  auto store2 = open_s3_store(kBucket, direct->url().substr(5 + strlen(kBucket) + 1), through(proxy2));
  EXPECT_FALSE(store2->put_if_absent("manifest", std::as_bytes(std::span("ours!!", 6))));
}

// --- the signer against botocore's ------------------------------------------------------------

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
