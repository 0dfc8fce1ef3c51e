#include "tools/model_tensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "runtime/json_parse.h"

namespace strata::cli {
namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

// The safetensors format caps its header at 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

Status CannotRead(const std::string& path, int err) {
  if (err == ENOENT) return NotFoundError(fmt::format("{}: no such file", path));
  return InvalidArgumentError(fmt::format("{}: cannot read it: {}", path, std::strerror(err)));
}

Result<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return CannotRead(path, errno);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The product of `dims`, or InvalidArgument when it overflows.
Result<uint64_t> Product(const std::vector<uint64_t>& dims, const std::string& where) {
  uint64_t n = 1;
  for (uint64_t d : dims) {
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / d) {
      return InvalidArgumentError(fmt::format("{}: its element count overflows 64 bits", where));
    }
    n *= d;
  }
  return n;
}

Status AddTensor(ModelTensors& m, uint64_t elems, const std::string& where) {
  if (elems == 0) return OkStatus();  // nothing to optimize, no room in the layout
  if (m.total_elems > std::numeric_limits<uint64_t>::max() - elems) {
    return InvalidArgumentError(
        fmt::format("{}: the model's element count overflows 64 bits", where));
  }
  m.elems.push_back(elems);
  m.total_elems += elems;
  return OkStatus();
}

Status ReadSafetensors(const std::string& path, ModelTensors& m) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return CannotRead(path, errno);
  auto not_safetensors = [&](std::string_view why) {
    return InvalidArgumentError(
        fmt::format("{}: not a safetensors file ({}); give a .safetensors file, its "
                    "*.safetensors.index.json, or a text file with one tensor size per line",
                    path, why));
  };
  unsigned char len_bytes[8];
  if (!in.read(reinterpret_cast<char*>(len_bytes), 8)) {
    return not_safetensors("shorter than its 8-byte header length");
  }
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len_bytes[i];
  std::error_code ec;
  const uint64_t file_bytes = fs::file_size(path, ec);
  if (header_bytes == 0 || header_bytes > kMaxHeaderBytes ||
      (!ec && header_bytes > file_bytes - 8)) {
    return not_safetensors(fmt::format("its header length is {} bytes in a file of {} bytes",
                                       header_bytes, ec ? 0 : file_bytes));
  }
  std::string header(header_bytes, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header.size()))) {
    return not_safetensors("its header is cut short");
  }
  bool too_deep = false;
  ordered_json j = ParseJsonBounded<ordered_json>(header, &too_deep);
  if (too_deep) {
    return not_safetensors(fmt::format("its header nests deeper than {} levels", kMaxJsonDepth));
  }
  if (!j.is_object()) return not_safetensors("its header is not a JSON object");
  for (const auto& [name, t] : j.items()) {
    if (name == "__metadata__") continue;
    const std::string where = fmt::format("{}: tensor '{}'", path, name);
    if (!t.is_object() || !t.contains("shape") || !t["shape"].is_array()) {
      return InvalidArgumentError(fmt::format("{} has no shape list; the file is damaged", where));
    }
    std::vector<uint64_t> dims;
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned()) {
        return InvalidArgumentError(fmt::format(
            "{} has shape {}; dimensions are non-negative integers", where, t["shape"].dump()));
      }
      dims.push_back(d.get<uint64_t>());
    }
    STRATA_ASSIGN_OR_RETURN(uint64_t elems, Product(dims, where));
    STRATA_RETURN_IF_ERROR(AddTensor(m, elems, where));
  }
  m.files.push_back(path);
  return OkStatus();
}

// Every file the index's weight_map names, in the order they first appear.
Status ReadIndex(const std::string& path, ModelTensors& m) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  bool too_deep = false;
  ordered_json j = ParseJsonBounded<ordered_json>(text, &too_deep);
  if (too_deep) {
    return InvalidArgumentError(fmt::format(
        "{}: nests deeper than {} levels; not a safetensors index", path, kMaxJsonDepth));
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return InvalidArgumentError(fmt::format(
        "{}: not a safetensors index (a JSON object with a \"weight_map\" of tensor name -> "
        "file)",
        path));
  }
  std::vector<std::string> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) {
      return InvalidArgumentError(fmt::format("{}: weight_map['{}'] is {}; it must be a file name",
                                              path, name, file.dump()));
    }
    const std::string f = file.get<std::string>();
    if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
  }
  if (files.empty()) return InvalidArgumentError(fmt::format("{}: its weight_map is empty", path));
  const fs::path dir = fs::path(path).parent_path();
  for (const std::string& f : files) {
    STRATA_RETURN_IF_ERROR(
        ReadSafetensors((dir / f).string(), m).WithContext(fmt::format("{} names it", path)));
  }
  return OkStatus();
}

// One tensor per line: its element count or its shape (4096x4096), as the
// last word of the line, so "name 4096x4096" works too.
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\r'; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// The dimensions of a size as a list line writes it: an element count
// (16777216) or a shape whose dimensions are separated by x, a comma or
// spaces (4096x4096, 4096,4096, 4096 x 4096, 4096, 4096), perhaps in the
// brackets Python prints ((4096, 4096), [4096, 4096]). Empty when it is none
// of those.
std::vector<uint64_t> ParseSize(std::string_view s) {
  s = Trim(s);
  if (s.size() >= 2 &&
      ((s.front() == '(' && s.back() == ')') || (s.front() == '[' && s.back() == ']'))) {
    s = Trim(s.substr(1, s.size() - 2));
    if (!s.empty() && s.back() == ',') s = Trim(s.substr(0, s.size() - 1));  // (4096,)
  }
  std::vector<uint64_t> dims;
  while (true) {
    size_t n = 0;
    uint64_t d = 0;
    for (; n < s.size() && IsDigit(s[n]); ++n) {
      if (n == 19) return {};  // over 10^19: no tensor is that large
      d = d * 10 + static_cast<uint64_t>(s[n] - '0');
    }
    if (n == 0) return {};
    dims.push_back(d);
    s = Trim(s.substr(n));
    if (s.empty()) return dims;
    if (s.front() == 'x' || s.front() == ',') s = Trim(s.substr(1));
  }
}

// One tensor per line: an optional name (a first word that does not start
// with a digit or a bracket), then its size; `#` starts a comment.
Status ReadList(const std::string& path, ModelTensors& m) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  if (text.find('\0') != std::string::npos) {
    return InvalidArgumentError(fmt::format(
        "{}: a binary file, and not safetensors (name it *.safetensors if it is one)", path));
  }
  std::istringstream lines(text);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::string_view size = Trim(line);
    if (size.empty()) continue;
    if (!IsDigit(size.front()) && size.front() != '(' && size.front() != '[') {
      size_t end = 0;
      while (end < size.size() && !IsSpace(size[end])) ++end;
      size = Trim(size.substr(end));  // after the name
    }
    const std::vector<uint64_t> dims = ParseSize(size);
    const std::string where = fmt::format("{}:{}", path, number);
    if (size.empty()) {
      return InvalidArgumentError(
          fmt::format("{}: '{}' names no size; write 'name 4096x4096', one tensor per line", where,
                      Trim(line)));
    }
    if (dims.empty()) {
      return InvalidArgumentError(fmt::format(
          "{}: '{}' is not a tensor size; write an element count (16777216) or a shape "
          "(4096x4096, 4096,4096 or (4096, 4096)), after an optional name, one tensor per line",
          where, size));
    }
    STRATA_ASSIGN_OR_RETURN(uint64_t elems, Product(dims, where));
    STRATA_RETURN_IF_ERROR(AddTensor(m, elems, where));
  }
  m.files.push_back(path);
  return OkStatus();
}

Status ReadPath(const std::string& path, ModelTensors& m) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / "model.safetensors.index.json", ec)) {
      return ReadIndex((dir / "model.safetensors.index.json").string(), m);
    }
    if (fs::exists(dir / "model.safetensors", ec)) {
      return ReadSafetensors((dir / "model.safetensors").string(), m);
    }
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
    }
    if (files.empty()) {
      return NotFoundError(fmt::format(
          "{}: a directory with no model.safetensors.index.json and no *.safetensors file; "
          "give the model's file or index",
          path));
    }
    std::sort(files.begin(), files.end());
    for (const std::string& f : files) STRATA_RETURN_IF_ERROR(ReadSafetensors(f, m));
    return OkStatus();
  }
  if (EndsWith(path, ".index.json")) return ReadIndex(path, m);
  if (EndsWith(path, ".safetensors")) return ReadSafetensors(path, m);
  return ReadList(path, m);
}

}  // namespace

Result<ModelTensors> ReadModelTensors(const std::string& path) {
  ModelTensors m;
  STRATA_RETURN_IF_ERROR(ReadPath(path, m));
  if (m.elems.empty()) {
    return InvalidArgumentError(
        fmt::format("{}: no tensor with elements in it; nothing to plan", path));
  }
  return m;
}

}  // namespace strata::cli
