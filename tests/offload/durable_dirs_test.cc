// offload::create_directories_durably and sync_directory (file.h): what they create and refuse.
// That they fsync the right directories is checked where it matters, by recording a run's saves
// (tests/crash/crash_states.py, scenario new-root: the run creates its checkpoint root).
#include <gtest/gtest.h>

#include <fstream>

#include "strata/offload/file.h"
#include "strata/offload/io_status.h"
#include "test_util.h"

namespace strata::offload {
namespace {

using test::TempDir;

TEST(DurableDirectories, CreatesEveryMissingLevelAndAcceptsWhatExists) {
  TempDir dir;
  const auto deep = dir.path() / "a" / "b" / "c";
  create_directories_durably(deep);
  EXPECT_TRUE(std::filesystem::is_directory(deep));
  create_directories_durably(deep);  // idempotent
  create_directories_durably(dir.path() / "a" / "b" / "d" / "");  // a trailing '/'
  EXPECT_TRUE(std::filesystem::is_directory(dir.path() / "a" / "b" / "d"));
  EXPECT_NO_THROW(sync_directory(deep));
}

TEST(DurableDirectories, RefusesAFileInThePathNamingIt) {
  TempDir dir;
  std::ofstream(dir.path() / "plain") << "x";
  try {
    create_directories_durably(dir.path() / "plain");
    ADD_FAILURE() << "a file taken for a directory";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find((dir.path() / "plain").string()), std::string::npos) << e.what();
  }
  EXPECT_THROW(create_directories_durably(dir.path() / "plain" / "below"), IoError);
  EXPECT_THROW(sync_directory(dir.path() / "missing"), IoError);
}

}  // namespace
}  // namespace strata::offload
