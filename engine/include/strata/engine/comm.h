// Data-parallel collectives over a torchrun-compatible environment.
//
// Rendezvous: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (as torchrun and
// `strata launch` set them), or the variables srun gives each task of a Slurm job step (see
// DistEnv::from_env); rank 0 hosts libtorch's c10d TCPStore. CPU tensors go through
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
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

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
  int local_world_size = 0;  // ranks on this node (their budgets share its RAM and disks); 0: unknown
  int node = -1;             // this node's number: GROUP_RANK (torchrun), SLURM_NODEID (srun); -1: unknown
  std::string launcher = "none";  // where the values came from: "torchrun", "slurm" or "none"

  // From the environment, first match wins:
  // - torchrun (and `strata launch`): RANK and WORLD_SIZE set; LOCAL_RANK (default RANK),
  //   LOCAL_WORLD_SIZE, MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500).
  // - srun: SLURM_PROCID and SLURM_STEP_NUM_TASKS set (srun sets both for every task of a job
  //   step; a batch script itself has no step task count, so running `strata train` there without
  //   srun is one process, not rank 0 of a world that never comes). LOCAL_RANK = SLURM_LOCALID;
  //   local world size from SLURM_STEP_TASKS_PER_NODE ("8(x4)", or "2(x3),1" indexed by
  //   SLURM_NODEID); MASTER_ADDR = the first host of SLURM_STEP_NODELIST unless set, which is
  //   where srun puts task 0 with its block and cyclic distributions (with an arbitrary
  //   distribution or SLURM_HOSTFILE set MASTER_ADDR to task 0's host); MASTER_PORT = 20000 +
  //   SLURM_JOB_ID % 10000 unless set, below Linux's ephemeral ports (every task of the job
  //   agrees; set MASTER_PORT when several steps of one job train at once).
  // - otherwise a single process.
  // Throws std::invalid_argument on malformed or inconsistent values (RANK >= WORLD_SIZE, a
  // bad host list, ...), naming the variable.
  static DistEnv from_env();
  // The same rules over any lookup (nullptr: not set); from_env() passes std::getenv.
  static DistEnv from_lookup(const std::function<const char*(const char*)>& getenv);
};

// The first host of a Slurm host list: "gpu-[07-09,12],login1" -> "gpu-07",
// "rack[2-3]-n[01-04]" -> "rack2-n01". Throws std::invalid_argument on an empty or malformed
// list (unbalanced or empty brackets).
std::string slurm_first_host(const std::string& nodelist);

// A TCP port free on loopback now (bound, read and closed; a rendezvous binds it again at once):
// MASTER_PORT for ranks of this machine. Throws std::runtime_error naming the socket error.
int free_loopback_port();

enum class ReduceOp { kSum, kMax };

class Communicator {
 public:
  class Work {
   public:
    virtual ~Work() = default;
    // CPU tensors (Gloo): blocks until the collective finished. CUDA tensors (NCCL): makes the
    // calling thread's current stream wait for it, without blocking the host, so the outputs
    // may be used by work enqueued on that stream afterwards. Throws CommError on failure or
    // timeout.
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

  // Whether Work::wait on a collective over `t` blocks the host until the ranks have exchanged
  // (CPU tensors, Gloo) rather than only ordering the calling thread's stream (CUDA, NCCL).
  static bool wait_blocks_host(const at::Tensor& t) { return !t.is_cuda(); }
  // out (world_size * n elements) = the ranks' `in` (n elements each) in rank order. `in` may be
  // this rank's slice of `out` (in place).
  virtual std::unique_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in) = 0;
  // out (n elements) = sum over ranks of their in[rank * n, (rank + 1) * n).
  virtual std::unique_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in) = 0;
  // Each rank sends in_counts[r] elements to rank r and receives out_counts[r] from it: `in` is
  // the pieces for ranks 0, 1, ... one after another, `out` the pieces from them, likewise. The
  // counts agree pairwise (this rank's in_counts[r] is rank r's out_counts[this rank]); any may be
  // 0, and so may a whole side. 1-D contiguous tensors of one dtype; the bytes travel unchanged.
  virtual std::unique_ptr<Work> all_to_all(const at::Tensor& out, const std::vector<int64_t>& out_counts,
                                           const at::Tensor& in, const std::vector<int64_t>& in_counts) = 0;
  virtual void all_reduce(const at::Tensor& t, ReduceOp op) = 0;
  virtual void broadcast(const at::Tensor& t, int root) = 0;
  virtual void barrier() = 0;

  // Called with the error's message on whichever thread sees a collective fail, just before
  // CommError is thrown there. A program whose other threads may be waiting on peers (an
  // asynchronous save's collectives, the updater) can end the process here: otherwise the error
  // is reported only after unwinding, and unwinding joins threads that wait on the broken
  // world, possibly until the timeout (`strata train` exits here: docs/CONFIG.md). Set it before
  // the first collective; not called for a failed rendezvous (create() throws then).
  using FailureHandler = std::function<void(const std::string& what)>;
  void set_failure_handler(FailureHandler h) { on_failure_ = std::make_shared<const FailureHandler>(std::move(h)); }

 protected:
  Communicator(int rank, int world) : rank_(rank), world_(world) {}
  // The handler as set (a copy a Work can hold); null when none.
  std::shared_ptr<const FailureHandler> failure_handler() const { return on_failure_; }

 private:
  int rank_, world_;
  std::shared_ptr<const FailureHandler> on_failure_;
};

}  // namespace strata::engine
