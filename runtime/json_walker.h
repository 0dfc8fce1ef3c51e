// JsonWalker, for JSON text from files and callers (configs, trace data).
#pragma once

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// Walks a document keeping the key path, to say where it failed to parse or
// where an object repeats a key (the DOM keeps only the last value, so a
// repeated key would silently drop a setting). nlohmann reports a syntax
// error and a number beyond a double (1e400, out_of_range.406) alike through
// parse_error(); this handler never throws, so neither can escape (a
// rethrowing re-parse once let the out_of_range one through, aborting the
// caller).
class JsonWalker final : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(std::size_t) override {
    return Push(Frame{.is_array = false, .key = {}, .index = 0, .keys = {}});
  }
  bool key(string_t& k) override {
    if (frames_.empty()) return true;
    frames_.back().key = k;
    if (!frames_.back().keys.insert(k).second && repeated_.empty()) repeated_ = Path();
    return true;
  }
  bool end_object() override { return Pop(); }
  bool start_array(std::size_t) override {
    return Push(Frame{.is_array = true, .key = {}, .index = 0, .keys = {}});
  }
  bool end_array() override { return Pop(); }
  bool parse_error(std::size_t /*position*/, const std::string& last_token,
                   const nlohmann::detail::exception& ex) override {
    failed_ = true;
    token_ = last_token;
    id_ = ex.id;
    what_ = ex.what();
    return false;
  }

  bool failed() const { return failed_; }
  // The path of the first key an object repeats; empty when none does.
  const std::string& repeated() const { return repeated_; }
  const std::string& token() const { return token_; }
  int id() const { return id_; }
  const std::string& what() const { return what_; }

  // "optimizer.params.lr", "optimizer.params.betas[1]"; empty at the top.
  std::string Path() const {
    std::string path;
    for (const Frame& f : frames_) {
      if (f.is_array) {
        path += fmt::format("[{}]", f.index);
      } else if (!f.key.empty()) {
        path += path.empty() ? f.key : "." + f.key;
      }
    }
    return path;
  }

 private:
  struct Frame {
    bool is_array = false;
    std::string key;             // the object's current key
    size_t index = 0;            // the array's current element
    std::set<std::string> keys;  // the object's keys so far
  };
  // A value is complete: the next error is past it, at its parent.
  bool Value() {
    if (frames_.empty()) return true;
    if (frames_.back().is_array) {
      ++frames_.back().index;
    } else {
      frames_.back().key.clear();
    }
    return true;
  }
  bool Push(Frame f) {
    frames_.push_back(std::move(f));
    return true;
  }
  bool Pop() {
    if (!frames_.empty()) frames_.pop_back();
    return Value();
  }

  std::vector<Frame> frames_;
  std::string repeated_;
  bool failed_ = false;
  std::string token_;
  int id_ = 0;
  std::string what_;
};

// The path ("optimizer.params.lr") of the first key an object of `text`
// repeats; "" when none does (or where the text stops being JSON).
inline std::string RepeatedJsonKey(std::string_view text) {
  JsonWalker walker;
  (void)nlohmann::json::sax_parse(text.begin(), text.end(), &walker);
  return walker.repeated();
}

}  // namespace strata
