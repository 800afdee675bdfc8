// trainmem::Error: the one exception type of the library. Its message is meant for the user as is: it names
// the file, the key, the value and what was expected. The CLI prints "trainmem: <message>" and exits 2.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace trainmem {

// Messages echo what the user gave (a value, a token of a file), which may be anything: every message is
// made valid UTF-8 (a byte that is not becomes the text \xNN) and at most kMaxMessageBytes long, so that a
// terminal, a JSON front end or a Python binding can always show it.
inline constexpr size_t kMaxMessageBytes = 2048;
std::string clean_message(std::string_view message);

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(clean_message(message)) {}
};

// An error in one field of a request (scenario.h): `field` is the field's name ("batch", "alloc_conf"), and
// `detail` the rest of the message ("\"-3\": expected an integer in [1, 1048576]"). The message reads
// "batch \"-3\": ..."; a front end that spells the field otherwise (the CLI's --batch) prints its own spelling
// followed by the detail.
class FieldError : public Error {
 public:
  FieldError(std::string field, std::string detail)
      : Error(field + " " + detail), field_(clean_message(field)), detail_(clean_message(detail)) {}
  const std::string& field() const { return field_; }
  const std::string& detail() const { return detail_; }

 private:
  std::string field_, detail_;
};

}  // namespace trainmem
