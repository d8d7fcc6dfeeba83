#ifndef COLIBRI_RUNTIME_GRPC_RAW_H_
#define COLIBRI_RUNTIME_GRPC_RAW_H_

// Messages taken raw (grpc::ByteBuffer, the generated services'
// WithRawCallbackMethod_*) and parsed here. gRPC's typed callback handlers
// answer a message that does not parse with a bare UNIMPLEMENTED, and on a
// stream report it as the client's half-close: the stream ends OK and that
// request, and every one after it, is never answered. Parsed here, such a
// message gets INVALID_ARGUMENT naming the type, and a stream answers it in
// its turn and reads on. The parse and the serialization are gRPC's own
// (SerializationTraits), so nothing is copied more than with typed handlers.

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/proto_buffer_writer.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace colibri {
namespace runtime {

// Parses `bytes` into `message` and frees the bytes (the request's memory
// is then held once, by the message).
template <typename Message>
absl::Status ParseRaw(grpc::ByteBuffer* bytes, Message* message) {
  const grpc::Status parsed = grpc::GenericDeserialize<grpc::ProtoBufferReader, Message>(bytes, message);
  bytes->Clear();
  if (parsed.ok()) return absl::OkStatus();
  message->Clear();
  return absl::InvalidArgumentError(absl::StrCat("the message is not a valid ", Message::descriptor()->full_name(),
                                                 " (cut short, not protobuf, a field of the wrong type, or a string "
                                                 "field that is not UTF-8)"));
}

// Serializes `message` into `bytes` (emptied first, and on failure).
template <typename Message>
absl::Status SerializeRaw(const Message& message, grpc::ByteBuffer* bytes) {
  bytes->Clear();  // gRPC's writer asserts it starts on an empty buffer
  bool own_buffer = false;
  const grpc::Status s = grpc::GenericSerialize<grpc::ProtoBufferWriter, Message>(message, bytes, &own_buffer);
  if (s.ok()) return absl::OkStatus();
  bytes->Clear();
  return absl::InternalError(
      absl::StrCat("cannot serialize the ", Message::descriptor()->full_name(), ": ", s.error_message()));
}

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_RAW_H_
