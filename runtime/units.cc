#include "runtime/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace strata {
namespace {

std::string WithoutSpaces(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c))) out += c;
  }
  return out;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

struct Split {
  double value = 0;
  std::string suffix;          // lowercased, to compare: "gib"
  std::string written_suffix;  // as the user wrote it, for messages: "GiB"
};

// Splits "1.5GiB" into 1.5 and "gib".
Result<Split> SplitNumber(std::string_view text, std::string_view what) {
  const std::string s = WithoutSpaces(text);
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  double value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + i, value);
  if (i == 0 || ec != std::errc() || ptr != s.data() + i || !std::isfinite(value)) {
    return InvalidArgumentError("parse " + std::string(what) + " '" + std::string(text) +
                                "': expected a non-negative number with an optional suffix");
  }
  return Split{value, Lower(s.substr(i)), s.substr(i)};
}

Result<uint64_t> Scale(std::string_view text, double value, double multiple,
                       std::string_view what) {
  double v = value * multiple;
  if (v >= 18446744073709551615.0) {
    return InvalidArgumentError("parse " + std::string(what) + " '" + std::string(text) +
                                "': too large");
  }
  if (multiple == 1 && v != std::floor(v)) {
    return InvalidArgumentError("parse " + std::string(what) + " '" + std::string(text) +
                                "': expected a whole number");
  }
  return static_cast<uint64_t>(std::llround(v));
}

std::string Printf(const char* format, double v, const char* unit) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v, unit);
  return buf;
}

}  // namespace

Result<uint64_t> ParseBytes(std::string_view text) {
  STRATA_ASSIGN_OR_RETURN(Split split, SplitNumber(text, "size"));
  const std::string& suffix = split.suffix;
  double m;
  if (suffix.empty() || suffix == "b") {
    m = 1;
  } else if (suffix == "k" || suffix == "kb" || suffix == "kib") {
    m = 0x1p10;
  } else if (suffix == "m" || suffix == "mb" || suffix == "mib") {
    m = 0x1p20;
  } else if (suffix == "g" || suffix == "gb" || suffix == "gib") {
    m = 0x1p30;
  } else if (suffix == "t" || suffix == "tb" || suffix == "tib") {
    m = 0x1p40;
  } else {
    return InvalidArgumentError("parse size '" + std::string(text) + "': unknown suffix '" +
                                split.written_suffix + "' (use K, M, G, T or KiB, MiB, GiB, TiB)");
  }
  return Scale(text, split.value, m, "size");
}

Result<uint64_t> ParseCount(std::string_view text) {
  STRATA_ASSIGN_OR_RETURN(Split split, SplitNumber(text, "count"));
  const std::string& suffix = split.suffix;
  double m;
  if (suffix.empty()) {
    m = 1;
  } else if (suffix == "k") {
    m = 1e3;
  } else if (suffix == "m") {
    m = 1e6;
  } else if (suffix == "g" || suffix == "b") {
    m = 1e9;
  } else if (suffix == "t") {
    m = 1e12;
  } else {
    return InvalidArgumentError("parse count '" + std::string(text) + "': unknown suffix '" +
                                split.written_suffix +
                                "' (use K = 1e3, M = 1e6, B or G = 1e9, T = 1e12)");
  }
  return Scale(text, split.value, m, "count");
}

Result<double> ParseRate(std::string_view text) {
  STRATA_ASSIGN_OR_RETURN(Split split, SplitNumber(text, "rate"));
  std::string suffix = split.suffix;
  if (suffix.size() >= 2 && suffix.ends_with("/s")) suffix.resize(suffix.size() - 2);
  if (suffix.size() > 1 && suffix.back() == 'b') suffix.pop_back();  // "GB" -> "g", "GiB" -> "gi"
  double m;
  if (suffix.empty() || suffix == "b") {
    m = 1;
  } else if (suffix == "k" || suffix == "m" || suffix == "g" || suffix == "t") {
    m = suffix == "k" ? 1e3 : suffix == "m" ? 1e6 : suffix == "g" ? 1e9 : 1e12;
  } else if (suffix == "ki" || suffix == "mi" || suffix == "gi" || suffix == "ti") {
    m = suffix == "ki" ? 0x1p10 : suffix == "mi" ? 0x1p20 : suffix == "gi" ? 0x1p30 : 0x1p40;
  } else {
    return InvalidArgumentError("parse rate '" + std::string(text) + "': unknown unit '" +
                                split.written_suffix +
                                "' (use bytes per second: 2.5GB/s, 900M, 1GiB/s)");
  }
  return split.value * m;
}

std::string FormatBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return std::to_string(bytes) + " B";
  return Printf("%.2f %s", v, units[u]);
}

std::string FormatCount(uint64_t count) {
  if (count < 1000) return std::to_string(count);
  const char* units[] = {"", "K", "M", "B", "T"};
  double v = static_cast<double>(count);
  int u = 0;
  while (v >= 1000 && u < 4) {
    v /= 1000;
    ++u;
  }
  return Printf("%.2f %s", v, units[u]);
}

std::string FormatRate(double bytes_per_sec) {
  const char* units[] = {"B/s", "KB/s", "MB/s", "GB/s", "TB/s"};
  double v = bytes_per_sec;
  int u = 0;
  while (v >= 1000 && u < 4) {
    v /= 1000;
    ++u;
  }
  return Printf("%.2f %s", v, units[u]);
}

std::string FormatSeconds(double s) {
  if (s >= 1) return Printf("%.2f %s", s, "s");
  if (s >= 1e-3) return Printf("%.1f %s", s * 1e3, "ms");
  if (s >= 1e-6) return Printf("%.0f %s", s * 1e6, "us");
  return Printf("%.0f %s", s * 1e9, "ns");
}

}  // namespace strata
