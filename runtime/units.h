// Parsing and printing of sizes, counts and rates for configs and the CLI.
//
//   ParseBytes("1MiB") == 1048576, ParseBytes("4K") == 4096, ParseBytes("512") == 512
//   ParseCount("256M") == 256000000, ParseCount("1.5B") == 1500000000
//   ParseRate("2.5GB/s") == 2.5e9, ParseRate("1GiB/s") == 1073741824
//   FormatBytes(1536) == "1.50 KiB", FormatRate(2.5e9) == "2.50 GB/s"
//
// Bytes use binary multiples (K, KB, KiB = 1024; M, G, T likewise: memory and
// IO sizes are powers of two). Counts (parameters, steps) use decimal
// multiples (K = 1e3, M = 1e6, G or B = 1e9, T = 1e12). Rates print decimal
// (GB/s = 1e9 bytes/s), as drive and link vendors quote them, and ParseRate
// reads them the same way (K, M, G, T decimal; KiB, MiB, GiB, TiB binary; an
// optional "B" and "/s").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "runtime/status.h"

namespace strata {

// InvalidArgument naming the text when it is not a non-negative size.
Result<uint64_t> ParseBytes(std::string_view text);
Result<uint64_t> ParseCount(std::string_view text);
Result<double> ParseRate(std::string_view text);  // bytes per second

std::string FormatBytes(uint64_t bytes);      // "1.50 GiB"
std::string FormatCount(uint64_t count);      // "1.50 B", "256.00 M", "512"
std::string FormatRate(double bytes_per_sec);  // "2.50 GB/s"
std::string FormatSeconds(double seconds);    // "12.3 ms", "1.20 s", "850 us"

inline constexpr uint64_t kKiB = uint64_t{1} << 10;
inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;

}  // namespace strata
