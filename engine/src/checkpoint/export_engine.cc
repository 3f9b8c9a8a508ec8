// A running engine's weights as a Hugging Face model directory (export_engine_hf, checkpoint.h):
// the shards shared among the ranks that see the target, each writer gathering its tensors'
// elements from their owners in rounds of all-to-alls; the plan and the writing are
// export_checkpoint_hf's (export_plan.h).
#include <ATen/ops/empty.h>

#include <algorithm>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>

#include "checkpoint/commit.h"
#include "checkpoint/export_plan.h"
#include "checkpoint/format.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/hf_io.h"
#include "strata/models/peft.h"
#include "strata/models/sharded_safetensors.h"

namespace strata::engine {
using namespace ckpt;

namespace {

// A writer receives at most one piece a round; a rank sends at most kSendElements a round (or one
// piece), and reads the next round's while this one travels and is written.
constexpr uint64_t kPieceElements = 16ull << 20;  // 64 MiB of fp32
constexpr uint64_t kSendElements = 16ull << 20;

// Elements [at, at + numel) of unit `unit`'s master, held by `owner`, for writer `writer`'s item.
struct Piece {
  size_t item;
  uint64_t at, numel;
  int owner, writer;
};

// Each writer's items in plan order, cut into pieces at slice boundaries and kPieceElements, and
// dealt into rounds: in rank order, each writer takes its next piece unless its owner already
// sends kSendElements in the round (an owner's first piece always goes). Alike on every rank.
class Rounds {
 public:
  Rounds(Engine& engine, const ExportPlan& plan, const std::vector<int>& writer_of_item, int world)
      : engine_(engine), plan_(plan), queue_(size_t(world)), next_(size_t(world)) {
    // An empty tensor has nothing to gather (its writer completes it by itself).
    for (size_t i = 0; i < plan.items.size(); ++i)
      if (writer_of_item[i] >= 0 && plan.items[i].t.numel > 0) queue_[size_t(writer_of_item[i])].push_back(i);
  }

  // The next round's pieces, by writer rank; empty when every item is done.
  std::vector<Piece> next() {
    std::vector<Piece> round;
    std::map<int, uint64_t> sends;
    for (size_t w = 0; w < queue_.size(); ++w) {
      Cursor& c = next_[w];
      if (c.k == queue_[w].size()) continue;
      const ExportItem& item = plan_.items[queue_[w][c.k]];
      const UnitLayout& L = engine_.partition().unit(item.t.unit);
      const uint64_t a = item.t.offset + c.done;
      const int owner = int(a / L.shard_numel);
      const uint64_t b = std::min({item.t.offset + item.t.numel, a + kPieceElements,
                                   L.shard_begin(owner) + L.shard_valid_numel(owner)});
      uint64_t& sent = sends[owner];
      if (sent > 0 && sent + (b - a) > kSendElements) continue;
      sent += b - a;
      round.push_back({queue_[w][c.k], a, b - a, owner, int(w)});
      if ((c.done += b - a) == item.t.numel) c = {c.k + 1, 0};
    }
    return round;
  }

 private:
  struct Cursor {
    size_t k = 0;       // the writer's item in progress (an index into its queue)
    uint64_t done = 0;  // its elements dealt so far
  };
  Engine& engine_;
  const ExportPlan& plan_;
  std::vector<std::vector<size_t>> queue_;  // [writer]: its items in plan order
  std::vector<Cursor> next_;
};

// The mark rank 0 leaves in the temporary directory: a rank that reads it back sees the target.
constexpr const char* kMarkFile = ".strata-export-mark";

int64_t read_mark(const fs::path& dir) {
  std::ifstream in(dir / kMarkFile);
  int64_t v = 0;
  return in >> v ? v : 0;
}

}  // namespace

ExportResult export_engine_hf(Engine& engine, Communicator& comm, const fs::path& out_arg, const EngineExport& options) {
  fs::path out_dir = out_arg.lexically_normal();
  if (!out_dir.has_filename()) out_dir = out_dir.parent_path();
  const int rank = comm.rank(), world = comm.world_size();
  const models::ModelConfig& mc = engine.model_config();
  const at::ScalarType type = export_type(options.content, options.type);
  const ExportPlan plan =
      plan_export(partition_json(engine.partition()), out_dir, mc, st_type_of(type), options.content);
  const uint64_t shard_bytes = shard_limit(options.content, options.shard_bytes);
  const std::vector<std::vector<size_t>> shards = models::plan_shards(plan.specs, shard_bytes);
  const fs::path tmp = models::ExportDirectory::temporary(out_dir);

  // Rank 0 prepares the directory (refusing a non-empty out_dir) and leaves its mark; a failure
  // here, or on any rank later, stops that rank's writing, not its part in the collectives, so
  // that every rank finishes them and learns of it at the end.
  std::string failure;
  const auto attempt = [&](const std::function<void()>& f) {
    if (!failure.empty()) return;
    try {
      f();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  };
  std::optional<models::ExportDirectory> out;
  at::Tensor mark = at::zeros({1}, at::kLong);
  if (rank == 0) attempt([&] {
      out.emplace(out_dir, options.overwrite, options.overwrite_hint, directory_kind(options.content));
      std::random_device rd;
      const int64_t m = int64_t((uint64_t(rd()) << 31) ^ rd()) | 1;
      std::ofstream(out->tmp() / kMarkFile) << m << "\n";
      mark.fill_(m);
    });
  comm.broadcast(mark, 0);
  const int64_t m = mark.item<int64_t>();
  bool sees = m != 0 && (rank == 0 || read_mark(tmp) == m);
  bool staged_own = false;  // a directory of this rank's own (not rank 0's), removed at the end if empty
  if (m != 0 && !sees && options.stage_on_every_rank) attempt([&] {
      fs::create_directories(tmp);
      staged_own = sees = true;
    });
  at::Tensor seeing = at::full({1}, sees ? int64_t(1) : int64_t(0), at::kLong);
  comm.all_reduce(seeing, ReduceOp::kSum);
  const bool shared = seeing.item<int64_t>() == world;
  if (rank == 0 && out) attempt([&] { fs::remove(out->tmp() / kMarkFile); });

  // Shard s's writer: rank s % world where every rank can write, else rank 0; none when rank 0
  // could not prepare the directory (nothing is gathered, the failure is agreed below).
  std::map<std::string, int> writer_of_tensor;
  std::vector<bool> mine(shards.size());
  for (size_t s = 0; s < shards.size(); ++s) {
    const int w = m == 0 ? -1 : shared ? int(s % size_t(world)) : 0;
    mine[s] = w == rank;
    for (size_t t : shards[s]) writer_of_tensor[plan.specs[t].name] = w;
  }
  std::vector<int> writer_of_item;
  // A merge's adapter goes to the writer of the weight it is merged into.
  for (const ExportItem& item : plan.items)
    writer_of_item.push_back(writer_of_tensor.at(item.key.empty() ? item.merge_into : item.key));
  std::optional<models::ShardedSafetensorsWriter> writer;
  const bool writes = std::find(mine.begin(), mine.end(), true) != mine.end() || (rank == 0 && m != 0);
  if (writes && sees) attempt([&] {
      writer.emplace(tmp, plan.specs, shard_bytes, std::map<std::string, std::string>{{"format", "pt"}},
                     models::ShardedSafetensorsWriter::Part{mine, rank == 0});
      // An adapter's one file is renamed when complete: the caller's upload takes it from out_dir.
      if (options.on_weights_file && options.content != ExportContent::kAdapter)
        writer->on_shard_complete([&](const std::string& file) { options.on_weights_file(tmp / file); });
    });
  ExportSink sink(plan, mc, type, writer && failure.empty() ? &*writer : nullptr);

  // Read, not changed: the hold makes read_state see the device's queued update; the caller (the
  // training thread) runs no update meanwhile. An asynchronous save in flight is waited for first.
  auto hold = std::make_shared<StateHold>(engine.partition().num_units());
  engine.hold_state(hold);
  struct ReleaseAll {
    StateHold& h;
    ~ReleaseAll() { h.release_all(); }
  } release_all{*hold};
  const std::shared_future<void> update = engine.update_finished();
  if (update.valid()) update.get();

  // This rank's pieces of a round, read into `buf` in the round's order (the order the all-to-all
  // sends them in). Runs on a thread of its own while the round before it travels and is written:
  // the swap reads overlap the writing. Returns its failure ("" when none).
  const auto read_round = [&engine, &plan, rank](const std::vector<Piece>& round, const at::Tensor& buf) {
    std::string error;
    int64_t at = 0;
    for (const Piece& p : round) {
      if (p.owner != rank) continue;
      const size_t unit = plan.items[p.item].t.unit;
      if (error.empty()) try {
          engine.read_state(unit, state::kMaster, p.at - engine.partition().unit(unit).shard_begin(rank), p.numel,
                            buf.data_ptr<float>() + at);
        } catch (const std::exception& e) {
          error = e.what();  // the pieces still go (unread), so that the rounds stay aligned
        }
      at += int64_t(p.numel);
    }
    return error;
  };
  Rounds rounds(engine, plan, writer_of_item, world);
  const at::Tensor send[2] = {aligned_floats(int64_t(kSendElements)), aligned_floats(int64_t(kSendElements))};
  const at::Tensor receive = aligned_floats(int64_t(kPieceElements));
  at::Tensor tensor;  // this rank's item in progress, in the export type
  uint64_t tensor_in = 0, gathered = 0;
  std::vector<Piece> round = rounds.next();
  std::future<std::string> reading = std::async(std::launch::async, read_round, round, send[0]);
  for (int cur = 0; !round.empty(); cur ^= 1) {
    std::vector<Piece> next = rounds.next();
    const std::string read_error = reading.get();
    if (!read_error.empty() && failure.empty()) failure = read_error;
    reading = std::async(std::launch::async, read_round, next, send[cur ^ 1]);
    std::vector<int64_t> send_counts(size_t(world), 0), receive_counts(size_t(world), 0);
    int64_t sending = 0;
    const Piece* receiving = nullptr;
    for (const Piece& p : round) {
      if (p.owner == rank) {
        send_counts[size_t(p.writer)] = int64_t(p.numel);
        sending += int64_t(p.numel);
      }
      if (p.writer == rank) {
        receive_counts[size_t(p.owner)] = int64_t(p.numel);
        receiving = &p;
      }
      gathered += p.numel;
    }
    comm.all_to_all(receive.narrow(0, 0, receiving ? int64_t(receiving->numel) : 0), receive_counts,
                    send[cur].narrow(0, 0, sending), send_counts)
        ->wait();
    // A failure here (a tensor too large for memory) stops this rank's writing, not its rounds.
    if (receiving && sink.writing() && failure.empty()) attempt([&] {
        const ExportItem& item = plan.items[receiving->item];
        if (tensor_in == 0)
          tensor = at::empty({int64_t(item.t.numel)}, at::TensorOptions().dtype(item.fp32 ? at::kFloat : type));
        tensor.narrow(0, int64_t(tensor_in), int64_t(receiving->numel))
            .copy_(receive.narrow(0, 0, int64_t(receiving->numel)));
        if ((tensor_in += receiving->numel) == item.t.numel) {
          sink.put(receiving->item, tensor);
          tensor = at::Tensor();
          tensor_in = 0;
        }
      });
    if (rank == 0 && options.progress)
      options.progress(gathered * models::st_dtype_bytes(st_type_of(type)), plan.total);
    round = std::move(next);
  }
  reading.get();  // the empty round's
  sink.finish();
  if (failure.empty()) failure = sink.failure();

  // Every shard is written (or some rank failed): rank 0 completes the directory.
  const auto agreed = [&](const RankError& e) {
    return std::runtime_error("export to " + out_dir.string() + ": " +
                              (e.rank == rank ? e.message : "rank " + std::to_string(e.rank) + ": " + e.message));
  };
  ExportResult result = sink.result();
  const std::optional<RankError> written = first_error(comm, failure);
  if (staged_own) {  // after every rank's writing (ranks of a node may share it): empty once the shards moved away
    std::error_code ignored;
    fs::remove(tmp, ignored);
  }
  if (written) throw agreed(*written);
  result.files = options.content == ExportContent::kAdapter ? std::vector<std::string>{models::kAdapterWeightsFile}
                                                             : models::shard_set_files(shards.size());
  if (rank == 0) attempt([&] {
      finish_export_directory(out->tmp(), options.content, mc, models::hf_dtype_name(type), shards.size(),
                              options.base_model);
      if (!options.tokenizer_from.empty() && options.content != ExportContent::kAdapter)
        result.tokenizer_files = models::copy_tokenizer_files(options.tokenizer_from, out->tmp());
      out->commit();
    });
  if (const std::optional<RankError> e = first_error(comm, failure)) throw agreed(*e);
  return result;
}

}  // namespace strata::engine
