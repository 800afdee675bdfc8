// A plain text table: columns with a header, left or right aligned, padded to the widest cell.
#pragma once

#include <string>
#include <vector>

namespace trainmem::report {

class TextTable {
 public:
  enum Align { kLeft, kRight };
  explicit TextTable(std::vector<std::pair<std::string, Align>> columns) : columns_(std::move(columns)) {}
  void row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  void rule() { rows_.push_back({}); }  // a horizontal line
  std::string str(const std::string& indent = "  ") const;

 private:
  std::vector<std::pair<std::string, Align>> columns_;
  std::vector<std::vector<std::string>> rows_;
};

// "12.3%" of a part in a whole (display only).
std::string percent(uint64_t part, uint64_t whole);

}  // namespace trainmem::report
