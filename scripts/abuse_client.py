#!/usr/bin/python3
"""Abusive clients for the soak (scripts/soak.sh): for --seconds, several
threads hit a router and its expert nodes with what a hostile or broken peer
sends, and check that each gets a clean refusal:

  malformed   Forward with a bad layer, token id, shape or byte count
              (INVALID_ARGUMENT); Compute on a node with an unowned expert or
              a row index out of range (INVALID_ARGUMENT / FAILED_PRECONDITION)
  oversized   Forward with more tokens than --max_tokens (RESOURCE_EXHAUSTED),
              and a message over the size limit (RESOURCE_EXHAUSTED)
  cancelled   Forward calls of 512 tokens cancelled after 1-5 ms
  admin       Reload and GetNodeInfo on a node's data port (PERMISSION_DENIED;
              GetNodeInfo without paths)
  slow        TCP connections to the gRPC and metrics ports that send a few
              bytes, then nothing, reopened every few seconds

Prints one line per kind with the counts and exits 1 if any call got an
answer other than the expected refusal (or OK for a cancel that lost the
race). The messages are generated with protoc at run time, as
scripts/router_client.py does (no download).

Usage: abuse_client.py --router HOST:PORT --nodes HOST:PORT,... --metrics PORT,...
                       [--seconds 60] [--d_model N] [--max_tokens N]
"""
import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

try:
    import grpc
except ImportError as ex:  # Debian: python3-grpcio, python3-protobuf
    print(f"SKIP: {ex}", file=sys.stderr)
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_messages():
    out = tempfile.mkdtemp(prefix="colibri_abuse_")
    files = [f"colibri/v1/{f}" for f in ("tensor.proto", "expert_node.proto", "router.proto")]
    subprocess.run(["protoc", f"--python_out={out}", f"-I{ROOT}/proto"] + files, check=True)
    sys.path.insert(0, out)
    from colibri.v1 import expert_node_pb2, router_pb2, tensor_pb2  # noqa: E402
    return router_pb2, expert_node_pb2, tensor_pb2


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.unexpected = []

    def add(self, kind, code, expected, detail=""):
        with self.lock:
            self.counts.setdefault(kind, {}).setdefault(code.name, 0)
            self.counts[kind][code.name] += 1
            if code not in expected and len(self.unexpected) < 20:
                self.unexpected.append(f"{kind}: {code.name} {detail}")


def code_of(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", required=True)
    ap.add_argument("--nodes", required=True)
    ap.add_argument("--metrics", default="")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--d_model", type=int, required=True)
    ap.add_argument("--max_tokens", type=int, default=65536)
    args = ap.parse_args()
    pb, npb, tpb = load_messages()
    big = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    router = grpc.insecure_channel(args.router, options=big)
    nodes = [grpc.insecure_channel(n, options=big) for n in args.nodes.split(",")]

    def rpc(channel, service, method, req_type, resp_type):
        return channel.unary_unary(f"/colibri.v1.{service}/{method}", request_serializer=req_type.SerializeToString,
                                   response_deserializer=resp_type.FromString)

    forward = rpc(router, "Router", "Forward", pb.ForwardRequest, pb.ForwardResponse)
    computes = [rpc(n, "ExpertNode", "Compute", npb.ComputeRequest, npb.ComputeResponse) for n in nodes]
    reloads = [rpc(n, "ExpertNode", "Reload", npb.ReloadRequest, npb.ReloadResponse) for n in nodes]
    infos = [rpc(n, "ExpertNode", "GetNodeInfo", npb.GetNodeInfoRequest, npb.GetNodeInfoResponse) for n in nodes]
    d = args.d_model
    rng = random.Random(7)

    def fwd(tokens, layer=0, data_bytes=None, shape=None):
        r = pb.ForwardRequest(layer=layer, routing=pb.ROUTING_MODE_GATE, request_id="abuse")
        r.hidden.dtype = tpb.DATA_TYPE_F32
        r.hidden.shape.extend(shape or [tokens, d])
        r.hidden.data = bytes(data_bytes if data_bytes is not None else tokens * d * 4)
        return r

    tally = Tally()
    end = time.time() + args.seconds
    bad = grpc.StatusCode.INVALID_ARGUMENT
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED

    def malformed():
        while time.time() < end:
            case = rng.randrange(6)
            if case == 0:
                c, m = code_of(forward, fwd(2, layer=999), timeout=10)
            elif case == 1:
                c, m = code_of(forward, fwd(3, shape=[3, d + 1]), timeout=10)
            elif case == 2:
                c, m = code_of(forward, fwd(3, data_bytes=7), timeout=10)
            elif case == 3:
                r = fwd(2)
                r.routing = 42
                c, m = code_of(forward, r, timeout=10)
            else:
                r = npb.ComputeRequest(layer=0)
                r.rows.dtype = tpb.DATA_TYPE_F32
                r.rows.shape.extend([2, d])
                r.rows.data = bytes(2 * d * 4)
                w = r.experts.add()
                w.expert = 10_000 if case == 4 else 0
                w.row_indices.extend([5 if case == 5 else 0])
                w.weights.extend([1.0])
                c, m = code_of(computes[rng.randrange(len(computes))], r, timeout=10)
            tally.add("malformed", c, (bad, grpc.StatusCode.FAILED_PRECONDITION), m)

    def oversized():
        while time.time() < end:
            if rng.random() < 0.5:
                c, m = code_of(forward, fwd(args.max_tokens + 1), timeout=30)
            else:  # over the router's message size limit (about max_tokens * (4 d + 64) + 1 MiB): gRPC refuses it
                c, m = code_of(forward, fwd(0, data_bytes=args.max_tokens * (d * 4 + 64) + (2 << 20), shape=[1, d]),
                               timeout=30)
            tally.add("oversized", c, (exhausted,), m)
            time.sleep(0.2)

    def cancelled():
        while time.time() < end:
            f = forward.future(fwd(512), timeout=30)
            time.sleep(rng.uniform(0.001, 0.005))
            f.cancel()
            try:
                f.result()
                c, m = grpc.StatusCode.OK, ""
            except grpc.FutureCancelledError:
                c, m = grpc.StatusCode.CANCELLED, ""
            except grpc.RpcError as e:
                c, m = e.code(), e.details()
            tally.add("cancelled", c, (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK), m)

    def admin():
        while time.time() < end:
            i = rng.randrange(len(nodes))
            c, m = code_of(reloads[i], npb.ReloadRequest(experts="0"), timeout=10)
            tally.add("admin", c, (grpc.StatusCode.PERMISSION_DENIED,), m)
            info = infos[i](npb.GetNodeInfoRequest(), timeout=10)
            tally.add("admin", grpc.StatusCode.OK if not info.model_dir else grpc.StatusCode.DATA_LOSS,
                      (grpc.StatusCode.OK,), "GetNodeInfo revealed model_dir")
            time.sleep(0.02)

    ports = [int(a.rsplit(":", 1)[1]) for a in [args.router] + args.nodes.split(",")]
    ports += [int(p) for p in args.metrics.split(",") if p]

    def slow():
        held = []
        while time.time() < end:
            for s in held:
                s.close()
            held = []
            for port in ports:
                for _ in range(4):
                    try:
                        s = socket.create_connection(("127.0.0.1", port), timeout=5)
                        s.send(b"PRI * HTTP/2.0\r\n" if rng.random() < 0.5 else b"GET /metr")
                        held.append(s)
                    except OSError:
                        pass
            tally.add("slow", grpc.StatusCode.OK, (grpc.StatusCode.OK,))
            time.sleep(3)
        for s in held:
            s.close()

    threads = [threading.Thread(target=f) for f in (malformed, malformed, oversized, cancelled, cancelled, admin, slow)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for kind, codes in sorted(tally.counts.items()):
        print(f"abuse {kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
    for u in tally.unexpected:
        print(f"abuse UNEXPECTED {u}")
    return 1 if tally.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
