"""``SlurmClusterResolver``: the cluster of a Slurm job step, from its environment.

Inside a step started by ``srun``, Slurm tells each process its rank
(``SLURM_PROCID``), the step's nodes (``SLURM_STEP_NODELIST``, compressed as
``node[1-3,7]``) and how many tasks run on each (``SLURM_STEP_TASKS_PER_NODE``,
compressed as ``2(x3),1``).  The resolver expands both itself (no
``scontrol``), lays the tasks out node by node with ports ``port_base``,
``port_base + 1``... on each node, and hands out the ranks to jobs as
TensorFlow's ``SlurmClusterResolver`` does:

* jobs are filled in sorted order of their names (``{"ps": 1, "worker": 3}``:
  rank 0 is ``ps:0``, ranks 1-3 are ``worker:0-2``);
* each task on a node gets its own ``gpus_per_task`` GPUs, in order, and with
  ``auto_set_gpu`` this process's ``CUDA_VISIBLE_DEVICES`` is set to them.

Example (TF's documented case, 2 nodes with 2 tasks and 4 GPUs each):
    >>> environ = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4",
    ...            "SLURM_STEP_NODELIST": "t02n[13,41]",
    ...            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    >>> resolver = SlurmClusterResolver(environ=environ)
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['t02n13:8888', 't02n13:8889', 't02n41:8888', 't02n41:8889']}
    >>> resolver.task_type, resolver.task_id, environ["CUDA_VISIBLE_DEVICES"]
    ('worker', 1, '2,3')
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, MutableMapping

from psflow import settings
from psflow.distribute.cluster_resolver.accelerators import (
    GpuProbe,
    probe_gpus,
    visible_gpu_count,
)
from psflow.distribute.cluster_resolver.base import (
    ClusterResolver,
    check_rpc_layer,
)
from psflow.distribute.cluster_resolver.cluster_spec import (
    ClusterSpec,
    coerce_task_index,
)
from psflow.errors import FailedPreconditionError, InvalidArgumentError

MAX_EXPANDED = 100_000
"""The most hosts (or per-node entries) a compressed list may expand to."""

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_HOST = re.compile(r"[A-Za-z0-9._-]+")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def _split_outside_brackets(hostlist: str) -> list[str]:
    """Splits at the commas that are not inside ``[...]``."""
    items: list[str] = []
    current: list[str] = []
    inside = False
    for char in hostlist:
        if char == "[":
            if inside:
                raise InvalidArgumentError(f"host list {hostlist!r} nests '[' brackets")
            inside = True
        elif char == "]":
            if not inside:
                raise InvalidArgumentError(f"host list {hostlist!r} has an unmatched ']'")
            inside = False
        elif char == "," and not inside:
            items.append("".join(current))
            current = []
            continue
        current.append(char)
    if inside:
        raise InvalidArgumentError(f"host list {hostlist!r} has an unclosed '['")
    items.append("".join(current))
    return items


def _expand_ranges(body: str, hostlist: str) -> list[str]:
    """Expands the inside of one ``[...]``: ``1-3,7`` or zero-padded ``001-003``."""
    values: list[str] = []
    for piece in body.split(","):
        match = _RANGE.fullmatch(piece)
        if match is None:
            raise InvalidArgumentError(f"range {piece!r} in host list {hostlist!r} is invalid")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise InvalidArgumentError(f"range {piece!r} in host list {hostlist!r} runs backwards")
        if len(values) + int(last) - int(first) + 1 > MAX_EXPANDED:
            raise InvalidArgumentError(
                f"host list {hostlist!r} expands to more than {MAX_EXPANDED} hosts"
            )
        width = len(first)  # Slurm pads every number to the first one's width
        values.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm host list, keeping its order and its zero padding.

    Each comma-separated item is literal text with optional ``[...]`` ranges;
    several ranges in one item expand as a product, left range outermost.

    Raises:
        InvalidArgumentError: the list is empty or malformed, a host name has
            characters other than letters, digits, ``.``, ``_`` and ``-``, or
            it expands to more than ``MAX_EXPANDED`` hosts; the message names
            the list and the part at fault.

    Example:
        >>> expand_hostlist("node[1-3,7]")
        ['node1', 'node2', 'node3', 'node7']
        >>> expand_hostlist("n[001-003],m5")
        ['n001', 'n002', 'n003', 'm5']
    """
    if not isinstance(hostlist, str) or not hostlist.strip():
        raise InvalidArgumentError(f"host list {hostlist!r} must be a non-empty string")
    hosts: list[str] = []
    for item in _split_outside_brackets(hostlist.strip()):
        if not item:
            raise InvalidArgumentError(f"host list {hostlist!r} has an empty entry")
        expanded = [""]
        for part in re.split(r"(\[[^\]]*\])", item):
            if part.startswith("["):
                values = _expand_ranges(part[1:-1], hostlist)
                if len(expanded) * len(values) + len(hosts) > MAX_EXPANDED:
                    raise InvalidArgumentError(
                        f"host list {hostlist!r} expands to more than {MAX_EXPANDED} hosts"
                    )
                expanded = [prefix + value for prefix in expanded for value in values]
            elif part:
                if not _HOST.fullmatch(part):
                    raise InvalidArgumentError(
                        f"host name part {part!r} in host list {hostlist!r} is invalid"
                    )
                expanded = [prefix + part for prefix in expanded]
        hosts.extend(expanded)
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expands Slurm's tasks-per-node list: ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    Raises:
        InvalidArgumentError: the list is malformed or expands to more than
            ``MAX_EXPANDED`` entries; the message names it.

    Example:
        >>> expand_tasks_per_node("3(x2),2,1")
        [3, 3, 2, 1]
    """
    if not isinstance(tasks_per_node, str) or not tasks_per_node.strip():
        raise InvalidArgumentError(
            f"tasks-per-node list {tasks_per_node!r} must be a non-empty string"
        )
    counts: list[int] = []
    for part in tasks_per_node.strip().split(","):
        match = _TASKS.fullmatch(part)
        if match is None or (match.group(2) is not None and int(match.group(2)) == 0):
            raise InvalidArgumentError(
                f"entry {part!r} of tasks-per-node list {tasks_per_node!r} is invalid "
                "(expected N or N(xR) with R >= 1)"
            )
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_EXPANDED:
            raise InvalidArgumentError(
                f"tasks-per-node list {tasks_per_node!r} expands to more than "
                f"{MAX_EXPANDED} entries"
            )
        counts.extend([int(match.group(1))] * repeat)
    return counts


def _slurm_var(environ: Mapping[str, str], name: str) -> str:
    try:
        return environ[name]
    except KeyError:
        raise FailedPreconditionError(
            f"{name} is not set: SlurmClusterResolver must run inside a Slurm job step "
            "(started by srun)"
        ) from None


def _int_arg(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} {value!r} must be an integer >= {minimum}")
    return value


def _int_var(environ: Mapping[str, str], name: str) -> int:
    return coerce_task_index(_slurm_var(environ, name), name)


class SlurmClusterResolver(ClusterResolver):
    """The cluster of the current Slurm job step, with TF's layout (see the module docstring).

    Every value is resolved once, at construction; the task type and index
    are known from then on (TF knows them only after ``cluster_spec()``).

    Args:
        jobs: job name -> number of tasks; the counts must add up to the
            step's tasks.  Default: ``{"worker": SLURM_STEP_NUM_TASKS}``.
        port_base: the port of the first task on each node.
        gpus_per_node: GPUs on each node.  Default: counted without touching
            CUDA (``CUDA_VISIBLE_DEVICES``, the NVIDIA driver, ``nvidia-smi``,
            else 0) through ``gpu_probe``.  Count it before anything narrows
            ``CUDA_VISIBLE_DEVICES``: construct the resolver once per process.
        gpus_per_task: GPUs given to each task.  Default: ``gpus_per_node``
            divided by the most tasks on one node.
        tasks_per_node: tasks on each node: an int for every node of
            ``SLURM_STEP_NODELIST``, or a mapping host -> count (its order is
            the task order).  Default: ``SLURM_STEP_TASKS_PER_NODE``.
        auto_set_gpu: set ``CUDA_VISIBLE_DEVICES`` (in ``environ``) to this
            task's GPUs.  Nothing is set when tasks get no GPUs.
        rpc_layer: the protocol prefix ``master()`` adds.
        environ: the environment to read (and write ``CUDA_VISIBLE_DEVICES``
            to); the process environment (:func:`psflow.settings.environ`) by default.
        gpu_probe: counts the node's GPUs when ``gpus_per_node`` is not given.

    Raises:
        FailedPreconditionError: a Slurm variable that is needed is not set.
        InvalidArgumentError: a Slurm variable or an argument is malformed,
            the jobs ask for a different number of tasks than the step has,
            the rank is out of range, the tasks on a node need more GPUs
            than it has, a node is listed twice, or ``environ`` cannot be
            written to when ``CUDA_VISIBLE_DEVICES`` must be set.

    Two deliberate differences from TF: hosts keep the order of
    ``SLURM_STEP_NODELIST`` (the order in which Slurm hands out ranks) where
    TF sorts their names as strings, so ``node10`` no longer lands before
    ``node2`` (both agree for lists of equal-width names, as in TF's docs);
    and when ``CUDA_VISIBLE_DEVICES`` already lists the node's GPUs, the GPUs
    given to a task are taken from that list instead of being numbered from 0.
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str | None = "grpc",
        *,
        environ: Mapping[str, str] | None = None,
        gpu_probe: GpuProbe | None = None,
    ) -> None:
        env = settings.environ() if environ is None else environ
        self.gpu_probe = gpu_probe
        self._rpc_layer = check_rpc_layer(rpc_layer)
        rank = _int_var(env, "SLURM_PROCID")
        layout = self._task_layout(env, tasks_per_node)
        num_tasks = sum(count for _, count in layout)
        if num_tasks < 1:
            raise InvalidArgumentError(f"the Slurm step has no tasks (layout {layout!r})")
        jobs = self._check_jobs(env, jobs, num_tasks)
        if rank >= num_tasks:
            raise InvalidArgumentError(
                f"SLURM_PROCID {rank} is out of range for a step of {num_tasks} tasks"
            )
        max_per_node = max(count for _, count in layout)
        port_base = _int_arg(port_base, "port_base", 1)
        if port_base + max_per_node - 1 > 65535:
            raise InvalidArgumentError(
                f"port_base {port_base} + {max_per_node} tasks per node runs past port 65535"
            )

        # GPUs: per node, then per task; TF's rule for the default split.
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if gpus_per_node is None:
            probe = gpu_probe if gpu_probe is not None else (lambda: visible_gpu_count(env))
            gpus_per_node = probe_gpus(probe)
        gpus_per_node = _int_arg(gpus_per_node, "gpus_per_node", 0)
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_per_node
        gpus_per_task = _int_arg(gpus_per_task, "gpus_per_task", 0)
        if max_per_node * gpus_per_task > gpus_per_node:
            raise InvalidArgumentError(
                f"{max_per_node} tasks per node x gpus_per_task {gpus_per_task} need more "
                f"GPUs than gpus_per_node {gpus_per_node}"
            )
        known = [d.strip() for d in (visible or "").split(",") if d.strip()]
        device_names = known if len(known) >= gpus_per_node else None

        # Tasks node by node, ports and GPUs counted from 0 on each node.
        addresses: list[str] = []
        allocations: list[str] = []
        for host, count in layout:
            for slot in range(count):
                addresses.append(f"{host}:{port_base + slot}")
                gpus = range(slot * gpus_per_task, (slot + 1) * gpus_per_task)
                names = [device_names[g] if device_names else str(g) for g in gpus]
                allocations.append(",".join(names))

        # Ranks to jobs in sorted job order (TF's).
        cluster: dict[str, list[str]] = {}
        start = 0
        for job in sorted(jobs):
            cluster[job] = addresses[start : start + jobs[job]]
            if start <= rank < start + jobs[job]:
                self._task_type, self._task_id = job, rank - start
            start += jobs[job]

        self._rank = rank
        self._jobs = dict(jobs)
        self._port_base = port_base
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        self._allocations = tuple(allocations)
        self._cluster_spec = ClusterSpec(cluster)
        if auto_set_gpu and gpus_per_task > 0:
            if not isinstance(env, MutableMapping):
                raise InvalidArgumentError(
                    f"environ ({type(env).__name__}) cannot be written to; pass a dict "
                    "or auto_set_gpu=False"
                )
            env["CUDA_VISIBLE_DEVICES"] = allocations[rank]

    @staticmethod
    def _task_layout(
        env: Mapping[str, str], tasks_per_node: int | Mapping[str, int] | None
    ) -> list[tuple[str, int]]:
        """Returns ``[(host, tasks on it)]`` in task order."""
        if isinstance(tasks_per_node, Mapping):
            layout = []
            for host, count in tasks_per_node.items():
                if not isinstance(host, str) or not _HOST.fullmatch(host):
                    raise InvalidArgumentError(f"host {host!r} in tasks_per_node is invalid")
                layout.append((host, _int_arg(count, f"tasks_per_node[{host!r}]", 0)))
            return layout
        nodelist = _slurm_var(env, "SLURM_STEP_NODELIST")
        hosts = expand_hostlist(nodelist)
        repeated = sorted(host for host, n in Counter(hosts).items() if n > 1)
        if repeated:
            raise InvalidArgumentError(
                f"SLURM_STEP_NODELIST {nodelist!r} lists node(s) {repeated} more than once"
            )
        if tasks_per_node is not None:
            count = _int_arg(tasks_per_node, "tasks_per_node", 1)
            return [(host, count) for host in hosts]
        spec = _slurm_var(env, "SLURM_STEP_TASKS_PER_NODE")
        counts = expand_tasks_per_node(spec)
        if len(counts) != len(hosts):
            raise InvalidArgumentError(
                f"SLURM_STEP_TASKS_PER_NODE {spec!r} gives {len(counts)} node(s) but "
                f"SLURM_STEP_NODELIST {nodelist!r} has {len(hosts)}"
            )
        return list(zip(hosts, counts, strict=True))

    @staticmethod
    def _check_jobs(
        env: Mapping[str, str], jobs: Mapping[str, int] | None, num_tasks: int
    ) -> dict[str, int]:
        if jobs is None:
            # TF reads SLURM_STEP_NUM_TASKS; without it, the layout's total.
            if "SLURM_STEP_NUM_TASKS" in env:
                jobs = {"worker": _int_var(env, "SLURM_STEP_NUM_TASKS")}
            else:
                jobs = {"worker": num_tasks}
        if not isinstance(jobs, Mapping) or not jobs:
            raise InvalidArgumentError(
                f"jobs {jobs!r} must be a non-empty mapping of job name to task count"
            )
        checked = ClusterSpec({job: [] for job in jobs}).jobs  # validates the names
        result = {job: _int_arg(jobs[job], f"jobs[{job!r}]", 0) for job in checked}
        if sum(result.values()) != num_tasks:
            raise InvalidArgumentError(
                f"jobs {result!r} ask for {sum(result.values())} tasks but the Slurm step "
                f"has {num_tasks}"
            )
        return result

    def cluster_spec(self) -> ClusterSpec:
        """Returns the step's cluster (the same object on every call)."""
        return self._cluster_spec

    def get_task_info(self) -> tuple[str | None, int | None]:
        """Returns ``(task_type, task_id)`` of this process (TF's API)."""
        return self.task_type, self.task_id

    @property
    def rank(self) -> int:
        """This process's ``SLURM_PROCID``."""
        return self._rank

    @property
    def gpu_allocation(self) -> tuple[str, ...]:
        """Each rank's GPUs, as ``CUDA_VISIBLE_DEVICES`` values (``""``: none)."""
        return self._allocations

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: object = None,
    ) -> dict[str, int]:
        """Returns ``{"GPU": gpus_per_task}``, as TF does."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task}
