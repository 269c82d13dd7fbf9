"""A two-node Ray cluster on this machine, on loopback only (run by test_ray_cluster.py).

`python -m tests.megatron.two_node_ray HEAD_PORT` starts a head node (1 CPU, resource
`node_a`) and a worker node (1 CPU, resource `node_b`) with Ray's own multi-node test utility,
prints `{"address": ...}`, then answers each stdin line `actors` with the actor table (class,
node, state) as one JSON line, and shuts the cluster down at end of input.

Loopback only: Ray rewrites `--node-ip-address 127.0.0.1` to the machine's outward address
unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, in which case it uses 127.0.0.1 and its gRPC
servers listen on 127.0.0.1 only. That switch also makes `ray start --address` refuse to add a
node, which the cluster utility (it starts nodes in-process) does not check. The caller sets the
switch, a shared RAY_AUTH_TOKEN and a private RAY_TMPDIR in this process's environment.
"""

from __future__ import annotations

import json
import os
import sys


def main(head_port: int) -> None:
    # RAY_TMPDIR (set by the caller) keeps the session and the "current cluster" file private,
    # so no other ray.init() on this machine attaches to this cluster.
    os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"), exist_ok=True)
    from ray.cluster_utils import Cluster

    common = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **common,
            "resources": {"node_a": 1},
            "gcs_server_port": head_port,
        },
    )
    cluster.add_node(**common, resources={"node_b": 1})
    nodes = {n["NodeID"]: n for n in cluster.global_state.node_table()}
    print(json.dumps({"address": cluster.address, "nodes": list(nodes)}), flush=True)
    try:
        for line in sys.stdin:
            if line.strip() == "actors":
                table = cluster.global_state.actor_table(None)
                actors = [
                    {
                        "class": a["ActorClassName"],
                        "node": a["Address"]["NodeID"],
                        "state": a["State"],
                    }
                    for a in table.values()
                ]
                print(json.dumps(actors), flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
