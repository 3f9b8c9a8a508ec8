#include "strata/engine/comm.h"

#include "comm_nodes.h"
#include "comm_peers.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef STRATA_HAVE_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace strata::engine {
namespace {


class LocalComm final : public Communicator {
 public:
  LocalComm() : Communicator(0, 1) {}
  struct Done : Work {
    void wait() override {}
  };
  std::unique_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in) override {
    TORCH_CHECK(out.numel() == in.numel(), "all_gather: out must hold world_size * in");
    if (in.data_ptr() != out.data_ptr()) out.copy_(in.view_as(out));  // in place: nothing to do
    return std::make_unique<Done>();
  }
  std::unique_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in) override {
    TORCH_CHECK(out.numel() == in.numel(), "reduce_scatter: in must hold world_size * out");
    if (in.data_ptr() != out.data_ptr()) out.copy_(in.view_as(out));  // in place: nothing to do
    return std::make_unique<Done>();
  }
  std::unique_ptr<Work> all_to_all(const at::Tensor& out, const std::vector<int64_t>& out_counts, const at::Tensor& in,
                                   const std::vector<int64_t>& in_counts) override {
    TORCH_CHECK(out_counts.size() == 1 && in_counts.size() == 1 && out_counts[0] == in_counts[0] &&
                    out.numel() == out_counts[0] && in.numel() == in_counts[0],
                "all_to_all: a world of one sends itself what it receives");
    if (in.numel() > 0 && in.data_ptr() != out.data_ptr()) out.copy_(in);
    return std::make_unique<Done>();
  }
  void all_reduce(const at::Tensor&, ReduceOp) override {}
  void broadcast(const at::Tensor&, int) override {}
  void barrier() override {}
};

// One thread running posted tasks in the order posted; each post's future holds its task's
// exception. The destructor runs what is queued, then joins.
class TaskThread {
 public:
  TaskThread() : thread_([this] { run(); }) {}
  ~TaskThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  std::shared_future<void> post(std::function<void()> task) {
    auto done = std::make_shared<std::promise<void>>();
    std::shared_future<void> future = done->get_future().share();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back([done, task = std::move(task)] {
        try {
          task();
          done->set_value();
        } catch (...) {
          done->set_exception(std::current_exception());
        }
      });
    }
    cv_.notify_one();
    return future;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest exists
};

// A collective running on a TaskThread: wait() blocks until it ends and rethrows its CommError.
struct Posted final : Communicator::Work {
  explicit Posted(std::shared_future<void> done) : done(std::move(done)) {}
  void wait() override { done.get(); }
  std::shared_future<void> done;
};

// Gloo for CPU tensors and, when asked for, NCCL for CUDA tensors (its unique id travels through
// the store), each under its own key prefix in the one TCPStore.
class GlooComm final : public Communicator {
 public:
  GlooComm(const DistEnv& env, std::chrono::milliseconds timeout, bool with_cuda)
      : Communicator(env.rank, env.world_size) {
    try {
      c10d::TCPStoreOptions opts;
      opts.port = uint16_t(env.master_port);
      opts.isServer = env.rank == 0;
      opts.numWorkers = env.world_size;
      opts.waitWorkers = true;
      opts.timeout = timeout;
      store_ = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
      // Single node (loopback master): loopback. Otherwise this host's own address, as
      // torch.distributed does (GLOO_SOCKET_IFNAME picks the interface).
      const bool loopback = env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0;
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (env.rank == 0) {  // rank 0's choice of reduction holds for every rank (read below)
        const char* flat = std::getenv("STRATA_FLAT_REDUCE");
        store_->set("strata/flat_reduce", std::vector<uint8_t>{uint8_t(flat && std::string(flat) == "1" ? '1' : '0')});
      }
      {
        // "host addr pid node"; the host name has no spaces, the address may be empty.
        const std::string addr = loopback ? "127.0.0.1" : ifname ? interface_address(ifname) : "";
        const std::string me =
            this_host() + " " + addr + " " + std::to_string(long(getpid())) + " " + std::to_string(env.node);
        peers_ = exchange_peers(*store_, env, me);
      }
      auto pg_opts = c10d::ProcessGroupGloo::Options::create(timeout);
      pg_opts->devices.push_back(
          loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
          : ifname
              ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
              : c10d::ProcessGroupGloo::createDefaultDevice());
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("gloo", store_), env.rank, env.world_size, pg_opts);
      // Across nodes the CPU reduce-scatter goes inside each node first (comm_nodes.h), through a
      // group of the node's ranks and one of the ranks of this one's place on every node.
      // Rank 0's STRATA_FLAT_REDUCE decides for all: ranks that chose otherwise would wait for each
      // other's sub-groups, or sum differently.
      nodes_ = node_layout(node_keys(*peers_), env.rank);
      const bool flat = store_->get("strata/flat_reduce") == std::vector<uint8_t>{uint8_t('1')};
      if (nodes_.two_steps() && !flat) {
        node_thread_ = std::make_unique<TaskThread>();
        node_pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
            c10::make_intrusive<c10d::PrefixStore>("gloo-node-" + std::to_string(nodes_.node), store_), nodes_.local,
            nodes_.per_node, pg_opts);
        place_pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
            c10::make_intrusive<c10d::PrefixStore>("gloo-place-" + std::to_string(nodes_.local), store_), nodes_.node,
            nodes_.nodes, pg_opts);
      } else {
        nodes_ = {};
      }
      if (with_cuda) {
#ifdef STRATA_HAVE_CUDA
        auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
        nccl_opts->timeout = timeout;
        nccl_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(
            c10::make_intrusive<c10d::PrefixStore>("nccl", store_), env.rank, env.world_size,
            nccl_opts);
#else
        throw std::runtime_error("this build of Strata has no CUDA (NCCL) support");
#endif
      }
    } catch (const std::exception& e) {
      throw CommError("rendezvous of rank " + std::to_string(env.rank) + " of " +
                      std::to_string(env.world_size) + " at " + env.master_addr + ":" +
                      std::to_string(env.master_port) + " failed: " + first_line(e.what()));
    }
  }

  struct GlooWork : Work {
    GlooWork(c10::intrusive_ptr<c10d::Work> w, std::string what, std::shared_ptr<const FailureHandler> on_failure,
             std::shared_ptr<const std::vector<Peer>> peers, int self, bool on_gloo)
        : w(std::move(w)), what(std::move(what)), on_failure(std::move(on_failure)), peers(std::move(peers)),
          self(self), on_gloo(on_gloo) {}
    void wait() override {
      try {
        w->wait();
      } catch (const std::exception& e) {
        const std::string error = first_line(e.what());
        // Gloo words a timeout in several ways ("Timed out ...", "Application timeout caused
        // pair closure"): whenever no dead local peer and no lost connection explain the error,
        // the other hosts are probed.
        std::string why;
        if (peers) {
          why = gone_peers(*peers, self) + lost_host(*peers, self, error);
          if (why.empty()) why = silent_hosts(*peers, self);
        }
        fail(what + " failed: " + error + " (a peer rank died or timed out" + why + ")", on_failure);
      }
      if (on_gloo) release_by_backend();
      if (then) std::exchange(then, {})();
    }
    // Gloo's worker thread marks a work complete before it drops its own references to it, and
    // through it to the work's tensors. A device buffer the caller frees after wait() would stay
    // counted against the device budget until that thread runs again (on a loaded machine, a
    // whole time slice later, while training goes on): wait for the backend to let go first.
    // (NCCL's wait only orders streams; its watchdog keeps its own copy of the work.)
    void release_by_backend() {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      while (w.use_count() > 1 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
      if (w.use_count() > 1)
        std::fprintf(stderr, "strata: Gloo still holds a finished %s after 1 s; its buffers stay counted on the "
                             "device until it lets go\n", what.c_str());
    }
    c10::intrusive_ptr<c10d::Work> w;
    std::string what;
    std::shared_ptr<const FailureHandler> on_failure;
    std::shared_ptr<const std::vector<Peer>> peers;
    int self;
    bool on_gloo;                // CPU tensors: wait() also waits for Gloo's worker to let go
    std::function<void()> then;  // after a successful wait (once)
  };

  std::unique_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in) override {
    return guarded("all_gather", out.is_cuda(), [&] {
      at::Tensor o = out, i = in;
      return pg(o)._allgather_base(o, i);
    });
  }
  std::unique_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in) override {
    if (out.is_cuda())
      return guarded("reduce_scatter", true, [&] {
        at::Tensor o = out, i = in;
        return pg(o)._reduce_scatter_base(o, i);
      });
    // Gloo has no reduce-scatter of its own: its _reduce_scatter_base all-reduces the whole
    // buffer, twice the bytes on the network (measured between two hosts, docs/PERFORMANCE.md).
    // An all-to-all hands each rank the world's copies of its chunk, (world - 1) / world of the
    // buffer as a ring reduce-scatter sends, and the rank sums them in rank order. The copies
    // received take as much memory as the buffer: a buffer over kSliceBytes goes in slices of
    // each rank's chunk instead, a slice's pieces staged and received within kSliceBytes, one
    // all-to-all after another before this returns (the issuing thread waits; Work::wait may
    // come from another thread, so later slices cannot be issued there in the ranks' order).
    const int64_t n = out.numel(), world = world_size();
    // bf16 and fp16 send their partial sums across the nodes in fp32 (rounded once, as flat): 2/G of
    // the flat bytes off a node, no saving with 2 ranks a node.
    const bool half = in.scalar_type() == at::kBFloat16 || in.scalar_type() == at::kHalf;
    if (nodes_.two_steps() && (!half || nodes_.per_node > 2)) {
      // On the node thread, in the order issued on every rank: its all-to-alls go through
      // node_pg_ and place_pg_ alone, so the caller goes on (and issues on pg_) meanwhile, as a
      // flat reduce-scatter's Gloo work lets it. The tensors stay alive in the task until it ends.
      const auto on = [this](c10d::ProcessGroupGloo& group, const char* what) {
        return [&group, what, this](const at::Tensor& recv, const at::Tensor& send) {
          guarded(what, false, [&] {
            at::Tensor r = recv, i = send;
            std::vector<int64_t> equal_split;
            return group.alltoall_base(r, i, equal_split, equal_split);
          })->wait();
        };
      };
      return std::make_unique<Posted>(node_thread_->post([this, on, out, in] {
        reduce_scatter_by_node(out, in, nodes_, kSliceBytes, on(*node_pg_, "reduce_scatter (inside the node)"),
                               on(*place_pg_, "reduce_scatter (across the nodes)"));
      }));
    }
    if (uint64_t(in.numel()) * uint64_t(in.element_size()) <= kSliceBytes) {
      at::Tensor recv = at::empty_like(in);
      std::unique_ptr<Work> work = guarded("reduce_scatter", false, [&] {
        at::Tensor r = recv, i = in;
        std::vector<int64_t> equal_split;
        return pg(r).alltoall_base(r, i, equal_split, equal_split);
      });
      static_cast<GlooWork&>(*work).then = [out, recv, world] { sum_blocks(out.view({-1}), recv, world); };
      return work;
    }
    const int64_t slice = std::max<int64_t>(1, int64_t(kSliceBytes / 2 / uint64_t(in.element_size())) / world);
    const at::Tensor whole = in.view({world, n});
    for (int64_t at = 0; at < n; at += slice) {
      const int64_t len = std::min(slice, n - at);
      at::Tensor staged = whole.narrow(1, at, len).contiguous().view({-1}), recv = at::empty_like(staged);
      guarded("reduce_scatter", false, [&] {
        std::vector<int64_t> equal_split;
        return pg(recv).alltoall_base(recv, staged, equal_split, equal_split);
      })->wait();
      sum_blocks(out.view({-1}).narrow(0, at, len), recv, world);
    }
    return std::make_unique<LocalComm::Done>();
  }
  // The most a CPU reduce-scatter holds beside its buffer: a buffer up to this size goes in one
  // all-to-all (its copies received), a larger one in slices staged and received within it.
  static constexpr uint64_t kSliceBytes = 64ull << 20;
  std::unique_ptr<Work> all_to_all(const at::Tensor& out, const std::vector<int64_t>& out_counts, const at::Tensor& in,
                                   const std::vector<int64_t>& in_counts) override {
    return guarded("all_to_all", out.is_cuda(), [&] {
      at::Tensor o = out, i = in;
      std::vector<int64_t> oc = out_counts, ic = in_counts;
      return pg(o).alltoall_base(o, i, oc, ic);
    });
  }
  void all_reduce(const at::Tensor& t, ReduceOp op) override {
    c10d::AllreduceOptions o;
    o.reduceOp = op == ReduceOp::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    guarded("all_reduce", t.is_cuda(), [&] {
      std::vector<at::Tensor> v{t};
      return pg(t).allreduce(v, o);
    })->wait();
  }
  void broadcast(const at::Tensor& t, int root) override {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    guarded("broadcast", t.is_cuda(), [&] {
      std::vector<at::Tensor> v{t};
      return pg(t).broadcast(v, o);
    })->wait();
  }
  void barrier() override {
    guarded("barrier", false, [&] { return pg_->barrier(); })->wait();
  }

 private:
  [[noreturn]] static void fail(const std::string& message, const std::shared_ptr<const FailureHandler>& on_failure) {
    if (on_failure && *on_failure) (*on_failure)(message);
    throw CommError(message);
  }
  static std::string first_line(const std::string& s) {
    auto n = s.find('\n');
    return n == std::string::npos ? s : s.substr(0, n);
  }
  template <typename F>
  std::unique_ptr<Work> guarded(const char* op, bool cuda, F&& issue) {
    const std::string what = std::string(op) + " on rank " + std::to_string(rank()) + " of " +
                             std::to_string(world_size());
    try {
      return std::make_unique<GlooWork>(issue(), what, failure_handler(), peers_, rank(), !cuda);
    } catch (const std::exception& e) {
      fail(what + " failed: " + first_line(e.what()), failure_handler());
    }
  }

  c10d::Backend& pg(const at::Tensor& t) {
    if (!t.is_cuda()) return *pg_;
    if (!nccl_) throw CommError("collective on a CUDA tensor, but the communicator has no NCCL");
    return *nccl_;
  }

  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::shared_ptr<const std::vector<Peer>> peers_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  NodeLayout nodes_;  // two_steps(): node_pg_, place_pg_ and node_thread_ exist
  c10::intrusive_ptr<c10d::ProcessGroupGloo> node_pg_, place_pg_;
  std::unique_ptr<TaskThread> node_thread_;  // after the groups: it ends (its tasks done) before them
  c10::intrusive_ptr<c10d::Backend> nccl_;
};

}  // namespace

std::unique_ptr<Communicator> Communicator::create(const DistEnv& env,
                                                   std::chrono::milliseconds timeout,
                                                   bool with_cuda) {
  if (env.world_size == 1) return std::make_unique<LocalComm>();
  return std::make_unique<GlooComm>(env, timeout, with_cuda);
}

std::unique_ptr<Communicator> Communicator::create_process_groups(const DistEnv& env,
                                                                  std::chrono::milliseconds timeout,
                                                                  bool with_cuda) {
  return std::make_unique<GlooComm>(env, timeout, with_cuda);
}

}  // namespace strata::engine
