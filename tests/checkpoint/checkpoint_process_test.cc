// Checkpoints across processes: a child killed with SIGKILL at random points
// during Save leaves the last complete checkpoint, bitwise; and the `strata
// inspect` / `strata export` command line (exit codes and output).
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "offload/checkpoint.h"
#include "runtime/testing/test_util.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/offload/test_seed.h"

namespace strata {
namespace {

using testing::Cluster;
using testing::ExpectParamsAreMaster;
using testing::ExpectSameSnapshot;
using testing::Snapshot;
using testing::TakeSnapshot;
using testing::TempDir;
using testing::TestSeed;

// A binary next to this test's own.
std::string Sibling(const std::string& name) {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / name).string();
}

// A child process with its stdout on a pipe.
struct Child {
  pid_t pid = -1;
  int out = -1;
  std::string buffered;

  static Child Spawn(const std::vector<std::string>& args) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    Child c;
    c.pid = ::fork();
    if (c.pid == 0) {
      ::dup2(fds[1], 1);
      const int devnull = ::open("/dev/null", O_WRONLY);
      ::dup2(devnull, 2);
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    c.out = fds[0];
    return c;
  }
  // The next line, or "" at end of output.
  std::string ReadLine() {
    for (;;) {
      if (size_t nl = buffered.find('\n'); nl != std::string::npos) {
        std::string line = buffered.substr(0, nl);
        buffered.erase(0, nl + 1);
        return line;
      }
      char buf[256];
      const ssize_t n = ::read(out, buf, sizeof(buf));
      if (n <= 0) return "";
      buffered.append(buf, static_cast<size_t>(n));
    }
  }
  // Exit status (or 128 + signal).
  int Wait() {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(out);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

// Where the child was: the last "saved N" and "saving N" lines it printed.
struct Progress {
  int saved = 0;
  int saving = 0;
};
Progress ReadProgress(Child& c, Progress p) {
  for (std::string line = c.ReadLine(); !line.empty(); line = c.ReadLine()) {
    if (line.rfind("saved ", 0) == 0) p.saved = std::stoi(line.substr(6));
    if (line.rfind("saving ", 0) == 0) p.saving = std::stoi(line.substr(7));
  }
  return p;
}

TEST(CrashTest, SigkillAtRandomPointsDuringSaveLeavesTheLastCompleteCheckpoint) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  constexpr int kCalibrationRounds = 6;
  constexpr int kKills = 96;
  constexpr int kForever = 1000000;  // the child never finishes by itself
  const std::string helper = Sibling("checkpoint_crash_helper");
  ASSERT_TRUE(std::filesystem::exists(helper)) << helper;

  // What each step's checkpoint must hold: the same training in this
  // process, extended as far as a child got.
  Cluster ref(1, testing::CrashTestConfig(), seed);
  ASSERT_TRUE(ref.status().ok()) << ref.status();
  std::vector<Snapshot> want = {*TakeSnapshot(ref)};
  auto want_at = [&](int64_t step) -> const Snapshot& {
    while (static_cast<int64_t>(want.size()) <= step) {
      EXPECT_TRUE(ref.Train(seed, 1).ok());
      want.push_back(*TakeSnapshot(ref));
    }
    return want[step];
  };
  Cluster loader(1, testing::CkptConfig(testing::Where::kNvme), seed + 1);
  ASSERT_TRUE(loader.status().ok());

  // A run to the end sets the time scale of the kills.
  double round_sec = 0;
  {
    TempDir dir;
    Child c = Child::Spawn(
        {helper, dir.path(), std::to_string(seed), std::to_string(kCalibrationRounds)});
    ASSERT_EQ(c.ReadLine(), "saving 1");
    ASSERT_EQ(c.ReadLine(), "saved 1");
    const auto t1 = std::chrono::steady_clock::now();
    ASSERT_EQ(ReadProgress(c, {}).saved, kCalibrationRounds);
    ASSERT_EQ(c.Wait(), 0);
    round_sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count() /
                (kCalibrationRounds - 1);
    Status s = loader.opt(0).Load(dir.path());
    ASSERT_TRUE(s.ok()) << s;
    ExpectSameSnapshot(*TakeSnapshot(loader), want_at(kCalibrationRounds));
  }
  std::printf("one round (step + save) takes %.2f ms\n", round_sec * 1e3);

  int inside_save = 0;
  for (int k = 0; k < kKills; ++k) {
    SCOPED_TRACE("kill " + std::to_string(k));
    TempDir dir;
    Child c = Child::Spawn({helper, dir.path(), std::to_string(seed), std::to_string(kForever)});
    // After the first save returned there is always a complete checkpoint.
    ASSERT_EQ(c.ReadLine(), "saving 1");
    ASSERT_EQ(c.ReadLine(), "saved 1");
    const auto delay = std::chrono::microseconds(
        static_cast<int64_t>(std::uniform_real_distribution<double>(0, 3 * round_sec)(rng) * 1e6));
    std::this_thread::sleep_for(delay);
    ::kill(c.pid, SIGKILL);
    const Progress p = ReadProgress(c, {.saved = 1, .saving = 1});
    ASSERT_EQ(c.Wait(), 128 + SIGKILL);
    if (p.saving > p.saved) ++inside_save;
    Status s = loader.opt(0).Load(dir.path());
    ASSERT_TRUE(s.ok()) << s;
    Snapshot got = *TakeSnapshot(loader);
    // A save killed after it published and before "saved" was printed
    // counts as complete.
    ASSERT_GE(got.step, p.saved);
    ASSERT_LE(got.step, p.saving);
    ExpectSameSnapshot(got, want_at(got.step));
    ExpectParamsAreMaster(loader, want_at(got.step));
    // Retention: the published save and at most the one before it remain,
    // besides the leftovers of the save that was killed.
    int saves = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      saves += e.path().filename().string().rfind("step-", 0) == 0;
    }
    EXPECT_LE(saves, 3);
  }
  std::printf("%d of %d kills landed inside a Save\n", inside_save, kKills);
  EXPECT_GE(inside_save, 50);
}

// ---- The command line ----------------------------------------------------------

struct Ran {
  int code = -1;
  std::string out;
  std::string err;
};

Ran RunStrata(const std::string& args, const TempDir& tmp) {
  const std::string out = tmp.File("cli.out"), err = tmp.File("cli.err");
  const std::string cmd = Sibling("strata") + " " + args + " >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  Ran r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream o(out), e(err);
  r.out.assign(std::istreambuf_iterator<char>(o), std::istreambuf_iterator<char>());
  r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  return r;
}

TEST(CliTest, InspectAndExport) {
  const uint64_t seed = TestSeed();
  TempDir dir, tmp;
  Cluster c(2, testing::CkptConfig(testing::Where::kHost, OptimizerType::kAdamW, 512, 2), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 3).ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());

  Ran r = RunStrata("inspect " + dir.path(), tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  std::printf("%s", r.out.c_str());
  EXPECT_NE(r.out.find("step         3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("world size   2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not verified"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("t0"), std::string::npos) << r.out;

  r = RunStrata("inspect --verify " + dir.path(), tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("verified: every chunk"), std::string::npos) << r.out;

  r = RunStrata("inspect --verify --json " + dir.path(), tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("step"), 3);
  EXPECT_EQ(j.at("world_size"), 2);
  EXPECT_EQ(j.at("verified"), true);
  EXPECT_EQ(j.at("tensors").size(), testing::kCkptSizes.size());

  const std::string out = tmp.File("model.safetensors");
  r = RunStrata("export " + dir.path() + " " + out, tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(out));
  EXPECT_GT(std::filesystem::file_size(out), 8u);

  r = RunStrata("inspect " + dir.File("missing"), tmp);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("strata inspect: NotFound"), std::string::npos) << r.err;

  r = RunStrata("inspect", tmp);
  EXPECT_EQ(r.code, 2) << r.err;

  // One flipped byte: inspect without --verify still reads the manifests,
  // --verify fails naming the file.
  auto reader = *CheckpointReader::Open(dir.path());
  const std::string victim = reader->info().save_dir + "/rank00001.exp_avg_sq.f32";
  // Flipped, not overwritten: a byte that already held the value written
  // left the file intact (one run in 256) and --verify passed.
  testing::FlipBits(victim, 100, 0x5a);
  r = RunStrata("inspect " + dir.path(), tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  r = RunStrata("inspect --verify " + dir.path(), tmp);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("DataLoss"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank00001.exp_avg_sq.f32"), std::string::npos) << r.err;
  r = RunStrata("export " + dir.path() + " " + tmp.File("x.safetensors"), tmp);
  EXPECT_EQ(r.code, 0) << "export reads only the master weights: " << r.err;
}

// Without --verify, inspect still opens every data file and checks its size
// against the manifest: a save missing a file (an incomplete copy) or with a
// truncated one exits 1 naming it (it used to print the save as fine).
TEST(CliTest, InspectWithoutVerifyChecksThatEveryDataFileIsThere) {
  const uint64_t seed = TestSeed();
  TempDir dir, tmp;
  Cluster c(2, testing::CkptConfig(testing::Where::kHost, OptimizerType::kAdamW, 512, 2), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  const std::string save_dir = (*CheckpointReader::Open(dir.path()))->info().save_dir;
  Ran r = RunStrata("inspect " + dir.path(), tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("every data file is there with its size"), std::string::npos) << r.out;

  const std::string victim = save_dir + "/rank00001.exp_avg.f32";
  std::filesystem::resize_file(victim, 4096);
  r = RunStrata("inspect " + dir.path(), tmp);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.err.find("DataLoss"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(victim + " has 4096 bytes"), std::string::npos) << r.err;

  std::filesystem::remove(victim);
  r = RunStrata("inspect --json " + dir.path(), tmp);
  EXPECT_EQ(r.code, 1) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("files_present"), false);
  EXPECT_EQ(j.at("error").at("code"), "NotFound") << j.dump();
  EXPECT_NE(j.at("error").at("message").get<std::string>().find(victim + " is missing"),
            std::string::npos)
      << j.dump();
}

// `inspect DIR/` of a one-group save: the save's directory is joined with one
// slash (it printed ckpt//step-...), and the counts read "1 tensor" and
// "1 group"; --json of a directory that is no checkpoint still prints one
// object, with the error as `strata plan --json` gives it (stdout was empty).
TEST(CliTest, InspectOfOneGroupWithATrailingSlashAndJsonErrors) {
  TempDir dir, tmp;
  auto device = std::move(*CreateHostDevice());
  constexpr uint64_t kElems = 1024;
  DeviceBuffer data = std::move(*device->Allocate(kElems * 4));
  DeviceBuffer grad = std::move(*device->Allocate(kElems * 4));
  std::vector<ParamGroup> groups(1);
  groups[0].params.push_back(
      {.name = "w", .data = data.data(), .grad = grad.data(), .elems = kElems});
  OffloadConfig config;
  auto opt = OffloadOptimizer::Create({.device = device.get()}, config, groups);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE((*opt)->Save(dir.path()).ok());

  Ran r = RunStrata("inspect " + dir.path() + "/", tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("//"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  save         " + dir.path() + "/step-"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 tensor, 1024 elems"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 group\n"), std::string::npos) << r.out;

  r = RunStrata("inspect --json " + dir.path() + "/", tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("save_dir").get<std::string>().find("//"), std::string::npos) << r.out;
  EXPECT_TRUE(j.at("error").is_null()) << r.out;

  r = RunStrata("inspect --json " + dir.File("missing"), tmp);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.err.find("strata inspect: NotFound"), std::string::npos) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("error").at("code"), "NotFound") << r.out;
  EXPECT_NE(j.at("error").at("message").get<std::string>().find("no such directory"),
            std::string::npos)
      << r.out;
}

// `inspect --json` of a checkpoint under a directory whose name is not
// UTF-8 prints the JSON with U+FFFD for the bad byte (it once aborted with
// nlohmann's type_error.316, exit 134).
TEST(CliTest, InspectJsonWithAPathThatIsNotUtf8) {
  const uint64_t seed = TestSeed();
  TempDir tmp;
  const std::string dir = tmp.File("bad\xff" "dir");
  ASSERT_TRUE(std::filesystem::create_directory(dir));
  Cluster c(1, testing::CkptConfig(testing::Where::kHost, OptimizerType::kAdamW, 512, 2), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 1).ok());
  ASSERT_TRUE(c.Save(dir).ok());

  Ran r = RunStrata("inspect --json '" + dir + "'", tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_NE(j.value("dir", "").find("bad\xef\xbf\xbd" "dir"), std::string::npos) << r.out;
  EXPECT_EQ(j.value("step", -1), 1);
}

// ---- Read-only checkpoints ---------------------------------------------------------

// fork, switch to `uid`/`gid` where it is another user (this process is
// root), run `fn` there and exit with what it returns: only system calls
// between fork and exit or exec (the parent has threads).
int RunAs(uid_t uid, gid_t gid, const std::function<int()>& fn) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (uid != ::geteuid() &&
        (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0)) {
      ::_exit(126);
    }
    ::_exit(fn());
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// `strata args...` as `uid`, stdout and stderr in files of `tmp`.
Ran RunStrataAs(uid_t uid, gid_t gid, std::vector<std::string> args, const TempDir& tmp) {
  const std::string out = tmp.File("cli_as.out"), err = tmp.File("cli_as.err");
  const int out_fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err_fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  args.insert(args.begin(), Sibling("strata"));
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  Ran r;
  r.code = RunAs(uid, gid, [&] {
    ::dup2(out_fd, 1);
    ::dup2(err_fd, 2);
    ::execv(argv[0], argv.data());
    return 127;
  });
  ::close(out_fd);
  ::close(err_fd);
  r.out = testing::ReadFileBytes(out);
  r.err = testing::ReadFileBytes(err);
  return r;
}

// Sets the mode of everything under `root` (root included): `dirs` for
// directories, `files` for the rest.
void ChmodTree(const std::string& root, std::filesystem::perms dirs, std::filesystem::perms files) {
  namespace fs = std::filesystem;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    fs::permissions(e.path(), e.is_directory() ? dirs : files);
  }
  fs::permissions(root, dirs);
}

// A checkpoint its reader cannot write (chmod -R a-w; a read-only mount and
// another user's files look the same to open(2)): inspect --verify and
// export read it. They used to open every file O_RDWR and fail with EACCES.
// As root the commands run as `nobody`, since root may write anything.
TEST(CliTest, AReadOnlyCheckpointIsInspectedAndExportedByAUserWhoCannotWriteIt) {
  namespace fs = std::filesystem;
  const uint64_t seed = TestSeed();
  TempDir dir, tmp;
  Cluster c(2, testing::CkptConfig(testing::Where::kHost, OptimizerType::kAdamW, 512, 2), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Train(seed, 2).ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  uid_t uid = ::geteuid();
  gid_t gid = ::getegid();
  if (uid == 0) {
    const passwd* nobody = ::getpwnam("nobody");
    if (nobody == nullptr) GTEST_SKIP() << "running as root and there is no user 'nobody'";
    uid = nobody->pw_uid;
    gid = nobody->pw_gid;
  }
  const fs::perms read_only_dir = fs::perms::owner_read | fs::perms::owner_exec |
                                  fs::perms::group_read | fs::perms::group_exec |
                                  fs::perms::others_read | fs::perms::others_exec;
  const fs::perms read_only_file =
      fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read;
  ChmodTree(dir.path(), read_only_dir, read_only_file);
  fs::permissions(tmp.path(), fs::perms::all);  // the export goes here
  // Writable again at the end, so that TempDir can remove it.
  struct Restore {
    std::string root;
    ~Restore() { ChmodTree(root, fs::perms::owner_all, fs::perms::owner_all); }
  } restore{dir.path()};

  // The premise: this user cannot open the checkpoint's files for writing.
  const std::string latest = dir.File("latest.json");
  const int can_write = RunAs(uid, gid, [&] {
    const int fd = ::open(latest.c_str(), O_RDWR | O_CLOEXEC);
    return fd >= 0 ? 1 : (errno == EACCES || errno == EROFS) ? 0 : 2;
  });
  ASSERT_NE(can_write, 126) << "could not switch to uid " << uid;
  if (can_write == 1) GTEST_SKIP() << "uid " << uid << " may write 0444 files here (capabilities?)";
  ASSERT_EQ(can_write, 0);

  Ran r = RunStrataAs(uid, gid, {"inspect", "--verify", dir.path()}, tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("verified: every chunk"), std::string::npos) << r.out << r.err;
  const std::string out = tmp.File("ro.safetensors");
  r = RunStrataAs(uid, gid, {"export", dir.path(), out}, tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(fs::exists(out)) << r.err;
  EXPECT_GT(fs::file_size(out), 8u);
}

// `strata export DIR ""` is refused (it wrote /model.safetensors), an output
// directory given with a trailing slash prints clean paths, and a missing
// parent directory is named, not the hidden temporary.
TEST(CliTest, ExportOutputPathsAreCheckedAndPrintedAsGiven) {
  const uint64_t seed = TestSeed();
  TempDir dir, tmp;
  Cluster c(1, testing::CkptConfig(testing::Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  const bool root_file_before = std::filesystem::exists("/model.safetensors");
  Ran r = RunStrata("export " + dir.path() + " ''", tmp);
  EXPECT_EQ(r.code, 2) << "InvalidArgument is a usage error: " << r.out;
  EXPECT_NE(r.err.find("InvalidArgument"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the output path is empty"), std::string::npos) << r.err;
  if (!root_file_before) {
    EXPECT_FALSE(std::filesystem::exists("/model.safetensors"));
  }

  r = RunStrata("export " + dir.path() + " " + tmp.File("ee.safetensors/"), tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote " + tmp.File("ee.safetensors/model.safetensors") + "\n"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("//"), std::string::npos) << r.out;

  r = RunStrata("export " + dir.path() + " " + tmp.File("nope/x.safetensors"), tmp);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.err.find(tmp.File("nope/x.safetensors") + ": the parent directory " +
                       tmp.File("nope") + " does not exist"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find(".tmp-"), std::string::npos) << r.err;
}

// A sharded export over a one-file export (and back): refused without
// --force, naming the stale file; with it the stale files are removed and
// the command says so.
TEST(CliTest, ExportIntoADirectoryOfAnotherLayoutNeedsForceAndRemovesIt) {
  const uint64_t seed = TestSeed();
  TempDir dir, tmp;
  Cluster c(1, testing::CkptConfig(testing::Where::kHost), seed);
  ASSERT_TRUE(c.status().ok());
  ASSERT_TRUE(c.Save(dir.path()).ok());
  const std::string out = tmp.File("hf");
  Ran r = RunStrata("export " + dir.path() + " " + out, tmp);
  ASSERT_EQ(r.code, 0) << r.err;
  r = RunStrata("export --max-shard-size 1KiB " + dir.path() + " " + out, tmp);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.err.find(out + "/model.safetensors"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors"));
  r = RunStrata("export --max-shard-size 1KiB --force " + dir.path() + " " + out, tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("removed " + out + "/model.safetensors"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(out + "/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors.index.json"));
  r = RunStrata("export --force " + dir.path() + " " + out, tmp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("removed " + out + "/model.safetensors.index.json"), std::string::npos)
      << r.out;
  EXPECT_EQ(testing::DirNames(out), std::vector<std::string>{"model.safetensors"});
}

}  // namespace
}  // namespace strata
