// The process the crash test kills: one rank trains a step and saves, again
// and again, printing "saving <step>" before each save and "saved <step>"
// after it returned OK (flushed, so the parent knows where the kill landed).
//   checkpoint_crash_helper DIR SEED ROUNDS
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/checkpoint/checkpoint_test_util.h"

int main(int argc, char** argv) {
  using strata::Status;
  namespace st = strata::testing;
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s DIR SEED ROUNDS\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const uint64_t seed = std::strtoull(argv[2], nullptr, 10);
  const int rounds = std::atoi(argv[3]);
  st::Cluster c(1, st::CrashTestConfig(), seed);
  if (!c.status().ok()) {
    std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return 1;
  }
  for (int round = 1; round <= rounds; ++round) {
    Status s = c.Train(seed, 1);
    std::printf("saving %d\n", round);
    std::fflush(stdout);
    if (s.ok()) s = strata::SaveCheckpoint(c.opt(0), dir, st::kCrashTestSave);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("saved %d\n", round);
    std::fflush(stdout);
  }
  return 0;
}
