// Built instead of s3_auth.cc and s3_store.cc where OpenSSL's or Boost's headers were not found
// at configure time.
#include "strata/offload/s3.h"

namespace strata::offload {

namespace {
[[noreturn]] void missing() {
  throw ObjectStoreError(ObjectStoreError::Kind::kInvalidArgument,
                         "S3: this build of Strata has no S3 driver (OpenSSL or Boost.Beast was not "
                         "found at configure time; scripts/setup.sh installs libssl-dev and "
                         "libboost-dev)");
}
}  // namespace

std::unique_ptr<ObjectStore> open_s3_store(const std::string&, const std::string&, const S3Options&) {
  missing();
}
void s3_create_bucket(const std::string&, const S3Options&) { missing(); }
S3Options s3_options_from_environment(const std::map<std::string, std::string>*, const std::string&) {
  missing();
}

}  // namespace strata::offload
