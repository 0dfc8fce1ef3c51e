#include "runtime/utf8.h"

#include <gtest/gtest.h>

#include <string>

namespace strata {
namespace {

TEST(Utf8, ValidTextHasNoErrorAndIsKept) {
  const std::string text = "w.0 \xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80";  // été € 😀
  EXPECT_EQ(Utf8ErrorAt(text), std::string::npos);
  EXPECT_EQ(Utf8ErrorAt(""), std::string::npos);
  EXPECT_EQ(EscapeNonUtf8(text), text);
}

TEST(Utf8, FindsTheFirstBadByte) {
  EXPECT_EQ(Utf8ErrorAt("ab\xff"), 2u);
  EXPECT_EQ(Utf8ErrorAt("a\xc3"), 1u);                // truncated
  EXPECT_EQ(Utf8ErrorAt("\xc3(x"), 0u);               // bad continuation
  EXPECT_EQ(Utf8ErrorAt("\xc0\xaf"), 0u);             // overlong '/'
  EXPECT_EQ(Utf8ErrorAt("x\xed\xa0\x80"), 1u);        // surrogate U+D800
  EXPECT_EQ(Utf8ErrorAt("\xf4\x90\x80\x80"), 0u);     // past U+10FFFF
  EXPECT_EQ(Utf8ErrorAt("\xf0\x9f\x98\x80\x80"), 4u); // a stray continuation
}

TEST(Utf8, EscapesOnlyTheBadBytes) {
  EXPECT_EQ(EscapeNonUtf8("/data/\xff\xfe/ckpt"), "/data/\\xff\\xfe/ckpt");
  EXPECT_EQ(EscapeNonUtf8("\xc3\xa9\xc3"), "\xc3\xa9\\xc3");
  EXPECT_EQ(EscapeNonUtf8("\xc0\xaf"), "\\xc0\\xaf");
  const std::string escaped = EscapeNonUtf8("a\x80\xe2\x82\xac\xf5z");
  EXPECT_EQ(escaped, "a\\x80\xe2\x82\xac\\xf5z");
  EXPECT_EQ(Utf8ErrorAt(escaped), std::string::npos);
}

}  // namespace
}  // namespace strata
