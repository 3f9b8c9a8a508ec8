// The node-local load's exchange in bounded rounds of all-to-all (exchange.h).
#include "checkpoint/exchange.h"

#include "checkpoint/commit.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace strata::engine::ckpt {

ExchangeLimits ExchangeLimits::agreed(Communicator& comm) {
  ExchangeLimits l;
  const char* mine = comm.rank() == 0 ? std::getenv("STRATA_EXCHANGE_BYTES") : nullptr;
  const std::string given = broadcast_string(comm, mine ? mine : "", 0);
  if (given.empty()) return l;
  const char* v = given.c_str();
  char* end = nullptr;
  const unsigned long long bytes = std::strtoull(v, &end, 10);
  if (*end != '\0' || bytes < 16)
    throw std::invalid_argument(std::string("STRATA_EXCHANGE_BYTES must be a whole number of bytes, at least 16: \"") +
                                v + "\"");
  l.read_bytes = bytes / 4;
  l.send_bytes = bytes / 4;
  l.receive_bytes = bytes - l.read_bytes - l.send_bytes;
  return l;
}

ExchangePlan plan_exchange(std::vector<ExchangeNeed> needs, const std::function<int(const Chunk&)>& server, int world,
                           const ExchangeLimits& limits) {
  std::sort(needs.begin(), needs.end(), [](const ExchangeNeed& a, const ExchangeNeed& b) {
    if (!(a.chunk == b.chunk)) return a.chunk < b.chunk;
    return a.from != b.from ? a.from < b.from : a.owner < b.owner;
  });
  ExchangePlan plan;
  plan.server.resize(needs.size());
  plan.round.resize(needs.size());
  // Each rank's latest round and what it holds there, per role.
  struct Fill {
    uint32_t round = 0;
    uint64_t bytes = 0;
  };
  std::vector<Fill> reads(static_cast<size_t>(world)), sends(reads), receipts(reads);
  std::vector<std::pair<int, uint64_t>> owners;  // of one chunk, other than its server: bytes each
  for (size_t b = 0; b < needs.size();) {
    size_t e = b;
    while (e < needs.size() && needs[e].chunk == needs[b].chunk) ++e;
    const Chunk& c = needs[b].chunk;
    const int q = server(c);
    if (q < 0 || q >= world) throw std::logic_error("plan_exchange: a chunk without a serving rank");
    const uint64_t read = c.numel * 4;
    uint64_t sent = 0;
    owners.clear();
    for (size_t i = b; i < e; ++i) {
      const ExchangeNeed& n = needs[i];
      if (n.owner < 0 || n.owner >= world || n.from < c.begin || n.from + n.numel > c.end())
        throw std::logic_error("plan_exchange: a need outside its chunk or the world");
      if (n.owner == q) continue;
      sent += n.numel * 4;
      auto it = std::find_if(owners.begin(), owners.end(), [&](const auto& o) { return o.first == n.owner; });
      if (it == owners.end()) owners.push_back({n.owner, n.numel * 4});
      else it->second += n.numel * 4;
    }
    uint32_t r = std::max(reads[size_t(q)].round, sends[size_t(q)].round);
    for (const auto& [p, bytes] : owners) r = std::max(r, receipts[size_t(p)].round);
    // Whether the chunk fits round r: nobody's share goes over its bound, unless it held
    // nothing there yet (a chunk larger than a bound goes alone). Round r + 1 is empty for every
    // rank involved, so it fits there.
    const auto fits = [&](uint32_t t) {
      const auto ok = [&](const Fill& f, uint64_t add, uint64_t cap) {
        const uint64_t have = f.round == t ? f.bytes : 0;
        return have == 0 || have + add <= cap;
      };
      if (!ok(reads[size_t(q)], read, limits.read_bytes) || !ok(sends[size_t(q)], sent, limits.send_bytes)) return false;
      for (const auto& [p, bytes] : owners)
        if (!ok(receipts[size_t(p)], bytes, limits.receive_bytes)) return false;
      return true;
    };
    if (!fits(r)) ++r;
    const auto add = [&](Fill& f, uint64_t bytes) {
      if (f.round != r) f = {r, 0};
      f.bytes += bytes;
    };
    add(reads[size_t(q)], read);
    add(sends[size_t(q)], sent);
    for (const auto& [p, bytes] : owners) add(receipts[size_t(p)], bytes);
    for (size_t i = b; i < e; ++i) plan.server[i] = q, plan.round[i] = r;
    plan.rounds = std::max(plan.rounds, r + 1);
    b = e;
  }
  plan.needs = std::move(needs);
  return plan;
}

void exchange_slices(Communicator& comm, ChunkReader& reader, LoadFailure& failure, const ExchangePlan& plan,
                     const at::Tensor& slice) {
  const int me = comm.rank(), world = comm.world_size();
  const std::vector<ExchangeNeed>& needs = plan.needs;
  // This rank's part of each round: the needs it serves (its own among them), and those it
  // receives from others, each in plan order.
  std::vector<std::vector<size_t>> served(plan.rounds), received(plan.rounds);
  for (size_t i = 0; i < needs.size(); ++i) {
    if (plan.server[i] == me) served[plan.round[i]].push_back(i);
    else if (needs[i].owner == me) received[plan.round[i]].push_back(i);
  }
  const auto floats = [](uint64_t n) { return n > 0 ? aligned_floats(int64_t(n)) : at::empty({0}, at::kFloat); };
  for (uint32_t t = 0; t < plan.rounds; ++t) {
    // The chunks this rank serves in this round, each read once into `area`.
    std::vector<uint64_t> chunk_at(served[t].size());
    std::vector<ChunkReader::Request> reads;
    uint64_t area_numel = 0;
    for (size_t j = 0; j < served[t].size(); ++j) {
      const Chunk& c = needs[served[t][j]].chunk;
      if (j == 0 || !(c == needs[served[t][j - 1]].chunk)) {
        reads.push_back({c, nullptr});
        area_numel += c.numel;
      }
      chunk_at[j] = area_numel - c.numel;
    }
    const at::Tensor area = floats(area_numel);
    for (size_t j = 0, x = 0; j < served[t].size(); ++j)
      if (j == 0 || !(needs[served[t][j]].chunk == needs[served[t][j - 1]].chunk))
        reads[x++].dst = area.data_ptr<float>() + chunk_at[j];
    if (!reads.empty()) failure.attempt([&] { reader.read(reads, reads.size()); });

    // To each other rank, in rank order, its pieces in plan order.
    std::vector<size_t> sending;
    for (size_t j = 0; j < served[t].size(); ++j)
      if (needs[served[t][j]].owner != me) sending.push_back(j);
    std::stable_sort(sending.begin(), sending.end(),
                     [&](size_t a, size_t b) { return needs[served[t][a]].owner < needs[served[t][b]].owner; });
    std::vector<int64_t> send_counts(size_t(world), 0), receive_counts(size_t(world), 0);
    uint64_t send_numel = 0;
    for (size_t j : sending) send_numel += needs[served[t][j]].numel;
    const at::Tensor send = floats(send_numel);
    float* out = send.data_ptr<float>();
    for (size_t j : sending) {
      const ExchangeNeed& n = needs[served[t][j]];
      send_counts[size_t(n.owner)] += int64_t(n.numel);
      if (failure.failed()) std::memset(out, 0, n.numel * 4);  // nothing half read travels
      else std::memcpy(out, area.data_ptr<float>() + chunk_at[j] + (n.from - n.chunk.begin), n.numel * 4);
      out += n.numel;
    }
    std::vector<size_t> receiving = received[t];
    std::stable_sort(receiving.begin(), receiving.end(),
                     [&](size_t a, size_t b) { return plan.server[a] < plan.server[b]; });
    uint64_t receive_numel = 0;
    for (size_t i : receiving) {
      receive_counts[size_t(plan.server[i])] += int64_t(needs[i].numel);
      receive_numel += needs[i].numel;
    }
    const at::Tensor receive = floats(receive_numel);
    comm.all_to_all(receive, receive_counts, send, send_counts)->wait();
    if (failure.failed() || !slice.defined()) continue;

    // This rank's own pieces from what it read, then the others' as they came (a failed copy, to
    // a device say, is kept like a failed read: the rounds go on).
    failure.attempt([&] {
      for (size_t j = 0; j < served[t].size(); ++j) {
        const ExchangeNeed& n = needs[served[t][j]];
        if (n.owner == me)
          slice.narrow(0, int64_t(n.to), int64_t(n.numel))
              .copy_(area.narrow(0, int64_t(chunk_at[j] + (n.from - n.chunk.begin)), int64_t(n.numel)));
      }
      int64_t at = 0;
      for (size_t i : receiving) {
        const ExchangeNeed& n = needs[i];
        slice.narrow(0, int64_t(n.to), int64_t(n.numel)).copy_(receive.narrow(0, at, int64_t(n.numel)));
        at += int64_t(n.numel);
      }
    });
  }
}

}  // namespace strata::engine::ckpt
