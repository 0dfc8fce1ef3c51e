// The seed of a randomized test: STRATA_TEST_SEED when set (to replay a
// failure), else a fresh random one. Printed either way.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace strata::testing {

inline uint64_t TestSeed() {
  const char* env = std::getenv("STRATA_TEST_SEED");
  const uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
  std::printf("seed %llu (replay with STRATA_TEST_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  return seed;
}

}  // namespace strata::testing
