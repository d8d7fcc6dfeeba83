#include "common/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace colibri {
namespace common {
namespace {

struct Slot {
  std::atomic<uintptr_t> begin{0};  // 0: free; 1: being claimed; else the range's start
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};

Slot g_slots[SigbusGuard::kSlots];

// The SIGBUS handler in place before ours (the embedding program's), written
// once, before ours is installed: faults not ours go to it.
struct sigaction g_previous = {};
std::atomic<int> g_previous_state{0};  // 0: not recorded; 1: being recorded; 2: recorded

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
  // Not ours (or no page to put there): the handler before ours, or the default action, as without the guard.
  if (g_previous_state.load(std::memory_order_acquire) == 2) {
    if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
    if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL &&
        g_previous.sa_handler != SIG_IGN) {
      g_previous.sa_handler(sig);
      return;
    }
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// (Re)installs the handler unless it is in place: something else (a test
// framework, say) may have replaced it since.
void InstallHandler() {
  struct sigaction current = {};
  if (::sigaction(SIGBUS, nullptr, &current) == 0 && (current.sa_flags & SA_SIGINFO) != 0 &&
      current.sa_sigaction == OnSigbus) {
    return;
  }
  if (int expected = 0; g_previous_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    g_previous = current;
    g_previous_state.store(2, std::memory_order_release);
  }
  struct sigaction action = {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
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
