// The file driver through the conformance suite, its own rules, and the S3 options' sources
// (no server needed for those).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "object_store_conformance.h"
#include "strata/offload/s3.h"
#include "test_util.h"

namespace strata::offload {
namespace {

using strata::test::TempDir;
using test::ObjectStoreConformance;
using Kind = ObjectStoreError::Kind;

TempDir& root() {
  static TempDir dir;
  return dir;
}

INSTANTIATE_TEST_SUITE_P(
    File, ObjectStoreConformance,
    ::testing::Values(test::StoreMaker{
        "file", [](const std::string& tag) { return open_file_store((root() / tag).string()); }, 16}),
    [](const auto& info) { return info.param.name; });

TEST(FileStore, TemporariesAreNeverListedAndTheirDirectoryIsNotAKey) {
  TempDir dir;
  auto store = open_object_store(dir.path().string());
  EXPECT_EQ(store->url(), dir.path().string());
  store->put("a", std::as_bytes(std::span("x", 1)));
  auto upload = store->start_multipart("b");
  upload->put_part(1, std::as_bytes(std::span("y", 1)));
  ASSERT_EQ(store->list("").size(), 1u);
  EXPECT_TRUE(std::filesystem::is_directory(dir / ".strata-tmp"));
  try {
    store->put(".strata-tmp/x", std::as_bytes(std::span("x", 1)));
    FAIL() << "a key in the store's own directory was accepted";
  } catch (const ObjectStoreError& e) {
    EXPECT_EQ(e.kind(), Kind::kInvalidArgument);
  }
}

TEST(FileStore, AKeyThatIsAlsoADirectoryIsAnErrorNamingBoth) {
  TempDir dir;
  auto store = open_file_store(dir.path().string());
  store->put("a/b", std::as_bytes(std::span("x", 1)));
  try {
    store->put("a/b/c", std::as_bytes(std::span("x", 1)));
    FAIL() << "a key under an object was accepted";
  } catch (const ObjectStoreError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot also be a directory"), std::string::npos) << e.what();
  }
}

TEST(ObjectStoreUrl, S3UrlsNeedABucket) {
  EXPECT_TRUE(is_s3_url("s3://bucket/prefix"));
  EXPECT_FALSE(is_s3_url("/data/s3://x"));
  try {
    open_object_store("s3:///prefix");
    FAIL();
  } catch (const ObjectStoreError& e) {
    EXPECT_EQ(e.kind(), Kind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("s3://bucket[/prefix]"), std::string::npos) << e.what();
  }
}

#if STRATA_HAVE_S3
// --- where the S3 options come from ---

void write(const std::filesystem::path& p, const std::string& text) {
  std::filesystem::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

TEST(S3Options, EnvironmentVariablesComeFirst) {
  TempDir home;
  write(home / ".aws/credentials", "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n");
  std::map<std::string, std::string> env = {{"AWS_ACCESS_KEY_ID", "ENVKEY"},
                                            {"AWS_SECRET_ACCESS_KEY", "ENVSECRET"},
                                            {"AWS_SESSION_TOKEN", "TOKEN"},
                                            {"AWS_REGION", "eu-west-3"},
                                            {"AWS_ENDPOINT_URL", "http://127.0.0.1:9000/"}};
  const S3Options o = s3_options_from_environment(&env, home.path().string());
  EXPECT_EQ(o.credentials.access_key_id, "ENVKEY");
  EXPECT_EQ(o.credentials.secret_access_key, "ENVSECRET");
  EXPECT_EQ(o.credentials.session_token, "TOKEN");
  EXPECT_EQ(o.region, "eu-west-3");
  EXPECT_EQ(o.endpoint, "http://127.0.0.1:9000");
  env["AWS_ENDPOINT_URL_S3"] = "https://s3.example.com";
  env["AWS_CA_BUNDLE"] = "/etc/corp-ca.pem";
  const S3Options o2 = s3_options_from_environment(&env, home.path().string());
  EXPECT_EQ(o2.endpoint, "https://s3.example.com");
  EXPECT_EQ(o2.ca_bundle, "/etc/corp-ca.pem");
}

TEST(S3Options, ProfilesFromTheSharedFiles) {
  TempDir home;
  write(home / ".aws/credentials",
        "# comment\n[default]\naws_access_key_id = DEFKEY\naws_secret_access_key = DEFSECRET\n"
        "[work]\naws_access_key_id=WORKKEY\naws_secret_access_key=WORKSECRET\naws_session_token = T\n");
  write(home / ".aws/config",
        "[default]\nregion = us-west-2\n[profile work]\nregion = ap-south-1\n"
        "endpoint_url = http://minio.local:9000\ns3 =\n  addressing_style = path\n"
        "[profile cfgonly]\naws_access_key_id = CFGKEY\naws_secret_access_key = CFGSECRET\n");
  std::map<std::string, std::string> env;
  S3Options o = s3_options_from_environment(&env, home.path().string());
  EXPECT_EQ(o.credentials.access_key_id, "DEFKEY");
  EXPECT_EQ(o.region, "us-west-2");
  EXPECT_EQ(o.endpoint, "https://s3.us-west-2.amazonaws.com");
  env["AWS_PROFILE"] = "work";
  o = s3_options_from_environment(&env, home.path().string());
  EXPECT_EQ(o.credentials.access_key_id, "WORKKEY");
  EXPECT_EQ(o.credentials.session_token, "T");
  EXPECT_EQ(o.region, "ap-south-1");
  EXPECT_EQ(o.endpoint, "http://minio.local:9000");
  env["AWS_PROFILE"] = "cfgonly";
  EXPECT_EQ(s3_options_from_environment(&env, home.path().string()).credentials.access_key_id, "CFGKEY");
  env["AWS_DEFAULT_REGION"] = "sa-east-1";
  EXPECT_EQ(s3_options_from_environment(&env, home.path().string()).region, "sa-east-1");
  // Other file locations.
  TempDir elsewhere;
  write(elsewhere / "creds", "[default]\naws_access_key_id = MOVED\naws_secret_access_key = S\n");
  std::map<std::string, std::string> moved = {{"AWS_SHARED_CREDENTIALS_FILE", (elsewhere / "creds").string()}};
  EXPECT_EQ(s3_options_from_environment(&moved, home.path().string()).credentials.access_key_id, "MOVED");
}

TEST(S3Options, MissingOrBadSettingsSayWhatToDo) {
  TempDir home;
  std::map<std::string, std::string> env;
  try {
    s3_options_from_environment(&env, home.path().string());
    FAIL();
  } catch (const ObjectStoreError& e) {
    EXPECT_NE(std::string(e.what()).find("AWS_ACCESS_KEY_ID"), std::string::npos) << e.what();
  }
  env = {{"AWS_ACCESS_KEY_ID", "K"}};
  EXPECT_THROW(s3_options_from_environment(&env, home.path().string()), ObjectStoreError);
  env = {{"AWS_ACCESS_KEY_ID", "K"}, {"AWS_SECRET_ACCESS_KEY", "S"}, {"AWS_ENDPOINT_URL", "ftp://x"}};
  EXPECT_THROW(s3_options_from_environment(&env, home.path().string()), ObjectStoreError);
  env = {{"AWS_ACCESS_KEY_ID", "K"}, {"AWS_SECRET_ACCESS_KEY", "S"}, {"STRATA_S3_ADDRESSING", "sideways"}};
  EXPECT_THROW(s3_options_from_environment(&env, home.path().string()), ObjectStoreError);
  env["STRATA_S3_ADDRESSING"] = "path";
  EXPECT_EQ(s3_options_from_environment(&env, home.path().string()).addressing,
            S3Options::Addressing::kPath);
  write(home / ".aws/credentials", "[default\naws_access_key_id = X\n");
  env = {};
  EXPECT_THROW(s3_options_from_environment(&env, home.path().string()), ObjectStoreError);
}

TEST(S3Sign, UriEncodingKeepsUnreservedBytesOnly) {
  EXPECT_EQ(s3_uri_encode("a-b_c.d~e/f g+h", true), "a-b_c.d~e/f%20g%2Bh");
  EXPECT_EQ(s3_uri_encode("a/b", false), "a%2Fb");
  EXPECT_EQ(s3_uri_encode("ü", false), "%C3%BC");
}

#endif  // STRATA_HAVE_S3

}  // namespace
}  // namespace strata::offload
