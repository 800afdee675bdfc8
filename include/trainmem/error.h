// trainmem::Error: the one exception type of the library. Its message is meant for the user as is: it names
// the file, the key, the value and what was expected. The CLI prints "trainmem: <message>" and exits 2.
#pragma once

#include <stdexcept>
#include <string>

namespace trainmem {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace trainmem
