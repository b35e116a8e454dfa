"""Collaborative filtering for movie recommendations, under ParameterServerStrategy.

The shape of Keras's tutorial of that name: a user embedding and a movie
embedding, their dot product plus a per-user and a per-movie bias, a sigmoid,
trained with binary cross-entropy on ratings scaled to [0, 1]. The ratings are
drawn here, in process (no download): a hidden low-rank taste model plus
per-user and per-movie offsets, observed on a sparse random set of
(user, movie) pairs, rounded to half stars from 0.5 to 5.

``--embedding embedding`` (the tutorial's way): users and movies are first
mapped to indices 0..n-1 and looked up in ``Embedding`` tables of a declared
size. ``--embedding dynamic``: the raw ids (large int64 values with no
vocabulary) go straight into ``DynamicEmbedding`` tables on the PS, which
create a row the first time an id is seen.

Run embedded with ``python examples/collaborative_filtering.py`` or on a
cluster with ``psflow local --ps 2 --workers 2 examples/collaborative_filtering.py
--embedding dynamic``. The last line is a JSON report; the exit status is 1
when the final validation loss does not beat predicting the mean rating.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import psflow as tf


def synthetic_ratings(
    num_users: int, num_movies: int, num_ratings: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(user_ids, movie_ids, ratings)``: int64 ids with no structure, ratings 0.5..5.

    Ids are distinct random values below 2**62 (as a hashed or database id
    would be); each rating is a hidden rank-4 affinity plus user and movie
    offsets and noise, squashed to 0.5..5 and rounded to half stars.
    """
    rng = np.random.default_rng(seed)
    user_ids = rng.choice(2**62, size=num_users, replace=False).astype(np.int64)
    movie_ids = rng.choice(2**62, size=num_movies, replace=False).astype(np.int64)
    taste_u = rng.normal(0.0, 1.0, size=(num_users, 4))
    taste_m = rng.normal(0.0, 1.0, size=(num_movies, 4))
    offset_u = rng.normal(0.0, 0.5, size=num_users)
    offset_m = rng.normal(0.0, 0.7, size=num_movies)
    u = rng.integers(0, num_users, size=num_ratings)
    m = rng.integers(0, num_movies, size=num_ratings)
    score = (taste_u[u] * taste_m[m]).sum(axis=1) / 2.0 + offset_u[u] + offset_m[m]
    score += rng.normal(0.0, 0.3, size=num_ratings)
    stars = 0.5 + 4.5 / (1.0 + np.exp(-score))
    ratings = np.clip(np.round(stars * 2.0) / 2.0, 0.5, 5.0)
    return user_ids[u], movie_ids[m], ratings


class RecommenderNet(tf.keras.Model):
    """User and movie vectors, their dot product plus both biases, a sigmoid."""

    def __init__(
        self, embedding: str, num_users: int, num_movies: int, embedding_size: int
    ) -> None:
        super().__init__()
        # He-normal vectors with a little L2 and default-initialised biases, as the tutorial.
        if embedding == "embedding":
            self.user_embedding = tf.keras.layers.Embedding(
                num_users,
                embedding_size,
                embeddings_initializer="he_normal",
                embeddings_regularizer=tf.keras.regularizers.l2(1e-6),
            )
            self.user_bias = tf.keras.layers.Embedding(num_users, 1)
            self.movie_embedding = tf.keras.layers.Embedding(
                num_movies,
                embedding_size,
                embeddings_initializer="he_normal",
                embeddings_regularizer=tf.keras.regularizers.l2(1e-6),
            )
            self.movie_bias = tf.keras.layers.Embedding(num_movies, 1)
        else:  # rows appear as ids are seen: no table size, no vocabulary, no regularizer
            he_std = (2.0 / embedding_size) ** 0.5
            self.user_embedding = tf.keras.layers.DynamicEmbedding(
                embedding_size, initializer="normal", init_scale=he_std, table_name="cf_user"
            )
            self.user_bias = tf.keras.layers.DynamicEmbedding(1, table_name="cf_user_bias")
            self.movie_embedding = tf.keras.layers.DynamicEmbedding(
                embedding_size, initializer="normal", init_scale=he_std, table_name="cf_movie"
            )
            self.movie_bias = tf.keras.layers.DynamicEmbedding(1, table_name="cf_movie_bias")

    def call(self, inputs, training=None):
        user, movie = inputs[:, 0], inputs[:, 1]
        user_vector = self.user_embedding(user)
        movie_vector = self.movie_embedding(movie)
        dot = tf.reduce_sum(user_vector * movie_vector, axis=1, keepdims=True)
        x = dot + self.user_bias(user) + self.movie_bias(movie)
        return tf.nn.sigmoid(x)


def binary_crossentropy(y: np.ndarray, p: np.ndarray) -> float:
    """Mean BCE of predictions ``p`` for soft labels ``y`` (Keras's clipping)."""
    p = np.clip(p, 1e-7, 1.0 - 1e-7)
    return float(np.mean(-(y * np.log(p) + (1.0 - y) * np.log(1.0 - p))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--embedding", choices=("embedding", "dynamic"), default="embedding")
    p.add_argument("--users", type=int, default=600)
    p.add_argument("--movies", type=int, default=400)
    p.add_argument("--ratings", type=int, default=40_000)
    p.add_argument("--embedding-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=0.003)
    args = p.parse_args(argv)

    tf.random.set_seed(0)
    users, movies, ratings = synthetic_ratings(args.users, args.movies, args.ratings)
    if args.embedding == "embedding":  # the tutorial's id -> index encoding
        users = np.unique(users, return_inverse=True)[1]
        movies = np.unique(movies, return_inverse=True)[1]
    x = np.stack([users, movies], axis=1).astype(np.int64)
    y = ((ratings - ratings.min()) / (ratings.max() - ratings.min())).astype(np.float32)
    y = y.reshape(-1, 1)
    split = int(0.9 * len(x))
    x_train, x_val, y_train, y_val = x[:split], x[split:], y[:split], y[split:]

    strategy = tf.distribute.ParameterServerStrategy()
    with strategy.scope():
        model = RecommenderNet(args.embedding, args.users, args.movies, args.embedding_size)
        model.compile(
            loss=tf.keras.losses.BinaryCrossentropy(),
            optimizer=tf.keras.optimizers.Adam(learning_rate=args.learning_rate),
        )
    history = model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_val, y_val),
        verbose=2,
    )
    val_loss = float(history.history["val_loss"][-1])
    baseline = binary_crossentropy(y_val, np.full_like(y_val, y_train.mean()))
    print(
        f"{args.embedding}: validation loss {val_loss:.4f}; "
        f"predicting the mean rating {baseline:.4f}"
    )
    print(json.dumps({"embedding": args.embedding, "val_loss": val_loss, "baseline": baseline}))
    return 0 if val_loss < baseline else 1


if __name__ == "__main__":
    sys.exit(main())
