"""Placement on a two-node Ray cluster (two raylets on this host, each declaring a custom resource
the sidecars' bundles ask for): SPREAD puts one sidecar on each node, PACK both on one, and a
push reaches every sidecar wherever it runs."""

import copy

import pytest
import torch

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from rollout.ray_launcher import RaySidecars  # noqa: E402
from tests.ray_cluster.test_ray_sidecars import SERVE_ARGS  # noqa: E402
from weight_sync import weights_checksum  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"rollout_host": 3},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=4, resources={"rollout_host": 3})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_spread_puts_one_sidecar_on_each_node_and_pack_both_on_one(two_nodes, qwen2_dir, hf_models):
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    kw = {"placement": None, "resources_per_sidecar": {"rollout_host": 1}, "max_restarts": 0}
    spread = RaySidecars(qwen2_dir, 2, SERVE_ARGS, **{**kw, "placement": "spread"})
    pack = RaySidecars(qwen2_dir, 2, SERVE_ARGS, **{**kw, "placement": "pack"}, token=spread.token)
    try:
        assert {i["node_id"] for i in spread.infos} == nodes
        assert len({i["node_id"] for i in pack.infos}) == 1
        trainer = copy.deepcopy(hf_models["qwen2"])
        with torch.no_grad():
            trainer.lm_head.weight.mul_(1.5)
        client = spread.client()  # one trainer, the four sidecars
        try:
            for url in pack.urls:
                client.add_sidecar(url)
            client.init_weight_sync()
            client.push_weights(trainer, version=1)
            assert client.weights_checksums() == [weights_checksum(trainer.named_parameters())] * 4
        finally:
            client.close()
    finally:
        pack.shutdown()
        spread.shutdown()
