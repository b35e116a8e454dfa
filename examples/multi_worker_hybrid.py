"""Hybrid mode: synchronous workers with the embedding table on a parameter server.

``TF_CONFIG`` lists ``worker`` *and* ``ps`` tasks: ``MultiWorkerMirroredStrategy``
mirrors the dense layers and all-reduces their gradients between the workers,
while the ``DynamicEmbedding`` table lives on the PS task; each worker looks its
rows up there, and every step's table gradient (the whole global batch's) is
applied on the PS once.  Every worker prints the same losses and the same row.

Run a PS and two workers on loopback::

    psflow local --mode multi-worker --ps 1 --workers 2 examples/multi_worker_hybrid.py

or by hand::

    python -m ps_server --port 7000 & sleep 3
    for i in 0 1; do
      TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:7100", "127.0.0.1:7101"],
                              "ps": ["127.0.0.1:7000"]},
                  "task": {"type": "worker", "index": '$i'}}' \\
        python examples/multi_worker_hybrid.py &
    done; wait %2 %3; kill %1
"""

import numpy as np

import psflow as pf

GLOBAL_BATCH = 64
strategy = pf.distribute.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.task_id

rng = np.random.default_rng(0)
users = rng.integers(0, 10**12, 50)[rng.integers(0, 50, 1024)]  # int64 ids, no vocabulary
clicked = (users % 3 == 0).astype(np.float32)[:, None]
dataset = pf.data.Dataset.from_tensor_slices((users, clicked)).batch(GLOBAL_BATCH)

with strategy.scope():
    pf.random.set_seed(0)
    model = pf.keras.Sequential(
        [
            pf.keras.layers.DynamicEmbedding(8, table_name="users", seed=1),  # on the PS
            pf.keras.layers.Dense(8, activation="relu"),  # mirrored
            pf.keras.layers.Dense(1),
        ]
    )
    optimizer = pf.keras.optimizers.Adagrad(0.1)
    loss_object = pf.keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")


def train_step(inputs):
    ids, labels = inputs
    with pf.GradientTape() as tape:
        per_example = loss_object(labels, model(ids, training=True))
        loss = pf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


for epoch in range(3):
    total = 0.0
    for batch in strategy.experimental_distribute_dataset(dataset):
        total += float(strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None))
    print(f"worker {rank}: epoch {epoch} loss {total:.4f}")
row = np.asarray(model.layers[0].table.lookup(users[:1], training=False))
print(f"worker {rank}: row of user {users[0]} starts {[round(float(v), 4) for v in row[0, :3]]}")
