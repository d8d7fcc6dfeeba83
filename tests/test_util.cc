#include "tests/test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "common/safetensors.h"
#include "tools/convert.h"

namespace colibri {
namespace testing {

ProcessGuard::ProcessGuard(const std::vector<std::string>& argv) {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const pid_t parent = getpid();
  pid_ = fork();
  REQUIRE(pid_ >= 0);
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  out_ = fdopen(fds[0], "r");
}

ProcessGuard::~ProcessGuard() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (out_ != nullptr) fclose(out_);
}

std::string ProcessGuard::ReadLine() {
  char line[512];
  return fgets(line, sizeof(line), out_) != nullptr ? std::string(line) : std::string();
}

int ProcessGuard::ReadPort(const std::string& what) {
  for (;;) {
    const std::string line = ReadLine();
    INFO("the process ended before printing \"" << what << "\"");
    REQUIRE(!line.empty());
    const size_t at = line.find(what);
    if (at != std::string::npos) return std::stoi(line.substr(at + what.size()));
  }
}

void ProcessGuard::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

void ProcessGuard::Pause() {
  Signal(SIGSTOP);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < until) {
    bool all_stopped = true;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid_) + "/task", ec)) {
      std::ifstream in(task.path() / "stat");
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const size_t close = text.rfind(')');
      if (close != std::string::npos && close + 2 < text.size() && text[close + 2] != 'T' && text[close + 2] != 't') {
        all_stopped = false;
      }
    }
    if (all_stopped) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  FAIL("process " << pid_ << " did not stop within 10 s of SIGSTOP");
}

int ProcessGuard::SignalAndWait(int sig, std::chrono::seconds timeout) {
  kill(pid_, sig);
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

int ConnectLoopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

double Metric(const std::string& page, const std::string& name) {
  std::smatch m;
  if (std::regex_search(page, m, std::regex("\n" + name + "(\\{[^}]*\\})? ([0-9.e+]+)"))) return std::stod(m[2]);
  return -1;
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = ConnectLoopback(port);
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  REQUIRE(::send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, n);
  ::close(fd);
  return response;
}

std::string Binary(const std::string& relative) { return std::string(COLIBRI_BINARY_DIR) + "/" + relative; }

TempDir::TempDir() {
  const char* tmp = getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/colibri_test_XXXXXX";
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

tools::SynthOptions SmallSynth(const std::string& out_dir, const std::string& naming) {
  tools::SynthOptions o;
  o.out_dir = out_dir;
  o.naming = naming;
  o.d_model = 48;
  o.d_ff = 80;
  o.n_layers = 2;
  o.n_experts = 4;
  o.top_k = 2;
  o.vocab_size = 64;
  o.dtype = common::DType::kF32;
  o.seed = 7;
  return o;
}

void MakeModel(const tools::SynthOptions& synth, const std::string& model_dir, common::DType weight_type) {
  std::ostringstream log;
  if (!std::filesystem::exists(synth.out_dir + "/config.json")) {  // converting one checkpoint twice is fine
    const absl::Status written = tools::WriteSyntheticCheckpoint(synth, log);
    INFO(written.message());
    REQUIRE(written.ok());
  }
  tools::ConvertOptions convert;
  convert.checkpoint_dir = synth.out_dir;
  convert.out_dir = model_dir;
  convert.weight_type = weight_type;
  convert.overwrite = true;
  convert.progress = false;
  const absl::Status converted = tools::ConvertCheckpoint(convert, log);
  INFO(converted.message());
  REQUIRE(converted.ok());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0xff);
  f.seekp(offset);
  f.write(&c, 1);
  REQUIRE(f.good());
}

void WriteBytesAt(const std::string& path, uint64_t offset, const std::string& bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  f.seekp(offset);
  f.write(bytes.data(), bytes.size());
  REQUIRE(f.good());
}

void TruncateFile(const std::string& path, uint64_t size) {
  REQUIRE(::truncate(path.c_str(), static_cast<off_t>(size)) == 0);
}

namespace {

template <typename T>
std::vector<T> ReadTensor(const std::string& path, const std::string& name, const char* dtype) {
  auto file = common::SafetensorsFile::Open(path);
  INFO(path << ": " << file.status().message());
  REQUIRE(file.ok());
  const common::SafetensorsTensor* t = (*file)->Find(name);
  INFO("tensor " << name << " in " << path);
  REQUIRE(t != nullptr);
  REQUIRE(t->dtype == dtype);
  std::vector<T> out(t->nbytes / sizeof(T));
  std::memcpy(out.data(), t->data, t->nbytes);
  return out;
}

}  // namespace

std::vector<float> ReadF32(const std::string& path, const std::string& name) {
  return ReadTensor<float>(path, name, "F32");
}

std::vector<int32_t> ReadI32(const std::string& path, const std::string& name) {
  return ReadTensor<int32_t>(path, name, "I32");
}

}  // namespace testing
}  // namespace colibri
