"""A cell's GPUs and its SGLang server's layout flags."""

import pytest

from gyre.runtime.gpu_cells import GpuCellLayout, sglang_cell_argv


def test_a_cell_inside_one_node_launches_one_server_from_its_leader():
    layout = GpuCellLayout(num_cells=2, per_cell=4, gpus_per_node=8)
    assert layout.problems(8) == []
    assert [s for s in range(4) if layout.launches_server(s)] == [0]
    # the second cell's leader is rank 4, on GPUs 4..7 of the node
    assert sglang_cell_argv(layout, 0, 4, leader_host="n0", dist_port=1) == [
        "--tp-size", "4", "--base-gpu-id", "4", "--enable-memory-saver"]
    with pytest.raises(ValueError, match="launches no SGLang process"):
        sglang_cell_argv(layout, 1, 5, leader_host="n0", dist_port=1)


def test_a_cell_of_four_nodes_launches_one_server_process_per_node():
    layout = GpuCellLayout(num_cells=8, per_cell=32, gpus_per_node=8)
    assert layout.problems(256) == [] and layout.nodes_per_cell == 4
    assert [s for s in range(32) if layout.launches_server(s)] == [0, 8, 16, 24]
    assert sglang_cell_argv(layout, 16, 0, leader_host="10.0.0.5", dist_port=5000) == [
        "--tp-size", "32", "--base-gpu-id", "0", "--enable-memory-saver",
        "--nnodes", "4", "--node-rank", "2", "--dist-init-addr", "10.0.0.5:5000"]
    assert sglang_cell_argv(layout, 0, 0, leader_host="fd00::1", dist_port=5000)[-1] == "[fd00::1]:5000"


def test_layouts_that_cannot_run():
    assert GpuCellLayout(3, 4, 6).problems(12) == [
        "a cell of TP x PP = 4 GPUs neither fits in a node of 6 nor is made of whole nodes"]
    assert GpuCellLayout(2, 4, 8).problems(16) == ["WORLD_SIZE=16 must be --num-cells x TP x PP = 2 x 4"]
    assert GpuCellLayout(3, 1, 2).problems(3) == ["WORLD_SIZE=3 is not a whole number of nodes of 2 GPUs"]
