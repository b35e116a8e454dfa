"""A restore gives every table shard its own optimizer step back.

Shards step independently: a push reaches only the shards that own some of its
ids, so after uneven traffic ``ps:0``'s table shard has taken more steps than
``ps:1``'s.  Adam's bias correction depends on that step, so a checkpoint of two
PS tasks restored onto two PS tasks continues bit for bit like the run that was
never interrupted only if each shard gets back its own step (not the largest
one).  Restoring onto another number of shards merges parts: that keeps the
largest step (documented on ``DynamicTable.from_parts``).
"""

from __future__ import annotations

import numpy as np
import pytest

from psflow.ps.dynamic_table import DynamicTable, TableConfig
from psflow.ps.key_index import shard_of
from psflow.ps.tables import TableRegistry
from psflow.transport.embedding_client import EmbeddingClient

DIM = 4
ADAM = {"name": "adam", "learning_rate": 0.01}


def _ids_of(shard: int, count: int, num_shards: int = 2) -> np.ndarray:
    """``count`` ids that shard ``shard`` of ``num_shards`` owns."""
    ids = np.arange(1, 50 * count, dtype=np.int64) * 7919
    return ids[shard_of(ids, num_shards) == shard][:count]


def _pushes(seed: int, steps: int, ids: np.ndarray):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = np.unique(rng.choice(ids, size=6))
        yield batch, rng.standard_normal((batch.size, DIM)).astype(np.float32)


def _uneven(client, ids0: np.ndarray, both: np.ndarray) -> None:
    """Six pushes that reach only shard 0, then three that reach both."""
    for batch, grads in _pushes(1, 6, ids0):
        client.lookup("emb", batch)
        client.push("emb", batch, grads)
    for batch, grads in _pushes(2, 3, both):
        client.lookup("emb", batch)
        client.push("emb", batch, grads)


@pytest.mark.slow
def test_two_ps_checkpoint_restored_onto_two_ps_continues_bit_for_bit_with_adam(start_ps, tmp_path):
    servers = [start_ps("--task", f"ps:{i}") for i in range(2)]
    config = TableConfig("emb", DIM, seed=5, optimizer=ADAM)
    ids0, ids1 = _ids_of(0, 10), _ids_of(1, 10)
    both = np.concatenate([ids0, ids1])
    with EmbeddingClient([s.address for s in servers], timeout=30) as client:
        client.create_table(config)
        _uneven(client, ids0, both)
        steps = [s["emb"].step for s in client.stats()]
        assert steps == [9, 3], steps  # the shards stepped unevenly
        client.save(str(tmp_path / "ckpt"))

        def more() -> np.ndarray:
            for batch, grads in _pushes(3, 4, both):
                client.push("emb", batch, grads)
            return client.lookup("emb", both)

        uninterrupted = more()
        uninterrupted_steps = [s["emb"].step for s in client.stats()]
        client.restore(str(tmp_path / "ckpt"))
        assert [s["emb"].step for s in client.stats()] == steps
        resumed = more()
        assert [s["emb"].step for s in client.stats()] == uninterrupted_steps
        assert resumed.tobytes() == uninterrupted.tobytes()


def test_restore_onto_another_number_of_shards_keeps_the_largest_step(tmp_path):
    """Merging parts cannot split a step by id: every new shard takes the largest."""
    old = [TableRegistry(f"ps:{i}") for i in range(2)]
    config = TableConfig("emb", DIM, seed=5, optimizer=ADAM)
    for s, registry in enumerate(old):
        registry.create(config, s, 2)
    ids0 = _ids_of(0, 5)
    for batch, grads in _pushes(1, 4, ids0):
        old[0].lookup("emb", batch)
        old[0].push("emb", batch, grads)
    for s, registry in enumerate(old):
        registry.save(str(tmp_path), f"ps-{s}")
    new = [TableRegistry(f"ps:{i}") for i in range(3)]
    for s, registry in enumerate(new):
        registry.restore(str(tmp_path), s, 3)
    assert [r.table("emb").step for r in new] == [4, 4, 4]
    same = [TableRegistry(f"ps:{i}") for i in range(2)]
    for s, registry in enumerate(same):
        registry.restore(str(tmp_path), s, 2)
    assert [r.table("emb").step for r in same] == [4, 0]
    assert isinstance(same[1].table("emb"), DynamicTable)
