"""The ranks' agreement (compiler/agreement.py): which difference gets which explanation."""
from spmd.compiler.agreement import digest, differences


def _lines(base: list[str], odd: list[str], hashes=("111", "222")) -> list[str]:
    zero, one = {"graph": base, "_string_hashes": [hashes[0]]}, {"graph": odd, "_string_hashes": [hashes[1]]}
    assert "_string_hashes" not in digest(zero)  # (explains a difference, never is one)
    return differences([digest(zero), digest(one)], {0: zero, 1: one})


def test_the_hash_seed_is_named_only_for_the_same_ops_wired_apart():
    """Found by a review: every graph difference got the PYTHONHASHSEED hint, since plain torchrun launches always
    hash strings differently; a rank's own `eps` is no matter of seeds."""
    eps = _lines(["native_layer_norm(64, 1e-05) of x, w, b -> tuple"], ["native_layer_norm(64, 0.001) of x, w, b -> tuple"])
    assert len(eps) == 1 and "wired apart" not in eps[0] and "PYTHONHASHSEED" not in eps[0], eps
    wired = ["addmm of b1, x, w1 -> [4, 8] float32", "addmm of b2, x, w2 -> [4, 8] float32"]
    swapped = _lines(wired, wired[::-1])
    assert "the same ops, wired apart. Rank 1 hashes strings unlike rank 0" in swapped[0], swapped
    assert "`PYTHONHASHSEED=0 torchrun ...`" in swapped[0]
    same_seed = _lines(wired, wired[::-1], hashes=("111", "111"))
    assert same_seed[0].endswith("the same ops, wired apart"), same_seed
    assert _lines(wired, wired) == []
