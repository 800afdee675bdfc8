// Python pickles of plain data, both ways: the subset torch.cuda.memory._snapshot() pickles are made of
// (dicts, lists, tuples, str, int, float, bool, None). Written with protocol 2 opcodes that Python's pickle
// and PyTorch's memory_viz (torch/utils/viz/MemoryViz.js `unpickle`) both read; read from protocols 2 to 5
// (Python 3.8+ pickles with 4 by default, 3.14 with 5; neither adds an opcode for these types). Anything else
// (classes, bytes, sets, protocol 0/1 text opcodes) is refused with a trainmem::Error, as are truncated or
// inconsistent pickles: the reader never trusts a length, a memo index or a nesting depth it is given.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace trainmem {

struct PyValue;
using PyList = std::vector<PyValue>;
using PyDict = std::vector<std::pair<PyValue, PyValue>>;  // in insertion order, as Python's dict
struct PyTuple {
  PyList items;
};

// One Python value. Integers are int64 (a pickle's larger integers are refused: no snapshot field needs one).
struct PyValue {
  std::variant<std::monostate, bool, int64_t, double, std::string, std::shared_ptr<PyList>,
               std::shared_ptr<PyTuple>, std::shared_ptr<PyDict>>
      v;

  PyValue() = default;
  PyValue(bool b) : v(b) {}  // NOLINT: implicit on purpose (building literals)
  PyValue(int64_t i) : v(i) {}  // NOLINT
  PyValue(uint64_t i);  // NOLINT; throws when above INT64_MAX
  PyValue(int i) : v(int64_t{i}) {}  // NOLINT
  PyValue(double d) : v(d) {}  // NOLINT
  PyValue(std::string s) : v(std::move(s)) {}  // NOLINT
  PyValue(const char* s) : v(std::string(s)) {}  // NOLINT
  PyValue(PyList l) : v(std::make_shared<PyList>(std::move(l))) {}  // NOLINT
  PyValue(PyTuple t) : v(std::make_shared<PyTuple>(std::move(t))) {}  // NOLINT
  PyValue(PyDict d) : v(std::make_shared<PyDict>(std::move(d))) {}  // NOLINT

  bool is_none() const { return std::holds_alternative<std::monostate>(v); }
  const std::string* str() const { return std::get_if<std::string>(&v); }
  const int64_t* integer() const { return std::get_if<int64_t>(&v); }
  const PyList* list() const;   // a list or a tuple's items
  const PyDict* dict() const;
  // dict lookup by a str key (nullptr when this is not a dict or has no such key)
  const PyValue* get(std::string_view key) const;
};

// The pickle (protocol 2) of `value`. Strings shorter than 256 bytes that repeat are memoized.
std::string pickle_dumps(const PyValue& value);

// Limits of the reader (each refused with an Error naming it).
inline constexpr size_t kPickleMaxDepth = 64;            // nesting of containers
inline constexpr uint64_t kPickleMaxBytes = uint64_t{1} << 32;  // a pickle file larger than 4 GiB
// values pushed (each string, number and container, memo fetches included): a snapshot of 200,000 trace
// entries with their frames holds a few million
inline constexpr uint64_t kPickleMaxValues = uint64_t{1} << 24;

// Reads a pickle of plain data. `what` names the input in errors ("step.pickle").
PyValue pickle_loads(std::string_view bytes, std::string_view what);

}  // namespace trainmem
