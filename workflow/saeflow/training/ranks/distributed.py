"""torch.distributed for training: which rank this process is, its device and backend, the collectives the parallel
modes use (each counted in bytes), and what a rank does when another one dies.

A process is a rank when a launcher made it one: torchrun (or `saeflow train --gpus N`, which runs torchrun's
launcher: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or srun starting several tasks of one job step (the
rendezvous is taken from Slurm's environment: SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the first host of
SLURM_STEP_NODELIST). Otherwise it is alone: `Comm.alone`, whose collectives are the identity, so one-process
training never touches torch.distributed. nccl on CUDA, gloo on the CPU (every test runs here).

A dead rank. Every rank bumps a counter in the rendezvous store twice a second (`Heartbeat`). When a collective
fails (gloo: the peer's socket closed), `Comm.guard` looks at whose counter stopped, writes that verdict to the store
and raises one line naming that rank. Every rank's heartbeat reads the verdict as soon as it is written, so a rank
still blocked on a live peer (rank 0, say, which under srun holds the store and leaves last) names the dead rank
when that peer leaves, even though the store left with it. A rank whose peer stops beating for
`SAEFLOW_RANK_TIMEOUT_SEC` (default 120 s) while this one waits in a collective that cannot fail by itself (nccl)
prints that line and exits. Nothing is published by a pass whose ranks did not all reach its end
(saeflow.training.ranks.parallel).
"""

import collections
import contextlib
import dataclasses
import datetime
import math
import os
import re
import threading
import time
import typing

import torch

from saeflow import devices
from saeflow.errors import SaeflowError, one_line, say

RANK_TIMEOUT_SEC = float(os.environ.get("SAEFLOW_RANK_TIMEOUT_SEC", 120))  # a silent peer is dead after this
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)  # a live peer may spend this long validating or publishing
HEARTBEAT_SEC = 0.5
EXIT_PEER_GONE = 3  # the exit status of a rank that gave up on a silent peer
_BEAT_KEY = "saeflow/beat/{}"
_LEFT_KEY = "saeflow/left/{}"  # set by a rank that stops on its own (an error it reports): not a dead rank
_GONE_KEY = "saeflow/gone"  # the dead ranks ("2" or "2,3"), written by the first rank that found them
_SEEN_KEY = "saeflow/seen/{}"  # set by a rank's heartbeat once it has read the verdict
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where this rank meets the others, and who it is."""

    rank: int
    world_size: int
    local_rank: int  # among the ranks of this node
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" or "srun": how the rank was started


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],login1") as host names, in order."""
    hosts = []
    for name in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", name)
        if not match:
            hosts.append(name)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Slurm's SLURM_STEP_TASKS_PER_NODE ("4(x2),3"): how many tasks node `node_id` runs."""
    counts = []
    for part in tasks_per_node.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts[node_id] if node_id < len(counts) else 1


def rendezvous_from_env(environ: typing.Mapping[str, str] | None = None) -> Rendezvous | None:
    """This process's rank from torchrun's variables or srun's; None when it is alone (or a world of one)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rdv = Rendezvous(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         int(env.get("LOCAL_WORLD_SIZE", 1)), env.get("MASTER_ADDR", "127.0.0.1"),
                         int(env.get("MASTER_PORT", 29500)), "torchrun")  # fmt: skip
    elif int(env.get("SLURM_STEP_NUM_TASKS") or 1) > 1 and "SLURM_PROCID" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
        job_id, step_id = int(env.get("SLURM_JOB_ID") or 0), int(env.get("SLURM_STEP_ID") or 0)
        port = int(env.get("MASTER_PORT") or 29500 + (job_id * 7 + step_id) % 10000)
        node_id = int(env.get("SLURM_NODEID") or 0)
        local_n = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", "1"), node_id)
        rdv = Rendezvous(int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         local_n, expand_hostlist(nodelist)[0], port, "srun")  # fmt: skip
    else:
        return None
    return rdv if rdv.world_size > 1 else None


def rank_device(name: str, local_rank: int) -> torch.device:
    """This rank's device: its own GPU (cuda:LOCAL_RANK, or cuda:0 when the launcher shows each rank one GPU)."""
    device = devices.resolve_device(name)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", local_rank % torch.cuda.device_count())


class Heartbeat:
    """A counter per rank in the rendezvous store, bumped every HEARTBEAT_SEC; a rank whose counter stops is gone."""

    def __init__(self, store, rank: int, world_size: int, timeout_sec: float = RANK_TIMEOUT_SEC):
        self.store, self.rank, self.world_size, self.timeout_sec = store, rank, world_size, timeout_sec
        self.stop_event = threading.Event()
        self.waiting = False  # the main thread is inside a collective (set by Comm)
        self.verdict: list[int] | None = None  # the dead ranks, once some rank found them
        self.published: typing.Callable[[], list[str]] = list  # the runs this job published (set by Comm.guard)
        self.thread = threading.Thread(target=self._beat, name="saeflow-heartbeat", daemon=True)
        self.thread.start()

    def counts(self) -> list[int]:
        return [self.store.add(_BEAT_KEY.format(r), 0) for r in range(self.world_size)]

    def _flagged(self, key: str) -> set[int]:
        return {r for r in range(self.world_size) if self.store.add(key.format(r), 0)}

    def left(self) -> set[int]:
        return self._flagged(_LEFT_KEY)

    def seen(self) -> set[int]:
        return self._flagged(_SEEN_KEY)

    def _read_verdict(self) -> list[int] | None:
        if self.verdict is None and self.store.check([_GONE_KEY]):
            self.verdict = [int(r) for r in self.store.get(_GONE_KEY).decode().split(",")]
            self.store.add(_SEEN_KEY.format(self.rank), 1)
        return self.verdict

    def leave(self) -> None:
        """Say this rank stops on purpose (so the others do not take it for dead), then stop beating. After a verdict
        the others ask nothing more of this rank, and the store may have left with rank 0: it is not touched."""
        if self.verdict is None:
            try:
                self.store.add(_LEFT_KEY.format(self.rank), 1)
            except Exception:  # noqa: BLE001 -- the store is gone: nobody is left to tell
                pass
        self.stop()

    def _beat(self) -> None:
        last, since = None, [time.monotonic()] * self.world_size
        while not self.stop_event.wait(HEARTBEAT_SEC):
            now = time.monotonic()
            if self.verdict is None:  # after it, rank 0 may take the store away any moment: stop asking it
                try:
                    self.store.add(_BEAT_KEY.format(self.rank), 1)
                    counts = self.counts()
                    self._read_verdict()
                except Exception:  # noqa: BLE001 -- the store went away: the main thread's next collective says so
                    return
                for r, count in enumerate(counts):
                    if last is None or count != last[r]:
                        since[r] = now
                last = counts
            silent = [r for r in range(self.world_size) if r != self.rank and now - since[r] > self.timeout_sec]
            if silent and self.waiting:  # in a collective that cannot fail by itself (nccl), which would wait forever
                self._give_up(silent)

    def _give_up(self, silent: list[int]) -> None:
        gone = self.verdict
        if gone is None:
            try:
                left = self.left()
            except Exception:  # noqa: BLE001
                left = set()
            gone = [r for r in silent if r not in left]
        why = _gone(gone) if gone else f"rank {silent[0]} stopped (its own line says why)"
        line = f"{why} (no heartbeat for {self.timeout_sec:g} s); this rank stops too, {publish_note(self.published())}"
        say(f"saeflow train: error: rank {self.rank}: {line}")
        os._exit(EXIT_PEER_GONE)

    def gone(self, wait_sec: float = 4 * HEARTBEAT_SEC) -> list[int] | None:
        """The dead ranks: the verdict another rank wrote, else the ranks whose counters did not move for `wait_sec`
        (written as the verdict); None when the store is unreachable and no verdict was read before it went."""
        try:
            if self._read_verdict():
                return self.verdict
            before, deadline = self.counts(), time.monotonic() + wait_sec
            while time.monotonic() < deadline:
                time.sleep(HEARTBEAT_SEC / 5)
                if self.verdict is not None:  # the heartbeat read it: the store may be leaving
                    return self.verdict
            after, left = self.counts(), self.left()
            gone = [r for r in range(self.world_size) if r != self.rank and before[r] == after[r] and r not in left]
            if gone and not self._read_verdict():
                self.store.set(_GONE_KEY, ",".join(map(str, gone)))
            return self.verdict or gone
        except Exception:  # noqa: BLE001 -- the store is gone
            return self.verdict

    def await_others(self, gone: list[int], max_sec: float = RANK_TIMEOUT_SEC / 4) -> None:
        """Rank 0 holds the rendezvous store (srun, forked ranks): before it exits on a dead peer, wait until every
        other live rank has read the verdict (its heartbeat does within a beat, even while its main thread is blocked
        on rank 0 itself) or left, so each names the dead rank rather than the store's absence. Bounded: a rank that
        never answers is waited for `max_sec` (30 s by default) at most."""
        deadline = time.monotonic() + max_sec
        others = set(range(self.world_size)) - set(gone) - {self.rank}
        while time.monotonic() < deadline:
            try:
                if others <= self.left() | self.seen():
                    return
            except Exception:  # noqa: BLE001 -- the store is gone already
                return
            time.sleep(HEARTBEAT_SEC / 5)

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join()


def _short(err: BaseException) -> str:
    """A backend's error in a few words: "Connection reset by peer", not gloo's file, line and advice."""
    text = re.sub(r"^\[[^\]]*\] ", "", one_line(err))
    return text.split(". ")[0][:120]


def publish_note(published: typing.Sequence[str]) -> str:
    """What a failed job published: "nothing was published", or the runs whose sae.pt is complete (a rerun finds
    them trained and skips them)."""
    if not published:
        return "nothing was published"
    return f"published {', '.join(published)} (complete: a rerun skips {'it' if len(published) == 1 else 'them'})"


def store_holder(rdv: Rendezvous) -> str:
    """Who holds the rendezvous store: rank 0 under srun and the plain env:// rendezvous (forked ranks), torchrun's
    agent (the launcher) when the ranks use its store."""
    agent = rdv.source == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return "the launcher (torchrun's agent)" if agent else "rank 0"


def _gone(ranks: list[int]) -> str:
    return f"rank {ranks[0]} is gone" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} are gone"


class _TensorCollectives:
    """This rank's view of the job: rank, world size, device, and the collectives (identity when alone).

    `sent_bytes[kind]` counts what each collective costs a rank on a ring (the cost model of docs/distributed.md):
    an all-reduce of S bytes sends 2 (N-1)/N S, an all-gather of s bytes per rank (N-1) s, an all-to-all the rows
    it sends to the other ranks, a broadcast or a point-to-point send its size. `calls[kind]` counts the calls.
    """

    def __init__(self, device: torch.device, rdv: Rendezvous | None = None, heartbeat: Heartbeat | None = None):
        self.device, self.rdv, self.heartbeat = device, rdv, heartbeat
        self.rank = rdv.rank if rdv else 0
        self.world_size = rdv.world_size if rdv else 1
        self.local_rank = rdv.local_rank if rdv else 0
        self.local_world_size = rdv.local_world_size if rdv else 1
        self.sent_bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    @property
    def distributed(self) -> bool:
        return self.rdv is not None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def _count(self, kind: str, n_bytes: float) -> None:
        self.calls[kind] += 1
        self.sent_bytes[kind] += int(n_bytes)

    @contextlib.contextmanager
    def _waiting(self):
        if self.heartbeat is not None:
            self.heartbeat.waiting = True
        try:
            yield
        finally:
            if self.heartbeat is not None:
                self.heartbeat.waiting = False

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `t` in place over the ranks (sum, max or min); every rank gets the same bytes."""
        if not self.distributed:
            return t
        import torch.distributed as dist

        n = self.world_size
        self._count("all_reduce", 2 * (n - 1) / n * t.numel() * t.element_size())
        with self._waiting():
            dist.all_reduce(t, op=getattr(dist.ReduceOp, _OPS[op]))
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """(world_size, *t.shape): every rank's `t` (same shape everywhere), in rank order."""
        if not self.distributed:
            return t[None]
        import torch.distributed as dist

        out = t.new_empty((self.world_size, *t.shape))
        self._count("all_gather", (self.world_size - 1) * t.numel() * t.element_size())
        with self._waiting():
            dist.all_gather(list(out.unbind(0)), t.contiguous())
        return out

    def exchange_rows(self, rows_nd: torch.Tensor, send_counts: typing.Sequence[int],
                      recv_counts: typing.Sequence[int]) -> torch.Tensor:  # fmt: skip
        """Rows to each rank (an all-to-all): the first `send_counts[0]` rows of `rows_nd` go to rank 0, the next
        `send_counts[1]` to rank 1, ...; returns the rows this rank receives (`recv_counts[r]` from rank r), in rank
        order. Each rank sends exactly the rows others receive: no padding. Counted as what leaves this rank."""
        if not self.distributed:
            return rows_nd
        import torch.distributed as dist

        row_bytes = math.prod(rows_nd.shape[1:]) * rows_nd.element_size()
        self._count("all_to_all", (sum(send_counts) - send_counts[self.rank]) * row_bytes)
        out = rows_nd.new_empty((sum(recv_counts), *rows_nd.shape[1:]))
        with self._waiting():
            dist.all_to_all_single(out, rows_nd.contiguous(), list(map(int, recv_counts)),
                                   list(map(int, send_counts)))  # fmt: skip
        return out

    def all_gather_rows(self, rows_nd: torch.Tensor, counts: typing.Sequence[int]) -> torch.Tensor:
        """Every rank's rows (rank r gives `counts[r]` of them), concatenated in rank order: an all-to-all that sends
        this rank's rows to every other rank, (N-1) counts[rank] rows (an all-gather would pad to the largest)."""
        if not self.distributed:
            return rows_nd
        n = self.world_size
        return self.exchange_rows(rows_nd.repeat(n, *([1] * (rows_nd.ndim - 1))), [rows_nd.shape[0]] * n, counts)

    def send(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        self._count("send", t.numel() * t.element_size())
        with self._waiting():
            dist.send(t.contiguous(), dst)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        import torch.distributed as dist

        with self._waiting():
            dist.recv(t, src)
        return t

    def barrier(self) -> None:
        if self.distributed:
            self.all_reduce(torch.zeros(1, device=self.device))

    def any_true(self, flag: bool) -> bool:
        return bool(self.all_reduce(torch.tensor([int(flag)], device=self.device), "max").item())

    def min_int(self, value: int) -> int:
        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64, device=self.device), "min").item())


class Comm(_TensorCollectives):
    """A rank of the job (or a process alone): the tensor collectives, plus small Python objects passed between
    ranks, one line when a collective fails because a rank is gone, and leaving the process group."""

    @classmethod
    def alone(cls, device: torch.device) -> "Comm":
        return cls(device)

    def broadcast_object(self, obj, src: int = 0):
        """`obj` of rank `src` on every rank (pickled; for plans and small state)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        with self._waiting():
            dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        self._count("broadcast_object", 0)
        return box[0]

    def on_root(self, fn: typing.Callable[[], typing.Any]):
        """`fn()` run on rank 0, its result on every rank; a SaeflowError there is raised on every rank."""
        if not self.distributed:
            return fn()
        outcome = None
        if self.is_root:
            try:
                outcome = ("ok", fn())
            except SaeflowError as err:
                outcome = ("error", str(err))
        kind, value = self.broadcast_object(outcome)
        if kind == "error":
            raise SaeflowError(value)
        return value

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` on every rank, in rank order (small: results, counts)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        with self._waiting():
            dist.all_gather_object(out, obj)
        return out

    @contextlib.contextmanager
    def guard(self, published: typing.Callable[[], list[str]] = list) -> typing.Iterator[None]:
        """Turn a failed collective into one line naming the rank that is gone (when one is), and what the job
        published before (`published()`: the runs whose sae.pt it wrote)."""
        if self.heartbeat is not None:
            self.heartbeat.published = published
        try:
            yield
        except Exception as err:
            if not self.distributed or self.heartbeat is None:
                raise
            if isinstance(err, SaeflowError):
                self.heartbeat.leave()
                raise
            gone = self.heartbeat.gone()
            self.heartbeat.leave()
            if gone and self.rank == 0:
                self.heartbeat.await_others(gone)
            holder = store_holder(self.rdv)
            if gone is None and holder == "rank 0" and self.rank != 0:
                gone_text = "rank 0 is gone (the rendezvous store it held is unreachable)"
            elif gone is None:
                gone_text = f"the rendezvous store is unreachable ({holder}, which holds it, is gone)"
            elif gone:
                gone_text = _gone(gone)
            else:
                raise
            raise SaeflowError(
                f"{gone_text} ({_short(err)}); this rank stops too, {publish_note(published())}; rerun to resume "
                "from the last checkpoint"
            ) from None

    def close(self) -> None:
        """Leave the process group (after every rank is done with it)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        if self.heartbeat is not None:
            self.heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def init(device_name: str, environ: typing.Mapping[str, str] | None = None) -> Comm:
    """This process's Comm: joins the process group when a launcher made it a rank, else `Comm.alone`."""
    rdv = rendezvous_from_env(environ)
    if rdv is None:
        return Comm.alone(devices.resolve_device(device_name))
    import torch.distributed as dist

    device = rank_device(device_name, rdv.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # torchrun's ranks meet in its agent's store (env://); srun's in a store rank 0 opens.
    init_method = "env://" if rdv.source == "torchrun" else f"tcp://{rdv.master_addr}:{rdv.master_port}"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rdv.rank, world_size=rdv.world_size,
                                timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
    except Exception as err:  # noqa: BLE001 -- the rendezvous failed: one line
        raise SaeflowError(
            f"rank {rdv.rank} of {rdv.world_size} could not join the others at {rdv.master_addr}:{rdv.master_port} "
            f"(from {rdv.source}'s environment): {one_line(err)[:200]}"
        ) from None
    store = dist.distributed_c10d._get_default_store()
    return Comm(device, rdv, Heartbeat(store, rdv.rank, rdv.world_size))
