#include "runtime/logging.h"

#include <glog/logging.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace colibri {
namespace runtime {
namespace {

// The length of the well-formed UTF-8 sequence at p (at most `left` bytes),
// 0 if there is none (RFC 3629: no overlong forms, surrogates or values past
// U+10FFFF).
size_t Utf8Length(const unsigned char* p, size_t left) {
  const unsigned char c = p[0];
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // the second byte's range
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  }
  if (len == 0 || len > left || p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < len; ++i) {
    if (p[i] < 0x80 || p[i] > 0xbf) return 0;
  }
  return len;
}

// A JSON string literal of `s` (RFC 8259 escapes); a byte that is not part
// of well-formed UTF-8 (a peer's message may hold anything) becomes U+FFFD,
// so every line stays valid JSON.
std::string JsonString(const char* s, size_t n) {
  std::string out = "\"";
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", c);
        } else if (c < 0x80) {
          out += static_cast<char>(c);
        } else if (const size_t len = Utf8Length(reinterpret_cast<const unsigned char*>(s) + i, n - i); len > 0) {
          out.append(s + i, len);
          i += len - 1;
        } else {
          out += "\\ufffd";
        }
    }
  }
  return out + "\"";
}

// One JSON object per line on stderr, written with one write(2) so lines of
// concurrent threads never interleave.
class JsonSink : public google::LogSink {
 public:
  void send(google::LogSeverity severity, const char* /*full_filename*/, const char* base_filename, int line,
            const google::LogMessageTime& time, const char* message, size_t message_len) override {
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &time.tm());
    const std::string out = absl::StrFormat(
        "{\"time\":\"%s.%06d%+03ld:%02ld\",\"level\":\"%s\",\"thread\":%d,\"file\":%s,\"line\":%d,"
        "\"message\":%s}\n",
        stamp, time.usec(), time.gmtoff() / 3600, (std::labs(time.gmtoff()) % 3600) / 60,
        google::GetLogSeverityName(severity), static_cast<int>(gettid()),
        JsonString(base_filename, std::strlen(base_filename)), line, JsonString(message, message_len));
    (void)!::write(STDERR_FILENO, out.data(), out.size());
  }
};

}  // namespace

absl::Status InitLogging(const char* argv0, const std::string& format, const std::string& min_level) {
  int level = 0;
  if (min_level == "info") {
    level = google::GLOG_INFO;
  } else if (min_level == "warning") {
    level = google::GLOG_WARNING;
  } else if (min_level == "error") {
    level = google::GLOG_ERROR;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--log_level '", min_level, "' is not one of info, warning, error"));
  }
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(absl::StrCat("--log_format '", format, "' is not text or json"));
  }
  FLAGS_minloglevel = level;
  google::InitGoogleLogging(argv0);
  if (format == "text") {
    FLAGS_logtostderr = true;
    return absl::OkStatus();
  }
  // json: no log files, no glog text on stderr; the sink writes every line.
  FLAGS_logtostderr = false;
  FLAGS_stderrthreshold = google::NUM_SEVERITIES;
  for (int s = 0; s < google::NUM_SEVERITIES; ++s) google::SetLogDestination(s, "");
  static JsonSink* sink = new JsonSink();  // lives as long as the process
  google::AddLogSink(sink);
  return absl::OkStatus();
}

class LogLines::Buffer : public std::streambuf {
 protected:
  int_type overflow(int_type c) override {
    if (c == traits_type::eof()) return traits_type::not_eof(c);
    Append(static_cast<char>(c));
    return c;
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    for (std::streamsize i = 0; i < n; ++i) Append(s[i]);
    return n;
  }

 private:
  static std::string& Line() {
    thread_local std::string line;
    return line;
  }
  static void Append(char c) {
    std::string& line = Line();
    if (c != '\n') {
      line += c;
      return;
    }
    google::LogSeverity severity = google::GLOG_INFO;
    absl::string_view text = line;
    if (absl::ConsumePrefix(&text, "WARNING: ")) {
      severity = google::GLOG_WARNING;
    } else if (absl::ConsumePrefix(&text, "ERROR: ")) {
      severity = google::GLOG_ERROR;
    }
    google::LogMessage(__FILE__, __LINE__, severity).stream() << text;
    line.clear();
  }
};

LogLines::LogLines() : std::ostream(nullptr), buffer_(std::make_unique<Buffer>()) { rdbuf(buffer_.get()); }

LogLines::~LogLines() = default;

}  // namespace runtime
}  // namespace colibri
