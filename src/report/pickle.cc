// Python pickles of plain data (pickle.h). Opcodes and their arguments from CPython's Lib/pickletools.py
// (the `opcodes` table) and Lib/pickle.py (`_Pickler.save_*`, `_Unpickler.load_*`).
#include "trainmem/pickle.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include "trainmem/error.h"

namespace trainmem {

PyValue::PyValue(uint64_t i) {
  if (i > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    throw Error(fmt::format("the integer {} is beyond what a snapshot holds (at most 2^63 - 1)", i));
  }
  v = static_cast<int64_t>(i);
}

const PyList* PyValue::list() const {
  if (const auto* l = std::get_if<std::shared_ptr<PyList>>(&v)) return l->get();
  if (const auto* t = std::get_if<std::shared_ptr<PyTuple>>(&v)) return &(*t)->items;
  return nullptr;
}

const PyDict* PyValue::dict() const {
  if (const auto* d = std::get_if<std::shared_ptr<PyDict>>(&v)) return d->get();
  return nullptr;
}

const PyValue* PyValue::get(std::string_view key) const {
  const PyDict* d = dict();
  if (!d) return nullptr;
  // a key given twice: the later value wins, as in Python's dict
  for (auto it = d->rbegin(); it != d->rend(); ++it) {
    if (const std::string* k = it->first.str(); k && *k == key) return &it->second;
  }
  return nullptr;
}

namespace {

// Opcodes (pickletools.py)
enum : uint8_t {
  kMark = '(', kStop = '.', kBinInt = 'J', kBinInt1 = 'K', kBinInt2 = 'M', kNone = 'N', kBinUnicode = 'X',
  kAppend = 'a', kEmptyDict = '}', kAppends = 'e', kBinGet = 'h', kLongBinGet = 'j', kEmptyList = ']',
  kBinPut = 'q', kLongBinPut = 'r', kSetItem = 's', kTuple = 't', kEmptyTuple = ')', kSetItems = 'u',
  kBinFloat = 'G', kList = 'l', kDict = 'd',
  kProto = 0x80, kTuple1 = 0x85, kTuple2 = 0x86, kTuple3 = 0x87, kNewTrue = 0x88, kNewFalse = 0x89,
  kLong1 = 0x8a, kLong4 = 0x8b, kShortBinUnicode = 0x8c, kBinUnicode8 = 0x8d, kMemoize = 0x94, kFrame = 0x95,
};

// ---- writer ----

class Writer {
 public:
  std::string out;

  void value(const PyValue& x, size_t depth = 0) {
    if (depth > kPickleMaxDepth) throw Error("a value nested too deeply to pickle");
    std::visit([&](const auto& a) { put(a, depth); }, x.v);
  }

 private:
  std::unordered_map<std::string, uint32_t> memo_;

  void byte(uint8_t b) { out.push_back(static_cast<char>(b)); }
  void le(uint64_t x, int n) {
    for (int i = 0; i < n; ++i) byte(static_cast<uint8_t>(x >> (8 * i)));
  }
  void put(const std::monostate&, size_t) { byte(kNone); }
  void put(bool b, size_t) { byte(b ? kNewTrue : kNewFalse); }
  void put(int64_t i, size_t) {
    // pickle.py save_long: BININT1, BININT2, BININT for what fits, else LONG1 with the two's complement bytes
    if (i >= 0 && i <= 0xff) {
      byte(kBinInt1);
      le(static_cast<uint64_t>(i), 1);
    } else if (i >= 0 && i <= 0xffff) {
      byte(kBinInt2);
      le(static_cast<uint64_t>(i), 2);
    } else if (i >= std::numeric_limits<int32_t>::min() && i <= std::numeric_limits<int32_t>::max()) {
      byte(kBinInt);
      le(static_cast<uint64_t>(i), 4);
    } else {
      // the fewest bytes whose top bit is the sign (encode_long)
      int n = 8;
      const auto u = static_cast<uint64_t>(i);
      while (n > 1) {
        const uint64_t top = u >> (8 * (n - 1));
        const uint8_t next = static_cast<uint8_t>(u >> (8 * (n - 2)));
        if ((top == 0 && !(next & 0x80)) || (top == 0xff && (next & 0x80))) {
          --n;
        } else {
          break;
        }
      }
      byte(kLong1);
      byte(static_cast<uint8_t>(n));
      le(u, n);
    }
  }
  void put(double d, size_t) {
    byte(kBinFloat);
    uint64_t bits = 0;  // memcpy, not std::bit_cast: libc++ 14 (emscripten 3.1's, make web) has no bit_cast
    std::memcpy(&bits, &d, sizeof bits);
    for (int i = 7; i >= 0; --i) byte(static_cast<uint8_t>(bits >> (8 * i)));  // big-endian
  }
  void put(const std::string& s, size_t) {
    const bool memoizable = s.size() < 256;
    if (memoizable) {
      if (auto it = memo_.find(s); it != memo_.end()) {
        get(it->second);
        return;
      }
    }
    byte(kBinUnicode);
    if (s.size() > std::numeric_limits<uint32_t>::max()) throw Error("a string too long to pickle");
    le(s.size(), 4);
    out += s;
    if (memoizable) {
      const auto id = static_cast<uint32_t>(memo_.size());
      memo_.emplace(s, id);
      memo(id, kBinPut, kLongBinPut);
    }
  }
  void get(uint32_t id) { memo(id, kBinGet, kLongBinGet); }
  // a memo opcode: its one-byte form for the first 256 entries, its four-byte form after
  void memo(uint32_t id, uint8_t short_op, uint8_t long_op) {
    byte(id < 256 ? short_op : long_op);
    le(id, id < 256 ? 1 : 4);
  }
  // batches of 1000, as pickle.py's _BATCHSIZE
  static constexpr size_t kBatch = 1000;
  void put(const std::shared_ptr<PyList>& l, size_t depth) {
    byte(kEmptyList);
    for (size_t i = 0; i < l->size(); i += kBatch) {
      byte(kMark);
      for (size_t j = i; j < std::min(l->size(), i + kBatch); ++j) value((*l)[j], depth + 1);
      byte(kAppends);
    }
  }
  void put(const std::shared_ptr<PyTuple>& t, size_t depth) {
    const PyList& items = t->items;
    if (items.empty()) {
      byte(kEmptyTuple);
      return;
    }
    if (items.size() <= 3) {
      for (const PyValue& x : items) value(x, depth + 1);
      byte(static_cast<uint8_t>(kTuple1 + items.size() - 1));
      return;
    }
    byte(kMark);
    for (const PyValue& x : items) value(x, depth + 1);
    byte(kTuple);
  }
  void put(const std::shared_ptr<PyDict>& d, size_t depth) {
    byte(kEmptyDict);
    for (size_t i = 0; i < d->size(); i += kBatch) {
      byte(kMark);
      for (size_t j = i; j < std::min(d->size(), i + kBatch); ++j) {
        value((*d)[j].first, depth + 1);
        value((*d)[j].second, depth + 1);
      }
      byte(kSetItems);
    }
  }
};

// ---- reader ----

class Reader {
 public:
  Reader(std::string_view bytes, std::string_view what) : b_(bytes), what_(what) {}

  PyValue run() {
    if (b_.size() > kPickleMaxBytes) fail(0, fmt::format("{} bytes: larger than the 4 GiB read", b_.size()));
    if (b_.empty()) fail(0, "the file is empty (expected a pickle of torch.cuda.memory._snapshot())");
    if (u8() != kProto) {
      fail(0, "not a pickle of protocol 2 or later (a torch.cuda.memory._snapshot() pickle starts with the byte "
              "0x80, PROTO)");
    }
    const uint8_t proto = u8_checked(0);
    if (proto < 2 || proto > 5) fail(1, fmt::format("pickle protocol {}: expected 2 to 5", proto));
    while (true) {
      if (pos_ >= b_.size()) fail(pos_, "truncated: the pickle ends before its STOP opcode");
      const size_t at = pos_;
      const uint8_t op = u8();
      switch (op) {
        case kStop: {
          if (!marks_.empty()) fail(at, "STOP with a MARK still open");
          if (stack_.size() != 1) fail(at, fmt::format("STOP with {} values on the stack (expected 1)", stack_.size()));
          if (pos_ != b_.size()) fail(pos_, fmt::format("{} bytes after the pickle's STOP", b_.size() - pos_));
          return std::move(stack_.back().value);
        }
        case kProto: fail(at, "a second PROTO opcode"); break;
        case kFrame: {
          const uint64_t n = le(8, at);
          if (n > b_.size() - pos_) fail(at, fmt::format("a FRAME of {} bytes where {} remain", n, b_.size() - pos_));
          break;
        }
        case kNone: push(PyValue()); break;
        case kNewTrue: push(PyValue(true)); break;
        case kNewFalse: push(PyValue(false)); break;
        case kBinInt1: push(PyValue(static_cast<int64_t>(le(1, at)))); break;
        case kBinInt2: push(PyValue(static_cast<int64_t>(le(2, at)))); break;
        case kBinInt: push(PyValue(static_cast<int64_t>(static_cast<int32_t>(le(4, at))))); break;
        case kLong1:
        case kLong4: {
          const uint64_t n = le(op == kLong1 ? 1 : 4, at);
          if (n > 8) fail(at, fmt::format("an integer of {} bytes: beyond the 64 bits a snapshot's fields take", n));
          const uint64_t u = n == 0 ? 0 : le(static_cast<int>(n), at);
          int64_t i = 0;
          if (n > 0) {
            const unsigned shift = static_cast<unsigned>(64 - 8 * n);
            i = static_cast<int64_t>(u << shift) >> shift;  // sign-extend the top byte's bit
          }
          push(PyValue(i));
          break;
        }
        case kBinFloat: {
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | u8_checked(at);
          double d = 0;  // memcpy, not std::bit_cast: libc++ 14 (emscripten 3.1's, make web) has no bit_cast
          std::memcpy(&d, &bits, sizeof d);
          push(PyValue(d));
          break;
        }
        case kShortBinUnicode: str(le(1, at), at); break;
        case kBinUnicode: str(le(4, at), at); break;
        case kBinUnicode8: str(le(8, at), at); break;
        case kEmptyList: push(PyValue(PyList{})); break;
        case kEmptyDict: push(PyValue(PyDict{})); break;
        case kEmptyTuple: push(PyValue(PyTuple{})); break;
        case kMark: marks_.push_back(stack_.size()); break;
        case kAppend: {
          need(2, at, "APPEND");
          Item x = pop();
          append_to(top(at, "APPEND"), std::move(x), at);
          break;
        }
        case kAppends: {
          const size_t m = pop_mark(at, "APPENDS");
          if (m == 0) fail(at, "APPENDS with no list below its MARK");
          std::vector<Item> items(std::make_move_iterator(stack_.begin() + static_cast<ptrdiff_t>(m)),
                                  std::make_move_iterator(stack_.end()));
          stack_.resize(m);
          for (Item& x : items) append_to(stack_.back(), std::move(x), at);
          break;
        }
        case kList:
        case kTuple: {
          const size_t m = pop_mark(at, op == kList ? "LIST" : "TUPLE");
          collect(m, op == kList, at);
          break;
        }
        case kTuple1:
        case kTuple2:
        case kTuple3: {
          const size_t n = static_cast<size_t>(op - kTuple1) + 1;
          if (stack_.size() < n || (!marks_.empty() && stack_.size() - n < marks_.back())) {
            fail(at, fmt::format("TUPLE{} with fewer than {} values on the stack", n, n));
          }
          collect(stack_.size() - n, false, at);
          break;
        }
        case kDict: {
          const size_t m = pop_mark(at, "DICT");
          if ((stack_.size() - m) % 2) fail(at, "DICT with an odd number of values (a key without its value)");
          push(PyValue(PyDict{}));
          std::rotate(stack_.begin() + static_cast<ptrdiff_t>(m), stack_.end() - 1, stack_.end());
          set_items(stack_[m], m + 1, at);
          break;
        }
        case kSetItem: {
          need(3, at, "SETITEM");
          set_items(stack_[stack_.size() - 3], stack_.size() - 2, at);
          break;
        }
        case kSetItems: {
          const size_t m = pop_mark(at, "SETITEMS");
          if (m == 0) fail(at, "SETITEMS with no dict below its MARK");
          if ((stack_.size() - m) % 2) fail(at, "SETITEMS with an odd number of values (a key without its value)");
          set_items(stack_[m - 1], m, at);
          break;
        }
        case kMemoize: put_memo(memo_.size(), at); break;
        case kBinPut: put_memo(le(1, at), at); break;
        case kLongBinPut: put_memo(le(4, at), at); break;
        case kBinGet: get_memo(le(1, at), at); break;
        case kLongBinGet: get_memo(le(4, at), at); break;
        default: refuse(op, at);
      }
    }
  }

 private:
  struct Item {
    PyValue value;
  };
  std::string_view b_;
  std::string_view what_;
  size_t pos_ = 0;
  std::vector<Item> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Item> memo_;
  std::unordered_set<const void*> shared_;  // containers fetched from the memo: never changed afterwards
  uint64_t values_ = 0;
  std::unordered_map<const void*, uint32_t> depth_;  // each container's nesting: 1 + its deepest item's

  [[noreturn]] void fail(size_t at, const std::string& why) const {
    throw Error(fmt::format("{}: not a snapshot pickle trainmem reads: {} (at byte {})", what_, why, at));
  }
  [[noreturn]] void refuse(uint8_t op, size_t at) const {
    const char* name = nullptr;
    switch (op) {
      case 'c': name = "GLOBAL"; break;
      case 0x93: name = "STACK_GLOBAL"; break;
      case 'R': name = "REDUCE"; break;
      case 'b': name = "BUILD"; break;
      case 0x81: name = "NEWOBJ"; break;
      case 0x92: name = "NEWOBJ_EX"; break;
      case 'i': name = "INST"; break;
      case 'o': name = "OBJ"; break;
      case 'C': case 'B': case 0x8e: name = "BINBYTES"; break;
      case 'T': case 'U': name = "BINSTRING"; break;
      case 0x8f: case 0x90: name = "a set"; break;
      case 0x91: name = "FROZENSET"; break;
      case 0x96: case 0x97: case 0x98: name = "a protocol 5 buffer"; break;
      case 'P': case 'Q': name = "PERSID"; break;
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'g': case 'p': name = "a protocol 0 text opcode"; break;
      default: break;
    }
    fail(at, fmt::format("opcode 0x{:02x}{}: only dicts, lists, tuples, str, int, float, bool and None are read",
                         op, name ? fmt::format(" ({})", name) : std::string()));
  }
  uint8_t u8() { return static_cast<uint8_t>(b_[pos_++]); }
  uint8_t u8_checked(size_t at) {
    if (pos_ >= b_.size()) fail(at, "truncated in the middle of an opcode's argument");
    return u8();
  }
  uint64_t le(int n, size_t at) {
    if (b_.size() - pos_ < static_cast<size_t>(n)) fail(at, "truncated in the middle of an opcode's argument");
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= uint64_t{u8()} << (8 * i);
    return x;
  }
  void str(uint64_t n, size_t at) {
    if (n > b_.size() - pos_) fail(at, fmt::format("a string of {} bytes where {} remain", n, b_.size() - pos_));
    push(PyValue(std::string(b_.substr(pos_, n))));
    pos_ += n;
  }
  void push(PyValue v) {
    if (++values_ > kPickleMaxValues) {
      fail(pos_, fmt::format("more than {} values (a hostile or corrupt pickle)", kPickleMaxValues));
    }
    if (const void* p = identity(v)) depth_.emplace(p, 1);
    stack_.push_back({std::move(v)});
  }
  Item pop() {
    Item x = std::move(stack_.back());
    stack_.pop_back();
    return x;
  }
  void need(size_t n, size_t at, const char* op) {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() < n || stack_.size() - n < floor) fail(at, fmt::format("{} with too few values on the stack", op));
  }
  Item& top(size_t at, const char* op) {
    if (stack_.empty()) fail(at, fmt::format("{} on an empty stack", op));
    return stack_.back();
  }
  size_t pop_mark(size_t at, const char* op) {
    if (marks_.empty()) fail(at, fmt::format("{} without a MARK", op));
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  static const void* identity(const PyValue& v) {
    if (const auto* l = std::get_if<std::shared_ptr<PyList>>(&v.v)) return l->get();
    if (const auto* t = std::get_if<std::shared_ptr<PyTuple>>(&v.v)) return t->get();
    if (const auto* d = std::get_if<std::shared_ptr<PyDict>>(&v.v)) return d->get();
    return nullptr;
  }
  uint32_t depth(const PyValue& v) const {
    const void* p = identity(v);
    if (!p) return 0;
    auto it = depth_.find(p);
    return it == depth_.end() ? 1 : it->second;
  }
  void deepen(const Item& parent, const Item& child, size_t at) {
    uint32_t& d = depth_[identity(parent.value)];
    d = std::max({d, uint32_t{1}, depth(child.value) + 1});
    if (d > kPickleMaxDepth) fail(at, fmt::format("containers nested more than {} deep", kPickleMaxDepth));
  }
  void mutable_check(const Item& c, size_t at, const char* op) {
    if (shared_.count(identity(c.value))) fail(at, fmt::format("{} changes a container already fetched from the memo (a recursive structure)", op));
  }
  void append_to(Item& target, Item x, size_t at) {
    auto* l = std::get_if<std::shared_ptr<PyList>>(&target.value.v);
    if (!l) fail(at, "APPEND(S) to something that is not a list");
    mutable_check(target, at, "APPEND(S)");
    deepen(target, x, at);
    (*l)->push_back(std::move(x.value));
  }
  void collect(size_t m, bool list, size_t at) {
    uint32_t d = 1;
    PyList items;
    items.reserve(stack_.size() - m);
    for (size_t i = m; i < stack_.size(); ++i) {
      d = std::max(d, depth(stack_[i].value) + 1);
      items.push_back(std::move(stack_[i].value));
    }
    if (d > kPickleMaxDepth) fail(at, fmt::format("containers nested more than {} deep", kPickleMaxDepth));
    stack_.resize(m);
    PyValue out = list ? PyValue(std::move(items)) : PyValue(PyTuple{std::move(items)});
    depth_[identity(out)] = d;
    stack_.push_back({std::move(out)});
  }
  void set_items(Item& target, size_t from, size_t at) {
    auto* d = std::get_if<std::shared_ptr<PyDict>>(&target.value.v);
    if (!d) fail(at, "SETITEM(S) on something that is not a dict");
    mutable_check(target, at, "SETITEM(S)");
    for (size_t i = from; i + 1 < stack_.size(); i += 2) {
      const PyValue& k = stack_[i].value;
      if (k.dict() || std::holds_alternative<std::shared_ptr<PyList>>(k.v)) fail(at, "a dict key that is a list or a dict (unhashable)");
      deepen(target, stack_[i], at);
      deepen(target, stack_[i + 1], at);
      (*d)->emplace_back(std::move(stack_[i].value), std::move(stack_[i + 1].value));
    }
    stack_.resize(from);
  }
  void put_memo(uint64_t id, size_t at) {
    if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back())) fail(at, "a memo PUT with nothing to store");
    memo_[id] = stack_.back();
  }
  void get_memo(uint64_t id, size_t at) {
    auto it = memo_.find(id);
    if (it == memo_.end()) fail(at, fmt::format("memo GET of {}, never stored", id));
    // A container fetched from the memo is shared from now on: changing it (through either reference) is
    // refused, which is what keeps the values a tree (a recursive structure would change its ancestor).
    if (const void* p = identity(it->second.value)) shared_.insert(p);
    push(it->second.value);
  }
};

}  // namespace

std::string pickle_dumps(const PyValue& value) {
  Writer w;
  w.out += static_cast<char>(kProto);
  w.out += static_cast<char>(2);
  w.value(value);
  w.out += static_cast<char>(kStop);
  return w.out;
}

PyValue pickle_loads(std::string_view bytes, std::string_view what) { return Reader(bytes, what).run(); }

}  // namespace trainmem
