#!/usr/bin/python3
"""PyTorch baseline: time one Mixtral sparse MoE block the way a user would run it.

This is what a user would pick instead of Colibri: Debian's PyTorch (python3-torch
1.13, run with /usr/bin/python3) executing a module equivalent to Hugging Face's
MixtralSparseMoeBlock (gate Linear, per-expert w1/w3/w2 Linear, SiLU, the loop over
experts with index_add_), with random weights, on the CPU, under
torch.inference_mode().  Its output is meant to be read side by side with Colibri's
kernels benchmark from the same run (the machine's memory bandwidth moves between
runs, so only same-run figures compare).

Per (dtype, T): inputs x [T, d_model] (seeded, generated in f32 and cast so every
dtype sees the same values), `--warmup` untimed calls, then `--repeat` calls each
timed with time.perf_counter_ns.  Reported: median / p90 / p99 / max latency in ms
(percentiles are nearest-rank, i.e. real samples: with 20 samples p99 == max),
  GB/s     = (distinct experts used x 3 x d_model x d_ff + experts x d_model [gate])
             x bytes per weight / median          (weights only, activations ignored)
  GFLOP/s  = 2 x 3 x d_model x d_ff x T x top_k / median   (expert FLOPs only)

Exit codes: 0 ok, 1 runtime error (e.g. not enough memory for the layer),
2 bad arguments, 77 torch not available.
"""
import argparse
import gc
import json
import math
import os
import resource
import sys
import time

DTYPE_BYTES = {"bf16": 2, "f32": 4}

EPILOG = """\
routing:
  uniform (default)  token t goes to experts (t*k + j) % E, j = 0..k-1, each with
                     weight 1/k.  Deterministic: T=1 touches experts 0..k-1, and every
                     expert is touched as soon as T*k >= E, so the weight bytes read
                     are known exactly.  The gate matmul, softmax and top-k are still
                     computed (same work as a real router); only their result is
                     replaced.
  gate               the real router: softmax(x @ G^T) over a random gate matrix G,
                     top-k, renormalised (Mixtral).  The experts touched are those a
                     real router would pick for these random inputs, so for small T*k
                     some experts may be unused (fewer bytes read; the number used is
                     reported).

metrics:
  median/p90/p99/max  per-call latency, ms; percentiles are nearest-rank samples
                      (with 20 samples p99 == max).
  GB/s                weight bytes read / median: (distinct experts used x 3 x
                      d_model x d_ff + E x d_model) x bytes per weight.  Compare it
                      with a read-bandwidth probe from the SAME run, never a constant.
  GFLOP/s             2 x 3 x d_model x d_ff x T x top_k / median (expert FLOPs only).

f32: Debian's torch is built with BLAS_INFO=generic, so f32 matmuls call the system
libblas.so.3, which is the slow reference BLAS (~4 GFLOP/s) unless OpenBLAS is
installed.  bf16 goes through oneDNN and is the honest baseline.  A configuration
whose first call predicts more than --max_seconds stops taking samples when the next
call would exceed that budget; it is still reported, with its sample count.

memory: one dtype's layer is built at a time and freed before the next; the full
Mixtral-8x7B layer is 2.8 GB in bf16 and 5.6 GB in f32.
"""


# ----------------------------------------------------------------------------- arguments

def positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def nonneg_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return v


def positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}")
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def int_list(text):
    items = [s.strip() for s in text.split(",")]
    if not items or any(s == "" for s in items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers: {text!r}")
    return [positive_int(s) for s in items]


def dtype_list(text):
    items = [s.strip().lower() for s in text.split(",")]
    for s in items:
        if s not in DTYPE_BYTES:
            raise argparse.ArgumentTypeError(
                f"unknown dtype {s!r} (choose from {', '.join(DTYPE_BYTES)})")
    return items


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench_torch.py",
        description="PyTorch baseline: time one Mixtral sparse MoE block "
                    "(HF MixtralSparseMoeBlock equivalent) on the CPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d_model", type=positive_int, default=4096, help="hidden size (default 4096)")
    p.add_argument("--d_ff", type=positive_int, default=14336, help="expert FFN size (default 14336)")
    p.add_argument("--experts", type=positive_int, default=8, help="number of experts E (default 8)")
    p.add_argument("--top_k", type=positive_int, default=2, help="experts per token k (default 2)")
    p.add_argument("--tokens", type=int_list, default=[1, 8, 32, 128],
                   help="comma-separated token counts T (default 1,8,32,128)")
    p.add_argument("--dtypes", type=dtype_list, default=["bf16", "f32"],
                   help="comma-separated weight/activation dtypes: bf16, f32 (default bf16,f32)")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="torch.set_num_threads (interop threads are set to 1) (default 2)")
    p.add_argument("--warmup", type=nonneg_int, default=3, help="untimed calls per configuration (default 3)")
    p.add_argument("--repeat", type=positive_int, default=20, help="timed calls per configuration (default 20)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed for weights and inputs (default 0)")
    p.add_argument("--routing", choices=["uniform", "gate"], default="uniform",
                   help="expert assignment, see below (default uniform)")
    p.add_argument("--max_seconds", type=positive_float, default=60.0,
                   help="time budget per configuration, warmup included; once exceeded no "
                        "more samples are taken (default 60)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line on stdout instead of the table "
                        "(the header then goes to stderr)")
    args = p.parse_args(argv)
    if args.top_k > args.experts:
        p.error(f"--top_k ({args.top_k}) must be <= --experts ({args.experts})")
    if len(set(args.dtypes)) != len(args.dtypes):
        p.error("--dtypes lists a dtype twice")
    if len(set(args.tokens)) != len(args.tokens):
        p.error("--tokens lists a value twice")
    return args


# ----------------------------------------------------------------------------- machine info

def cpu_info():
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = val.strip()
                elif key == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    try:
        ncpu = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        ncpu = os.cpu_count() or 0
    return model, isa, ncpu


def mem_available_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def blas_info(torch):
    """Lines of torch.__config__.show() about BLAS/MKL/OpenBLAS, and the libblas loaded."""
    lines = []
    for line in torch.__config__.show().splitlines():
        s = line.strip().lstrip("-").strip()
        if not s:
            continue
        if s.startswith("Build settings:"):
            # one very long line: keep only the BLAS-related settings
            for tok in s[len("Build settings:"):].split(","):
                tok = tok.strip()
                if any(w in tok.upper() for w in ("BLAS", "MKL", "LAPACK")):
                    lines.append(tok)
        elif any(w in s.upper() for w in ("BLAS", "MKL", "LAPACK")):
            lines.append(s)
    loaded = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                base = os.path.basename(path).lower()
                if "blas" in base or "mkl_" in base or base.startswith("libmkl"):
                    loaded.add(os.path.realpath(path))
    except OSError:
        pass
    return lines, sorted(loaded)


def f32_gemm_probe(torch, n=512):
    """GFLOP/s of one n x n x n f32 matmul (after one untimed call)."""
    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    torch.mm(a, b)
    best = None
    for _ in range(3):
        t0 = time.perf_counter_ns()
        torch.mm(a, b)
        dt = time.perf_counter_ns() - t0
        best = dt if best is None else min(best, dt)
    return 2.0 * n * n * n / best  # FLOP/ns == GFLOP/s


# ----------------------------------------------------------------------------- the module

def define_modules(torch):
    nn = torch.nn
    F = torch.nn.functional

    class MixtralBlockSparseTop2MLP(nn.Module):
        """HF's expert: w2(silu(w1 x) * w3 x)."""

        def __init__(self, d_model, d_ff, dtype=None, device=None):
            super().__init__()
            self.w1 = nn.Linear(d_model, d_ff, bias=False, dtype=dtype, device=device)
            self.w2 = nn.Linear(d_ff, d_model, bias=False, dtype=dtype, device=device)
            self.w3 = nn.Linear(d_model, d_ff, bias=False, dtype=dtype, device=device)
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states):
            current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
            return self.w2(current_hidden_states)

    class MixtralSparseMoeBlock(nn.Module):
        """HF's MixtralSparseMoeBlock forward (inference: no jitter noise).

        `fixed_routes`, when set to (selected_experts [T,k] int64, routing_weights [T,k] f32),
        replaces the router's choice after the gate/softmax/top-k have been computed
        (the --routing uniform mode); everything else is HF's code path.
        """

        def __init__(self, d_model, d_ff, num_experts, top_k, dtype=None, device=None):
            super().__init__()
            self.hidden_dim = d_model
            self.ffn_dim = d_ff
            self.num_experts = num_experts
            self.top_k = top_k
            self.gate = nn.Linear(d_model, num_experts, bias=False, dtype=dtype, device=device)
            self.experts = nn.ModuleList(
                [MixtralBlockSparseTop2MLP(d_model, d_ff, dtype=dtype, device=device)
                 for _ in range(num_experts)])
            self.fixed_routes = None

        def forward(self, hidden_states):
            batch_size, sequence_length, hidden_dim = hidden_states.shape
            hidden_states = hidden_states.view(-1, hidden_dim)
            # router_logits: (batch * sequence_length, n_experts)
            router_logits = self.gate(hidden_states)

            routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
            routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
            if self.fixed_routes is not None:
                selected_experts, routing_weights = self.fixed_routes
            # we cast back to the input dtype
            routing_weights = routing_weights.to(hidden_states.dtype)

            final_hidden_states = torch.zeros(
                (batch_size * sequence_length, hidden_dim),
                dtype=hidden_states.dtype, device=hidden_states.device)

            # One hot encode the selected experts to create an expert mask
            # this will be used to easily index which expert is going to be sollicitated
            expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)

            # Loop over all available experts in the model and perform the computation on each expert
            for expert_idx in range(self.num_experts):
                expert_layer = self.experts[expert_idx]
                idx, top_x = torch.where(expert_mask[expert_idx])

                if top_x.shape[0] == 0:
                    continue

                # in torch it is faster to index using lists than torch tensors
                top_x_list = top_x.tolist()
                idx_list = idx.tolist()

                # Index the correct hidden states and compute the expert hidden state for
                # the current expert. We need to make sure to multiply the output hidden
                # states by `routing_weights` on the corresponding tokens (top-1 and top-2)
                current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
                current_hidden_states = expert_layer(current_state) * routing_weights[top_x_list, idx_list, None]

                # However `index_add_` only support torch tensors for indexing so we'll use
                # the `top_x` tensor here.
                final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
            final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
            return final_hidden_states, router_logits

    return MixtralSparseMoeBlock


def build_block(torch, block_cls, args, dtype):
    """The block with uninitialised storage of `dtype`, then seeded weights.

    Each matrix is drawn in f32 (nn.Linear's default bound 1/sqrt(fan_in)) and cast, so
    bf16 and f32 runs use the same weights up to rounding; only one f32 matrix is
    alive at a time on top of the layer itself.
    """
    block = torch.nn.utils.skip_init(block_cls, args.d_model, args.d_ff, args.experts,
                                     args.top_k, dtype=dtype, device="cpu")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        mats = [block.gate.weight]
        for e in block.experts:
            mats += [e.w1.weight, e.w3.weight, e.w2.weight]
        for w in mats:
            bound = 1.0 / math.sqrt(w.shape[1])
            tmp = torch.empty(w.shape, dtype=torch.float32).uniform_(-bound, bound)
            w.copy_(tmp)
            del tmp
    block.eval()
    return block


# ----------------------------------------------------------------------------- measurement

def nearest_rank(sorted_vals, p):
    n = len(sorted_vals)
    k = max(1, math.ceil(p / 100.0 * n))
    return sorted_vals[min(k, n) - 1]


def median(sorted_vals):
    n = len(sorted_vals)
    m = n // 2
    return sorted_vals[m] if n % 2 else 0.5 * (sorted_vals[m - 1] + sorted_vals[m])


class Output:
    def __init__(self, as_json):
        self.as_json = as_json
        self.header_printed = False
        self.cols = ["impl", "dtype", "T", "samples", "median_ms", "p90_ms", "p99_ms",
                     "max_ms", "GB/s", "GFLOP/s"]
        self.widths = [5, 5, 5, 7, 10, 10, 10, 10, 8, 8]

    def note(self, text):
        """Header / notes: '# ' lines on stdout with the table, on stderr with --json."""
        stream = sys.stderr if self.as_json else sys.stdout
        for line in text.splitlines():
            print(f"# {line}", file=stream)
        stream.flush()

    def row(self, rec):
        if self.as_json:
            print(json.dumps(rec, sort_keys=False), flush=True)
            return
        if not self.header_printed:
            print("  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                            for i, (c, w) in enumerate(zip(self.cols, self.widths))))
            self.header_printed = True
        vals = [rec["impl"], rec["dtype"], str(rec["T"]), str(rec["samples"]),
                f"{rec['median_ms']:.3f}", f"{rec['p90_ms']:.3f}", f"{rec['p99_ms']:.3f}",
                f"{rec['max_ms']:.3f}", f"{rec['GB/s']:.2f}", f"{rec['GFLOP/s']:.2f}"]
        print("  ".join(v.rjust(w) if i > 1 else v.ljust(w)
                        for i, (v, w) in enumerate(zip(vals, self.widths))), flush=True)


def uniform_routes(torch, T, k, E):
    t = torch.arange(T, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(k, dtype=torch.int64).unsqueeze(0)
    selected = (t * k + j) % E
    weights = torch.full((T, k), 1.0 / k, dtype=torch.float32)
    return selected, weights


def run_config(torch, block, args, dname, dtype, T, out, context):
    # Inputs: seeded per (seed, T), drawn in f32 and cast, identical across dtypes.
    g = torch.Generator().manual_seed(args.seed * 1000003 + T)
    x = torch.randn((1, T, args.d_model), generator=g, dtype=torch.float32).to(dtype)

    if args.routing == "uniform":
        block.fixed_routes = uniform_routes(torch, T, args.top_k, args.experts)
        used = sorted(set(block.fixed_routes[0].flatten().tolist()))
    else:
        block.fixed_routes = None
        logits = block.gate(x.view(-1, args.d_model))
        probs = torch.softmax(logits, dim=1, dtype=torch.float)
        used = sorted(set(torch.topk(probs, args.top_k, dim=-1)[1].flatten().tolist()))
        del logits, probs

    budget_ns = args.max_seconds * 1e9
    notes = []
    gc.collect()
    start = time.perf_counter_ns()
    last = None
    calls = 0

    # warmup (the first call, timed, sets the estimate)
    for i in range(args.warmup):
        if last is not None and (time.perf_counter_ns() - start) + last > budget_ns:
            notes.append(f"skipped {args.warmup - i} of {args.warmup} warmup calls (budget)")
            break
        t0 = time.perf_counter_ns()
        y, _ = block(x)
        last = time.perf_counter_ns() - t0
        calls += 1
        if i == 0:
            if not bool(torch.isfinite(y).all()):
                raise RuntimeError(f"{dname} T={T}: output is not finite")
            est = last * (args.warmup + args.repeat)
            if est > budget_ns:
                notes.append(f"first call {last / 1e9:.2f} s -> estimated {est / 1e9:.0f} s for "
                             f"{args.warmup}+{args.repeat} calls > --max_seconds {args.max_seconds:g}: "
                             f"taking only the samples that fit")
        del y

    samples = []
    for i in range(args.repeat):
        if samples and (time.perf_counter_ns() - start) + last > budget_ns:
            notes.append(f"skipped the remaining {args.repeat - i} of {args.repeat} timed calls "
                         f"(budget {args.max_seconds:g} s); samples taken: {len(samples)}")
            break
        t0 = time.perf_counter_ns()
        y, _ = block(x)
        t1 = time.perf_counter_ns()
        last = t1 - t0
        samples.append(last)
        if i == 0 and calls == 0:
            if not bool(torch.isfinite(y).all()):
                raise RuntimeError(f"{dname} T={T}: output is not finite")
            if last * args.repeat > budget_ns:
                notes.append(f"first call {last / 1e9:.2f} s -> estimated {last * args.repeat / 1e9:.0f} s "
                             f"> --max_seconds {args.max_seconds:g}: taking only the samples that fit")
        del y

    s = sorted(samples)
    med_ns = median(s)
    bpw = DTYPE_BYTES[dname]
    weight_bytes = (len(used) * 3 * args.d_model * args.d_ff + args.experts * args.d_model) * bpw
    flops = 2.0 * 3 * args.d_model * args.d_ff * T * args.top_k
    rec = {
        "impl": "torch", "dtype": dname, "T": T, "samples": len(samples),
        "median_ms": med_ns / 1e6, "p90_ms": nearest_rank(s, 90) / 1e6,
        "p99_ms": nearest_rank(s, 99) / 1e6, "max_ms": s[-1] / 1e6,
        "GB/s": weight_bytes / med_ns, "GFLOP/s": flops / med_ns,
        "min_ms": s[0] / 1e6, "experts_used": len(used), "weight_bytes": weight_bytes,
        "expert_flops": flops, "routing": args.routing, "d_model": args.d_model,
        "d_ff": args.d_ff, "experts": args.experts, "top_k": args.top_k,
        "warmup": args.warmup, "repeat": args.repeat, "truncated": len(samples) < args.repeat,
        "seed": args.seed,
    }
    rec.update(context)
    if notes:
        rec["notes"] = notes
    for n in notes:
        out.note(f"{dname} T={T}: {n}")
    if args.routing == "gate" and len(used) < args.experts:
        out.note(f"{dname} T={T}: router used {len(used)} of {args.experts} experts")
    out.row(rec)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except Exception as ex:  # ImportError, or a broken install raising something else
        print(f"torch not available: {ex}", file=sys.stderr)
        return 77

    # Interop threads must be set before any parallel work starts.
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already initialised (only if imported into a running torch program)
    torch.set_num_threads(args.threads)

    out = Output(args.json)
    model, isa, ncpu = cpu_info()
    blas_lines, blas_loaded = blas_info(torch)
    probe = f32_gemm_probe(torch) if "f32" in args.dtypes else None

    context = {"torch_version": torch.__version__, "threads": torch.get_num_threads(),
               "interop_threads": torch.get_num_interop_threads(), "cpu": model}
    out.note(f"bench_torch: PyTorch baseline, HF MixtralSparseMoeBlock equivalent")
    out.note(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, "
             f"threads {torch.get_num_threads()} (interop {torch.get_num_interop_threads()}), "
             f"{ncpu} CPUs available")
    out.note(f"cpu: {model} [{' '.join(isa) or 'no AVX2'}]")
    out.note(f"torch config: {'; '.join(blas_lines) or 'no BLAS lines'}")
    out.note(f"BLAS library loaded: {', '.join(blas_loaded) or 'none found in /proc/self/maps'}; "
             f"oneDNN (mkldnn) available: {torch.backends.mkldnn.is_available()}")
    reference_blas = any("/blas/" in p for p in blas_loaded) and not any("openblas" in p for p in blas_loaded)
    out.note("note: f32 matmul goes through the BLAS above "
             + ("(Debian's reference BLAS: expect ~4 GFLOP/s, f32 is NOT an optimized baseline); "
                if reference_blas else "")
             + "bf16 goes through oneDNN and is the honest baseline")
    if probe is not None:
        out.note(f"f32 GEMM probe 512x512x512: {probe:.1f} GFLOP/s")
        context["f32_gemm_probe_gflops"] = round(probe, 2)
    context["blas"] = blas_loaded
    out.note(f"shape: d_model {args.d_model}, d_ff {args.d_ff}, experts {args.experts}, "
             f"top_k {args.top_k}; routing {args.routing}; tokens {','.join(map(str, args.tokens))}; "
             f"warmup {args.warmup}, repeat {args.repeat}, seed {args.seed}, "
             f"budget {args.max_seconds:g} s per configuration")

    block_cls = define_modules(torch)
    torch_dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    for dname in args.dtypes:
        dtype = torch_dtypes[dname]
        bpw = DTYPE_BYTES[dname]
        layer_bytes = (args.experts * 3 * args.d_model * args.d_ff + args.experts * args.d_model) * bpw
        need = layer_bytes + args.d_model * args.d_ff * 4  # + one f32 matrix while initialising
        avail = mem_available_bytes()
        if avail is not None and need > 0.9 * avail:
            print(f"bench_torch: {dname} layer needs {need / 1e9:.2f} GB but only "
                  f"{avail / 1e9:.2f} GB is available", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        block = build_block(torch, block_cls, args, dtype)
        out.note(f"{dname}: built layer ({layer_bytes / 1e9:.2f} GB of weights) in "
                 f"{time.perf_counter() - t0:.1f} s; peak RSS so far {peak_rss_gb():.2f} GB")
        try:
            with torch.inference_mode():
                for T in args.tokens:
                    run_config(torch, block, args, dname, dtype, T, out, context)
        finally:
            del block
            gc.collect()
    out.note(f"peak RSS {peak_rss_gb():.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
