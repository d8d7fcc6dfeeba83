#!/usr/bin/python3
"""Turns the rendered chart into a local loopback run with the same flags.

  local_args.py MANIFESTS.yaml MODEL_DIR CERTS_DIR OUT_DIR

Writes OUT_DIR/nodes.txt — one line per expert pod, in the order of the
router's cluster file: "<dns name> <args...>" — OUT_DIR/router.txt with
the router's args, and OUT_DIR/probe.txt with the first pod's readiness probe
when it is a command (TLS on): TLS files mapped like the args, the server name
"localhost" (the test certificates'), the port left as PORT. Each pod's args are the rendered ones, with only what
cannot hold on one machine replaced: the model paths point at MODEL_DIR,
--listen and --admin_listen at 127.0.0.1:0, metrics at port 0, --threads at 1, the cluster file,
the verified-files cache and TLS files at local ones (CERTS_DIR/{node,router}/{tls.crt,tls.key,ca.crt}).
Every other flag (experts, residency, huge pages, --numa_node_auto, timeouts,
TLS on/off, drain) is kept as rendered.
"""
import sys

import yaml

manifests, model, certs, out = sys.argv[1:5]
docs = [d for d in yaml.safe_load_all(open(manifests)) if d]


def local(args, role):
    result = []
    for a in args:
        flag, _, value = a.partition("=")
        if flag == "--model":
            a = f"--model={model}"
        elif flag == "--model_root":
            a = f"--model_root={model}/.."
        elif flag in ("--listen", "--admin_listen"):
            a = f"{flag}=127.0.0.1:0"
        elif flag == "--metrics_port":
            a = "--metrics_port=0"
        elif flag == "--threads":
            a = "--threads=1"
        elif flag == "--cluster_file":
            a = f"--cluster_file={out}/experts.txt"
        elif flag == "--verify_cache":
            a = f"--verify_cache={out}/verified.txt"
        elif value.startswith("/etc/colibri/tls-"):
            a = f"{flag}={certs}/{role}/{value.rsplit('/', 1)[1]}"
        result.append(a)
    return result


config = next(d for d in docs if d["kind"] == "ConfigMap")
names = config["data"]["experts.txt"].split()
shards = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
with open(f"{out}/nodes.txt", "w") as f:
    for name in names:
        host = name.split(":")[0]
        pod, service = host.split(".")[0], host.split(".")[1]
        sts = shards[service]
        assert pod.rsplit("-", 1)[0] == service, name
        args = local(sts["spec"]["template"]["spec"]["containers"][0]["args"], "node")
        f.write(" ".join([name] + args) + "\n")
router = next(d for d in docs if d["kind"] == "Deployment")
with open(f"{out}/router.txt", "w") as f:
    f.write(" ".join(local(router["spec"]["template"]["spec"]["containers"][0]["args"], "router")) + "\n")
probe = shards[names[0].split(".")[1]]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
with open(f"{out}/probe.txt", "w") as f:
    if "exec" in probe:
        command = probe["exec"]["command"][-1].split()
        mapped = []
        for a in command:
            flag, _, value = a.partition("=")
            if flag == "--target":
                a = "--target=127.0.0.1:PORT"
            elif flag == "--tls_server_name":
                a = "--tls_server_name=localhost"
            elif value.startswith("/etc/colibri/tls-"):
                a = f"{flag}={certs}/node/{value.rsplit('/', 1)[1]}"
            mapped.append(a)
        f.write(" ".join(mapped) + "\n")
print(f"{len(names)} expert pods, {len(shards)} shards")
