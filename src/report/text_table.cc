#include "text_table.h"

#include <fmt/format.h>

#include <algorithm>

namespace trainmem::report {

std::string TextTable::str(const std::string& indent) const {
  std::vector<size_t> width(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) width[c] = columns_[c].first.size();
  for (const auto& r : rows_) {
    for (size_t c = 0; c < r.size() && c < width.size(); ++c) width[c] = std::max(width[c], r[c].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out = indent;
    for (size_t c = 0; c < columns_.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      const bool last = c + 1 == columns_.size();
      if (columns_[c].second == kRight) {
        out += fmt::format("{:>{}}", cell, width[c]);
      } else {
        out += last ? cell : fmt::format("{:<{}}", cell, width[c]);
      }
      if (!last) out += "  ";
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out + "\n";
  };
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  std::vector<std::string> header;
  for (const auto& c : columns_) header.push_back(c.first);
  std::string s = line(header);
  for (const auto& r : rows_) {
    s += r.empty() ? indent + std::string(total - 2, '-') + "\n" : line(r);
  }
  return s;
}

std::string percent(uint64_t part, uint64_t whole) {
  if (whole == 0) return "-";
  return fmt::format("{:.1f}%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

}  // namespace trainmem::report
