#include <gtest/gtest.h>

TEST(SkipCheck, Passes) { SUCCEED(); }
TEST(SkipCheck, Skips) { GTEST_SKIP() << "no GPU here (on purpose)"; }
