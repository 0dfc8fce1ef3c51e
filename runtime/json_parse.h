// JSON parsing with a nesting limit, for text from files and callers.
//
// nlohmann's parser is iterative, but copying a value, dump() and
// comparisons recurse once per level: a value nested 100,000 deep (a
// crafted manifest, a trace's other data) parsed fine and then overflowed
// the stack there. Files and arguments Strata reads nest a few levels.
#pragma once

#include <string_view>

namespace strata {

inline constexpr int kMaxJsonDepth = 64;

// Json::parse(text) without exceptions; a discarded value when the text is
// not JSON, or when it nests deeper than `max_depth` (then *too_deep is set,
// so the caller can say which).
template <typename Json>
Json ParseJsonBounded(std::string_view text, bool* too_deep = nullptr,
                      int max_depth = kMaxJsonDepth) {
  bool deep = false;
  Json j = Json::parse(
      text.begin(), text.end(),
      [&](int depth, typename Json::parse_event_t, Json&) {
        if (depth <= max_depth) return true;
        deep = true;
        return false;  // not kept: the deep part is never built
      },
      /*allow_exceptions=*/false);
  if (too_deep != nullptr) *too_deep = deep;
  return deep ? Json(Json::value_t::discarded) : j;
}

}  // namespace strata
