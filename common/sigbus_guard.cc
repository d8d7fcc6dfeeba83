#include "common/sigbus_guard.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "common/mutex.h"

namespace colibri {
namespace common {
namespace {

struct Slot {
  std::atomic<uintptr_t> begin{0};  // 0: free; 1: being claimed; else the range's start
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};

Slot g_slots[SigbusGuard::kSlots];

// The SIGBUS handler in place when the guard's was first installed (the
// embedding program's, or the default), written once before the guard's is
// installed: faults not ours go to it. Never one installed later, which may
// have recorded the guard's as its own previous: the two would call each
// other.
struct sigaction g_previous = {};
std::atomic<bool> g_previous_recorded{false};
std::atomic<bool> g_previous_spent{false};  // a one-shot (SA_RESETHAND) previous handler has run

// Calls `previous` as the kernel would have: its mask (and SIGBUS itself,
// without SA_NODEFER) blocked meanwhile, and once only with SA_RESETHAND.
// False if it is the default action or SIG_IGN, or spent.
bool PassOn(const struct sigaction& previous, int sig, siginfo_t* info, void* context) {
  // sa_handler and sa_sigaction share their storage: SIG_DFL and SIG_IGN whatever the flags.
  if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) return false;
  if ((previous.sa_flags & SA_RESETHAND) != 0 && g_previous_spent.exchange(true)) return false;
  sigset_t mask = previous.sa_mask, before;
  if ((previous.sa_flags & SA_NODEFER) == 0) sigaddset(&mask, sig);
  ::pthread_sigmask(SIG_BLOCK, &mask, &before);
  if ((previous.sa_flags & SA_SIGINFO) != 0) {
    previous.sa_sigaction(sig, info, context);
  } else {
    previous.sa_handler(sig);
  }
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  return true;
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  // Only a fault the kernel raised (si_code > 0) has an address to look up;
  // one sent by kill() or raise() does not.
  const uintptr_t addr = info->si_code > 0 ? reinterpret_cast<uintptr_t>(info->si_addr) : 0;
  for (Slot& s : g_slots) {
    if (addr == 0) break;
    const uintptr_t begin = s.begin.load(std::memory_order_acquire);
    if (begin <= 1 || addr < begin || addr >= s.end.load(std::memory_order_acquire)) continue;
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    void* at = reinterpret_cast<void*>(addr / page * page);
    // A page of zeros in place of the vanished one; the faulting read is retried and sees it.
    if (::mmap(at, page, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED) {
      s.faulted.store(true, std::memory_order_release);
      return;
    }
    break;
  }
  // Not ours (or no page to put there): the handler there before ours, or
  // the default action, as without the guard.
  if (g_previous_recorded.load(std::memory_order_acquire)) {
    if (PassOn(g_previous, sig, info, context)) return;
    if (g_previous.sa_handler == SIG_IGN && info->si_code <= 0) return;  // a sent signal the program ignores
  }
  ::signal(sig, SIG_DFL);
  // A fault the kernel raised happens again on return, now with the default
  // action (and its own address in the core file); a sent signal is sent again.
  if (info->si_code <= 0) ::raise(sig);
}

// (Re)installs the handler unless it is in place: something else (a test
// framework, say) may have replaced it since.
void InstallHandler() {
  static Mutex mu;  // one installer at a time (never taken in the handler)
  MutexLock lock(&mu);
  struct sigaction current = {};
  if (::sigaction(SIGBUS, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == OnSigbus) return;
  if (!g_previous_recorded.load(std::memory_order_relaxed)) {
    g_previous = current;
    g_previous_recorded.store(true, std::memory_order_release);
  }
  struct sigaction action = {};
  action.sa_sigaction = OnSigbus;
  // SA_ONSTACK: a Go program's handler, passed on to, must run on the signal stack.
  action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGBUS, &action, nullptr);
}

}  // namespace

int SigbusGuard::Register(const void* data, size_t size) {
  if (data == nullptr || size == 0) return -1;
  InstallHandler();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  for (int i = 0; i < kSlots; ++i) {
    if (g_slots[i].begin.load(std::memory_order_relaxed) != 0) continue;  // taken: no write to its line
    uintptr_t expected = 0;
    // Claim the slot (0 -> 1), fill it, then publish begin (release): the
    // handler reads begin first (acquire) and skips slots being claimed.
    if (!g_slots[i].begin.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    g_slots[i].end.store(begin + size, std::memory_order_relaxed);
    g_slots[i].faulted.store(false, std::memory_order_relaxed);
    g_slots[i].begin.store(begin, std::memory_order_release);
    return i;
  }
  return -1;
}

void SigbusGuard::Unregister(int slot) {
  if (slot < 0 || slot >= kSlots) return;
  g_slots[slot].begin.store(0, std::memory_order_release);
}

void SigbusGuard::UnblockHere() {
  sigset_t bus;
  sigemptyset(&bus);
  sigaddset(&bus, SIGBUS);
  ::pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
}

bool SigbusGuard::Faulted(int slot) {
  return slot >= 0 && slot < kSlots && g_slots[slot].faulted.load(std::memory_order_acquire);
}

}  // namespace common
}  // namespace colibri
