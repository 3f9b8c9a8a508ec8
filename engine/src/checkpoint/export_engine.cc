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


// One export of a running engine, in phases; each phase names the collectives it runs, and every
// rank runs every phase (a rank that failed keeps its failure and stops writing, not its part in
// the collectives, so that the ranks agree on it at the end).
class EngineExporter {
 public:
  EngineExporter(Engine& engine, Communicator& comm, const fs::path& out_dir, const EngineExport& options)
      : engine_(engine), comm_(comm), options_(options), out_dir_(out_dir), rank_(comm.rank()), world_(comm.world_size()),
        mc_(engine.model_config()), type_(export_type(options.content, options.type)),
        plan_(plan_export(partition_json(engine.partition()), out_dir, mc_, st_type_of(type_), options.content)),
        shard_bytes_(shard_limit(options.content, options.shard_bytes)),
        shards_(models::plan_shards(plan_.specs, shard_bytes_)), tmp_(models::ExportDirectory::temporary(out_dir)) {}

  ExportResult run() {
    stage_directory();
    assign_writers();
    open_writer();
    ExportSink sink(plan_, mc_, type_, writer_ && !failure_.failed() ? &*writer_ : nullptr);
    gather_and_write(sink);
    return commit(sink);
  }

 private:
  // Collectives: one broadcast (rank 0's mark), one all-reduce (how many ranks see it). Rank 0
  // prepares the directory (refusing a non-empty out_dir) and leaves a random mark in it; a rank
  // that reads the mark back sees the target (or, with stage_on_every_rank, stages its own).
  void stage_directory() {
    at::Tensor mark = at::zeros({1}, at::kLong);
    if (rank_ == 0) failure_.attempt([&] {
        out_.emplace(out_dir_, options_.overwrite, options_.overwrite_hint, directory_kind(options_.content));
        std::random_device rd;
        const int64_t m = int64_t((uint64_t(rd()) << 31) ^ rd()) | 1;
        std::ofstream(out_->tmp() / kMarkFile) << m << "\n";
        mark.fill_(m);
      });
    comm_.broadcast(mark, 0);
    mark_ = mark.item<int64_t>();
    sees_ = mark_ != 0 && (rank_ == 0 || read_mark(tmp_) == mark_);
    if (mark_ != 0 && !sees_ && options_.stage_on_every_rank) failure_.attempt([&] {
        fs::create_directories(tmp_);
        staged_own_ = sees_ = true;
      });
    at::Tensor seeing = at::full({1}, sees_ ? int64_t(1) : int64_t(0), at::kLong);
    comm_.all_reduce(seeing, ReduceOp::kSum);
    shared_ = seeing.item<int64_t>() == world_;
    if (rank_ == 0 && out_) failure_.attempt([&] { fs::remove(out_->tmp() / kMarkFile); });
  }

  // No collectives (alike on every rank). Shard s's writer: rank s % world where every rank sees
  // the directory, else rank 0; none when rank 0 could not prepare it (nothing is gathered, the
  // failure is agreed at the commit). A merge's adapter goes to the writer of its weight.
  // An expert tensor's adapters merge into every expert's weights, which may span shards: those
  // shards take the writer of the first, so that one writer holds the adapters for all of them.
  void assign_writers() {
    std::map<std::string, int> writer_of_tensor, writer_of_module;
    const auto module_of = [&](const std::string& weight) {
      const std::optional<models::AdaptedWeight> w =
          options_.content == ExportContent::kMerged ? models::adapted_weight(mc_, weight) : std::nullopt;
      return w ? w->module : std::string();
    };
    mine_.assign(shards_.size(), false);
    for (size_t s = 0; s < shards_.size(); ++s) {
      int w = mark_ == 0 ? -1 : shared_ ? int(s % size_t(world_)) : 0;
      std::string bound;  // the module whose earlier weights fixed this shard's writer
      for (size_t t : shards_[s])
        if (const auto m = writer_of_module.find(module_of(plan_.specs[t].name)); m != writer_of_module.end()) {
          if (!bound.empty() && m->second != w)
            throw std::runtime_error("export: the weights that " + bound + " and " + m->first +
                                     " merge into span shards of different writers (a larger shard_bytes avoids it)");
          w = m->second;
          bound = m->first;
        }
      mine_[s] = w == rank_;
      for (size_t t : shards_[s]) {
        writer_of_tensor[plan_.specs[t].name] = w;
        if (const std::string m = module_of(plan_.specs[t].name); !m.empty()) writer_of_module.emplace(m, w);
      }
    }
    for (const ExportItem& item : plan_.items)
      writer_of_item_.push_back(item.key.empty() ? writer_of_module.at(item.merge_into) : writer_of_tensor.at(item.key));
  }

  // No collectives: this rank's writer of its shards (rank 0 also writes the index).
  void open_writer() {
    const bool writes = std::find(mine_.begin(), mine_.end(), true) != mine_.end() || (rank_ == 0 && mark_ != 0);
    if (writes && sees_) failure_.attempt([&] {
        writer_.emplace(tmp_, plan_.specs, shard_bytes_, std::map<std::string, std::string>{{"format", "pt"}},
                        models::ShardedSafetensorsWriter::Part{mine_, rank_ == 0});
        // An adapter's one file is renamed when complete: the caller's upload takes it from out_dir.
        if (options_.on_weights_file && options_.content != ExportContent::kAdapter)
          writer_->on_shard_complete([this](const std::string& file) { options_.on_weights_file(tmp_ / file); });
      });
  }

  // Collectives: one all-to-all a round, the same rounds on every rank (Rounds). The state is read,
  // not changed: the hold makes read_state see the device's queued update, and the caller (the
  // training thread) runs no update meanwhile; an asynchronous save in flight is waited for first.
  void gather_and_write(ExportSink& sink) {
    auto hold = std::make_shared<StateHold>(engine_.partition().num_units());
    engine_.hold_state(hold);
    struct ReleaseAll {
      StateHold& h;
      ~ReleaseAll() { h.release_all(); }
    } release_all{*hold};
    const std::shared_future<void> update = engine_.update_finished();
    if (update.valid()) update.get();

    Rounds rounds(engine_, plan_, writer_of_item_, world_);
    const at::Tensor send[2] = {aligned_floats(int64_t(kSendElements)), aligned_floats(int64_t(kSendElements))};
    const at::Tensor receive = aligned_floats(int64_t(kPieceElements));
    Assembly assembly;
    uint64_t gathered = 0;
    std::vector<Piece> round = rounds.next();
    std::future<std::string> reading = std::async(std::launch::async, [&, r = round] { return read_round(r, send[0]); });
    for (int cur = 0; !round.empty(); cur ^= 1) {
      std::vector<Piece> next = rounds.next();
      failure_.keep(reading.get());
      reading = std::async(std::launch::async, [&, r = next, c = cur] { return read_round(r, send[c ^ 1]); });
      std::vector<int64_t> send_counts(size_t(world_), 0), receive_counts(size_t(world_), 0);
      int64_t sending = 0;
      const Piece* receiving = nullptr;
      for (const Piece& p : round) {
        if (p.owner == rank_) {
          send_counts[size_t(p.writer)] = int64_t(p.numel);
          sending += int64_t(p.numel);
        }
        if (p.writer == rank_) {
          receive_counts[size_t(p.owner)] = int64_t(p.numel);
          receiving = &p;
        }
        gathered += p.numel;
      }
      comm_.all_to_all(receive.narrow(0, 0, receiving ? int64_t(receiving->numel) : 0), receive_counts,
                       send[cur].narrow(0, 0, sending), send_counts)
          ->wait();
      // A failure here (a tensor too large for memory) stops this rank's writing, not its rounds.
      if (receiving && sink.writing() && !failure_.failed())
        failure_.attempt([&] { assembly.add(*receiving, receive, plan_, type_, sink); });
      if (rank_ == 0 && options_.progress)
        options_.progress(gathered * models::st_dtype_bytes(st_type_of(type_)), plan_.total);
      round = std::move(next);
    }
    reading.get();  // the empty round's
    sink.finish();
    failure_.keep(sink.failure());
  }

  // This rank's pieces of a round, read into `buf` in the round's order (the order the all-to-all
  // sends them in). Runs on a thread of its own while the round before it travels and is written:
  // the swap reads overlap the writing. Returns its failure ("" when none); a piece that failed
  // still goes (unread), so that the rounds stay aligned.
  std::string read_round(const std::vector<Piece>& round, const at::Tensor& buf) {
    FirstFailure read;
    int64_t at = 0;
    for (const Piece& p : round) {
      if (p.owner != rank_) continue;
      const size_t unit = plan_.items[p.item].t.unit;
      read.attempt([&] {
        engine_.read_state(unit, state::kMaster, p.at - engine_.partition().unit(unit).shard_begin(rank_), p.numel,
                           buf.data_ptr<float>() + at);
      });
      at += int64_t(p.numel);
    }
    return read.message();
  }

  // The item in progress on a writer: its pieces copied in, in the export type, until it is whole.
  struct Assembly {
    at::Tensor tensor;
    uint64_t in = 0;
    void add(const Piece& p, const at::Tensor& received, const ExportPlan& plan, at::ScalarType type, ExportSink& sink) {
      const ExportItem& item = plan.items[p.item];
      if (in == 0) tensor = at::empty({int64_t(item.t.numel)}, at::TensorOptions().dtype(item.fp32 ? at::kFloat : type));
      tensor.narrow(0, int64_t(in), int64_t(p.numel)).copy_(received.narrow(0, 0, int64_t(p.numel)));
      if ((in += p.numel) == item.t.numel) {
        sink.put(p.item, tensor);
        tensor = at::Tensor();
        in = 0;
      }
    }
  };

  // Collectives: first_error twice (every shard written; then rank 0's completion of the
  // directory). Every rank throws alike when any failed.
  ExportResult commit(const ExportSink& sink) {
    ExportResult result = sink.result();
    const std::optional<RankError> written = first_error(comm_, failure_.message());
    if (staged_own_) {  // after every rank's writing (ranks of a node may share it): empty once the shards moved away
      std::error_code ignored;
      fs::remove(tmp_, ignored);
    }
    if (written) throw agreed(*written);
    result.files = options_.content == ExportContent::kAdapter ? std::vector<std::string>{models::kAdapterWeightsFile}
                                                                : models::shard_set_files(shards_.size());
    if (rank_ == 0) failure_.attempt([&] {
        finish_export_directory(out_->tmp(), options_.content, mc_, models::hf_dtype_name(type_), shards_.size(),
                                options_.base_model);
        if (!options_.tokenizer_from.empty() && options_.content != ExportContent::kAdapter)
          result.tokenizer_files = models::copy_tokenizer_files(options_.tokenizer_from, out_->tmp());
        out_->commit();
      });
    if (const std::optional<RankError> e = first_error(comm_, failure_.message())) throw agreed(*e);
    return result;
  }

  std::runtime_error agreed(const RankError& e) const {
    return std::runtime_error("export to " + out_dir_.string() + ": " +
                              (e.rank == rank_ ? e.message : "rank " + std::to_string(e.rank) + ": " + e.message));
  }

  Engine& engine_;
  Communicator& comm_;
  const EngineExport& options_;
  const fs::path out_dir_;
  const int rank_, world_;
  const models::ModelConfig& mc_;
  const at::ScalarType type_;
  const ExportPlan plan_;
  const uint64_t shard_bytes_;
  const std::vector<std::vector<size_t>> shards_;
  const fs::path tmp_;
  FirstFailure failure_;
  std::optional<models::ExportDirectory> out_;  // rank 0's
  int64_t mark_ = 0;         // rank 0's mark (0: it could not prepare the directory)
  bool sees_ = false;        // this rank writes into the target's temporary directory
  bool staged_own_ = false;  // a directory of this rank's own (not rank 0's), removed at the end if empty
  bool shared_ = false;      // every rank sees it
  std::vector<bool> mine_;   // by shard: this rank writes it
  std::vector<int> writer_of_item_;
  std::optional<models::ShardedSafetensorsWriter> writer_;
};

}  // namespace

ExportResult export_engine_hf(Engine& engine, Communicator& comm, const fs::path& out_arg, const EngineExport& options) {
  fs::path out_dir = out_arg.lexically_normal();
  if (!out_dir.has_filename()) out_dir = out_dir.parent_path();
  return EngineExporter(engine, comm, out_dir, options).run();
}

}  // namespace strata::engine
