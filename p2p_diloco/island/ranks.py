"""An island of many processes (docs/DESIGN.md, "Islands of many ranks"): N ranks launched by
``torchrun`` train one model replica together over torch.distributed (DDP, or FSDP2's
``fully_shard``), and only rank 0, the *leader*, joins the swarm.

The leader runs the island as a single-process island does (DHT, syncer, reporter, checkpoints);
the other ranks, the *followers*, run :meth:`~p2p_diloco.island.learner.Learner.follow`: they do what
the leader's learner thread tells them, one small command at a time, broadcast over the process
group at the leader's step boundaries: train an inner step, land an outer update (whose tensors the
leader broadcasts), load downloaded global parameters, take part in a collective read (FSDP's
snapshots and evaluations), restore a checkpoint, stop. So every rank lands every update at the
same inner step, the ranks of a DDP island hold bit-identical parameters (checked after every
update, :meth:`IslandRanks.agree`), and followers never touch the network beyond their group.

A rank that dies makes the next collective of the others fail (gloo and NCCL see the closed
connection; a stalled rank, after :data:`RANK_TIMEOUT`): they end with :class:`RankLost`, a
non-zero exit, after the leader's normal teardown (DHT, averagers, final checkpoint).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Optional, Sequence

import torch

from p2p_diloco.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

# seconds a collective waits for a stalled rank: the followers wait this long for the leader's next
# command while it works alone (its start, tokenizing raw text, downloads of --join-timeout, a DDP
# evaluation); a dead rank is seen at once (its connections close)
RANK_TIMEOUT = 3600.0


class RankLost(UserError):
    """Another rank of this island died, stalled past :data:`RANK_TIMEOUT`, or diverged: the island
    ends (a launcher such as ``torchrun --max-restarts`` may start it again, from its checkpoint)."""

    exit_code = 1


def launched_ranks() -> int:
    """The island's number of ranks as ``torchrun`` set it in the environment (``WORLD_SIZE``; 1
    outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (modulo the GPUs present: ranks may share one) on CUDA."""
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local % max(1, torch.cuda.device_count()))


class IslandRanks:
    """The process group of one multi-rank island, and the leader's commands to its followers.

    Every method is collective (each rank calls it, in the same order) except :meth:`command`
    (leader) and :meth:`receive` (followers), which pair up. Collectives run on the learner thread
    only.

    :param parallel: ``ddp`` (every rank holds the whole model; reads are local to the leader) or
        ``fsdp`` (parameters, gradients and optimizer state sharded with FSDP2's ``fully_shard``;
        reading whole parameters is collective)
    :param device: this rank's device (the model's)
    :raises RankLost: from any collective, when another rank is gone
    """

    def __init__(self, parallel: str, device: torch.device, timeout: float = RANK_TIMEOUT):
        import torch.distributed as dist

        self.dist, self.parallel, self.device = dist, parallel, device
        # NCCL cannot put two ranks on one GPU: ranks that share one talk over gloo
        shared = device.type == "cuda" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.backend = "nccl" if device.type == "cuda" and not shared else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            # torchrun keeps one store across its restarts: keys of this attempt's own, so a restarted
            # island's ranks never read the addresses of the ranks that died
            store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
            store = dist.PrefixStore(f"p2p_diloco/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        except (RuntimeError, ValueError) as e:
            raise RankLost(f"the island's ranks could not form a process group ({e})") from None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._comm = "cpu" if self.backend == "gloo" else device  # where broadcast buffers live
        self._released = False
        self.midway: Optional[str] = None  # the leader's command whose collectives are under way
        logger.info("rank %d of %d (%s over %s, device %s)", self.rank, self.world, parallel, self.backend, device)

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that joins the swarm."""
        return self.rank == 0

    @property
    def collective_reads(self) -> bool:
        """Whether reading whole parameters or running a forward pass needs every rank (FSDP)."""
        return self.parallel == "fsdp"

    # ------------------------------------------------------------------ model

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make ``model`` data-parallel over the ranks; returns the module to run forward passes
        through. DDP wraps it (the parameters stay ``model``'s); FSDP shards ``model`` in place (its
        parameters become DTensors of the same names and global shapes)."""
        with self.collective("wrapping the model"):
            if self.parallel == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                ids = [self.device.index] if self.device.type == "cuda" else None
                # no buffer broadcast: the leader's evaluations run outside the wrapper, alone
                return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=init_device_mesh(self.device.type, (self.world,)))
            return model

    # ------------------------------------------------------------------ commands

    def command(self, kind: str, *args) -> None:
        """Leader: tell the followers what to do next (a tuple of small picklable values)."""
        self.broadcast_object((kind, *args))

    @contextlib.contextmanager
    def order(self, doing: str, kind: str, *args, send: bool = True):
        """Context for one command and its collectives, on every rank: the leader first sends
        ``(kind, *args)`` (when ``send``), then every rank runs the body, the command's collectives,
        whose process-group errors become :class:`RankLost` naming ``doing``. Until the body ends,
        the leader's followers are midway (:meth:`release` then only leaves them)."""
        sent = self.leader and send
        if sent:
            self.command(kind, *args)
            self.midway = kind
        with self.collective(doing):
            yield
        if sent:
            self.midway = None

    def receive(self) -> tuple:
        """Follower: the leader's next command."""
        return self.broadcast_object(None)

    def broadcast_object(self, value):
        """The leader's ``value`` on every rank (pickled)."""
        box = [value]
        with self.collective("broadcasting a command"):
            self.dist.broadcast_object_list(box, src=0, device=torch.device(self._comm))
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        with self.collective("waiting for the other ranks"):
            self.dist.barrier()

    # ------------------------------------------------------------------ tensors

    @torch.no_grad()
    def broadcast(self, tensors: Optional[Sequence[torch.Tensor]], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """The leader's fp32 ``tensors`` on every rank (followers pass None), as fp32 tensors of
        ``shapes`` on the communication device (the CPU for gloo)."""
        out = []
        with self.collective("broadcasting an update"):
            for i, shape in enumerate(shapes):
                if self.leader:
                    buffer = tensors[i].to(self._comm, torch.float32).contiguous()
                else:
                    buffer = torch.empty(shape, dtype=torch.float32, device=self._comm)
                self.dist.broadcast(buffer, src=0)
                out.append(buffer)
        return out

    def local(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """``full`` (a whole tensor, the same on every rank) in the layout of ``param``: itself for
        DDP, this rank's shard (a DTensor like ``param``, cut without communication) for FSDP."""
        if self.parallel == "ddp":
            return full
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)

    @torch.no_grad()
    def whole(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 CPU copies of whole parameters: the leader's own for DDP; gathered (collective) for FSDP."""
        if self.parallel == "ddp":
            return [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        with self.collective("gathering parameters"):
            return [p.full_tensor().to("cpu", torch.float32, copy=True) for p in params]

    def totals(self, loss: torch.Tensor, tokens: int) -> tuple[float, int]:
        """(mean loss over the ranks, tokens summed over the ranks) of one inner step."""
        values = torch.tensor([float(loss), float(tokens)], dtype=torch.float64, device=self._comm)
        with self.collective("summing the step's tokens"):
            self.dist.all_reduce(values)
        return float(values[0]) / self.world, int(values[1])

    @torch.no_grad()
    def agree(self, params: Sequence[torch.Tensor]) -> int:
        """Check that every rank holds the same ``params`` (DDP, after an outer update); returns the
        checksum: the sum of the parameters' bits read as integers (exact, so equal tensors give
        equal sums on every rank). FSDP's ranks hold disjoint shards, so it is not called for them.

        :raises RankLost: when a rank's checksum differs from the leader's
        """
        total = 0
        for p in params:
            p = p.detach()
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]
            total += int(p.contiguous().view(bits).to(torch.int64).sum())
        sums = [None] * self.world
        with self.collective("comparing parameters"):
            self.dist.all_gather_object(sums, total)
        differing = [rank for rank, value in enumerate(sums) if value != sums[0]]
        if differing:
            raise RankLost(f"ranks {differing} of this island hold other parameters than rank 0 after an outer "
                           "update: the ranks diverged")
        return total

    # ------------------------------------------------------------------ end

    def release(self) -> None:
        """Leader: tell the followers to stop (once), then leave the group. When they are inside a
        command (the leader failed midway), it only leaves: their collective then fails and they end
        with an error, as they must, instead of reading "stop" as that command's data.

        :raises RankLost: when a follower is gone
        """
        if not self._released and self.leader:
            self._released = True
            if self.midway is None:
                self.command("stop")
            else:
                logger.warning("leaving the island's other ranks inside the command %r: they end with it", self.midway)
        self.close()

    def close(self) -> None:
        """Leave the process group (idempotent)."""
        if self.dist.is_initialized():
            with contextlib.suppress(Exception):
                self.dist.destroy_process_group()

    @contextlib.contextmanager
    def collective(self, what: str):
        """Context: a ``RuntimeError`` or ``ConnectionError`` from torch.distributed inside (a collective,
        or DDP's gradient all-reduce in ``backward()``) becomes :class:`RankLost` naming ``what``."""
        try:
            yield
        except (RuntimeError, ConnectionError) as e:  # (torch's DistBackendError is a RuntimeError)
            if not _group_error(e):
                raise  # this rank's own failure (out of memory, a model's bug): not another rank's
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RankLost(f"rank {self.rank} of this island lost its group while {what}: another rank died or "
                           f"stalled ({first[:200]})") from None


def _group_error(e: BaseException) -> bool:
    """Whether ``e`` is the process group's failure (a peer rank gone or stalled), as torch.distributed,
    gloo and NCCL raise it."""
    import torch.distributed as dist

    if isinstance(e, ConnectionError) or isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return any(mark in text for mark in ("gloo", "Gloo", "NCCL", "nccl", "Connection", "ProcessGroup", "timed out"))


def start_ranks(parallel: str, device: torch.device, expected: int, leader_work: float = 0.0) -> Optional[IslandRanks]:
    """The island's process group when ``torchrun`` started it as one of several ranks, else None.

    :param expected: ``--nproc-per-node`` (1: any); torchrun's local world size must match it
    :param leader_work: seconds the leader may work alone between two commands (``--join-timeout``):
        the group's timeout is :data:`RANK_TIMEOUT` or this plus 10 minutes, the longer
    :raises ConfigError: a mismatch between ``--nproc-per-node`` and torchrun's
    """
    if launched_ranks() <= 1:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if expected > 1 and local and local != expected:
        raise ConfigError(f"--nproc-per-node {expected} but torchrun started {local} ranks on this machine: "
                          "give one of them")
    return IslandRanks(parallel, rank_device(device), timeout=max(RANK_TIMEOUT, leader_work + 600.0))


def torchrun_argv(nproc: int, argv: Sequence[str], max_restarts: int = 0, module: str = "p2p_diloco") -> list[str]:
    """The command line that makes ``p2p-diloco peer --nproc-per-node N ...`` one island of N ranks on
    this machine: ``torchrun --standalone --nproc-per-node N --max-restarts R -m MODULE ...`` with
    the same flags (``module``: the entry point that was called, the product's or the lab's)."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), "-m", module, *argv]

