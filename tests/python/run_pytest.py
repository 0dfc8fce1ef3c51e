"""Runs one pytest file for ctest. Exits 77 (reported by ctest as skipped,
with the reason printed) when PyTorch or the built module cannot be
imported by this Python; otherwise pytest's own exit status."""
import sys


def main():
    try:
        import torch  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        print(f"SKIPPED: PyTorch is not importable by {sys.executable}: {e} "
              "(install Debian's python3-torch; scripts/setup does)")
        return 77
    try:
        import strata.torch  # noqa: F401
    except Exception as e:
        print(f"SKIPPED: strata.torch is not importable from {sys.path[:2]}: {e} "
              "(build the strata_python target; it needs pybind11-dev and python3-dev)")
        return 77

    import pytest

    return pytest.main(["-q", "-rs", "-p", "no:cacheprovider", *sys.argv[1:]])


# Guarded: torch.multiprocessing's spawned children import this file again.
if __name__ == "__main__":
    sys.exit(main())
