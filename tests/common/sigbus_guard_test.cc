// The SIGBUS guard: a guarded mapping whose file shrinks reads zeros and is
// marked faulted; a SIGBUS that is not a guarded range's goes to the handler
// the program had (installed before the guard's, or after it), called as the
// kernel would call it. Each case runs in a child process.
#include "common/sigbus_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <functional>
#include <string>

#include "tests/test_util.h"

namespace colibri {
namespace common {
namespace {

void ExitHandler(int) { _exit(42); }

int g_calls_fd = -1;
void CountingHandler(int) {  // returns: the fault happens again
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
  SECTION("installed before the guard's") {
    const int status = InChild([&] {
      Install(ExitHandler, 0);
      GuardedTruncation(path);
      ::raise(SIGBUS);  // not a guarded range's
    });
    INFO("child status " << status);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 42));
  }
  SECTION("installed after the guard's, which is installed again by the next range") {
    const int status = InChild([&] {
      GuardedTruncation(path);
      Install(ExitHandler, 0);
      GuardedTruncation(path + "2");
      struct sigaction now = {};
      ::sigaction(SIGBUS, nullptr, &now);
      if ((now.sa_flags & SA_ONSTACK) == 0) _exit(8);  // a Go program's handler needs the signal stack
      ::raise(SIGBUS);
    });
    INFO("child status " << status);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 42));
  }
  SECTION("SA_RESETHAND: called once, then the default action, as without the guard") {
    int calls[2];
    REQUIRE(::pipe(calls) == 0);
    const int status = InChild([&] {
      g_calls_fd = calls[1];
      Install(CountingHandler, SA_RESETHAND);
      GuardedTruncation(path);
      // An unguarded mapping past its file's end: the fault repeats after the handler returns.
      const int fd = ::open((path + "3").c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
      auto* data =
          static_cast<volatile unsigned char*>(::mmap(nullptr, ::sysconf(_SC_PAGESIZE), PROT_READ, MAP_SHARED, fd, 0));
      if (data == MAP_FAILED) _exit(2);
      (void)data[0];
    });
    ::close(calls[1]);
    char buffer[16];
    const ssize_t n = ::read(calls[0], buffer, sizeof(buffer));
    ::close(calls[0]);
    INFO("child status " << status << ", handler calls " << n);
    CHECK(n == 1);
    CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS));
  }
}

}  // namespace
}  // namespace common
}  // namespace colibri
