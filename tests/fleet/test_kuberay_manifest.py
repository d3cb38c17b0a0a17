"""The KubeRay manifest of docs/fleet.md parses and offers what the fleet needs (it is not applied)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gyre.fleet.slots import SLOT_RESOURCE

MANIFEST = Path(__file__).resolve().parents[2] / "examples" / "kuberay" / "gyre-fleet.yaml"


def resources(start_params: dict) -> dict:
    return json.loads(json.loads(start_params["resources"]))  # KubeRay wants the JSON quoted once more


def test_the_manifest_is_a_raycluster_whose_executors_offer_slots():
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert len(docs) == 1
    rc = docs[0]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    import ray

    assert rc["spec"]["rayVersion"] == ray.__version__  # the pods' Ray is rank 0's
    head = rc["spec"]["headGroupSpec"]
    assert resources(head["rayStartParams"]) == {SLOT_RESOURCE: 0} and head["rayStartParams"]["num-cpus"] == "0"
    (workers,) = rc["spec"]["workerGroupSpecs"]
    assert resources(workers["rayStartParams"]) == {SLOT_RESOURCE: 8} and workers["replicas"] == 3
    (container,) = workers["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert env["GYRE_FLEET_DIR"] in mounts
