// JSON parsing with a nesting limit, for text from files and callers.
//
// nlohmann's parser is iterative, but copying a value, dump() and
// comparisons recurse once per level: a value nested 100,000 deep (a
// crafted manifest, a trace's other data) parsed fine and then overflowed
// the stack there. Files and arguments Strata reads nest a few levels.
#pragma once

#include <algorithm>
#include <string_view>

namespace strata {

inline constexpr int kMaxJsonDepth = 64;

// The deepest nesting of arrays and objects in `text`, brackets inside
// strings not counted: one linear pass (a parser callback would do, but
// nlohmann's callback parser rescans the parent after every object closes,
// quadratic in an array of objects).
inline int JsonNesting(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// Json::parse(text) without exceptions; a discarded value when the text is
// not JSON, or when it nests deeper than `max_depth` (then *too_deep is set,
// so the caller can say which).
template <typename Json>
Json ParseJsonBounded(std::string_view text, bool* too_deep = nullptr,
                      int max_depth = kMaxJsonDepth) {
  const bool deep = JsonNesting(text) > max_depth;
  if (too_deep != nullptr) *too_deep = deep;
  if (deep) return Json(Json::value_t::discarded);
  return Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
}

}  // namespace strata
