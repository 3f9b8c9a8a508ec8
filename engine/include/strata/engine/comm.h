// Data-parallel collectives over a torchrun-compatible environment.
//
// Rendezvous: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (as torchrun and
// `strata launch` set them); rank 0 hosts libtorch's c10d TCPStore. CPU tensors go through
// libtorch's Gloo process group, CUDA tensors through its NCCL one (when created with_cuda). A world of
// one needs no store and copies locally.
//
// Failure: every collective and the rendezvous have a timeout. A rank that dies makes the
// others' collectives fail (connection reset, or the timeout if the peer hangs) with a
// CommError naming the operation and the rank; nothing waits forever.
//
// Ordering: all ranks must issue the same collectives in the same order (the engine's schedule
// is the same on every rank). Thread safety: one thread issues collectives; Work::wait may be
// called from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

namespace strata::engine {

class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // From the environment; absent variables mean a single process. Throws std::invalid_argument
  // on malformed or inconsistent values (RANK >= WORLD_SIZE, ...).
  static DistEnv from_env();
};

enum class ReduceOp { kSum, kMax };

class Communicator {
 public:
  class Work {
   public:
    virtual ~Work() = default;
    // Blocks until the collective finished; throws CommError on failure or timeout.
    virtual void wait() = 0;
  };

  // `with_cuda`: also create an NCCL group for CUDA tensors.
  static std::unique_ptr<Communicator> create(const DistEnv& env,
                                              std::chrono::milliseconds timeout,
                                              bool with_cuda = false);
  // Always the process groups (Gloo, and NCCL when with_cuda), even for a world of one: tests
  // use it to run the real NCCL path on a single GPU.
  static std::unique_ptr<Communicator> create_process_groups(const DistEnv& env,
                                                             std::chrono::milliseconds timeout,
                                                             bool with_cuda);
  virtual ~Communicator() = default;
  int rank() const { return rank_; }
  int world_size() const { return world_; }

  // out (world_size * n elements) = the ranks' `in` (n elements each) in rank order.
  virtual std::unique_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in) = 0;
  // out (n elements) = sum over ranks of their in[rank * n, (rank + 1) * n).
  virtual std::unique_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in) = 0;
  virtual void all_reduce(const at::Tensor& t, ReduceOp op) = 0;
  virtual void broadcast(const at::Tensor& t, int root) = 0;
  virtual void barrier() = 0;

 protected:
  Communicator(int rank, int world) : rank_(rank), world_(world) {}

 private:
  int rank_, world_;
};

}  // namespace strata::engine
