"""Strata: the optimizer state (fp32 master weights, Adam moments) off the GPU,
in pinned DRAM and on NVMe, updated by a SIMD CPU Adam.

    from strata.torch import OffloadAdam
    optimizer = OffloadAdam(model.parameters(), lr=3e-4, offload="nvme",
                            nvme_path="/local_nvme", host_budget="8GiB")

docs/pytorch.md is the guide; strata.torch.OffloadAdam's docstring the reference.
"""

from strata._strata import InvalidArgumentError, ResourceExhaustedError, StrataError

__all__ = ["StrataError", "InvalidArgumentError", "ResourceExhaustedError"]
__version__ = "0.1.0"
