"""CTR training with embedding tables on parameter servers: psflow's dynamic tables vs TensorFlow.

Both sides run 2 parameter servers and 2 workers as separate processes on
loopback and train the same model on the same Criteo-shaped data
(``psflow.keras.datasets.ctr``: 13 dense + 26 Zipf-distributed categorical
features, labels from a hidden logistic model):
one 8-float embedding row per id, the 26 rows and the dense features into
Dense(64, relu) -> Dense(1), sigmoid cross-entropy, Adagrad 0.05, a custom
loop scheduled through the ClusterCoordinator (one closure = one batch).

- psflow: ``DynamicEmbedding`` on the raw int64 ids (no vocabulary; rows made
  on first sight, sharded by id hash; lookups and pushes carry unique ids);
  each PS allocates ``VOCAB / 2`` rows up front, as many in all as TensorFlow's
  vocabulary holds (``config.rows_allocated_up_front``), and grows past them.
- TensorFlow: a fixed ``Embedding(VOCAB, 8)`` partitioned over the 2 PS by
  ``FixedShardsPartitioner(2)``, ids hashed into ``[0, VOCAB)`` first (so
  unrelated ids collide: TensorFlow's PSS needs a fixed vocabulary).

Measured: examples/s (ratio), CPU milliseconds per step of each role (chief,
workers, PS: utime+stime of every process from ``/proc`` over the timed steps,
all threads, both sides; where the gap is), the calls per step the PS tasks
serve (psflow), bytes on the wire per step (psflow: counted by
the servers; TensorFlow: the formula below, it has no counter), resident
memory of the PS processes, test AUC of both and of a single-process psflow
run on the same batches, pulled bytes with the hot-row cache on vs off, and
the memory per row of a large dynamic table (the 10M-row bound in the full run).

TensorFlow bytes per step (formula): gathered rows ``B*26*8*4`` out of the PS
(TensorFlow gathers per occurrence), gradient rows ``B*26*(8*4+8)`` in, and
the dense weights pulled and pushed once (``2 * 4 * dense_params``).

Both throughput lines carry the same ``config`` (batch, model sizes, steps,
processes, threads): identical for both sides.  Threads: psflow's processes
run NumPy with one BLAS/OpenMP thread (its math is single-threaded anyway) and
gRPC's own pollers; TensorFlow's run its default intra/inter-op pools (one
thread per core), its idiomatic setting, nothing pinned.  TensorFlow runs each
step as a ``tf.function`` closure through its ClusterCoordinator, TensorFlow's
own sparse Adagrad kernels next to the variables; one step per closure on
both sides.

Hybrid mode (psflow only) on the same data, batches and cluster shape:
``MultiWorkerMirroredStrategy`` with 2 PS tasks in its cluster and 2 workers,
the table on the PS tasks (each worker looks up its half of the batch and the
workers share the push of each step's summed table gradient), the dense
tower mirrored and all-reduced.  Three cases, each training as many examples
as the async side (warm-up included):

- global batch ``--batch`` (256 per worker): the single-process run's
  updates, half the async side's batch per worker step;
- global batch ``2 * --batch``: the async side's batch per worker step kept
  per replica, TensorFlow's default when workers are added (its
  multi-worker tutorial scales the global batch with the workers), and the
  fair match for throughput: each worker computes what an async worker
  does per step; it makes half the updates, at the same learning rate;
- the same with the learning rate doubled (0.1), the linear scaling rule a
  user applies with a global batch twice as large (Goyal et al. 2017; the
  elastic mode's ``global_batch_scale`` is that factor); printed as its own
  case, nothing else tuned.

Measured beside the async side: examples/s (worker 0's timed steps), test
AUC, and CPU milliseconds per ``--batch`` examples of the workers and the PS
tasks over the timed steps (each worker's own, the PS tasks' read from
``/proc`` by worker 0; the async side's chief has no counterpart).

``--seed N`` (default 0: the README's runs) draws other initial weights on every
psflow side (the dense layers and the table's row seed) and shuffles the
training examples, which every side then reads in that order (the async
workers' shards are cut from it; TensorFlow's initial weights keep their own
seeds): AUC differences between the sides can be told from one draw's luck.

Prints JSON lines (stdout) and a table (stderr); ``--quick`` is the same cases
with fewer steps.  Format: shared/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _cluster
from _common import emit, progress, table

BENCH = "recsys"
VOCAB = 1 << 20
# Rows each psflow PS allocates up front: TensorFlow's side holds its whole
# vocabulary from the start (VOCAB rows over 2 shards), so the dynamic table
# gets the same rows in all (it still grows past them if needed).
CAPACITY_PER_PS = VOCAB // 2
DIM = 8
HIDDEN = 64
NUM_CAT, NUM_DENSE = 26, 13
DENSE_PARAMS = (NUM_CAT * DIM + NUM_DENSE) * HIDDEN + HIDDEN + HIDDEN + 1


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux ``/proc``), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux ``/proc``), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    # after the command name: state is field 3, utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(roles: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of every role's processes (summed per role)."""
    return {role: sum(cpu_seconds(p) for p in pids) for role, pids in roles.items()}


def cpu_ms_per_step(before: dict, after: dict, steps: int) -> dict[str, float]:
    """Milliseconds of CPU per step of every role, and their ``total``."""
    out = {role: 1000 * (after[role] - before[role]) / steps for role in before}
    out["total"] = sum(out.values())
    return out


def make_data(path: str, train: int, test: int, seed: int = 0) -> None:
    """Writes the train and test sets (and TensorFlow's hashed ids) to ``path``.

    ``seed`` other than 0 shuffles the training examples (``--seed``): every side
    reads them in that order (the async workers' shards are cut from it); the
    examples themselves and the test set stay the same."""
    import numpy as np

    from psflow.keras.datasets import ctr

    x, y, _ = ctr.load_data(train, seed=1)
    if seed:
        order = np.random.default_rng(seed).permutation(train)
        x, y = {k: v[order] for k, v in x.items()}, y[order]
    xt, yt, logit_t = ctr.load_data(test, seed=2)
    np.savez(
        path,
        cat=x["cat"],
        dense=x["dense"],
        y=y,
        cat_test=xt["cat"],
        dense_test=xt["dense"],
        y_test=yt,
        logit_test=logit_t,
        cat_tf=(x["cat"].view(np.uint64) % np.uint64(VOCAB)).astype(np.int64),
        cat_tf_test=(xt["cat"].view(np.uint64) % np.uint64(VOCAB)).astype(np.int64),
    )


def psflow_model(pf, name: str, capacity: int = CAPACITY_PER_PS, seed: int = 0):
    """The model, psflow side (``capacity``: rows each PS allocates up front; ``seed``
    moves the table's row seed, ``--seed``: the dense layers follow ``pf.random``'s)."""

    class Model(pf.keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = pf.keras.layers.DynamicEmbedding(
                DIM, table_name=name, seed=3 + seed, capacity=capacity
            )
            self.hidden = pf.keras.layers.Dense(HIDDEN, activation="relu")
            self.out = pf.keras.layers.Dense(1)

        def call(self, inputs, training=None):
            cat, dense = inputs
            e = pf.reshape(self.emb(cat, training=training), (-1, NUM_CAT * DIM))
            return self.out(self.hidden(pf.concat([e, dense], axis=1)))

    return Model()


def _loss(pf, logits, y):
    return pf.reduce_mean(pf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))


def single_process_auc(data: dict, batch: int, steps: int, seed: int = 0) -> float:
    """AUC of the same model trained in this process on the same batches."""
    import psflow as pf
    from psflow.keras.datasets import ctr

    pf.random.set_seed(seed)
    model = psflow_model(pf, "single", seed=seed)
    optimizer = pf.keras.optimizers.Adagrad(0.05)
    n = data["cat"].shape[0]
    for s in range(steps):
        lo = (s * batch) % (n - batch)
        xb = (
            pf.constant(data["cat"][lo : lo + batch]),
            pf.constant(data["dense"][lo : lo + batch]),
        )
        with pf.GradientTape() as tape:
            loss = _loss(pf, model(xb), pf.constant(data["y"][lo : lo + batch]))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    test_x = (pf.constant(data["cat_test"]), pf.constant(data["dense_test"]))
    scores = model(test_x, training=False).numpy()
    return ctr.roc_auc(data["y_test"], scores)


def ps_training(pf, strategy, model, optimizer, data: dict, batch: int):
    """The CTR model's PSS training: ``(coordinator, per-worker iterator, step closure)``.

    Shared with ``tiered.py``, which imports this module and registers it to be
    pickled by value (its workers cannot import it).
    """
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    cat, dense, y = data["cat"], data["dense"], data["y"]

    def dataset_fn(ctx):
        ds = pf.data.Dataset.from_tensor_slices(((cat, dense), y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(batch)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step_fn(it):
        xb, yb = next(it)

        def replica_fn(xb, yb):
            with pf.GradientTape() as tape:
                loss = _loss(pf, model(xb, training=True), yb)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica_fn, args=(xb, yb))

    return coordinator, iterator, step_fn


def run_psflow(
    data: dict, cluster: dict, pids: dict[str, list[int]], batch: int, steps: int, seed: int = 0
) -> dict:
    """Throughput, bytes per step, PS memory, AUC and hot-row bytes of the psflow side."""

    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
    from psflow.keras.datasets import ctr
    from psflow.ps.dynamic_table import TableConfig
    from psflow.ps.hot_rows import HotRowPolicy
    from psflow.transport.embedding_client import EmbeddingClient

    resolver = SimpleClusterResolver(
        ClusterSpec({**cluster, "chief": ["127.0.0.1:1"]}), task_type="chief", task_id=0
    )
    pf.random.set_seed(seed)
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = psflow_model(pf, "ctr", seed=seed)
        optimizer = pf.keras.optimizers.Adagrad(0.05)
    coordinator, iterator, step_fn = ps_training(pf, strategy, model, optimizer, data, batch)

    client = EmbeddingClient(cluster["ps"], timeout=60)

    def wire() -> int:
        dense_bytes = sum(s["bytes_in"] + s["bytes_out"] for s in strategy.ps_stats())
        return dense_bytes + sum(a + b for a, b in client.server_bytes())

    def rpcs() -> int:
        """Pulls, pushes, lookups and table pushes the PS tasks served so far."""
        dense = sum(s["pulls"] + s["pushes_applied"] for s in strategy.ps_stats())
        return dense + sum(t.lookups + t.step for shard in client.stats() for t in shard.values())

    for _ in range(5):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    before, rpcs_before = wire(), rpcs()
    roles = {**pids, "chief": [os.getpid()]}
    cpu_before = cpu_snapshot(roles)
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    elapsed = time.perf_counter() - start
    cpu = cpu_ms_per_step(cpu_before, cpu_snapshot(roles), steps)
    rpcs_per_step = (rpcs() - rpcs_before) / steps
    per_step = (wire() - before) / steps
    rss = sum(rss_bytes(p) for p in pids["ps"])
    rows = sum(s["ctr"].rows for s in client.stats())
    # inference: unseen test ids read their initial rows without being inserted
    test_x = (pf.constant(data["cat_test"]), pf.constant(data["dense_test"]))
    scores = model(test_x, training=False).numpy()
    auc = ctr.roc_auc(data["y_test"], scores)
    coordinator.shutdown()

    # Hot rows: the same lookup stream through a client with and without the cache.
    hot = {}
    for label, policy in (("off", None), ("on", HotRowPolicy(1024, 10))):
        c = EmbeddingClient(cluster["ps"], timeout=60, hot_rows=policy)
        c.create_table(TableConfig(f"hot_{label}", DIM, optimizer={"name": "adagrad"}))
        for s in range(steps):
            c.lookup(f"hot_{label}", data["cat"][s * batch : (s + 1) * batch])
        hot[label] = c.bytes.pulled / steps
        c.close()
    client.close()
    return {
        "examples_per_s": steps * batch / elapsed,
        "cpu_ms_per_step": cpu,
        "ps_rpcs_per_step": rpcs_per_step,
        "bytes_per_step": per_step,
        "ps_rss": rss,
        "rows": rows,
        "auc": auc,
        "hot_off": hot["off"],
        "hot_on": hot["on"],
        "auc_oracle": ctr.roc_auc(data["y_test"], data["logit_test"]),
    }


def hybrid_worker(
    path: str,
    global_batch: int,
    warmup: int,
    steps: int,
    out: str,
    lr: float = 0.05,
    seed: int = 0,
) -> None:
    """One worker of the hybrid side (``TF_CONFIG`` names it): MultiWorkerMirroredStrategy
    with the table on the PS tasks, global batches of ``global_batch`` cut over the workers,
    Adagrad at ``lr``; ``warmup`` untimed steps, then ``steps`` timed ones.  Its CPU seconds
    over the timed steps, and worker 0's reading of the PS tasks' (``RECSYS_PS_PIDS``: same
    host), go into ``out``."""
    import numpy as np

    import psflow as pf
    from psflow.keras.datasets import ctr

    data = dict(np.load(path))
    pf.random.set_seed(seed)  # worker 0's dense values win (broadcast), as the single process's
    strategy = pf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = psflow_model(pf, "ctr_hybrid", seed=seed)
        optimizer = pf.keras.optimizers.Adagrad(lr)
    ds = pf.data.Dataset.from_tensor_slices(((data["cat"], data["dense"]), data["y"]))
    iterator = iter(strategy.experimental_distribute_dataset(ds.batch(global_batch)))

    def replica_fn(xb, yb):
        with pf.GradientTape() as tape:
            per_example = pf.nn.sigmoid_cross_entropy_with_logits(
                labels=yb, logits=model(xb, training=True)
            )
            # each replica's share of the global batch's mean: the ring sums them
            loss = pf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(warmup):
        strategy.run(replica_fn, args=next(iterator))
    ps_pids = [int(p) for p in os.environ.get("RECSYS_PS_PIDS", "").split(",") if p]
    ps_cpu = sum(cpu_seconds(p) for p in ps_pids)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        strategy.run(replica_fn, args=next(iterator))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    ps_cpu = sum(cpu_seconds(p) for p in ps_pids) - ps_cpu
    test_x = (pf.constant(data["cat_test"]), pf.constant(data["dense_test"]))
    scores = model(test_x, training=False).numpy()
    with open(out, "w") as f:
        json.dump(
            {
                "examples_per_s": steps * global_batch / elapsed,
                "cpu_s": cpu,
                "ps_cpu_s": ps_cpu,
                "steps": steps,
                "lr": lr,
                "auc": ctr.roc_auc(data["y_test"], scores),
                "examples": (warmup + steps) * global_batch,
                "global_batch": global_batch,
            },
            f,
        )


def run_hybrid(
    path: str,
    env: dict[str, str],
    global_batch: int,
    warmup: int,
    steps: int,
    lr: float,
    batch: int,
    seed: int = 0,
) -> dict:
    """The hybrid side: 2 PS + 2 MultiWorkerMirroredStrategy workers, worker 0's figures,
    and the CPU milliseconds of each role (both workers, both PS tasks) per ``batch``
    examples (the async side's step) over the timed steps."""
    with _cluster.Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        ps = _cluster.psflow_cluster(procs, 2, 0, env)["ps"]
        ps_pids = ",".join(str(proc.pid) for proc in procs.procs[:2])
        workers = [f"127.0.0.1:{p}" for p in _cluster.free_ports(2)]
        outs = [os.path.join(tmp, f"w{i}.json") for i in range(2)]
        started = []
        for i, out in enumerate(outs):
            task = {"type": "worker", "index": i}
            tf_config = {"cluster": {"worker": workers, "ps": ps}, "task": task}
            args = [sys.executable, os.path.abspath(__file__), "--hybrid-worker", out]
            args += ["--data", path, "--batch", str(global_batch)]
            args += ["--warmup", str(warmup), "--steps", str(steps), "--lr", str(lr)]
            args += ["--seed", str(seed)]
            extra = {"TF_CONFIG": json.dumps(tf_config), "RECSYS_PS_PIDS": ps_pids}
            proc, _ = procs.start(args, None, {**env, **extra})
            started.append(proc)
        deadline = time.monotonic() + 600
        for proc in started:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"a hybrid worker exited with {code}")
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
        first = results[0]
        per = 1000 / (steps * global_batch / batch)  # ms per ``batch`` examples
        cpu = {"worker": per * sum(r["cpu_s"] for r in results), "ps": per * first["ps_cpu_s"]}
        cpu["total"] = cpu["worker"] + cpu["ps"]
        return {**first, "cpu_ms_per_batch": cpu}


TF_CHIEF = """
import json, os, sys, time
import numpy as np
import tensorflow as tf
spec, path, batch, steps, vocab, dim, hidden = json.loads(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:8])
d = np.load(path)
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
strategy = tf.distribute.ParameterServerStrategy(
    resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
# Plain tf.Variables and TensorFlow's own Adagrad kernels: Keras 3 layers cannot
# differentiate a partitioned (Sharded) variable under a GradientTape.
with strategy.scope():
    glorot = tf.keras.initializers.GlorotUniform(seed=1)
    params = [
        tf.Variable(tf.random.stateless_uniform((vocab, dim), (0, 1), -0.05, 0.05), name="emb"),
        tf.Variable(glorot((26 * dim + 13, hidden)), name="w1"),
        tf.Variable(tf.zeros((hidden,)), name="b1"),
        tf.Variable(glorot((hidden, 1)), name="w2"),
        tf.Variable(tf.zeros((1,)), name="b2"),
    ]
emb, w1, b1, w2, b2 = params
shards = lambda v: list(getattr(v, "variables", [v]))
flat_p = [s for v in params for s in shards(v)]
flat_a = []
for s in flat_p:  # each accumulator on its shard's PS, as Keras makes slots
    with strategy.scope(), strategy.extended.colocate_vars_with(s):
        flat_a.append(tf.Variable(tf.fill(s.shape, 0.1)))
assert [s.shape for s in flat_p] == [s.shape for s in flat_a]

def forward(cat, dense):
    e = tf.reshape(tf.nn.embedding_lookup(emb, cat), (-1, 26 * dim))
    h = tf.nn.relu(tf.matmul(tf.concat([e, dense], 1), w1) + b1)
    return tf.matmul(h, w2) + b2

cat, dense, y = d["cat_tf"], d["dense"], d["y"]
def dataset_fn(ctx):
    ds = tf.data.Dataset.from_tensor_slices(((cat, dense), y))
    return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(batch)
@tf.function
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)
iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
@tf.function
def step_fn(it):
    def replica_fn(xb, yb):
        with tf.GradientTape() as tape:
            logits = forward(*xb)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=yb, logits=logits))
        grads = tape.gradient(loss, flat_p)
        for v, a, g in zip(flat_p, flat_a, grads):
            if isinstance(g, tf.IndexedSlices):
                tf.raw_ops.ResourceSparseApplyAdagradV2(
                    var=v.handle, accum=a.handle, lr=0.05, epsilon=1e-7, grad=g.values, indices=g.indices)
            else:
                tf.raw_ops.ResourceApplyAdagradV2(
                    var=v.handle, accum=a.handle, lr=0.05, epsilon=1e-7, grad=g)
        return loss
    xb, yb = next(it)
    return strategy.run(replica_fn, args=(xb, yb))
for _ in range(5):
    coordinator.schedule(step_fn, args=(iterator,))
coordinator.join()
cpu0 = sum(os.times()[:2])
print("MARK start", flush=True)
start = time.perf_counter()
for _ in range(steps):
    coordinator.schedule(step_fn, args=(iterator,))
coordinator.join()
elapsed = time.perf_counter() - start
print("MARK end", flush=True)
chief_cpu = sum(os.times()[:2]) - cpu0
scores = forward(tf.constant(d["cat_tf_test"]), tf.constant(d["dense_test"])).numpy().ravel()
print("SCORES " + json.dumps(scores.tolist()), flush=True)
print("RESULT " + json.dumps({"examples_per_s": steps * batch / elapsed, "chief_cpu": chief_cpu}), flush=True)
time.sleep(0.5)
"""


def run_tensorflow(python: str, path: str, batch: int, steps: int) -> dict | None:
    """TensorFlow's side; None when it could not run."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
    with _cluster.Processes() as procs:
        spec = _tf_cluster(procs, python, env)
        ps_pids = [p.pid for p in procs.procs[:2]]
        roles = {"ps": ps_pids, "worker": [p.pid for p in procs.procs[2:4]]}
        chief = subprocess.Popen(
            [
                python,
                "-c",
                TF_CHIEF,
                json.dumps(spec),
                path,
                *map(str, (batch, steps, VOCAB, DIM, HIDDEN)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_cluster.child_env(env),
            cwd=_cluster.ROOT,
        )
        result, scores, rss = None, None, 0
        marks: dict[str, dict[str, float]] = {}
        deadline = time.monotonic() + 900
        for line in chief.stdout:
            if line.startswith("MARK "):  # the chief's timed phase starts or ends
                marks[line.split()[1]] = cpu_snapshot(roles)
            elif line.startswith("SCORES "):
                scores = json.loads(line[len("SCORES ") :])
                rss = sum(rss_bytes(p) for p in ps_pids)  # measured while the PS still run
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
            if time.monotonic() > deadline:
                break
        try:
            chief.wait(60)
        except subprocess.TimeoutExpired:
            chief.kill()
            chief.wait()
        if result is None:
            progress(f"TensorFlow run failed: {chief.stderr.read()[-2000:]}")
            return None
        result["scores"], result["ps_rss"] = scores, rss
        marks["start"]["chief"], marks["end"]["chief"] = 0.0, result.pop("chief_cpu")
        result["cpu_ms_per_step"] = cpu_ms_per_step(marks["start"], marks["end"], steps)
        return result


def _tf_cluster(procs: _cluster.Processes, python: str, env: dict) -> dict:
    ports = _cluster.free_ports(5)
    spec = {
        "ps": [f"127.0.0.1:{p}" for p in ports[:2]],
        "worker": [f"127.0.0.1:{p}" for p in ports[2:4]],
        "chief": [f"127.0.0.1:{ports[4]}"],
    }
    for job in ("ps", "worker"):
        for i in range(2):
            procs.start(
                [python, "-c", _cluster.TF_SERVER, json.dumps(spec), job, str(i)],
                "TF_READY",
                env,
                timeout=180,
            )
    return spec


def table_memory(rows: int) -> tuple[float, float, float]:
    """``(bytes per row, row + slot bytes, seconds)`` of a dynamic table of ``rows`` ids."""
    import numpy as np

    from psflow.ps.dynamic_table import DynamicTable, TableConfig

    table = DynamicTable(TableConfig("big", DIM, optimizer={"name": "adagrad"}, capacity=rows))
    start = time.perf_counter()
    chunk = 1 << 20
    for lo in range(0, rows, chunk):
        ids = np.arange(lo, min(rows, lo + chunk), dtype=np.int64) * 7919 - 12345
        table.lookup(ids)
    elapsed = time.perf_counter() - start
    assert table.stats().rows == rows
    return table.nbytes / rows, 2 * DIM * 4, elapsed


def median_cpu(runs: list[dict]) -> dict[str, float]:
    """The median over ``runs`` of each role's CPU milliseconds per step."""
    roles = runs[0]["cpu_ms_per_step"]
    return {r: statistics.median(run["cpu_ms_per_step"][r] for run in runs) for r in roles}


def emit_cpu(side: str, runs: list[dict]) -> None:
    """One JSON line per role: CPU milliseconds per step (median over ``runs``)."""
    for role, value in median_cpu(runs).items():
        emit(
            BENCH,
            f"{side}/{role}",
            "cpu_per_step",
            value,
            "ms",
            n=len(runs),
            runs=[run["cpu_ms_per_step"][role] for run in runs],
            measured="utime+stime of /proc/<pid>/stat over the timed steps, all threads",
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, a 1M-row memory check")
    p.add_argument("--no-tf", action="store_true", help="skip TensorFlow")
    p.add_argument(
        "--tf-python",
        default=sys.executable,
        help="the interpreter with TensorFlow (default: this one)",
    )
    p.add_argument("--batch", type=int, default=512, help="examples per step (both sides)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="psflow's initial weights and the training examples' order (0: the README's runs)",
    )
    p.add_argument("--hybrid-worker", help=argparse.SUPPRESS)  # internal: one hybrid worker
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=0.05, help=argparse.SUPPRESS)
    args = p.parse_args()
    batch = args.batch
    if args.hybrid_worker:
        hybrid_worker(
            args.data, batch, args.warmup, args.steps, args.hybrid_worker, args.lr, args.seed
        )
        return 0
    steps = 30 if args.quick else 200
    rounds = 1 if args.quick else 3
    big_rows = 1_000_000 if args.quick else 10_000_000
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    config = {
        "batch": batch,
        "steps": steps,
        "warmup_steps": 5,
        "rounds": rounds,
        "ps": 2,
        "workers": 2,
        "embedding_dim": DIM,
        "categorical": NUM_CAT,
        "dense_features": NUM_DENSE,
        "hidden": HIDDEN,
        "dense_params": DENSE_PARAMS,
        "optimizer": "adagrad(0.05)",
        "seed": args.seed,
        "rows_allocated_up_front": {
            "psflow": f"DynamicEmbedding capacity={CAPACITY_PER_PS} per PS (grows beyond)",
            "tensorflow": f"Embedding vocabulary {VOCAB} over 2 shards (fixed)",
        },
        "steps_per_closure": 1,
        "cores": os.cpu_count(),
        "threads": {
            "psflow": "BLAS/OpenMP 1 per process (+ gRPC pollers)",
            "tensorflow": "default intra/inter-op pools (one per core)",
        },
    }
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ctr.npz")
        progress("generating data")
        make_data(path, batch * (steps + 5), 20_000, args.seed)
        data = dict(np.load(path))
        has_tf = not args.no_tf and (
            args.tf_python != sys.executable or importlib.util.find_spec("tensorflow") is not None
        )
        if not has_tf:
            emit(BENCH, "tensorflow", "skipped", 0, "", reason="tensorflow is not installed")
        runs, tf_runs = [], []
        # equal examples to the async side's (warm-up included): the same global batch as
        # the single process (half the async per-worker batch), or the async per-worker batch
        # kept per replica (TensorFlow's default policy: twice the global batch, half the
        # steps), at the same learning rate and at twice it (the linear scaling rule a user
        # applies with the global batch: Goyal et al. 2017)
        twice = (steps + 5) // 2 - 2
        hybrid_cases = [
            ("hybrid", batch, 5, steps, 0.05),
            ("hybrid-2x", 2 * batch, 2, twice, 0.05),
            ("hybrid-2x-lr2x", 2 * batch, 2, twice, 0.1),
        ]
        hybrid_runs: dict[str, list[dict]] = {name: [] for name, *_ in hybrid_cases}
        for r in range(rounds):  # A B A B: drift on the shared machine hits both sides
            progress(f"round {r + 1}/{rounds}: psflow, 2 PS + 2 workers")
            with _cluster.Processes() as procs:
                cluster = _cluster.psflow_cluster(procs, 2, 2, env)
                pids = {
                    "ps": [proc.pid for proc in procs.procs[:2]],
                    "worker": [proc.pid for proc in procs.procs[2:4]],
                }
                runs.append(run_psflow(data, cluster, pids, batch, steps, args.seed))
            for name, global_batch, warmup, timed, lr in hybrid_cases:
                progress(
                    f"round {r + 1}/{rounds}: psflow hybrid, global batch {global_batch}, lr {lr}"
                )
                hybrid_runs[name].append(
                    run_hybrid(path, env, global_batch, warmup, timed, lr, batch, args.seed)
                )
            if has_tf:
                progress(f"round {r + 1}/{rounds}: TensorFlow, 2 PS + 2 workers")
                tf_out = run_tensorflow(args.tf_python, path, batch, steps)
                if tf_out is not None:
                    tf_runs.append(tf_out)
        ours = dict(runs[-1])
        ours["examples_per_s"] = statistics.median(r["examples_per_s"] for r in runs)
        hybrid = {}
        for name, results in hybrid_runs.items():
            hybrid[name] = dict(results[-1])
            hybrid[name]["examples_per_s"] = statistics.median(r["examples_per_s"] for r in results)
            hybrid[name]["runs"] = [r["examples_per_s"] for r in results]
            hybrid[name]["cpu_ms_per_batch"] = {
                role: statistics.median(r["cpu_ms_per_batch"][role] for r in results)
                for role in ("worker", "ps", "total")
            }
        theirs = None
        if tf_runs:
            theirs = dict(tf_runs[-1])
            theirs["examples_per_s"] = statistics.median(r["examples_per_s"] for r in tf_runs)
        progress("psflow: single process")
        single = single_process_auc(data, batch, steps, args.seed)
        progress(f"dynamic table of {big_rows:,} rows")
        per_row, row_slot, fill_s = table_memory(big_rows)

    from psflow.keras.datasets import ctr

    emit(
        BENCH,
        "psflow",
        "throughput",
        ours["examples_per_s"],
        "examples/s",
        batch=batch,
        steps=steps,
        n=len(runs),
        runs=[r["examples_per_s"] for r in runs],
        config=config,
    )
    emit(BENCH, "psflow", "bytes_per_step", ours["bytes_per_step"], "B", measured=True)
    emit_cpu("psflow", runs)
    emit(
        BENCH,
        "psflow",
        "ps_rpcs_per_step",
        ours["ps_rpcs_per_step"],
        "calls",
        counted="dense pulls + pushes + table lookups + table pushes served by the PS tasks",
    )
    emit(BENCH, "psflow", "ps_memory", ours["ps_rss"] / 2**20, "MiB", rows=ours["rows"])
    emit(BENCH, "psflow", "auc", ours["auc"], "", oracle=ours["auc_oracle"])
    emit(BENCH, "psflow-single-process", "auc", single, "")
    for name, h in hybrid.items():
        emit(
            BENCH,
            f"psflow-{name}",
            "throughput",
            h["examples_per_s"],
            "examples/s",
            global_batch=h["global_batch"],
            learning_rate=h["lr"],
            n=len(h["runs"]),
            runs=h["runs"],
            mode="MultiWorkerMirroredStrategy, 2 workers + 2 PS, table on the PS",
        )
        emit(
            BENCH,
            f"psflow-{name}",
            f"cpu_ms_per_{batch}_examples",
            h["cpu_ms_per_batch"]["total"],
            "ms",
            **{role: h["cpu_ms_per_batch"][role] for role in ("worker", "ps")},
        )
        emit(BENCH, f"psflow-{name}", "auc", h["auc"], "", examples=h["examples"])
        emit(
            BENCH,
            f"{name}-vs-async",
            "ratio",
            h["examples_per_s"] / ours["examples_per_s"],
            "x",
            a=f"psflow-{name}",
            b="psflow",
            auc_a=h["auc"],
            auc_b=ours["auc"],
            examples_a=h["examples"],
            examples_b=(steps + 5) * batch,
        )
    emit(BENCH, "hot-rows/off", "pulled_per_step", ours["hot_off"], "B")
    emit(BENCH, "hot-rows/on", "pulled_per_step", ours["hot_on"], "B", count=1024, refresh_every=10)
    emit(
        BENCH,
        "hot-rows",
        "ratio",
        ours["hot_on"] / ours["hot_off"],
        "x",
        a="cache-on",
        b="cache-off",
    )
    emit(
        BENCH,
        f"table/{big_rows}",
        "bytes_per_row",
        per_row,
        "B",
        row_and_slot=row_slot,
        bound=row_slot + 32,
        fill_s=fill_s,
    )
    tf_formula = batch * NUM_CAT * (DIM * 4 + DIM * 4 + 8) + 2 * 4 * DENSE_PARAMS
    ours_cpu = median_cpu(runs)
    rows = [
        ["examples/s", round(ours["examples_per_s"]), "-", "-"],
        *[
            [f"CPU ms/step {role}", round(ours_cpu[role], 1), "-", "-"]
            for role in ("chief", "worker", "ps", "total")
        ],
        ["bytes/step", round(ours["bytes_per_step"]), round(tf_formula), "-"],
        ["PS RSS MiB", round(ours["ps_rss"] / 2**20), "-", "-"],
        [f"AUC (single-process psflow {single:.4f})", round(ours["auc"], 4), "-", "-"],
    ]
    if theirs is not None:
        ratio = ours["examples_per_s"] / theirs["examples_per_s"]
        theirs_cpu = median_cpu(tf_runs)
        tf_auc = ctr.roc_auc(data["y_test"], np.array(theirs["scores"]))
        emit(
            BENCH,
            "tensorflow",
            "throughput",
            theirs["examples_per_s"],
            "examples/s",
            batch=batch,
            n=len(tf_runs),
            runs=[r["examples_per_s"] for r in tf_runs],
            config=config,
        )
        emit(BENCH, "throughput", "ratio", ratio, "x", a="psflow", b="tensorflow-pss")
        emit_cpu("tensorflow", tf_runs)
        emit(BENCH, "tensorflow", "bytes_per_step", tf_formula, "B", measured=False, formula=True)
        emit(BENCH, "tensorflow", "ps_memory", theirs["ps_rss"] / 2**20, "MiB", vocab=VOCAB)
        emit(BENCH, "tensorflow", "auc", tf_auc, "")
        rows = [
            [
                "examples/s",
                round(ours["examples_per_s"]),
                round(theirs["examples_per_s"]),
                round(ratio, 2),
            ],
            *[
                [
                    f"CPU ms/step {role}",
                    round(ours_cpu[role], 1),
                    round(theirs_cpu[role], 1),
                    round(ours_cpu[role] / max(theirs_cpu[role], 1e-9), 2),
                ]
                for role in ("chief", "worker", "ps", "total")
            ],
            [
                "bytes/step",
                round(ours["bytes_per_step"]),
                round(tf_formula),
                round(ours["bytes_per_step"] / tf_formula, 2),
            ],
            [
                "PS RSS MiB",
                round(ours["ps_rss"] / 2**20),
                round(theirs["ps_rss"] / 2**20),
                round(ours["ps_rss"] / max(theirs["ps_rss"], 1), 2),
            ],
            [
                f"AUC (single-process psflow {single:.4f})",
                round(ours["auc"], 4),
                round(tf_auc, 4),
                "-",
            ],
        ]
    table(["2 PS + 2 workers", "psflow", "TensorFlow", "ratio"], rows)
    table(
        [
            "2 PS + 2 workers, equal examples",
            "examples/s",
            "x async",
            "test AUC",
            "examples",
            f"CPU ms/{batch} ex (workers+PS)",
        ],
        [
            [
                f"async PS (batch {batch} per worker step, lr 0.05)",
                round(ours["examples_per_s"]),
                1.0,
                round(ours["auc"], 4),
                (steps + 5) * batch,
                f"{ours_cpu['worker'] + ours_cpu['ps']:.1f} "
                f"({ours_cpu['worker']:.1f}+{ours_cpu['ps']:.1f})",
            ],
            *[
                [
                    f"hybrid, sync global batch {h['global_batch']} "
                    f"({h['global_batch'] // 2} per worker), lr {h['lr']}",
                    round(h["examples_per_s"]),
                    round(h["examples_per_s"] / ours["examples_per_s"], 2),
                    round(h["auc"], 4),
                    h["examples"],
                    f"{h['cpu_ms_per_batch']['total']:.1f} ({h['cpu_ms_per_batch']['worker']:.1f}"
                    f"+{h['cpu_ms_per_batch']['ps']:.1f})",
                ]
                for h in hybrid.values()
            ],
        ],
    )
    table(
        ["other", "value"],
        [
            ["hot-row cache pulled bytes on/off", round(ours["hot_on"] / ours["hot_off"], 3)],
            [
                f"dynamic table bytes/row at {big_rows:,} rows (bound {row_slot + 32})",
                round(per_row, 1),
            ],
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
