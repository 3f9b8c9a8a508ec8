// Seeded mutation fuzzing of the safetensors reader (no libFuzzer): valid files are mutated (bit
// flips, JSON punctuation, inserted and deleted header bytes, rewritten numbers and dtypes,
// truncation, header-length changes, appended bytes) and read with parse_safetensors_header and
// SafetensorsFile. Each read must either succeed with every tensor inside the file and consistent
// with its shape, or throw SafetensorsError; anything else (another exception, a crash, a view
// outside the file) fails. Deterministic: a failure names the seed and iteration.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <typeinfo>
#include <vector>

#include "strata/models/safetensors.h"
#include "test_util.h"

namespace strata::models {
namespace {

namespace fs = std::filesystem;

constexpr int kIterations = 24000;  // mutated inputs, spread over the seeds

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

uint64_t read_le64(const std::string& s) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(s[i]);
  return n;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Valid files to start from: written by SafetensorsWriter, plus hand-made ones with gaps,
// trailing bytes and JSON order different from data order.
std::vector<std::string> seeds(const fs::path& dir) {
  std::vector<std::string> out;
  auto write = [&](const std::string& name, const std::vector<SafetensorsWriter::Spec>& specs,
                   const std::map<std::string, std::string>& meta) {
    SafetensorsWriter w(dir / name, specs, meta);
    uint64_t i = 0;
    for (const auto& s : specs) {
      uint64_t n = st_dtype_bytes(s.dtype);
      for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
      w.write(s.name, test::random_bytes(n, ++i));
    }
    w.finish();
    out.push_back(slurp(dir / name));
  };
  write("mixed.safetensors",
        {{"h.0.attn.c_attn.weight", StDType::kF32, {4, 12}},
         {"h.0.attn.c_attn.bias", StDType::kBF16, {12}},
         {"scalar", StDType::kF64, {}},
         {"empty", StDType::kF16, {0, 3}},
         {"ids", StDType::kI64, {2, 3}},
         {"mask", StDType::kBool, {5}},
         {"u8", StDType::kU8, {3, 1, 2}}},
        {{"format", "pt"}, {"note", "seed"}});
  write("single.safetensors", {{"w", StDType::kI32, {7}}}, {});
  write("none.safetensors", {}, {{"k", "v"}});
  std::vector<SafetensorsWriter::Spec> many;
  for (int i = 0; i < 40; ++i) {
    many.push_back({"layers." + std::to_string(i) + ".w", i % 2 ? StDType::kI8 : StDType::kI16,
                    {i % 5, 2}});
  }
  write("many.safetensors", many, {});
  const std::string h =
      R"({"late":{"dtype":"F16","shape":[2,2],"data_offsets":[24,32]},)"
      R"("z":{"dtype":"I64","shape":[0],"data_offsets":[8,8]},)"
      R"("early":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
      R"("__metadata__":{"a":"b","c":""}})";
  out.push_back(le64(h.size()) + h + std::string(40, '\x5a'));
  return out;
}

const char* const kNumbers[] = {
    "0", "1", "2", "7", "8", "-1", "-0", "01", "48", "1e3", "3.5", "4294967296",
    "9223372036854775807", "9223372036854775808", "18446744073709551615",
    "18446744073709551616", "99999999999999999999999", "2305843009213693952", "1.0", "-9223372036854775808"};
const std::string kTokens[] = {"{", "}", "[", "]", ",", ":", "\"", "\\", " ", "null", "true",
                               "\"F32\"", "\"BF16\"", "\"Q4\"", "\"\"", "{}", "[]", "\"dtype\"",
                                 "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", "\xff", "\xc3",
                               std::string(1, '\0')};
const char* const kDtypes[] = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8",
                               "U8", "BOOL", "F8_E4M3", "U64", "f32", ""};

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  void mutate(std::string* f) {
    switch (pick(11)) {
      case 0: flip_bit(f); break;
      case 1: set_header_byte(f); break;
      case 2: insert_in_header(f, true); break;
      case 3: insert_in_header(f, false); break;  // length field left stale
      case 4: delete_in_header(f); break;
      case 5: rewrite_number(f); break;
      case 6: rewrite_number(f); break;
      case 7: rewrite_dtype(f); break;
      case 8: truncate(f); break;
      case 9: set_header_length(f); break;
      case 10: f->append(pick(64), static_cast<char>(pick(256))); break;
    }
  }

 private:
  size_t pick(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }

  // The header's [begin, end) within the file, as far as the length field and size allow.
  std::pair<size_t, size_t> header(const std::string& f) const {
    if (f.size() < 8) return {f.size(), f.size()};
    const uint64_t n = read_le64(f);
    return {8, 8 + static_cast<size_t>(std::min<uint64_t>(n, f.size() - 8))};
  }
  void add_to_length(std::string* f, int64_t delta) {
    if (f->size() < 8) return;
    f->replace(0, 8, le64(read_le64(*f) + static_cast<uint64_t>(delta)));
  }

  void flip_bit(std::string* f) {
    if (f->empty()) return;
    (*f)[pick(f->size())] ^= static_cast<char>(1 << pick(8));
  }
  void set_header_byte(std::string* f) {
    const auto [b, e] = header(*f);
    if (b == e) return;
    static const char kChars[] = "{}[],:\"\\ -+.0123456789eE\x00\xff";
    (*f)[b + pick(e - b)] = kChars[pick(sizeof kChars - 1)];
  }
  void insert_in_header(std::string* f, bool fix_length) {
    const auto [b, e] = header(*f);
    if (f->size() < 8) return;
    const std::string tok = pick(4) == 0 ? std::string(1 + pick(8), static_cast<char>(pick(256)))
                                         : kTokens[pick(std::size(kTokens))];
    f->insert(b + pick(e - b + 1), tok);
    if (fix_length) add_to_length(f, static_cast<int64_t>(tok.size()));
  }
  void delete_in_header(std::string* f) {
    const auto [b, e] = header(*f);
    if (b == e) return;
    const size_t at = b + pick(e - b);
    const size_t len = std::min<size_t>(1 + pick(pick(2) ? 4 : 40), e - at);
    f->erase(at, len);
    if (pick(4) != 0) add_to_length(f, -static_cast<int64_t>(len));
  }
  // Replaces a run of digits (a shape entry or an offset) by an interesting number or nudges it.
  void rewrite_number(std::string* f) {
    const auto [b, e] = header(*f);
    std::vector<std::pair<size_t, size_t>> runs;
    for (size_t i = b; i < e;) {
      if (std::isdigit(static_cast<unsigned char>((*f)[i]))) {
        size_t j = i;
        while (j < e && std::isdigit(static_cast<unsigned char>((*f)[j]))) ++j;
        runs.emplace_back(i, j);
        i = j;
      } else {
        ++i;
      }
    }
    if (runs.empty()) return;
    const auto [i, j] = runs[pick(runs.size())];
    std::string rep;
    if (pick(2)) {
      rep = kNumbers[pick(std::size(kNumbers))];
    } else {
      uint64_t v = 0;
      for (size_t k = i; k < j && k < i + 18; ++k) v = v * 10 + static_cast<uint64_t>((*f)[k] - '0');
      const int64_t d = static_cast<int64_t>(pick(17)) - 8;
      rep = std::to_string(static_cast<int64_t>(v) + d);
    }
    f->replace(i, j - i, rep);
    if (pick(4) != 0) add_to_length(f, static_cast<int64_t>(rep.size()) - static_cast<int64_t>(j - i));
  }
  void rewrite_dtype(std::string* f) {
    const auto [b, e] = header(*f);
    std::vector<size_t> at;
    for (size_t p = f->find("\"dtype\":\"", b); p != std::string::npos && p < e;
         p = f->find("\"dtype\":\"", p + 1)) {
      at.push_back(p + 9);
    }
    if (at.empty()) return;
    const size_t s = at[pick(at.size())];
    const size_t q = f->find('"', s);
    if (q == std::string::npos) return;
    const std::string rep = kDtypes[pick(std::size(kDtypes))];
    const int64_t delta = static_cast<int64_t>(rep.size()) - static_cast<int64_t>(q - s);
    f->replace(s, q - s, rep);
    add_to_length(f, delta);
  }
  void truncate(std::string* f) { f->resize(pick(f->size() + 1)); }
  void set_header_length(std::string* f) {
    if (f->size() < 8) f->resize(8);
    const uint64_t n = read_le64(*f);
    const uint64_t size = f->size();
    const uint64_t choices[] = {0, 1, 2, n - 1, n + 1, n + 8, size - 8, size - 7, size,
                                100'000'000, 100'000'001, ~uint64_t{0}, uint64_t{1} << 63,
                                pick(size + 16)};
    f->replace(0, 8, le64(choices[pick(std::size(choices))]));
  }

  std::mt19937_64 rng_;
};

struct Stats {
  int header_ok = 0, header_rejected = 0, file_ok = 0, file_rejected = 0, failures = 0;
};

void report(Stats* st, const std::string& what) {
  if (++st->failures <= 10) ADD_FAILURE() << what;
}

// Invariants of a successful parse against a data section of `data_bytes`.
void check_tensors(const std::vector<TensorInfo>& ts, uint64_t data_bytes, const std::string& where,
                   Stats* st) {
  uint64_t prev_end = 0;
  for (const TensorInfo& t : ts) {
    uint64_t bytes = st_dtype_bytes(t.dtype);
    bool zero = false;
    for (int64_t d : t.shape) {
      if (d < 0) report(st, where + ": negative dimension accepted in " + t.name);
      zero |= d == 0;
    }
    if (zero) bytes = 0;
    else bytes *= t.numel();
    if (t.begin > t.end || t.end > data_bytes || t.bytes() != bytes) {
      report(st, where + ": bad tensor accepted: " + t.name);
    }
    if (t.bytes() != 0) {
      if (t.begin < prev_end) report(st, where + ": overlap accepted at " + t.name);
      prev_end = t.end;
    }
  }
}

void fuzz_one(const std::string& f, const fs::path& path, uint64_t aux, const std::string& where,
              Stats* st) {
  // parse_safetensors_header on the header as the length field delimits it, or on whatever the
  // bytes after the length field are, against the real or an arbitrary data size.
  if (f.size() >= 8) {
    const uint64_t n = read_le64(f);
    const size_t len = static_cast<size_t>(std::min<uint64_t>(n, f.size() - 8));
    const std::string text = f.substr(8, len);
    const uint64_t data_bytes = aux % 3 == 0 ? f.size() - 8 - len
                                : aux % 3 == 1 ? aux % 4096
                                               : ~uint64_t{0} - aux % 16;
    try {
      std::map<std::string, std::string> meta;
      const auto ts = parse_safetensors_header(text, data_bytes, "fuzz", &meta);
      check_tensors(ts, data_bytes, where + " (header)", st);
      ++st->header_ok;
    } catch (const SafetensorsError&) {
      ++st->header_rejected;
    } catch (const std::exception& e) {
      report(st, where + " (header): " + typeid(e).name() + ": " + e.what());
    } catch (...) {
      report(st, where + " (header): unknown exception");
    }
  }

  spit(path, f);
  try {
    SafetensorsFile file(path);
    const uint64_t data_offset = 8 + read_le64(f);
    check_tensors(file.tensors(), f.size() - data_offset, where, st);
    for (const TensorInfo& t : file.tensors()) {
      const TensorView v = file.get(t.name);
      if (v.info != &t || v.data.size() != t.bytes() ||
          data_offset + t.end > f.size() ||
          std::memcmp(v.data.data(), f.data() + data_offset + t.begin, v.data.size()) != 0) {
        report(st, where + ": view of '" + t.name + "' is not the file's bytes at its offsets");
      }
    }
    ++st->file_ok;
  } catch (const SafetensorsError&) {
    ++st->file_rejected;
  } catch (const std::exception& e) {
    report(st, where + ": " + typeid(e).name() + ": " + e.what());
  } catch (...) {
    report(st, where + ": unknown exception");
  }
}

TEST(SafetensorsFuzz, MutatedFilesAreReadOrRejectedWithSafetensorsError) {
  test::TempDir dir;
  const std::vector<std::string> base = seeds(dir.path());
  const fs::path path = dir / "fuzz.safetensors";
  Stats st;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t seed = 1; seed <= base.size(); ++seed) {
    Mutator m(seed * 0x9e3779b97f4a7c15ull);
    std::mt19937_64 rng(seed);
    const int per_seed = kIterations / static_cast<int>(base.size());
    for (int it = 0; it < per_seed && st.failures <= 10; ++it) {
      std::string f = base[seed - 1];
      const int rounds = 1 + static_cast<int>(rng() % 4);
      for (int r = 0; r < rounds; ++r) m.mutate(&f);
      fuzz_one(f, path, rng(), "seed " + std::to_string(seed) + " iteration " + std::to_string(it), &st);
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("fuzz: %d inputs in %.1f s; header parsed %d, rejected %d; file opened %d, rejected %d\n",
              st.file_ok + st.file_rejected, secs, st.header_ok, st.header_rejected, st.file_ok,
              st.file_rejected);
  EXPECT_EQ(st.failures, 0);
  EXPECT_GE(st.file_ok + st.file_rejected, 20000);
  // The mutations must exercise both outcomes, or the fuzzer is not testing much.
  EXPECT_GT(st.file_ok, 1000);
  EXPECT_GT(st.file_rejected, 1000);
}

// The seeds themselves are valid (otherwise the fuzzer only mutates garbage).
TEST(SafetensorsFuzz, SeedsAreValid) {
  test::TempDir dir;
  const auto base = seeds(dir.path());
  for (size_t i = 0; i < base.size(); ++i) {
    spit(dir / "s.safetensors", base[i]);
    EXPECT_NO_THROW(SafetensorsFile(dir / "s.safetensors")) << "seed " << i;
  }
}

}  // namespace
}  // namespace strata::models
