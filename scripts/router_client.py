#!/usr/bin/python3
"""An independent gRPC client for Colibri's Router service (Python grpcio).

Not the project's C++ code: the message classes are generated from proto/ by
protoc --python_out at run time (into a temporary directory; no download),
and calls go through grpcio's generic unary API by method name.  Used by the
end-to-end checks to call a router exactly as an outside client would.

Subcommands:
  forward  read token_ids / hidden_states from an inputs file (as written by
           torch_moe_reference.py make-inputs), call Router.Forward for one
           layer with --routing lut|gate|client (client: routes taken from
           --routes FILE's expert_ids / expert_weights, e.g. a torch forward
           output), and write output / expert_ids / expert_weights in the
           same layout as torch_moe_reference.py forward, so its `compare`
           subcommand checks the two.
  info     print GetModelInfo as JSON.
  status   print GetClusterStatus as JSON.

Exit codes: 0 ok, 1 the call failed (the status code and message are
printed), 2 bad arguments or files, 77 grpcio/protobuf not installed.
Run with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf).
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_moe_reference as ref  # noqa: E402  (the safetensors reader/writer; exits 77 without numpy)

try:
    import grpc
    import google.protobuf  # noqa: F401
except ImportError as ex:
    print(f"grpcio/protobuf not available: {ex}", file=sys.stderr)
    sys.exit(77)
np = ref.np


def load_messages(proto_root):
    """Generates the colibri.v1 Python message modules and imports them."""
    out = tempfile.mkdtemp(prefix="colibri_py_")
    files = [os.path.join("colibri/v1", f) for f in ("tensor.proto", "expert_node.proto", "router.proto")]
    subprocess.run(["protoc", f"--python_out={out}", f"-I{proto_root}"] + files, check=True)
    sys.path.insert(0, out)
    from colibri.v1 import router_pb2, tensor_pb2  # noqa: E402
    return router_pb2, tensor_pb2


def unary(channel, method, request_type, response_type):
    return channel.unary_unary(f"/colibri.v1.Router/{method}", request_serializer=request_type.SerializeToString,
                               response_deserializer=response_type.FromString)


def cmd_forward(args, pb, tpb, channel):
    inp = ref.SafeFile(args.inputs)
    hidden = ref.to_f32(inp.raw("hidden_states"), inp.dtype("hidden_states")).astype(np.float32)
    ids = np.array(inp.raw("token_ids"), dtype=np.int32).reshape(-1)
    req = pb.ForwardRequest(layer=args.layer, return_routes=True, request_id="router_client.py")
    req.token_ids.extend(ids.tolist())
    req.hidden.dtype = tpb.DATA_TYPE_F32
    req.hidden.shape.extend(list(hidden.shape))
    req.hidden.data = np.ascontiguousarray(hidden).tobytes()
    req.routing = {"lut": pb.ROUTING_MODE_LUT, "gate": pb.ROUTING_MODE_GATE,
                   "client": pb.ROUTING_MODE_CLIENT}[args.routing]
    if args.routing == "client":
        routes = ref.SafeFile(args.routes)
        experts = np.array(routes.raw("expert_ids"), dtype=np.int32)
        weights = ref.to_f32(routes.raw("expert_weights"), routes.dtype("expert_weights"))
        req.routes.top_k = experts.shape[1]
        req.routes.expert_ids.extend(experts.reshape(-1).tolist())
        req.routes.weights.extend(weights.reshape(-1).tolist())
    try:
        resp = unary(channel, "Forward", pb.ForwardRequest, pb.ForwardResponse)(req, timeout=args.timeout)
    except grpc.RpcError as ex:
        print(f"Forward failed: {ex.code().name}: {ex.details()}")
        return 1
    if resp.output.dtype != tpb.DATA_TYPE_F32 or list(resp.output.shape) != list(hidden.shape):
        print(f"Forward: unexpected output dtype {resp.output.dtype} shape {list(resp.output.shape)}")
        return 1
    y = np.frombuffer(resp.output.data, dtype="<f4").reshape(hidden.shape)
    k = resp.routes.top_k
    experts = np.array(resp.routes.expert_ids, dtype=np.int32).reshape(-1, k)
    weights = np.array(resp.routes.weights, dtype=np.float32).reshape(-1, k)
    ref.write_safetensors(args.out, {"output": y, "expert_ids": experts, "expert_weights": weights},
                          {"routing": args.routing, "layer": args.layer})
    print(f"forward: {args.router} layer {args.layer} tokens {hidden.shape[0]} routing {args.routing} -> {args.out}")
    return 0


def print_unary(args, pb, channel, method):
    from google.protobuf import json_format
    request_type, response_type = getattr(pb, method + "Request"), getattr(pb, method + "Response")
    try:
        resp = unary(channel, method, request_type, response_type)(request_type(), timeout=args.timeout)
    except grpc.RpcError as ex:
        print(f"{method} failed: {ex.code().name}: {ex.details()}")
        return 1
    print(json_format.MessageToJson(resp))
    return 0


def cmd_info(args, pb, tpb, channel):
    return print_unary(args, pb, channel, "GetModelInfo")


def cmd_status(args, pb, tpb, channel):
    return print_unary(args, pb, channel, "GetClusterStatus")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", required=True, help="host:port")
    p.add_argument("--proto_root", default=os.path.join(HERE, "..", "proto"))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("forward")
    f.add_argument("--inputs", required=True)
    f.add_argument("--layer", type=int, required=True)
    f.add_argument("--routing", choices=("lut", "gate", "client"), default="lut")
    f.add_argument("--routes", help="client routing: a file with expert_ids / expert_weights")
    f.add_argument("--out", required=True)
    sub.add_parser("info")
    sub.add_parser("status")
    args = p.parse_args()
    if args.cmd == "forward" and args.routing == "client" and not args.routes:
        p.error("--routing client needs --routes")
    try:
        pb, tpb = load_messages(os.path.abspath(args.proto_root))
    except (OSError, subprocess.CalledProcessError) as ex:
        print(f"cannot generate the messages with protoc: {ex}", file=sys.stderr)
        return 2
    channel = grpc.insecure_channel(args.router)
    try:
        return {"forward": cmd_forward, "info": cmd_info, "status": cmd_status}[args.cmd](args, pb, tpb, channel)
    except ref.RefError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
