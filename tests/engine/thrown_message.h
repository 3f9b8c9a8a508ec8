// Shared by the engine's unit tests (partition, host device, rendezvous, configuration): the
// message of an expected exception, and whether a text contains a part of it.
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace strata::test {

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The message of the E that `fn` throws; records a failure and returns "" if it throws nothing.
// Exceptions of other types propagate (gtest reports them).
template <typename E, typename Fn>
std::string thrown_message(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return "";
}

}  // namespace strata::test
