// Checkpoints: bitwise round trips for every placement, exact resume,
// resharding N -> M ranks, export to safetensors, and bad input.
#include "offload/checkpoint.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "runtime/testing/fault_comm.h"
#include "runtime/testing/fault_storage.h"
#include "runtime/testing/test_util.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/offload/test_seed.h"

namespace strata {
namespace {

using testing::CkptConfig;
using testing::Cluster;
using testing::ExpectParamsAreMaster;
using testing::ExpectSameSnapshot;
using testing::Snapshot;
using testing::TakeSnapshot;
using testing::TempDir;
using testing::TestSeed;
using testing::Where;

// Partial offload: the first sub-groups' state on the device.
OffloadConfig WithGpu(OffloadConfig config, double gpu_fraction) {
  config.gpu_fraction = gpu_fraction;
  return config;
}

struct RoundTripCase {
  std::string name;
  Where save_where;
  Where load_where;
  OptimizerType optimizer = OptimizerType::kAdamW;
  double save_gpu = 0.0;  // gpu_fraction of the saving and the loading optimizer
  double load_gpu = 0.0;
};

class RoundTripTest : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(RoundTripTest, LoadGivesBitwiseTheSavedStateAndParams) {
  const RoundTripCase& c = GetParam();
  const uint64_t seed = TestSeed();
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Cluster a(1, WithGpu(CkptConfig(c.save_where, c.optimizer), c.save_gpu), seed);
  ASSERT_TRUE(a.status().ok()) << a.status();
  ASSERT_TRUE(a.Train(seed, 3).ok());
  ASSERT_TRUE(a.opt(0).SetGroupHyper(1, {.lr = 5e-4, .weight_decay = 0.01}).ok());
  Status s = a.opt(0).Save(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  Snapshot saved = *TakeSnapshot(a);

  Cluster b(1, WithGpu(CkptConfig(c.load_where, c.optimizer), c.load_gpu),
            seed + 1);  // other params
  ASSERT_TRUE(b.status().ok()) << b.status();
  ASSERT_EQ(a.opt(0).plan().device_sub_groups > 0, c.save_gpu > 0);
  ASSERT_EQ(b.opt(0).plan().device_sub_groups > 0, c.load_gpu > 0);
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
    ::testing::Values(
        RoundTripCase{"host", Where::kHost, Where::kHost},
        RoundTripCase{"nvme", Where::kNvme, Where::kNvme},
        RoundTripCase{"mixed", Where::kMixed, Where::kMixed},
        RoundTripCase{"host_to_nvme", Where::kHost, Where::kNvme},
        RoundTripCase{"nvme_to_mixed", Where::kNvme, Where::kMixed},
        RoundTripCase{"mixed_to_host", Where::kMixed, Where::kHost},
        RoundTripCase{"lion_mixed", Where::kMixed, Where::kMixed, OptimizerType::kLion},
        RoundTripCase{"adagrad_host", Where::kHost, Where::kNvme, OptimizerType::kAdagrad},
        // Every tier, and across fractions.
        RoundTripCase{"device_half_to_host", Where::kMixed, Where::kHost, OptimizerType::kAdamW,
                      0.5, 0.0},
        RoundTripCase{"host_to_device_all", Where::kHost, Where::kHost, OptimizerType::kAdamW, 0.0,
                      1.0},
        RoundTripCase{"device_mixed_to_device_nvme", Where::kMixed, Where::kNvme,
                      OptimizerType::kAdam, 0.3, 0.7}),
    [](const ::testing::TestParamInfo<RoundTripCase>& info) { return info.param.name; });

// ---- Resume -------------------------------------------------------------------

struct ResumeCase {
  std::string name;
  Where where;
  DType param_dtype = DType::kBF16;
  double gpu_fraction = 0.0;
};

class ResumeTest : public ::testing::TestWithParam<ResumeCase> {};

// Save at step k, load into a fresh optimizer, run to k + j: bitwise the
// state and params of the run that never stopped.
TEST_P(ResumeTest, SaveLoadAndContinueEqualsAnUninterruptedRun) {
  const ResumeCase& c = GetParam();
  const uint64_t seed = TestSeed();
  TempDir dir;
  OffloadConfig config = WithGpu(CkptConfig(c.where), c.gpu_fraction);
  config.param_dtype = c.param_dtype;
  if (c.param_dtype == DType::kF16) {
    // Dynamic loss scaling that grows every 2 steps: the scaler's state moves.
    config.loss_scaler = {
        .mode = LossScaleMode::kDynamic, .initial_scale_power = 8, .growth_interval = 2};
  }
  constexpr int kBefore = 3, kAfter = 4;
  Cluster run(1, config, seed);
  ASSERT_TRUE(run.status().ok()) << run.status();
  ASSERT_TRUE(run.Train(seed, kBefore).ok());
  Status s = run.opt(0).Save(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(run.Train(seed, kAfter).ok());
  Snapshot uninterrupted = *TakeSnapshot(run);

  Cluster resumed(1, config, seed ^ 0xabc);
  ASSERT_TRUE(resumed.status().ok()) << resumed.status();
  s = resumed.opt(0).Load(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resumed.opt(0).step_count(), kBefore);
  ASSERT_TRUE(resumed.Train(seed, kAfter).ok());
  Snapshot got = *TakeSnapshot(resumed);
  EXPECT_EQ(got.step, kBefore + kAfter);
  ExpectSameSnapshot(got, uninterrupted);
  ASSERT_TRUE(run.device().Synchronize().ok());
  ASSERT_TRUE(resumed.device().Synchronize().ok());
  for (size_t t = 0; t < run.model(0).size(); ++t) {
    EXPECT_EQ(resumed.model(0).ParamBytes(t), run.model(0).ParamBytes(t)) << "tensor " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, ResumeTest,
    ::testing::Values(ResumeCase{"host", Where::kHost}, ResumeCase{"nvme", Where::kNvme},
                      ResumeCase{"mixed", Where::kMixed},
                      ResumeCase{"mixed_fp16_scaled", Where::kMixed, DType::kF16},
                      ResumeCase{"device_mixed_fp16_scaled", Where::kMixed, DType::kF16, 0.4}),
    [](const ::testing::TestParamInfo<ResumeCase>& info) { return info.param.name; });

// ---- Reshard ------------------------------------------------------------------

// One rank trains k steps and saves; N-rank optimizers load it (1 -> N) and
// save again; M-rank optimizers load that (N -> M). Every load must give the
// single-rank state bitwise, and j more steps on M ranks the single rank's
// k + j state.
class ReshardTest : public ::testing::Test {
 protected:
  static constexpr int kBefore = 2, kAfter = 2;
  void SetUp() override {
    seed_ = TestSeed();
    Cluster ref(1, Config(1), seed_);
    ASSERT_TRUE(ref.status().ok()) << ref.status();
    ASSERT_TRUE(ref.Train(seed_, kBefore).ok());
    Status s = ref.Save(one_.path());
    ASSERT_TRUE(s.ok()) << s;
    at_k_ = *TakeSnapshot(ref);
    ASSERT_TRUE(ref.Train(seed_, kAfter).ok());
    at_kj_ = *TakeSnapshot(ref);
  }
  static OffloadConfig Config(int world) {
    return CkptConfig(Where::kMixed, OptimizerType::kAdamW, 512, static_cast<uint32_t>(world));
  }
  // Loads `dir` into `world` ranks and checks them against the reference.
  void LoadAndCheck(Cluster& c, const std::string& dir) {
    ASSERT_TRUE(c.status().ok()) << c.status();
    Status s = c.Load(dir);
    ASSERT_TRUE(s.ok()) << s;
    Snapshot got = *TakeSnapshot(c);
    ExpectSameSnapshot(got, at_k_);
    ExpectParamsAreMaster(c, at_k_);
  }
  void ContinueAndCheck(Cluster& c) {
    ASSERT_TRUE(c.Train(seed_, kAfter).ok());
    Snapshot got = *TakeSnapshot(c);
    ExpectSameSnapshot(got, at_kj_);
    ExpectParamsAreMaster(c, at_kj_);
  }
  // N ranks holding the reference state, saved into `dir`.
  void SaveWith(int world, const std::string& dir) {
    Cluster n(world, Config(world), seed_ + 7);
    LoadAndCheck(n, one_.path());
    Status s = n.Save(dir);
    ASSERT_TRUE(s.ok()) << s;
  }
  void Reshard(int from, int to) {
    TempDir dir;
    if (from == 1) {
      Cluster m(to, Config(to), seed_ + 9);
      LoadAndCheck(m, one_.path());
      ContinueAndCheck(m);
      return;
    }
    SaveWith(from, dir.path());
    auto reader = CheckpointReader::Open(dir.path());
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ((*reader)->info().world_size, static_cast<uint32_t>(from));
    Cluster m(to, Config(to), seed_ + 9);
    LoadAndCheck(m, dir.path());
    ContinueAndCheck(m);
  }

  uint64_t seed_ = 0;
  TempDir one_;
  Snapshot at_k_, at_kj_;
};

TEST_F(ReshardTest, OneToTwo) { Reshard(1, 2); }
TEST_F(ReshardTest, TwoToFour) { Reshard(2, 4); }
TEST_F(ReshardTest, FourToOne) { Reshard(4, 1); }
TEST_F(ReshardTest, ThreeToTwo) { Reshard(3, 2); }
TEST_F(ReshardTest, TwoToTwoKeepsTheWorldSize) { Reshard(2, 2); }

// The state of N ranks with half of it on the device, into M ranks with all
// or none of it there.
TEST_F(ReshardTest, AcrossGpuFractions) {
  TempDir dir;
  Cluster two(2, WithGpu(Config(2), 0.5), seed_ + 7);
  LoadAndCheck(two, one_.path());
  ASSERT_GT(two.opt(0).plan().device_sub_groups, 0u);
  Status s = two.Save(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  Cluster all(1, WithGpu(Config(1), 1.0), seed_ + 9);
  LoadAndCheck(all, dir.path());
  ASSERT_EQ(all.opt(0).plan().device_sub_groups, all.opt(0).sub_groups().size());
  ContinueAndCheck(all);
  Cluster four(4, Config(4), seed_ + 11);
  LoadAndCheck(four, dir.path());
  ContinueAndCheck(four);
}

TEST_F(ReshardTest, AnotherAlignmentMapsTensorByTensor) {
  OffloadConfig config = Config(2);
  config.align_elems = 256;  // every tensor sits elsewhere in the flat buffer
  Cluster m(2, config, seed_ + 9);
  LoadAndCheck(m, one_.path());
  ContinueAndCheck(m);
}

TEST_F(ReshardTest, ForbiddenReshardIsFailedPreconditionAndLoadsNothing) {
  TempDir dir;
  SaveWith(2, dir.path());
  Cluster m(1, Config(1), seed_ + 9);
  ASSERT_TRUE(m.status().ok());
  Snapshot before = *TakeSnapshot(m);
  Status s = LoadCheckpoint(m.opt(0), dir.path(), {.reshard = Reshard::kForbid});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("saved with 2 ranks"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rank00000.json"), std::string::npos) << s;
  ExpectSameSnapshot(*TakeSnapshot(m), before);
}

// ---- Export -------------------------------------------------------------------

std::vector<char> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Parses a safetensors file the way the format's spec reads: u64 LE header
// size, the JSON header, then the data; checks that every tensor is F32 and
// the offsets tile the data with no gap. Returns name -> fp32 values.
std::map<std::string, std::vector<float>> ParseSafetensors(const std::string& path,
                                                           nlohmann::json* metadata) {
  std::map<std::string, std::vector<float>> out;
  const std::vector<char> bytes = ReadAll(path);
  EXPECT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= uint64_t{static_cast<uint8_t>(bytes[k])} << (8 * k);
  EXPECT_EQ(n % 8, 0u) << "header size must keep the data 8-byte aligned";
  EXPECT_LE(8 + n, bytes.size());
  const nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + n);
  const uint64_t data_bytes = bytes.size() - 8 - n;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      *metadata = it.value();
      continue;
    }
    EXPECT_EQ(it.value().at("dtype"), "F32") << it.key();
    const auto shape = it.value().at("shape").get<std::vector<uint64_t>>();
    const auto off = it.value().at("data_offsets").get<std::vector<uint64_t>>();
    EXPECT_EQ(shape.size(), 1u);
    EXPECT_EQ(off[1] - off[0], shape[0] * 4) << it.key();
    EXPECT_LE(off[1], data_bytes);
    ranges.push_back({off[0], off[1]});
    std::vector<float> v(shape[0]);
    if (!v.empty()) std::memcpy(v.data(), bytes.data() + 8 + n + off[0], off[1] - off[0]);
    out[it.key()] = std::move(v);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (auto [b, e] : ranges) {
    EXPECT_EQ(b, at) << "the tensors must tile the data section";
    at = e;
  }
  EXPECT_EQ(at, data_bytes);
  return out;
}

TEST(ExportTest, SafetensorsHoldsEveryMasterTensorByName) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  // Two ranks, part of the state on the device: the export consolidates the
  // shards of every tier.
  Cluster c(2, WithGpu(CkptConfig(Where::kMixed, OptimizerType::kAdamW, 512, 2), 0.4), seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_GT(c.opt(0).plan().device_sub_groups, 0u);
  ASSERT_TRUE(c.Train(seed, 2).ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  Snapshot snap = *TakeSnapshot(c);
  TempDir out_dir;
  const std::string out = out_dir.File("model.safetensors");
  auto s = ExportSafetensors(dir.path(), out);
  ASSERT_TRUE(s.ok()) << s.status();
  nlohmann::json meta;
  auto tensors = ParseSafetensors(out, &meta);
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_EQ(meta.at("step"), "2");
  EXPECT_EQ(meta.at("world_size"), "2");
  ASSERT_EQ(tensors.size(), c.opt(0).params().size());
  for (size_t i = 0; i < c.opt(0).params().size(); ++i) {
    const std::string name = c.opt(0).params()[i].name;
    ASSERT_TRUE(tensors.count(name)) << name;
    const std::vector<float>& v = tensors[name];
    ASSERT_EQ(v.size(), snap.state[0][i].size()) << name;
    for (size_t k = 0; k < v.size(); ++k) {
      ASSERT_EQ(std::bit_cast<uint32_t>(v[k]), snap.state[0][i][k]) << name << " elem " << k;
    }
  }
  // PyTorch, where the system Python has it, reads the same bytes.
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0) {
    const std::string script = dir.File("check.py");
    std::ofstream(script) << R"PY(
import json, struct, sys, torch
raw = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
header = json.loads(raw[8:8 + n])
total = 0.0
for name, t in header.items():
    if name == '__metadata__':
        continue
    b, e = t['data_offsets']
    x = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=torch.float32) if e > b else torch.zeros(0)
    assert list(x.shape) == t['shape'], name
    total += float(x.double().sum())
print(repr(total))
)PY";
    const std::string cmd = "/usr/bin/python3 " + script + " " + out + " > " + dir.File("sum.txt");
    ASSERT_EQ(std::system(cmd.c_str()), 0);
    double want = 0;
    for (const auto& a : snap.state[0]) {
      for (uint32_t bits : a) want += static_cast<double>(std::bit_cast<float>(bits));
    }
    double got = 0;
    std::ifstream(dir.File("sum.txt")) >> got;
    EXPECT_NEAR(got, want, 1e-6 * (1 + std::fabs(want)));
  }
}

TEST(ExportTest, UnnamedParamsAreNumbered) {
  // A manifest whose names are empty: export falls back to param.<i>.
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  auto reader = *CheckpointReader::Open(dir.path());
  const std::string manifest = reader->info().save_dir + "/rank00000.json";
  nlohmann::json j = nlohmann::json::parse(ReadAll(manifest));
  for (auto& t : j["tensors"]) t["name"] = "";
  j.erase("manifest_xxh3");
  j["manifest_xxh3"] = fmt::format("{:016x}", XXH3_64bits(j.dump().data(), j.dump().size()));
  std::ofstream(manifest) << j.dump(1);
  TempDir out_dir;
  const std::string out = out_dir.File("unnamed.safetensors");
  auto s = ExportSafetensors(dir.path(), out);
  ASSERT_TRUE(s.ok()) << s.status();
  nlohmann::json meta;
  auto tensors = ParseSafetensors(out, &meta);
  EXPECT_TRUE(tensors.count("param.0"));
  EXPECT_TRUE(tensors.count("param.7"));
}

// ---- Bad input ------------------------------------------------------------------

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = TestSeed();
    saved_ = std::make_unique<Cluster>(1, CkptConfig(Where::kMixed), seed_);
    ASSERT_TRUE(saved_->status().ok());
    ASSERT_TRUE(saved_->Train(seed_, 2).ok());
    ASSERT_TRUE(saved_->Save(dir_.path()).ok());
    save_dir_ = (*CheckpointReader::Open(dir_.path()))->info().save_dir;
    target_ = std::make_unique<Cluster>(1, CkptConfig(Where::kMixed), seed_ + 1);
    ASSERT_TRUE(target_->status().ok());
    ASSERT_TRUE(target_->Train(seed_ + 5, 1).ok());
    before_ = *TakeSnapshot(*target_);
    ASSERT_TRUE(target_->device().Synchronize().ok());
    for (size_t t = 0; t < target_->model(0).size(); ++t) {
      params_before_.push_back(target_->model(0).ParamBytes(t));
    }
  }
  // Loads into the target and checks that the failure changed nothing.
  Status LoadExpectingFailure(const std::string& dir) {
    Status s = target_->opt(0).Load(dir);
    EXPECT_FALSE(s.ok());
    ExpectSameSnapshot(*TakeSnapshot(*target_), before_);
    EXPECT_TRUE(target_->device().Synchronize().ok());
    for (size_t t = 0; t < target_->model(0).size(); ++t) {
      EXPECT_EQ(target_->model(0).ParamBytes(t), params_before_[t]) << "params of tensor " << t;
    }
    return s;
  }
  std::string File(const std::string& name) const { return save_dir_ + "/" + name; }

  uint64_t seed_ = 0;
  TempDir dir_;
  std::string save_dir_;
  std::unique_ptr<Cluster> saved_, target_;
  Snapshot before_;
  std::vector<std::vector<uint8_t>> params_before_;
};

void ExpectMentions(const Status& s, const std::string& what) {
  EXPECT_NE(s.message().find(what), std::string::npos) << "'" << what << "' not in: " << s;
}

TEST_F(BadInputTest, NoCheckpointIsNotFound) {
  Status s = LoadExpectingFailure(dir_.File("nothing-here"));
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  ExpectMentions(s, "nothing-here");
  TempDir empty;
  s = LoadExpectingFailure(empty.path());
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  ExpectMentions(s, "latest.json");
  // A file is not a directory (it was "no such directory").
  std::ofstream(empty.File("a.safetensors")) << "x";
  s = LoadExpectingFailure(empty.File("a.safetensors"));
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  ExpectMentions(s, "a.safetensors: not a directory");
  // The readers (inspect, export, state_dict_from_checkpoint) name an empty
  // directory as such (they said "open checkpoint : no such directory").
  auto reader = CheckpointReader::Open("");
  EXPECT_EQ(reader.status().code(), StatusCode::kInvalidArgument) << reader.status();
  ExpectMentions(reader.status(), "open checkpoint '': the checkpoint directory is empty");
}

TEST_F(BadInputTest, MissingDataFileIsNotFoundNamingIt) {
  std::filesystem::remove(File("rank00000.exp_avg.f32"));
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  ExpectMentions(s, "rank00000.exp_avg.f32");
}

TEST_F(BadInputTest, MissingManifestIsNotFound) {
  std::filesystem::remove(File("rank00000.json"));
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  ExpectMentions(s, "rank00000.json");
}

// latest.json naming a save that is gone says so and lists the saves there
// (it said "rank00000.json is missing: copy every rank's files").
TEST_F(BadInputTest, LatestJsonNamingAMissingSaveSaysSoAndListsTheSaves) {
  const std::string id = std::filesystem::path(save_dir_).filename().string();
  const std::string moved = dir_.File("step-0000000001-0123456789ab");
  std::filesystem::rename(save_dir_, moved);
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  ExpectMentions(s, dir_.File("latest.json") + " names " + id + ", which does not exist in " +
                        dir_.path() + " (saves there: step-0000000001-0123456789ab)");
  ExpectMentions(s, "load one of them by its directory, or restore " + id);
  std::filesystem::remove_all(moved);
  s = LoadExpectingFailure(dir_.path());
  ExpectMentions(s, "(saves there: none)");
}

// latest.json that is a directory: load says what is wrong and what to do
// (it said EISDIR only); save refuses before writing anything (it wrote the
// save, failed to publish, and said the save "is complete and kept").
TEST_F(BadInputTest, LatestJsonThatIsADirectoryIsNamedByLoadAndSave) {
  const std::string latest = dir_.File("latest.json");
  std::filesystem::remove(latest);
  std::filesystem::create_directory(latest);
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, latest + " is not a file (a directory), so it names no save: move it away");
  ExpectMentions(s, std::filesystem::path(save_dir_).filename().string());
  const auto before = testing::DirNames(dir_.path());
  saved_.reset();  // else the save is refused as a second live optimizer saving into dir_
  s = target_->Save(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, latest + " is a directory, not the file Save writes");
  ExpectMentions(s, "nothing was written");
  EXPECT_EQ(s.message().find("complete and kept"), std::string::npos) << s;
  EXPECT_EQ(testing::DirNames(dir_.path()), before);
}

// latest.json that is a symbolic link: loads read through it, and a save
// refuses before writing anything (it wrote every rank's part, then failed
// to publish saying "give the path of a new file", a path nobody gave).
TEST_F(BadInputTest, LatestJsonThatIsASymlinkIsRefusedBySaveBeforeWriting) {
  const std::string latest = dir_.File("latest.json");
  const std::string real = dir_.File("real-latest.json");
  std::filesystem::rename(latest, real);
  std::filesystem::create_symlink(real, latest);
  ASSERT_TRUE(target_->Load(dir_.path()).ok()) << "a load reads through the link";
  const auto before = testing::DirNames(dir_.path());
  Status s = target_->Save(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, latest + " is a symbolic link, not the file Save writes");
  ExpectMentions(s, "put the file it points to in its place");
  ExpectMentions(s, "nothing was written");
  EXPECT_EQ(testing::DirNames(dir_.path()), before);
}

// What a first save killed before it finished leaves (a save directory of
// temporaries, no latest.json) is named as such, in the directory and in the
// save directory; it read as "this is not a checkpoint".
TEST(OpenTest, WhatAnUnfinishedFirstSaveLeftIsNamedAsSuch) {
  namespace fs = std::filesystem;
  TempDir dir;
  Result<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(dir.path());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  ExpectMentions(r.status(), "this is not a checkpoint");
  const std::string save = dir.File("step-0000000001-3579d8204a98");
  fs::create_directories(save);
  std::ofstream(save + "/.rank00000.master.f32.tmp-20916-c234c6218a3519f9") << "partial";
  r = CheckpointReader::Open(dir.path());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  ExpectMentions(r.status(), "no save here finished");
  ExpectMentions(r.status(), "step-0000000001-3579d8204a98");
  r = CheckpointReader::Open(save);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  ExpectMentions(r.status(), "this save did not finish");
}

// A checkpoint, or a save directory, this user cannot read (mode 000) is
// EACCES naming the directory; it read as "not a checkpoint" and
// "rank00000.json is missing". As root this runs as nobody.
TEST_F(BadInputTest, AnUnreadableCheckpointIsEaccesNamingTheDirectory) {
  namespace fs = std::filesystem;
  const fs::perms readable = fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                             fs::perms::others_read | fs::perms::others_exec;
  fs::permissions(dir_.path(), readable);
  auto open = [&](const std::string& locked, const std::string& dir) {
    fs::permissions(locked, fs::perms::none);
    auto failed = testing::RunUnprivileged([&]() -> std::string {
      auto r = CheckpointReader::Open(dir);
      if (r.ok()) return "opened";
      const std::string m = r.status().ToString();
      for (const std::string& needle :
           {std::string("EACCES"), "may not read " + locked + " (mode 000",
            std::string("give this user read and search permission")}) {
        if (m.find(needle) == std::string::npos) return "no '" + needle + "' in " + m;
      }
      return "";
    });
    fs::permissions(locked, readable);
    return failed;
  };
  auto failed = open(dir_.path(), dir_.path());
  if (!failed) GTEST_SKIP() << "cannot switch to uid 65534";
  EXPECT_EQ(*failed, "");
  EXPECT_EQ(open(save_dir_, dir_.path()), "");
  EXPECT_EQ(open(save_dir_, save_dir_ + "/"), "");
}

// Inspect without --verify: every data file is there with its size.
TEST_F(BadInputTest, CheckFilesNamesAMissingOrTruncatedDataFile) {
  auto reader = CheckpointReader::Open(dir_.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_TRUE((*reader)->CheckFiles().ok());
  std::filesystem::resize_file(File("rank00000.master.f32"), 4096);
  reader = CheckpointReader::Open(dir_.path());
  Status s = (*reader)->CheckFiles();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  ExpectMentions(s, File("rank00000.master.f32") + " has 4096 bytes");
  std::filesystem::remove(File("rank00000.exp_avg_sq.f32"));
  reader = CheckpointReader::Open(dir_.path());
  s = (*reader)->CheckFiles(std::vector<uint32_t>{0});
  ExpectMentions(s, "rank00000.master.f32");
  std::filesystem::remove(File("rank00000.master.f32"));
  reader = CheckpointReader::Open(dir_.path());
  s = (*reader)->CheckFiles();
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  ExpectMentions(s, File("rank00000.master.f32") + " is missing");
}

TEST_F(BadInputTest, TruncatedDataFileIsDataLoss) {
  const std::string f = File("rank00000.master.f32");
  std::filesystem::resize_file(f, std::filesystem::file_size(f) - 4096);
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  ExpectMentions(s, "rank00000.master.f32");
  ExpectMentions(s, "truncated");
}

TEST_F(BadInputTest, TruncatedManifestIsDataLoss) {
  const std::string f = File("rank00000.json");
  std::filesystem::resize_file(f, std::filesystem::file_size(f) / 2);
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  ExpectMentions(s, "rank00000.json");
}

TEST_F(BadInputTest, EditedManifestFailsItsChecksum) {
  const std::string f = File("rank00000.json");
  nlohmann::json j = nlohmann::json::parse(ReadAll(f));
  j["groups"][0]["lr"] = 0.5;
  std::ofstream(f) << j.dump(1);
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  ExpectMentions(s, "manifest_xxh3");
}

// A manifest with a value nested 100,000 deep (crafted): nlohmann parses it,
// but copying and dump() recurse per level, and the checksum overflowed the
// stack (SIGSEGV in load, inspect and export). Refused as DataLoss instead.
TEST_F(BadInputTest, AManifestNestedTooDeepIsDataLossNotACrash) {
  const std::string f = File("rank00000.json");
  const std::vector<char> bytes = ReadAll(f);
  std::string text(bytes.begin(), bytes.end());
  const size_t brace = text.find('{');
  ASSERT_NE(brace, std::string::npos);
  const int depth = 100000;
  text.insert(brace + 1, "\"x\": " + std::string(depth, '[') + std::string(depth, ']') + ", ");
  std::ofstream(f) << text;
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  ExpectMentions(s, "rank00000.json is not a valid manifest (nested deeper than 64 levels");
}

TEST_F(BadInputTest, NewerFormatVersionIsFailedPrecondition) {
  const std::string f = File("rank00000.json");
  nlohmann::json j = nlohmann::json::parse(ReadAll(f));
  j["format_version"] = kCheckpointFormatVersion + 1;
  std::ofstream(f) << j.dump(1);
  Status s = LoadExpectingFailure(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, "format version 2");
  ExpectMentions(s, "newer strata");
}

TEST_F(BadInputTest, AnotherModelIsFailedPrecondition) {
  std::vector<uint64_t> sizes = testing::kCkptSizes;
  sizes[2] += 1;
  Cluster other(1, CkptConfig(Where::kHost), seed_, sizes);
  ASSERT_TRUE(other.status().ok());
  Snapshot before = *TakeSnapshot(other);
  Status s = other.opt(0).Load(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, "another model");
  ExpectMentions(s, "rank00000.json");
  ExpectSameSnapshot(*TakeSnapshot(other), before);

  Cluster lion(1, CkptConfig(Where::kHost, OptimizerType::kLion), seed_);
  ASSERT_TRUE(lion.status().ok());
  s = lion.opt(0).Load(dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, "AdamW");
}

// Adam and AdamW keep the same arrays: a save of one used to load silently
// into the other, whose update then went on under another weight decay.
TEST_F(BadInputTest, AdamAndAdamWSavesAreRefusedByTheOtherNamingBoth) {
  Cluster adam(1, CkptConfig(Where::kHost, OptimizerType::kAdam), seed_);
  ASSERT_TRUE(adam.status().ok());
  const Snapshot before = *TakeSnapshot(adam);
  Status s = adam.opt(0).Load(dir_.path());  // saved by AdamW
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, "the checkpoint was saved by AdamW (decoupled weight decay");
  ExpectMentions(s, "this optimizer is Adam (L2 weight decay: adam_w_mode false");
  ExpectMentions(s, "configure the optimizer the checkpoint was saved with");
  ExpectSameSnapshot(*TakeSnapshot(adam), before);

  TempDir adam_dir;
  ASSERT_TRUE(adam.Save(adam_dir.path()).ok());
  s = target_->opt(0).Load(adam_dir.path());  // an AdamW optimizer
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, "the checkpoint was saved by Adam (L2 weight decay");
  ExpectSameSnapshot(*TakeSnapshot(*target_), before_);
}

// Where no group decays the two rules are one update: a save of one loads
// into the other (a DeepSpeed "type": "Adam" config saved as Adam before it
// resolved to AdamW), and the state comes through bitwise.
TEST_F(BadInputTest, AdamAndAdamWSavesWithoutWeightDecayLoadIntoEachOther) {
  Cluster adam(1, CkptConfig(Where::kHost, OptimizerType::kAdam), seed_);
  Cluster adamw(1, CkptConfig(Where::kHost, OptimizerType::kAdamW), seed_ + 1);
  ASSERT_TRUE(adam.status().ok());
  ASSERT_TRUE(adamw.status().ok());
  for (Cluster* c : {&adam, &adamw}) {
    for (uint32_t g = 0; g < c->opt(0).num_groups(); ++g) {
      GroupHyper h = c->opt(0).group_hyper(g);
      h.weight_decay = 0;
      ASSERT_TRUE(c->opt(0).SetGroupHyper(g, h).ok());
    }
  }
  TempDir adam_dir;
  ASSERT_TRUE(adam.Save(adam_dir.path()).ok());
  const Snapshot saved = *TakeSnapshot(adam);
  Status s = adamw.opt(0).Load(adam_dir.path());
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(adamw), saved);
  // One group that decays, and the rules differ again: refused.
  GroupHyper h = adamw.opt(0).group_hyper(0);
  h.weight_decay = 0.1;
  ASSERT_TRUE(adamw.opt(0).SetGroupHyper(0, h).ok());
  s = adamw.opt(0).Load(adam_dir.path());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, "the checkpoint was saved by Adam (L2 weight decay");
}

TEST_F(BadInputTest, FlippedByteInEachDataFileIsDataLossNamingIt) {
  std::mt19937_64 rng(seed_);
  for (const char* name :
       {"rank00000.master.f32", "rank00000.exp_avg.f32", "rank00000.exp_avg_sq.f32"}) {
    SCOPED_TRACE(name);
    const std::string f = File(name);
    const uint64_t at = rng() % std::filesystem::file_size(f);
    testing::FlipBits(f, at, static_cast<uint8_t>(1 << (rng() % 8)));
    Status s = LoadExpectingFailure(dir_.path());
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
    ExpectMentions(s, name);
    // The same file fails `inspect --verify`'s check too.
    auto reader = CheckpointReader::Open(dir_.path());
    ASSERT_TRUE(reader.ok());
    Status v = (*reader)->Verify();
    EXPECT_EQ(v.code(), StatusCode::kDataLoss) << v;
    ExpectMentions(v, name);
    // A fresh save of the same state for the next file.
    ASSERT_TRUE(saved_->Save(dir_.path()).ok());
    save_dir_ = (*CheckpointReader::Open(dir_.path()))->info().save_dir;
  }
  // After all of that the newest save loads.
  Status s = target_->opt(0).Load(dir_.path());
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(*target_), *TakeSnapshot(*saved_));
}

// ---- Durability: the fault storage's "drop unsynced writes" -------------------------

TEST(DurabilityTest, EverythingASaveWroteIsSyncedAndAFailedSaveLeavesThePreviousOne) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  auto fault = testing::FaultStorage::Create(
      CreatePosixStorage(), {.seed = seed, .drop_unsynced = testing::DropUnsynced::kOn});
  Cluster c(1, CkptConfig(Where::kMixed), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 2).ok());
  const SaveOptions save{.storage = fault.get(), .chunk_bytes = 8192, .queue_depth = 4};
  Status s = SaveCheckpoint(c.opt(0), dir.path(), save);
  ASSERT_TRUE(s.ok()) << s;
  Snapshot first = *TakeSnapshot(c);
  // Power loss right after the save: every byte of it was fsync'd.
  ASSERT_TRUE(fault->SimulateCrash().ok());
  {
    Cluster check(1, CkptConfig(Where::kHost), seed + 1);
    s = LoadCheckpoint(check.opt(0), dir.path(), {.storage = fault.get()});
    ASSERT_TRUE(s.ok()) << s;
    ExpectSameSnapshot(*TakeSnapshot(check), first);
  }
  // Saves that fail part way (a write or an fsync), then power loss: the
  // unsynced bytes turn to garbage, and the first save is what loads.
  ASSERT_TRUE(c.Train(seed, 1).ok());
  for (testing::FaultOptions f :
       {testing::FaultOptions{.write_eio_one_in = 3},
        testing::FaultOptions{.write_enospc_one_in = 5},
        testing::FaultOptions{.sync_eio_one_in = 2},
        testing::FaultOptions{.short_io_one_in = 2, .sync_eio_one_in = 4}}) {
    f.seed = seed;
    f.drop_unsynced = testing::DropUnsynced::kOn;
    fault->SetOptions(f);
    for (int attempt = 0; attempt < 5; ++attempt) {
      s = SaveCheckpoint(c.opt(0), dir.path(), save);
      if (!s.ok()) break;
    }
    fault->SetOptions({.drop_unsynced = testing::DropUnsynced::kOn});
    ASSERT_TRUE(fault->SimulateCrash().ok());
    Cluster check(1, CkptConfig(Where::kHost), seed + 1);
    s = LoadCheckpoint(check.opt(0), dir.path(), {.storage = fault.get()});
    ASSERT_TRUE(s.ok()) << s;
    Snapshot got = *TakeSnapshot(check);
    // Either the faults spared a whole save (then it is the newest state)
    // or the first save is still the current one.
    if (got.step == first.step) {
      ExpectSameSnapshot(got, first);
    } else {
      ExpectSameSnapshot(got, *TakeSnapshot(c));
    }
  }
}

// A drive that reports a write it did not finish (a torn write that is then
// fsync'd without error) is caught by the checksums on load, and the save
// before it, which retention keeps, still loads.
TEST(DurabilityTest, TornWritesAreCaughtAndThePreviousSaveStillLoads) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  auto fault = testing::FaultStorage::Create(CreatePosixStorage(), {.seed = seed});
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 2).ok());
  const SaveOptions save{.storage = fault.get(), .chunk_bytes = 8192, .queue_depth = 4};
  ASSERT_TRUE(SaveCheckpoint(c.opt(0), dir.path(), save).ok());
  Snapshot first = *TakeSnapshot(c);
  const std::string first_dir = (*CheckpointReader::Open(dir.path()))->info().save_dir;
  ASSERT_TRUE(c.Train(seed, 1).ok());
  fault->SetOptions({.seed = seed, .torn_write_one_in = 1});
  Status s = SaveCheckpoint(c.opt(0), dir.path(), save);
  fault->SetOptions({});
  ASSERT_TRUE(s.ok()) << "a torn write reports success: " << s;
  ASSERT_GT(fault->stats().torn_writes.load(), 0u);

  Cluster check(1, CkptConfig(Where::kHost), seed + 1);
  ASSERT_TRUE(check.status().ok());
  Snapshot before = *TakeSnapshot(check);
  s = check.opt(0).Load(dir.path());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  // The torn file is named: a data file, a manifest or latest.json.
  EXPECT_NE(s.message().find(dir.path() + "/"), std::string::npos) << s;
  ExpectSameSnapshot(*TakeSnapshot(check), before);
  ASSERT_TRUE(std::filesystem::exists(first_dir)) << "retention keeps the previous save";
  s = check.opt(0).Load(first_dir);
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(check), first);
}

// ---- A failed save removes what it wrote -------------------------------------------

// The save directories in `dir`, sorted (by step).
std::vector<std::string> SaveDirs(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The posix storage, failing what a test names by file name (the file, or an
// AtomicFileWriter temporary of it): opening it to write (ENOSPC, a full disk),
// renaming onto it (EIO, nothing renamed; or EIO after the rename, as when
// the directory fsync fails), removing it (EACCES), taking a lock (EROFS, as
// FileLock on a read-only mount). Counts the data files
// committed. Set up before the save starts; then read-only, so shared by
// every rank's thread.
class RiggedStorage final : public Storage {
 public:
  enum class RenameFault : uint8_t { kBefore, kAfter };
  std::string fail_open;
  std::string fail_rename;
  RenameFault rename_fault = RenameFault::kBefore;
  std::string fail_remove;
  bool read_only_lock = false;   // Lock fails as FileLock does on a read-only mount
  std::string read_latest_from;  // reads of latest.json read this file instead

  std::string_view name() const override { return "rigged(posix)"; }
  Result<std::unique_ptr<File>> Open(const std::string& path, const FileOptions& o) override {
    if (o.access == FileAccess::kReadWrite && Is(path, fail_open)) {
      return ErrnoError(ENOSPC, "open " + path);
    }
    if (o.access == FileAccess::kReadOnly && !read_latest_from.empty() &&
        std::filesystem::path(path).filename() == "latest.json") {
      return base_->Open(read_latest_from, o);
    }
    return base_->Open(path, o);
  }
  Status Remove(const std::string& path) override {
    if (Is(path, fail_remove)) return ErrnoError(EACCES, "remove " + path);
    return base_->Remove(path);
  }
  Status Rename(const std::string& from, const std::string& to) override {
    if (Is(to, fail_rename) && rename_fault == RenameFault::kBefore) {
      return ErrnoError(EIO, "rename " + from + " to " + to);
    }
    STRATA_RETURN_IF_ERROR(base_->Rename(from, to));
    if (Is(to, fail_rename)) return ErrnoError(EIO, "fsync directory after renaming " + to);
    if (to.ends_with(".f32")) ++data_files_committed;
    return OkStatus();
  }
  Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) override {
    if (read_only_lock) {
      return Status(StatusCode::kFailedPrecondition,
                    std::string(ErrnoError(EROFS, "lock " + path).message()) +
                        ": the directory is on a read-only filesystem; give a directory on a "
                        "writable one");
    }
    return base_->Lock(path);
  }

  std::atomic<int> data_files_committed{0};

 private:
  static bool Is(const std::string& path, const std::string& target) {
    if (target.empty()) return false;
    const std::string name = std::filesystem::path(path).filename().string();
    return name == target || name.starts_with("." + target + ".tmp-");
  }
  std::unique_ptr<Storage> base_ = CreatePosixStorage();
};

// A save lock that cannot be taken for another reason than a holder (a
// read-only mount, a directory this user cannot write) names that reason on
// every rank; it used to say "another save into DIR is running".
TEST(FailedSaveTest, ASaveLockThatCannotBeMadeNamesItsCauseNotAnotherSave) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(2, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2), seed);
  ASSERT_TRUE(c.status().ok());
  RiggedStorage rigged;
  rigged.read_only_lock = true;
  std::vector<Status> status(2);
  ASSERT_TRUE(c.Run([&](int r) {
                 status[r] = SaveCheckpoint(c.opt(r), dir.path(), {.storage = &rigged});
                 return OkStatus();
               }).ok());
  EXPECT_EQ(status[0].code(), StatusCode::kFailedPrecondition) << status[0];
  ExpectMentions(status[0], "take the save lock of " + dir.path());
  ExpectMentions(status[0], "EROFS");
  ExpectMentions(status[0], "nothing was written");
  EXPECT_EQ(status[0].message().find("another save"), std::string::npos) << status[0];
  EXPECT_FALSE(status[1].ok());
  ExpectMentions(status[1], "see rank 0's error");
  EXPECT_TRUE(SaveDirs(dir.path()).empty());
}

// What a failed second save must leave current: the first save, made after 2
// steps, and the names in its directory; then 1 more step.
struct FirstSave {
  Snapshot state;
  std::vector<std::string> names;
};
void SaveThenStep(Cluster& c, uint64_t seed, const std::string& dir, FirstSave* out) {
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 2).ok());
  ASSERT_TRUE(c.Save(dir).ok());
  out->state = *TakeSnapshot(c);
  out->names = testing::DirNames(dir);
  ASSERT_TRUE(c.Train(seed, 1).ok());
}

// Every rank's SaveCheckpoint into `dir` through `storage`, expected to fail.
std::vector<Status> SaveFailingOnEveryRank(Cluster& c, const std::string& dir, Storage* storage) {
  std::vector<Status> status(c.world());
  EXPECT_FALSE(c.Run([&](int r) {
                  return status[r] = SaveCheckpoint(c.opt(r), dir, {.storage = storage});
                }).ok());
  return status;
}

// The entries of `dir` that `before` does not have.
std::vector<std::string> NewEntries(const std::string& dir,
                                    const std::vector<std::string>& before) {
  std::vector<std::string> out;
  for (const std::string& name : testing::DirNames(dir)) {
    if (std::find(before.begin(), before.end(), name) == before.end()) out.push_back(name);
  }
  return out;
}

// A save that fails part way, after data files were written (a full disk at
// rank 1's manifest, an IO error at rank 0's second data file, latest.json
// that cannot be written): every rank removes its files and the save's
// directory, each rank's error is what it was (the failing rank's own,
// Unavailable on the others), and the previous save is current and loads
// bitwise.
TEST(FailedSaveTest, ASaveThatFailsPartWayLeavesNothingAndThePreviousSaveLoads) {
  struct Case {
    std::string what;
    int world;
    std::string fail_open;
    std::string fail_rename;
    int failing_rank;
    StatusCode code;
  };
  for (const Case& k : std::vector<Case>{
           {"rank 1's manifest, disk full", 2, "rank00001.json", "", 1,
            StatusCode::kResourceExhausted},
           {"rank 0's second data file, EIO", 2, "", "rank00000.exp_avg.f32", 0,
            StatusCode::kInternal},
           {"latest.json, disk full", 2, "latest.json", "", 0, StatusCode::kResourceExhausted},
           {"the only rank's manifest, disk full", 1, "rank00000.json", "", 0,
            StatusCode::kResourceExhausted},
       }) {
    SCOPED_TRACE(k.what);
    const uint64_t seed = TestSeed();
    TempDir dir;
    Cluster c(k.world, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, k.world), seed);
    FirstSave first;
    ASSERT_NO_FATAL_FAILURE(SaveThenStep(c, seed, dir.path(), &first));
    RiggedStorage rigged;
    rigged.fail_open = k.fail_open;
    rigged.fail_rename = k.fail_rename;
    const std::vector<Status> status = SaveFailingOnEveryRank(c, dir.path(), &rigged);
    EXPECT_GT(rigged.data_files_committed.load(), 0) << "the save failed after writing files";
    for (int r = 0; r < k.world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      if (r == k.failing_rank) {
        EXPECT_EQ(status[r].code(), k.code) << status[r];
        ExpectMentions(status[r], k.fail_open.empty() ? "rename " : "open ");
        ExpectMentions(status[r], k.fail_open.empty() ? k.fail_rename : k.fail_open);
      } else {
        EXPECT_EQ(status[r].code(), StatusCode::kUnavailable) << status[r];
        ExpectMentions(status[r], "the previous checkpoint stays the current one");
      }
      EXPECT_EQ(status[r].message().find("could not be removed"), std::string::npos) << status[r];
    }
    EXPECT_EQ(testing::DirNames(dir.path()), first.names)
        << "the failed save's directory is removed";

    Cluster check(k.world, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, k.world),
                  seed + 1);
    ASSERT_TRUE(check.status().ok());
    Status s = check.Load(dir.path());
    ASSERT_TRUE(s.ok()) << s;
    ExpectSameSnapshot(*TakeSnapshot(check), first.state);
    ExpectParamsAreMaster(check, first.state);
  }
}

// A removal that fails does not hide the save's error: the error keeps its
// code and cause and names the directory that is left; the previous save
// still loads, and the next save's retention removes the leftover.
TEST(FailedSaveTest, AFailedRemovalKeepsTheErrorAndNamesTheDirectoryLeft) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(2, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2), seed);
  FirstSave first;
  ASSERT_NO_FATAL_FAILURE(SaveThenStep(c, seed, dir.path(), &first));
  RiggedStorage rigged;
  rigged.fail_open = "rank00001.json";
  rigged.fail_remove = "rank00000.master.f32";
  const std::vector<Status> status = SaveFailingOnEveryRank(c, dir.path(), &rigged);
  const std::vector<std::string> left = NewEntries(dir.path(), first.names);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(testing::DirNames(dir.File(left[0])), std::vector<std::string>{"rank00000.master.f32"})
      << "everything else is removed";
  EXPECT_EQ(status[1].code(), StatusCode::kResourceExhausted) << status[1];
  ExpectMentions(status[1], "open ");
  ExpectMentions(status[1], "rank00001.json");
  EXPECT_EQ(status[0].code(), StatusCode::kUnavailable) << status[0];
  for (int r = 0; r < 2; ++r) {
    ExpectMentions(status[r],
                   "the partial save directory " + dir.File(left[0]) + " could not be removed");
  }
  ExpectMentions(status[0], "remove " + dir.File(left[0]) + "/rank00000.master.f32");

  Cluster check(2, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2), seed + 1);
  ASSERT_TRUE(check.status().ok());
  Status s = check.Load(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(check), first.state);

  ASSERT_TRUE(c.Save(dir.path()).ok());
  EXPECT_FALSE(std::filesystem::exists(dir.File(left[0]))) << "retention removes the leftover";
}

// A publish that fails after its rename (the directory fsync) has made
// latest.json name the new save: that save is kept, not removed, and loads.
TEST(FailedSaveTest, APublishThatFailsAfterItsRenameKeepsTheSaveLatestJsonNames) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(2, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2), seed);
  FirstSave first;
  ASSERT_NO_FATAL_FAILURE(SaveThenStep(c, seed, dir.path(), &first));
  RiggedStorage rigged;
  rigged.fail_rename = "latest.json";
  rigged.rename_fault = RiggedStorage::RenameFault::kAfter;
  const std::vector<Status> status = SaveFailingOnEveryRank(c, dir.path(), &rigged);
  EXPECT_EQ(status[0].code(), StatusCode::kInternal) << status[0];
  ExpectMentions(status[0], "fsync directory after renaming");
  EXPECT_EQ(status[1].code(), StatusCode::kUnavailable) << status[1];
  const std::string saved = (*CheckpointReader::Open(dir.path()))->info().save_dir;
  ASSERT_TRUE(std::filesystem::exists(saved));
  for (int r = 0; r < 2; ++r) ExpectMentions(status[r], saved + " is complete and kept");

  Cluster check(2, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2), seed + 1);
  ASSERT_TRUE(check.status().ok());
  Status s = check.Load(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(check), *TakeSnapshot(c));
}

// The ranks cannot agree whether a save failed (the all-reduce itself fails):
// each rank's own error comes first, nothing is removed (a rank that saw the
// agreement succeed could publish the save), the message names the directory
// left, and the previous save stays current.
TEST(FailedSaveTest, AnAgreementThatFailsKeepsEachRanksErrorAndTheFiles) {
  struct Case {
    std::string what;
    int agreement;  // 0 the ranks' settings, 1 the lock and the save's id, 2 the written parts,
                    // 3 the publish
    std::string fail_open;
    int failing_rank;
  };
  for (const Case& k : std::vector<Case>{{"rank 1's manifest", 2, "rank00001.json", 1},
                                         {"latest.json", 3, "latest.json", 0}}) {
    SCOPED_TRACE(k.what);
    const uint64_t seed = TestSeed();
    TempDir dir;
    std::vector<testing::FaultComm*> comms(2);
    Cluster c(2, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2), seed,
              testing::kCkptSizes, [&](int r, std::unique_ptr<Communicator> base) {
                auto comm = std::make_unique<testing::FaultComm>(std::move(base));
                comms[r] = comm.get();
                return comm;
              });
    FirstSave first;
    ASSERT_NO_FATAL_FAILURE(SaveThenStep(c, seed, dir.path(), &first));
    RiggedStorage rigged;
    rigged.fail_open = k.fail_open;
    for (testing::FaultComm* comm : comms) comm->Fail(testing::CommCall::kAllReduce, k.agreement);
    const std::vector<Status> status = SaveFailingOnEveryRank(c, dir.path(), &rigged);
    const std::vector<std::string> left = NewEntries(dir.path(), first.names);
    ASSERT_EQ(left.size(), 1u) << "the save's directory is left";
    EXPECT_FALSE(testing::DirNames(dir.File(left[0])).empty()) << "and its files";
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      if (r == k.failing_rank) {
        EXPECT_EQ(status[r].code(), StatusCode::kResourceExhausted) << status[r];
        ExpectMentions(status[r], "open " + dir.path());
        ExpectMentions(status[r], k.fail_open);
      } else {
        EXPECT_EQ(status[r].code(), StatusCode::kUnavailable) << status[r];
      }
      ExpectMentions(status[r], "the ranks could not agree on the outcome (rank " +
                                    std::to_string(r) + ": the communicator broke)");
      ExpectMentions(status[r], dir.File(left[0]) + " is left as it is");
    }
    Cluster check(2, CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2), seed + 1);
    ASSERT_TRUE(check.status().ok());
    Status s = check.Load(dir.path());
    ASSERT_TRUE(s.ok()) << s;
    ExpectSameSnapshot(*TakeSnapshot(check), first.state);
  }
}

// ---- The ranks agree on what they save and load ---------------------------------------

// Every path under `dir` (recursively), relative to it.
std::vector<std::string> Tree(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    out.push_back(std::filesystem::relative(e.path(), dir).string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Two ranks, trained and saved into `dirs_[0]` and `dirs_[1]` (both
// complete, loadable checkpoints of different states), then trained on.
class RankAgreementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = std::make_unique<Cluster>(2, Config(), seed_);
    ASSERT_TRUE(c_->status().ok());
    for (int d = 0; d < 2; ++d) {
      ASSERT_TRUE(c_->Train(seed_, 2).ok());
      ASSERT_TRUE(c_->Save(dirs_[d].path()).ok());
      saved_.push_back(*TakeSnapshot(*c_));
    }
    ASSERT_TRUE(c_->Train(seed_, 1).ok());
  }
  static OffloadConfig Config() { return CkptConfig(Where::kHost, OptimizerType::kAdamW, 1024, 2); }
  // Each rank's SaveCheckpoint into dir_of(rank), with options_of(rank).
  std::vector<Status> SaveEach(
      const std::function<std::string(int)>& dir_of,
      const std::function<SaveOptions(int)>& options_of = [](int) { return SaveOptions{}; }) {
    std::vector<Status> status(2);
    EXPECT_TRUE(c_->Run([&](int r) {
                    status[r] = SaveCheckpoint(c_->opt(r), dir_of(r), options_of(r));
                    return OkStatus();
                  }).ok());
    return status;
  }
  // What both directories hold now.
  std::vector<std::vector<std::string>> Trees() const {
    return {Tree(dirs_[0].path()), Tree(dirs_[1].path())};
  }
  // Both directories hold what they held, and each loads bitwise.
  void ExpectSavesIntact(const std::vector<std::vector<std::string>>& trees) {
    for (int d = 0; d < 2; ++d) {
      SCOPED_TRACE("directory " + std::to_string(d));
      EXPECT_EQ(Tree(dirs_[d].path()), trees[d]) << "nothing is written or removed";
      Cluster check(2, Config(), seed_ + 1);
      ASSERT_TRUE(check.status().ok());
      Status s = check.Load(dirs_[d].path());
      ASSERT_TRUE(s.ok()) << s;
      ExpectSameSnapshot(*TakeSnapshot(check), saved_[d]);
    }
  }
  // A save after a refused one works (rank 0 holds no lock) and loads.
  void ExpectASaveInto0Works() {
    const Snapshot now = *TakeSnapshot(*c_);
    Status s = c_->Save(dirs_[0].path());
    ASSERT_TRUE(s.ok()) << s;
    Cluster check(2, Config(), seed_ + 2);
    ASSERT_TRUE(check.status().ok());
    s = check.Load(dirs_[0].path());
    ASSERT_TRUE(s.ok()) << s;
    ExpectSameSnapshot(*TakeSnapshot(check), now);
  }

  const uint64_t seed_ = TestSeed();
  TempDir dirs_[2];
  std::unique_ptr<Cluster> c_;
  std::vector<Snapshot> saved_;
};

// Rank 0 saving into A and rank 1 into B used to succeed on both: A's
// latest.json named a save holding rank 0's files only, retention removed
// A's older complete saves, and A no longer loaded.
TEST_F(RankAgreementTest, ASaveIntoADifferentDirectoryPerRankWritesNothingOnEveryRank) {
  const std::vector<std::vector<std::string>> trees = Trees();
  const std::vector<Status> status = SaveEach([&](int r) { return dirs_[r].path(); });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(status[r].code(), StatusCode::kInvalidArgument) << status[r];
    ExpectMentions(status[r], fmt::format("rank {} saves into {} while another rank saves into a "
                                          "different directory: every rank must pass the same "
                                          "directory",
                                          r, dirs_[r].path()));
    ExpectMentions(status[r], "nothing was written");
  }
  ExpectSavesIntact(trees);
  ExpectASaveInto0Works();
}

// One directory spelled differently (a trailing separator, a "." on the
// way, relative) is one directory.
TEST_F(RankAgreementTest, OneDirectorySpelledDifferentlyIsOneDirectory) {
  const std::string rel = std::filesystem::relative(dirs_[0].path()).string();
  const std::vector<Status> status =
      SaveEach([&](int r) { return r == 0 ? dirs_[0].path() + "/" : "./" + rel + "/."; });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  Cluster check(2, Config(), seed_ + 1);
  ASSERT_TRUE(check.status().ok());
  Status s = check.Load(dirs_[0].path());
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(check), *TakeSnapshot(*c_));
}

// A rank whose counters were restored alone (a lone load) used to write its
// files into a step-<its step> directory that rank 0's retention removed.
TEST_F(RankAgreementTest, RanksAtDifferentStepsSaveNothing) {
  const int64_t step = c_->opt(0).step_count();
  ASSERT_TRUE(c_->opt(1).RestoreCounters(step + 5, c_->opt(1).loss_scaler_state()).ok());
  const std::vector<std::vector<std::string>> trees = Trees();
  const std::vector<Status> status = SaveEach([&](int) { return dirs_[0].path(); });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(status[r].code(), StatusCode::kFailedPrecondition) << status[r];
    ExpectMentions(status[r], fmt::format("rank {} is at step {} while another rank is at a "
                                          "different step",
                                          r, r == 0 ? step : step + 5));
    ExpectMentions(status[r], "nothing was written");
  }
  ExpectSavesIntact(trees);
  ASSERT_TRUE(c_->opt(1).RestoreCounters(step, c_->opt(1).loss_scaler_state()).ok());
  ExpectASaveInto0Works();
}

// Different hyperparameters (an lr changed on one rank) used to give a save
// whose manifests disagree: "rank00001.json does not agree with
// rank00000.json" at every load.
TEST_F(RankAgreementTest, RanksWithDifferentHyperparametersSaveNothing) {
  const GroupHyper before = c_->opt(1).group_hyper(1);
  GroupHyper changed = before;
  changed.lr *= 0.5;
  ASSERT_TRUE(c_->opt(1).SetGroupHyper(1, changed).ok());
  const std::vector<std::vector<std::string>> trees = Trees();
  const std::vector<Status> status = SaveEach([&](int) { return dirs_[0].path(); });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(status[r].code(), StatusCode::kFailedPrecondition) << status[r];
    ExpectMentions(status[r], fmt::format("rank {} saves group hyperparameters", r));
    ExpectMentions(status[r], "while another rank's differ");
    ExpectMentions(status[r], "nothing was written");
  }
  ExpectSavesIntact(trees);
  ASSERT_TRUE(c_->opt(1).SetGroupHyper(1, before).ok());
  ExpectASaveInto0Works();
}

// SaveOptions that differ (chunk_bytes) would give manifests that disagree too.
TEST_F(RankAgreementTest, RanksWithDifferentSaveOptionsSaveNothing) {
  const std::vector<std::vector<std::string>> trees = Trees();
  const std::vector<Status> status =
      SaveEach([&](int) { return dirs_[0].path(); },
               [](int r) { return SaveOptions{.chunk_bytes = r == 0 ? 4096u : 8192u}; });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(status[r].code(), StatusCode::kInvalidArgument) << status[r];
    ExpectMentions(status[r],
                   fmt::format("rank {} saves with chunk_bytes {}", r, r == 0 ? 4096 : 8192));
  }
  ExpectSavesIntact(trees);
}

// A rank whose own checks refuse the save (chunk_bytes) fails, and so does
// the other, at once (it used to wait alone in the lock's all-reduce).
TEST_F(RankAgreementTest, ARankThatRefusesTheSaveFailsItOnEveryRank) {
  const std::vector<std::vector<std::string>> trees = Trees();
  const std::vector<Status> status =
      SaveEach([&](int) { return dirs_[0].path(); },
               [](int r) { return SaveOptions{.chunk_bytes = r == 1 ? 1000u : 4096u}; });
  EXPECT_EQ(status[1].code(), StatusCode::kInvalidArgument) << status[1];
  ExpectMentions(status[1], "chunk_bytes 1000 is not a positive multiple of 4096");
  EXPECT_EQ(status[0].code(), StatusCode::kFailedPrecondition) << status[0];
  ExpectMentions(status[0], "another rank refused the save");
  ExpectSavesIntact(trees);
}

// An empty directory is refused naming the argument (the save said "create
// directory : EINVAL", the load "open checkpoint : no such directory"), on
// every rank together: the check rides in the agreement, so a rank that
// passed "" alone leaves no other waiting, and that one is told why.
TEST_F(RankAgreementTest, AnEmptyDirectoryIsRefusedOnEveryRank) {
  const std::vector<std::vector<std::string>> trees = Trees();
  const Snapshot now = *TakeSnapshot(*c_);
  std::vector<Status> status = SaveEach([](int) { return std::string(); });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("save, rank " + std::to_string(r));
    EXPECT_EQ(status[r].code(), StatusCode::kInvalidArgument) << status[r];
    ExpectMentions(status[r], fmt::format("save checkpoint '' (rank {}, step", r));
    ExpectMentions(status[r], "the checkpoint directory is empty; give a directory");
    ExpectMentions(status[r], "nothing was written");
  }
  status = SaveEach([&](int r) { return r == 1 ? std::string() : dirs_[0].path(); });
  ExpectMentions(status[1], "the checkpoint directory is empty; give a directory");
  EXPECT_EQ(status[0].code(), StatusCode::kInvalidArgument) << status[0];
  ExpectMentions(status[0], fmt::format("rank 0 saves into {} while another rank saves into a "
                                        "different directory",
                                        dirs_[0].path()));

  for (const bool both : {true, false}) {
    SCOPED_TRACE(both ? "load, both ranks ''" : "load, rank 1 ''");
    ASSERT_TRUE(c_->Run([&](int r) {
                    status[r] = LoadCheckpoint(c_->opt(r), both || r == 1 ? "" : dirs_[0].path());
                    return OkStatus();
                  }).ok());
    EXPECT_EQ(status[1].code(), StatusCode::kInvalidArgument) << status[1];
    ExpectMentions(status[1],
                   "load checkpoint '' (rank 1): nothing was loaded: the checkpoint directory is "
                   "empty; give the directory given to Save");
    EXPECT_FALSE(status[0].ok());
    ExpectMentions(status[0], "nothing was loaded");
  }
  ExpectSameSnapshot(*TakeSnapshot(*c_), now);
  ExpectSavesIntact(trees);
  ExpectASaveInto0Works();
}

// A load with a different directory per rank used to load each rank's shard
// from its own checkpoint, silently mixing two.
TEST_F(RankAgreementTest, ALoadFromADifferentDirectoryPerRankLoadsNothing) {
  const Snapshot now = *TakeSnapshot(*c_);
  std::vector<Status> status(2);
  ASSERT_TRUE(c_->Run([&](int r) {
                  status[r] = LoadCheckpoint(c_->opt(r), dirs_[r].path());
                  return OkStatus();
                }).ok());
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(status[r].code(), StatusCode::kInvalidArgument) << status[r];
    ExpectMentions(status[r], fmt::format("rank {} loads from {} while another rank loads from a "
                                          "different directory",
                                          r, dirs_[r].path()));
    ExpectMentions(status[r], "nothing was loaded");
  }
  ExpectSameSnapshot(*TakeSnapshot(*c_), now);
  ExpectParamsAreMaster(*c_, now);
  EXPECT_EQ(c_->opt(0).loaded_save().dir, "");
}

// latest.json replaced between the ranks' reads (a save by another job while
// this one loads): the ranks resolve different saves of one directory, and
// each used to load its shard of its own.
TEST_F(RankAgreementTest, RanksThatResolveDifferentSavesLoadNothing) {
  TempDir elsewhere;
  const std::string old_latest = elsewhere.File("latest.json");
  std::filesystem::copy_file(dirs_[0].File("latest.json"), old_latest);
  ASSERT_TRUE(c_->Save(dirs_[0].path()).ok());
  ASSERT_TRUE(c_->Train(seed_, 1).ok());
  const Snapshot now = *TakeSnapshot(*c_);
  RiggedStorage rigged;  // rank 1 reads the latest.json of before the last save
  rigged.read_latest_from = old_latest;
  std::vector<Status> status(2);
  ASSERT_TRUE(c_->Run([&](int r) {
                  status[r] = LoadCheckpoint(c_->opt(r), dirs_[0].path(),
                                             {.storage = r == 1 ? &rigged : nullptr});
                  return OkStatus();
                }).ok());
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(status[r].code(), StatusCode::kFailedPrecondition) << status[r];
    ExpectMentions(status[r], "while another rank resolved another save");
    ExpectMentions(status[r], "nothing was loaded");
  }
  ExpectSameSnapshot(*TakeSnapshot(*c_), now);
  ExpectParamsAreMaster(*c_, now);
}

// ---- The loss scaler across param dtypes ---------------------------------------------

// A bf16 (or fp32) save's loss scaler is scale 1: restored into an fp16
// optimizer, it ran at loss scale 1 and most fp16 gradients flushed to zero.
// Now the scaler starts from this config's initial scale (logged); the step
// count and the state are the save's. An fp16 save keeps its scale.
TEST(ScalerTest, AnFp16OptimizerLoadingABf16SaveStartsFromItsInitialScale) {
  const uint64_t seed = TestSeed();
  TempDir dir, fp16_dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 2).ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  ASSERT_EQ(c.opt(0).loss_scale(), 1.0);

  OffloadConfig fp16 = CkptConfig(Where::kHost);
  fp16.param_dtype = DType::kF16;
  fp16.loss_scaler = {.mode = LossScaleMode::kDynamic, .initial_scale_power = 10};
  Cluster target(1, fp16, seed + 1);
  ASSERT_TRUE(target.status().ok());
  {
    testing::LogCapture log(LogLevel::kInfo);
    Status s = target.Load(dir.path());
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(
        log.Find(LogLevel::kInfo, "the loss scaler starts from this config's initial scale").size(),
        1u);
  }
  EXPECT_EQ(target.opt(0).step_count(), 2);
  EXPECT_EQ(target.opt(0).loss_scale(), 1024.0);
  EXPECT_EQ(target.opt(0).loss_scaler_state(),
            (LossScalerState{.scale = 1024.0, .hysteresis_left = 2}));
  EXPECT_EQ(TakeSnapshot(target)->state, TakeSnapshot(c)->state);

  // fp16 to fp16: the saved scaler, as it was.
  ASSERT_TRUE(target.Train(seed, 1).ok());
  ASSERT_TRUE(target.Save(fp16_dir.path()).ok());
  Cluster again(1, fp16, seed + 2);
  ASSERT_TRUE(again.status().ok());
  ASSERT_TRUE(again.Load(fp16_dir.path()).ok());
  EXPECT_EQ(again.opt(0).loss_scaler_state(), target.opt(0).loss_scaler_state());
  EXPECT_EQ(again.opt(0).step_count(), 3);
}

// ---- Retention ------------------------------------------------------------------

TEST(RetentionTest, KeepsTheNewestSavesAndRemovesLeftovers) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  // A leftover of a save that crashed before publishing.
  std::filesystem::create_directories(dir.File("step-0000000000-deadbeef0000"));
  std::vector<std::string> published;
  for (int s = 0; s < 4; ++s) {
    ASSERT_TRUE(c.Train(seed, 1).ok());
    ASSERT_TRUE(c.Save(dir.path()).ok());
    published.push_back((*CheckpointReader::Open(dir.path()))->info().save_dir);
  }
  EXPECT_EQ(SaveDirs(dir.path()).size(), 2u) << "the default keeps the newest and the previous";
  EXPECT_TRUE(std::filesystem::exists(published[3]));
  EXPECT_TRUE(std::filesystem::exists(published[2]));
  // The previous one loads on its own.
  Cluster other(1, CkptConfig(Where::kHost), seed + 1);
  Status s = other.opt(0).Load(published[2]);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(other.opt(0).step_count(), 3);

  ASSERT_TRUE(c.Save(dir.path(), {.keep_checkpoints = 3}).ok());
  EXPECT_EQ(SaveDirs(dir.path()).size(), 3u);

  // An unreadable latest.json: the next save publishes but removes nothing.
  std::ofstream(dir.File("latest.json"), std::ios::trunc) << "{\"checkp";
  ASSERT_TRUE(c.Save(dir.path()).ok());
  EXPECT_EQ(SaveDirs(dir.path()).size(), 4u);
  ASSERT_TRUE(other.opt(0).Load(dir.path()).ok());
}

// Two live optimizers of one process saving into one directory (a GAN's
// generator and discriminator) replaced each other's saves: the second's
// save became the current one, retention removed the first's, and a load
// took whichever came last. The second save is refused before anything is
// written, under any spelling of the directory; it is allowed once the
// first optimizer is gone, or when the saver resumed from that directory.
TEST(DirOwnerTest, ASecondLiveOptimizerSavingIntoOneDirectoryIsRefused) {
  namespace fs = std::filesystem;
  const uint64_t seed = TestSeed();
  TempDir dir, links;
  auto first = std::make_unique<Cluster>(1, CkptConfig(Where::kHost), seed);
  Cluster second(1, CkptConfig(Where::kHost), seed + 1);
  ASSERT_TRUE(first->status().ok() && second.status().ok());
  ASSERT_TRUE(first->Train(seed, 2).ok());
  ASSERT_TRUE(second.Train(seed + 1, 1).ok());
  ASSERT_TRUE(first->Save(dir.path()).ok());
  ASSERT_TRUE(first->Save(dir.path()).ok()) << "the same optimizer saves again";
  const std::string latest = testing::ReadFileBytes(dir.File("latest.json"));
  const auto names = testing::DirNames(dir.path());
  fs::create_directory_symlink(dir.path(), links.File("alias"));
  for (const std::string& spelling : {dir.path(), dir.path() + "/", links.File("alias")}) {
    SCOPED_TRACE(spelling);
    Status s = second.Save(spelling);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    ExpectMentions(s, "another optimizer of this process saves into " + spelling +
                          " (its last save there was at step 2) and is still alive");
    ExpectMentions(s, "Give each optimizer a directory of its own");
    ExpectMentions(s, "nothing was written");
    EXPECT_EQ(testing::DirNames(dir.path()), names);
    EXPECT_EQ(testing::ReadFileBytes(dir.File("latest.json")), latest);
  }
  // A directory of its own, or one beside, is the second's.
  ASSERT_TRUE(second.Save(dir.File("discriminator")).ok());

  // A resume from the directory takes it over: then the first is refused.
  auto resumed = std::make_unique<Cluster>(1, CkptConfig(Where::kHost), seed + 2);
  ASSERT_TRUE(resumed->status().ok());
  ASSERT_TRUE(resumed->Load(dir.path()).ok());
  ASSERT_TRUE(resumed->Train(seed, 1).ok());
  Status s = resumed->Save(dir.path());
  ASSERT_TRUE(s.ok()) << s;
  s = first->Save(dir.path());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  ExpectMentions(s, "(its last save there was at step 3)");

  // Once the optimizer that saved last is gone, the directory is free.
  Cluster late(1, CkptConfig(Where::kHost), seed + 3);
  ASSERT_TRUE(late.status().ok());
  resumed.reset();
  s = late.Save(dir.path());
  EXPECT_TRUE(s.ok()) << s;
}

// Retention removes only what Strata wrote: a directory named exactly as a
// save is named (step-<10 digits>-<12 hex digits>) that holds nothing but a
// save's files. A user's files and directories that merely start with
// "step-" survive every save, the first one into the directory included.
TEST(RetentionTest, UserFilesNamedLikeSavesSurviveAndOnlyStrataSavesAreRemoved) {
  namespace fs = std::filesystem;
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  auto write = [](const std::string& path, const std::string& text) {
    fs::create_directories(fs::path(path).parent_path());
    std::ofstream(path) << text;
  };
  // The user's: none of these may be touched.
  const std::map<std::string, std::string> user_files = {
      {"step-1000.pt", "weights at step 1000"},
      {"step-500/model.pt", "weights at step 500"},
      {"step-0000000001-abcdefabcdef", "a file, named exactly like a save"},
      {"step-0000000002-abcdefabcdef/notes.txt", "a save directory the user wrote into"},
      {"step-0000000003-ABCDEFABCDEF/rank00000.json", "upper-case hex: not Strata's name"},
      {"step-0000000004-abcdefabcdef-old/rank00000.master.f32", "a suffix: not Strata's name"},
      {"step-0000000005-abcdefabcdef/rank00000.json", "{\"format\": \"something else\"}"},
      {"step-0000000007-abcdefabcdef/rank00000.json", "{\"format\": 5, \"save_id\": []}"},
      {".latest.json.tmp-notes", "not a temporary Strata writes"},
      {"elsewhere/data.bin", "what a symlink named like a save points to"},
  };
  for (const auto& [name, text] : user_files) write(dir.File(name), text);
  fs::create_directory_symlink(dir.File("elsewhere"), dir.File("step-0000000006-abcdefabcdef"));
  // Strata's: the leftovers of a save that crashed (a data file and a
  // temporary of another), and an empty save directory.
  const std::string crashed = dir.File("step-0000000000-deadbeef0000");
  write(crashed + "/rank00000.master.f32", std::string(4096, '\0'));
  write(crashed + "/.rank00000.exp_avg.f32.tmp-4242-1f", "partial");
  fs::create_directories(dir.File("step-0000000000-000000000001"));

  std::vector<std::string> published;
  for (int s = 0; s < 4; ++s) {
    ASSERT_TRUE(c.Train(seed, 1).ok());
    ASSERT_TRUE(c.Save(dir.path()).ok());
    published.push_back((*CheckpointReader::Open(dir.path()))->info().save_dir);
    for (const auto& [name, text] : user_files) {
      ASSERT_TRUE(fs::exists(dir.File(name))) << name << " removed by save " << s;
      EXPECT_EQ(testing::ReadFileBytes(dir.File(name)), text) << name;
    }
    ASSERT_TRUE(fs::is_symlink(dir.File("step-0000000006-abcdefabcdef")));
    EXPECT_FALSE(fs::exists(crashed)) << "a crashed save's leftovers are removed";
    EXPECT_FALSE(fs::exists(dir.File("step-0000000000-000000000001")));
  }
  // Strata's own older saves are still pruned: the newest two remain.
  EXPECT_FALSE(fs::exists(published[0]));
  EXPECT_FALSE(fs::exists(published[1]));
  EXPECT_TRUE(fs::exists(published[2]));
  EXPECT_TRUE(fs::exists(published[3]));
}

// The history of latest.json as written.
std::vector<std::string> History(const std::string& dir) {
  std::ifstream in(dir + "/latest.json");
  return nlohmann::json::parse(in)["history"].get<std::vector<std::string>>();
}

// A latest.json restored from a backup lists saves that retention removed
// since: none of them exists. Retention then cannot tell what is wanted and
// removes nothing (it used to remove every save but the new one, the save
// just loaded from included).
TEST(RetentionTest, ALatestJsonListingOnlyMissingSavesRemovesNothing) {
  namespace fs = std::filesystem;
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  std::string backup;
  for (int s = 0; s < 4; ++s) {
    ASSERT_TRUE(c.Train(seed, 1).ok());
    ASSERT_TRUE(c.Save(dir.path()).ok());
    if (s == 1) backup = testing::ReadFileBytes(dir.File("latest.json"));
  }
  const std::vector<std::string> saves = SaveDirs(dir.path());  // steps 3 and 4
  ASSERT_EQ(saves.size(), 2u);
  std::ofstream(dir.File("latest.json"), std::ios::trunc) << backup;  // names steps 2 and 1

  Cluster resumed(1, CkptConfig(Where::kHost), seed + 1);
  ASSERT_TRUE(resumed.status().ok());
  Status s = resumed.Load(dir.File(saves[1]));
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(resumed.Train(seed, 1).ok());
  testing::LogCapture log;
  ASSERT_TRUE(resumed.Save(dir.path()).ok());
  for (const std::string& save : saves) {
    EXPECT_TRUE(fs::exists(dir.File(save))) << save << " was removed";
  }
  EXPECT_EQ(SaveDirs(dir.path()).size(), 3u);
  const auto warned = log.Find(LogLevel::kWarning, "lists only saves that do not exist");
  ASSERT_EQ(warned.size(), 1u);
  EXPECT_NE(warned[0].find(saves[0]), std::string::npos) << warned[0];
  EXPECT_TRUE(log.Find(LogLevel::kInfo, "checkpoint retention: removed").empty());
  // The save loaded from stays listed, so the next saves account for it.
  EXPECT_EQ(
      History(dir.path()),
      (std::vector<std::string>{(*CheckpointReader::Open(dir.path()))->info().save_id, saves[1]}));
}

// A save copied back into DIR from a backup and loaded: the next save keeps
// it (the optimizer loaded from it) and the saves of later steps (a save
// newer than the kept ones is never removed); it used to remove all but two.
// Later saves remove, and log, only what latest.json listed.
TEST(RetentionTest, ASaveCopiedBackAndLoadedIsKeptAndSoAreLaterOnes) {
  namespace fs = std::filesystem;
  const uint64_t seed = TestSeed();
  TempDir dir, backup;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 1).ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  const std::string first = SaveDirs(dir.path())[0];
  fs::copy(dir.File(first), backup.File(first), fs::copy_options::recursive);
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(c.Train(seed, 1).ok());
    ASSERT_TRUE(c.Save(dir.path()).ok());
  }
  ASSERT_FALSE(fs::exists(dir.File(first)));
  fs::copy(backup.File(first), dir.File(first), fs::copy_options::recursive);
  const std::vector<std::string> before = SaveDirs(dir.path());  // steps 1, 3, 4
  ASSERT_EQ(before.size(), 3u);

  Cluster resumed(1, CkptConfig(Where::kHost), seed + 1);
  ASSERT_TRUE(resumed.status().ok());
  Status s = resumed.Load(dir.File(first) + "/");
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(resumed.Train(seed, 1).ok());
  {
    testing::LogCapture log;
    ASSERT_TRUE(resumed.Save(dir.path()).ok());  // step 2
    for (const std::string& save : before) {
      EXPECT_TRUE(fs::exists(dir.File(save))) << save << " was removed";
    }
    EXPECT_TRUE(log.Find(LogLevel::kInfo, "checkpoint retention: removed").empty());
    const auto kept = log.Find(LogLevel::kWarning, "later than a save the rule keeps");
    ASSERT_EQ(kept.size(), 1u);
    EXPECT_NE(kept[0].find(before[1]), std::string::npos) << kept[0];
  }
  const std::string second = (*CheckpointReader::Open(dir.path()))->info().save_id;
  // The next save is the second of the resumed line: with two kept, the new
  // line has replaced the save loaded from, which goes with a log line (it
  // used to stay for the optimizer's life, a third save on disk).
  ASSERT_TRUE(resumed.Train(seed, 1).ok());
  testing::LogCapture log;
  ASSERT_TRUE(resumed.Save(dir.path()).ok());  // step 3
  const std::string third = (*CheckpointReader::Open(dir.path()))->info().save_id;
  EXPECT_FALSE(fs::exists(dir.File(first)));
  EXPECT_TRUE(fs::exists(dir.File(second)));
  const auto removed = log.Find(LogLevel::kInfo, "checkpoint retention: removed");
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_NE(removed[0].find(first), std::string::npos) << removed[0];
  EXPECT_EQ(History(dir.path()), (std::vector<std::string>{third, second}));
}

// A removal killed part way (retention's remove_all after the data files
// went, a preemption) left a save directory with its manifest: it counted as
// complete, so it was kept forever with a warning at every save, and it did
// not load. A manifest whose data files are missing or cut short makes an
// incomplete save, which the next save removes.
TEST(RetentionTest, ASaveLeftWithoutItsDataIsRemovedByTheNextSave) {
  namespace fs = std::filesystem;
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  std::vector<std::string> saves;
  for (int s = 0; s < 4; ++s) {
    ASSERT_TRUE(c.Train(seed, 1).ok());
    ASSERT_TRUE(c.Save(dir.path()).ok());
    saves.push_back((*CheckpointReader::Open(dir.path()))->info().save_id);
  }
  // saves[0] and saves[1] were removed; put back what cut-short removals left.
  for (int k : {0, 1}) ASSERT_FALSE(fs::exists(dir.File(saves[k])));
  const std::string manifest = testing::ReadFileBytes(dir.File(saves[3] + "/rank00000.json"));
  auto leave = [&](int k, bool truncated_data) {
    fs::create_directories(dir.File(saves[k]));
    std::string m = manifest;
    m.replace(m.find(saves[3]), saves[3].size(), saves[k]);  // its own save id
    std::ofstream(dir.File(saves[k] + "/rank00000.json")) << m;
    if (truncated_data) std::ofstream(dir.File(saves[k] + "/rank00000.master.f32")) << "cut";
  };
  leave(0, false);  // only the manifest
  leave(1, true);   // the manifest and a data file cut short
  ASSERT_TRUE(c.Train(seed, 1).ok());
  testing::LogCapture log;
  ASSERT_TRUE(c.Save(dir.path()).ok());
  EXPECT_FALSE(fs::exists(dir.File(saves[0])));
  EXPECT_FALSE(fs::exists(dir.File(saves[1])));
  EXPECT_EQ(log.Find(LogLevel::kInfo, "an incomplete save").size(), 2u);
  EXPECT_TRUE(log.Find(LogLevel::kWarning, "checkpoint retention").empty());
  EXPECT_EQ(SaveDirs(dir.path()).size(), 2u);
}

// keep_checkpoints saves of the line resumed from a save replace it: it is
// kept while fewer have followed it, so a rollback to an older save keeps
// that save until the new line can stand in for it; saves into another
// directory do not count.
TEST(RetentionTest, TheSaveLoadedFromIsKeptUntilKeepSavesFollowIt) {
  namespace fs = std::filesystem;
  const uint64_t seed = TestSeed();
  TempDir dir, elsewhere;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(c.Train(seed, 1).ok());
    ASSERT_TRUE(c.Save(dir.path(), {.keep_checkpoints = 3}).ok());
  }
  const std::vector<std::string> old_line = SaveDirs(dir.path());  // steps 1, 2, 3
  ASSERT_EQ(old_line.size(), 3u);

  Cluster resumed(1, CkptConfig(Where::kHost), seed + 1);
  ASSERT_TRUE(resumed.status().ok());
  ASSERT_TRUE(resumed.Load(dir.File(old_line[0])).ok());  // a rollback to step 1
  std::vector<std::string> new_line;
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(resumed.Train(seed, 1).ok());
    ASSERT_TRUE(resumed.Save(elsewhere.path(), {.keep_checkpoints = 3}).ok());
    ASSERT_TRUE(resumed.Save(dir.path(), {.keep_checkpoints = 3}).ok());
    new_line.push_back((*CheckpointReader::Open(dir.path()))->info().save_id);
    SCOPED_TRACE("after save " + std::to_string(s + 1) + " of the resumed line");
    EXPECT_EQ(fs::exists(dir.File(old_line[0])), s < 2) << "the save loaded from";
  }
  // Steps 2, 3 and 4 of the new line are kept, and the abandoned line's
  // step 3 (later than the oldest kept save, so never removed); its step 2
  // went when it was no later than the kept ones.
  EXPECT_FALSE(fs::exists(dir.File(old_line[1])));
  EXPECT_TRUE(fs::exists(dir.File(old_line[2])));
  EXPECT_EQ(SaveDirs(dir.path()).size(), 4u);
  EXPECT_EQ(History(dir.path()), (std::vector<std::string>{new_line[2], new_line[1], new_line[0]}));
}

// Ranged ReadState and piecewise WriteState (what Save and Load use, so that
// neither holds a buffer of a whole sub-group's state) give exactly what the
// whole-state calls give, on every tier: DRAM, NVMe, both, and device state.
class StatePiecesTest : public ::testing::TestWithParam<std::tuple<Where, double>> {};

TEST_P(StatePiecesTest, RangedReadsAndPiecewiseWritesMatchTheWholeState) {
  const auto [where, gpu_fraction] = GetParam();
  const uint64_t seed = TestSeed();
  Cluster c(1, WithGpu(CkptConfig(where), gpu_fraction), seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_TRUE(c.Train(seed, 2).ok());
  OffloadOptimizer& o = c.opt(0);
  const uint32_t arrays = o.StateArrayCount();
  constexpr uint64_t kPiece = 100;  // not a divisor of the sub-groups' sizes
  bool saw_device = false;
  for (uint32_t i = 0; i < o.sub_groups().size(); ++i) {
    SCOPED_TRACE("sub-group " + std::to_string(i));
    const uint64_t elems = o.sub_groups()[i].elems();
    const bool on_device = o.plan().sub_groups[i].tier == Tier::kDevice;
    saw_device |= on_device;
    std::vector<float> whole(elems * arrays);
    ASSERT_TRUE(o.ReadState(i, whole).ok());
    std::vector<float> pieces(whole.size(), -1.0f);
    for (uint32_t a = 0; a < arrays; ++a) {
      for (uint64_t b = 0; b < elems; b += kPiece) {
        const uint64_t n = std::min(kPiece, elems - b);
        ASSERT_TRUE(o.ReadState(i, a, b, std::span(pieces).subspan(a * elems + b, n)).ok());
      }
    }
    EXPECT_EQ(std::memcmp(pieces.data(), whole.data(), whole.size() * 4), 0);

    std::vector<float> want(whole.size());
    for (size_t k = 0; k < want.size(); ++k) want[k] = whole[k] * 0.5f + static_cast<float>(k);
    std::vector<std::pair<uint32_t, uint64_t>> calls;
    Status written = o.WriteState(
        i,
        [&](uint32_t a, uint64_t begin, std::span<float> piece) {
          calls.emplace_back(a, begin);
          std::copy_n(want.begin() + a * elems + begin, piece.size(), piece.begin());
          return OkStatus();
        },
        kPiece);
    ASSERT_TRUE(written.ok()) << written;
    // Every array once, in order; in place (one call each) unless on the device.
    std::vector<std::pair<uint32_t, uint64_t>> want_calls;
    for (uint32_t a = 0; a < arrays; ++a) {
      for (uint64_t b = 0; b < elems; b += on_device ? kPiece : elems)
        want_calls.emplace_back(a, b);
    }
    EXPECT_EQ(calls, want_calls);
    std::vector<float> got(whole.size());
    ASSERT_TRUE(o.ReadState(i, got).ok());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);

    // An update of array 1 sees its committed values and changes only it.
    std::vector<uint64_t> begins;
    Status updated = o.UpdateState(
        i, 1,
        [&](uint64_t begin, std::span<float> piece) -> Result<bool> {
          begins.push_back(begin);
          for (size_t k = 0; k < piece.size(); ++k) {
            if (std::bit_cast<uint32_t>(piece[k]) !=
                std::bit_cast<uint32_t>(want[elems + begin + k])) {
              return InternalError(fmt::format("elem {} is not the committed value", begin + k));
            }
            piece[k] += 1.0f;
          }
          return true;
        },
        kPiece);
    ASSERT_TRUE(updated.ok()) << updated;
    EXPECT_EQ(begins.size(), on_device ? (elems + kPiece - 1) / kPiece : 1);
    for (uint64_t k = 0; k < elems; ++k) want[elems + k] += 1.0f;
    ASSERT_TRUE(o.ReadState(i, got).ok());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
  }
  EXPECT_EQ(saw_device, gpu_fraction > 0);

  const uint64_t elems0 = o.sub_groups()[0].elems();
  std::vector<float> one(1);
  EXPECT_EQ(o.ReadState(0, arrays, 0, one).code(), StatusCode::kOutOfRange);
  Status past = o.ReadState(0, 0, elems0, one);
  EXPECT_EQ(past.code(), StatusCode::kOutOfRange);
  ExpectMentions(past, fmt::format("array 0 elems [{}, {}) is outside", elems0, elems0 + 1));
  EXPECT_TRUE(o.ReadState(0, 0, elems0, {}).ok());
  EXPECT_EQ(o.ReadState(static_cast<uint32_t>(o.sub_groups().size()), 0, 0, one).code(),
            StatusCode::kOutOfRange);
}

INSTANTIATE_TEST_SUITE_P(Tiers, StatePiecesTest,
                         ::testing::Values(std::tuple{Where::kHost, 0.0},
                                           std::tuple{Where::kNvme, 0.0},
                                           std::tuple{Where::kMixed, 0.0},
                                           std::tuple{Where::kHost, 0.5}));

// Load reads the files straight into the state and zeroes only what no
// tensor covers (the alignment padding): a state that held other values
// there (set through WriteState) reads back as the save, padding zero.
TEST(StatePiecesTest, ALoadZeroesThePaddingWhateverTheStateHeld) {
  for (Where where : {Where::kHost, Where::kNvme}) {
    SCOPED_TRACE(where == Where::kHost ? "host" : "nvme");
    const uint64_t seed = TestSeed();
    TempDir dir;
    Cluster c(1, CkptConfig(where), seed);
    ASSERT_TRUE(c.status().ok()) << c.status();
    ASSERT_TRUE(c.Train(seed, 2).ok());
    OffloadOptimizer& o = c.opt(0);
    const uint32_t arrays = o.StateArrayCount();
    std::vector<std::vector<float>> saved;
    for (uint32_t i = 0; i < o.sub_groups().size(); ++i) {
      saved.emplace_back(o.sub_groups()[i].elems() * arrays);
      ASSERT_TRUE(o.ReadState(i, saved.back()).ok());
    }
    ASSERT_TRUE(c.Save(dir.path()).ok());
    uint64_t padding = 0;
    for (uint32_t i = 0; i < o.sub_groups().size(); ++i) {
      const ElemRange sg = o.sub_groups()[i];
      std::vector<uint8_t> covered(sg.elems(), 0);
      // (Held: a range-for over *PiecesInRange(...) reads a destroyed temporary.)
      const auto pieces = PiecesInRange(o.layout(), sg);
      ASSERT_TRUE(pieces.ok()) << pieces.status();
      for (const TensorPiece& p : *pieces) {
        std::fill_n(covered.begin() + (p.flat_offset_elems - sg.begin), p.elems, 1);
      }
      for (uint64_t k = 0; k < sg.elems(); ++k) {
        if (covered[k]) continue;
        ++padding;
        for (uint32_t a = 0; a < arrays; ++a) ASSERT_EQ(saved[i][a * sg.elems() + k], 0.0f);
      }
      ASSERT_TRUE(o.WriteState(i, std::vector<float>(sg.elems() * arrays, 7.0f)).ok());
    }
    ASSERT_GT(padding, 0u) << "the test's layout has no padding";
    ASSERT_TRUE(c.Load(dir.path()).ok());
    for (uint32_t i = 0; i < o.sub_groups().size(); ++i) {
      std::vector<float> got(saved[i].size());
      ASSERT_TRUE(o.ReadState(i, got).ok());
      EXPECT_EQ(std::memcmp(got.data(), saved[i].data(), got.size() * 4), 0) << "sub-group " << i;
    }
  }
}

// A fill or an update that fails part way: the error comes back as is, and
// an NVMe sub-group keeps its committed state (nothing was written to it).
TEST(StatePiecesTest, AFailedFillOrUpdateLeavesAnNvmeSubGroupAsItWas) {
  const uint64_t seed = TestSeed();
  Cluster c(1, CkptConfig(Where::kNvme), seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_TRUE(c.Train(seed, 1).ok());
  OffloadOptimizer& o = c.opt(0);
  const uint32_t arrays = o.StateArrayCount();
  for (uint32_t i = 0; i < o.sub_groups().size(); ++i) {
    ASSERT_EQ(o.plan().sub_groups[i].tier, Tier::kNvme);
    std::vector<float> before(o.sub_groups()[i].elems() * arrays);
    ASSERT_TRUE(o.ReadState(i, before).ok());
    Status s = o.WriteState(i, [](uint32_t a, uint64_t, std::span<float> piece) -> Status {
      std::fill(piece.begin(), piece.end(), 7.0f);
      if (a == 1) return DataLossError("the source went bad");
      return OkStatus();
    });
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    ExpectMentions(s, "the source went bad");
    std::vector<float> after(before.size());
    ASSERT_TRUE(o.ReadState(i, after).ok());
    EXPECT_EQ(std::memcmp(after.data(), before.data(), before.size() * 4), 0) << "sub-group " << i;

    s = o.UpdateState(i, 2, [](uint64_t, std::span<float> piece) -> Result<bool> {
      std::fill(piece.begin(), piece.end(), 7.0f);
      return DataLossError("the update went bad");
    });
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    ExpectMentions(s, "the update went bad");
    ASSERT_TRUE(o.ReadState(i, after).ok());
    EXPECT_EQ(std::memcmp(after.data(), before.data(), before.size() * 4), 0) << "sub-group " << i;
  }
  EXPECT_EQ(
      o.UpdateState(0, arrays, [](uint64_t, std::span<float>) -> Result<bool> { return false; })
          .code(),
      StatusCode::kOutOfRange);
  ASSERT_TRUE(c.Train(seed, 1).ok());  // and the optimizer still steps
}

// Save and Load hold a chunk of the state at a time, not a sub-group's: the
// heap in use (sampled every 200 us while they run) grows by much less than
// one sub-group's state. They used to buffer the whole sub-group (up to 12
// GB at DeepSpeed's default sub_group_size).
TEST(CheckpointMemoryTest, SaveAndLoadHoldNoBufferOfASubGroupsState) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers' allocator does not report mallinfo2";
#else
  for (Where where : {Where::kHost, Where::kNvme}) {
    SCOPED_TRACE(where == Where::kHost ? "host" : "nvme");
    constexpr uint64_t kElems = uint64_t{8} << 20;  // one sub-group of ~72 MiB of AdamW state
    TempDir dir;
    Cluster c(1, CkptConfig(where, OptimizerType::kAdamW, kElems), TestSeed(),
              {kElems / 2, 64, kElems / 4});  // groups 0, 0, 1
    ASSERT_TRUE(c.status().ok()) << c.status();
    ASSERT_EQ(c.opt(0).sub_groups().size(), 1u);
    const uint64_t state_bytes = c.opt(0).sub_groups()[0].elems() * 3 * 4;
    auto heap = [] {
      const struct mallinfo2 m = mallinfo2();
      return static_cast<int64_t>(m.uordblks + m.hblkhd);
    };
    auto peak_growth = [&](const std::function<Status()>& fn) {
      const int64_t base = heap();
      std::atomic<bool> done{false};
      std::atomic<int64_t> peak{base};
      std::thread sampler([&] {
        while (!done.load()) {
          peak = std::max(peak.load(), heap());
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      });
      Status s = fn();
      done = true;
      sampler.join();
      EXPECT_TRUE(s.ok()) << s;
      return static_cast<uint64_t>(peak.load() - base);
    };
    const uint64_t save = peak_growth([&] { return c.Save(dir.path()); });
    const uint64_t load = peak_growth([&] { return c.Load(dir.path()); });
    EXPECT_LT(save, state_bytes / 2) << "save: heap grew by " << save << " bytes";
    EXPECT_LT(load, state_bytes / 2) << "load: heap grew by " << load << " bytes";
  }
#endif
}

// Values a trainer writes into params after Create (its own weights file,
// loaded late) become the master weights with ReloadParams: exactly the
// written values where they differ, the fp32 masters elsewhere (a write of
// equal values rounds nothing), the moments untouched; on every tier and
// with each rank adopting its own shard.
class ReloadParamsTest : public ::testing::TestWithParam<std::tuple<Where, double, int>> {};

TEST_P(ReloadParamsTest, WrittenParamsBecomeTheMasterWeights) {
  const auto [where, gpu_fraction, world] = GetParam();
  const uint64_t seed = TestSeed();
  Cluster c(world, WithGpu(CkptConfig(where, OptimizerType::kAdamW, 1024, world), gpu_fraction),
            seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_TRUE(c.Train(seed, 2).ok());
  const Snapshot before = *TakeSnapshot(c);
  const std::vector<size_t> order = c.model(0).FlatOrder();  // flat index -> model tensor
  const DType dtype = c.opt(0).config().param_dtype;
  // Flat tensors 0 and 2 get new values (the same on every rank); tensor 5
  // gets back the bytes it holds (a write of equal values).
  std::mt19937_64 rng(seed + 17);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::map<size_t, std::vector<float>> fresh;
  for (size_t f : {size_t{0}, size_t{2}}) {
    std::vector<float> v(c.model(0).elems(order[f]));
    for (float& x : v) x = d(rng);
    fresh[f] = v;
  }
  uint64_t differing = 0;
  std::map<size_t, std::vector<uint8_t>> changed;  // per element of the fresh tensors
  for (auto& [f, v] : fresh) {
    const std::vector<uint8_t> old = c.model(0).ParamBytes(order[f]);
    for (int r = 0; r < world; ++r) v = c.model(r).SetParam(order[f], v);
    const std::vector<uint8_t> now = c.model(0).ParamBytes(order[f]);
    for (size_t k = 0; k < v.size(); ++k) {
      changed[f].push_back(std::memcmp(&old[k * DTypeSize(dtype)], &now[k * DTypeSize(dtype)],
                                       DTypeSize(dtype)) != 0);
      differing += changed[f].back();
    }
  }
  for (int r = 0; r < world; ++r) {
    const std::vector<uint8_t> same = c.model(r).ParamBytes(order[5]);
    std::vector<float> as_float(c.model(r).elems(order[5]));
    for (size_t k = 0; k < as_float.size(); ++k) {
      uint32_t v = 0;
      std::memcpy(&v, &same[k * DTypeSize(dtype)], DTypeSize(dtype));
      as_float[k] =
          dtype == DType::kBF16 ? BF16ToF32(static_cast<uint16_t>(v)) : std::bit_cast<float>(v);
    }
    c.model(r).SetParam(order[5], as_float);
  }
  ASSERT_GT(differing, 0u);

  std::vector<uint64_t> adopted(world);
  ASSERT_TRUE(c.Run([&](int r) -> Status {
                 STRATA_ASSIGN_OR_RETURN(adopted[r], c.opt(r).ReloadParams());
                 return OkStatus();
               }).ok());
  EXPECT_EQ(std::accumulate(adopted.begin(), adopted.end(), uint64_t{0}), differing);

  const Snapshot after = *TakeSnapshot(c);
  for (size_t t = 0; t < before.state[0].size(); ++t) {
    SCOPED_TRACE("flat tensor " + std::to_string(t));
    for (uint32_t a = 1; a < before.state.size(); ++a) {
      EXPECT_EQ(after.state[a][t], before.state[a][t]) << "array " << a;  // the moments stay
    }
    if (!fresh.count(t)) {
      EXPECT_EQ(after.state[0][t], before.state[0][t]);  // not rounded to the param dtype
      continue;
    }
    // A new value equal to the old one (the master cast to bf16) keeps the
    // fp32 master; the others are the new value.
    for (size_t k = 0; k < fresh[t].size(); ++k) {
      ASSERT_EQ(after.state[0][t][k],
                changed[t][k] ? std::bit_cast<uint32_t>(fresh[t][k]) : before.state[0][t][k])
          << "elem " << k;
    }
  }
  // The next step starts from them: a second reload finds nothing to adopt.
  ASSERT_TRUE(c.Train(seed, 1).ok());
  ASSERT_TRUE(c.Run([&](int r) -> Status {
                 STRATA_ASSIGN_OR_RETURN(adopted[r], c.opt(r).ReloadParams());
                 return OkStatus();
               }).ok());
  EXPECT_EQ(std::accumulate(adopted.begin(), adopted.end(), uint64_t{0}), 0u);
}

INSTANTIATE_TEST_SUITE_P(Tiers, ReloadParamsTest,
                         ::testing::Values(std::tuple{Where::kHost, 0.0, 1},
                                           std::tuple{Where::kNvme, 0.0, 1},
                                           std::tuple{Where::kMixed, 0.0, 2},
                                           std::tuple{Where::kHost, 0.5, 1}));

// Only the params named are read; a bad index is refused before anything.
TEST(ReloadParamsTest, OnlyTheNamedParamsAreAdoptedAndABadIndexIsRefused) {
  const uint64_t seed = TestSeed();
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_TRUE(c.Train(seed, 1).ok());
  const Snapshot before = *TakeSnapshot(c);
  const std::vector<size_t> order = c.model(0).FlatOrder();
  for (size_t f : {size_t{0}, size_t{1}}) {
    // A value no master (about N(0, 1)) rounds to: every element changes.
    c.model(0).SetParam(order[f], std::vector<float>(c.model(0).elems(order[f]), 1000.0f));
  }
  const std::vector<uint32_t> bad = {0, 99};
  Result<uint64_t> refused = c.opt(0).ReloadParams(bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfRange);
  ExpectMentions(refused.status(), "param 99 of 8 registered");
  EXPECT_EQ(TakeSnapshot(c)->state, before.state);
  const std::vector<uint32_t> first = {0};
  Result<uint64_t> n = c.opt(0).ReloadParams(first);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, c.model(0).elems(order[0]));
  const Snapshot after = *TakeSnapshot(c);
  EXPECT_EQ(after.state[0][1], before.state[0][1]);  // written, not named: not adopted
  EXPECT_EQ(after.state[0][0],
            std::vector<uint32_t>(after.state[0][0].size(), std::bit_cast<uint32_t>(1000.0f)));
}

// ---- A load into a new optimizer reads each file once --------------------------------

// The state Create writes from the params may be overwritten by a load at no
// risk (ResetStateFromParams writes it again): such a load reads each data
// file once. A stepped optimizer's load verifies every file before it
// changes anything, then reads it again. A step ends the first kind of state
// (even one that fails); ReloadParams keeps it.
TEST(OnePassLoadTest, ANewOptimizerReadsEachFileOnceAndASteppedOneVerifiesFirst) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster saved(1, CkptConfig(Where::kMixed), seed);
  ASSERT_TRUE(saved.status().ok()) << saved.status();
  ASSERT_TRUE(saved.Train(seed, 2).ok());
  EXPECT_FALSE(saved.opt(0).state_from_params());
  ASSERT_TRUE(saved.Save(dir.path(), {.chunk_bytes = 4096}).ok());
  const CheckpointInfo info = (*CheckpointReader::Open(dir.path()))->info();
  uint64_t payload = 0;
  for (const CheckpointFile& f : info.ranks[0].files) payload += f.payload_bytes;

  auto counting = testing::FaultStorage::Create(CreatePosixStorage(), {.seed = seed});
  Cluster target(1, CkptConfig(Where::kMixed), seed + 1);
  ASSERT_TRUE(target.status().ok()) << target.status();
  EXPECT_TRUE(target.opt(0).state_from_params());
  ASSERT_TRUE(target.opt(0).ReloadParams().ok());
  EXPECT_TRUE(target.opt(0).state_from_params());
  Status s = target.Load(dir.path(), {.storage = counting.get()});
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(target), *TakeSnapshot(saved));
  EXPECT_FALSE(target.opt(0).state_from_params());
  const uint64_t once = counting->stats().read_bytes.load();
  EXPECT_GE(once, payload);
  EXPECT_LE(once, info.data_bytes() + 64 * 1024) << "the data files and the manifests, once";

  ASSERT_TRUE(target.Train(seed, 1).ok());
  s = target.Load(dir.path(), {.storage = counting.get()});
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameSnapshot(*TakeSnapshot(target), *TakeSnapshot(saved));
  EXPECT_GE(counting->stats().read_bytes.load() - once, info.data_bytes() + payload)
      << "every file verified whole, then read again";
}

// A one-rank save of one step, in chunks of 4096 bytes (many per file).
void SaveOneStepInSmallChunks(const std::string& dir, uint64_t seed) {
  Cluster saved(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(saved.status().ok()) << saved.status();
  ASSERT_TRUE(saved.Train(seed, 1).ok());
  ASSERT_TRUE(saved.Save(dir, {.chunk_bytes = 4096}).ok());
}

// ReadFlat reads whole chunks straight into an output aligned to 4096 bytes
// (no copy) and the partial ones at its ends through the reader's buffers;
// an unaligned output gets every chunk through them. Same values either way,
// and a chunk read in place that fails its checksum still fails the read.
TEST(ReaderTest, WholeChunksAreReadStraightIntoAnAlignedOutput) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SaveOneStepInSmallChunks(dir.path(), seed));
  std::mutex mu;
  std::vector<std::span<const std::byte>> reads;
  auto storage = testing::FaultStorage::Create(
      CreatePosixStorage(),
      {.seed = seed, .before_io = [&](IoOp op, const std::string&, std::span<const std::byte> b) {
         std::lock_guard<std::mutex> lock(mu);
         if (op == IoOp::kRead) reads.push_back(b);
       }});
  auto reader = *CheckpointReader::Open(dir.path(), {.storage = storage.get()});
  const uint64_t n = reader->info().total_elems;
  ASSERT_GT(n * 4, 4 * 4096u) << "several whole chunks";
  // [begin, n) with begin 1: the first chunk is partial, the last one is
  // padded past the payload.
  const ElemRange range{1, n};
  const size_t bytes = range.elems() * 4;
  std::unique_ptr<std::byte, decltype(&std::free)> memory(
      static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 8191) / 4096 * 4096)), &std::free);
  // Elem 1 (file byte 4) at memory + 4: the chunks' file offsets and their
  // places in the output agree modulo 4096. A vector's data is 16-byte
  // aligned, so never 4 past a page: no chunk of it is aligned.
  const std::span<float> aligned(reinterpret_cast<float*>(memory.get() + 4), range.elems());
  std::vector<float> unaligned(range.elems());
  auto in_out = [&](std::span<const float> out) {
    std::lock_guard<std::mutex> lock(mu);
    const auto* lo = reinterpret_cast<const std::byte*>(out.data());
    uint64_t in_place = 0;
    for (std::span<const std::byte> b : reads) {
      if (b.data() >= lo && b.data() + b.size() <= lo + out.size_bytes()) in_place += b.size();
    }
    reads.clear();
    return in_place;
  };
  ASSERT_TRUE(reader->ReadFlat(0, range, unaligned).ok());
  EXPECT_EQ(in_out(unaligned), 0u);
  Status s = reader->ReadFlat(0, range, aligned);
  ASSERT_TRUE(s.ok()) << s;
  const uint64_t whole = (n * 4 / 4096 - 1) * 4096;  // chunks 1 .. the last whole one
  EXPECT_EQ(in_out(aligned), whole);
  EXPECT_TRUE(std::equal(aligned.begin(), aligned.end(), unaligned.begin(), [](float a, float b) {
    return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
  }));

  // A bit flipped in chunk 2, which is read in place.
  reader.reset();
  const CheckpointFile& file = (*CheckpointReader::Open(dir.path()))->info().ranks[0].files[0];
  testing::FlipBits((*CheckpointReader::Open(dir.path()))->info().save_dir + "/" + file.name,
                    2 * 4096 + 17, 0x04);
  reader = *CheckpointReader::Open(dir.path(), {.storage = storage.get()});
  s = reader->ReadFlat(0, range, aligned);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  ExpectMentions(s, ": chunk 2 ");
}

// A chunk that fails its checksum late in a new optimizer's load, after the
// earlier sub-groups took their saved state on every rank: every rank
// writes the state Create wrote again, the params and counters stay, and
// the optimizer trains on exactly as one that never saw the checkpoint.
class OnePassLoadFailureTest : public ::testing::TestWithParam<std::tuple<Where, double, int>> {};

TEST_P(OnePassLoadFailureTest, ACorruptChunkLeavesTheStateAsCreatedOnEveryRank) {
  const auto [where, gpu_fraction, world] = GetParam();
  const uint64_t seed = TestSeed();
  const OffloadConfig config =
      WithGpu(CkptConfig(where, OptimizerType::kAdamW, 1024, world), gpu_fraction);
  TempDir dir;
  {
    Cluster saved(world, config, seed);
    ASSERT_TRUE(saved.status().ok()) << saved.status();
    ASSERT_TRUE(saved.Train(seed, 2).ok());
    ASSERT_TRUE(saved.Save(dir.path(), {.chunk_bytes = 4096}).ok());
  }
  // The last rank's last array, in its last chunk of data: what its load
  // reads last.
  const CheckpointInfo info = (*CheckpointReader::Open(dir.path()))->info();
  const CheckpointFile& last = info.ranks.back().files.back();
  const std::string bad = info.save_dir + "/" + last.name;
  testing::FlipBits(bad, last.payload_bytes - 3, 0x10);

  Cluster target(world, config, seed + 1);
  ASSERT_TRUE(target.status().ok()) << target.status();
  const Snapshot before = *TakeSnapshot(target);
  ASSERT_TRUE(target.device().Synchronize().ok());
  std::vector<std::vector<uint8_t>> params_before;
  for (size_t t = 0; t < target.model(0).size(); ++t) {
    params_before.push_back(target.model(0).ParamBytes(t));
  }
  std::vector<Status> status(world);
  ASSERT_TRUE(target
                  .Run([&](int r) {
                    status[r] = LoadCheckpoint(target.opt(r), dir.path());
                    return OkStatus();
                  })
                  .ok());
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_FALSE(status[r].ok());
    ExpectMentions(status[r],
                   "nothing was loaded (the state is again the one Create wrote from the params)");
    if (r == world - 1) {
      EXPECT_EQ(status[r].code(), StatusCode::kDataLoss) << status[r];
      ExpectMentions(status[r], bad + ": chunk");
    } else {
      ExpectMentions(status[r], "1 other rank(s) failed while loading");
    }
    EXPECT_TRUE(target.opt(r).state_from_params());
  }
  ExpectSameSnapshot(*TakeSnapshot(target), before);
  ASSERT_TRUE(target.device().Synchronize().ok());
  for (int r = 0; r < world; ++r) {
    for (size_t t = 0; t < target.model(r).size(); ++t) {
      EXPECT_EQ(target.model(r).ParamBytes(t), params_before[t]) << "rank " << r << " tensor " << t;
    }
  }
  Cluster twin(world, config, seed + 1);
  ASSERT_TRUE(twin.status().ok()) << twin.status();
  ASSERT_TRUE(target.Train(seed + 2, 2).ok());
  ASSERT_TRUE(twin.Train(seed + 2, 2).ok());
  ExpectSameSnapshot(*TakeSnapshot(target), *TakeSnapshot(twin));
  ASSERT_TRUE(target.device().Synchronize().ok());
  for (size_t t = 0; t < target.model(0).size(); ++t) {
    EXPECT_EQ(target.model(0).ParamBytes(t), twin.model(0).ParamBytes(t)) << "tensor " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Tiers, OnePassLoadFailureTest,
                         ::testing::Values(std::tuple{Where::kHost, 0.0, 1},
                                           std::tuple{Where::kNvme, 0.0, 1},
                                           std::tuple{Where::kMixed, 0.0, 2},
                                           std::tuple{Where::kHost, 0.5, 1}));

// Verify checks the arrays' files on threads of their own (the two
// checksums per byte are CPU work at about a drive's rate): reads of two
// files are in flight at once. With threads = 1 the files are read one after
// the other. Of two corrupt files, the error names the lower array's.
TEST(ReaderTest, VerifyReadsTheArraysFilesOnThreadsOfTheirOwn) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one hardware thread";
  const uint64_t seed = TestSeed();
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SaveOneStepInSmallChunks(dir.path(), seed));
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> order;  // the data file of each read, as submitted
  bool meet = true;                // a read waits until another file was read
  int alone = 0;
  auto storage = testing::FaultStorage::Create(
      CreatePosixStorage(),
      {.seed = seed,
       .before_io = [&](IoOp op, const std::string& path, std::span<const std::byte>) {
         if (op != IoOp::kRead || !path.ends_with(".f32")) return;  // not a manifest
         std::unique_lock<std::mutex> lock(mu);
         order.push_back(path);
         cv.notify_all();
         auto other = [&] {
           return std::any_of(order.begin(), order.end(), [&](auto& p) { return p != path; });
         };
         if (meet && alone == 0 && !cv.wait_for(lock, std::chrono::seconds(10), other)) ++alone;
       }});
  auto reader = *CheckpointReader::Open(dir.path(), {.storage = storage.get()});
  const uint32_t arrays = static_cast<uint32_t>(reader->info().arrays.size());
  ASSERT_EQ(arrays, 3u);
  Status s = reader->Verify();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(alone, 0) << "a file's read waited 10 s for a read of another file";

  meet = false;
  order.clear();
  reader = *CheckpointReader::Open(dir.path(), {.storage = storage.get(), .threads = 1});
  ASSERT_TRUE(reader->Verify().ok());
  uint32_t runs = 0;
  for (size_t i = 0; i < order.size(); ++i) runs += i == 0 || order[i] != order[i - 1];
  EXPECT_EQ(runs, arrays) << "one thread: each file read whole before the next";

  const CheckpointInfo info = reader->info();
  for (uint32_t a : {2u, 1u}) {
    testing::FlipBits(info.save_dir + "/" + info.ranks[0].files[a].name, 4096 + 3, 0x10);
  }
  for (int threads : {0, 1}) {
    reader = *CheckpointReader::Open(dir.path(), {.threads = threads});
    s = reader->Verify();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
    ExpectMentions(s, info.ranks[0].files[1].name + ": chunk 1 ");
  }
}

// A verify pass of a large checkpoint takes a while: it logs progress lines
// as save and load do (here at once: quiet_sec 0), a final "done" line when
// every file passed, and none when one failed.
TEST(ReaderTest, VerifyLogsProgressAndADoneLineOnlyWhenEverythingPassed) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SaveOneStepInSmallChunks(dir.path(), seed));
  std::mutex mu;
  std::vector<std::string> lines;
  LogSink previous = SetLogSink([&](LogLevel, std::string_view m) {
    std::lock_guard<std::mutex> lock(mu);
    lines.emplace_back(m);
  });
  const LogLevel level = GetLogLevel();
  SetLogLevel(LogLevel::kInfo);
  const ReaderOptions o{.verify_what = "rank 3: verify it",
                        .progress = {.quiet_sec = 0, .interval_sec = 0}};
  auto count = [&](std::string_view what) {
    std::lock_guard<std::mutex> lock(mu);
    return std::count_if(lines.begin(), lines.end(),
                         [&](const std::string& l) { return l.find(what) != std::string::npos; });
  };
  Status s = (*CheckpointReader::Open(dir.path(), o))->Verify();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_GE(count("rank 3: verify it: "), 2) << "progress lines";
  EXPECT_EQ(count("rank 3: verify it: done, "), 1);
  const CheckpointInfo info = (*CheckpointReader::Open(dir.path()))->info();
  testing::FlipBits(info.save_dir + "/" + info.ranks[0].files[2].name, 2 * 4096 + 9, 0x01);
  lines.clear();
  s = (*CheckpointReader::Open(dir.path(), o))->Verify();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_GE(count("rank 3: verify it: "), 1);
  EXPECT_EQ(count(": done, "), 0) << "a failed verify claims nothing";
  SetLogLevel(level);
  SetLogSink(std::move(previous));
}

// Reads that go on where the one before ended (the next tensor, the next
// sub-group) find their chunks read ahead: a call leaves the next chunks in
// flight (up to queue_depth), each chunk is read from the drive once, and a
// bad chunk read ahead fails only the call that asks for it. A call
// elsewhere reads what it asks for.
TEST(ReaderTest, ConsecutiveReadsFindTheNextChunksReadAhead) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SaveOneStepInSmallChunks(dir.path(), seed));
  auto whole_reader = *CheckpointReader::Open(dir.path());
  const CheckpointInfo info = whole_reader->info();
  const uint64_t n = info.total_elems, per_chunk = 4096 / 4;
  ASSERT_GE(n / per_chunk, 6u) << "more chunks than the queue depth (4)";
  std::vector<float> want(n);
  ASSERT_TRUE(whole_reader->ReadFlat(0, {0, n}, want).ok());

  // Chunk by chunk through the reader's storage, counting requests.
  std::atomic<int> submitted{0};
  auto counting = testing::FaultStorage::Create(
      CreatePosixStorage(),
      {.seed = seed, .before_io = [&](IoOp op, const std::string& path, auto) {
         if (op == IoOp::kRead && path.ends_with(".master.f32")) ++submitted;
       }});
  auto reader = *CheckpointReader::Open(dir.path(), {.storage = counting.get(), .queue_depth = 4});
  std::vector<float> got(n);
  for (uint64_t c = 0; c * per_chunk < n; ++c) {
    const uint64_t lo = c * per_chunk, hi = std::min(n, lo + per_chunk);
    Status s = reader->ReadFlat(0, {lo, hi}, std::span(got).subspan(lo, hi - lo));
    ASSERT_TRUE(s.ok()) << "chunk " << c << ": " << s;
    if (c == 0) {
      EXPECT_EQ(submitted.load(), 4) << "the first call leaves 3 chunks in flight";
    }
  }
  EXPECT_EQ(got, want);
  const uint64_t chunks = info.ranks[0].files[0].chunk_xxh3.size();
  EXPECT_EQ(submitted.load(), static_cast<int>(chunks)) << "each chunk read once";

  // Back to the start: read again, whatever the stream held.
  submitted = 0;
  ASSERT_TRUE(reader->ReadFlat(0, {0, per_chunk}, std::span(got).first(per_chunk)).ok());
  EXPECT_GE(submitted.load(), 1);
  EXPECT_EQ(got, want);

  // A corrupt chunk 3, read ahead by the calls for chunks 0 to 2, fails the
  // call for chunk 3 alone.
  testing::FlipBits(info.save_dir + "/" + info.ranks[0].files[0].name, 3 * 4096 + 5, 0x02);
  reader = *CheckpointReader::Open(dir.path(), {.queue_depth = 4});
  for (uint64_t c = 0; c < 3; ++c) {
    Status s = reader->ReadFlat(0, {c * per_chunk, (c + 1) * per_chunk},
                                std::span(got).subspan(c * per_chunk, per_chunk));
    EXPECT_TRUE(s.ok()) << "chunk " << c << ": " << s;
  }
  Status s = reader->ReadFlat(0, {3 * per_chunk, 4 * per_chunk},
                              std::span(got).subspan(3 * per_chunk, per_chunk));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  ExpectMentions(s, ": chunk 3 ");
}

// The descriptors this process has open.
size_t OpenFds() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// A reader holds at most one data file per array open, whatever the number
// of ranks: it kept every file it opened (CheckFiles and Verify open them
// all), and inspect of a 200-rank Adam save (600 files, two descriptors each
// on io_uring) failed with EMFILE, blaming one data file.
// The read buffers (queue_depth + 1 chunks per array) are asked of the
// allocator at an array's first read: when it has none to give (here a
// child process whose address space is capped), the read is
// ResourceExhausted naming them; it was an abort (STRATA_CHECK), and a
// chunk_bytes of up to 256 MiB makes that 2.25 GiB per array.
TEST(ReaderTest, ReadBuffersThatCannotBeHadAreResourceExhaustedNotAnAbort) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers need more address space than the cap leaves";
#else
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_TRUE(c.Train(seed, 1).ok());
  constexpr uint64_t kChunk = uint64_t{64} << 20;
  ASSERT_TRUE(c.Save(dir.path(), {.chunk_bytes = kChunk}).ok());
  auto reader = CheckpointReader::Open(dir.path(), {.queue_depth = 8});
  ASSERT_TRUE(reader.ok()) << reader.status();
  const uint64_t elems = (*reader)->info().total_elems;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Room for what is mapped now and 128 MiB: less than 9 chunks of 64 MiB.
    std::ifstream statm("/proc/self/statm");
    uint64_t pages = 0;
    statm >> pages;
    const rlim_t cap = pages * ::sysconf(_SC_PAGESIZE) + (rlim_t{128} << 20);
    const rlimit limit{cap, cap};
    if (::setrlimit(RLIMIT_AS, &limit) != 0) ::_exit(3);
    std::vector<float> out(elems);
    const Status s = (*reader)->ReadFlat(0, {0, elems}, out);
    const bool named = s.code() == StatusCode::kResourceExhausted &&
                       s.message().find(
                           "no memory for the read buffers of array 'master' (9 "
                           "chunks of chunk_bytes 64.00 MiB") != std::string::npos;
    if (!named) std::fprintf(stderr, "child: %s\n", s.ToString().c_str());
    ::_exit(named ? 0 : 1);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus)) << "the child died of signal " << WTERMSIG(wstatus);
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "(1: another status, printed above; 3: no setrlimit)";
  // The parent, uncapped, reads it.
  std::vector<float> all(elems);
  const Status read = (*reader)->ReadFlat(0, {0, elems}, all);
  EXPECT_TRUE(read.ok()) << read;
#endif
}

TEST(ReaderTest, OpenFilesStayBoundedWhateverTheNumberOfRanks) {
  const uint64_t seed = TestSeed();
  constexpr int kWorld = 12;
  TempDir dir;
  Cluster c(kWorld, CkptConfig(Where::kHost, OptimizerType::kAdam, 1024, kWorld), seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_TRUE(c.Train(seed, 1).ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  // The most descriptors open when a data file is read (io_uring: two per file).
  std::mutex mu;
  size_t most = 0;
  auto base = CreateStorage({});
  ASSERT_TRUE(base.ok()) << base.status();
  auto counting = testing::FaultStorage::Create(
      std::move(*base), {.seed = seed, .before_io = [&](IoOp op, const std::string& path, auto) {
                           if (op != IoOp::kRead || !path.ends_with(".f32")) return;
                           // Counted under the lock: two threads listing
                           // /proc/self/fd at once would each see the
                           // other's directory descriptor.
                           std::lock_guard<std::mutex> lock(mu);
                           most = std::max(most, OpenFds());
                         }});
  const size_t before = OpenFds();
  {
    auto reader = CheckpointReader::Open(dir.path(), {.storage = counting.get()});
    ASSERT_TRUE(reader.ok()) << reader.status();
    const CheckpointInfo& info = (*reader)->info();
    ASSERT_EQ(info.world_size, static_cast<uint32_t>(kWorld));
    const size_t arrays = info.arrays.size();
    ASSERT_EQ(arrays, 3u);
    ASSERT_TRUE((*reader)->CheckFiles().ok());
    EXPECT_LE(OpenFds(), before) << "CheckFiles keeps no file open";
    Status s = (*reader)->Verify();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_LE(most, before + 2 * arrays);
    EXPECT_LE(OpenFds(), before + 2 * arrays);
    // Every array read whole, across the ranks.
    for (uint32_t a = 0; a < arrays; ++a) {
      std::vector<float> all(info.total_elems);
      s = (*reader)->ReadFlat(a, {0, info.total_elems}, all);
      ASSERT_TRUE(s.ok()) << s;
    }
    EXPECT_LE(most, before + 2 * arrays);
  }
  EXPECT_LE(OpenFds(), before);
  // An export reads the master files (one open at a time) and writes one file.
  most = 0;
  TempDir out;
  ExportOptions o;
  o.reader.storage = counting.get();
  auto exported = ExportSafetensors(dir.path(), out.File("m.safetensors"), o);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_GT(most, 0u);
  EXPECT_LE(most, before + 2 + 2);
}

// A command that removes what a signal interrupts (bench checkpoint) learns
// of a save's directory before it exists: kCreatingDirectory comes before
// the mkdir and before the first temporary inside it, so there is no
// moment when the directory is there and unknown to it.
TEST(SaveTest, TheSaveDirectoryIsAnnouncedBeforeItIsMade) {
  namespace fs = std::filesystem;
  const uint64_t seed = TestSeed();
  TempDir dir;
  Cluster c(1, CkptConfig(Where::kHost), seed);
  ASSERT_TRUE(c.status().ok()) << c.status();
  ASSERT_TRUE(c.Train(seed, 1).ok());
  std::mutex mu;
  std::vector<std::pair<AtomicFileEvent, std::string>> events;
  std::vector<bool> existed;  // per kCreatingDirectory: the path already existed
  AtomicFileListener previous =
      SetAtomicFileListener([&](AtomicFileEvent e, const std::string& path) {
        std::lock_guard<std::mutex> lock(mu);
        events.emplace_back(e, path);
        if (e == AtomicFileEvent::kCreatingDirectory) existed.push_back(fs::exists(path));
      });
  Status s = c.Save(dir.path());
  SetAtomicFileListener(std::move(previous));
  ASSERT_TRUE(s.ok()) << s;
  const std::string save_dir = (*CheckpointReader::Open(dir.path()))->info().save_dir;
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front(), std::make_pair(AtomicFileEvent::kCreatingDirectory, save_dir));
  EXPECT_EQ(existed, std::vector<bool>{false});
  const auto first_inside = std::find_if(events.begin(), events.end(), [&](const auto& e) {
    return e.first == AtomicFileEvent::kCreatingTemporary &&
           fs::path(e.second).parent_path() == fs::path(save_dir);
  });
  EXPECT_NE(first_inside, events.end()) << "the data files are written through temporaries";
}

}  // namespace
}  // namespace strata
