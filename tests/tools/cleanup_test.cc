// CleanupScope (tools/cleanup.h): what a signal removes, and on which thread.
#include "tools/cleanup.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "runtime/testing/test_util.h"

namespace strata::cli {
namespace {

// A signal that a thread other than the command's receives runs the cleanup
// on the command's thread: while that thread is busy (here: SIGINT blocked)
// nothing is removed yet, and a file it adds afterwards goes too. The
// handler used to run where the signal landed, beside the command, which
// could make a file after its pass.
TEST(CleanupScopeTest, ASignalToAnotherThreadRunsTheCleanupOnTheCommandsThread) {
  testing::TempDir dir;
  const std::string a = dir.File("a"), b = dir.File("b");
  int to_parent[2], to_child[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  ASSERT_EQ(::pipe(to_child), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    CleanupScope cleanup;
    cleanup.AddFile(a);
    std::ofstream(a) << "a";
    std::thread worker([] {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    });
    sigset_t sigint, old;
    sigemptyset(&sigint);
    sigaddset(&sigint, SIGINT);
    ::pthread_sigmask(SIG_BLOCK, &sigint, &old);  // the command's thread is busy
    ::pthread_kill(worker.native_handle(), SIGINT);
    char c = 's';
    if (::write(to_parent[1], &c, 1) != 1 || ::read(to_child[0], &c, 1) != 1) ::_exit(3);
    cleanup.AddFile(b);
    std::ofstream(b) << "b";
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);  // the handler runs here, and ends it
    ::_exit(4);
  }
  char c = 0;
  ASSERT_EQ(::read(to_parent[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(std::filesystem::exists(a)) << "removed by the thread the signal landed on";
  ASSERT_EQ(::write(to_child[1], "g", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << "status " << status;
  EXPECT_FALSE(std::filesystem::exists(a));
  EXPECT_FALSE(std::filesystem::exists(b));
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) ::close(fd);
}

}  // namespace
}  // namespace strata::cli
