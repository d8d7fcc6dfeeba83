// The SIGBUS guard: a guarded mapping whose file shrinks reads zeros and is
// marked faulted; a SIGBUS that is not a guarded range's goes to the handler
// the program had installed first, called as the kernel would call it. Each
// case runs in a child process; the program's handlers exit 9 if a guarded
// read reached them (the guard missing).
#include "common/sigbus_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <catch2/catch.hpp>
#include <functional>
#include <string>
#include <thread>

#include "common/parallel_for.h"
#include "tests/test_util.h"

namespace colibri {
namespace common {
namespace {

volatile sig_atomic_t g_guarded_done = 0;  // the guarded reads are over
int g_calls_fd = -1;

void ExitHandler(int) { _exit(g_guarded_done ? 42 : 9); }

void CountingHandler(int) {  // returns: a fault happens again
  if (!g_guarded_done) _exit(9);
  const char c = 'x';
  if (write(g_calls_fd, &c, 1) != 1) _exit(7);
}

// A guarded 2-page mapping of a file truncated under it: reading its second
// page gives zeros and marks the slot. Exits the child on failure.
void GuardedTruncation(const std::string& path) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ::ftruncate(fd, 2 * page) != 0) _exit(1);
  auto* data = static_cast<volatile unsigned char*>(::mmap(nullptr, 2 * page, PROT_READ, MAP_SHARED, fd, 0));
  if (data == MAP_FAILED) _exit(2);
  const int slot = SigbusGuard::Register(const_cast<unsigned char*>(data), 2 * page);
  if (slot < 0) _exit(3);
  if (::ftruncate(fd, 0) != 0) _exit(4);
  if (data[page] != 0 || !SigbusGuard::Faulted(slot)) _exit(5);  // zeros, and marked
}

// A read past the end of an unguarded mapping: a real fault, not ours.
void UnguardedFault(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  auto* data =
      static_cast<volatile unsigned char*>(::mmap(nullptr, ::sysconf(_SC_PAGESIZE), PROT_READ, MAP_SHARED, fd, 0));
  if (data == MAP_FAILED) _exit(2);
  (void)data[0];
}

void Install(void (*handler)(int), int flags) {
  struct sigaction own = {};
  own.sa_handler = handler;
  own.sa_flags = flags;
  sigemptyset(&own.sa_mask);
  ::sigaction(SIGBUS, &own, nullptr);
}

// Runs `body` in a child; its wait status.
int InChild(const std::function<void()>& body) {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // async-signal-safe steps and _exit only
    body();
    _exit(6);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  return status;
}

TEST_CASE("a truncated guarded mapping reads zeros, and other SIGBUS go to the program's own handler") {
  colibri::testing::TempDir dir;
  const std::string path = dir / "file";
  SECTION("a real fault outside the ranges, and a sent SIGBUS") {
    for (const bool sent : {false, true}) {
      const int status = InChild([&] {
        Install(ExitHandler, 0);
        GuardedTruncation(path);
        g_guarded_done = 1;
        if (sent) ::raise(SIGBUS);
        UnguardedFault(path + "2");
      });
      INFO("sent " << sent << ", child status " << status);
      CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 42));
    }
  }
  SECTION("a handler installed after the guard's is replaced at the next range; the guard runs on the signal stack") {
    const int status = InChild([&] {
      GuardedTruncation(path);
      Install(ExitHandler, 0);
      GuardedTruncation(path + "2");  // the guard's again: ExitHandler would exit 9
      struct sigaction now = {};
      ::sigaction(SIGBUS, nullptr, &now);
      _exit((now.sa_flags & SA_ONSTACK) != 0 ? 0 : 8);  // a Go program's handler needs the signal stack
    });
    INFO("child status " << status);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  }
  SECTION("SA_RESETHAND: called once, then the default action, as without the guard") {
    int calls[2];
    REQUIRE(::pipe(calls) == 0);
    const int status = InChild([&] {
      g_calls_fd = calls[1];
      Install(CountingHandler, SA_RESETHAND);
      GuardedTruncation(path);
      g_guarded_done = 1;
      UnguardedFault(path + "3");  // the handler returns: the fault again, then the default action
    });
    ::close(calls[1]);
    char buffer[16];
    const ssize_t n = ::read(calls[0], buffer, sizeof(buffer));
    ::close(calls[0]);
    INFO("child status " << status << ", handler calls " << n);
    CHECK(n == 1);
    CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS));
  }
  SECTION("SIG_IGN: a sent SIGBUS stays ignored; a real fault takes the default action") {
    const int ignored = InChild([&] {
      Install(SIG_IGN, 0);
      GuardedTruncation(path);
      ::raise(SIGBUS);
      _exit(0);
    });
    CHECK((WIFEXITED(ignored) && WEXITSTATUS(ignored) == 0));
    const int fault = InChild([&] {
      Install(SIG_IGN, SA_SIGINFO);  // sa_sigaction reads as SIG_IGN too
      GuardedTruncation(path);
      UnguardedFault(path + "4");
    });
    INFO("child status " << fault);
    CHECK((WIFSIGNALED(fault) && WTERMSIG(fault) == SIGBUS));
  }
}

TEST_CASE("the threads Colibri starts unblock SIGBUS, which a program may have blocked in all its threads") {
  sigset_t all, before;
  sigfillset(&all);
  REQUIRE(::pthread_sigmask(SIG_BLOCK, &all, &before) == 0);  // the helpers inherit this mask
  std::atomic<int> unblocked{0}, running{0};
  ParallelFor(2, 2, [&](size_t) {
    // Both tasks at once: one on the caller, one on its helper (at most 10 s apart).
    ++running;
    for (int i = 0; running < 2 && i < 10000; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    sigset_t now;
    ::pthread_sigmask(SIG_BLOCK, nullptr, &now);
    unblocked += !sigismember(&now, SIGBUS);
  });
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  // The calling thread keeps its mask; its helper does not.
  CHECK(unblocked == 1);
}

}  // namespace
}  // namespace common
}  // namespace colibri
