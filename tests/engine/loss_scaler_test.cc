// The fp16 loss scale on its own: halved on a skipped step (never below 1), doubled after a
// window of good steps in a row, fixed at 1 without fp16, restored from a checkpoint's counters.
#include <gtest/gtest.h>

#include "runtime/loss_scaler.h"

namespace strata::engine::runtime {
namespace {

TEST(LossScaler, HalvesOnOverflowAndDoublesAfterAWindowOfGoodSteps) {
  LossScaler s(true, 1024, 3);
  EXPECT_EQ(s.scale(), 1024);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 1024) << "two good steps of a window of three";
  EXPECT_EQ(s.good_steps(), 2);
  s.update(true);
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.good_steps(), 0) << "an overflow starts the window again";
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.good_steps(), 0);
}

TEST(LossScaler, NeverGoesBelowOne) {
  LossScaler s(true, 4, 100);
  for (int i = 0; i < 5; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 1);
}

TEST(LossScaler, StaysAtOneWithoutFp16) {
  LossScaler s(false, 65536, 1);
  EXPECT_EQ(s.scale(), 1);
  s.update(false);
  s.update(true);
  EXPECT_EQ(s.scale(), 1);
  EXPECT_EQ(s.good_steps(), 0);
}

TEST(LossScaler, GoesOnFromRestoredCounters) {
  LossScaler s(true, 65536, 4);
  s.restore(256, 3);
  s.update(false);
  EXPECT_EQ(s.scale(), 512) << "the restored window's fourth good step";
}

}  // namespace
}  // namespace strata::engine::runtime
