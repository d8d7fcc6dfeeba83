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

// The SIGBUS handler ours displaced last (the embedding program's), in one
// of two slots so that a new one is written beside the one a handler may be
// reading; -1: none recorded. Faults not ours go to it.
struct sigaction g_previous[2] = {};
std::atomic<int> g_previous_slot{-1};
// Non-zero while a fault is being passed on: a handler that passes it back
// to ours (one that recorded ours as its own previous) then ends the chain.
std::atomic<int> g_passing{0};

// Calls `previous` as the kernel would have: its mask (and SIGBUS itself,
// without SA_NODEFER) blocked meanwhile, its disposition reset first with
// SA_RESETHAND. False if it is the default action or SIG_IGN.
bool PassOn(const struct sigaction& previous, int sig, siginfo_t* info, void* context) {
  const bool with_info = (previous.sa_flags & SA_SIGINFO) != 0;
  if (with_info ? previous.sa_sigaction == nullptr : previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
    return false;
  }
  if ((previous.sa_flags & SA_RESETHAND) != 0) {
    struct sigaction reset = {};
    reset.sa_handler = SIG_DFL;
    sigemptyset(&reset.sa_mask);
    ::sigaction(sig, &reset, nullptr);
  }
  sigset_t mask = previous.sa_mask, before;
  if ((previous.sa_flags & SA_NODEFER) == 0) sigaddset(&mask, sig);
  ::pthread_sigmask(SIG_BLOCK, &mask, &before);
  if (with_info) {
    previous.sa_sigaction(sig, info, context);
  } else {
    previous.sa_handler(sig);
  }
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  return true;
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
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
  // Not ours (or no page to put there): the handler ours displaced, or the
  // default action, as without the guard.
  const int slot = g_previous_slot.load(std::memory_order_acquire);
  if (slot >= 0 && g_passing.fetch_add(1) == 0) {
    const bool passed = PassOn(g_previous[slot], sig, info, context);
    g_passing.fetch_sub(1);
    if (passed) return;
  } else if (slot >= 0) {
    g_passing.fetch_sub(1);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// (Re)installs the handler unless it is in place: the program may have
// installed its own since, which faults not ours then go to.
void InstallHandler() {
  static Mutex mu;  // one installer at a time (never taken in the handler)
  MutexLock lock(&mu);
  struct sigaction current = {};
  if (::sigaction(SIGBUS, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == OnSigbus) return;
  const int next = g_previous_slot.load(std::memory_order_relaxed) == 0 ? 1 : 0;
  g_previous[next] = current;
  g_previous_slot.store(next, std::memory_order_release);
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

bool SigbusGuard::Faulted(int slot) {
  return slot >= 0 && slot < kSlots && g_slots[slot].faulted.load(std::memory_order_acquire);
}

}  // namespace common
}  // namespace colibri
