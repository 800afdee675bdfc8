// PYTORCH_CUDA_ALLOC_CONF parsing, as CUDAAllocatorConfig::parseArgs does it: "key:value" pairs separated by
// commas, list values in brackets. Errors carry PyTorch's own message.
#include <fmt/format.h>

#include <limits>

#include <bit>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <string>
#include <vector>

#include "trainmem/allocator.h"
#include "trainmem/error.h"

namespace trainmem {

namespace {

// std::from_chars of a double: the whole text, a decimal or "inf"/"nan", or false. libc++ before 17 (emscripten
// 3.1's, make web) has only the integer overloads; there strtod reads it, with what from_chars refuses and
// strtod takes (leading space, '+', hexadecimal) refused first.
bool parse_double(const std::string& v, double& x) {
#if defined(__cpp_lib_to_chars)
  auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  return r.ec == std::errc() && r.ptr == v.data() + v.size();
#else
  if (v.empty() || std::isspace(static_cast<unsigned char>(v[0])) || v[0] == '+' ||
      v.find_first_of("xX") != std::string::npos) {
    return false;
  }
  char* end = nullptr;
  errno = 0;
  x = std::strtod(v.c_str(), &end);
  return end == v.c_str() + v.size() && errno != ERANGE;
#endif
}

// lexArgs: ',', ':', '[' and ']' are tokens of their own; spaces are dropped.
std::vector<std::string> lex(std::string_view s) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == ',' || ch == ':' || ch == '[' || ch == ']') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      out.emplace_back(1, ch);
    } else if (!std::isspace(static_cast<unsigned char>(ch))) {
      cur += ch;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

class Parser {
 public:
  Parser(std::string_view conf, TorchVersion torch) : conf_(conf), torch_(torch), t_(lex(conf)) {}

  AllocatorConfig parse() {
    AllocatorConfig c;
    while (i_ < t_.size()) {
      const std::string key = t_[i_++];
      expect(":", key);
      if (key == "max_split_size_mb") {
        const uint64_t mb = number(key);
        check_at_least_20(key, mb);
        c.max_split_size = mb * kMiB;
      } else if (key == "max_non_split_rounding_mb") {
        const uint64_t mb = number(key);
        check_at_least_20(key, mb);
        c.max_non_split_rounding = mb * kMiB;
      } else if (key == "roundup_power2_divisions") {
        divisions(c);
      } else if (key == "expandable_segments") {
        c.expandable_segments = boolean("Expected a single True/False argument for expandable_segments");
      } else if (key == "garbage_collection_threshold") {
        const std::string v = value(key);
        double x = 0;
        if (!parse_double(v, x)) fail(fmt::format("Error, expecting {} value", key));
        // TORCH_CHECK(val1 > 0, ...): written so that NaN fails it too, as it does in PyTorch
        if (!(x > 0.0)) fail("garbage_collect_threshold too small, set it 0.0~1.0");
        if (x >= 1.0) fail("garbage_collect_threshold too big, set it 0.0~1.0");
        c.garbage_collection_threshold = x;
      } else if (key == "release_lock_on_cudamalloc" || key == "pinned_use_cuda_host_register" ||
                 key == "pinned_use_background_threads") {
        (void)boolean(fmt::format("Expected a single True/False argument for {}", key));
      } else if (key == "backend") {
        const std::string v = value(key);
        if (v != "native") {
          fail(v == "cudaMallocAsync"
                   ? "backend:cudaMallocAsync is not modelled (trainmem models the native caching allocator)"
                   : "Unknown allocator backend, options are native and cudaMallocAsync");
        }
      } else {
        fail(fmt::format("Unrecognized CachingAllocator option: {}", key));
      }
      if (i_ < t_.size()) expect(",", key);
    }
    return c;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    throw FieldError("alloc_conf", fmt::format("\"{}\": {}", conf_, msg));
  }
  void expect(const char* tok, const std::string& key) {
    if (i_ >= t_.size() || t_[i_] != tok) {
      if (std::string(tok) == ":") fail(fmt::format("Error, expecting {} value", key));
      fail(fmt::format("Error parsing CachingAllocator settings, expected {}", tok));
    }
    ++i_;
  }
  std::string value(const std::string& key) {
    if (i_ >= t_.size() || t_[i_] == "," || t_[i_] == ":") fail(fmt::format("Error, expecting {} value", key));
    return t_[i_++];
  }
  uint64_t parse_u64(const std::string& v, const std::string& key) const {
    uint64_t x = 0;
    auto r = std::from_chars(v.data(), v.data() + v.size(), x);
    if (r.ec != std::errc() || r.ptr != v.data() + v.size()) fail(fmt::format("Error, expecting {} value", key));
    // CUDAAllocatorConfig.cpp reads every number with `size_t val1 = stoi(config[i])`, which throws
    // std::out_of_range beyond INT_MAX: PyTorch refuses such a value, and none of them means anything then.
    if (x > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
      fail(fmt::format("{} value {} is beyond what PyTorch reads (stoi: at most {})", key, v,
                       std::numeric_limits<int>::max()));
    }
    return x;
  }
  uint64_t number(const std::string& key) { return parse_u64(value(key), key); }
  bool boolean(const std::string& msg) {
    const std::string v = i_ < t_.size() ? t_[i_++] : "";
    if (v == "True") return true;
    if (v == "False") return false;
    fail(msg);
  }
  void check_at_least_20(const std::string& key, uint64_t mb) const {
    // 1.13 - 2.8: "must be > 20" (val > kLargeBuffer / mb); newer: ">= 20".
    const bool newer = torch_ >= TorchVersion{2, 9};
    if (newer ? mb < 20 : mb <= 20) {
      fail(fmt::format("CachingAllocator option {} too small, must be {} 20", key, newer ? ">=" : ">"));
    }
  }
  // "roundup_power2_divisions:4" or "roundup_power2_divisions:[256:1,512:2,>:8]"
  void divisions(AllocatorConfig& c) {
    auto& d = c.roundup_power2_divisions;
    if (i_ < t_.size() && t_[i_] == "[") {
      ++i_;
      bool first = true;
      size_t last = 0;
      while (i_ < t_.size() && t_[i_] != "]") {
        const std::string k = t_[i_++];
        expect(":", "roundup_power2_divisions");
        const uint64_t val = number("roundup_power2_divisions");
        if (val != 0 && !std::has_single_bit(val)) fail("For roundups, the divisions has to be power of 2 or 0 to disable roundup ");
        if (k == ">") {
          // up to 2.8 the fill starts at the last explicit interval (and overwrites it); later after it
          const size_t from = torch_ >= TorchVersion{2, 9} ? last + 1 : last;
          for (size_t j = from; j < d.size(); ++j) d[j] = val;
        } else {
          const uint64_t mb = parse_u64(k, "roundup_power2_divisions");
          if (!std::has_single_bit(mb)) fail("For roundups, the intervals have to be power of 2 ");
          size_t index = static_cast<size_t>(63 - std::countl_zero(mb));
          index = std::min(index, d.size() - 1);
          if (first) {
            for (size_t j = 0; j < index; ++j) d[j] = val;
            first = false;
          }
          d[index] = val;
          last = index;
        }
        if (i_ < t_.size() && t_[i_] == ",") ++i_;
      }
      expect("]", "roundup_power2_divisions");
      return;
    }
    const uint64_t val = number("roundup_power2_divisions");
    if (!std::has_single_bit(val)) fail("For roundups, the divisions has to be power of 2 ");
    d.fill(val);
  }

  std::string conf_;
  TorchVersion torch_;
  std::vector<std::string> t_;
  size_t i_ = 0;
};

}  // namespace

AllocatorConfig parse_alloc_conf(std::string_view conf, TorchVersion torch) { return Parser(conf, torch).parse(); }

}  // namespace trainmem
