"""The conductor's block keys: a universal hash of each token prefix, computed for all of a
prompt's blocks at once (numpy), so a 32k-token prompt is keyed in tens of microseconds.

Who owns what: the keys exist only inside one conductor process (its
:class:`~kvstore.conductor.cacheindex.FleetCacheIndex` is rebuilt from the engines' events
at every start), so the hash's parameters are drawn at random per process
(:data:`HASH`) and never leave it.  They are not the pool's
:class:`~kvstore.keys.ChunkKey` (those are xxh3 chains, a contract with every client) and
need not be stable across processes or releases.

The function, per lane ``l`` (two lanes, each modulo the Mersenne prime ``p = 2**31 - 1``)::

    h_l(block)  = 1 + sum_k a_{l,k} * x_k                (mod p)
    key_l(i)    = b_l * key_l(i-1) + h_l(block i)        (mod p),   key_l(-1) = seed_l

where ``x`` is the block's tokens as little-endian 16-bit halves (token 0's low half, its
high half, token 1's low half, ...),
``a_{l,k}`` random coefficients per block size and ``b_l`` a random base.  The key of
block ``i`` is ``key_0(i) | key_1(i) << 31``, a 62-bit int, and names the whole prefix up
to block ``i``.  Both stages are universal hashes of their input (multilinear, then a
polynomial in the block hashes), so two different prefixes of ``n`` blocks share a key
with probability at most about ``(n/p)**2`` whatever their tokens, for prompts not chosen
with the parameters in hand (an adversary who cannot read the conductor's memory cannot
aim for collisions).  A collision would only misdirect a routing credit: engines load
nothing by these keys.

Vectorised as: block hashes by float64 matrix products over 32 halves at a time (exact:
32 products of a 16-bit half and a 31-bit coefficient sum below 2**53; the partial sums,
each below 2**52, are added as integers and reduced every 2**11 of them), then
``key(i) = b**(i+1) * (seed + sum_{j<=i} h(j) * b**-(j+1))`` by one cumulative sum.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import xxhash

P = (1 << 31) - 1
LANES = 2
_TERMS = 32  # 16-bit halves per exact float64 product: 32 terms below 2**47 sum below 2**53


class PrefixHash:
    """The hash's parameters (see the module docstring).  Thread-safe: parameters are
    immutable once drawn; the power tables grow under a lock and are only replaced, never
    written in place, so readers see a consistent table."""

    def __init__(self, secret: int | None = None) -> None:
        self._secret = int.from_bytes(os.urandom(16), "little") if secret is None else secret
        rng = np.random.default_rng([self._secret, 0])
        self.base = rng.integers(2, P, size=LANES, dtype=np.uint64)
        self.inv = np.array([pow(int(b), P - 2, P) for b in self.base], dtype=np.uint64)
        self._coef: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._pow = np.ones((LANES, 1), dtype=np.uint64)  # [:, i] = base**i
        self._ipow = np.ones((LANES, 1), dtype=np.uint64)  # [:, i] = base**-i

    def coefficients(self, block_size: int) -> np.ndarray:
        """``(2 * block_size, LANES)`` float64: the multilinear hash's coefficients."""
        c = self._coef.get(block_size)
        if c is None:
            rng = np.random.default_rng([self._secret, 1, block_size])
            c = rng.integers(1, P, size=(2 * block_size, LANES), dtype=np.uint64).astype(np.float64)
            with self._lock:
                c = self._coef.setdefault(block_size, c)
        return c

    def powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(base**i, base**-i)`` for ``i`` in ``0..n`` (``(LANES, n+1)`` uint64 each)."""
        pw, ipw = self._pow, self._ipow
        if pw.shape[1] > n:
            return pw, ipw
        with self._lock:
            pw, ipw = self._pow, self._ipow
            have = pw.shape[1]
            if have <= n:
                want = max(n + 1, 2 * have, 1024)
                new, inew = np.empty((LANES, want), np.uint64), np.empty((LANES, want), np.uint64)
                new[:, :have], inew[:, :have] = pw, ipw
                cur = have
                while cur < want:  # [cur, cur+m) = [0, m) times base**cur: a doubling per step
                    m = min(cur, want - cur)
                    step = new[:, cur - 1] * self.base % P
                    istep = inew[:, cur - 1] * self.inv % P
                    new[:, cur : cur + m] = new[:, :m] * step[:, None] % P
                    inew[:, cur : cur + m] = inew[:, :m] * istep[:, None] % P
                    cur += m
                self._pow, self._ipow = pw, ipw = new, inew
        return pw, ipw

    def block_hashes(self, tokens: np.ndarray, block_size: int) -> np.ndarray:
        """``(LANES, blocks)`` uint64: ``h(block)`` of each full block of ``tokens`` (``<u4``)."""
        nb = len(tokens) // block_size
        halves = tokens[: nb * block_size].view("<u2").reshape(nb, 2 * block_size)
        coef = self.coefficients(block_size)
        acc = np.ones((nb, LANES), dtype=np.uint64)
        for g in range(0, 2 * block_size, _TERMS):  # exact products: see the module docstring
            acc += (halves[:, g : g + _TERMS].astype(np.float64) @ coef[g : g + _TERMS]).astype(np.uint64)
            if g // _TERMS % 2048 == 2047:  # 2**11 partial sums below 2**52 each: reduce before overflow
                acc %= P
        acc %= P
        return acc.T

    def keys(self, tokens: np.ndarray, block_size: int, seed: int) -> list[int]:
        """The key of every full block of ``tokens`` (``<u4``), the chain starting from
        ``seed`` (a key, or :meth:`seed`'s value): one int per block."""
        out: list[int] = self.packed(tokens, block_size, seed).tolist()
        return out

    def packed(self, tokens: np.ndarray, block_size: int, seed: int) -> np.ndarray:
        """:meth:`keys` as a uint64 array (turning keys into ints costs as much as hashing)."""
        nb = len(tokens) // block_size
        if nb == 0:
            return np.empty(0, dtype=np.uint64)
        h = self.block_hashes(tokens, block_size)
        pw, ipw = self.powers(nb)
        s = h * ipw[:, 1 : nb + 1] % P  # < 2**62
        s[:, 0] += np.array([seed & P, seed >> 31], dtype=np.uint64) % P
        np.cumsum(s, axis=1, out=s)  # < nb * 2**31: exact below 2**33 blocks
        s %= P
        s = s * pw[:, 1 : nb + 1] % P
        packed: np.ndarray = s[0] | (s[1] << np.uint64(31))
        return packed

    def seed(self, domain: bytes) -> int:
        """A chain's starting key for ``domain`` (the LoRA name's bytes): both lanes below ``p``."""
        h = xxhash.xxh3_128_intdigest(domain, seed=self._secret & ((1 << 64) - 1))
        return (h & 0xFFFFFFFFFFFF) % P | ((h >> 64) % P) << 31


HASH = PrefixHash()
"""This process's hash (its parameters are drawn when the module is imported)."""
