#!/usr/bin/env bash
# The Helm chart without Helm (none is packaged for Debian 12):
#  1. renders it with deploy/helm/render (Go text/template + Sprig, the
#     engine Helm uses) for the default values and for the per-socket
#     multi-shard example, and validates every object against the Kubernetes
#     schemas (npm kubernetes-models, installed by scripts/install-deps.sh);
#  2. lint: NOTES.txt renders; missing or contradictory values fail with a
#     clear message; the rendered objects say what the layout needs (integer
#     CPUs, gRPC probes, IPC_LOCK, anti-affinity, PDBs, huge pages, NUMA);
#  3. runs each layout on loopback with the rendered flags (only addresses,
#     paths and thread counts replaced): real colibri-expert processes for
#     every pod and a colibri-router reading the rendered cluster file — the
#     router first sees one shard, then the file grows and it discovers the
#     rest without a restart and serves.
# Skips (77) only when go, node or the validators are missing.
# Usage: helm_chart.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
chart=$src/deploy/helm/colibri
modules=${COLIBRI_NODE_TOOLS:-/opt/colibri-tools}/node_modules
py=/usr/bin/python3
for need in go node; do
  command -v $need >/dev/null || { echo "SKIP: $need is not installed (scripts/install-deps.sh installs it)"; exit 77; }
done
[ -f "$modules/kubernetes-models/package.json" ] ||
  { echo "SKIP: no kubernetes-models in $modules (scripts/install-deps.sh installs it)"; exit 77; }
source "$src/scripts/process_lib.sh"
proc_init
tmp=$proc_logs
fail() { echo "FAIL: $*"; exit 1; }

echo "--- build the renderer (offline, GOPATH mode, Debian's Sprig and YAML sources)"
gopath=$build/helm-render
mkdir -p "$gopath/src/colibri"
ln -sfn "$src/deploy/helm/render" "$gopath/src/colibri/helmrender"
(cd "$gopath/src/colibri/helmrender" && GO111MODULE=off GOPATH=$gopath:/usr/share/gocode GOFLAGS= GOPROXY=off \
  GOCACHE=$gopath/cache nice -n 10 go build -o "$gopath/render" .)
render() { "$gopath/render" -chart "$chart" "$@"; }

echo "--- render and validate against the Kubernetes schemas"
# The defaults need TLS secrets (secure by default): the "default" layout is
# the defaults with both plaintext opt-outs; the per-socket example has TLS.
printf 'tls: {clients: {plaintext: true}, nodes: {plaintext: true}}\n' > "$tmp/plaintext.yaml"
render -f "$tmp/plaintext.yaml" > "$tmp/default.yaml"
render -f "$src/deploy/helm/examples/values-per-socket.yaml" > "$tmp/socket.yaml"
node "$src/deploy/helm/validate/k8s_validate.mjs" "$modules" "$tmp/default.yaml" "$tmp/socket.yaml" | tail -1
node "$src/deploy/helm/validate/k8s_validate.mjs" "$modules" "$tmp/default.yaml" "$tmp/socket.yaml" >/dev/null ||
  { node "$src/deploy/helm/validate/k8s_validate.mjs" "$modules" "$tmp/default.yaml" "$tmp/socket.yaml" | grep FAIL; fail "schema validation"; }

echo "--- lint"
render -notes -f "$tmp/plaintext.yaml" > "$tmp/notes.txt"
grep -q "port-forward svc/colibri-router 50051" "$tmp/notes.txt" || fail "NOTES.txt does not say how to call the router"
grep -q "WARNING: TLS is off" "$tmp/notes.txt" || fail "NOTES.txt does not warn about the plaintext opt-outs"
expect_fail() {  # needle values-yaml
  printf '%s\n' "$2" > "$tmp/bad.yaml"
  if render -f "${3:-$tmp/plaintext.yaml}" -f "$tmp/bad.yaml" > /dev/null 2> "$tmp/err"; then
    fail "rendered despite: $2"
  fi
  grep -qF -- "$1" "$tmp/err" || fail "for '$2' expected '$1', got: $(cat "$tmp/err")"
  echo "ok: refused ($1)"
}
printf '{}\n' > "$tmp/empty.yaml"
expect_fail "TLS between the router and the expert nodes is required" '{}' "$tmp/empty.yaml"
expect_fail "TLS for the router's clients is required" 'tls: {nodes: {secretName: n}}' "$tmp/empty.yaml"
expect_fail "model.pvc or model.hostPath is required" 'model: {hostPath: ""}'
expect_fail "give either pvc or hostPath, not both" 'model: {pvc: claim}'
printf 'model: {pvc: claim, hostPath: ""}\n' > "$tmp/pvc.yaml"  # deploy/README.md's install: --set model.hostPath=
render -f "$tmp/plaintext.yaml" -f "$tmp/pvc.yaml" > /dev/null || fail "a pvc with hostPath emptied does not render"
echo "ok: a pvc in place of the default hostPath renders"
expect_fail "is more than model.nExperts" 'experts: {shards: 9}'
expect_fail "one --experts spec per shard" 'experts: {assignment: explicit, shardExperts: ["0-3"]}'
expect_fail "must be even or explicit" 'experts: {assignment: random}'
expect_fail "whole number of CPUs" 'experts: {cpus: 2.5}'
expect_fail "replicasPerShard must be at least 1" 'experts: {replicasPerShard: 0}'
expect_fail "experts.hugepages.size must be 2Mi" 'experts: {hugepages: {enabled: true, size: 1Gi}}'
$py - "$tmp/default.yaml" "$tmp/socket.yaml" <<'PY'
import sys, yaml
for path, shards, replicas in ((sys.argv[1], 2, 2), (sys.argv[2], 4, 2)):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    sts = [d for d in docs if d["kind"] == "StatefulSet"]
    assert len(sts) == shards, (path, len(sts))
    socket = "socket" in path
    specs = []
    for s in sts:
        pod = s["spec"]["template"]["spec"]
        c = pod["containers"][0]
        r = c["resources"]
        assert r["requests"] == r["limits"], "Guaranteed QoS needs requests == limits"
        assert isinstance(r["requests"]["cpu"], int), "integer CPUs"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if socket:  # TLS on: the kubelet's gRPC probe cannot connect; colibri-health can
                command = c[probe]["exec"]["command"][-1]
                assert "colibri-health" in command and "--tls_ca=" in command and "--tls_cert=" in command, command
            else:
                assert "grpc" in c[probe], probe
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        # The default seccomp profile allows mbind/set_mempolicy only with SYS_NICE.
        assert ("SYS_NICE" in c["securityContext"]["capabilities"]["add"]) == socket
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert anti["labelSelector"]["matchLabels"]["colibri.dev/shard"] == s["metadata"]["labels"]["colibri.dev/shard"]
        assert s["spec"]["replicas"] == replicas
        assert ("--numa_node_auto" in c["args"]) == socket
        assert (r["limits"].get("hugepages-2Mi") == "24Gi") == socket
        specs += [a.split("=", 1)[1] for a in c["args"] if a.startswith("--experts=")]
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget" and "expert" in d["metadata"]["name"]]
    assert len(pdbs) == shards and all(p["spec"].get("maxUnavailable") == 1 for p in pdbs)
    print(f"ok: {path.rsplit('/', 1)[1]}: {shards} shards ({', '.join(specs)}), requests == limits, integer CPUs, "
          f"{'colibri-health' if socket else 'gRPC'} probes, IPC_LOCK, anti-affinity per shard, PDBs"
          f"{', NUMA auto, huge pages' if socket else ''}")
PY
# A pinned kernel profile: one ConfigMap, mounted read-only where COLIBRI_KERNEL_PROFILE points;
# without one, an emptyDir there (each pod measures its own, once).
printf 'experts:\n  kernelProfile: |\n    isa avx2\n    bf16_widen 0\n' > "$tmp/pinned.yaml"
render -f "$tmp/plaintext.yaml" -f "$tmp/pinned.yaml" > "$tmp/pinned_render.yaml"
node "$src/deploy/helm/validate/k8s_validate.mjs" "$modules" "$tmp/pinned_render.yaml" >/dev/null || fail "schema validation with a pinned kernel profile"
$py - "$tmp/pinned_render.yaml" "$tmp/default.yaml" <<'PY' || fail "the kernel profile's ConfigMap, volume or environment is wrong"
import sys, yaml
for path, pinned in ((sys.argv[1], True), (sys.argv[2], False)):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-kernel-profile")]
    assert len(maps) == (1 if pinned else 0), (path, len(maps))
    if pinned:
        assert maps[0]["data"]["kernels.txt"] == "isa avx2\nbf16_widen 0\n", maps[0]["data"]
    for s in (d for d in docs if d["kind"] == "StatefulSet"):
        pod = s["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert {"name": "COLIBRI_KERNEL_PROFILE", "value": "/var/cache/colibri/kernels.txt"} in c["env"], c.get("env")
        mount = [m for m in c["volumeMounts"] if m["name"] == "kernel-profile"][0]
        assert mount["mountPath"] == "/var/cache/colibri" and mount["readOnly"] == pinned, mount
        volume = [v for v in pod["volumes"] if v["name"] == "kernel-profile"][0]
        assert ("configMap" in volume) == pinned and ("emptyDir" in volume) == (not pinned), volume
print("ok: kernel profile: emptyDir by default, a read-only ConfigMap when pinned")
PY
render -f "$tmp/plaintext.yaml" -f <(printf 'experts: {replicasPerShard: 1}\n') | grep -q "minAvailable: 1" || fail "a single replica's PDB must keep it"
render -f "$tmp/plaintext.yaml" -f <(printf 'tls: {clients: {secretName: c, mutual: true}}\n') > "$tmp/client_tls.yaml"
$py - "$tmp/client_tls.yaml" <<'PY' || fail "with client TLS the router's readiness probe must be colibri-health with its certificate"
import sys, yaml
router = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "Deployment")
command = router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"][-1]
assert "colibri-health" in command and "--tls_ca=/etc/colibri/tls-clients/ca.crt" in command, command
assert "--tls_cert=/etc/colibri/tls-clients/tls.crt" in command, command
PY
echo "ok: with client TLS the router's readiness probe is colibri-health over (mutual) TLS"
echo "ok: a shard with one replica gets minAvailable: 1"

echo "--- the rendered flags on loopback: nodes, router, discovery through the cluster file"
"$build/tools/colibri-synth" --out "$tmp/ckpt" --d_model 64 --d_ff 96 --layers 2 --experts 8 --vocab 50 >/dev/null
"$build/tools/colibri-convert" --checkpoint "$tmp/ckpt" --out "$tmp/models/model" --weight_type int8 --progress=false >/dev/null
bash "$src/scripts/make_test_certs.sh" "$tmp/raw" >/dev/null
mkdir -p "$tmp/certs/node" "$tmp/certs/router"
cp "$tmp/raw/server.crt" "$tmp/certs/node/tls.crt"; cp "$tmp/raw/server.key" "$tmp/certs/node/tls.key"
cp "$tmp/raw/client.crt" "$tmp/certs/router/tls.crt"; cp "$tmp/raw/client.key" "$tmp/certs/router/tls.key"
cp "$tmp/raw/ca.crt" "$tmp/certs/node/ca.crt"; cp "$tmp/raw/ca.crt" "$tmp/certs/router/ca.crt"
for layout in default socket; do
  run=$tmp/run_$layout
  mkdir -p "$run"
  manifests=$tmp/$layout.yaml
  if [ "$layout" = socket ]; then  # the local clients (router_client.py, the decode example) speak plaintext
    render -f "$src/deploy/helm/examples/values-per-socket.yaml" \
      -f <(printf 'tls: {clients: {secretName: "", plaintext: true}}\n') > "$tmp/socket_local.yaml"
    manifests=$tmp/socket_local.yaml
  fi
  $py "$src/deploy/helm/validate/local_args.py" "$manifests" "$tmp/models/model" "$tmp/certs" "$run"
  : > "$run/all.txt"
  i=0
  while read -r name args; do
    # shellcheck disable=SC2086
    proc_start "${layout}_node_$i" "$build/expert_node/colibri-expert" $args
    echo "$name 127.0.0.1:$port" >> "$run/all.txt"
    i=$((i + 1))
  done < "$run/nodes.txt"
  if [ -s "$run/probe.txt" ]; then  # TLS on: the rendered probe command against the first pod
    first_port=$(head -1 "$run/all.txt" | cut -d' ' -f2 | cut -d: -f2)
    PATH=$build/tools:$PATH sh -c "$(sed "s/PORT/$first_port/" "$run/probe.txt")" >/dev/null ||
      fail "$layout: the rendered TLS probe did not pass against a TLS node"
    echo "ok: $layout: the rendered probe (colibri-health over mutual TLS) passes against the node"
  fi
  first_shard=$(head -1 "$run/all.txt" | cut -d' ' -f1 | cut -d. -f2)
  grep "\.$first_shard\." "$run/all.txt" | cut -d' ' -f2 > "$run/experts.txt"
  # The test certificates name localhost, not the pods' DNS names (where the chart runs TLS to the nodes).
  server_name=()
  grep -q -- "--node_tls_ca=" "$run/router.txt" && server_name=(--node_tls_server_name=localhost)
  # shellcheck disable=SC2046
  proc_start "${layout}_router" "$build/router_node/colibri-router" $(cat "$run/router.txt") --listen=127.0.0.1:0 \
    --health_interval_ms=200 "${server_name[@]}"
  router=127.0.0.1:$port
  # (grep reads a file, not a pipe: grep -q closing a pipe early fails the writer under pipefail)
  serving() { $py "$src/scripts/router_client.py" --router "$router" status > "$run/status.json" 2>&1 || true
              grep -q '"serving": true' "$run/status.json"; }
  serving && fail "$layout: serving with one shard of $i pods"
  echo "ok: $layout: with only $first_shard in the cluster file the router does not serve"
  sleep 1.1  # a new mtime even on coarse-grained file systems
  cut -d' ' -f2 "$run/all.txt" > "$run/experts.txt.new" && mv "$run/experts.txt.new" "$run/experts.txt"
  for _ in $(seq 1 100); do serving && break; sleep 0.1; done
  serving || { cat "$run/status.json"; fail "$layout: the router did not discover every shard"; }
  "$build/clients/cpp/colibri-decode-example" --router "$router" --steps 2 >/dev/null ||
    fail "$layout: the decode example failed against the discovered cluster"
  echo "ok: $layout: $i expert pods discovered from the grown cluster file; the router serves (decode example ran)"
  proc_stop_all > "$run/stopped"
  grep -v "exit status 0" "$run/stopped" && fail "a process did not exit 0"
  echo "ok: $layout: $(wc -l < "$run/stopped") processes stopped, each with exit status 0"
done
echo "PASS"
