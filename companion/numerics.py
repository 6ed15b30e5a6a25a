"""The CPU's numerical path, fixed so that stored outputs reproduce on any x86-64 CPU
with AVX2.

Every chapter calls :func:`pin_cpu_path` in its first code cell, before torch loads, and
the Makefile exports the same variables (``python companion/numerics.py`` prints them),
so the tests, ``make notebooks`` and a reader's kernel all run one path. This module
imports neither torch nor numpy at import time.

Why it is needed. float32 addition is not associative, and the libraries under torch
pick their code by CPU, so the same seed gives results that differ in the last bits
between an AVX-512 Xeon and an AVX2 EPYC; a few hundred training steps turn that into
different printed digits, and nbval fails with nothing wrong. What is fixed, and why
each value:

* ``MKL_CBWR=COMPATIBLE``: MKL (every float32 matrix product) runs its conditional
  numerical reproducibility branch built on SSE2 without the approximate ``rcpps`` and
  ``rsqrtps``. It is the one branch MKL documents as giving the same bits on Intel and
  non-Intel CPUs: its ``AVX2`` branch is for Intel CPUs only, and on an AMD CPU MKL
  falls back to ``AUTO`` without a word (measured on an EPYC: the branch read back is 2,
  AUTO).
* ``ATEN_CPU_CAPABILITY=avx2``: ATen's own vectorised kernels (reductions, softmax,
  elementwise maths) run their AVX2 build, the same machine code on an AVX-512 CPU as on
  an AVX2 one. The portable ``default`` build would also reach CPUs without AVX2 but
  costs more, and every x86-64 CPU since 2015 has AVX2.
* ``OMP_NUM_THREADS=MKL_NUM_THREADS=2`` and ``MKL_DYNAMIC=FALSE``: a reduction split
  over two threads sums in another order than over one, so the count is fixed, whatever
  the machine has (2 is what CI and Colab have); MKL may not lower it on its own.
* oneDNN is switched off (``torch.backends.mkldnn.enabled = False``): it JIT-compiles
  convolutions for the CPU at hand; without it they run through MKL too.
* ``OPENBLAS_CORETYPE=Haswell`` and ``NPY_DISABLE_CPU_FEATURES``: NumPy (``np.polyfit``
  in the plots) has its own BLAS and its own AVX-512 loops; both are held at AVX2.

Two paths no variable pins, found by running the same binary under an emulated EPYC
(``qemu-x86_64 -cpu EPYC-Rome``) beside an AVX-512 Xeon: matrix products, attention,
softmax, the norms, the losses, every gradient and ``torch.randn`` agreed bit for bit,
and two things did not.

* ``torch.sqrt`` of a float32 CPU tensor goes to MKL's vector library, whose results
  are not correctly rounded and whose last bits follow the CPU kind whatever
  ``MKL_CBWR`` says (1,650 of 12,288 square roots differed). Adam's per-tensor update
  takes ``exp_avg_sq.sqrt()``, so every trained digit drifted. The companion's Adam
  optimisers are built with ``fused=True`` (:func:`companion.training.portable_adam`),
  ATen's own kernel, which agreed bit for bit.
* Dropout's ``bernoulli_`` takes an MKL generator on Intel CPUs only, so its masks
  differ by vendor. No stored output trains with dropout: chapter 3 uses it only with
  ``FULL = True``.

What it costs, measured on a 2-core EPYC: a 1024 × 1024 float32 product takes 64 ms
instead of 24 ms; a training step of chapter 4's 48-wide decoder 47 ms instead of 31 ms;
whole chapters run 1.3 to 1.7 times longer (chapter 4: 204 s instead of 147 s). MKL's
SSE2 branch is the price; ATen's ``default`` build instead of ``avx2`` would add more.
Set ``COMPANION_NUMERICS=native`` to skip the pin, for speed, when reproducing the
stored digits does not matter (GPU runs, ``FULL = True``).

On CPUs that are not x86-64 (Apple silicon, ARM servers) there is no MKL and nothing to
pin: the chapters run and their asserts hold, but printed digits of trained results
differ.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import warnings

__all__ = [
    "PINNED_ENV",
    "THREADS",
    "applies",
    "pin_cpu_path",
    "pinned_path",
    "read_path",
]

THREADS = 2
PINNED_ENV: dict[str, str] = {
    "MKL_CBWR": "COMPATIBLE",
    "ATEN_CPU_CAPABILITY": "avx2",
    "OMP_NUM_THREADS": str(THREADS),
    "MKL_NUM_THREADS": str(THREADS),
    "MKL_DYNAMIC": "FALSE",
    "OPENBLAS_CORETYPE": "Haswell",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4,AVX512_ICL,AVX512_SPR",
}
_MKL_BRANCHES = {
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    10: "AVX2",
    12: "AVX512",
}
_X86_64 = ("x86_64", "amd64")


def applies() -> bool:
    """True where the pin is used: an x86-64 CPU and ``COMPANION_NUMERICS`` not
    ``native``."""
    mode = os.environ.get("COMPANION_NUMERICS", "pinned")
    if mode not in ("pinned", "native"):
        raise ValueError(
            f"COMPANION_NUMERICS must be 'pinned' or 'native', got {mode!r}"
        )
    return mode == "pinned" and platform.machine().lower() in _X86_64


def _mkl_branch() -> str | None:
    """MKL's reproducibility branch as MKL reports it, or None where it cannot be
    asked."""
    import torch

    candidates = [
        os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"),
        None,
    ]
    for lib in candidates:
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for symbol in ("mkl_serv_cbwr_get", "mkl_cbwr_get"):
            fn = getattr(handle, symbol, None)
            if fn is not None:
                branch = fn(1)  # MKL_CBWR_BRANCH
                return _MKL_BRANCHES.get(branch, str(branch))
    return None


def read_path() -> dict[str, object]:
    """The path torch is on now: MKL branch, ATen capability, threads, oneDNN (imports
    torch)."""
    import torch

    return {
        "mkl_branch": _mkl_branch(),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "onednn": torch.backends.mkldnn.enabled,
    }


def pinned_path() -> dict[str, object]:
    """What :func:`read_path` returns once :func:`pin_cpu_path` has taken effect."""
    return {
        "mkl_branch": PINNED_ENV["MKL_CBWR"],
        "aten_capability": PINNED_ENV["ATEN_CPU_CAPABILITY"].upper(),
        "threads": THREADS,
        "onednn": False,
    }


def pin_cpu_path() -> None:
    """Fix MKL's branch, ATen's kernels, the thread count and NumPy's BLAS; then import
    torch.

    Call it before anything imports torch or numpy: MKL and ATen read their variables
    once, on first use. If they had already been read, the path is checked and a warning
    says what differs (restart the kernel and run the first cell first). Does nothing
    where :func:`applies` is False.
    """
    if not applies():
        return
    late = [name for name in ("torch", "numpy") if name in sys.modules]
    os.environ.update(PINNED_ENV)
    import torch

    torch.set_num_threads(THREADS)
    torch.backends.mkldnn.enabled = False
    now, want = read_path(), pinned_path()
    if (
        now["mkl_branch"] is None
    ):  # a torch whose MKL cannot be asked: trust the variable
        now["mkl_branch"] = want["mkl_branch"]
    wrong = {k: v for k, v in now.items() if v != want[k]}
    if wrong:
        warnings.warn(
            f"the CPU numerical path is not the pinned one: got {wrong}, want "
            f"{ {k: want[k] for k in wrong} }"
            + (f" ({' and '.join(late)} loaded before pin_cpu_path)" if late else "")
            + "; printed digits may differ from the stored outputs",
            RuntimeWarning,
            stacklevel=2,
        )


if __name__ == "__main__":
    # For the Makefile: NAME=VALUE words (no value holds a space).
    print(" ".join(f"{name}={value}" for name, value in PINNED_ENV.items()))
