#!/usr/bin/python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/), committed.

  /usr/bin/python3 tests/fuzz/make_corpus.py BUILD_DIR

Valid inputs for each target, so fuzzing starts past the first checks: small
safetensors files; a tiny model's manifest, expert, LUT and gate files with
their selector byte (made by the build's colibri-synth/convert with the same
shape as tests/fuzz/fuzz_model.h); Compute and Forward requests in every
mode and Reload requests (serialized with message classes protoc generates from
proto/); C API
argument blobs.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

build = os.path.abspath(sys.argv[1])
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
corpus = os.path.join(here, "corpus")


def put(target, name, data):
    d = os.path.join(corpus, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors(tensors):
    header, blob = {}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + blob


put("safetensors_fuzz", "one_f32", safetensors({"w": ("F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4))}))
put("safetensors_fuzz", "mixed", safetensors({"a": ("BF16", [3], b"\0" * 6), "b": ("I32", [1, 2], b"\1" * 8)}))
put("safetensors_fuzz", "empty", safetensors({}))

tmp = tempfile.mkdtemp()
subprocess.run([f"{build}/tools/colibri-synth", "--out", f"{tmp}/ckpt", "--d_model", "32", "--d_ff", "64",
                "--layers", "2", "--experts", "4", "--top_k", "2", "--vocab", "16", "--dtype", "f32"],
               check=True, stdout=subprocess.DEVNULL)
subprocess.run([f"{build}/tools/colibri-convert", "--checkpoint", f"{tmp}/ckpt", "--out", f"{tmp}/model",
                "--weight_type", "int4", "--progress=false"], check=True, stdout=subprocess.DEVNULL)
for selector, path in enumerate(["manifest.json", "layer_001/expert_002.bin", "layer_000/lut.bin", "layer_001/gate.bin"]):
    put("model_dir_fuzz", f"{selector}_{os.path.basename(path)}", bytes([selector]) + open(f"{tmp}/model/{path}", "rb").read())

subprocess.run(["protoc", f"--python_out={tmp}", f"-I{root}/proto", "colibri/v1/tensor.proto",
                "colibri/v1/expert_node.proto", "colibri/v1/router.proto"], check=True)
sys.path.insert(0, tmp)
from colibri.v1 import expert_node_pb2, router_pb2, tensor_pb2  # noqa: E402

rows = struct.pack("<64f", *[((i * 7) % 13 - 6) / 6.0 for i in range(64)])
req = expert_node_pb2.ComputeRequest(layer=1, per_expert_output=True)
req.rows.dtype = tensor_pb2.DATA_TYPE_F32
req.rows.shape.extend([2, 32])
req.rows.data = rows
w = req.experts.add(expert=2)
w.row_indices.extend([0, 1])
w.weights.extend([0.5, 0.25])
put("expert_request_fuzz", "per_expert", req.SerializeToString())
req.per_expert_output = False
req.experts.add(expert=0, row_indices=[1], weights=[1.0])
put("expert_request_fuzz", "row_sums", req.SerializeToString())
req.rows.dtype = tensor_pb2.DATA_TYPE_BF16
req.rows.data = rows[: len(rows) // 2]
put("expert_request_fuzz", "bf16", req.SerializeToString())
# Grouped output: row 1's two entries folded into reply row 0 (rank 0 then 1), row 0's alone.
req.num_output_rows = 2
req.experts[0].output_rows.extend([1, 0])
req.experts[0].ranks.extend([0, 1])
req.experts[1].output_rows.extend([0])
req.experts[1].ranks.extend([0])
put("expert_request_fuzz", "grouped", req.SerializeToString())

for mode in (router_pb2.ROUTING_MODE_LUT, router_pb2.ROUTING_MODE_GATE, router_pb2.ROUTING_MODE_CLIENT):
    f = router_pb2.ForwardRequest(layer=mode % 2, routing=mode, return_routes=True, return_timings=True)
    f.token_ids.extend([3, 15])
    f.hidden.dtype = tensor_pb2.DATA_TYPE_F32
    f.hidden.shape.extend([2, 32])
    f.hidden.data = rows
    if mode == router_pb2.ROUTING_MODE_CLIENT:
        f.routes.top_k = 2
        f.routes.expert_ids.extend([0, 3, 1, 2])
        f.routes.weights.extend([0.6, 0.4, 0.5, 0.5])
        f.output_dtype = tensor_pb2.DATA_TYPE_BF16
    put("router_request_fuzz", f"mode_{mode}", f.SerializeToString())

for routing in (1, 2, 3):
    blob = struct.pack("<iiB", 0, routing, 2) + struct.pack("<2i", 3, 9) + rows + struct.pack("<4i", 0, 1, 2, 3)
    blob += struct.pack("<4f", 0.5, 0.5, 0.7, 0.3)
    put("c_api_fuzz", f"routing_{routing}", blob)
for name, experts, model_dir in (("reshard", "layer:0/expert:0-1", ""), ("all", "all", ""),
                                 ("outside", "", "/etc"), ("bad_spec", "layer:9/expert:-1", "")):
    r = expert_node_pb2.ReloadRequest(experts=experts, model_dir=model_dir)
    put("admin_request_fuzz", name, r.SerializeToString())
put("admin_request_fuzz", "keep_previous", expert_node_pb2.ReloadRequest(keep_previous=True).SerializeToString())
put("admin_request_fuzz", "drop", expert_node_pb2.ReloadRequest(drop_model_id="xxh3_128:" + "0" * 32).SerializeToString())
print("corpora written to", corpus)
