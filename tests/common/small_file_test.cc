// Reading small files someone else controls (common/small_file.h): a
// regular file whole; anything that could stall or exhaust the reader
// refused at once, naming the path.

#include "common/small_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "tests/test_util.h"

namespace colibri {
namespace common {
namespace {

using colibri::testing::TempDir;

bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

TEST_CASE("a small regular file is read whole, and a FIFO, a device, a large file or a refused symlink is not") {
  TempDir dir;
  const std::string path = dir / "list.txt";
  std::ofstream(path) << "a:1\nb:2\n";
  absl::StatusOr<std::string> text = ReadSmallFile(path);
  REQUIRE(text.ok());
  CHECK(*text == "a:1\nb:2\n");

  CHECK(ReadSmallFile(dir / "missing").status().code() == absl::StatusCode::kNotFound);

  const std::string fifo = dir / "fifo";  // no writer: a plain open would block
  REQUIRE(mkfifo(fifo.c_str(), 0644) == 0);
  const absl::Status from_fifo = ReadSmallFile(fifo).status();
  CHECK(from_fifo.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Contains(from_fifo, fifo + " is not a regular file"));

  CHECK(ReadSmallFile("/dev/zero").status().code() == absl::StatusCode::kFailedPrecondition);

  const absl::Status large = ReadSmallFile(path, {/*max_bytes=*/4}).status();
  CHECK(large.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Contains(large, "holds 8 bytes, more than the 4 it may"));

  const std::string link = dir / "link";
  std::filesystem::create_symlink(path, link);
  CHECK(ReadSmallFile(link).ok());
  CHECK(ReadSmallFile(link, {1 << 20, /*follow_symlinks=*/false}).status().code() == absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace common
}  // namespace colibri
