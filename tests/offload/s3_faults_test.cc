// The S3 driver's retries against a real S3 server through a fault-injecting proxy of our own:
// SlowDown bursts, dropped connections, hung requests, answers lost or cut short, a multipart
// upload's failed parts, and the error once every attempt failed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "s3_fixture.h"
#include "s3_server.h"
#include "strata/offload/s3.h"
#include "test_util.h"

namespace strata::offload {
namespace {

using namespace s3_testing;
using strata::test::random_bytes;
using Kind = ObjectStoreError::Kind;

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

}  // namespace
}  // namespace strata::offload
