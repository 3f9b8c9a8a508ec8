// The S3 driver's multipart uploads: Create/UploadPart/Complete/AbortMultipartUpload, and
// listing and aborting pending ones (the protocol is written in s3_store.cc).
#include <algorithm>
#include <map>
#include <mutex>

#include "s3_internal.h"

namespace strata::offload::s3_detail {

namespace {

class S3Upload final : public MultipartUpload {
 public:
  S3Upload(S3Store& store, std::string key, std::string upload_id)
      : store_(store), key_(std::move(key)), upload_id_(std::move(upload_id)) {}
  ~S3Upload() override {
    try {
      abort();
    } catch (...) {
    }
  }
  void put_part(int number, std::span<const std::byte> data) override;
  ObjectInfo complete() override;
  void abort() override;

 private:
  S3Store& store_;
  std::string key_;
  std::string upload_id_;
  std::mutex mu_;
  std::map<int, std::pair<std::string, uint64_t>> parts_;  // number -> (etag, bytes)
  bool finished_ = false;
};

void S3Upload::put_part(int number, std::span<const std::byte> data) {
  if (number < 1 || number > 10000) {
    throw ObjectStoreError(Kind::kInvalidArgument, "UploadPart " + store_.url_of(key_) +
                                                       ": part number " + std::to_string(number) +
                                                       " is outside 1..10000");
  }
  const Response r = store_.send(
      "UploadPart", key_, "PUT", store_.object_path(key_),
      {{"partNumber", std::to_string(number)}, {"uploadId", upload_id_}}, {}, data);
  store_.expect(r, {200}, "UploadPart", key_);
  const std::string etag = r.header("etag");
  if (etag.empty()) store_.bad_answer("UploadPart (no ETag)", key_, r);
  std::lock_guard lock(mu_);
  parts_[number] = {etag, data.size()};
}

ObjectInfo S3Upload::complete() {
  std::lock_guard lock(mu_);
  if (finished_) {
    throw ObjectStoreError(Kind::kInvalidArgument, "CompleteMultipartUpload " + store_.url_of(key_) +
                                                       ": the upload was already finished");
  }
  if (parts_.empty() || parts_.rbegin()->first != int(parts_.size())) {
    throw ObjectStoreError(Kind::kInvalidArgument,
                           "CompleteMultipartUpload " + store_.url_of(key_) + ": parts 1.." +
                               std::to_string(parts_.empty() ? 0 : parts_.rbegin()->first) +
                               " are not all there (" + std::to_string(parts_.size()) + " uploaded)");
  }
  std::string xml = "<CompleteMultipartUpload>";
  uint64_t total = 0;
  for (const auto& [number, part] : parts_) {
    xml += "<Part><PartNumber>" + std::to_string(number) + "</PartNumber><ETag>" + part.first +
           "</ETag></Part>";
    total += part.second;
  }
  xml += "</CompleteMultipartUpload>";
  const Response r = store_.send("CompleteMultipartUpload", key_, "POST", store_.object_path(key_),
                                 {{"uploadId", upload_id_}}, {{"Content-Type", "application/xml"}},
                                 std::as_bytes(std::span(xml)), /*error_in_body=*/true);
  if (r.status == 404 && r.repeated && error_info(r).code == "NoSuchUpload") {
    // The answer to an earlier attempt was lost; the upload completed then if the object is there.
    if (auto info = store_.head(key_); info && info->size == total) {
      finished_ = true;
      return *info;
    }
  }
  store_.expect(r, {200}, "CompleteMultipartUpload", key_);
  if (r.body.find("<Error>") != std::string::npos) store_.fail_status(r, "CompleteMultipartUpload", key_);
  finished_ = true;
  std::string etag;
  if (auto parsed = Xml::parse(r.body)) etag = parsed->tree.get("CompleteMultipartUploadResult.ETag", "");
  if (etag.empty()) {
    // RGW 16.2 answers Complete with an empty <ETag>; HEAD has it.
    if (auto info = store_.head(key_)) return *info;
    store_.bad_answer("CompleteMultipartUpload (the object is not there afterwards)", key_, r);
  }
  return ObjectInfo{key_, total, S3Store::unquote(etag)};
}

void S3Upload::abort() {
  std::lock_guard lock(mu_);
  if (finished_) return;
  finished_ = true;
  const Response r = store_.send("AbortMultipartUpload", key_, "DELETE", store_.object_path(key_),
                                 {{"uploadId", upload_id_}}, {}, {});
  if (r.status == 404) return;
  store_.expect(r, {200, 204}, "AbortMultipartUpload", key_);
}

}  // namespace

std::unique_ptr<MultipartUpload> S3Store::start_multipart(const std::string& key) {
  check_object_key(key);
  const Response r =
      send("CreateMultipartUpload", key, "POST", object_path(key), {{"uploads", ""}}, {}, {});
  expect(r, {200}, "CreateMultipartUpload", key);
  const auto xml = Xml::parse(r.body);
  const std::string id = xml ? xml->tree.get("InitiateMultipartUploadResult.UploadId", "") : "";
  if (id.empty()) bad_answer("CreateMultipartUpload (no UploadId)", key, r);
  return std::make_unique<S3Upload>(*this, key, id);
}

std::vector<PendingUpload> S3Store::list_multipart_uploads(const std::string& prefix) {
  std::vector<PendingUpload> out;
  const std::string full = full_key_prefix() + prefix;
  std::string key_marker, id_marker;
  for (;;) {
    Query query{{"uploads", ""}, {"prefix", full}};
    if (!key_marker.empty()) query.emplace_back("key-marker", key_marker);
    if (!id_marker.empty()) query.emplace_back("upload-id-marker", id_marker);
    const Response r = send("ListMultipartUploads", prefix, "GET", bucket_path(), query, {}, {});
    expect(r, {200}, "ListMultipartUploads", prefix);
    const auto xml = Xml::parse(r.body);
    const auto result = xml ? xml->tree.get_child_optional("ListMultipartUploadsResult") : boost::none;
    if (!result) bad_answer("ListMultipartUploads", prefix, r);
    for (const auto& [name, child] : *result) {
      if (name != "Upload") continue;
      const std::string key = child.get("Key", "");
      if (!key.starts_with(full_key_prefix())) continue;
      out.push_back({key.substr(full_key_prefix().size()), child.get("UploadId", "")});
    }
    if (result->get("IsTruncated", "false") != "true") break;
    key_marker = result->get("NextKeyMarker", "");
    id_marker = result->get("NextUploadIdMarker", "");
    if (key_marker.empty()) bad_answer("ListMultipartUploads (truncated without a next marker)", prefix, r);
  }
  std::sort(out.begin(), out.end(), [](const PendingUpload& a, const PendingUpload& b) {
    return a.key != b.key ? a.key < b.key : a.upload_id < b.upload_id;
  });
  return out;
}

void S3Store::abort_multipart_upload(const PendingUpload& upload) {
  check_object_key(upload.key);
  const Response r = send("AbortMultipartUpload", upload.key, "DELETE", object_path(upload.key),
                          {{"uploadId", upload.upload_id}}, {}, {});
  if (r.status == 404) return;  // NoSuchUpload: already gone
  expect(r, {200, 204}, "AbortMultipartUpload", upload.key);
}

}  // namespace strata::offload::s3_detail
