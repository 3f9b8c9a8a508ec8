// The conformance suite every ObjectStore driver passes (object_store.h states the contract).
// A driver's test file instantiates it:
//   INSTANTIATE_TEST_SUITE_P(File, ObjectStoreConformance, ::testing::Values(StoreMaker{...}));
// The oracle is the data: everything written is read back and compared byte for byte.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>

#include "strata/offload/object_store.h"

namespace strata::offload::test {

struct StoreMaker {
  std::string name;
  // A fresh, empty store; `tag` is unique per call (a directory or key-prefix name).
  std::function<std::unique_ptr<ObjectStore>(const std::string& tag)> make;
  // How many concurrent create-only writers the store is asked to arbitrate.
  int racers = 8;
};

inline std::string PrintToString(const StoreMaker& m) { return m.name; }

class ObjectStoreConformance : public ::testing::TestWithParam<StoreMaker> {
 protected:
  std::unique_ptr<ObjectStore> fresh();
};

}  // namespace strata::offload::test
