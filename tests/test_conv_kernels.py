"""The CPU window kernels: both im2col layouts, the bias inside the GEMM, chunks of images,
the chunked max pool.

References: the direct float64 loop of tests/test_conv_ops.py (the definition),
central differences (tests/gradcheck.py), and the whole-batch patch-view product
the kernels replaced (float32, within tests/numerics.py's split tolerance: the
bias is now summed inside the GEMM). Determinism: the same call twice, and the
same call with one and with two kernel threads, give the same bits.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import psflow as pf
from psflow.ops import conv_cpu, conv_ops, kernel_pool, nn_ops, pool_ops
from psflow.ops.window_geometry import patch_view
from tests.gradcheck import check_gradients
from tests.numerics import assert_close_across_splits
from tests.test_conv_ops import _reference_conv2d
from tests.test_mirrored_training import logical_cpus

# input channels on both sides of the layout switch (position-major up to 4, then row-major)
CHANNELS = (1, conv_cpu.POSITION_MAJOR_MAX_CHANNELS, conv_cpu.POSITION_MAJOR_MAX_CHANNELS + 1, 8)
GEOMETRY = [(1, "VALID", 1), (2, "SAME", 1), (1, "SAME", 2), (3, "VALID", 1)]


def _layer(x, w, b, stride, padding, dil, relu):
    return conv_ops.conv_layer(x, w, b, 2, (stride, stride), padding, (dil, dil), relu)


@pytest.fixture(params=["whole batch", "chunks of one image"])
def chunking(request, monkeypatch):
    """Runs a test on both convolution paths: the batch as one chunk (the small tests' shapes
    take it by default) and chunks of one image each (what large batches take)."""
    if request.param == "chunks of one image":
        monkeypatch.setattr(conv_cpu, "IMAGE_CHUNK_BYTES", 1)
    return request.param


@pytest.fixture
def threads():
    """Sets this thread's kernel width for one test, and puts the default back."""
    yield kernel_pool.set_thread_width
    kernel_pool.set_thread_width(None)


@pytest.mark.parametrize("cin", CHANNELS)
@pytest.mark.parametrize(("stride", "padding", "dil"), GEOMETRY)
def test_fused_conv_matches_the_direct_loop_and_finite_differences(
    chunking, cin: int, stride: int, padding: str, dil: int
) -> None:
    rng = np.random.default_rng(cin * 31 + stride * 7 + dil)
    x = rng.standard_normal((2, 7, 6, cin))
    w = rng.standard_normal((3, 2, cin, 3))
    b = rng.standard_normal(3)
    got = _layer(x, w, b, stride, padding, dil, relu=True).numpy()
    want = np.maximum(_reference_conv2d(x, w, stride, padding, dil) + b, 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # without the ReLU, whose kink finite differences cannot cross
    check_gradients(lambda a, k, c: _layer(a, k, c, stride, padding, dil, relu=False), x, w, b)


@pytest.mark.parametrize("cin", CHANNELS)
def test_fused_conv_relu_gradient_masks_where_the_output_is_zero(chunking, cin: int) -> None:
    rng = np.random.default_rng(cin)
    x, w, b = (pf.constant(rng.standard_normal(s)) for s in ((3, 6, 6, cin), (3, 3, cin, 4), (4,)))
    u = rng.standard_normal((3, 4, 4, 4))
    with pf.GradientTape(persistent=True) as tape:
        tape.watch([x, w, b])
        fused = _layer(x, w, b, 1, "VALID", 1, relu=True)
        composed = pf.nn.relu(pf.nn.conv2d(x, w, 1, "VALID") + b)
    got = tape.gradient(fused, [x, w, b], output_gradients=pf.constant(u))
    want = tape.gradient(composed, [x, w, b], output_gradients=pf.constant(u))
    for g, r in zip(got, want):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-12, atol=1e-12)


def _whole_batch_patch_product(x, w, b, u):
    """The kernels' predecessor in float32: one patch-view copy, GEMM, bias, ReLU, and its VJP
    for the kernel and the bias."""
    n, h, wd, c = x.shape
    kh, kw, _, f = w.shape
    oh, ow = h - kh + 1, wd - kw + 1
    cols = patch_view(x, (oh, ow), (kh, kw), (1, 1), (1, 1)).reshape(n * oh * ow, kh * kw * c)
    z2 = cols @ w.reshape(-1, f)
    z2 += b
    np.maximum(z2, 0, out=z2)
    g2 = u.reshape(-1, f) * (z2 > 0)
    return z2.reshape(n, oh, ow, f), (cols.T @ g2).reshape(w.shape), g2.sum(axis=0)


@pytest.mark.parametrize("cin", (1, 8))
def test_fused_conv_agrees_with_the_whole_batch_product_it_replaced(chunking, cin: int) -> None:
    rng = np.random.default_rng(40 + cin)
    x = rng.standard_normal((16, 12, 12, cin), dtype=np.float32)
    w = rng.standard_normal((3, 3, cin, 8), dtype=np.float32)
    b = rng.standard_normal(8, dtype=np.float32)
    u = rng.standard_normal((16, 10, 10, 8), dtype=np.float32)
    kv, bv = pf.Variable(w), pf.Variable(b)
    with pf.GradientTape() as tape:
        y = _layer(pf.constant(x), kv, bv, 1, "VALID", 1, relu=True)
    dw, db = tape.gradient(y, [kv, bv], output_gradients=pf.constant(u))
    z, want_dw, want_db = _whole_batch_patch_product(x, w, b, u)
    assert_close_across_splits(y.numpy(), z)
    assert_close_across_splits(dw.numpy(), want_dw)
    assert_close_across_splits(db.numpy(), want_db)


def _conv_and_pool_step(x, w, b):
    kv, bv, xv = pf.Variable(w), pf.Variable(b), pf.constant(x)
    with pf.GradientTape() as tape:
        tape.watch(xv)
        y = pf.nn.max_pool2d(_layer(xv, kv, bv, 1, "SAME", 1, relu=True), 2, 2, "SAME")
    return [y.numpy()] + [g.numpy() for g in tape.gradient(y, [xv, kv, bv])]


@pytest.mark.parametrize("cin", (1, 8))
def test_kernels_give_the_same_bits_every_run_and_with_any_thread_count(
    chunking, threads, cin: int
) -> None:
    rng = np.random.default_rng(cin)
    x = rng.standard_normal((64, 15, 13, cin), dtype=np.float32)
    w = rng.standard_normal((3, 3, cin, 16), dtype=np.float32)
    b = rng.standard_normal(16, dtype=np.float32)
    threads(1)
    one = _conv_and_pool_step(x, w, b)
    threads(2)
    two = _conv_and_pool_step(x, w, b)
    again = _conv_and_pool_step(x, w, b)
    for a, c, d in zip(one, two, again):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(c, d)


def test_large_batches_take_chunks_of_whole_images_and_small_ones_the_whole_batch() -> None:
    # the tutorial CNN's first layer at batch 256: several chunks, each of whole images
    bounds = conv_cpu.image_chunks(256, 26 * 26, 10, 32, 4)
    assert len(bounds) > 1 and bounds[0][0] == 0 and bounds[-1][1] == 256
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert len(conv_cpu.image_chunks(2, 7 * 6, 7, 3, 8)) == 1


@pytest.mark.parametrize("cin", (1, 8))
def test_chunks_of_images_give_what_the_whole_batch_gives(monkeypatch, cin: int) -> None:
    rng = np.random.default_rng(70 + cin)
    x = rng.standard_normal((9, 11, 10, cin), dtype=np.float32)
    w = rng.standard_normal((3, 3, cin, 8), dtype=np.float32)
    b = rng.standard_normal(8, dtype=np.float32)

    def step():
        xv, kv, bv = pf.constant(x), pf.Variable(w), pf.Variable(b)
        with pf.GradientTape() as tape:
            tape.watch(xv)
            y = _layer(xv, kv, bv, 2, "SAME", 1, relu=True)
            loss = pf.reduce_sum(y * y)
        return [y.numpy()] + [g.numpy() for g in tape.gradient(loss, [xv, kv, bv])]

    whole = step()
    monkeypatch.setattr(conv_cpu, "IMAGE_CHUNK_BYTES", 1)
    chunked = step()
    # another split of the products' rows and of the kernel gradient's sum: a BLAS may
    # pick another kernel for another row count, so agreement within the split tolerance
    for got, want in zip(chunked, whole):
        assert_close_across_splits(got, want)


def _first_max_routing(x, k, s, pads, g):
    """Max-pool VJP by definition: each window's gradient to its first maximum (row-major)."""
    xp = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=-np.inf)
    dx = np.zeros_like(xp)
    n, oh, ow, c = g.shape
    for b, i, j, ch in np.ndindex(n, oh, ow, c):
        win = xp[b, i * s : i * s + k, j * s : j * s + k, ch]
        r, q = np.unravel_index(np.argmax(win), win.shape)  # argmax: the first of ties
        dx[b, i * s + r, j * s + q, ch] += g[b, i, j, ch]
    return dx[:, pads[0][0] : xp.shape[1] - pads[0][1], pads[1][0] : xp.shape[2] - pads[1][1]]


@pytest.mark.parametrize(
    ("shape", "k", "s", "padding", "pads"),
    [
        ((3, 8, 6, 5), 2, 2, "VALID", ((0, 0), (0, 0))),  # tiles the input exactly
        ((3, 7, 5, 5), 2, 2, "VALID", ((0, 0), (0, 0))),  # a last row and column left over
        ((3, 7, 5, 5), 2, 2, "SAME", ((0, 1), (0, 1))),  # padded to tile
        ((3, 9, 8, 2), 2, 3, "VALID", ((0, 0), (0, 0))),  # gaps between windows
    ],
)
@pytest.mark.parametrize("chunk_bytes", [pool_ops.POOL_CHUNK_BYTES, 1])
def test_disjoint_max_pool_routes_ties_to_the_first_maximum(
    monkeypatch, shape, k, s, padding, pads, chunk_bytes
) -> None:
    monkeypatch.setattr(pool_ops, "POOL_CHUNK_BYTES", chunk_bytes)  # 1: a chunk per image
    rng = np.random.default_rng(sum(shape))
    # a ReLU's output: many zero windows, so ties are common
    x = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)
    x[0, :2, :2, :] = 1.5  # one window entirely tied at a non-zero value
    xv = pf.constant(x)
    with pf.GradientTape() as tape:
        tape.watch(xv)
        y = pf.nn.max_pool2d(xv, k, s, padding)
    g = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    got = tape.gradient(y, xv, output_gradients=pf.constant(g)).numpy()
    np.testing.assert_array_equal(got, _first_max_routing(x, k, s, pads, g))


def test_chunks_depend_on_the_shape_only_and_cover_the_batch(threads) -> None:
    threads(1)
    one = kernel_pool.chunk_bounds(1000, 3000)
    threads(8)
    assert kernel_pool.chunk_bounds(1000, 3000) == one
    assert one[0][0] == 0 and one[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(one, one[1:]))
    assert kernel_pool.chunk_bounds(5, 10**9) == [(i, i + 1) for i in range(5)]


def test_run_chunks_returns_in_chunk_order_and_raises_a_chunks_error(threads) -> None:
    threads(3)
    bounds = kernel_pool.chunk_bounds(20, 1, target=3)
    assert kernel_pool.run_chunks(lambda lo, hi: (lo, hi), bounds) == bounds

    def failing(lo: int, hi: int) -> None:
        if lo == 9:
            raise pf.errors.InvalidArgumentError("chunk 9")

    with pytest.raises(pf.errors.InvalidArgumentError, match="chunk 9"):
        kernel_pool.run_chunks(failing, bounds)


def test_kernel_width_is_per_thread(threads) -> None:
    threads(1)
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(kernel_pool.width()))
    t.start()
    t.join(timeout=10)
    assert kernel_pool.width() == 1
    assert seen and seen[0] == max(1, pf.thread_budget.process_threads())


def test_mirrored_replicas_narrow_the_kernel_width() -> None:
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        widths = strategy.run(lambda: pf.constant(kernel_pool.width())).values
    share = max(1, pf.thread_budget.process_threads() // 2)
    assert [int(v.numpy()) for v in widths] == [share, share]


# (M, K, N): rows of a cut (M >= N), columns of b cut (N > M), the sum over K cut (K >> M, N)
GEMM_SHAPES = {"rows": (2000, 300, 64), "columns": (64, 300, 2000), "sum": (16, 100000, 32)}


@pytest.mark.parametrize("cut", sorted(GEMM_SHAPES))
def test_split_matmul_matches_numpy_and_keeps_its_bits_with_any_thread_count(threads, cut) -> None:
    m, k, n = GEMM_SHAPES[cut]
    assert 2 * m * k * n >= 2 * kernel_pool.GEMM_CHUNK_FLOPS  # cut in several chunks
    rng = np.random.default_rng(m + n)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    threads(1)
    one = kernel_pool.matmul(a, b)
    threads(2)
    two = kernel_pool.matmul(a, b)
    np.testing.assert_array_equal(one, two)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    # a k-long float32 sum errs by at most about k * eps * sum(|terms|)
    bound = k * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(two - exact) <= bound)


def test_split_matmul_without_blas_thread_control_still_multiplies(
    threads, monkeypatch: pytest.MonkeyPatch
) -> None:
    from psflow.distribute import replica_pool

    monkeypatch.setattr(replica_pool, "_blas_found", [None])
    threads(2)
    rng = np.random.default_rng(9)
    a = rng.standard_normal((600, 300))
    b = rng.standard_normal((300, 64))
    np.testing.assert_allclose(kernel_pool.matmul(a, b), a @ b, rtol=1e-12, atol=1e-12)


def test_split_matmul_puts_the_blas_thread_count_back(threads) -> None:
    from psflow.distribute import replica_pool

    before = replica_pool.blas_thread_count()
    if before is None:
        pytest.skip("the loaded BLAS has no settable thread count")
    threads(2)
    a = np.ones((600, 300), np.float32)
    kernel_pool.matmul(a, a.T[:, :64].copy())
    assert replica_pool.blas_thread_count() == before


def test_blas_held_to_one_nests_restores_and_keeps_the_products_bits(threads) -> None:
    from psflow.distribute import replica_pool

    before = replica_pool.blas_thread_count()
    if before is None:
        pytest.skip("the loaded BLAS has no settable thread count")
    threads(2)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((600, 300), dtype=np.float32)
    b = rng.standard_normal((300, 64), dtype=np.float32)
    small = rng.standard_normal((8, 300), dtype=np.float32)
    alone = [kernel_pool.matmul(a, b), kernel_pool.matmul(small, b)]
    with kernel_pool.blas_held_to_one() as held:
        assert held and replica_pool.blas_thread_count() == 1
        with kernel_pool.blas_held_to_one():  # nested: still held, nothing restored
            inside = [kernel_pool.matmul(a, b), kernel_pool.matmul(small, b)]
        assert replica_pool.blas_thread_count() == 1
        pair = kernel_pool.matmuls([(small, b), (small.T, small)])
    assert replica_pool.blas_thread_count() == before
    for x, y in zip(alone, inside):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))
    np.testing.assert_array_equal(pair[0].view(np.uint32), alone[1].view(np.uint32))
    with pytest.raises(ZeroDivisionError), kernel_pool.blas_held_to_one():
        1 / 0  # noqa: B018 - an error inside the block
    assert replica_pool.blas_thread_count() == before


def test_blas_held_to_one_sets_nothing_when_the_budget_is_one_thread(monkeypatch) -> None:
    """A process budgeted one BLAS thread (every PS worker) pays no library call to narrow
    and restore it around each product: only the count is read."""
    from psflow.distribute import replica_pool

    before = replica_pool.blas_thread_count()
    if before is None:
        pytest.skip("the loaded BLAS has no settable thread count")
    replica_pool.set_blas_thread_count(1)
    sets: list[int] = []
    real = replica_pool.set_blas_thread_count
    monkeypatch.setattr(replica_pool, "set_blas_thread_count", lambda n: sets.append(n) or real(n))
    try:
        a = np.ones((600, 300), np.float32)
        with kernel_pool.blas_held_to_one() as held:
            assert held
            kernel_pool.matmul(a, a.T[:, :64].copy())
        kernel_pool.matmul(a, a.T[:, :64].copy())
        assert sets == [] and replica_pool.blas_thread_count() == 1
    finally:
        real(before)


def test_fit_holds_the_blas_to_one_thread_per_step_and_puts_it_back() -> None:
    from psflow.distribute import replica_pool

    before = replica_pool.blas_thread_count()
    if before is None:
        pytest.skip("the loaded BLAS has no settable thread count")
    seen: list[int | None] = []

    class Probe(pf.keras.layers.Layer):
        def call(self, x, training=None):  # type: ignore[no-untyped-def]
            if training:  # a training step (not the model's build)
                seen.append(replica_pool.blas_thread_count())
            return x

    model = pf.keras.Sequential([pf.keras.Input((4,)), Probe(), pf.keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 4), np.float32)
    model.fit(x, np.zeros((8, 3), np.float32), batch_size=4, verbose=0)
    assert seen and all(c == 1 for c in seen)
    assert replica_pool.blas_thread_count() == before


@pytest.mark.parametrize("relu", [True, False])
def test_fused_dense_equals_matmul_add_relu_bitwise_at_model_sizes(relu: bool) -> None:
    # big enough that the products are cut into chunks (tests/test_gradients.py has small ones)
    rng = np.random.default_rng(5)
    x = pf.constant(rng.standard_normal((256, 784)).astype(np.float32))
    w = pf.Variable(rng.standard_normal((784, 512)).astype(np.float32) * 0.05)
    b = pf.Variable(rng.standard_normal(512).astype(np.float32))
    results = []
    for fused in (True, False):
        with pf.GradientTape() as tape:
            tape.watch(x)
            if fused:
                y = nn_ops.dense(x, w, b, relu=relu)
            else:
                y = pf.matmul(x, w) + b
                y = pf.nn.relu(y) if relu else y
            loss = pf.reduce_sum(y * y)
        results.append([y.numpy()] + [g.numpy() for g in tape.gradient(loss, [x, w, b])])
    for a, c in zip(*results):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("share", [1, 2])
def test_gemm_cut_is_even_long_enough_and_a_function_of_the_shapes(threads, share) -> None:
    for m, k, n in [(256, 784, 512), (64, 784, 512), (784, 256, 512), (2000, 300, 64), (9, 9, 9)]:
        threads(1)
        kind, bounds = kernel_pool.gemm_cut(m, k, n, share)
        threads(4)
        assert kernel_pool.gemm_cut(m, k, n, share) == (kind, bounds)
        along = m if kind == "rows" else n
        assert kind == ("rows" if m >= n else "columns")
        assert bounds[0][0] == 0 and bounds[-1][1] == along
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        parts = len(bounds)
        assert parts & (parts - 1) == 0  # a power of two: even on 2 or 4 threads
        if parts > 1:
            assert min(hi - lo for lo, hi in bounds) >= kernel_pool.GEMM_MIN_SPAN // 2
            assert 2 * m * k * n // parts >= kernel_pool.GEMM_CHUNK_FLOPS // share
    # the sum over K keeps its cut (its order of partial sums) whatever the share
    assert kernel_pool.gemm_cut(16, 100000, 32, 2) == kernel_pool.gemm_cut(16, 100000, 32)
    assert kernel_pool.gemm_cut(16, 100000, 32)[0] == "sum"


def test_the_mlp_products_at_batch_256_are_cut_once_per_core_of_two() -> None:
    # each chunk packs the other operand again: the 784-512-512-10 MLP's batch-256 step
    # took 2-12% more CPU with these products in 4 chunks than in 2
    for m, k, n in [(256, 784, 512), (256, 512, 512), (784, 256, 512)]:
        assert len(kernel_pool.gemm_cut(m, k, n)[1]) == 2
    # a backward pair: one chunk per product, the two side by side
    assert len(kernel_pool.gemm_cut(256, 512, 512, 2)[1]) == 1
    assert len(kernel_pool.gemm_cut(512, 256, 512, 2)[1]) == 1


def test_products_side_by_side_match_numpy_and_keep_their_bits_with_any_thread_count(
    threads,
) -> None:
    # a Dense layer's backward pair at batch 256 (input and weight gradients), and a sum-cut one
    rng = np.random.default_rng(11)
    g = rng.standard_normal((256, 512), dtype=np.float32)
    w = rng.standard_normal((512, 512), dtype=np.float32)
    a = rng.standard_normal((256, 512), dtype=np.float32)
    s = rng.standard_normal((100000, 16), dtype=np.float32)
    pairs = [[(g, w.T), (a.T, g)], [(s.T, s), (g, w)]]
    for products in pairs:
        threads(1)
        one = kernel_pool.matmuls(products)
        threads(2)
        two = kernel_pool.matmuls(products)
        again = kernel_pool.matmuls(products)
        for p, q, r, (x, y) in zip(one, two, again, products):
            np.testing.assert_array_equal(p, q)
            np.testing.assert_array_equal(q, r)
            exact = x.astype(np.float64) @ y.astype(np.float64)
            bound = x.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(y))
            assert np.all(np.abs(q - exact) <= bound)
    # a sum-cut product alone and beside another: the same cut, the same bits
    np.testing.assert_array_equal(kernel_pool.matmul(s.T, s), kernel_pool.matmuls(pairs[1])[0])


def test_dense_backward_runs_both_products_and_skips_the_input_gradient_of_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(2)
    x = pf.constant(rng.standard_normal((64, 784)).astype(np.float32))
    w1 = pf.Variable(rng.standard_normal((784, 512)).astype(np.float32) * 0.05)
    w2 = pf.Variable(rng.standard_normal((512, 10)).astype(np.float32) * 0.05)
    calls: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []
    single: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real_pair, real_one = kernel_pool.matmuls, kernel_pool.matmul

    def pair(products):
        if len(products) > 1:  # kernel_pool.matmul comes here too, with one product
            calls.append([(p.shape, q.shape) for p, q in products])
        return real_pair(products)

    def one(p, q):
        single.append((p.shape, q.shape))
        return real_one(p, q)

    with pf.GradientTape() as tape:
        monkeypatch.setattr(kernel_pool, "matmul", one)
        monkeypatch.setattr(kernel_pool, "matmuls", pair)
        h = nn_ops.dense(x, w1, relu=True)
        loss = pf.reduce_sum(nn_ops.dense(h, w2) ** 2)
    assert calls == []  # the forward pass: one product per layer
    single.clear()
    tape.gradient(loss, [w1, w2])
    # the second layer: input and weight gradients side by side; the first: the weight's only
    # (its input is data, not watched: no (64, 512) @ (512, 784) product)
    assert calls == [[((64, 10), (10, 512)), ((512, 64), (64, 10))]]
    assert single == [((784, 64), (64, 512))]


@pytest.mark.parametrize("shape", [(256, 784, 512), (2000, 300, 64), (16, 100000, 32), (8, 8, 8)])
@pytest.mark.parametrize(("with_bias", "relu"), [(True, True), (True, False), (False, True)])
def test_dense_kernel_adds_bias_and_relu_per_chunk_with_the_bits_of_the_whole_array(
    threads, shape, with_bias: bool, relu: bool
) -> None:
    m, k, n = shape  # a column cut, a row cut, a sum cut, one call
    rng = np.random.default_rng(m + k)
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32) if with_bias else None
    threads(2)
    want = kernel_pool.matmul(a, w)
    if bias is not None:
        want = want + bias
    if relu:
        want = np.maximum(want, 0)
    got = kernel_pool.dense(a, w, bias, relu)
    np.testing.assert_array_equal(got, want)
    threads(1)
    np.testing.assert_array_equal(kernel_pool.dense(a, w, bias, relu), want)
