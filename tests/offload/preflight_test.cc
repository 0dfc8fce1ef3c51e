// The engine's machine checks, end to end through OffloadOptimizer::Create:
// a model this machine cannot hold is refused before anything is allocated,
// with the numbers; a missing nvme_path folder is made; one that cannot be
// made is a clear error. (The planner's arithmetic: placement_test.cc.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "offload/config.h"
#include "offload/optimizer.h"
#include "runtime/device.h"
#include "runtime/machine.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

struct Fixture {
  std::unique_ptr<Device> device;
  DeviceBuffer data, grad;
};

Fixture Make(uint64_t bytes) {
  Fixture f;
  f.device = std::move(*CreateHostDevice());
  f.data = std::move(*f.device->Allocate(bytes));
  f.grad = std::move(*f.device->Allocate(bytes));
  return f;
}

TEST(EnginePreflightTest, AModelLargerThanThisMachineIsRefusedWithTheNumbers) {
  Result<HostMemory> mem = ProbeHostMemory();
  ASSERT_TRUE(mem.ok()) << mem.status();
  Fixture f = Make(4096);
  // Claims 4x the machine's memory in parameters: the plan (16 bytes a
  // parameter in DRAM) cannot fit; nothing is read or allocated before the
  // plan is refused, so the small buffers behind the claim are never touched.
  const uint64_t elems = mem->total_bytes;
  OffloadConfig config;  // offload to cpu, host budget unlimited
  // The claimed grad starts where the claimed data ends: disjoint, as Create
  // checks, and never dereferenced.
  void* grad = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(f.data.data()) +
                                       elems * DTypeSize(config.param_dtype));
  std::vector<ParamGroup> groups(1);
  groups[0].params.push_back({.name = "huge", .data = f.data.data(), .grad = grad, .elems = elems});
  EngineContext context;
  context.device = f.device.get();
  Result<std::unique_ptr<OffloadOptimizer>> opt =
      OffloadOptimizer::Create(context, config, groups);
  ASSERT_EQ(opt.status().code(), StatusCode::kResourceExhausted) << opt.status();
  const std::string m(opt.status().message());
  EXPECT_NE(m.find("of host memory"), std::string::npos) << m;
  EXPECT_NE(m.find("but this machine has"), std::string::npos) << m;
  // The knob: state on NVMe (and smaller sub-groups where even the staging
  // is too much).
  EXPECT_NE(m.find("nvme_path"), std::string::npos) << m;
}

class NvmePathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("strata-nvme-path-" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  Result<std::unique_ptr<OffloadOptimizer>> CreateWith(const std::string& nvme_path) {
    // Buffers before their device.
    fixture_.grad = {};
    fixture_.data = {};
    fixture_.device.reset();
    fixture_ = Make(kElems * 4);
    groups_.assign(1, {});
    groups_[0].params.push_back(
        {.name = "w", .data = fixture_.data.data(), .grad = fixture_.grad.data(),
         .elems = kElems});
    OffloadConfig config;
    config.device = OffloadDevice::kNvme;
    config.nvme_paths = {nvme_path};
    config.host_budget_bytes = 0;  // staging only: every sub-group on NVMe
    config.sub_group_elems = kElems / 2;
    config.buffer_count = 2;
    EngineContext context;
    context.device = fixture_.device.get();
    return OffloadOptimizer::Create(context, config, groups_);
  }
  static constexpr uint64_t kElems = 8192;
  fs::path root_;
  Fixture fixture_;
  std::vector<ParamGroup> groups_;
};

TEST_F(NvmePathTest, AMissingFolderIsCreated) {
  const std::string dir = (root_ / "not" / "yet").string();
  Result<std::unique_ptr<OffloadOptimizer>> opt = CreateWith(dir);
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_TRUE(fs::is_directory(dir));
  EXPECT_TRUE(fs::exists(dir + "/strata-rank0.state"));
  ASSERT_TRUE((*opt)->Step().ok());
}

TEST_F(NvmePathTest, AFolderThatCannotBeMadeIsAClearError) {
  const std::string file = (root_ / "a-file").string();
  std::ofstream(file) << "x";
  // The preflight refuses both before anything is allocated.
  Result<std::unique_ptr<OffloadOptimizer>> opt = CreateWith(file + "/state");
  ASSERT_EQ(opt.status().code(), StatusCode::kFailedPrecondition) << opt.status();
  const std::string m(opt.status().message());
  EXPECT_NE(
      m.find("nvme_path " + file + "/state: cannot be created: " + file + " is not a directory"),
      std::string::npos)
      << m;
  opt = CreateWith(file);
  ASSERT_EQ(opt.status().code(), StatusCode::kFailedPrecondition) << opt.status();
  EXPECT_NE(opt.status().message().find("exists and is not a directory"), std::string_view::npos);
}

}  // namespace
}  // namespace strata
