// colibri-decode-example: what an LLM server's decoding loop does with
// Colibri. For each of --steps tokens it makes a hidden state, then for every
// MoE layer sends it to the router over one ForwardStream session and adds
// the MoE output to it (the residual connection), as the attention side of a
// model would between layers. Prints a fingerprint of each final hidden
// state. The Go example (clients/go/cmd/colibri-decode-example) prints the
// same lines for the same arguments: inputs come from splitmix64, and the
// output is FNV-1a over the float bits.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "clients/cpp/client.h"
#include "runtime/flags.h"

ABSL_FLAG(std::string, router, "", "host:port of the router. Required.");
ABSL_FLAG(int, steps, 4, "Tokens to decode.");
ABSL_FLAG(int, layers, 0, "MoE layers per token (0: all of the model's).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the inputs (token ids and hidden states).");
ABSL_FLAG(std::string, routing, "lut", "lut or gate.");

namespace {

// splitmix64: the same sequence in C++ and Go.
struct SplitMix64 {
  uint64_t state;
  uint64_t Next() {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float Value() {  // [-1, 1), float arithmetic only
    const float u = static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f);
    return 2.0f * u - 1.0f;
  }
};

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

uint64_t Fnv1a64(const std::vector<float>& v) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto* bytes = reinterpret_cast<const unsigned char*>(v.data());  // little-endian on x86-64
  for (size_t i = 0; i < v.size() * 4; ++i) {
    h ^= bytes[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  colibri::runtime::ParseFlags(
      argc, argv,
      "Decodes --steps tokens through every MoE layer of the model a Colibri router serves, over one stream,\n"
      "adding each layer's output to the hidden state. Example: colibri-decode-example --router 127.0.0.1:50051");
  namespace cc = colibri::client;
  cc::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_router);
  const std::string routing = absl::GetFlag(FLAGS_routing);
  if (options.target.empty() || (routing != "lut" && routing != "gate")) {
    std::cerr << "colibri-decode-example: needs --router HOST:PORT and --routing lut|gate\n";
    return 2;
  }
  auto client = cc::Client::Connect(options);
  if (!client.ok()) {
    std::cerr << "colibri-decode-example: " << client.status() << "\n";
    return 1;
  }
  const auto& model = (*client)->model();
  const int layers = absl::GetFlag(FLAGS_layers) > 0 ? absl::GetFlag(FLAGS_layers) : model.n_layers();
  std::printf("model d_model %d layers %d experts %d top_k %d routing %s\n", model.d_model(), layers, model.n_experts(),
              model.top_k(), routing.c_str());
  auto session = (*client)->OpenSession();
  if (!session.ok()) {
    std::cerr << "colibri-decode-example: " << session.status() << "\n";
    return 1;
  }
  SplitMix64 rng{absl::GetFlag(FLAGS_seed)};
  for (int step = 0; step < absl::GetFlag(FLAGS_steps); ++step) {
    const int32_t token = static_cast<int32_t>(rng.Next() % static_cast<uint64_t>(model.vocab_size()));
    std::vector<float> hidden(model.d_model());
    for (float& v : hidden) v = rng.Value();
    for (int layer = 0; layer < layers; ++layer) {
      cc::ForwardArgs args;
      args.layer = layer;
      args.token_ids = {token};
      args.hidden = hidden;
      args.routing = routing == "gate" ? cc::Routing::kGate : cc::Routing::kLut;
      absl::StatusOr<cc::ForwardResult> r = (*session)->Forward(args);
      if (!r.ok()) {
        std::cerr << "colibri-decode-example: step " << step << " layer " << layer << ": " << r.status() << "\n";
        return 1;
      }
      for (size_t i = 0; i < hidden.size(); ++i) hidden[i] += r->output[i];
    }
    std::printf("step %d token %d fnv1a64 %016llx first %08x %08x %08x %08x\n", step, token,
                static_cast<unsigned long long>(Fnv1a64(hidden)), Bits(hidden[0]), Bits(hidden[1]), Bits(hidden[2]),
                Bits(hidden[3]));
  }
  const absl::Status closed = (*session)->Close();
  if (!closed.ok()) {
    std::cerr << "colibri-decode-example: " << closed << "\n";
    return 1;
  }
  return 0;
}
