// The SIGBUS guard: a guarded mapping whose file shrinks reads zeros and is
// marked faulted; a SIGBUS that is not a guarded range's goes to the handler
// the program had before (a program that links Colibri keeps its own).
#include "common/sigbus_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <string>

#include "tests/test_util.h"

namespace colibri {
namespace common {
namespace {

void ProgramsOwnHandler(int) { _exit(42); }

TEST_CASE("a truncated guarded mapping reads zeros, and other SIGBUS go to the program's own handler") {
  colibri::testing::TempDir dir;
  const std::string path = dir / "file";
  const long page = ::sysconf(_SC_PAGESIZE);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // only async-signal-safe steps and _exit from here
    struct sigaction own = {};
    own.sa_handler = ProgramsOwnHandler;
    sigemptyset(&own.sa_mask);
    ::sigaction(SIGBUS, &own, nullptr);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ::ftruncate(fd, 2 * page) != 0) _exit(1);
    auto* data = static_cast<volatile unsigned char*>(::mmap(nullptr, 2 * page, PROT_READ, MAP_SHARED, fd, 0));
    if (data == MAP_FAILED) _exit(2);
    const int slot = SigbusGuard::Register(const_cast<unsigned char*>(data), 2 * page);
    if (slot < 0) _exit(3);
    if (::ftruncate(fd, 0) != 0) _exit(4);
    if (data[page] != 0 || !SigbusGuard::Faulted(slot)) _exit(5);  // zeros, and marked
    ::raise(SIGBUS);                                               // not a guarded range's
    _exit(6);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO("child status " << status);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 42);
}

}  // namespace
}  // namespace common
}  // namespace colibri
