#!/usr/bin/python3
"""Independent PyTorch reference for one Hugging Face sparse MoE block.

Computes the sparse mixture-of-experts block of a Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2(-Lite),
DeepSeek-V3 / Kimi-K2, gpt-oss or Llama 4 checkpoint with PyTorch (float32, weights upcast to float32), independently of
the Colibri C++ code, to produce golden vectors and to cross-check the C++
reference.  The math is HF's MixtralSparseMoeBlock forward:

    p = softmax(x @ G^T)                    (float32)
    (w, e) = top-k of p                     (ties -> lower expert id first)
    w /= sum(w)                             (Mixtral always; others if norm_topk_prob)
    y = sum_j w_j * W2[e_j] @ (silu(W1[e_j] @ x) * (W3[e_j] @ x))

Shared experts are added when the checkpoint has them: Qwen2-MoE's, as HF's
Qwen2MoeSparseMoeBlock does,

    y += sigmoid(x @ g^T) * W2s @ (silu(W1s @ x) * (W3s @ x))
    (g = mlp.shared_expert_gate.weight [1, d_model]; W*s = mlp.shared_expert.*)

and DeepSeek-V2's mlp.shared_experts.* ungated (y += W2s @ (...)), as HF's
DeepseekV2Moe does; DeepSeek-V2 weights are p * routed_scaling_factor, never
renormalized (greedy top-k only).

gpt-oss (HF's GptOssTopKRouter + GptOssExperts): logits = x @ R^T + b_R; the
top-k logits, softmax over those k; per expert gate_up = x @ GU[e] + b_GU[e]
(GU [d_model, 2 d_ff], gate = gate_up[..., ::2], up = gate_up[..., 1::2]),
gate clamped above at swiglu_limit, up to [-limit, limit],
out = ((up + 1) * gate * sigmoid(1.702 * gate)) @ D[e] + b_D[e], times the weight.

Llama 4 (HF's Llama4Router + Llama4TextMoe): the top-k logits, each scored
sigmoid(logit); the expert sees x * score (the input is scaled, not the
output); gate, up = (x * score) @ GU[e] split in halves, out = (up * silu(gate))
@ D[e]; plus the shared expert (an ungated SwiGLU MLP) of x.

Subcommands:
  make-inputs  random token_ids (I32 [T]) and hidden_states (F32 [T, d_model])
  forward      run the MoE block of layer L; writes output / expert_ids /
               expert_weights.  --routing embedding routes each token by the
               gate applied to its embedding row (no-balancing lookup table)
               while the experts still act on the hidden state.  --keep_experts
               computes the layer pruned to those experts (colibri-prune):
               the gate restricted to them (softmax over their logits only),
               expert ids written renumbered 0.. in ascending order.
  compare      compare two output files (relative L2 error and routes)

Safetensors files are read and written with a small built-in reader/writer
(json + numpy + struct, memory-mapped so big checkpoints are not loaded whole).
Exit codes: 0 ok, 1 comparison failed, 2 error (bad file / tensor / naming),
77 torch not available.  Run with Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import glob
import json
import os
import struct
import sys

try:
    import numpy as np
except ImportError as _ex:  # same 'skipped' code as a missing torch
    print(f"torch not available: numpy failed to import ({_ex})", file=sys.stderr)
    sys.exit(77)

DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "I32": "<i4", "I64": "<i8", "F8_E4M3": "u1"}


def _e4m3_table():
    """float32 value of each FP8 e4m3fn byte (1 sign, 4 exponent bits biased by 7, 3 mantissa bits,
    no infinities, S.1111.111 = NaN), from the format's definition."""
    table = np.zeros(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 15 and mantissa == 7:
            table[code] = np.nan
        elif exponent == 0:
            table[code] = sign * mantissa * 2.0 ** -9
        else:
            table[code] = sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return table


E4M3 = _e4m3_table()
NP_TO_ST = {np.dtype("float32"): "F32", np.dtype("int32"): "I32", np.dtype("int64"): "I64"}


class RefError(Exception):
    """A user-facing error (exit code 2)."""


class SafeFile:
    """Lazily memory-mapped safetensors file."""

    def __init__(self, path):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise RefError(f"{path}: bad header (file shorter than 8 bytes)")
                (n,) = struct.unpack("<Q", raw)
                if n > size - 8 or n > 1 << 30:
                    raise RefError(f"{path}: bad header (header length {n} exceeds file size {size})")
                header = json.loads(f.read(n).decode("utf-8"))
        except OSError as ex:
            raise RefError(f"{path}: cannot read file: {ex}") from ex
        except (UnicodeDecodeError, json.JSONDecodeError) as ex:
            raise RefError(f"{path}: bad header (invalid JSON: {ex})") from ex
        if not isinstance(header, dict):
            raise RefError(f"{path}: bad header (not a JSON object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start, data_size = 8 + n, size - 8 - n
        self.entries = {}
        for name, info in header.items():
            try:
                dt, shape, (b, e) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
            except (KeyError, TypeError, ValueError) as ex:
                raise RefError(f"{path}: bad header entry for tensor '{name}'") from ex
            if dt not in DTYPES:
                raise RefError(f"{path}: tensor '{name}' has unsupported dtype {dt}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dt]).itemsize
            if not (0 <= b <= e <= data_size and e - b == nbytes):
                raise RefError(f"{path}: tensor '{name}' has bad data_offsets {[b, e]}")
            self.entries[name] = (dt, tuple(shape), b)

    def raw(self, name):
        """Memory-mapped array in storage dtype (BF16 stays uint16)."""
        if name not in self.entries:
            raise RefError(f"{self.path}: missing tensor '{name}'")
        dt, shape, b = self.entries[name]
        if 0 in shape:
            return np.zeros(shape, DTYPES[dt])
        return np.memmap(self.path, DTYPES[dt], mode="r", offset=self.data_start + b, shape=shape)

    def dtype(self, name):
        return self.entries[name][0]


def to_f32(arr, st_dtype):
    """Convert (a slice of) a raw tensor to a fresh float32 array."""
    if st_dtype == "BF16":
        return (np.asarray(arr, dtype=np.uint32) << 16).view(np.float32)
    if st_dtype == "F8_E4M3":
        return E4M3[np.asarray(arr)]
    return np.array(arr, dtype=np.float32)


def write_safetensors(path, tensors, metadata=None):
    """Write {name: np.ndarray}; header padded with spaces to a multiple of 8."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in NP_TO_ST:
            raise RefError(f"cannot write tensor '{name}' of dtype {arr.dtype}")
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for data in blobs:
            f.write(data)


class Checkpoint:
    """config.json plus one or more safetensors files, looked up by tensor name."""

    def __init__(self, directory):
        cfg_path = os.path.join(directory, "config.json")
        try:
            with open(cfg_path) as f:
                self.config = json.load(f)
        except (OSError, json.JSONDecodeError) as ex:
            raise RefError(f"{cfg_path}: cannot read config: {ex}") from ex
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as ex:
                raise RefError(f"{index}: bad index file: {ex}") from ex
            files = {s: SafeFile(os.path.join(directory, s)) for s in set(weight_map.values())}
            self.where = {n: files[s] for n, s in weight_map.items()}
        else:
            shards = [single] if os.path.exists(single) else sorted(glob.glob(os.path.join(directory, "*.safetensors")))
            if not shards:
                raise RefError(f"{directory}: no model.safetensors or model.safetensors.index.json")
            self.where = {}
            for p in shards:
                sf = SafeFile(p)
                self.where.update({n: sf for n in sf.entries})
        self.directory = directory
        self.model_type = self.config.get("model_type", "?")
        self.prefix_all = ""
        if self.model_type == "llama4":  # Llama4ForConditionalGeneration: the text model under language_model.
            self.config = dict(self.config.get("text_config", {}), model_type="llama4")
            self.prefix_all = "language_model."
        # The experts' activation is ACT2FN[hidden_act] (gpt-oss's its own clamped one).
        if self.model_type != "gpt_oss" and self.config.get("hidden_act", "silu") not in ("silu", "swish"):
            raise RefError(f"{directory}/config.json: hidden_act {self.config['hidden_act']} is not silu")
        self.d_model = self._cfg("hidden_size")
        self.vocab = self._cfg("vocab_size")
        self.top_k = self._cfg("num_experts_per_tok")
        self.scale = 1.0
        self.sigmoid, self.topk_method, self.n_group, self.topk_group = False, "greedy", 1, 1
        if self.model_type == "mixtral":
            self.n_experts, self.norm = self._cfg("num_local_experts"), True
        elif self.model_type in ("gpt_oss", "llama4", "llama4_text"):
            self.n_experts, self.norm = self._cfg("num_local_experts"), self.model_type == "gpt_oss"
        elif self.model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
            # HF's DeepseekV2Moe: softmax over all experts, greedy or
            # group-limited (group score = max) top-k, weights times
            # routed_scaling_factor, never renormalized.  DeepseekV3TopkRouter:
            # sigmoid scores, + e_score_correction_bias for choosing only, groups
            # scored by the sum of their top two, the unbiased scores of the
            # chosen renormalized (norm_topk_prob) then times the factor.
            v3 = self.model_type != "deepseek_v2"
            self.n_experts = self._cfg("n_routed_experts")
            # Keys left out: the configuration classes' defaults (DeepseekV3Config:
            # renormalized, scaling 2.5, 8 groups with 4 kept; DeepseekV2Config: 1.0, no groups).
            self.norm = v3 and bool(self.config.get("norm_topk_prob", True))
            self.scale = float(self.config.get("routed_scaling_factor", 2.5 if v3 else 1.0))
            self.sigmoid = v3
            self.topk_method = self.config.get("topk_method", "noaux_tc" if v3 else "greedy")
            if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise RefError(f"{directory}/config.json: topk_method {self.topk_method} is not one of DeepSeek's "
                               "(greedy, group_limited_greedy, noaux_tc)")
            self.n_group = int(self.config.get("n_group", 8 if v3 else 1))
            self.topk_group = int(self.config.get("topk_group", 4 if v3 else 1))
        else:
            self.n_experts = self._cfg("num_experts")
            self.norm = bool(self.config.get("norm_topk_prob", False))
        if not 0 < self.top_k <= self.n_experts:
            raise RefError(f"{directory}/config.json: num_experts_per_tok {self.top_k} not in [1, {self.n_experts}]")
        if any(n.endswith(".mlp.router.weight") for n in self.where):
            self.naming, self.prefix = "gpt_oss", "mlp"
        elif any(n.endswith(".feed_forward.router.weight") for n in self.where):
            self.naming, self.prefix = "llama4", "feed_forward"
        elif any(".block_sparse_moe." in n for n in self.where):
            self.naming, self.prefix, self.proj = "mixtral", "block_sparse_moe", ("w1", "w3", "w2")
        elif any(".mlp.experts." in n and n.endswith(".gate_proj.weight") for n in self.where):
            self.naming, self.prefix, self.proj = "qwen/olmoe", "mlp", ("gate_proj", "up_proj", "down_proj")
        else:
            raise RefError(f"{directory}: unknown tensor naming (no block_sparse_moe.* or mlp.experts.*.gate_proj)")

    def _cfg(self, key):
        if key not in self.config:
            raise RefError(f"{self.directory}/config.json: missing field '{key}'")
        return int(self.config[key])

    def raw(self, name):
        if name not in self.where:
            raise RefError(f"{self.directory}: missing tensor '{name}'")
        return self.where[name].raw(name), self.where[name].dtype(name)

    def load(self, name, shape=None, rows=None):
        arr, dt = self.raw(name)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise RefError(f"{self.directory}: tensor '{name}' has shape {list(arr.shape)}, expected {list(shape)}")
        if dt == "F8_E4M3":  # DeepSeek-V3's block FP8: W = W8 * scale_inv of its 128 x 128 block
            if rows is not None:
                raise RefError(f"{self.directory}: row selection of FP8 tensor '{name}' is not supported")
            scale_arr, scale_dt = self.raw(name + "_scale_inv")
            scale = to_f32(scale_arr, scale_dt)
            full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:arr.shape[0], :arr.shape[1]]
            return to_f32(arr, dt) * full
        return to_f32(arr if rows is None else arr[rows], dt)

    def gate_name(self, layer):
        if self.naming in ("gpt_oss", "llama4"):
            return f"{self.prefix_all}model.layers.{layer}.{self.prefix}.router.weight"
        return f"model.layers.{layer}.{self.prefix}.gate.weight"

    def embedding_name(self):
        return f"{self.prefix_all}model.embed_tokens.weight"

    def expert_name(self, layer, e, which):  # which: 0 = gate (w1), 1 = up (w3), 2 = down (w2)
        return f"model.layers.{layer}.{self.prefix}.experts.{e}.{self.proj[which]}.weight"


def import_torch():
    try:
        import torch
    except Exception as ex:  # ImportError, or a broken install
        print(f"torch not available: {ex}", file=sys.stderr)
        sys.exit(77)
    torch.set_num_threads(2)
    return torch


def cmd_make_inputs(args):
    ck = Checkpoint(args.checkpoint)
    if args.tokens < 0:
        raise RefError(f"--tokens must be >= 0, got {args.tokens}")
    if args.layer is not None:
        ck.raw(ck.gate_name(args.layer))  # fail early if the layer has no MoE gate
    rng = np.random.default_rng(args.seed)
    token_ids = rng.integers(0, ck.vocab, size=args.tokens).astype(np.int32)
    hidden = rng.standard_normal((args.tokens, ck.d_model), dtype=np.float32)
    meta = {"seed": args.seed, "tokens": args.tokens}
    if args.layer is not None:
        meta["layer"] = args.layer
    write_safetensors(args.out, {"token_ids": token_ids, "hidden_states": hidden}, meta)
    print(f"make-inputs: model_type={ck.model_type} tokens={args.tokens} d_model={ck.d_model} "
          f"vocab={ck.vocab} seed={args.seed} -> {args.out}")
    return 0


def cmd_forward(args):
    torch = import_torch()
    ck = Checkpoint(args.checkpoint)
    inp = SafeFile(args.inputs)
    hidden = to_f32(inp.raw("hidden_states"), inp.dtype("hidden_states"))
    if hidden.ndim != 2 or hidden.shape[1] != ck.d_model:
        raise RefError(f"{args.inputs}: hidden_states shape {list(hidden.shape)} != [T, {ck.d_model}]")
    T, E, k = hidden.shape[0], ck.n_experts, ck.top_k
    x = torch.from_numpy(hidden)
    gate = torch.from_numpy(ck.load(ck.gate_name(args.layer), (E, ck.d_model)))
    if args.routing == "embedding":
        ids = np.array(inp.raw("token_ids"), dtype=np.int64).reshape(-1)
        if ids.shape[0] != T or (T and (ids.min() < 0 or ids.max() >= ck.vocab)):
            raise RefError(f"{args.inputs}: token_ids must be [{T}] values in [0, {ck.vocab})")
        route_src = torch.from_numpy(ck.load(ck.embedding_name(), (ck.vocab, ck.d_model), rows=ids))
    else:
        route_src = x
    keep = None
    if args.keep_experts:
        # The layer pruned to these experts: the gate restricted to them, ids renumbered 0.. in this order.
        keep = sorted(int(v) for v in args.keep_experts.split(","))
        if ck.naming in ("gpt_oss", "llama4") or ck.n_group > 1 or len(set(keep)) != len(keep) or \
                not keep or keep[0] < 0 or keep[-1] >= E or len(keep) < k:
            raise RefError(f"--keep_experts {args.keep_experts}: needs >= top_k distinct ids in [0, {E}) and "
                           f"a family with softmax or sigmoid top-k routing without groups")
    if ck.naming in ("gpt_oss", "llama4"):
        with torch.no_grad():
            experts, weights, y = forward_fused(torch, ck, args.layer, x, route_src, gate)
        return write_forward(args, ck, y, experts, weights)
    with torch.no_grad():
        logits = route_src @ gate.T
        dropped = torch.ones(E, dtype=torch.bool)
        if keep is not None:
            dropped[keep] = False
            logits = logits.masked_fill(dropped, float("-inf"))  # softmax over the kept experts only
        probs = logits.sigmoid() if ck.sigmoid else torch.softmax(logits, dim=-1, dtype=torch.float32)
        choice = probs
        bias_name = f"model.layers.{args.layer}.mlp.gate.e_score_correction_bias"
        if ck.topk_method == "noaux_tc" and bias_name in ck.where:
            choice = probs + torch.from_numpy(ck.load(bias_name, (E,)))
        if keep is not None:
            choice = choice.masked_fill(dropped, float("-inf"))
        if ck.topk_method in ("group_limited_greedy", "noaux_tc") and ck.n_group > 1:
            grouped = choice.view(T, ck.n_group, E // ck.n_group)
            if ck.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            kept = torch.sort(-group_scores, dim=-1, stable=True).indices[:, :ck.topk_group]
            mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0)
            mask = mask.unsqueeze(-1).expand(T, ck.n_group, E // ck.n_group).reshape(T, E)
            choice = choice.masked_fill(mask == 0, 0.0)  # as HF does: 0.0, not -inf
        # Stable ascending sort of -choice: descending, ties -> lower expert id.
        experts = torch.sort(-choice, dim=-1, stable=True).indices[:, :k]
        weights = probs.gather(1, experts)
        if ck.norm:  # DeepSeek-V3 (sigmoid) adds 1e-20 to the sum; the softmax families nothing
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if ck.sigmoid else 0.0))
        weights = weights * ck.scale
        y = torch.zeros_like(x)
        for e in range(E):  # HF-style loop over experts with index_add_
            tok, slot = torch.where(experts == e)
            if tok.numel() == 0:
                continue
            w1 = torch.from_numpy(ck.load(ck.expert_name(args.layer, e, 0)))
            w3 = torch.from_numpy(ck.load(ck.expert_name(args.layer, e, 1), w1.shape))
            w2 = torch.from_numpy(ck.load(ck.expert_name(args.layer, e, 2), (w1.shape[1], w1.shape[0])))
            if w1.shape[1] != ck.d_model:
                raise RefError(f"{ck.directory}: expert {e} of layer {args.layer} has d_model {w1.shape[1]}")
            xs = x[tok]
            h = torch.nn.functional.silu(xs @ w1.T) * (xs @ w3.T)
            y.index_add_(0, tok, (h @ w2.T) * weights[tok, slot, None])
        shared = f"model.layers.{args.layer}.mlp.shared_expert"  # Qwen2-MoE (gated below)
        if f"{shared}s.gate_proj.weight" in ck.where:
            shared += "s"  # DeepSeek's shared_experts: one MLP, ungated, added
        if f"{shared}.gate_proj.weight" in ck.where:
            s1 = torch.from_numpy(ck.load(f"{shared}.gate_proj.weight"))
            s3 = torch.from_numpy(ck.load(f"{shared}.up_proj.weight", s1.shape))
            s2 = torch.from_numpy(ck.load(f"{shared}.down_proj.weight", (s1.shape[1], s1.shape[0])))
            out = (torch.nn.functional.silu(x @ s1.T) * (x @ s3.T)) @ s2.T
            gate_name = f"model.layers.{args.layer}.mlp.shared_expert_gate.weight"
            if gate_name in ck.where:
                out = torch.sigmoid(x @ torch.from_numpy(ck.load(gate_name, (1, ck.d_model))).T) * out
            y = y + out
    if keep is not None:
        renumber = torch.full((E,), -1, dtype=torch.int64)
        renumber[keep] = torch.arange(len(keep))
        experts = renumber[experts]
    return write_forward(args, ck, y, experts, weights)


def forward_fused(torch, ck, layer, x, route_src, gate):
    """gpt-oss's and Llama 4's MoE blocks (fused expert tensors), as HF computes them."""
    T, E, k = x.shape[0], ck.n_experts, ck.top_k
    block = f"{ck.prefix_all}model.layers.{layer}.{ck.prefix}"
    logits = route_src @ gate.T
    if ck.naming == "gpt_oss":
        logits = logits + torch.from_numpy(ck.load(f"{block}.router.bias", (E,)))
    top_value, experts = torch.topk(logits, k, dim=-1)
    weights = torch.softmax(top_value, dim=-1) if ck.naming == "gpt_oss" else torch.sigmoid(top_value)
    gate_up_all, down_all = ck.raw(f"{block}.experts.gate_up_proj"), ck.raw(f"{block}.experts.down_proj")
    if gate_up_all[0].shape[:2] != (E, ck.d_model) or gate_up_all[0].shape[2] % 2:
        raise RefError(f"{ck.directory}: {block}.experts.gate_up_proj has shape {list(gate_up_all[0].shape)}")
    d_ff = gate_up_all[0].shape[2] // 2
    y = torch.zeros_like(x)
    limit = float(ck.config.get("swiglu_limit", 7.0))
    for e in range(E):
        tok, slot = torch.where(experts == e)
        if tok.numel() == 0:
            continue
        gu = torch.from_numpy(to_f32(gate_up_all[0][e], gate_up_all[1]))
        down = torch.from_numpy(to_f32(down_all[0][e], down_all[1]))
        if tuple(down.shape) != (d_ff, ck.d_model):
            raise RefError(f"{ck.directory}: {block}.experts.down_proj[{e}] has shape {list(down.shape)}")
        if ck.naming == "gpt_oss":
            gu_bias = torch.from_numpy(ck.load(f"{block}.experts.gate_up_proj_bias", (E, 2 * d_ff))[e])
            down_bias = torch.from_numpy(ck.load(f"{block}.experts.down_proj_bias", (E, ck.d_model))[e])
            gate_up = x[tok] @ gu + gu_bias
            g, u = gate_up[..., ::2], gate_up[..., 1::2]
            g = g.clamp(min=None, max=limit)
            u = u.clamp(min=-limit, max=limit)
            out = ((u + 1) * (g * torch.sigmoid(g * 1.702))) @ down + down_bias
            y.index_add_(0, tok, out * weights[tok, slot, None])
        else:
            routed_in = x[tok] * weights[tok, slot, None]
            g, u = (routed_in @ gu).chunk(2, dim=-1)
            y.index_add_(0, tok, (u * torch.nn.functional.silu(g)) @ down)
    if ck.naming == "llama4":
        shared = f"{block}.shared_expert"
        s1 = torch.from_numpy(ck.load(f"{shared}.gate_proj.weight"))
        s3 = torch.from_numpy(ck.load(f"{shared}.up_proj.weight", s1.shape))
        s2 = torch.from_numpy(ck.load(f"{shared}.down_proj.weight", (s1.shape[1], s1.shape[0])))
        y = y + (torch.nn.functional.silu(x @ s1.T) * (x @ s3.T)) @ s2.T
    return experts, weights, y


def write_forward(args, ck, y, experts, weights):
    T, E, k = y.shape[0], ck.n_experts, ck.top_k
    write_safetensors(args.out, {"output": y.numpy(), "expert_ids": experts.numpy().astype(np.int32),
                                 "expert_weights": weights.numpy()},
                      {"model_type": ck.model_type, "layer": args.layer, "routing": args.routing})
    print(f"forward: model_type={ck.model_type} naming={ck.naming} layer={args.layer} tokens={T} "
          f"experts={E} top_k={k} routing={args.routing} norm_topk_prob={ck.norm} -> {args.out}")
    return 0


def cmd_compare(args):
    exp, act = SafeFile(args.expected), SafeFile(args.actual)
    for sf in (exp, act):
        if "output" not in sf.entries:
            print(f"FAIL: {sf.path}: missing tensor 'output'")
            return 1
    e = to_f32(exp.raw("output"), exp.dtype("output")).astype(np.float64)
    a = to_f32(act.raw("output"), act.dtype("output")).astype(np.float64)
    if e.shape != a.shape:
        print(f"FAIL: output shape differs: expected {list(e.shape)}, actual {list(a.shape)}")
        return 1
    diff = np.abs(a - e)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_ref = float(np.abs(e).max()) if e.size else 0.0
    dn, en = float(np.linalg.norm(a - e)), float(np.linalg.norm(e))
    rel_l2 = dn / en if en > 0 else (0.0 if dn == 0 else float("inf"))
    rel_max = max_abs / max_ref if max_ref > 0 else (0.0 if max_abs == 0 else float("inf"))
    ok = bool(np.all(np.isfinite(a))) and rel_l2 <= args.rtol
    print(f"output {list(e.shape)}: max_abs_err={max_abs:.3e} max_err/max|expected|={rel_max:.3e} "
          f"rel_l2={rel_l2:.3e} (rtol={args.rtol:g})")
    if args.atol is not None and max_abs > args.atol:
        print(f"FAIL: max_abs_err {max_abs:.3e} > atol {args.atol:g}")
        ok = False
    if "expert_ids" in exp.entries and "expert_ids" in act.entries:
        ei, ai = np.array(exp.raw("expert_ids")), np.array(act.raw("expert_ids"))
        if ei.shape != ai.shape:
            print(f"FAIL: expert_ids shape differs: expected {list(ei.shape)}, actual {list(ai.shape)}")
            return 1
        bad = [t for t in range(ei.shape[0]) if set(ei[t].tolist()) != set(ai[t].tolist())]
        print(f"expert_ids {list(ei.shape)}: {len(bad)} token(s) routed differently")
        for t in bad[:5]:
            print(f"  token {t}: expected {sorted(ei[t].tolist())}, actual {sorted(ai[t].tolist())}")
        ok = ok and not bad
    else:
        print("expert_ids: not present in both files, routes not compared")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-inputs", help="write random token_ids / hidden_states")
    for opt in ("--checkpoint", "--out"):
        p.add_argument(opt, required=True)
    for opt in ("--tokens", "--seed"):
        p.add_argument(opt, type=int, required=True)
    p.add_argument("--layer", type=int, help="optional: check that this layer has an MoE gate")
    p = sub.add_parser("forward", help="run the MoE block of one layer")
    for opt in ("--checkpoint", "--inputs", "--out"):
        p.add_argument(opt, required=True)
    p.add_argument("--layer", type=int, required=True, help="Hugging Face layer index")
    p.add_argument("--routing", choices=("gate", "embedding"), default="gate")
    p.add_argument("--keep_experts", help="comma-separated expert ids: the layer pruned to them (colibri-prune)")
    p = sub.add_parser("compare", help="compare two forward outputs")
    for opt in ("--expected", "--actual"):
        p.add_argument(opt, required=True)
    p.add_argument("--rtol", type=float, required=True, help="max relative L2 error of output")
    p.add_argument("--atol", type=float, help="optional max absolute error of output")
    args = ap.parse_args(argv)
    try:
        return {"make-inputs": cmd_make_inputs, "forward": cmd_forward, "compare": cmd_compare}[args.cmd](args)
    except RefError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
