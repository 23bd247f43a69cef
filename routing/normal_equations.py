"""The linear algebra of the cost fit (routing/learn.py): weighted normal equations summed a
column at a time, residuals, and a bounded, ridge-regularised solve. Pure Python (the serving
install has no numpy); tests/unit/test_learn.py checks it against numpy."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from itertools import repeat

Vector = list[float]
Row = tuple[float, ...]


def accumulate(
    gram: list[Vector],
    rhs: Vector,
    rows: Sequence[Row],
    targets: Sequence[float],
    weights: Sequence[float],
) -> None:
    """Add sum of w * row row^T to the upper triangle of `gram`, and sum of w * row * y to `rhs`:
    a column at a time, each entry one sum over the rows in their order (a loop in C, not a
    Python step per row and term); unexcited terms (an all-zero column) add nothing."""
    if not rows:
        return
    columns = list(zip(*rows, strict=True))
    excited = [i for i, column in enumerate(columns) if any(column)]
    for i in excited:
        weighted = list(map(operator.mul, weights, columns[i]))
        rhs[i] += sum(map(operator.mul, weighted, targets))
        gram_i = gram[i]
        for j in excited:
            if j >= i:
                gram_i[j] += sum(map(operator.mul, weighted, columns[j]))


def regularised_solve(
    gram: list[Vector],
    rhs: Vector,
    precision: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
) -> Vector:
    """Mirror the upper triangle, add the ridge (towards theta = 1), solve within the bounds.
    `gram` and `rhs` are changed in place."""
    size = len(rhs)
    for i in range(size):
        for j in range(i):
            gram[i][j] = gram[j][i]
        gram[i][i] += precision[i]
        rhs[i] += precision[i]  # the prior's mean is theta = 1
    return bounded_solve(gram, rhs, low, high)


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    # the same products summed in the same order as sum(x * y for ...), so the same float, without
    # a generator frame per product
    if len(a) != len(b):
        raise ValueError("vectors of different lengths")
    total: float = sum(map(operator.mul, a, b))
    return total


def residuals_of(rows: Sequence[Row], targets: Sequence[float], theta: Sequence[float]) -> Vector:
    """y - theta . row for every row, a column at a time (a loop in C per term instead of a
    Python call per row: this is most of a refit's CPU). An all-zero column (an unexcited term)
    adds nothing and is skipped; the others are summed in term order, as `dot` does."""
    if not rows:
        return []
    columns = iter(zip(*rows, strict=True))
    fitted = list(map(operator.mul, next(columns), repeat(theta[0])))
    for t, column in zip(theta[1:], columns, strict=True):
        if any(column):
            fitted = list(map(operator.add, fitted, map(operator.mul, column, repeat(t))))
    return list(map(operator.sub, targets, fitted))


def bounded_solve(
    gram: Sequence[Sequence[float]],
    rhs: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
) -> Vector:
    """argmin of the quadratic with this Gram matrix and right-hand side within [low, high]: solve,
    hold each term that leaves its bounds at the bound, solve the others again (an active set;
    at most one round per term)."""
    size = len(rhs)
    theta = _solve(gram, rhs)
    free = list(range(size))
    while True:
        out = [i for i in free if not low[i] <= theta[i] <= high[i]]
        if not out:
            return theta
        theta = [min(max(t, lo), hi) for t, lo, hi in zip(theta, low, high, strict=True)]
        free = [i for i in free if i not in out]
        if not free:
            return theta
        held = [i for i in range(size) if i not in free]
        b = [rhs[i] - sum(gram[i][j] * theta[j] for j in held) for i in free]
        solved = _solve([[gram[i][j] for j in free] for i in free], b)
        for i, value in zip(free, solved, strict=True):
            theta[i] = value


def _solve(matrix: Sequence[Sequence[float]], rhs: Sequence[float]) -> Vector:
    """x with matrix @ x = rhs: Gaussian elimination with partial pivoting (the method of
    LAPACK's gesv, which numpy.linalg.solve calls; Golub & Van Loan, "Matrix Computations",
    4th ed., alg. 3.4.1). The ridge makes the Gram matrix positive definite, so a zero pivot
    means the inputs were not finite: raised as ArithmeticError rather than returned as NaN."""
    size = len(rhs)
    a = [[*map(float, matrix[i]), float(rhs[i])] for i in range(size)]  # augmented, copied
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        if not a[pivot][col] or not math.isfinite(a[pivot][col]):
            raise ArithmeticError("singular matrix in the cost fit's solve")
        a[col], a[pivot] = a[pivot], a[col]
        head = a[col]
        for r in range(col + 1, size):
            factor = a[r][col] / head[col]
            if factor:
                row = a[r]
                for c in range(col, size + 1):
                    row[c] -= factor * head[c]
    x = [0.0] * size
    for i in range(size - 1, -1, -1):
        x[i] = (a[i][size] - sum(a[i][j] * x[j] for j in range(i + 1, size))) / a[i][i]
    return x
