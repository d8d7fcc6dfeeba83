#!/usr/bin/python3
"""One expert node, one long call, small calls beside it: how long the small
ones wait, and how soon the node is free after the long one is cancelled.

  /usr/bin/python3 scripts/node_fairness.py [BUILD_DIR]

Makes a bf16 model (d_model 512, d_ff 1024, 8 experts) with the build's
colibri-synth/convert, starts colibri-expert on 127.0.0.1:0, then:
  1. a small call alone (1 row, 8 experts);
  2. a long call (4096 rows x 8 experts, an 8 MiB request) and, 0.3 s into
     it, five small calls one after the other: their latencies;
  3. the long call again, cancelled after 0.3 s, then a small call: the time
     from the cancel to its answer.
Prints the figures and lscpu's model name. The messages are generated with
protoc at run time (no download). Exits 77 without grpcio/numpy.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

try:
    import grpc
    import numpy as np
except ImportError as ex:  # Debian: python3-grpcio, python3-numpy
    print(f"SKIP: {ex}", file=sys.stderr)
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build"))
    work = tempfile.mkdtemp(prefix="colibri_fairness_")
    subprocess.run(["protoc", f"--python_out={work}", f"-I{ROOT}/proto", "colibri/v1/tensor.proto",
                    "colibri/v1/expert_node.proto"], check=True)
    sys.path.insert(0, work)
    from colibri.v1 import expert_node_pb2 as pb, tensor_pb2 as tpb  # noqa: E402
    subprocess.run([f"{build}/tools/colibri-synth", "--out", f"{work}/ckpt", "--d_model", "512", "--d_ff", "1024",
                    "--layers", "1", "--experts", "8", "--vocab", "50"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([f"{build}/tools/colibri-convert", "--checkpoint", f"{work}/ckpt", "--out", f"{work}/model",
                    "--weight_type", "bf16", "--progress=false"], check=True, stdout=subprocess.DEVNULL)
    node = subprocess.Popen([f"{build}/expert_node/colibri-expert", f"--model={work}/model", "--listen=127.0.0.1:0",
                             "--residency=paged"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(re.search(r"port (\d+)", node.stdout.readline()).group(1))
        big = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=big)
        compute = channel.unary_unary("/colibri.v1.ExpertNode/Compute", request_serializer=pb.ComputeRequest.SerializeToString,
                                      response_deserializer=pb.ComputeResponse.FromString)

        def request(rows):
            r = pb.ComputeRequest(layer=0)
            r.rows.dtype = tpb.DATA_TYPE_F32
            r.rows.shape.extend([rows, 512])
            r.rows.data = np.random.default_rng(0).standard_normal((rows, 512), dtype=np.float32).tobytes()
            for e in range(8):
                w = r.experts.add()
                w.expert = e
                w.row_indices.extend(range(rows))
                w.weights.extend([0.1] * rows)
            return r

        def timed(call):
            t = time.perf_counter()
            call()
            return 1000 * (time.perf_counter() - t)

        long_call, small = request(4096), request(1)
        compute(small, timeout=30)  # warm-up
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.*)", cpu)
        print(f"# node_fairness: long call {long_call.ByteSize() / 2**20:.1f} MiB (4096 rows x 8 experts, d_model 512, "
              f"bf16); lscpu: {model.group(1) if model else '?'}")
        print(f"small call alone: {timed(lambda: compute(small, timeout=30)):.1f} ms")
        future = compute.future(long_call, timeout=300)
        time.sleep(0.3)
        beside = [timed(lambda: compute(small, timeout=60)) for _ in range(5)]
        print("small calls during the long one: " + ", ".join(f"{x:.1f}" for x in beside) + " ms")
        t = time.perf_counter()
        future.result()
        print(f"the long call finished {time.perf_counter() - t:.2f} s after them")
        future = compute.future(long_call, timeout=300)
        time.sleep(0.3)
        t = time.perf_counter()
        future.cancel()
        compute(small, timeout=60)
        print(f"long call cancelled: a small call answered {1000 * (time.perf_counter() - t):.1f} ms after the cancel")
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait()


if __name__ == "__main__":
    main()
