// The nearest of some known names to a word that matched none, for the
// "did you mean ...?" of config and command-line errors.
//
//   NearestSpelling("nvme_pth", {"nvme_path", "device"}) == "nvme_path"
//   NearestSpelling("foo", {"nvme_path", "device"}) == ""
#pragma once

#include <cstddef>
#include <span>
#include <string_view>

namespace strata {

// The edits (insert, delete or replace one character) that turn a into b.
size_t EditDistance(std::string_view a, std::string_view b);

// The candidate closest to `word`, when it is close enough to be what was
// meant: at most max(2, word.size() / 3) edits. The first of equally close
// ones; "" when none is that close.
std::string_view NearestSpelling(std::string_view word,
                                 std::span<const std::string_view> candidates);

}  // namespace strata
