// The S3 driver: an ObjectStore on a bucket and key prefix, over HTTP/1.1 with Boost.Beast.
//
// Protocol (how the guarantees of object_store.h are met on S3 and its look-alikes):
//   - put is one PutObject with the payload's SHA-256 signed (an S3 PUT replaces atomically);
//   - put_if_absent is PutObject with "If-None-Match: *" (412 when the key exists). When an
//     attempt was retried (its answer lost to a dropped connection or a timeout), a 412 may be
//     this call's own earlier success: the driver then reads the object and reports success
//     exactly when the bytes are this call's;
//   - get is a ranged GET; an answer shorter than asked (S3 cuts a range at the object's end) is
//     kInvalidArgument, never a short read;
//   - list is ListObjectsV2 with continuation tokens, list_page_keys per page;
//   - a multipart upload is Create/UploadPart/Complete/AbortMultipartUpload. A 200 answer to
//     Complete that carries an <Error> is an error (S3 sends those). An empty ETag in Complete's
//     answer (RGW 16.2 does that) is filled in with a HEAD. A Complete retried after its answer
//     was lost may find the upload gone (NoSuchUpload): it then counts as done when HEAD shows an
//     object of the parts' total size;
//   - retries: network errors, timeouts, HTTP 5xx and 429, and the codes SlowDown,
//     RequestTimeout, InternalError and ConditionalRequestConflict are retried up to
//     max_attempts times with full-jitter exponential backoff; each attempt is signed afresh.
//     A request on a pooled keep-alive connection that the server closed meanwhile is resent
//     once on a new connection without counting as an attempt;
//   - threads: the store holds a pool of idle connections; a request takes one (or opens one),
//     drives it on the calling thread with its own io_context (a deadline timer per operation),
//     and puts it back when the answer allowed keep-alive. Any number of threads may call at once;
//     concurrency is the callers' (put_object / get_object run parts on several threads).
//
// This file: the store's operations and requests (signing, retries, error classification). The
// HTTP layer is s3_http.cc, the multipart upload s3_multipart.cc, what they share s3_internal.h.
#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "s3_internal.h"

namespace strata::offload::s3_detail {

S3ErrorInfo error_info(const Response& r) {
  S3ErrorInfo info;
  info.request_id = r.header("x-amz-request-id");
  if (auto xml = Xml::parse(r.body)) {
    if (auto error = xml->tree.get_child_optional("Error")) {
      info.code = error->get("Code", "");
      info.message = error->get("Message", "");
      if (info.request_id.empty()) info.request_id = error->get("RequestId", "");
    }
  }
  if (info.code.empty()) {
    switch (r.status) {
      case 403: info.code = "AccessDenied"; break;
      case 404: info.code = "NotFound"; break;
      case 412: info.code = "PreconditionFailed"; break;
      default: break;
    }
  }
  return info;
}

bool retryable(int status, const std::string& code) {
  return status >= 500 || status == 429 || code == "SlowDown" || code == "RequestTimeout" ||
         code == "InternalError" || code == "ConditionalRequestConflict";
}

Kind kind_of(int status, const std::string& code) {
  if (code == "QuotaExceeded" || code == "EntityTooLarge" || code == "InsufficientCapacity") {
    return Kind::kNoSpace;
  }
  if (status == 404) return Kind::kNotFound;
  if (status == 403 || status == 401) return Kind::kAccessDenied;
  if (status == 412) return Kind::kPreconditionFailed;
  if (status == 400 || status == 416 || status == 411) return Kind::kInvalidArgument;
  if (status >= 500 || status == 429) return Kind::kUnavailable;
  return Kind::kOther;
}

std::chrono::milliseconds backoff(const S3Options& o, int attempt) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const double cap = std::min<double>(static_cast<double>(o.backoff_cap.count()),
                                      static_cast<double>(o.backoff_base.count()) *
                                          static_cast<double>(1ull << std::min(attempt, 20)));
  return std::chrono::milliseconds(
      static_cast<int64_t>(std::uniform_real_distribution<double>(0, cap)(rng)));
}

S3Store::S3Store(std::string bucket, std::string prefix, S3Options options)
    : bucket_(std::move(bucket)), prefix_(std::move(prefix)), options_(std::move(options)),
      endpoint_(parse_endpoint(options_.endpoint)), pool_(endpoint_, options_) {
  if (options_.unsigned_payload && !endpoint_.tls) {
    throw ObjectStoreError(Kind::kInvalidArgument,
                           "S3: unsigned payloads need https; " + options_.endpoint + " is http");
  }
  if (options_.max_attempts < 1) options_.max_attempts = 1;
  const bool amazon = endpoint_.host.ends_with(".amazonaws.com");
  virtual_hosted_ = options_.addressing == S3Options::Addressing::kVirtual ||
                    (options_.addressing == S3Options::Addressing::kAuto && amazon &&
                     bucket_.find('.') == std::string::npos);
}

void S3Store::put(const std::string& key, std::span<const std::byte> data) {
  check_object_key(key);
  expect(send("PutObject", key, "PUT", object_path(key), {}, {}, data), {200}, "PutObject", key);
}

bool S3Store::put_if_absent(const std::string& key, std::span<const std::byte> data) {
  check_object_key(key);
  const Response r =
      send("PutObject", key, "PUT", object_path(key), {}, {{"If-None-Match", "*"}}, data);
  if (r.status == 200) return true;
  if (r.status != 412) expect(r, {200}, "PutObject (create-only)", key);
  if (!r.repeated) return false;
  // A retried create-only write: the earlier attempt may have been the one that created it.
  const auto info = head(key);
  if (!info || info->size != data.size()) return false;
  std::vector<std::byte> now(data.size());
  get(key, 0, now);
  return std::equal(now.begin(), now.end(), data.begin(), data.end());
}

std::optional<ObjectInfo> S3Store::head(const std::string& key) {
  check_object_key(key);
  const Response r = send("HeadObject", key, "HEAD", object_path(key), {}, {}, {});
  if (r.status == 404) return std::nullopt;
  expect(r, {200}, "HeadObject", key);
  return ObjectInfo{key, std::stoull(r.header("content-length").empty() ? "0" : r.header("content-length")),
                    unquote(r.header("etag"))};
}

void S3Store::get(const std::string& key, uint64_t offset, std::span<std::byte> out) {
  check_object_key(key);
  if (out.empty()) {
    const auto info = head(key);
    if (!info) fail_not_found("GetObject", key);
    if (offset > info->size) past_end(key, offset, 0, std::to_string(info->size));
    return;
  }
  const std::string range =
      "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + out.size() - 1);
  const Response r = send("GetObject", key, "GET", object_path(key), {}, {{"Range", range}}, {}, false, out);
  if (r.status == 416) past_end(key, offset, out.size(), total_of(r.header("content-range")));
  expect(r, {200, 206}, "GetObject", key);
  if (r.body_in_destination) {
    // A whole object (200) is only right when the range was all of it from the start.
    if (r.status == 200 && offset != 0) past_end(key, offset, out.size(), total_of(r.header("content-range")));
    return;
  }
  if (r.body.size() != out.size() || (r.status == 200 && offset != 0)) {
    past_end(key, offset, out.size(), total_of(r.header("content-range")));
  }
  std::memcpy(out.data(), r.body.data(), out.size());
}

std::vector<ObjectInfo> S3Store::list(const std::string& prefix) {
  std::vector<ObjectInfo> out;
  const std::string full = full_key_prefix() + prefix;
  std::string token;
  for (;;) {
    Query query{{"list-type", "2"}, {"prefix", full},
                {"max-keys", std::to_string(std::max(1, options_.list_page_keys))}};
    if (!token.empty()) query.emplace_back("continuation-token", token);
    const Response r = send("ListObjectsV2", prefix, "GET", bucket_path(), query, {}, {});
    expect(r, {200}, "ListObjectsV2", prefix);
    const auto xml = Xml::parse(r.body);
    const auto result = xml ? xml->tree.get_child_optional("ListBucketResult") : boost::none;
    if (!result) bad_answer("ListObjectsV2", prefix, r);
    for (const auto& [name, child] : *result) {
      if (name != "Contents") continue;
      const std::string key = child.get("Key", "");
      if (!key.starts_with(full_key_prefix())) continue;
      out.push_back(ObjectInfo{key.substr(full_key_prefix().size()), child.get<uint64_t>("Size", 0),
                               unquote(child.get("ETag", ""))});
    }
    if (result->get("IsTruncated", "false") != "true") break;
    token = result->get("NextContinuationToken", "");
    if (token.empty()) bad_answer("ListObjectsV2 (truncated without a continuation token)", prefix, r);
  }
  std::sort(out.begin(), out.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
  return out;
}

void S3Store::remove(const std::string& key) {
  check_object_key(key);
  const Response r = send("DeleteObject", key, "DELETE", object_path(key), {}, {}, {});
  if (r.status == 404) return;
  expect(r, {200, 204}, "DeleteObject", key);
}

Response S3Store::send(const char* op, const std::string& key, const std::string& method,
                       const std::string& path, const Query& query, const Headers& headers,
                       std::span<const std::byte> body, bool error_in_body, std::span<std::byte> into) {
  const std::string host = virtual_hosted_ ? bucket_ + "." + host_header() : host_header();
  std::string target = s3_uri_encode(path, true);
  for (size_t i = 0; i < query.size(); ++i) {
    target += (i ? "&" : "?") + s3_uri_encode(query[i].first, false) + "=" +
              s3_uri_encode(query[i].second, false);
  }
  const std::string payload_hash = options_.unsigned_payload
                                       ? "UNSIGNED-PAYLOAD"
                                       : sha256_hex(body.data(), body.size());
  std::string last_error;
  int last_status = 0;
  S3ErrorInfo last_info;
  bool resent_stale = false;
  int sends = 0;
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(backoff(options_, attempt - 1));
    S3Request request{method, host, path, query, headers, payload_hash};
    s3_sign(request, options_.credentials, options_.region, s3_amz_date_now());
    bool reused = false;
    try {
      ++sends;
      Response r = pool_.exchange(method, host, target, request.headers, body, &reused, into);
      r.repeated = sends > 1;
      S3ErrorInfo info;
      const bool body_error = error_in_body && r.status == 200 &&
                              r.body.find("<Error>") != std::string::npos;
      if (r.status >= 300 || body_error) info = error_info(r);
      if (!retryable(body_error ? 500 : r.status, info.code)) return r;
      last_error = describe_status(r, info);
      last_status = r.status;
      last_info = info;
    } catch (const TransportError& e) {
      if (e.permanent) {
        throw ObjectStoreError(Kind::kAccessDenied, std::string(op) + " " + url_of(key) + ": " + e.message);
      }
      // A keep-alive connection the server had closed before this request reached it: resend
      // once on a new connection, not counted as an attempt (and drop the other idle ones).
      if (reused && e.before_response && !resent_stale) {
        resent_stale = true;
        pool_.drop_idle();
        --sends;
        --attempt;
        continue;
      }
      last_error = e.message;
      last_status = 0;
      last_info = {};
    }
  }
  throw ObjectStoreError(Kind::kUnavailable,
                         std::string(op) + " " + url_of(key) + ": failed after " +
                             std::to_string(options_.max_attempts) + " attempts; last: " + last_error,
                         last_status, last_info.code, last_info.request_id);
}

[[noreturn]] void S3Store::fail_status(const Response& r, const char* op, const std::string& key) const {
  const S3ErrorInfo info = error_info(r);
  throw ObjectStoreError(kind_of(r.status, info.code),
                         std::string(op) + " " + url_of(key) + ": " + describe_status(r, info),
                         r.status, info.code, info.request_id);
}

void S3Store::expect(const Response& r, std::initializer_list<int> ok, const char* op,
                     const std::string& key) const {
  if (std::find(ok.begin(), ok.end(), r.status) == ok.end()) fail_status(r, op, key);
}

[[noreturn]] void S3Store::bad_answer(const char* op, const std::string& key, const Response& r) const {
  throw ObjectStoreError(Kind::kOther, std::string(op) + " " + url_of(key) +
                                           ": unexpected answer (HTTP " + std::to_string(r.status) +
                                           "): " + r.body.substr(0, 300),
                         r.status, "", r.header("x-amz-request-id"));
}

std::string S3Store::describe_status(const Response& r, const S3ErrorInfo& info) {
  std::string text = "HTTP " + std::to_string(r.status);
  if (!info.code.empty()) text += " " + info.code;
  if (!info.message.empty()) text += " (" + info.message + ")";
  if (!info.request_id.empty()) text += ", request id " + info.request_id;
  return text;
}

[[noreturn]] void S3Store::fail_not_found(const char* op, const std::string& key) const {
  throw ObjectStoreError(Kind::kNotFound, std::string(op) + " " + url_of(key) + ": no such key",
                         404, "NoSuchKey");
}

[[noreturn]] void S3Store::past_end(const std::string& key, uint64_t offset, uint64_t size,
                                    const std::string& total) const {
  throw ObjectStoreError(Kind::kInvalidArgument,
                         "GetObject " + url_of(key) + ": bytes [" + std::to_string(offset) + ", " +
                             std::to_string(offset + size) + ") are past the end of a " +
                             (total.empty() ? std::string("shorter") : total + "-byte") + " object");
}

std::string S3Store::total_of(const std::string& content_range) {
  const size_t slash = content_range.rfind('/');
  return slash == std::string::npos ? "" : content_range.substr(slash + 1);
}

}  // namespace strata::offload::s3_detail

namespace strata::offload {

using s3_detail::error_info;
using s3_detail::Kind;
using s3_detail::Response;
using s3_detail::S3Store;

std::unique_ptr<ObjectStore> open_s3_store(const std::string& bucket, const std::string& prefix,
                                           const S3Options& options) {
  if (bucket.empty()) throw ObjectStoreError(Kind::kInvalidArgument, "S3: empty bucket name");
  if (!prefix.empty()) check_object_key(prefix);
  return std::make_unique<S3Store>(bucket, prefix, options);
}

void s3_create_bucket(const std::string& bucket, const S3Options& options) {
  S3Options path_style = options;
  path_style.addressing = S3Options::Addressing::kPath;
  S3Store store(bucket, "", path_style);
  const Response r = store.send("CreateBucket", "", "PUT", "/" + bucket, {}, {}, {});
  if (r.status == 200) return;
  if (r.status == 409 && error_info(r).code == "BucketAlreadyOwnedByYou") return;
  store.fail_status(r, "CreateBucket", "");
}

}  // namespace strata::offload
