#include "kernels/fault_guard.h"

#include <csetjmp>
#include <csignal>
#include <mutex>

namespace colibri {
namespace kernels {
namespace {

// The guarded thread's way back; null on every other thread.
thread_local sigjmp_buf* t_return = nullptr;
struct sigaction g_old_ill, g_old_segv;  // the handlers before, restored after

void OnFault(int sig) {
  if (t_return != nullptr) siglongjmp(*t_return, sig);
  // Another thread's fault: back to the handler from before, which takes it
  // when the instruction runs again.
  sigaction(sig, sig == SIGILL ? &g_old_ill : &g_old_segv, nullptr);
}

}  // namespace

int RunCatchingFaults(const std::function<bool()>& fn, bool* result) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  struct sigaction act {};
  act.sa_handler = OnFault;
  sigemptyset(&act.sa_mask);
  sigaction(SIGILL, &act, &g_old_ill);
  sigaction(SIGSEGV, &act, &g_old_segv);
  sigjmp_buf back;
  const int sig = sigsetjmp(back, /*savemask=*/1);  // the signal mask comes back with a fault
  if (sig == 0) {
    t_return = &back;
    *result = fn();
  }
  t_return = nullptr;
  sigaction(SIGILL, &g_old_ill, nullptr);
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  return sig;
}

}  // namespace kernels
}  // namespace colibri
