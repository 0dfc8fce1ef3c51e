"""Strata: the optimizer state (fp32 master weights, Adam moments) off the GPU,
in pinned DRAM and on NVMe, updated by a SIMD CPU Adam.

    from strata.torch import OffloadAdam
    optimizer = OffloadAdam(model.parameters(), lr=3e-4, offload="nvme",
                            nvme_path="/local_nvme", host_budget="8GiB")

docs/pytorch.md is the guide; strata.torch.OffloadAdam's docstring the reference.

Logging: the engine's log lines (the placement plan, warnings, progress of
long work) go to the `logging` logger "strata", each record with a `rank`
attribute and the message prefixed "[rank N] ". Python's defaults show
warnings and errors on stderr; `logging.basicConfig(level=logging.INFO)` (or
a handler on logging.getLogger("strata")) shows the plan and progress too.
STRATA_LOG (debug|info|warning|error|off, default info) sets what the engine
emits at all.
"""

import atexit as _atexit
import logging as _logging
import os as _os
import sys as _sys

from strata import _strata
from strata._strata import InvalidArgumentError, ResourceExhaustedError, StrataError

__all__ = ["StrataError", "InvalidArgumentError", "ResourceExhaustedError"]
__version__ = "0.2.0"

logger = _logging.getLogger("strata")
_LEVELS = {"debug": _logging.DEBUG, "info": _logging.INFO, "warning": _logging.WARNING,
           "error": _logging.ERROR}


def _rank():
    """This process's rank: torch.distributed's when it is initialized (only
    looked up when torch was imported already), else $RANK, else 0."""
    dist = _sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a half-initialized process group: fall through
        pass
    try:
        return int(_os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _forward(level, message):
    levelno = _LEVELS.get(level, _logging.INFO)
    if logger.isEnabledFor(levelno):
        rank = _rank()
        logger.log(levelno, "[rank %d] %s", rank, message, extra={"rank": rank})


_strata.set_log_handler(_forward)
# Before the interpreter finalizes: engine threads must not call into Python then.
_atexit.register(_strata.set_log_handler, None)
