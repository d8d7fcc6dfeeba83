#include "kernels/fault_guard.h"

#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <csignal>

namespace colibri {
namespace kernels {
namespace {

TEST_CASE("a fault in guarded code ends that code with its signal, and the process goes on") {
  bool result = false;
  CHECK(RunCatchingFaults([] { return true; }, &result) == 0);
  CHECK(result);

  // An instruction the CPU refuses (ud2), as a tile instruction without AMX would be.
  result = false;
  CHECK(RunCatchingFaults(
            [] {
              __builtin_trap();
              return true;
            },
            &result) == SIGILL);
  CHECK_FALSE(result);

  // A read of a page that may not be read.
  void* page = mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(page != MAP_FAILED);
  CHECK(RunCatchingFaults([page] { return *static_cast<volatile const char*>(page) == 1; }, &result) == SIGSEGV);
  munmap(page, 4096);

  // The guard is gone after each call, and works again.
  CHECK(RunCatchingFaults([] { return false; }, &result) == 0);
  CHECK_FALSE(result);
  CHECK(RunCatchingFaults(
            [] {
              __builtin_trap();
              return true;
            },
            &result) == SIGILL);
}

}  // namespace
}  // namespace kernels
}  // namespace colibri
