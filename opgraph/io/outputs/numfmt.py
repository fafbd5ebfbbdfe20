"""Numbers to CSV text a whole column at a time, with numpy (Python's `%` is ~150 ns a number).

    csv_block([np.array([8192, 16384]), np.array([0.5550716604534, 1.0277])])
    # b"8192,5.55071660453e-01\\n16384,1.02770000000e+00\\n"

Invariant: an integer column prints as `%d` would; a float column as `%.11e` would (12
significant digits), to within one unit in the last digit (numpy rounds the scaled binary value,
Python the exact decimal one). A column with values numpy cannot scale safely (non-finite, or
beyond 1e±290) is formatted by Python instead, in the same `%.11e` form.
"""

from __future__ import annotations

import numpy as np

# "0000" ... "9999" as bytes, and "e-399" ... "e+399" padded with NUL, which `csv_block` drops.
_DIGITS4 = np.frombuffer("".join(f"{i:04d}" for i in range(10000)).encode(),
                         dtype=np.uint8).reshape(10000, 4)
_EXP_BIAS = 400
_EXPONENTS = np.zeros((2 * _EXP_BIAS, 5), dtype=np.uint8)
for _e in range(-_EXP_BIAS, _EXP_BIAS):
    _text = f"e{_e:+03d}".encode()
    _EXPONENTS[_e + _EXP_BIAS, :len(_text)] = list(_text)
_POWERS = 10 ** np.arange(19, dtype=np.int64)
_COMMA, _NEWLINE, _MINUS, _DOT, _ZERO = (ord(c) for c in ",\n-.0")


def int_bytes(values) -> np.ndarray:
    """(n, 20) NUL-padded ASCII of whole numbers (|v| < 1e19), right-aligned."""
    v = np.asarray(values, dtype=np.int64)
    a = np.abs(v)
    groups, x = [], a.copy()
    for _ in range(5):  # 4 digits at a time, least significant first
        groups.append(x % 10000)
        x //= 10000
    out = np.concatenate([_DIGITS4[g] for g in reversed(groups)], axis=1)
    digits = np.maximum(np.searchsorted(_POWERS, a, side="right"), 1)
    out[np.arange(20)[None, :] < (20 - digits)[:, None]] = 0
    negative = v < 0
    if negative.any():
        rows = np.nonzero(negative)[0]
        out[rows, 19 - digits[rows]] = _MINUS
    return out


def float_bytes(values) -> np.ndarray:
    """(n, 19) NUL-padded ASCII of floats in `%.11e` form."""
    v = np.asarray(values, dtype=float)
    a = np.abs(v)
    zero = a == 0
    scaled = np.where(zero, 1.0, a)
    if not (np.isfinite(scaled).all() and (scaled > 1e-290).all() and (scaled < 1e290).all()):
        return _python_floats(v)
    e = np.floor(np.log10(scaled)).astype(np.int64)
    m = np.rint(scaled * 10.0 ** (11 - e)).astype(np.int64)  # 12 digits, if e was right
    high = m >= 10 ** 12
    if high.any():
        m[high] = (m[high] + 5) // 10
        e[high] += 1
    low = m < 10 ** 11
    if low.any():
        m[low] *= 10
        e[low] -= 1
    g0 = m // 100_000_000
    rest = m - g0 * 100_000_000
    g1 = rest // 10_000
    g2 = rest - g1 * 10_000
    out = np.empty((len(v), 19), dtype=np.uint8)
    first = _DIGITS4[g0]
    out[:, 1] = first[:, 0]
    out[:, 2] = _DOT
    out[:, 3:6] = first[:, 1:]
    out[:, 6:10] = _DIGITS4[g1]
    out[:, 10:14] = _DIGITS4[g2]
    out[:, 14:19] = _EXPONENTS[e + _EXP_BIAS]
    if zero.any():
        out[zero] = np.frombuffer(b"\x000.00000000000e+00\x00", dtype=np.uint8)
    out[:, 0] = np.where(np.signbit(v), _MINUS, 0)
    return out


def _python_floats(v: np.ndarray) -> np.ndarray:
    texts = [format(x, ".11e") for x in v.tolist()]
    width = max(19, *map(len, texts)) if texts else 19
    out = np.zeros((len(v), width), dtype=np.uint8)
    for i, t in enumerate(texts):
        out[i, width - len(t):] = list(t.encode())
    return out


def text_bytes(labels: list[str], index: np.ndarray) -> np.ndarray:
    """(n, w) NUL-padded ASCII of `labels[index[i]]`: a column of a few distinct strings."""
    width = max(map(len, labels))
    table = np.zeros((len(labels), width), dtype=np.uint8)
    for i, label in enumerate(labels):
        table[i, :len(label)] = list(label.encode("ascii"))
    return table[np.asarray(index)]


def csv_block(columns: list[np.ndarray]) -> bytes:
    """CSV rows of already formatted (n, w) byte columns or plain int/float arrays."""
    n = len(columns[0])
    parts = []
    for col in columns:
        if col.dtype == np.uint8 and col.ndim == 2:
            parts.append(col)
        elif col.dtype.kind in "iu":
            parts.append(int_bytes(col))
        else:
            parts.append(float_bytes(col))
        parts.append(np.full((n, 1), _COMMA, dtype=np.uint8))
    parts[-1] = np.full((n, 1), _NEWLINE, dtype=np.uint8)
    flat = np.concatenate(parts, axis=1).ravel()
    return flat[flat != 0].tobytes()


__all__ = ["csv_block", "float_bytes", "int_bytes", "text_bytes"]
