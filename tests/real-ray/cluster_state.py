"""Prints what a Ray cluster's GCS says about its nodes, as one JSON line.

    python cluster_state.py 127.0.0.3:6391 [timeout_seconds]

Asks the GCS directly (ray._raylet.GcsClient: GetAllNodeInfo and
GetAllResourceUsage), without `ray status` (which reads the autoscaler's
last report, a few seconds old, and keeps listing dead nodes as "Active")
or the dashboard (which `ray list nodes` needs and
`--include-dashboard=false` leaves out). It does not join the
cluster as a driver. Output:

    {"alive": 2, "dead": 0,
     "total": {"CPU": 2.0, "neuron_cores": 2.0, ...},
     "available": {"CPU": 2.0, "neuron_cores": 0.0, ...},
     "nodes": [{"ip": "127.0.0.3", "state": "ALIVE", "total": {...},
                "available": {...}}, ...]}

"available" is summed over the alive nodes; a resource that is all in use
is 0.0 (the GCS's usage report leaves it out). Exit status 0; 1 with a message
on stderr (after Ray's own warnings) when the GCS does not answer: with the
default timeout of 3 s that takes about 3 s, where `ray status` takes 41 s.
"""

import json
import os
import sys


def main():
    address = sys.argv[1]
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
    # Without a GCS, making the client waits for two connections
    # (gcs_rpc_server_connect_timeout_s, 5 s each) and then for the cluster
    # id (py_gcs_connect_timeout_s, 30 s): 40 s. Ray's C++ side reads these
    # RAY_* variables when it first needs its config, after the import.
    step = str(max(1, round(timeout / 3)))
    os.environ.setdefault("RAY_gcs_rpc_server_connect_timeout_s", step)
    os.environ.setdefault("RAY_py_gcs_connect_timeout_s", step)
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    try:
        client = GcsClient(address=address)
        infos = client.get_all_node_info(timeout=timeout)
        usage = client.get_all_resource_usage(timeout=timeout)
    except Exception as e:  # RpcError, ConnectionError, TimeoutError
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    available_by_node = {
        b.node_id: dict(b.resources_available)
        for b in usage.resource_usage_data.batch
    }
    nodes, total, available = [], {}, {}
    for info in infos.values():
        state = GcsNodeInfo.GcsNodeState.Name(info.state)
        node = {
            "ip": info.node_manager_address,
            "state": state,
            "total": dict(info.resources_total),
            # The GCS leaves out a resource none of which is free.
            "available": {
                k: available_by_node.get(info.node_id, {}).get(k, 0.0)
                for k in info.resources_total
            },
        }
        nodes.append(node)
        if state == "ALIVE":
            for k, v in node["total"].items():
                total[k] = total.get(k, 0.0) + v
            for k, v in node["available"].items():
                available[k] = available.get(k, 0.0) + v
    alive = sum(n["state"] == "ALIVE" for n in nodes)
    print(json.dumps(sort_keys=True, obj={
        "alive": alive,
        "dead": len(nodes) - alive,
        "total": total,
        "available": available,
        "nodes": sorted(nodes, key=lambda n: (n["state"], n["ip"])),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
