// The checkpoint format (format.h): names, atomic writes, the manifest and its units, tensors and
// chunks. What reads a checkpoint without an engine (verify, describe, latest) is in inspect.cc.
#include "checkpoint/format.h"
#include "strata/engine/device.h"

#include <ATen/ops/from_blob.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "strata/engine/checkpoint.h"
#include "strata/models/hf_io.h"
#include "strata/offload/file.h"

namespace strata::engine {
namespace ckpt {

std::string rank_name(int r) {
  char b[32];
  snprintf(b, sizeof b, "rank-%05d", r);
  return b;
}

void fail_errno(const std::string& what, const fs::path& p) {
  throw std::runtime_error(what + " " + p.string() + ": " + std::strerror(errno));
}

void write_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail_errno("cannot create", tmp);
  const auto fail = [&](const char* what) {
    const int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    errno = e;
    fail_errno(what, tmp);
  };
  size_t done = 0;
  while (done < text.size()) {
    ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("cannot write");
    done += size_t(w);
  }
  if (::fsync(fd) != 0) fail("cannot fsync");
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail_errno("cannot rename to", path);
  offload::sync_directory(path.parent_path());
}

StepDirectories step_directories(const fs::path& root) {
  StepDirectories out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step-", 0) != 0) continue;
    (fs::exists(e.path() / "manifest.json") ? out.committed : out.half_written).push_back(n);
  }
  std::sort(out.committed.begin(), out.committed.end());
  std::sort(out.half_written.begin(), out.half_written.end());
  return out;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json partition_json(const Partition& part) {
  json units = json::array();
  for (const UnitLayout& u : part.units()) {
    json ts = json::array();
    for (const TensorSlot& t : u.tensors) {
      json j = {{"name", t.name}, {"shape", t.shape}};
      if (t.origin.is_part())
        j["of"] = {{"name", t.origin.whole}, {"shape", t.origin.whole_shape}, {"dim", t.origin.dim},
                   {"begin", t.origin.begin}};
      if (t.quantized) {  // a 4-bit record (model.quantize): its own place and elements
        j["at"] = t.offset;
        j["stored"] = t.numel;
        j["quant4"] = true;
      }
      ts.push_back(std::move(j));
    }
    units.push_back({{"name", u.name}, {"numel", u.numel}, {"tensors", ts}});
  }
  return units;
}

std::vector<ManifestTensor> manifest_tensors(const json& units, const std::string& where) {
  std::vector<ManifestTensor> out;
  for (size_t u = 0; u < units.size(); ++u) {
    uint64_t offset = 0;
    for (const json& t : units[u].at("tensors")) {
      ManifestTensor m;
      m.unit = u;
      m.offset = offset;
      m.slot.name = t.at("name").get<std::string>();
      m.slot.shape = t.at("shape").get<std::vector<int64_t>>();
      m.numel = 1;
      for (int64_t d : m.slot.shape) m.numel *= uint64_t(d);
      if (t.contains("of")) {
        const json& of = t["of"];
        m.slot.origin = {of.at("name").get<std::string>(), of.at("shape").get<std::vector<int64_t>>(),
                         of.at("dim").get<int64_t>(), of.at("begin").get<int64_t>()};
        const int64_t d = m.slot.origin.dim;
        bool fits = d >= 0 && size_t(d) < m.slot.shape.size() && m.slot.shape.size() == m.slot.origin.whole_shape.size() &&
                    m.slot.origin.begin >= 0 &&
                    m.slot.origin.begin + m.slot.shape[size_t(d)] <= m.slot.origin.whole_shape[size_t(d)];
        for (size_t i = 0; fits && i < m.slot.shape.size(); ++i)
          fits = i == size_t(d) || m.slot.shape[i] == m.slot.origin.whole_shape[i];
        if (!fits)
          throw std::runtime_error("checkpoint " + where + ": tensor " + m.slot.name + " is not a part of " +
                                   m.slot.origin.whole + " of its shape");
      }
      if (t.value("quant4", false)) {
        m.offset = t.at("at").get<uint64_t>();
        m.numel = t.at("stored").get<uint64_t>();
        m.slot.quantized = true;
      }
      m.slot.offset = m.offset;
      m.slot.numel = m.numel;
      offset = m.offset + m.numel;
      out.push_back(std::move(m));
    }
    if (offset != units[u].at("numel").get<uint64_t>())
      throw std::runtime_error("checkpoint " + where + ": the tensors of unit " + units[u].at("name").get<std::string>() +
                               " do not add up to its size");
  }
  return out;
}

std::vector<WholeRun> whole_runs(const TensorSlot& slot) {
  if (!slot.origin.is_part()) return {{0, slot.numel, slot.offset}};
  const std::vector<int64_t>& S = slot.origin.whole_shape;
  const size_t d = size_t(slot.origin.dim);
  uint64_t outer = 1, inner = 1;
  for (size_t i = 0; i < d; ++i) outer *= uint64_t(S[i]);
  for (size_t i = d + 1; i < S.size(); ++i) inner *= uint64_t(S[i]);
  const uint64_t len = uint64_t(slot.shape[d]) * inner, whole_row = uint64_t(S[d]) * inner;
  std::vector<WholeRun> runs;
  runs.reserve(outer);
  for (uint64_t o = 0; o < outer; ++o)
    runs.push_back({o * whole_row + uint64_t(slot.origin.begin) * inner, len, slot.offset + o * len});
  return runs;
}

void check_whole_coverage(const std::vector<ManifestTensor>& tensors, const std::string& where) {
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> runs;  // whole tensor -> (begin, numel)
  std::map<std::string, uint64_t> numel;
  for (const ManifestTensor& t : tensors) {
    uint64_t n = 1;
    for (int64_t d : t.slot.whole_shape()) n *= uint64_t(d);
    numel[t.slot.whole_name()] = n;
    for (const WholeRun& r : whole_runs(t.slot)) runs[t.slot.whole_name()].emplace_back(r.whole_begin, r.numel);
  }
  for (auto& [name, rs] : runs) {
    std::sort(rs.begin(), rs.end());
    uint64_t next = 0;
    for (const auto& [b, n] : rs) {
      if (b != next)
        throw std::runtime_error("checkpoint " + where + ": the parts of " + name + (b < next ? " overlap" : " leave a gap") +
                                 " at element " + std::to_string(std::min(b, next)));
      next += n;
    }
    if (next != numel[name])
      throw std::runtime_error("checkpoint " + where + ": the parts of " + name + " cover " + std::to_string(next) + " of its " +
                               std::to_string(numel[name]) + " elements");
  }
}

std::map<std::string, std::vector<int64_t>> whole_tensors(const std::vector<ManifestTensor>& tensors) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const ManifestTensor& t : tensors) out[t.slot.whole_name()] = t.slot.whole_shape();
  return out;
}

at::Tensor aligned_floats(int64_t n) {
  static_assert(kAlign == 4096, "Device::unpinned_host aligns to 4 KiB");
  return Device::unpinned_host(uint64_t(n), at::kFloat);
}

bool is_object_location(const fs::path& location) { return offload::is_object_store_url(location.string()); }

ObjectLocation open_object_location(const fs::path& location) {
  const std::string url = location.string();
  const size_t slash = url.rfind('/');
  // "<scheme>://<store>/<name>": a name after the last '/', and a store before it.
  if (!is_object_location(location) || slash == std::string::npos || slash == 0 || slash + 1 >= url.size() ||
      url[slash - 1] == '/')
    throw std::runtime_error("checkpoint " + url + ": expected s3://bucket[/prefix]/<checkpoint name>");
  return {offload::open_object_store(url.substr(0, slash)), url.substr(slash + 1)};
}

std::string data_prefix(const json& manifest) {
  if (!manifest.contains("store")) return "";
  return manifest["store"].at("save_id").get<std::string>() + "/";
}

json parse_manifest(const std::string& text, const std::string& where) {
  json m;
  try {
    m = json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error("checkpoint " + where + " is not valid JSON: " + e.what());
  }
  const int format = m.value("format", 0);
  if (format < kFormatWithoutParts || format > kFormatVersion || m.value("kind", "") != "strata-checkpoint")
    throw std::runtime_error("checkpoint " + where + ": not a Strata checkpoint of format " +
                             std::to_string(kFormatWithoutParts) + " to " + std::to_string(kFormatVersion));
  return m;
}

std::optional<json> read_stored_manifest(offload::ObjectStore& store, const std::string& name) {
  const std::string key = stored_manifest_key(name);
  std::vector<std::byte> bytes;
  try {
    bytes = store.get_all(key);
  } catch (const offload::ObjectStoreError& e) {
    if (e.kind() == offload::ObjectStoreError::Kind::kNotFound) return std::nullopt;
    throw;
  }
  return parse_manifest(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()), store.url_of(key));
}

json read_manifest(const fs::path& dir) {
  if (is_object_location(dir)) {
    ObjectLocation at = open_object_location(dir);
    if (auto m = read_stored_manifest(*at.store, at.name)) return std::move(*m);
    throw std::runtime_error("checkpoint " + dir.string() +
                             " has no manifest.json: it was never committed (or is not a checkpoint)");
  }
  const fs::path manifest_path = dir / "manifest.json";
  if (!fs::exists(manifest_path))
    throw std::runtime_error("checkpoint " + dir.string() +
                             " has no manifest.json: it was never committed (or is not a checkpoint)");
  return parse_manifest(read_text(manifest_path), manifest_path.string());
}

json quantization_json(const models::QuantizedBase& q, at::ScalarType compute) {
  return {{"load_in_4bit", true},
          {"bnb_4bit_quant_type", q.quant_type},
          {"bnb_4bit_use_double_quant", q.double_quant},
          {"bnb_4bit_blocksize", q.blocksize},
          {"llm_int8_skip_modules", q.skip_modules},
          {"bnb_4bit_compute_dtype", models::hf_dtype_name(compute)}};
}

std::optional<ManifestQuantization> manifest_quantization(const json& m, const fs::path& dir) {
  if (!m.contains("quantize")) return std::nullopt;
  try {
    const json& j = m.at("quantize");
    ManifestQuantization out;
    out.q.load_in_4bit = j.at("load_in_4bit").get<bool>();
    out.q.quant_type = j.at("bnb_4bit_quant_type").get<std::string>();
    out.q.double_quant = j.at("bnb_4bit_use_double_quant").get<bool>();
    out.q.blocksize = j.at("bnb_4bit_blocksize").get<int64_t>();
    out.q.skip_modules = j.at("llm_int8_skip_modules").get<std::vector<std::string>>();
    out.compute = models::parse_export_dtype(j.at("bnb_4bit_compute_dtype").get<std::string>());
    return out;
  } catch (const std::exception& e) {
    throw std::runtime_error((dir / "manifest.json").string() + ": \"quantize\" is not a 4-bit base's settings: " +
                             e.what());
  }
}

CheckpointMeta checkpoint_meta(const json& m, const fs::path& dir) {
  CheckpointMeta meta;
  try {
    meta.train_steps = m.at("train_steps").get<int64_t>();
    meta.samples_consumed = m.at("samples_consumed").get<uint64_t>();
    meta.world_size = m.at("world_size").get<int>();
    if (m.contains("frozen_base")) meta.frozen_base = m["frozen_base"].get<std::string>();
    if (m.contains("lora")) meta.lora = m["lora"].dump();
    meta.data_pack = m.value("data_pack", false);
    if (m.contains("global_batch")) meta.global_batch = m["global_batch"].get<uint64_t>();
    else if (meta.train_steps > 0 && meta.samples_consumed % uint64_t(meta.train_steps) == 0)
      meta.global_batch = meta.samples_consumed / uint64_t(meta.train_steps);
  } catch (const json::exception& e) {
    throw std::runtime_error("checkpoint " + dir.string() + ": manifest.json: " + e.what());
  }
  return meta;
}

}  // namespace ckpt
}  // namespace strata::engine
