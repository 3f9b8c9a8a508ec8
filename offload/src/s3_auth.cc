// SigV4 signing and where the S3 options come from (s3.h states the rules).
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>

#include "strata/offload/s3.h"

extern char** environ;

namespace strata::offload {

namespace {

using Kind = ObjectStoreError::Kind;

std::string to_hex(const unsigned char* bytes, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[bytes[i] >> 4];
    out[2 * i + 1] = digits[bytes[i] & 15];
  }
  return out;
}

std::string hmac_sha256(std::string_view key, std::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &n);
  return std::string(reinterpret_cast<const char*>(out), n);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Header values are trimmed and runs of spaces collapsed (SigV4's canonical form).
std::string canonical_value(const std::string& value) {
  std::string out;
  bool space = false;
  for (char c : value) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

using Ini = std::map<std::string, std::map<std::string, std::string>>;

// The AWS profile files: "[section]" lines and "key = value" lines; '#' and ';' start comments.
// Indented lines (nested settings such as "s3 =\n  addressing_style = path") are skipped.
Ini read_ini(const std::string& path) {
  Ini ini;
  std::ifstream in(path);
  if (!in) return ini;
  std::string line, section;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && (line[0] == ' ' || line[0] == '\t')) continue;
    const std::string t = trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t.front() == '[') {
      if (t.back() != ']') {
        throw ObjectStoreError(Kind::kInvalidArgument, path + ":" + std::to_string(number) +
                                                           ": malformed section header '" + t + "'");
      }
      section = trim(t.substr(1, t.size() - 2));
      continue;
    }
    const size_t eq = t.find('=');
    if (eq == std::string::npos || section.empty()) continue;
    ini[section][lower(trim(t.substr(0, eq)))] = trim(t.substr(eq + 1));
  }
  return ini;
}

}  // namespace

std::string sha256_hex(const void* data, size_t size) {
  unsigned char out[SHA256_DIGEST_LENGTH];
  SHA256(static_cast<const unsigned char*>(data), size, out);
  return to_hex(out, sizeof out);
}

std::string s3_uri_encode(std::string_view text, bool keep_slash) {
  static const char* digits = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += digits[c >> 4];
      out += digits[c & 15];
    }
  }
  return out;
}

std::string s3_amz_date_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm {};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

void s3_sign(S3Request& request, const S3Credentials& credentials, const std::string& region,
             const std::string& amz_date) {
  request.headers["x-amz-date"] = amz_date;
  request.headers["x-amz-content-sha256"] = request.payload_sha256;
  if (!credentials.session_token.empty()) {
    request.headers["x-amz-security-token"] = credentials.session_token;
  }
  std::map<std::string, std::string> canonical;  // sorted by lower-case name
  canonical["host"] = request.host;
  for (const auto& [name, value] : request.headers) canonical[lower(name)] = canonical_value(value);

  std::vector<std::pair<std::string, std::string>> query;
  for (const auto& [name, value] : request.query) {
    query.emplace_back(s3_uri_encode(name, false), s3_uri_encode(value, false));
  }
  std::sort(query.begin(), query.end());

  std::string creq = request.method + "\n" +
                     s3_uri_encode(request.path.empty() ? "/" : request.path, true) + "\n";
  for (size_t i = 0; i < query.size(); ++i) {
    creq += (i ? "&" : "") + query[i].first + "=" + query[i].second;
  }
  creq += "\n";
  std::string signed_headers;
  for (const auto& [name, value] : canonical) {
    creq += name + ":" + value + "\n";
    signed_headers += (signed_headers.empty() ? "" : ";") + name;
  }
  creq += "\n" + signed_headers + "\n" + request.payload_sha256;

  const std::string date = amz_date.substr(0, 8);
  const std::string scope = date + "/" + region + "/s3/aws4_request";
  const std::string to_sign = "AWS4-HMAC-SHA256\n" + amz_date + "\n" + scope + "\n" +
                              sha256_hex(creq.data(), creq.size());
  std::string key = hmac_sha256("AWS4" + credentials.secret_access_key, date);
  key = hmac_sha256(key, region);
  key = hmac_sha256(key, "s3");
  key = hmac_sha256(key, "aws4_request");
  const std::string signature = hmac_sha256(key, to_sign);
  request.headers["Authorization"] =
      "AWS4-HMAC-SHA256 Credential=" + credentials.access_key_id + "/" + scope +
      ", SignedHeaders=" + signed_headers + ", Signature=" +
      to_hex(reinterpret_cast<const unsigned char*>(signature.data()), signature.size());
}

S3Options s3_options_from_environment(const std::map<std::string, std::string>* env_in,
                                      const std::string& home_in) {
  std::map<std::string, std::string> process_env;
  if (!env_in) {
    for (char** e = environ; e && *e; ++e) {
      const std::string entry = *e;
      const size_t eq = entry.find('=');
      if (eq != std::string::npos) process_env[entry.substr(0, eq)] = entry.substr(eq + 1);
    }
    env_in = &process_env;
  }
  const auto& env = *env_in;
  auto var = [&](const char* name) -> std::string {
    const auto it = env.find(name);
    return it == env.end() ? "" : it->second;
  };
  const std::string home = home_in.empty() ? var("HOME") : home_in;
  std::string profile = var("AWS_PROFILE");
  if (profile.empty()) profile = var("AWS_DEFAULT_PROFILE");
  if (profile.empty()) profile = "default";

  std::string credentials_path = var("AWS_SHARED_CREDENTIALS_FILE");
  if (credentials_path.empty() && !home.empty()) credentials_path = home + "/.aws/credentials";
  std::string config_path = var("AWS_CONFIG_FILE");
  if (config_path.empty() && !home.empty()) config_path = home + "/.aws/config";
  const Ini credentials_file = credentials_path.empty() ? Ini{} : read_ini(credentials_path);
  const Ini config_file = config_path.empty() ? Ini{} : read_ini(config_path);
  // In the config file a profile other than "default" is "[profile NAME]".
  const std::string config_section = profile == "default" ? profile : "profile " + profile;
  auto from = [](const Ini& ini, const std::string& section, const char* key) -> std::string {
    const auto s = ini.find(section);
    if (s == ini.end()) return "";
    const auto k = s->second.find(key);
    return k == s->second.end() ? "" : k->second;
  };

  S3Options options;
  S3Credentials& c = options.credentials;
  c.access_key_id = var("AWS_ACCESS_KEY_ID");
  c.secret_access_key = var("AWS_SECRET_ACCESS_KEY");
  c.session_token = var("AWS_SESSION_TOKEN");
  std::string credentials_source = "AWS_ACCESS_KEY_ID";
  if (c.access_key_id.empty()) {
    for (const auto& [ini, section, path] :
         {std::tuple{&credentials_file, profile, credentials_path},
          std::tuple{&config_file, config_section, config_path}}) {
      c.access_key_id = from(*ini, section, "aws_access_key_id");
      if (c.access_key_id.empty()) continue;
      c.secret_access_key = from(*ini, section, "aws_secret_access_key");
      c.session_token = from(*ini, section, "aws_session_token");
      credentials_source = path + " [" + section + "]";
      break;
    }
  }
  if (c.access_key_id.empty()) {
    throw ObjectStoreError(
        Kind::kAccessDenied,
        "S3: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give profile '" +
            profile + "' aws_access_key_id and aws_secret_access_key in " +
            (credentials_path.empty() ? std::string("~/.aws/credentials") : credentials_path) +
            " (instance metadata, SSO and credential_process are not supported)");
  }
  if (c.secret_access_key.empty()) {
    throw ObjectStoreError(Kind::kAccessDenied, "S3: an access key id but no secret access key in " +
                                                    credentials_source);
  }

  options.region = var("AWS_REGION");
  if (options.region.empty()) options.region = var("AWS_DEFAULT_REGION");
  if (options.region.empty()) options.region = from(config_file, config_section, "region");
  if (options.region.empty()) options.region = "us-east-1";

  options.endpoint = var("AWS_ENDPOINT_URL_S3");
  if (options.endpoint.empty()) options.endpoint = var("AWS_ENDPOINT_URL");
  if (options.endpoint.empty()) options.endpoint = from(config_file, config_section, "endpoint_url");
  if (options.endpoint.empty()) options.endpoint = "https://s3." + options.region + ".amazonaws.com";
  while (!options.endpoint.empty() && options.endpoint.back() == '/') options.endpoint.pop_back();
  if (!options.endpoint.starts_with("http://") && !options.endpoint.starts_with("https://")) {
    throw ObjectStoreError(Kind::kInvalidArgument,
                           "S3: endpoint '" + options.endpoint + "' must start with http:// or https://");
  }

  options.ca_bundle = var("AWS_CA_BUNDLE");
  if (options.ca_bundle.empty()) options.ca_bundle = from(config_file, config_section, "ca_bundle");

  const std::string addressing = var("STRATA_S3_ADDRESSING");
  if (addressing == "path") {
    options.addressing = S3Options::Addressing::kPath;
  } else if (addressing == "virtual") {
    options.addressing = S3Options::Addressing::kVirtual;
  } else if (!addressing.empty() && addressing != "auto") {
    throw ObjectStoreError(Kind::kInvalidArgument, "STRATA_S3_ADDRESSING='" + addressing +
                                                       "': expected path, virtual or auto");
  }
  return options;
}

}  // namespace strata::offload
