#include "runtime/spelling.h"

#include <algorithm>
#include <vector>

namespace strata {

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string_view NearestSpelling(std::string_view word,
                                 std::span<const std::string_view> candidates) {
  std::string_view nearest;
  size_t best = std::max<size_t>(2, word.size() / 3) + 1;
  for (std::string_view c : candidates) {
    if (const size_t d = EditDistance(word, c); d < best) {
      best = d;
      nearest = c;
    }
  }
  return nearest;
}

}  // namespace strata
