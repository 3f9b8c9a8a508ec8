// A checkpoint's tensors read from its chunks (export.cc's exports, export_merged.cc's merges),
// and the model a manifest describes. Private to engine/src/checkpoint. Not thread safe: one
// reader per export.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "checkpoint/catalog.h"
#include "checkpoint/chunk_reader.h"
#include "checkpoint/format.h"
#include "strata/models/model_config.h"

namespace strata::engine::ckpt {

// A manifest's model: its config.json, with the LoRA settings it trained with.
models::ModelConfig manifest_model(const json& m, const fs::path& dir);

// Each tensor from the chunks it overlaps, a window of them read at a time; the last chunk read
// is kept, as it may straddle into the next tensor. Tensors are read in manifest order.
class TensorReader {
 public:
  TensorReader(ChunkReader& reader, const ChunkCatalog& catalog) : reader_(reader), catalog_(catalog) {}

  // The tensor's elements, flat.
  at::Tensor read(const ManifestTensor& it) {
    at::Tensor full = at::empty({int64_t(it.numel)}, at::TensorOptions().dtype(at::kFloat));
    const uint64_t lo = it.offset, hi = it.offset + it.numel;
    const auto place = [&](const Loaded& l) {
      const uint64_t b = l.chunk.begin, e = l.chunk.end();
      const uint64_t from = std::max(b, lo), to = std::min(e, hi);
      full.narrow(0, int64_t(from - lo), int64_t(to - from)).copy_(l.data.narrow(0, int64_t(from - b), int64_t(to - from)));
    };
    const std::vector<Chunk> need = catalog_.overlapping(it.unit, /*kind=master*/ 0, lo, hi);
    for (size_t i = 0; i < need.size(); i += kWindow) {
      std::vector<Loaded> window;
      std::vector<ChunkReader::Request> batch;
      for (size_t j = i; j < std::min(need.size(), i + kWindow); ++j) {
        if (kept_.data.defined() && kept_.chunk == need[j]) {
          place(kept_);
          continue;
        }
        Loaded l{need[j], aligned_floats(int64_t(need[j].numel))};
        batch.push_back({l.chunk, l.data.data_ptr<float>()});
        window.push_back(std::move(l));
      }
      reader_.read(batch, kWindow);
      for (const Loaded& l : window) place(l);
      if (!window.empty()) kept_ = std::move(window.back());
    }
    return full;
  }

 private:
  static constexpr size_t kWindow = 16;  // chunks in flight: 64 MiB
  struct Loaded {
    Chunk chunk;
    at::Tensor data;
  };
  ChunkReader& reader_;
  const ChunkCatalog& catalog_;
  Loaded kept_;
};

}  // namespace strata::engine::ckpt
