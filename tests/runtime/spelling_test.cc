#include "runtime/spelling.h"

#include <gtest/gtest.h>

#include <string_view>
#include <vector>

namespace strata {
namespace {

TEST(SpellingTest, EditDistanceCountsInsertionsDeletionsAndReplacements) {
  EXPECT_EQ(EditDistance("", ""), 0u);
  EXPECT_EQ(EditDistance("", "abc"), 3u);
  EXPECT_EQ(EditDistance("abc", ""), 3u);
  EXPECT_EQ(EditDistance("nvme_pth", "nvme_path"), 1u);  // an insertion
  EXPECT_EQ(EditDistance("nvme-dri", "nvme-dir"), 2u);   // two replacements
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
  EXPECT_EQ(EditDistance("sitting", "kitten"), 3u);
}

TEST(SpellingTest, TheNearestCloseEnoughCandidateOrNone) {
  const std::vector<std::string_view> names = {"device", "nvme_path", "buffer_count", "pin_memory"};
  EXPECT_EQ(NearestSpelling("nvme_pth", names), "nvme_path");
  EXPECT_EQ(NearestSpelling("buffer_cnt", names), "buffer_count");
  EXPECT_EQ(NearestSpelling("devcie", names), "device");  // 2 edits: allowed for any length
  EXPECT_EQ(NearestSpelling("host_budget", names), "");   // nothing that close
  EXPECT_EQ(NearestSpelling("x", {}), "");
  // Up to a third of a long word may differ: 4 of 12 here, 5 is too many.
  const std::vector<std::string_view> long_name = {"abcdefghijkl"};
  EXPECT_EQ(NearestSpelling("abcdefghWXYZ", long_name), "abcdefghijkl");
  EXPECT_EQ(NearestSpelling("abcdefgVWXYZ", long_name), "");
  // Of two equally close, the first.
  const std::vector<std::string_view> twins = {"cat", "cut"};
  EXPECT_EQ(NearestSpelling("cot", twins), "cat");
}

}  // namespace
}  // namespace strata
