"""Where a cell's GPUs are and how its SGLang server spans them (``--backend gpu``).

A cell is ``TP x PP`` contiguous ranks (:mod:`gyre.runtime.cell_group`); torchrun gives each node
``gpus_per_node`` ranks (``LOCAL_WORLD_SIZE``), rank ``r`` on GPU ``LOCAL_RANK = r % gpus_per_node``.
A cell either fits inside one node (``TP x PP`` divides ``gpus_per_node``) or is made of whole
nodes (``gpus_per_node`` divides ``TP x PP``).  Its SGLang server spans all its GPUs with
``--tp-size TP x PP``: inside one node the leader launches it alone (``--base-gpu-id`` = the
leader's local rank); over several nodes the first rank of each of the cell's nodes launches one
SGLang process with SGLang's multi-node flags (``--nnodes``, ``--node-rank``,
``--dist-init-addr`` on the leader's node), and only node rank 0 answers HTTP.

:func:`check_gpu_layout` is what ``pretrain_gyre.py --check-config`` runs for a GPU config; it
needs no GPU (the world and node size come from the environment torchrun sets, or the sbatch
script's dry run).  :func:`sglang_cell_argv` is the pure argv builder the cell's launch uses.
"""

from __future__ import annotations

from dataclasses import dataclass

#: SGLang flags a cell sets itself from its layout; ``--sglang-<flag>`` may not set them.
CELL_MANAGED_SGLANG_FLAGS = ("tp_size", "base_gpu_id", "nnodes", "node_rank", "dist_init_addr",
                             "enable_memory_saver", "dp_size", "pp_size")


@dataclass(frozen=True)
class GpuCellLayout:
    """``num_cells`` cells of ``per_cell`` ranks on nodes of ``gpus_per_node`` GPUs."""

    num_cells: int
    per_cell: int
    gpus_per_node: int

    @property
    def nodes_per_cell(self) -> int:
        return max(1, self.per_cell // self.gpus_per_node)

    def problems(self, world: int) -> list[str]:
        """Why this layout cannot run on ``world`` ranks (empty when it can)."""
        out = []
        if world != self.num_cells * self.per_cell:
            out.append(f"WORLD_SIZE={world} must be --num-cells x TP x PP = {self.num_cells} x {self.per_cell}")
        if world % self.gpus_per_node:
            out.append(f"WORLD_SIZE={world} is not a whole number of nodes of {self.gpus_per_node} GPUs")
        if self.gpus_per_node % self.per_cell and self.per_cell % self.gpus_per_node:
            out.append(f"a cell of TP x PP = {self.per_cell} GPUs neither fits in a node of {self.gpus_per_node} "
                       f"nor is made of whole nodes")
        return out

    def launches_server(self, shard: int) -> bool:
        """Whether the cell's rank ``shard`` launches an SGLang process (the first rank on each of the
        cell's nodes)."""
        return shard % min(self.per_cell, self.gpus_per_node) == 0


def sglang_cell_argv(layout: GpuCellLayout, shard: int, local_rank: int, *, leader_host: str,
                     dist_port: int) -> list[str]:
    """The layout flags of the SGLang process the cell's rank ``shard`` launches (on its node's GPUs
    from ``local_rank``): tensor parallelism over the whole cell, and over several nodes SGLang's
    multi-node flags with the leader's node as rank 0.

    Raises:
        ValueError: this rank launches no SGLang process (:meth:`GpuCellLayout.launches_server`).
    """
    if not layout.launches_server(shard):
        raise ValueError(f"shard {shard} of a cell of {layout.per_cell} GPUs launches no SGLang process")
    argv = ["--tp-size", str(layout.per_cell), "--base-gpu-id", str(local_rank), "--enable-memory-saver"]
    if layout.nodes_per_cell > 1:
        host = f"[{leader_host}]" if ":" in leader_host else leader_host
        argv += ["--nnodes", str(layout.nodes_per_cell), "--node-rank", str(shard // layout.gpus_per_node),
                 "--dist-init-addr", f"{host}:{dist_port}"]
    return argv


def check_gpu_layout(args, world: int, gpus_per_node: int) -> list[str]:
    """Every reason a ``--backend gpu`` configuration cannot run, each one line starting with the
    flag at fault (``argument --flag: ...``); empty when it is consistent.  Needs no GPU."""
    import shlex

    per_cell = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    out = [f"argument --num-cells: {p}" for p in GpuCellLayout(args.num_cells, per_cell, gpus_per_node).problems(world)]
    given = {k[len("sglang_"):]: v for k, v in vars(args).items()
             if k.startswith("sglang_") and v is not None and v is not False and v != ""}
    if args.rollout_engine == "sglang":
        try:
            extra = {t[2:].split("=")[0].replace("-", "_") for t in shlex.split(given.get("extra_args", ""))
                     if t.startswith("--")}
        except ValueError:
            extra = set()
        for name in CELL_MANAGED_SGLANG_FLAGS:
            if name in given or name in extra:
                flag = f"--sglang-{name.replace('_', '-')}" if name in given else "--sglang-extra-args"
                out.append(f"argument {flag}: a cell sets --{name.replace('_', '-')} from its layout "
                           f"(TP x PP = {per_cell} GPUs per SGLang server); remove it")
        if args.distributed_backend == "gloo":
            out.append("argument --distributed-backend: SGLang cells need a GPU per rank (nccl); gloo is for "
                       "embedded engines sharing one GPU")
    else:
        if per_cell > 1:
            out.append("argument --rollout-engine: the embedded engine serves from one GPU; cells of several GPUs "
                       "serve with --rollout-engine sglang")
        for name in sorted(given):
            out.append(f"argument --sglang-{name.replace('_', '-')}: only SGLang cells use it "
                       f"(--rollout-engine sglang)")
    if args.rollout_kv_migration and args.rollout_engine == "sglang":
        out.append("argument --rollout-kv-migration: SGLang cells share KV through --rollout-shared-kv-store "
                   "(the engine-to-engine copy is the embedded engine's)")
    if args.standalone_engines:
        out.append("argument --standalone-engines: the standalone pool runs embedded engines on CPU (--backend cpu)")
    return out


def check_model_for_sglang(args, hf_config) -> list[str]:
    """What SGLang would refuse about a cell's model (its ``config.json`` read here): attention heads
    that do not split over the server's ``TP x PP`` GPUs, and a ``--sglang-context-length`` beyond the
    model's ``max_position_embeddings`` without RoPE scaling."""
    out = []
    per_cell = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    if heads % per_cell:
        out.append(f"argument --tensor-model-parallel-size: a cell's SGLang server runs --tp-size TP x PP = "
                   f"{per_cell}, which does not divide the model's {heads} attention heads")
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {}
    scaled = rope.get("rope_type", rope.get("type", "default")) not in ("default", None)
    context = getattr(args, "sglang_context_length", None)
    if context and limit and context > limit and not scaled:
        out.append(f"argument --sglang-context-length: {context} is beyond the model's max_position_embeddings "
                   f"{limit} (set RoPE scaling in its config.json for longer contexts)")
    return out
