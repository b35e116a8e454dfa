"""The two string hashes TensorFlow's hashing layers use, in pure Python, bit for bit.

- :func:`fingerprint64`: FarmHash's Fingerprint64 (the ``farmhashna`` 64-bit hash),
  which ``tf.strings.to_hash_bucket_fast`` and Keras's ``Hashing`` (no salt) and
  ``StringLookup`` (several OOV buckets) reduce modulo the bucket count.
- :func:`siphash24`: SipHash-2-4 with a 128-bit key, which
  ``tf.strings.to_hash_bucket_strong`` (``Hashing(salt=...)``) reduces likewise.

Both are implemented here from the published algorithms so psflow needs no
native extension; tests compare them with TensorFlow where it is installed.
Python integers are unbounded, so every 64-bit operation is masked by ``_M``.
They cost microseconds per string: layers hash each distinct value once.
"""

from __future__ import annotations

_M = (1 << 64) - 1
_K0 = 0xC3A5C85C97CB3127
_K1 = 0xB492B66FBE98F273
_K2 = 0x9AE16A3B2F90404F


def _fetch64(s: bytes, i: int) -> int:
    return int.from_bytes(s[i : i + 8], "little")


def _fetch32(s: bytes, i: int) -> int:
    return int.from_bytes(s[i : i + 4], "little")


def _rot(v: int, shift: int) -> int:
    return ((v >> shift) | (v << (64 - shift))) & _M if shift else v


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def _len16(u: int, v: int, mul: int) -> int:
    a = ((u ^ v) * mul) & _M
    a ^= a >> 47
    b = ((v ^ a) * mul) & _M
    b ^= b >> 47
    return (b * mul) & _M


def _len0to16(s: bytes) -> int:
    n = len(s)
    if n >= 8:
        mul = (_K2 + n * 2) & _M
        a = (_fetch64(s, 0) + _K2) & _M
        b = _fetch64(s, n - 8)
        c = (_rot(b, 37) * mul + a) & _M
        d = ((_rot(a, 25) + b) * mul) & _M
        return _len16(c, d, mul)
    if n >= 4:
        mul = (_K2 + n * 2) & _M
        a = _fetch32(s, 0)
        return _len16((n + (a << 3)) & _M, _fetch32(s, n - 4), mul)
    if n > 0:
        y = s[0] + (s[n >> 1] << 8)
        z = n + (s[n - 1] << 2)
        return (_shift_mix(((y * _K2) ^ (z * _K0)) & _M) * _K2) & _M
    return _K2


def _len17to32(s: bytes) -> int:
    n = len(s)
    mul = (_K2 + n * 2) & _M
    a = (_fetch64(s, 0) * _K1) & _M
    b = _fetch64(s, 8)
    c = (_fetch64(s, n - 8) * mul) & _M
    d = (_fetch64(s, n - 16) * _K2) & _M
    return _len16(
        (_rot((a + b) & _M, 43) + _rot(c, 30) + d) & _M,
        (a + _rot((b + _K2) & _M, 18) + c) & _M,
        mul,
    )


def _len33to64(s: bytes) -> int:
    n = len(s)
    mul = (_K2 + n * 2) & _M
    a = (_fetch64(s, 0) * _K2) & _M
    b = _fetch64(s, 8)
    c = (_fetch64(s, n - 8) * mul) & _M
    d = (_fetch64(s, n - 16) * _K2) & _M
    y = (_rot((a + b) & _M, 43) + _rot(c, 30) + d) & _M
    z = _len16(y, (a + _rot((b + _K2) & _M, 18) + c) & _M, mul)
    e = (_fetch64(s, 16) * mul) & _M
    f = _fetch64(s, 24)
    g = ((y + _fetch64(s, n - 32)) * mul) & _M
    h = ((z + _fetch64(s, n - 24)) * mul) & _M
    return _len16(
        (_rot((e + f) & _M, 43) + _rot(g, 30) + h) & _M,
        (e + _rot((f + a) & _M, 18) + g) & _M,
        mul,
    )


def _weak32(s: bytes, i: int, a: int, b: int) -> tuple[int, int]:
    """Two 64-bit lanes from 32 bytes at ``i`` and two seeds."""
    w, x, y, z = (_fetch64(s, i + k) for k in (0, 8, 16, 24))
    a = (a + w) & _M
    b = _rot((b + a + z) & _M, 21)
    c = a
    a = (a + x + y) & _M
    b = (b + _rot(a, 44)) & _M
    return (a + z) & _M, (b + c) & _M


def fingerprint64(data: bytes) -> int:
    """FarmHash Fingerprint64 of ``data``, as an unsigned 64-bit integer."""
    s = bytes(data)
    n = len(s)
    if n <= 16:
        return _len0to16(s)
    if n <= 32:
        return _len17to32(s)
    if n <= 64:
        return _len33to64(s)
    # longer inputs: a 64-byte block loop over three lanes, then the last 64 bytes
    seed = 81
    x = seed
    y = (seed * _K1 + 113) & _M
    z = (_shift_mix((y * _K2 + 113) & _M) * _K2) & _M
    v0 = v1 = w0 = w1 = 0
    x = (x * _K2 + _fetch64(s, 0)) & _M
    end = ((n - 1) // 64) * 64
    last64 = end + ((n - 1) & 63) - 63
    pos = 0
    while True:
        x = (_rot((x + y + v0 + _fetch64(s, pos + 8)) & _M, 37) * _K1) & _M
        y = (_rot((y + v1 + _fetch64(s, pos + 48)) & _M, 42) * _K1) & _M
        x ^= w1
        y = (y + v0 + _fetch64(s, pos + 40)) & _M
        z = (_rot((z + w0) & _M, 33) * _K1) & _M
        v0, v1 = _weak32(s, pos, (v1 * _K1) & _M, (x + w0) & _M)
        w0, w1 = _weak32(s, pos + 32, (z + w1) & _M, (y + _fetch64(s, pos + 16)) & _M)
        z, x = x, z
        pos += 64
        if pos == end:
            break
    mul = (_K1 + ((z & 0xFF) << 1)) & _M
    pos = last64
    w0 = (w0 + ((n - 1) & 63)) & _M
    v0 = (v0 + w0) & _M
    w0 = (w0 + v0) & _M
    x = (_rot((x + y + v0 + _fetch64(s, pos + 8)) & _M, 37) * mul) & _M
    y = (_rot((y + v1 + _fetch64(s, pos + 48)) & _M, 42) * mul) & _M
    x ^= (w1 * 9) & _M
    y = (y + v0 * 9 + _fetch64(s, pos + 40)) & _M
    z = (_rot((z + w0) & _M, 33) * mul) & _M
    v0, v1 = _weak32(s, pos, (v1 * mul) & _M, (x + w0) & _M)
    w0, w1 = _weak32(s, pos + 32, (z + w1) & _M, (y + _fetch64(s, pos + 16)) & _M)
    z, x = x, z
    return _len16(
        (_len16(v0, w0, mul) + _shift_mix(y) * _K0 + z) & _M,
        (_len16(v1, w1, mul) + x) & _M,
        mul,
    )


def _sip_rounds(v: list[int], rounds: int) -> None:
    v0, v1, v2, v3 = v
    for _ in range(rounds):
        v0 = (v0 + v1) & _M
        v1 = _rot_left(v1, 13) ^ v0
        v0 = _rot_left(v0, 32)
        v2 = (v2 + v3) & _M
        v3 = _rot_left(v3, 16) ^ v2
        v0 = (v0 + v3) & _M
        v3 = _rot_left(v3, 21) ^ v0
        v2 = (v2 + v1) & _M
        v1 = _rot_left(v1, 17) ^ v2
        v2 = _rot_left(v2, 32)
    v[:] = [v0, v1, v2, v3]


def _rot_left(v: int, shift: int) -> int:
    return ((v << shift) | (v >> (64 - shift))) & _M


def siphash24(key: tuple[int, int], data: bytes) -> int:
    """SipHash-2-4 of ``data`` under the 128-bit key ``(k0, k1)`` (each taken mod 2**64)."""
    k0, k1 = key[0] & _M, key[1] & _M
    v = [
        k0 ^ 0x736F6D6570736575,
        k1 ^ 0x646F72616E646F6D,
        k0 ^ 0x6C7967656E657261,
        k1 ^ 0x7465646279746573,
    ]
    s = bytes(data)
    full = len(s) - len(s) % 8
    for i in range(0, full, 8):  # compression: two rounds per 8-byte word
        m = _fetch64(s, i)
        v[3] ^= m
        _sip_rounds(v, 2)
        v[0] ^= m
    last = ((len(s) & 0xFF) << 56) | int.from_bytes(s[full:], "little")
    v[3] ^= last
    _sip_rounds(v, 2)
    v[0] ^= last
    v[2] ^= 0xFF  # finalization: four rounds
    _sip_rounds(v, 4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]
