// The step driver (runtime/step_driver.h) over hand-made schedules: every use of every
// micro-batch reaches the runner in the schedule's order, numbered over the whole step as the
// coordinator counts them (Schedule::use_at), between the micro-batch's begin and end.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/step_driver.h"

namespace strata::engine::runtime {
namespace {

using layout::Schedule;
using layout::Use;

struct Recorder final : UseRunner {
  std::vector<std::string> calls;
  std::vector<size_t> ks;
  size_t throw_at = size_t(-1);  // a use whose k throws
  void begin_micro_batch(int64_t m, bool last) override {
    calls.push_back("begin " + std::to_string(m) + (last ? " last" : ""));
  }
  void end_micro_batch() override { calls.push_back("end"); }
  void forward(size_t s, size_t k) override { use("F", s, k); }
  void head(size_t s, size_t k) override { use("H", s, k); }
  void backward(size_t s, size_t k) override { use("B", s, k); }
  void use(const char* kind, size_t s, size_t k) {
    if (k == throw_at) throw std::runtime_error("use " + std::to_string(k) + " failed");
    calls.push_back(kind + std::to_string(s));
    ks.push_back(k);
  }
};

std::vector<std::string> one_micro_batch(const std::vector<std::string>& uses, int64_t m, bool last) {
  std::vector<std::string> out{"begin " + std::to_string(m) + (last ? " last" : "")};
  out.insert(out.end(), uses.begin(), uses.end());
  out.push_back("end");
  return out;
}

TEST(StepDriver, WalksAVocabularyTiledTiedScheduleInOrderOverEveryMicroBatch) {
  // Two embedding tiles (units 0, 1), two blocks (2, 3), two head tiles tied to the embedding's.
  const Schedule schedule({{0}, {1}, {2}, {3}, {0}, {1}}, 4, /*embedding_stages=*/2, /*head_stages=*/2);
  const std::vector<std::string> uses = {"F0", "F1", "F2", "F3", "F4", "H5", "B4", "B3", "B2", "B1", "B0"};
  Recorder r;
  EXPECT_EQ(run_step_uses(schedule, 3, r), 3 * uses.size());
  std::vector<std::string> want;
  for (int64_t m = 0; m < 3; ++m) {
    const auto mb = one_micro_batch(uses, m, m == 2);
    want.insert(want.end(), mb.begin(), mb.end());
  }
  EXPECT_EQ(r.calls, want);
  ASSERT_EQ(r.ks.size(), 3 * uses.size());
  for (size_t i = 0; i < r.ks.size(); ++i) EXPECT_EQ(r.ks[i], i) << "use " << i << " is use k of the step";
}

TEST(StepDriver, HandsEachUseTheIndexTheCoordinatorCountsBy) {
  // A whole head, three blocks: use k of the step is Schedule::use_at(k), micro-batch after
  // micro-batch (the coordinator's gathers and prefetch read use_at).
  const Schedule schedule({{0}, {1}, {2}, {3}, {4}}, 5);
  struct ByIndex final : UseRunner {
    const Schedule& s;
    size_t next = 0;
    explicit ByIndex(const Schedule& sch) : s(sch) {}
    void begin_micro_batch(int64_t, bool) override {}
    void end_micro_batch() override {}
    void check(Use::Kind kind, size_t stage, size_t k) {
      EXPECT_EQ(k, next++);
      EXPECT_EQ(s.use_at(k).kind, kind) << "use " << k;
      EXPECT_EQ(s.use_at(k).stage, stage) << "use " << k;
    }
    void forward(size_t st, size_t k) override { check(Use::kForward, st, k); }
    void head(size_t st, size_t k) override { check(Use::kHead, st, k); }
    void backward(size_t st, size_t k) override { check(Use::kBackward, st, k); }
  } r(schedule);
  EXPECT_EQ(run_step_uses(schedule, 4, r), 4 * schedule.uses().size());
  EXPECT_EQ(r.next, 4 * schedule.uses().size());
}

TEST(StepDriver, AFailingUseStopsTheStepThere) {
  const Schedule schedule({{0}, {1}, {2}}, 3);
  Recorder r;
  r.throw_at = 7;  // micro-batch 1's head (5 uses a micro-batch)
  EXPECT_THROW(run_step_uses(schedule, 2, r), std::runtime_error);
  EXPECT_EQ(r.calls, (std::vector<std::string>{"begin 0", "F0", "F1", "H2", "B1", "B0", "end", "begin 1 last", "F0", "F1"}));
  EXPECT_EQ(r.ks.back(), 6u) << "nothing ran after the failed use";
}

TEST(StepDriver, NoMicroBatchesRunNothing) {
  const Schedule schedule({{0}, {1}}, 2);
  Recorder r;
  EXPECT_EQ(run_step_uses(schedule, 0, r), 0u);
  EXPECT_TRUE(r.calls.empty());
}

}  // namespace
}  // namespace strata::engine::runtime
