#include "runtime/units.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(Units, ParseBytesBinary) {
  EXPECT_EQ(*ParseBytes("512"), 512u);
  EXPECT_EQ(*ParseBytes("4K"), 4096u);
  EXPECT_EQ(*ParseBytes("1MiB"), 1u << 20);
  EXPECT_EQ(*ParseBytes("1.5 GiB"), 3ull << 29);
  EXPECT_EQ(*ParseBytes("2g"), 2ull << 30);
  EXPECT_EQ(*ParseBytes("1T"), 1ull << 40);
}

TEST(Units, ParseCountDecimal) {
  EXPECT_EQ(*ParseCount("256M"), 256000000u);
  EXPECT_EQ(*ParseCount("1.5B"), 1500000000u);
  EXPECT_EQ(*ParseCount("7"), 7u);
}

TEST(Units, ParseRateIsDecimalLikeFormatRateAndBinaryWithI) {
  EXPECT_DOUBLE_EQ(*ParseRate("2.5GB/s"), 2.5e9);
  EXPECT_DOUBLE_EQ(*ParseRate("900M"), 9e8);
  EXPECT_DOUBLE_EQ(*ParseRate("1GiB/s"), 1073741824.0);
  EXPECT_DOUBLE_EQ(*ParseRate("512"), 512.0);
  EXPECT_DOUBLE_EQ(*ParseRate("3 tb/s"), 3e12);
  EXPECT_EQ(FormatRate(*ParseRate("2.50 GB/s")), "2.50 GB/s");
  Result<double> bad = ParseRate("5 furlongs/s");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("5 furlongs/s"), std::string_view::npos);
  EXPECT_FALSE(ParseRate("").ok());
  EXPECT_FALSE(ParseRate("-1GB/s").ok());
}

TEST(Units, RejectsGarbageWithTheText) {
  Result<uint64_t> r = ParseBytes("12 parsecs");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("12 parsecs"), std::string_view::npos);
  EXPECT_FALSE(ParseBytes("").ok());
  EXPECT_FALSE(ParseBytes("-1").ok());
  EXPECT_FALSE(ParseCount("1.5").ok());
  EXPECT_FALSE(ParseBytes("1e999").ok());
  EXPECT_FALSE(ParseBytes("99999999T").ok());
}

// The suffix is quoted as written, not lowercased: '1X' gave "unknown suffix 'x'".
TEST(Units, AnUnknownSuffixIsQuotedAsWritten) {
  Result<uint64_t> count = ParseCount("1X");
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("unknown suffix 'X'"), std::string_view::npos)
      << count.status();
  Result<uint64_t> size = ParseBytes("4 GiBs");
  ASSERT_FALSE(size.ok());
  EXPECT_NE(size.status().message().find("unknown suffix 'GiBs'"), std::string_view::npos)
      << size.status();
  Result<double> rate = ParseRate("5 Furlongs/s");
  ASSERT_FALSE(rate.ok());
  EXPECT_NE(rate.status().message().find("unknown unit 'Furlongs/s'"), std::string_view::npos)
      << rate.status();
}

TEST(Units, Format) {
  EXPECT_EQ(FormatBytes(100), "100 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatCount(1500000000), "1.50 B");
  EXPECT_EQ(FormatRate(2.5e9), "2.50 GB/s");
  EXPECT_EQ(FormatSeconds(0.0123), "12.3 ms");
}

}  // namespace
}  // namespace strata
