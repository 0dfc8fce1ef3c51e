// Checkpoints that misuse cannot harm: recorded shapes checked on load, one
// validator for every reader, exports that load_state_dict takes (shaped,
// fp32/bf16/fp16, Hugging Face shards) and that refuse harmful outputs, the
// save lock of a checkpoint directory.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "offload/checkpoint.h"
#include "runtime/testing/fault_storage.h"
#include "runtime/testing/test_util.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/offload/test_seed.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::CkptConfig;
using testing::Cluster;
using testing::ExpectSameSnapshot;
using testing::Snapshot;
using testing::TakeSnapshot;
using testing::TempDir;
using testing::TestSeed;
using testing::Where;

std::string ReadAll(const std::string& path) { return testing::ReadFileBytes(path); }
std::vector<std::string> Names(const std::string& dir) { return testing::DirNames(dir); }

void ExpectMentions(const Status& s, const std::string& what) {
  EXPECT_NE(s.message().find(what), std::string::npos) << "'" << what << "' not in: " << s;
}

// Shapes for testing::kCkptSizes = {1000, 37, 4096, 1, 0, 2500, 777, 64}, in
// registration (group) order, which Cluster's optimizers use.
TensorShapes ShapesOf(OffloadOptimizer& opt) {
  TensorShapes out;
  for (const Param& p : opt.params()) {
    switch (p.elems) {
      case 1000: out.push_back({25, 40}); break;
      case 4096: out.push_back({64, 8, 8}); break;
      case 2500: out.push_back({50, 50}); break;
      case 64: out.push_back({4, 16}); break;
      case 1: out.push_back({}); break;  // a scalar
      default: out.push_back({p.elems}); break;
    }
  }
  return out;
}

// Rewrites rank 0's manifest of the save in `dir` through `edit` and seals it
// again, as a tool that writes a wrong value with a valid checksum would.
void EditManifest(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::string path = (*reader)->info().save_dir + "/rank00000.json";
  nlohmann::json j = nlohmann::json::parse(ReadAll(path));
  edit(j);
  j.erase("manifest_xxh3");
  const std::string text = j.dump();
  j["manifest_xxh3"] = fmt::format("{:016x}", XXH3_64bits(text.data(), text.size()));
  std::ofstream(path) << j.dump(1);
}

// ---- Shapes ------------------------------------------------------------------------

TEST(ShapesTest, SavedShapesAreRecordedAndALoadWithOtherShapesChangesNothing) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kMixed), seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_TRUE(c.Train(seed, 2).ok());
  const TensorShapes shapes = ShapesOf(c.opt(0));
  ASSERT_TRUE(c.Save(dir.path(), {.shapes = shapes}).ok());
  auto reader = CheckpointReader::Open(dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_TRUE((*reader)->info().tensors[i].shape.has_value()) << i;
    EXPECT_EQ(*(*reader)->info().tensors[i].shape, shapes[i]) << i;
  }

  Cluster target(1, CkptConfig(Where::kMixed), seed + 1);
  ASSERT_TRUE(target.status().ok());
  const Snapshot before = *TakeSnapshot(target);
  // The same element counts, another shape: a transposed weight.
  TensorShapes transposed = shapes;
  for (auto& s : transposed) {
    if (s == std::vector<uint64_t>{25, 40}) s = {40, 25};
  }
  Status s = target.Load(dir.path(), {.shapes = transposed});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, "has shape [25, 40] in the checkpoint, [40, 25] here");
  ExpectSameSnapshot(*TakeSnapshot(target), before);
  // The right shapes, or none (a C++ trainer that knows only counts), load.
  ASSERT_TRUE(target.Load(dir.path(), {.shapes = shapes}).ok());
  ASSERT_TRUE(target.Load(dir.path()).ok());
  ExpectSameSnapshot(*TakeSnapshot(target), *TakeSnapshot(c));
}

TEST(ShapesTest, ShapesThatDoNotMatchTheElementCountsAreRefusedBeforeWriting) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  TensorShapes bad = ShapesOf(c.opt(0));
  bad[0] = {7, 7};
  Status s = c.Save(dir.path(), {.shapes = bad});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  ExpectMentions(s, "shape [7, 7]");
  EXPECT_TRUE(fs::is_empty(dir.path()));
  bad.pop_back();
  EXPECT_EQ(c.Save(dir.path(), {.shapes = bad}).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(fs::is_empty(dir.path()));
  // A product that wraps to the element count (3 x 0xAAAAAAAAAAAAAAAB is 1
  // mod 2^64): saved, and then refused by every reader.
  bad = ShapesOf(c.opt(0));
  size_t scalar = 0;
  while (c.opt(0).params()[scalar].elems != 1) ++scalar;
  bad[scalar] = {3, 0xAAAAAAAAAAAAAAABu};
  Status s2 = c.Save(dir.path(), {.shapes = bad});
  EXPECT_EQ(s2.code(), StatusCode::kInvalidArgument) << s2;
  ExpectMentions(s2, "has shape [3, 12297829382473034411] but 1 elems");
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

// A chunk past kMaxCheckpointChunkBytes: its buffers (queue_depth per file)
// failed to allocate and aborted the save (2^46), or made a save that needs
// gigabytes per array to read.
TEST(SaveOptionsTest, ChunkBytesPastTheLimitAreRefusedBeforeWriting) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  for (uint64_t chunk_bytes : {kMaxCheckpointChunkBytes + 4096, uint64_t{1} << 46}) {
    SCOPED_TRACE(chunk_bytes);
    Status s = c.Save(dir.path(), {.chunk_bytes = chunk_bytes});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    ExpectMentions(s, fmt::format("chunk_bytes {} is more than 268435456", chunk_bytes));
    EXPECT_TRUE(fs::is_empty(dir.path()));
  }
}

// ---- One validator ---------------------------------------------------------------------

// What load refuses, inspect (the reader that `strata inspect --verify` and
// export use) refuses too, with the same message.
TEST(ValidatorTest, ReadersRefuseWhatLoadRefusesNamingTheField) {
  const uint64_t seed = TestSeed();
  struct Case {
    std::string what;
    std::function<void(nlohmann::json&)> edit;
  };
  const std::vector<Case> cases = {
      {"groups[1].lr is -0.5", [](nlohmann::json& j) { j["groups"][1]["lr"] = -0.5; }},
      {"groups[0].beta2 is 1", [](nlohmann::json& j) { j["groups"][0]["beta2"] = 1.0; }},
      {"groups[0].eps is 0", [](nlohmann::json& j) { j["groups"][0]["eps"] = 0.0; }},
      // Finite in double, but not in the fp32 update (the engine's rule).
      {"groups[0].eps is 1e-50", [](nlohmann::json& j) { j["groups"][0]["eps"] = 1e-50; }},
      {"groups[1].lr is 1e+39", [](nlohmann::json& j) { j["groups"][1]["lr"] = 1e39; }},
      {"hysteresis_left 0", [](nlohmann::json& j) { j["loss_scaler"]["hysteresis_left"] = 0; }},
      {"scale -1", [](nlohmann::json& j) { j["loss_scaler"]["scale"] = -1.0; }},
      {"step -3 is negative", [](nlohmann::json& j) { j["step"] = -3; }},
      // Read as int64 it was -1 ("step -1 is negative"); 3.5 was read as 3.
      {"step is 18446744073709551615, out of the range",
       [](nlohmann::json& j) { j["step"] = UINT64_MAX; }},
      {"step is 3.5, not an integer", [](nlohmann::json& j) { j["step"] = 3.5; }},
      {"hysteresis_left is -1, out of the range",
       [](nlohmann::json& j) { j["loss_scaler"]["hysteresis_left"] = -1; }},
      {"shape[1] is 2.5, not an integer",
       [](nlohmann::json& j) {
         for (auto& t : j["tensors"]) {
           if (t["elems"] == 1000) t["shape"] = {400, 2.5};
         }
       }},
      {"optimizer is 'SGD'", [](nlohmann::json& j) { j["optimizer"] = "SGD"; }},
      // Arrays renamed in step with their files: only "master" was checked,
      // so readers took a momentum array as exp_avg.
      {"arrays are [master, momentum, exp_avg_sq]; a save of AdamW holds [master, exp_avg, "
       "exp_avg_sq]",
       [](nlohmann::json& j) {
         j["arrays"][1] = "momentum";
         for (auto& f : j["files"]) {
           if (f["array"] == "exp_avg") f["array"] = "momentum";
         }
       }},
      {"param_dtype is 'int8'", [](nlohmann::json& j) { j["param_dtype"] = "int8"; }},
      {"has shape [3, 3] but 1000 elems",
       [](nlohmann::json& j) {
         for (auto& t : j["tensors"]) {
           if (t["elems"] == 1000) t["shape"] = {3, 3};
         }
       }},
      // 2^62 more elems in the last tensor and the layout: shard_elems x 4
      // wrapped to the real file's payload_bytes, so Open took it; reads
      // used the wrapped offsets and export planned ~2^40 parts.
      {"layout.total_elems",
       [](nlohmann::json& j) {
         constexpr uint64_t kMore = uint64_t{1} << 62;
         nlohmann::json& last = j["tensors"].back();
         last["elems"] = last["elems"].get<uint64_t>() + kMore;
         for (const char* k : {"total_elems", "shard_elems", "tensor_elems"}) {
           j["layout"][k] = j["layout"][k].get<uint64_t>() + kMore;
         }
         j["shard"]["end"] = j["shard"]["end"].get<uint64_t>() + kMore;  // one rank
       }},
      // A chunk past kMaxCheckpointChunkBytes (2^46 aborted in aligned_alloc).
      {"chunk_bytes 536870912 is more than the 268435456 bytes a save writes",
       [](nlohmann::json& j) { j["chunk_bytes"] = uint64_t{512} << 20; }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    TempDir dir;
    Cluster c(1, CkptConfig(Where::kHost), seed);
    ASSERT_TRUE(c.status().ok());
    ASSERT_TRUE(c.Save(dir.path()).ok());
    EditManifest(dir.path(), k.edit);
    auto inspect = CheckpointReader::Open(dir.path());
    ASSERT_FALSE(inspect.ok());
    EXPECT_EQ(inspect.status().code(), StatusCode::kDataLoss) << inspect.status();
    ExpectMentions(inspect.status(), k.what);
    const Snapshot before = *TakeSnapshot(c);
    Status load = c.Load(dir.path());
    EXPECT_EQ(load.code(), StatusCode::kDataLoss) << load;
    ExpectMentions(load, std::string(inspect.status().message()));
    ExpectSameSnapshot(*TakeSnapshot(c), before);
    TempDir out;
    EXPECT_FALSE(ExportSafetensors(dir.path(), out.File("m.safetensors")).ok());
  }
}

// ---- Names ----------------------------------------------------------------------------

// A save made before OffloadOptimizer::Create refused two params of one name
// (per-submodule named_parameters()): state_dict_from_checkpoint keyed it by
// name and silently dropped tensors. Readers for a state_dict or an export
// now refuse it, naming both tensors; load takes it by index, and a save
// after that load exports.
TEST(DuplicateNamesTest, ReadersRefuseAnOldSaveWithDuplicateNamesAndLoadTakesItByIndex) {
  const uint64_t seed = TestSeed();
  TempDir dir, resaved, out;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 1).ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  std::string first;
  EditManifest(dir.path(), [&](nlohmann::json& j) {
    first = j["tensors"][0]["name"];
    j["tensors"][3]["name"] = first;
  });
  auto reader = CheckpointReader::Open(dir.path());
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kFailedPrecondition) << reader.status();
  ExpectMentions(reader.status(), "tensors 0 and 3 are both named '" + first + "'");
  ExpectMentions(reader.status(), "save again");
  auto exported = ExportSafetensors(dir.path(), out.File("m.safetensors"));
  ASSERT_FALSE(exported.ok());
  ExpectMentions(exported.status(), "tensors 0 and 3 are both named");
  EXPECT_TRUE(fs::is_empty(out.path()));
  EXPECT_TRUE(CheckpointReader::Open(dir.path(), {.duplicate_names = DuplicateNames::kAllow}).ok());

  Cluster target(1, CkptConfig(Where::kHost), seed + 1);
  ASSERT_TRUE(target.status().ok());
  Status s = target.Load(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(target), *TakeSnapshot(c));
  ASSERT_TRUE(target.Save(resaved.path()).ok());
  ASSERT_TRUE(ExportSafetensors(resaved.path(), out.File("m.safetensors")).ok());
}

// ---- Export ---------------------------------------------------------------------------

struct Safetensors {
  nlohmann::json header;
  std::string data;  // the data section
};
Safetensors ParseSafetensors(const std::string& path) {
  const std::string raw = ReadAll(path);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<uint8_t>(raw[k]);
  Safetensors st{.header = nlohmann::json::parse(raw.substr(8, n)), .data = raw.substr(8 + n)};
  return st;
}

class ExportShapedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = TestSeed();
    cluster_ = std::make_unique<Cluster>(2, CkptConfig(Where::kMixed, OptimizerType::kAdamW, 512, 2),
                                         seed_);
    ASSERT_TRUE(cluster_->status().ok()) << cluster_->status();
    ASSERT_TRUE(cluster_->Train(seed_, 2).ok());
    shapes_ = ShapesOf(cluster_->opt(0));
    ASSERT_TRUE(cluster_->Save(ckpt_.path(), {.shapes = shapes_}).ok());
    snap_ = *TakeSnapshot(*cluster_);
  }
  // The master weights of tensor i as `dtype` bytes, as the export must hold them.
  std::string Want(size_t i, DType dtype) const {
    std::string out;
    for (uint32_t bits : snap_.state[0][i]) {
      const float f = std::bit_cast<float>(bits);
      if (dtype == DType::kF32) {
        out.append(reinterpret_cast<const char*>(&f), 4);
      } else {
        const uint16_t h = dtype == DType::kBF16 ? F32ToBF16(f) : F32ToF16(f);
        out.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
    return out;
  }
  void ExpectTensors(const Safetensors& st, DType dtype, std::string_view st_dtype,
                     std::set<std::string>* seen) {
    for (const auto& [name, t] : st.header.items()) {
      if (name == "__metadata__") continue;
      size_t i = 0;
      while (i < cluster_->opt(0).params().size() && cluster_->opt(0).params()[i].name != name) ++i;
      ASSERT_LT(i, cluster_->opt(0).params().size()) << name;
      EXPECT_EQ(t.at("dtype"), st_dtype) << name;
      EXPECT_EQ(t.at("shape").get<std::vector<uint64_t>>(), shapes_[i]) << name;
      const uint64_t b = t.at("data_offsets")[0], e = t.at("data_offsets")[1];
      EXPECT_EQ(st.data.substr(b, e - b), Want(i, dtype)) << name;
      seen->insert(name);
    }
  }

  uint64_t seed_ = 0;
  TempDir ckpt_;
  std::unique_ptr<Cluster> cluster_;
  TensorShapes shapes_;
  Snapshot snap_;
};

TEST_F(ExportShapedTest, OneFileInEachDTypeHoldsShapedNamedMasterWeights) {
  for (const auto& [dtype, st_dtype] :
       std::vector<std::pair<DType, std::string>>{{DType::kF32, "F32"}, {DType::kBF16, "BF16"},
                                                  {DType::kF16, "F16"}}) {
    SCOPED_TRACE(st_dtype);
    TempDir out;
    auto r = ExportSafetensors(ckpt_.path(), out.File("model.safetensors"), {.dtype = dtype});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->files, std::vector<std::string>{out.File("model.safetensors")});
    std::set<std::string> seen;
    ExpectTensors(ParseSafetensors(out.File("model.safetensors")), dtype, st_dtype, &seen);
    EXPECT_EQ(seen.size(), cluster_->opt(0).params().size());
    EXPECT_EQ(Names(out.path()), std::vector<std::string>{"model.safetensors"});
  }
  TempDir out;
  EXPECT_EQ(ExportSafetensors(ckpt_.path(), out.File("m.safetensors"), {.dtype = DType::kF64})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

TEST_F(ExportShapedTest, ShardsFollowTheHuggingFaceLayoutWithAnIndex) {
  TempDir out;
  const std::string target = out.File("hf");
  // 8 KiB per shard: several shards, and the 16 KiB tensor alone in one.
  auto r = ExportSafetensors(ckpt_.path(), target, {.max_shard_bytes = 8192});
  ASSERT_TRUE(r.ok()) << r.status();
  const size_t n = r->files.size() - 1;
  ASSERT_GE(n, 3u);
  const nlohmann::json index = nlohmann::json::parse(ReadAll(target + "/model.safetensors.index.json"));
  EXPECT_EQ(r->files.back(), target + "/model.safetensors.index.json");
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), r->tensor_bytes);
  std::set<std::string> seen;
  uint64_t total = 0;
  for (size_t s = 0; s < n; ++s) {
    const std::string file = fmt::format("model-{:05}-of-{:05}.safetensors", s + 1, n);
    EXPECT_EQ(r->files[s], target + "/" + file);
    const Safetensors st = ParseSafetensors(r->files[s]);
    size_t tensors = 0;
    for (const auto& [name, t] : st.header.items()) {
      if (name == "__metadata__") continue;
      EXPECT_EQ(index.at("weight_map").at(name), file) << name;
      ++tensors;
    }
    // At most the limit, unless one tensor alone is larger.
    EXPECT_TRUE(st.data.size() <= 8192 || tensors == 1) << file << ": " << st.data.size();
    total += st.data.size();
    ExpectTensors(st, DType::kF32, "F32", &seen);
  }
  EXPECT_EQ(seen.size(), cluster_->opt(0).params().size());
  EXPECT_EQ(index.at("weight_map").size(), seen.size());
  EXPECT_EQ(total, r->tensor_bytes);
  // Everything fits in one shard: model.safetensors and no index, as Hugging Face does.
  auto one = ExportSafetensors(ckpt_.path(), out.File("one"), {.max_shard_bytes = 1 << 30});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(Names(out.File("one")), std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(ExportSafetensors(ckpt_.path(), out.File("x.safetensors"), {.max_shard_bytes = 8192})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

// An export never replaces what it reads, nor anything that is not a new or
// (with --force) a regular file, and a failed one leaves nothing behind.
TEST_F(ExportShapedTest, HarmfulOutputsAreRefusedBeforeAnyByteIsWritten) {
  const std::string latest = ckpt_.File("latest.json");
  const std::string latest_before = ReadAll(latest);
  const std::string save_dir = (*CheckpointReader::Open(ckpt_.path()))->info().save_dir;
  for (const std::string& inside :
       {latest, ckpt_.path(), save_dir + "/rank00000.json", ckpt_.File("sub/../model.safetensors"),
        save_dir + "/new.safetensors"}) {
    for (ExistingFile e : {ExistingFile::kRefuse, ExistingFile::kReplace}) {
      auto r = ExportSafetensors(ckpt_.path(), inside, {.existing = e});
      ASSERT_FALSE(r.ok()) << inside;
      EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status();
      ExpectMentions(r.status(), "inside the checkpoint directory");
    }
  }
  // A bare file name from inside the save (the working directory): it was
  // once resolved as a relative path outside every checkpoint, and written.
  const fs::path cwd = fs::current_path();
  fs::current_path(save_dir);
  auto bare = ExportSafetensors(ckpt_.path(), "m.safetensors");
  fs::current_path(cwd);
  EXPECT_EQ(bare.status().code(), StatusCode::kFailedPrecondition) << bare.status();
  ExpectMentions(bare.status(), "inside the checkpoint directory");
  EXPECT_FALSE(fs::exists(save_dir + "/m.safetensors"));
  EXPECT_EQ(ReadAll(latest), latest_before);
  ASSERT_TRUE(cluster_->Load(ckpt_.path()).ok()) << "the checkpoint is intact";

  TempDir out;
  const std::string file = out.File("model.safetensors");
  std::ofstream(file) << "precious";
  auto refused = ExportSafetensors(ckpt_.path(), file);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  ExpectMentions(refused.status(), "--force");
  EXPECT_EQ(ReadAll(file), "precious");
  auto forced = ExportSafetensors(ckpt_.path(), file, {.existing = ExistingFile::kReplace});
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_NE(ReadAll(file), "precious");
  // Not a regular file: refused even with --force.
  fs::create_directory(out.File("d.safetensors"));
  fs::create_symlink(file, out.File("link.safetensors"));
  for (const std::string& bad : {std::string("/dev/null"), out.File("d.safetensors"),
                                 out.File("link.safetensors")}) {
    auto r = ExportSafetensors(ckpt_.path(), bad, {.existing = ExistingFile::kReplace});
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << bad << ": " << r.status();
  }
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  // A device node named like an output file (root can make one; others skip this part).
  if (::mknod(out.File("dev.safetensors").c_str(), S_IFCHR | 0600, makedev(1, 3)) == 0) {
    auto r = ExportSafetensors(ckpt_.path(), out.File("dev.safetensors"),
                               {.existing = ExistingFile::kReplace});
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status();
    ExpectMentions(r.status(), "a device, not a regular file");
    EXPECT_TRUE(fs::is_character_file(out.File("dev.safetensors")));
  }
  // A shard directory whose second shard exists: nothing is written at all.
  fs::create_directory(out.File("hf"));
  std::ofstream(out.File("hf/model-00002-of-00005.safetensors")) << "x";
  auto partial = ExportSafetensors(ckpt_.path(), out.File("hf"), {.max_shard_bytes = 8192});
  EXPECT_EQ(partial.status().code(), StatusCode::kFailedPrecondition) << partial.status();
  EXPECT_EQ(Names(out.File("hf")), std::vector<std::string>{"model-00002-of-00005.safetensors"});
}

// The export goes through the storage like every other writer, so the fault
// storage reaches it: an IO error fails the export, naming the file, and
// leaves neither the output nor a temporary file.
TEST_F(ExportShapedTest, WriteFaultsFailTheExportAndLeaveNothing) {
  for (const auto& [what, faults] : std::vector<std::pair<std::string, testing::FaultOptions>>{
           {"write EIO", {.seed = 1, .write_eio_one_in = 2}},
           {"ENOSPC", {.seed = 2, .write_enospc_one_in = 2}},
           {"fsync EIO", {.seed = 3, .sync_eio_one_in = 1}}}) {
    SCOPED_TRACE(what);
    TempDir out;
    auto fault = testing::FaultStorage::Create(CreatePosixStorage(), faults);
    auto r = ExportSafetensors(ckpt_.path(), out.File("hf"),
                               {.max_shard_bytes = 8192, .storage = fault.get(),
                                .buffer_bytes = 4096});
    ASSERT_FALSE(r.ok());
    ExpectMentions(r.status(), out.File("hf/model-0000"));
    EXPECT_GT(fault->stats().injected_errors.load(), 0u);
    EXPECT_EQ(Names(out.File("hf")), std::vector<std::string>{}) << r.status();
  }
}

// The posix storage, whose rename onto a file named `target` takes effect
// and then fails, as when the directory's fsync after it fails.
class SyncAfterRenameFails final : public Storage {
 public:
  explicit SyncAfterRenameFails(std::string target) : target_(std::move(target)) {}
  std::string_view name() const override { return "sync-after-rename-fails(posix)"; }
  Result<std::unique_ptr<File>> Open(const std::string& path, const FileOptions& o) override {
    return base_->Open(path, o);
  }
  Status Remove(const std::string& path) override { return base_->Remove(path); }
  Status Rename(const std::string& from, const std::string& to) override {
    STRATA_RETURN_IF_ERROR(base_->Rename(from, to));
    if (fs::path(to).filename() != target_) return OkStatus();
    return ErrnoError(EIO, "fsync directory after renaming " + to);
  }
  Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) override {
    return base_->Lock(path);
  }

 private:
  std::string target_;
  std::unique_ptr<Storage> base_ = CreatePosixStorage();
};

// A shard whose commit failed after its rename (the directory sync) is in
// place: the message counts and names it with the shards before it. It was
// left out (and a first shard's failure named no shard in place at all).
TEST_F(ExportShapedTest, AShardRenamedBeforeItsCommitFailedIsNamedInPlace) {
  size_t n = 0;
  {
    TempDir dry;
    auto r = ExportSafetensors(ckpt_.path(), dry.File("hf"), {.max_shard_bytes = 8192});
    ASSERT_TRUE(r.ok()) << r.status();
    n = r->files.size() - 1;
    ASSERT_GE(n, 3u);
  }
  for (size_t k : {1u, 2u}) {
    SCOPED_TRACE(k);
    TempDir out;
    const std::string hf = out.File("hf");
    auto shard = [&](size_t s) { return fmt::format("model-{:05}-of-{:05}.safetensors", s, n); };
    SyncAfterRenameFails storage(shard(k));
    auto r = ExportSafetensors(ckpt_.path(), hf, {.max_shard_bytes = 8192, .storage = &storage});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInternal) << r.status();
    ExpectMentions(r.status(), "fsync directory after renaming");
    std::vector<std::string> in_place;
    for (size_t s = 1; s <= k; ++s) in_place.push_back(hf + "/" + shard(s));
    ExpectMentions(r.status(),
                   fmt::format("{} shard(s) are in place ({})", k, fmt::join(in_place, ", ")));
    for (const std::string& path : in_place) EXPECT_TRUE(fs::exists(path)) << path;
  }
}

// The checkpoint is read on a thread of the export's own, one part ahead of
// the conversion and writing on the caller's: the data files are never read
// on the calling thread, and the output is the same for any part size.
TEST_F(ExportShapedTest, TheCheckpointIsReadAheadOnAThreadOfItsOwn) {
  std::mutex mu;
  int on_caller = 0, elsewhere = 0;
  const std::thread::id caller = std::this_thread::get_id();
  auto reads = testing::FaultStorage::Create(
      CreatePosixStorage(),
      {.seed = seed_, .before_io = [&](IoOp op, const std::string& path, auto) {
         if (op != IoOp::kRead || !path.ends_with(".f32")) return;
         std::lock_guard<std::mutex> lock(mu);
         ++(std::this_thread::get_id() == caller ? on_caller : elsewhere);
       }});
  for (uint64_t buffer_bytes : {4096u, 1u << 20}) {
    SCOPED_TRACE(buffer_bytes);
    TempDir out;
    ExportOptions o{.dtype = DType::kBF16, .buffer_bytes = buffer_bytes};
    o.reader.storage = reads.get();
    auto r = ExportSafetensors(ckpt_.path(), out.File("m.safetensors"), o);
    ASSERT_TRUE(r.ok()) << r.status();
    std::set<std::string> seen;
    ExpectTensors(ParseSafetensors(out.File("m.safetensors")), DType::kBF16, "BF16", &seen);
    EXPECT_EQ(seen.size(), cluster_->opt(0).params().size());
  }
  EXPECT_GT(elsewhere, 0);
  EXPECT_EQ(on_caller, 0) << "data files read on the calling thread";
}

// An interruption (the Python module's Ctrl-C) stops the export between
// buffers with Cancelled, and nothing of it is left: neither the file being
// written nor the shards sealed before it (none is renamed into place
// before all are written).
TEST_F(ExportShapedTest, AnInterruptedExportLeavesNothing) {
  int polls = 0;
  const ExportOptions sharded = {.max_shard_bytes = 8192,
                                 .buffer_bytes = 4096,
                                 .interrupted = [&] { return ++polls < 0; }};
  {
    TempDir out;
    ASSERT_TRUE(ExportSafetensors(ckpt_.path(), out.File("hf"), sharded).ok());
  }
  const int total = polls;
  ASSERT_GT(total, 4);
  for (int at : {1, total / 2, total}) {
    SCOPED_TRACE(at);
    TempDir out;
    polls = 0;
    ExportOptions o = sharded;
    o.interrupted = [&] { return ++polls == at; };
    auto r = ExportSafetensors(ckpt_.path(), out.File("hf"), o);
    EXPECT_EQ(r.status().code(), StatusCode::kCancelled) << r.status();
    ExpectMentions(r.status(), "interrupted while writing " + out.File("hf/model-0000"));
    EXPECT_EQ(Names(out.File("hf")), std::vector<std::string>{}) << r.status();
  }
}

// A forced export over an earlier one of the same layout that fails part
// way leaves every file of the earlier one as
// it was: shards were once renamed into place one by one, so a failure at
// the third had replaced the first two and the index named a mix.
TEST_F(ExportShapedTest, AFailedForcedExportLeavesTheEarlierOneWhole) {
  TempDir out;
  const std::string hf = out.File("hf");
  ASSERT_TRUE(ExportSafetensors(ckpt_.path(), hf, {.max_shard_bytes = 8192}).ok());
  // The earlier export holds other weights: the model trained on since.
  ASSERT_TRUE(cluster_->Train(seed_ + 1, 1).ok());
  TempDir later;
  ASSERT_TRUE(cluster_->Save(later.path(), {.shapes = shapes_}).ok());
  std::map<std::string, std::string> before;
  for (const std::string& name : Names(hf)) before[name] = ReadAll(hf + "/" + name);
  ASSERT_GE(before.size(), 4u) << "three shards or more, and the index";
  auto unchanged = [&](const Status& s) {
    std::map<std::string, std::string> now;
    for (const std::string& name : Names(hf)) now[name] = ReadAll(hf + "/" + name);
    EXPECT_TRUE(now == before) << s;
  };
  ExportOptions o{
      .max_shard_bytes = 8192, .existing = ExistingFile::kReplace, .buffer_bytes = 4096};
  int polls = 0;
  o.interrupted = [&] { return ++polls < 0; };
  {
    TempDir dry;
    ASSERT_TRUE(ExportSafetensors(later.path(), dry.File("hf"), o).ok());
  }
  const int total = polls;
  for (int at : {total / 2, total}) {
    SCOPED_TRACE(at);
    polls = 0;
    o.interrupted = [&] { return ++polls == at; };
    auto r = ExportSafetensors(later.path(), hf, o);
    EXPECT_EQ(r.status().code(), StatusCode::kCancelled) << r.status();
    unchanged(r.status());
  }
  // Once it succeeds, the shards are the new ones.
  o.interrupted = nullptr;
  ASSERT_TRUE(ExportSafetensors(later.path(), hf, o).ok());
  size_t changed = 0;
  for (const auto& [name, bytes] : before) changed += ReadAll(hf + "/" + name) != bytes ? 1 : 0;
  EXPECT_GT(changed, 1u);
}

// An export killed part way (SIGKILL, an out-of-memory kill) leaves its
// temporary, up to a whole shard. The next export into that directory
// removes those of dead processes and says so; a live writer's, and other
// files', stay. A one-file export removes its own target's only.
TEST_F(ExportShapedTest, AnExportRemovesTheTemporariesOfExportsKilledPartWay) {
  TempDir out;
  const std::string dir = out.File("hf");
  fs::create_directory(dir);
  const std::string dead = std::to_string(testing::DeadPid());
  const std::string alive = std::to_string(::getpid());
  const std::vector<std::string> killed = {".model-00001-of-00007.safetensors.tmp-" + dead + "-a1",
                                           ".model.safetensors.tmp-" + dead + "-b2"};
  const std::vector<std::string> kept = {".model.safetensors.tmp-" + alive + "-c3",
                                         ".notes.txt.tmp-" + dead + "-d4"};
  for (const std::string& name : killed)
    std::ofstream((dir + "/" + name)) << std::string(1000, 'x');
  for (const std::string& name : kept) std::ofstream((dir + "/" + name)) << "y";
  testing::LogCapture log(LogLevel::kInfo);
  auto r = ExportSafetensors(ckpt_.path(), dir, {.max_shard_bytes = 8192});
  ASSERT_TRUE(r.ok()) << r.status();
  for (const std::string& name : killed) EXPECT_FALSE(fs::exists((dir + "/" + name))) << name;
  for (const std::string& name : kept) EXPECT_TRUE(fs::exists((dir + "/" + name))) << name;
  const auto lines = log.Find(LogLevel::kInfo, "removed 2 temporary file(s), 1.95 KiB");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find((dir + "/" + killed[0])), std::string::npos) << lines[0];

  // One file: its own target's temporaries only.
  const std::string mine = ".m.safetensors.tmp-" + dead + "-e5";
  const std::string other = ".model.safetensors.tmp-" + dead + "-f6";
  std::ofstream(out.File(mine)) << "z";
  std::ofstream(out.File(other)) << "z";
  ASSERT_TRUE(ExportSafetensors(ckpt_.path(), out.File("m.safetensors")).ok());
  EXPECT_FALSE(fs::exists(out.File(mine)));
  EXPECT_TRUE(fs::exists(out.File(other)));
}

// The output path as the user gave it: an empty one is refused (it used to
// write /model.safetensors), a directory with a trailing slash gives clean
// paths, and a missing parent directory is named as such.
TEST_F(ExportShapedTest, OutputPathsAreCheckedAndJoinedAsGiven) {
  const bool root_file_before = fs::exists("/model.safetensors");
  for (ExistingFile e : {ExistingFile::kRefuse, ExistingFile::kReplace}) {
    auto r = ExportSafetensors(ckpt_.path(), "", {.existing = e});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    ExpectMentions(r.status(), "the output path is empty");
  }
  if (!root_file_before) {
    EXPECT_FALSE(fs::exists("/model.safetensors"));
  }

  TempDir out;
  auto one = ExportSafetensors(ckpt_.path(), out.File("one/"));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->files, std::vector<std::string>{out.File("one/model.safetensors")});
  auto hf = ExportSafetensors(ckpt_.path(), out.File("hf//"), {.max_shard_bytes = 8192});
  ASSERT_TRUE(hf.ok()) << hf.status();
  ASSERT_GE(hf->files.size(), 3u);
  for (const std::string& f : hf->files) {
    EXPECT_EQ(f.find("//"), std::string::npos) << f;
    EXPECT_EQ(f.rfind(out.File("hf/model"), 0), 0u) << f;
    EXPECT_TRUE(fs::exists(f)) << f;
  }
  EXPECT_EQ(hf->files.back(), out.File("hf/model.safetensors.index.json"));

  const std::string missing = out.File("nope/model.safetensors");
  auto r = ExportSafetensors(ckpt_.path(), missing);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status();
  ExpectMentions(r.status(), missing + ": the parent directory " + out.File("nope") +
                                 " does not exist");
  EXPECT_EQ(r.status().message().find(".tmp-"), std::string_view::npos) << r.status();
  EXPECT_FALSE(fs::exists(out.File("nope")));
}

// An output directory holds one export layout: Hugging Face loaders prefer
// model.safetensors over an index, so a single file left beside new shards
// (or an index and shards beside a new single file) would load old weights.
// Without --force the export refuses, naming the stale files and writing
// nothing; with it they are removed. Files that are not the export's names
// are never touched.
TEST_F(ExportShapedTest, AnotherLayoutsFilesAreRefusedOrWithForceReplaced) {
  TempDir out;
  const std::string hf = out.File("hf");
  const std::vector<std::string> users = {"README.md", "config.json", "model-final.safetensors"};
  auto add_users = [&](const std::string& dir) {
    for (const std::string& name : users) std::ofstream(dir + "/" + name) << name;
  };
  auto names_without_users = [&](const std::string& dir) {
    std::vector<std::string> out;
    for (const std::string& n : Names(dir)) {
      if (std::find(users.begin(), users.end(), n) == users.end()) out.push_back(n);
    }
    for (const std::string& name : users) EXPECT_EQ(ReadAll(dir + "/" + name), name) << name;
    return out;
  };
  const ExportOptions sharded{.max_shard_bytes = 8192};
  ExportOptions sharded_force = sharded;
  sharded_force.existing = ExistingFile::kReplace;

  // One file, then shards.
  ASSERT_TRUE(ExportSafetensors(ckpt_.path(), hf).ok());
  add_users(hf);
  const std::vector<std::string> before = Names(hf);
  auto refused = ExportSafetensors(ckpt_.path(), hf, sharded);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  ExpectMentions(refused.status(), hf + "/model.safetensors");
  ExpectMentions(refused.status(), "--force");
  EXPECT_EQ(Names(hf), before) << "nothing written";
  auto forced = ExportSafetensors(ckpt_.path(), hf, sharded_force);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->removed, std::vector<std::string>{hf + "/model.safetensors"});
  std::vector<std::string> want;
  for (const std::string& f : forced->files) want.push_back(fs::path(f).filename().string());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names_without_users(hf), want);
  const size_t shards = forced->files.size() - 1;
  ASSERT_GE(shards, 3u);

  // Shards, then one file.
  refused = ExportSafetensors(ckpt_.path(), hf);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  ExpectMentions(refused.status(), hf + "/model.safetensors.index.json");
  ExpectMentions(refused.status(), fmt::format("{}/model-00001-of-{:05}.safetensors", hf, shards));
  EXPECT_EQ(names_without_users(hf), want) << "nothing written";
  forced = ExportSafetensors(ckpt_.path(), hf, {.existing = ExistingFile::kReplace});
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(names_without_users(hf), std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(forced->removed.size(), shards + 1);

  // Shards of another count: the old ones go too.
  ASSERT_TRUE(ExportSafetensors(ckpt_.path(), hf, sharded_force).ok());
  ExportOptions bigger = sharded_force;
  bigger.max_shard_bytes = 20000;
  forced = ExportSafetensors(ckpt_.path(), hf, bigger);
  ASSERT_TRUE(forced.ok()) << forced.status();
  ASSERT_LT(forced->files.size() - 1, shards);
  want.clear();
  for (const std::string& f : forced->files) want.push_back(fs::path(f).filename().string());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names_without_users(hf), want);

  // A stale name that is not a regular file is refused even with --force.
  fs::create_directory(hf + "/model-00001-of-00099.safetensors");
  const std::vector<std::string> kept = Names(hf);
  refused = ExportSafetensors(ckpt_.path(), hf, {.existing = ExistingFile::kReplace});
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  ExpectMentions(refused.status(), "a directory, not a regular file");
  EXPECT_EQ(Names(hf), kept);
}

// Load, export and the reader never ask to write a checkpoint's files: every
// open is FileAccess::kReadOnly, so a checkpoint the user cannot write (mode
// 0444, a read-only mount, another user's) reads. CliTest.AReadOnly... runs
// the command line as a user who cannot write it.
TEST_F(ExportShapedTest, ReadersOpenEveryCheckpointFileReadOnly) {
  auto counters = std::make_shared<IoCounters>();
  auto storage = CreateCountingStorage(CreatePosixStorage(), counters);
  auto reader = CheckpointReader::Open(ckpt_.path(), {.storage = storage.get()});
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_TRUE((*reader)->Verify().ok());
  TempDir out;
  auto exported = ExportSafetensors(ckpt_.path(), out.File("m.safetensors"),
                                    {.reader = {.storage = storage.get()}});
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_TRUE(cluster_->Load(ckpt_.path(), {.storage = storage.get()}).ok());
  EXPECT_GT(counters->opens.load(), 2u * 3u);  // the manifests and data files of 2 ranks
  EXPECT_EQ(counters->read_only_opens.load(), counters->opens.load());
}

// ---- Saving ---------------------------------------------------------------------------

// Two jobs saving into one directory: the second finds rank 0's save lock,
// fails on every rank naming the path and the holder, and writes nothing.
TEST(SaveLockTest, ASaveWhileAnotherRunsInTheDirectoryIsRefusedOnEveryRank) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(2, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  const std::vector<std::string> before = Names(dir.path());
  auto storage = CreatePosixStorage();
  {
    auto other = storage->Lock(dir.File("strata-save.lock"));
    ASSERT_TRUE(other.ok()) << other.status();
    std::vector<Status> status(2);
    ASSERT_FALSE(c.Run([&](int r) { return status[r] = SaveCheckpoint(c.opt(r), dir.path()); })
                     .ok());
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(status[r].code(), StatusCode::kFailedPrecondition) << status[r];
      ExpectMentions(status[r], "nothing was written");
    }
    ExpectMentions(status[0], dir.File("strata-save.lock"));
    ExpectMentions(status[0], "held by this process");
    ExpectMentions(status[0], "another save into");
    EXPECT_EQ(Names(dir.path()), before);
  }
  ASSERT_TRUE(c.Save(dir.path()).ok()) << "free again once the other save ends";
}

// A crash between writing latest.json's temporary file and renaming it leaves
// a ".latest.json.tmp-..." file; the next save, holding the lock, removes it.
TEST(SaveLockTest, RetentionRemovesTemporariesThatCrashedSavesLeft) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  std::ofstream(dir.File(".latest.json.tmp-4242-1f")) << "{";
  ASSERT_TRUE(c.Save(dir.path()).ok());
  for (const std::string& name : Names(dir.path())) {
    EXPECT_EQ(name.find(".tmp-"), std::string::npos) << name;
  }
}

}  // namespace
}  // namespace strata
