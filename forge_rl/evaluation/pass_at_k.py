"""The unbiased pass@k estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", section 2.1): with n samples of a problem of which c pass,

    pass@k = 1 - C(n - c, k) / C(n, k)

the probability that k samples drawn without replacement from the n hold at least one that passes.
Drawing n > k samples and using this estimates pass@k with less variance than drawing exactly k.
The binomials overflow floats for n in the hundreds, so it is computed as the product

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)

(each factor in [0, 1), no large numbers), and is exactly 1 when n - c < k: every draw of k holds a
passing sample.

    >>> round(pass_at_k(num_samples=10, num_passed=1, k=1), 6)
    0.1
    >>> round(pass_at_k(num_samples=10, num_passed=1, k=5), 6)
    0.5
    >>> mean_pass_at_k([10, 10], [0, 10], k=10)
    0.5
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(num_samples: int, num_passed: int, k: int) -> float:
    """The unbiased pass@k of one problem with `num_samples` samples of which `num_passed` passed."""
    _check(num_samples, num_passed, k)
    if num_samples - num_passed < k:
        return 1.0
    not_passed = 1.0
    for i in range(num_samples - num_passed + 1, num_samples + 1):
        not_passed *= 1.0 - k / i
    return 1.0 - not_passed


def mean_pass_at_k(num_samples: Sequence[int], num_passed: Sequence[int], k: int) -> float:
    """pass@k over problems: the mean of each problem's pass@k (problems may have different numbers
    of samples, each at least k)."""
    if len(num_samples) != len(num_passed):
        raise ValueError(
            f"mean_pass_at_k: {len(num_samples)} sample counts but {len(num_passed)} pass counts; "
            "give one of each per problem."
        )
    if not num_samples:
        raise ValueError("mean_pass_at_k: no problems; pass@k of an empty set is undefined.")
    return sum(pass_at_k(n, c, k) for n, c in zip(num_samples, num_passed)) / len(num_samples)


def _check(num_samples: int, num_passed: int, k: int) -> None:
    if k < 1:
        raise ValueError(f"pass@k: k ({k}) must be >= 1.")
    if not 0 <= num_passed <= num_samples:
        raise ValueError(f"pass@k: num_passed ({num_passed}) must be between 0 and num_samples ({num_samples}).")
    if k > num_samples:
        raise ValueError(
            f"pass@{k} needs at least {k} samples per problem, and this problem has {num_samples}: "
            f"draw at least {k} samples of each problem, or report pass@k only for k <= {num_samples}."
        )
