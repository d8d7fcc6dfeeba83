#ifndef COLIBRI_TESTS_TEST_UTIL_H_
#define COLIBRI_TESTS_TEST_UTIL_H_

// Shared helpers for Colibri's tests: scratch directories that clean up after
// themselves, and small synthetic models built through the real tools.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "tools/synth.h"

namespace colibri {
namespace testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents when
// the object is destroyed.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Small synthetic checkpoint options: d_model 48, d_ff 80 (ragged against 64),
// 4 experts, top-2, 2 layers, vocab 64, f32, `naming`.
tools::SynthOptions SmallSynth(const std::string& out_dir, const std::string& naming = "mixtral");

// Writes the checkpoint (unless synth.out_dir already holds one) and converts
// it to `model_dir` with `weight_type`; REQUIREs (Catch2) that both succeed.
void MakeModel(const tools::SynthOptions& synth, const std::string& model_dir, common::DType weight_type);

// Reads a whole file / overwrites one byte (XOR 0xff) / truncates / overwrites bytes.
std::string ReadFile(const std::string& path);
void FlipByte(const std::string& path, uint64_t offset);
void TruncateFile(const std::string& path, uint64_t size);
void WriteBytesAt(const std::string& path, uint64_t offset, const std::string& bytes);

// A child process (argv[0] a path) with its stdout on a pipe; killed with
// SIGKILL when the guard is destroyed — and by the kernel if the test process
// dies first — so no test leaves a process behind.
class ProcessGuard {
 public:
  explicit ProcessGuard(const std::vector<std::string>& argv);
  ~ProcessGuard();
  ProcessGuard(const ProcessGuard&) = delete;
  ProcessGuard& operator=(const ProcessGuard&) = delete;

  // The next line of the child's stdout ("" at EOF).
  std::string ReadLine();
  // Reads lines until one says "listening on port N" and returns N; REQUIREs it.
  int ReadPort(const std::string& what = "listening on port ");
  // Sends `sig` and waits up to `timeout` for the exit status (-1: still running).
  int SignalAndWait(int sig, std::chrono::seconds timeout);
  void Signal(int sig);
  // SIGSTOP, then waits (up to 10 s) until every thread is stopped: a call
  // already being answered cannot slip through after this returns.
  void Pause();
  int pid() const { return pid_; }

 private:
  int pid_ = -1;
  FILE* out_ = nullptr;
};

// GET http://127.0.0.1:port/path; the whole response, status line first.
std::string HttpGet(int port, const std::string& path);
// The value of the first sample of `name` in a Prometheus text page, or -1.
double Metric(const std::string& page, const std::string& name);
// A TCP connection to 127.0.0.1:port (REQUIREs it connects); the caller closes it.
int ConnectLoopback(int port);

// Path of a binary in the build tree, e.g. Binary("expert_node/colibri-expert").
std::string Binary(const std::string& relative);

// Reads an F32 or I32 tensor of a safetensors file; REQUIREs it exists.
std::vector<float> ReadF32(const std::string& path, const std::string& name);
std::vector<int32_t> ReadI32(const std::string& path, const std::string& name);

}  // namespace testing
}  // namespace colibri

#endif  // COLIBRI_TESTS_TEST_UTIL_H_
