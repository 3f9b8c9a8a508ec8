#include "strata/planner/cluster.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace strata::planner {

using json = nlohmann::json;

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024, kGB = 1e9, kTB = 1e12;

struct Reader {
  const json& j;
  std::string where;
  double num(const std::string& key, double scale, double fallback = -1) const {
    if (!j.contains(key)) {
      if (fallback >= 0) return fallback;
      throw std::invalid_argument(where + ": missing \"" + key + "\"");
    }
    if (!j[key].is_number() || j[key].get<double>() < 0)
      throw std::invalid_argument(where + ": \"" + key + "\" must be a number >= 0, not " + j[key].dump());
    return j[key].get<double>() * scale;
  }
  Reader sub(const std::string& key) const {
    if (!j.contains(key) || !j[key].is_object()) throw std::invalid_argument(where + ": missing object \"" + key + "\"");
    return {j[key], where + "." + key};
  }
};

}  // namespace

void check_cluster(const Cluster& c) {
  const auto fail = [&](const std::string& what) {
    throw std::invalid_argument("cluster " + c.name + " (" + std::to_string(c.nodes) + " nodes of " +
                                std::to_string(c.node.gpus) + " GPUs): " + what);
  };
  if (c.nodes < 1 || c.node.gpus < 1) fail("needs at least one node and one GPU a node");
  if (c.node.gpu.memory <= c.node.gpu.reserved || c.node.gpu.peak_flops <= 0 || c.node.gpu.memory_bandwidth <= 0)
    fail("the GPU needs memory beyond its reserve, peak_tflops and memory_gbps");
  if (c.nodes > 1 && c.node.inter_bandwidth <= 0) fail("several nodes need a network: inter_gbps");
  if (c.node.gpus > 1 && c.node.intra_bandwidth <= 0) fail("several GPUs a node need a link between them: intra_gbps");
  if (c.node.pcie_h2d <= 0 || c.node.pcie_d2h <= 0) fail("pcie_h2d_gbps and pcie_d2h_gbps must be > 0");
}

double matmul_rate(const GpuSpec& g, double flops, bool fp32) {
  const double peak = fp32 ? (g.peak_flops_fp32 > 0 ? g.peak_flops_fp32 : g.peak_flops / 2) : g.peak_flops;
  const auto& pts = g.matmul_efficiency;
  if (pts.empty()) return peak;
  double f = pts.front().second;
  if (flops >= pts.back().first) {
    f = pts.back().second;
  } else if (flops > pts.front().first) {
    for (size_t i = 1; i < pts.size(); ++i)
      if (flops <= pts[i].first) {
        const double a = std::log(pts[i - 1].first), b = std::log(pts[i].first), x = std::log(flops);
        f = pts[i - 1].second + (pts[i].second - pts[i - 1].second) * (x - a) / (b - a);
        break;
      }
  }
  return peak * f;
}

double NodeSpec::disk_seconds(double read, double written, double drives, double sharers) const {
  if (read <= 0 && written <= 0) return 0;
  const double scale = drives / sharers, rd = nvme_read * scale, wr = nvme_write * scale, both = nvme_duplex * scale;
  if ((read > 0 && rd <= 0) || (written > 0 && wr <= 0))
    throw std::invalid_argument("strata plan: swap traffic on a node whose drives have no bandwidth");
  const double turns = (read > 0 ? read / rd : 0) + (written > 0 ? written / wr : 0);
  if (both <= 0) return turns;
  // Together: each direction no faster than alone, both no faster than the measured sum, and
  // never slower than taking turns.
  return std::min(turns, std::max({read > 0 ? read / rd : 0.0, written > 0 ? written / wr : 0.0, (read + written) / both}));
}

namespace {
Cluster parse_cluster_json(const json& j, const std::string& source);
}  // namespace

Cluster parse_cluster(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": not JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(source + ": a cluster is a JSON object");
  try {
    return parse_cluster_json(j, source);
  } catch (const json::exception& e) {  // a value of the wrong type
    throw std::invalid_argument(source + ": " + e.what());
  }
}

namespace {

Cluster parse_cluster_json(const json& j, const std::string& source) {
  const Reader top{j, source};
  Cluster c;
  c.name = j.value("name", "cluster");
  c.source = j.value("source", "");
  c.nodes = int(top.num("nodes", 1, 1));
  if (c.nodes < 1) throw std::invalid_argument(source + ": \"nodes\" must be >= 1");
  const Reader n = top.sub("node");
  NodeSpec& node = c.node;
  node.gpus = int(n.num("gpus", 1));
  if (node.gpus < 1) throw std::invalid_argument(source + ".node: \"gpus\" must be >= 1");
  const Reader g = n.sub("gpu");
  node.gpu.name = g.j.value("name", "gpu");
  node.gpu.memory = g.num("memory_gib", kGiB);
  node.gpu.reserved = g.num("reserved_gib", kGiB, 0);
  node.gpu.peak_flops = g.num("peak_tflops", 1e12);
  node.gpu.peak_flops_fp32 = g.num("peak_tflops_fp32", 1e12, 0);
  node.gpu.memory_bandwidth = g.num("memory_gbps", kGB);
  node.gpu.is_host = g.j.value("is_host", false);
  node.gpu.attention_efficiency = g.num("attention_efficiency", 1, 1);
  if (node.gpu.attention_efficiency <= 0 || node.gpu.attention_efficiency > 1)
    throw std::invalid_argument(g.where + ": \"attention_efficiency\" must be in (0, 1]");
  if (g.j.contains("matmul_efficiency")) {
    const json& e = g.j["matmul_efficiency"];
    if (!e.is_array()) throw std::invalid_argument(g.where + ": \"matmul_efficiency\" must be [[flops, fraction], ...]");
    for (const json& p : e) {
      if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number() || p[0].get<double>() <= 0 ||
          p[1].get<double>() <= 0 || p[1].get<double>() > 1)
        throw std::invalid_argument(g.where + ": each matmul_efficiency point is [flops > 0, 0 < fraction <= 1], not " +
                                    p.dump());
      node.gpu.matmul_efficiency.emplace_back(p[0].get<double>(), p[1].get<double>());
    }
    if (!std::is_sorted(node.gpu.matmul_efficiency.begin(), node.gpu.matmul_efficiency.end()))
      throw std::invalid_argument(g.where + ": matmul_efficiency points must be in increasing flops");
  }
  node.host_memory = n.num("host_memory_gib", kGiB);
  node.cpu_adam_rate = n.num("cpu_adam_gparams", 1e9);
  if (n.j.contains("nvme")) {
    const Reader v = n.sub("nvme");
    node.nvme_drives = int(v.num("drives", 1));
    node.nvme_capacity = v.num("capacity_tb", kTB);
    node.nvme_read = v.num("read_gbps", kGB);
    node.nvme_write = v.num("write_gbps", kGB);
    node.nvme_duplex = v.num("duplex_gbps", kGB, 0);
  }
  node.pcie_h2d = n.num("pcie_h2d_gbps", kGB);
  node.pcie_d2h = n.num("pcie_d2h_gbps", kGB);
  node.intra_bandwidth = n.num("intra_gbps", kGB, node.gpus > 1 ? -1 : 0);
  node.intra_latency = n.num("intra_latency_us", 1e-6, 0);
  node.intra_cpu_share = n.num("intra_cpu_share", 1, 1);
  if (node.intra_cpu_share <= 0 || node.intra_cpu_share > 1)
    throw std::invalid_argument(n.where + ": \"intra_cpu_share\" must be in (0, 1]");
  node.inter_bandwidth = n.num("inter_gbps", kGB, c.nodes > 1 ? -1 : 0);
  node.inter_latency = n.num("inter_latency_us", 1e-6, 0);
  return c;
}

}  // namespace

Cluster load_cluster(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::invalid_argument("cannot read the cluster file " + path);
  std::stringstream s;
  s << f.rdbuf();
  return parse_cluster(s.str(), path);
}

std::string cluster_json(const Cluster& c) {
  const NodeSpec& n = c.node;
  json eff = json::array();
  for (auto [f, e] : n.gpu.matmul_efficiency) eff.push_back({f, e});
  json gpu = {{"name", n.gpu.name},
              {"memory_gib", n.gpu.memory / kGiB},
              {"reserved_gib", n.gpu.reserved / kGiB},
              {"peak_tflops", n.gpu.peak_flops / 1e12},
              {"peak_tflops_fp32", n.gpu.peak_flops_fp32 / 1e12},
              {"matmul_efficiency", eff},
              {"memory_gbps", n.gpu.memory_bandwidth / kGB},
              {"attention_efficiency", n.gpu.attention_efficiency},
              {"is_host", n.gpu.is_host}};
  json node = {{"gpus", n.gpus},
               {"gpu", gpu},
               {"host_memory_gib", n.host_memory / kGiB},
               {"cpu_adam_gparams", n.cpu_adam_rate / 1e9},
               {"pcie_h2d_gbps", n.pcie_h2d / kGB},
               {"pcie_d2h_gbps", n.pcie_d2h / kGB},
               {"intra_gbps", n.intra_bandwidth / kGB},
               {"intra_latency_us", n.intra_latency / 1e-6},
               {"intra_cpu_share", n.intra_cpu_share},
               {"inter_gbps", n.inter_bandwidth / kGB},
               {"inter_latency_us", n.inter_latency / 1e-6}};
  if (n.nvme_drives > 0)
    node["nvme"] = {{"drives", n.nvme_drives},
                    {"capacity_tb", n.nvme_capacity / kTB},
                    {"read_gbps", n.nvme_read / kGB},
                    {"write_gbps", n.nvme_write / kGB},
                    {"duplex_gbps", n.nvme_duplex / kGB}};
  return json{{"name", c.name}, {"source", c.source}, {"nodes", c.nodes}, {"node", node}}.dump(2) + "\n";
}

namespace {

// Shared assumption of the GPU presets (not measured by this project): cuBLAS reaches about
// three quarters of the tensor-core peak on large 16-bit products and much less on small ones.
// `strata plan --calibrate` measures the curve where it runs.
const std::vector<std::pair<double, double>> kAssumedTensorCoreCurve = {
    {1e8, 0.15}, {1e9, 0.35}, {1e10, 0.6}, {1e11, 0.75}, {1e12, 0.8}};

Cluster dgx_a100() {
  Cluster c;
  c.name = "dgx-a100";
  c.source =
      "NVIDIA DGX A100 80GB datasheet: 8x A100-SXM4-80GB, 2 TB RAM, 8x 200 Gb/s HDR InfiniBand for compute, "
      "NVMe data drives 8x 3.84 TB; A100 datasheet: 312 TFLOPS bf16/fp16 dense, 19.5 TFLOPS fp32, 2039 GB/s HBM2e, "
      "NVLink 600 GB/s per GPU. Assumed, not measured here: matmul efficiency curve, 85% of HBM for memory-bound "
      "kernels, 230 GB/s NCCL all-reduce bus bandwidth in a node, 25 GB/s PCIe 4.0 each way, 8 Gparam/s CPU Adam "
      "(2x EPYC 7742), 6/3 GB/s read/write per NVMe drive.";
  c.node.gpus = 8;
  GpuSpec& g = c.node.gpu;
  g.name = "A100-SXM4-80GB";
  g.memory = 80 * kGiB;
  g.reserved = 2 * kGiB;
  g.peak_flops = 312e12;
  g.peak_flops_fp32 = 19.5e12;
  g.matmul_efficiency = kAssumedTensorCoreCurve;
  g.memory_bandwidth = 0.85 * 2039e9;
  c.node.host_memory = 2048 * kGiB;
  c.node.cpu_adam_rate = 8e9;
  c.node.nvme_drives = 8;
  c.node.nvme_capacity = 3.84e12;
  c.node.nvme_read = 6e9;
  c.node.nvme_write = 3e9;
  c.node.pcie_h2d = c.node.pcie_d2h = 25e9;
  c.node.intra_bandwidth = 230e9;
  c.node.intra_latency = 10e-6;
  c.node.inter_bandwidth = 200e9;
  c.node.inter_latency = 5e-6;
  return c;
}

Cluster dgx_h100() {
  Cluster c = dgx_a100();
  c.name = "dgx-h100";
  c.source =
      "NVIDIA DGX H100 datasheet: 8x H100-SXM5-80GB, NVLink 4 (900 GB/s per GPU), 2 TB RAM, 8x 400 Gb/s NDR "
      "InfiniBand for compute (the 8x 50 GB/s of Megatron-Core's MoE runs), NVMe data drives 8x 3.84 TB; H100 SXM "
      "datasheet: 989 TFLOPS bf16 dense, 67 TFLOPS fp32, 3.35 TB/s HBM3. Assumed, not measured here: matmul "
      "efficiency curve, 85% of HBM for memory-bound kernels, 350 GB/s NCCL bus bandwidth in a node (dgx-a100's "
      "share of NVLink), 50 GB/s PCIe 5.0 each way, 10 Gparam/s CPU Adam (2x Xeon 8480C), 6/3 GB/s per NVMe drive.";
  GpuSpec& g = c.node.gpu;
  g.name = "H100-SXM5-80GB";
  g.memory = 79.2 * kGiB;  // what the project's H100 reports (h100-box)
  g.peak_flops = 989e12;
  g.peak_flops_fp32 = 67e12;
  // The products' rates measured on this project's H200 (h200-box), whose GH100 compute die and
  // clocks are the H100 SXM's (only its memory differs), as fractions of the H100's datasheet peak.
  g.matmul_efficiency = {{6.7e7, 0.007 * 700 / 989}, {5.37e8, 0.05 * 700 / 989}, {4.29e9, 0.35 * 700 / 989},
                         {3.44e10, 0.87 * 700 / 989}, {2.75e11, 700.0 / 989}};
  g.memory_bandwidth = 0.85 * 3.35e12;
  c.node.cpu_adam_rate = 10e9;
  c.node.pcie_h2d = c.node.pcie_d2h = 50e9;
  c.node.intra_bandwidth = 350e9;
  c.node.inter_bandwidth = 400e9;
  return c;
}

Cluster dgx2_v100() {
  Cluster c;
  c.name = "dgx2-v100";
  c.source =
      "NVIDIA DGX-2 datasheet: 16x V100-SXM3-32GB on NVSwitch (300 GB/s per GPU), 1.5 TB RAM, 30 TB NVMe "
      "(8x 3.84 TB), 8x 100 Gb/s InfiniBand; V100 datasheet: 125 TFLOPS tensor (fp16), 15.7 TFLOPS fp32, 900 GB/s "
      "HBM2. The ZeRO-Infinity paper (SC21) runs on these nodes. Assumed, not measured here: matmul efficiency "
      "curve, 85% of HBM for memory-bound kernels, 120 GB/s NCCL bus bandwidth in a node, 12 GB/s PCIe 3.0 each way, "
      "4 Gparam/s CPU Adam (2x Xeon Platinum 8168), 3/2 GB/s read/write per NVMe drive.";
  c.node.gpus = 16;
  GpuSpec& g = c.node.gpu;
  g.name = "V100-SXM3-32GB";
  g.memory = 32 * kGiB;
  g.reserved = 1.5 * kGiB;
  g.peak_flops = 125e12;
  g.peak_flops_fp32 = 15.7e12;
  g.matmul_efficiency = kAssumedTensorCoreCurve;
  g.memory_bandwidth = 0.85 * 900e9;
  c.node.host_memory = 1536 * kGiB;
  c.node.cpu_adam_rate = 4e9;
  c.node.nvme_drives = 8;
  c.node.nvme_capacity = 3.84e12;
  c.node.nvme_read = 3e9;
  c.node.nvme_write = 2e9;
  c.node.pcie_h2d = c.node.pcie_d2h = 12e9;
  c.node.intra_bandwidth = 120e9;
  c.node.intra_latency = 10e-6;
  c.node.inter_bandwidth = 100e9;
  c.node.inter_latency = 5e-6;
  return c;
}

Cluster h100_box() {
  Cluster c;
  c.name = "h100-box";
  c.source =
      "This project's GPU machine (docs/PERFORMANCE.md): one H100 80GB HBM3, 16 cores, 125 GiB RAM, one 64 GiB "
      "virtual disk. Measured there 2026-11-23: device copy 2.98 TB/s, CPU Adam 4.69 Gparam/s (bf16 gradients, "
      "16 threads), disk write 2.54 GB/s (fio). H100 SXM datasheet: 989 TFLOPS bf16 dense, 67 TFLOPS fp32. "
      "Assumed, not measured: matmul efficiency curve, 2.5 GB/s disk read, 50 GB/s PCIe each way.";
  c.node.gpus = 1;
  GpuSpec& g = c.node.gpu;
  g.name = "H100-80GB-HBM3";
  g.memory = 79.2 * kGiB;
  g.reserved = 1.5 * kGiB;
  g.peak_flops = 989e12;
  g.peak_flops_fp32 = 67e12;
  g.matmul_efficiency = kAssumedTensorCoreCurve;
  g.memory_bandwidth = 2.98e12;
  c.node.host_memory = 125 * kGiB;
  c.node.cpu_adam_rate = 4.69e9;
  c.node.nvme_drives = 1;
  c.node.nvme_capacity = 64 * kGiB;
  c.node.nvme_read = 2.5e9;
  c.node.nvme_write = 2.54e9;
  c.node.pcie_h2d = c.node.pcie_d2h = 50e9;
  return c;
}

Cluster h200_box() {
  Cluster c;
  c.name = "h200-box";
  c.source =
      "This project's second GPU machine (docs/PERFORMANCE.md): one H200 (139.8 GiB as CUDA reports it), 16 cores, "
      "125 GiB RAM, one 64 GiB virtual disk. Measured there by Strata's own benchmarks, not by training runs: "
      "strata plan --calibrate --device cuda (2026-11-27): bf16 products peak at 700 TFLOP/s, 0.7% of it at "
      "6.7e7 FLOPs a product, 5% at 5.4e8, 35% at 4.3e9, 87% at 3.4e10, the peak from 2.7e11; PCIe 54.5 GB/s up, "
      "54.7 down; disk 1.27 GB/s read, 1.94 write. strata bench adam (2026-11-27, 1e8 parameters, 16 threads): CPU "
      "Adam 4.13 Gparam/s; CUDA Adam's device copy bandwidth 4.17 TB/s. Reserved: the engine's own reserve (8% "
      "of the GPU) and the CUDA context. Assumed: fp32 peak 67 TFLOPS (H200 datasheet, unused in bf16 runs).";
  c.node.gpus = 1;
  GpuSpec& g = c.node.gpu;
  g.name = "H200";
  g.memory = 139.8 * kGiB;
  g.reserved = 11.7 * kGiB;
  g.peak_flops = 700e12;
  g.peak_flops_fp32 = 67e12;
  g.matmul_efficiency = {{6.7e7, 0.007}, {5.37e8, 0.05}, {4.29e9, 0.35}, {3.44e10, 0.87}, {2.75e11, 1.0}};
  g.memory_bandwidth = 4.17e12;
  c.node.host_memory = 125 * kGiB;
  c.node.cpu_adam_rate = 4.13e9;
  c.node.nvme_drives = 1;
  c.node.nvme_capacity = 64 * kGiB;
  c.node.nvme_read = 1.27e9;
  c.node.nvme_write = 1.94e9;
  c.node.pcie_h2d = 54.5e9;
  c.node.pcie_d2h = 54.7e9;
  return c;
}

}  // namespace

std::vector<std::string> cluster_presets() { return {"dgx-a100", "dgx-h100", "dgx2-v100", "h100-box", "h200-box"}; }

Cluster cluster_preset(const std::string& name) {
  if (name == "dgx-a100") return dgx_a100();
  if (name == "dgx-h100") return dgx_h100();
  if (name == "dgx2-v100") return dgx2_v100();
  if (name == "h100-box") return h100_box();
  if (name == "h200-box") return h200_box();
  std::string names;
  for (const std::string& n : cluster_presets()) names += (names.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown cluster '" + name + "': give a JSON file or one of " + names);
}

Cluster cluster_from(const std::string& s) {
  for (const std::string& n : cluster_presets())
    if (s == n) return cluster_preset(s);
  return load_cluster(s);
}

}  // namespace strata::planner
