// UTF-8 checks for text that crosses into JSON, C callers or Python: names,
// paths and error messages may carry a caller's arbitrary bytes.
#ifndef STRATA_RUNTIME_UTF8_H_
#define STRATA_RUNTIME_UTF8_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace strata {

// The offset of the first byte that breaks UTF-8 in `s` (overlong forms,
// surrogates and code points past U+10FFFF included); npos when it is valid.
size_t Utf8ErrorAt(std::string_view s);

// `s` with each byte that breaks UTF-8 written as the four characters \xNN
// (a path keeps its readable parts and shows which bytes were not text).
// Valid text is returned as it is.
std::string EscapeNonUtf8(std::string_view s);

}  // namespace strata

#endif  // STRATA_RUNTIME_UTF8_H_
