// The gradient reducer's swap writes (engine/src/runtime/gradient_reducer.h): last_write, a swap
// reduce waiting for the unit's last write, the bound on writes in flight, finish_writes and a
// failed write. The bench, whose writes a test can hold or fail: gradient_reducer_bench.h.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradient_reducer_bench.h"

namespace strata::engine::runtime {
namespace {

using namespace reducer_testing;
using namespace std::chrono_literals;

TEST(GradientReducer, ASwapReduceReadsAfterTheUnitsLastWriteAndFinishWritesWaitsForAll) {
  Bench b(grads_in(Placement::kNvme), false, offload::IoBackend::kThreadPool);
  for (size_t u = 0; u < 4; ++u) EXPECT_FALSE(b.reducer->last_write(u).valid()) << "nothing written yet";
  b.gate->hold();
  b.within("reduce(1)", [&] {
    b.reduce(1);
    b.sync();  // the write is submitted, not complete
  });
  const offload::IoFuture first = b.reducer->last_write(1);
  ASSERT_TRUE(first.valid());
  EXPECT_FALSE(first.ready()) << "held";
  EXPECT_FALSE(b.reducer->last_write(2).valid()) << "unit 2 was not reduced";
  // The next micro-batch's contribution reads the partition only once that write is done: the
  // d2h stream waits there.
  b.within("the second reduce(1)", [&] { b.reduce(1); });
  const std::shared_ptr<Event> past = b.device->record(b.device->d2h_stream());
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(past->done()) << "the read-add-write of unit 1 did not wait for its last write";
  b.gate->release();
  b.sync();
  const offload::IoFuture second = b.reducer->last_write(1);
  ASSERT_TRUE(second.valid());
  b.reducer->finish_writes();
  EXPECT_TRUE(second.ready());
  EXPECT_FALSE(b.reducer->last_write(1).valid()) << "finish_writes forgets the step's writes";
  EXPECT_TRUE(at::equal(b.accumulator(1), b.want[1]));

  // finish_writes blocks until every write is done.
  b.end_step();
  b.gate->hold();
  b.within("reduce(head), reduce(1)", [&] {
    b.reduce(kHead);
    b.reduce(1);
    b.sync();
  });
  std::vector<offload::IoFuture> writes;
  for (size_t u : {0, 1, 3}) writes.push_back(b.reducer->last_write(u));
  for (const offload::IoFuture& w : writes) EXPECT_TRUE(w.valid() && !w.ready());
  Background finish([&] { b.reducer->finish_writes(); });
  EXPECT_FALSE(finish.finished_within(100ms)) << "finish_writes returned with writes in flight";
  b.gate->release();
  finish.done.get();
  for (const offload::IoFuture& w : writes) EXPECT_TRUE(w.valid() && w.ready() && w.wait().ok());
  for (size_t u : {0, 1, 3}) EXPECT_TRUE(at::equal(b.accumulator(u), b.want[u])) << "unit " << u;
}

TEST(GradientReducer, OverTwoSwapWritesInFlightTheNextSwapReduceWaitsForTheOldest) {
  Bench b(grads_in(Placement::kNvme), false, offload::IoBackend::kThreadPool);
  b.gate->hold();
  // Three writes held (units 1, 2, 0), each submitted before the next reduce: none of those
  // reduces waits, though two and then three writes are in flight.
  for (size_t s : {1, 2, 0}) {
    b.within("reduce(" + std::to_string(s) + ") with fewer than three writes in flight", [&] {
      b.reduce(s);
      b.sync();
    });
  }
  const double waited = b.prof.step.wait_grads;
  Background fourth([&] { b.reduce(1); });  // a second micro-batch's contribution of unit 1
  EXPECT_FALSE(fourth.finished_within(100ms)) << "a fourth write went in flight without waiting";
  b.gate->release();
  fourth.done.get();
  EXPECT_GT(b.prof.step.wait_grads, waited) << "the wait counts as waiting for gradients";
  b.finish();
  for (size_t u : {0, 1, 2}) EXPECT_TRUE(at::equal(b.accumulator(u), b.want[u])) << "unit " << u;
}

TEST(GradientReducer, AFailedSwapWriteFailsFinishWritesOnceEveryOtherWriteHasEnded) {
  Bench b(grads_in(Placement::kNvme), false, offload::IoBackend::kThreadPool);
  // The embedding's gradient partition fails its writes; the others are held.
  const std::string name = "embedding.grad";  // the store's swap region: "<unit>.<kind>"
  ASSERT_TRUE(b.swap->contains(name));
  for (const offload::SwapSpace::Piece& piece : b.swap->locate(name, 0, b.swap->size(name)))
    b.gate->fail(piece.file_offset, piece.file_offset + piece.length);
  b.gate->hold();
  // The failing write has ended before the held ones are submitted.
  b.within("reduce(0)", [&] {
    b.reduce(0);
    b.sync();
  });
  const offload::IoFuture failed = b.reducer->last_write(0);
  ASSERT_TRUE(failed.valid());
  for (int i = 0; i < 200 && !failed.ready(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(failed.ready());
  EXPECT_FALSE(failed.wait().ok()) << "the injected failure";
  b.within("reduce(2), reduce(1)", [&] {
    b.reduce(2);
    b.reduce(1);
    b.sync();
  });
  const offload::IoFuture held1 = b.reducer->last_write(1), held2 = b.reducer->last_write(2);
  ASSERT_TRUE(held1.valid() && held2.valid());
  EXPECT_FALSE(held1.ready() || held2.ready());
  std::string error;
  Background finish([&] {
    try {
      b.reducer->finish_writes();
    } catch (const offload::IoError& e) {
      error = e.what();
    }
  });
  EXPECT_FALSE(finish.finished_within(100ms)) << "finish_writes rethrew before the other writes ended";
  b.gate->release();
  finish.done.get();
  EXPECT_NE(error.find(name), std::string::npos) << "finish_writes threw: \"" << error << "\"";
  EXPECT_TRUE(held1.ready() && held1.wait().ok());
  EXPECT_TRUE(held2.ready() && held2.wait().ok());
  EXPECT_NO_THROW(b.reducer->finish_writes()) << "the failure is reported once";
  for (size_t u : {1, 2}) EXPECT_TRUE(at::equal(b.accumulator(u), b.want[u])) << "unit " << u;
}

}  // namespace
}  // namespace strata::engine::runtime
