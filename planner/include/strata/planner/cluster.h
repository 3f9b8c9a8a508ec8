// A machine and a cluster of them, as the planner sees them: what each node has (GPUs with their
// memory and matmul speed, host RAM, the CPU's optimizer rate, NVMe drives, PCIe, NVLink) and how
// nodes are joined (bandwidth and latency of the network). Read from a JSON file (format in
// docs/PLANNER.md), written by `strata plan --calibrate`, or one of the presets below with its
// sources.
//
// Units inside: bytes, bytes per second, seconds, FLOP per second. Plain value types;
// thread-safe. Errors: std::invalid_argument naming the file and key.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace strata::planner {

struct GpuSpec {
  std::string name;
  double memory = 0;       // bytes of device memory
  double reserved = 0;     // bytes the framework cannot use (context, allocator slack)
  double peak_flops = 0;   // dense matmul at 16-bit precision (bf16/fp16), FLOP/s
  double peak_flops_fp32 = 0;  // dense matmul in fp32 (0: peak_flops / 2)
  // Achieved fraction of the peak by the work of one matrix product (FLOPs), as points
  // (flops, fraction) interpolated on log(flops), clamped at the ends: small products do not
  // fill the GPU.
  std::vector<std::pair<double, double>> matmul_efficiency;
  double memory_bandwidth = 0;  // bytes/s a memory-bound kernel reaches (read + write)
  // The fused attention's rate as a fraction of the matrix products' at the same work (1: as fast;
  // the GPU presets leave it at 1, calibration measures it).
  double attention_efficiency = 1;
  // The "GPU" is this host's CPU (the engine's host device): compute, the optimizer and copies
  // share the same cores and memory, so they do not overlap one another (the disk still works
  // beside them).
  bool is_host = false;
};

struct NodeSpec {
  int gpus = 1;
  GpuSpec gpu;
  double host_memory = 0;        // bytes of RAM for training state
  double cpu_adam_rate = 0;      // parameters/s of the CPU Adam step with all the node's cores
  int nvme_drives = 0;
  double nvme_capacity = 0;      // bytes per drive
  double nvme_read = 0, nvme_write = 0;  // bytes/s per drive
  // Bytes/s per drive read and written together (reads and writes in flight at once, as the
  // optimizer's swap runs them); 0: unknown, reads and writes are taken to take turns.
  double nvme_duplex = 0;
  // Seconds for `read` and `written` bytes on `drives` drives shared by `sharers` ranks.
  double disk_seconds(double read, double written, double drives, double sharers) const;
  double pcie_h2d = 0, pcie_d2h = 0;     // bytes/s per GPU, each way
  double intra_bandwidth = 0;    // bytes/s per GPU of a collective inside the node (bus bandwidth)
  // On the host device: the share of a collective's time at intra_bandwidth that is CPU work on
  // each rank (copies, the TCP stack); the rest is waiting for the other ranks, which the
  // engine's own work beside the collective fills. 1: all of it is CPU work.
  double intra_cpu_share = 1;
  double inter_bandwidth = 0;    // bytes/s per node each way over the network
  double inter_latency = 0;      // seconds, one message between nodes
  double intra_latency = 0;      // seconds, one message inside a node
};

struct Cluster {
  std::string name;
  std::string source;  // where the numbers come from
  int nodes = 1;
  NodeSpec node;
  int gpus() const { return nodes * node.gpus; }
};

// Throws std::invalid_argument naming what is missing for `c` as planned (its node count may
// have been changed after parsing): a network for several nodes, a link for several GPUs a node,
// GPU memory and speed.
void check_cluster(const Cluster& c);

// The achieved matmul rate (FLOP/s) for one product of `flops` FLOPs at 16-bit (or fp32) precision.
double matmul_rate(const GpuSpec& gpu, double flops, bool fp32 = false);

Cluster parse_cluster(const std::string& json_text, const std::string& source);
Cluster load_cluster(const std::string& path);
std::string cluster_json(const Cluster& c);

// dgx-a100, dgx2-v100, h100-box; throws std::invalid_argument listing them.
Cluster cluster_preset(const std::string& name);
std::vector<std::string> cluster_presets();
// A preset's name or a JSON file's path.
Cluster cluster_from(const std::string& name_or_path);

}  // namespace strata::planner
