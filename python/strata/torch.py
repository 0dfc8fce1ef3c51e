"""strata.torch: OffloadAdam, a torch.optim.Optimizer whose state lives off the GPU.

    import torch
    from strata.torch import OffloadAdam

    model = MyModel()
    optimizer = OffloadAdam(model.parameters(), lr=3e-4, weight_decay=0.1,
                            offload="nvme", nvme_path="/local_nvme", host_budget="8GiB")
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    for batch in data:
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

See OffloadAdam's docstring and docs/pytorch.md.
"""

import atexit
import contextlib
import copy
import errno
import functools
import gc
import json
import math
import numbers
import os
import re
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist

import strata
from strata import _strata
from strata._strata import (TRACE_MAX_STEPS, InvalidArgumentError, ResourceExhaustedError,
                            StrataError)

__all__ = ["OffloadAdam", "StrataError", "InvalidArgumentError", "ResourceExhaustedError",
           "export_checkpoint", "state_dict_from_checkpoint"]

_PARAM_DTYPES = {torch.float32: None, torch.float16: "fp16", torch.bfloat16: "bf16"}
_BUFFER_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_STATE_DICT_VERSION = 1
# Each registered param -> a weak reference to the OffloadAdam that trains it:
# a second optimizer over the same tensor would overwrite the first one's update.
_OWNERS = {}  # id(param) -> (weakref to the param, weakref to its OffloadAdam)
# The OffloadAdams of this process whose engines hold nvme_path locks.
_NVME_HOLDERS = weakref.WeakSet()
# torch.optim.Adam/AdamW options that change what the step computes or promises (a
# CUDA-graph-capturable step, autograd through it): refused when True, as arguments
# and in groups. Its other options (foreach, fused) choose an implementation: ignored.
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def _trace_steps(where, value, none_ok=False):
    """The number of steps a trace keeps: an int from 1 to TRACE_MAX_STEPS (True: 8;
    None/False: 0 where allowed); ValueError otherwise."""
    if none_ok and (value is None or value is False):
        return 0
    if value is True:
        return 8
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= TRACE_MAX_STEPS:
        return value
    raise ValueError(f"{where}={value!r}; give the number of steps to keep (an int from 1 "
                     f"to {TRACE_MAX_STEPS})" + (", True (8) or None" if none_ok else ""))


def _merge(base, override):
    """Deep merge of two config dicts; `override` wins."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class _RepeatedKeys(dict):
    """A JSON object in which `repeated` appeared more than once (the last value is kept)."""

    def __init__(self, pairs, repeated):
        super().__init__(pairs)
        self.repeated = repeated


def _object_keeping_repeats(pairs):
    """json's object_pairs_hook: a dict, or a _RepeatedKeys naming the first repeated key."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            return _RepeatedKeys(pairs, key)
        seen.add(key)
    return dict(pairs)


def _repeated_key(tree, path=""):
    """The key path ("optimizer.params.lr") of a key repeated in a parsed config, or None."""
    if isinstance(tree, _RepeatedKeys):
        return f"{path}.{tree.repeated}" if path else tree.repeated
    if isinstance(tree, dict):
        children = ((f"{path}.{k}" if path else k, v) for k, v in tree.items())
    elif isinstance(tree, list):
        children = ((f"{path}[{i}]", v) for i, v in enumerate(tree))
    else:
        return None
    for sub, value in children:
        found = _repeated_key(value, sub)
        if found:
            return found
    return None


def _config_dict(config):
    """The config argument as a dict ({} for None): a dict, or a JSON string of one."""
    if config is None:
        return {}
    if isinstance(config, (str, bytes)):
        try:
            config = json.loads(config, object_pairs_hook=_object_keeping_repeats)
            repeated = _repeated_key(config)
        except ValueError as e:
            hint = ""
            if isinstance(config, str) and os.path.isfile(config):
                hint = (f" ({config!r} is a file: pass its text, "
                        "config=pathlib.Path(path).read_text())")
            raise ValueError(f"OffloadAdam: config is not valid JSON: {e}{hint}") from None
        except RecursionError:
            raise ValueError("OffloadAdam: config JSON is nested too deeply to parse (a "
                             "DeepSpeed config is a few levels deep)") from None
        # As the engine's parser and DeepSpeed's: json keeps only the last value of
        # a repeated key, so a setting would vanish unseen.
        if repeated:
            raise ValueError(f"OffloadAdam: parse config JSON: the key {repeated} appears more "
                             "than once in its object; JSON keeps only the last value, so "
                             "remove the others")
    if not isinstance(config, dict):
        raise TypeError(f"OffloadAdam: config is a {type(config).__name__}; give a dict or a "
                        "JSON object string (docs/config.md)")
    return config


def _scalar(value):
    """A one-element tensor (torch accepts lr=torch.tensor(...)) as a float; else as is."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"OffloadAdam: lr is a tensor of {value.numel()} elements; give "
                             "a number")
        return float(value)
    return value


def _is_count(value):
    """A whole number >= 1 (an int, or a float without a fraction such as 1e8); not a bool."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):
        return value >= 1
    return isinstance(value, float) and value.is_integer() and value >= 1


_FP32_MAX = torch.finfo(torch.float32).max
_FP32_MIN_NORMAL = torch.finfo(torch.float32).tiny


def _beta_ok(v):
    return 0 <= v < 1 and torch.tensor(v, dtype=torch.float32).item() < 1


def _check_hyper(where, lr, betas, eps, weight_decay):
    """ValueError naming the field unless the hyperparameters are finite and in range."""
    try:
        if isinstance(betas, (str, bytes)):
            raise TypeError("text")
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"OffloadAdam: {where}betas={betas!r}; give two numbers in [0, 1)")
    # The engine's rules (ValidateGroupHyper), said here in the user's terms
    # (param_groups[i], betas[1]): the update runs in fp32, so a value must be finite
    # there, eps a normal fp32 number, and a beta below 1 once rounded to fp32.
    rules = [("lr", lr, lambda v: 0 <= v <= _FP32_MAX,
              "finite, >= 0 and at most 3.4e38 (the update runs in fp32)"),
             ("betas[0]", b1, _beta_ok, "in [0, 1), and below 1 in fp32"),
             ("betas[1]", b2, _beta_ok, "in [0, 1), and below 1 in fp32"),
             ("eps", eps, lambda v: _FP32_MIN_NORMAL <= v <= _FP32_MAX,
              "finite and in [1.2e-38, 3.4e38] (the update runs in fp32)"),
             ("weight_decay", weight_decay, lambda v: 0 <= v <= _FP32_MAX,
              "finite, >= 0 and at most 3.4e38 (the update runs in fp32)")]
    for field, value, ok, allowed in rules:
        v = _number(where, field, value)  # text and non-numbers: "it must be a number"
        if not (math.isfinite(v) and ok(v)):
            raise ValueError(f"OffloadAdam: {where}{field} is {value}; it must be {allowed}")


def _check_flags(where, group):
    """ValueError for a torch.optim Adam option OffloadAdam does not run, set in a group
    (where: "param_groups[1] has ") or given as an argument (where: "")."""
    for flag in _UNSUPPORTED_FLAGS:
        if group.get(flag):
            raise ValueError(f"OffloadAdam: {where}{flag}=True; OffloadAdam runs Adam/AdamW "
                             f"without {flag}: drop it (or use torch.optim for this model)")


def _check_unique(groups):
    """ValueError naming both places where one tensor is listed twice."""
    seen = {}
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g["params"]):
            where = f"param_groups[{gi}]['params'][{pi}]"
            if id(p) in seen:
                raise ValueError(f"OffloadAdam: {where} is the same tensor as {seen[id(p)]} "
                                 f"(shape {tuple(p.shape)}); list each param once")
            seen[id(p)] = where


def _number(where, key, value):
    try:
        if isinstance(value, (str, bytes)):  # float("0.1") would take text
            raise TypeError("text")
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"OffloadAdam: {where}{key} is {value!r}; it must be a number") from None


def _non_finite(tree, path=""):
    """The key path of the first inf/nan number in a config dict, or None."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            found = _non_finite(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            found = _non_finite(v, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(tree, float) and not math.isfinite(tree):
        return f"{path} = {tree}"
    return None


def _fill_auto(config, values):
    """Replaces "auto" (Hugging Face's DeepSpeed integration writes it) at the key
    paths in `values` with the value there (None: the key is dropped, so the
    engine's default applies). Other "auto" values reach the engine, which names them."""
    for path, value in values.items():
        node, keys = config, path.split(".")
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict) and node.get(keys[-1]) == "auto":
            if value is None:
                del node[keys[-1]]
            else:
                node[keys[-1]] = value


def _split_names(params):
    """Accepts tensors, (name, tensor) pairs (model.named_parameters()) or group dicts of
    either; returns what torch.optim.Optimizer takes and {id(tensor): name}."""
    names = {}

    def strip(seq):
        if isinstance(seq, (set, frozenset)):
            # As torch.optim refuses it: a state_dict or checkpoint keys params by
            # their order, which a set's changes between runs.
            raise TypeError("OffloadAdam: params given as a set, whose order changes between "
                            "runs (state_dicts and checkpoints key params by it); give a list")
        seq = [seq] if isinstance(seq, torch.Tensor) else list(seq)
        out = []
        for x in seq:
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
                names[id(x[1])] = x[0]
                x = x[1]
            out.append(x)
        return out

    if isinstance(params, (set, frozenset)):
        strip(params)  # refused
    params = list(params) if not isinstance(params, torch.Tensor) else [params]
    if params and isinstance(params[0], dict):
        return [dict(g, params=strip(g["params"])) for g in params], names
    return strip(params), names


def _global_rank(group, rank):
    """The global rank of `rank` in `group` (PyTorch 1.13 keeps this private)."""
    if group is None or group is dist.group.WORLD:
        return rank
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return get(group, rank)


def _group_timeout(group, device=None):
    """The timeout `group` was made with (a timedelta), or None where torch hides it.

    torch 1.13 has it on `group.options`; torch >= 2.6 dropped that, and keeps
    it per backend (`group._get_backend(device).options`)."""
    backends = []
    if device is not None and hasattr(group, "_get_backend"):
        try:
            backends.append(group._get_backend(device))
        except Exception:  # no backend for that device type in this group
            pass
    backends.append(group)
    for b in backends:
        timeout = getattr(getattr(b, "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


class _TorchDistributedComm:
    """The engine's collectives over torch.distributed (CPU tensors, e.g. gloo).

    Called from the engine's stream thread with the GIL held, one collective at
    a time, in the same order on every rank. The memoryviews are raw bytes of
    the engine's buffers; torch.distributed gets copies (send may alias recv,
    and gloo's worker thread may hold a tensor past the call).

    Each collective first all-reduces a small header (which collective, dtype,
    op and count): ranks that issue different ones (a rank skipped a step, or
    saves while another steps) raise on every rank, naming both, instead of
    meeting in a transfer of another size (gloo aborts the process on that).
    """

    _CALLS = ("all-reduce", "reduce-scatter", "all-gather", "barrier")

    def __init__(self, group, rank, world_size):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._dtypes = sorted(_BUFFER_DTYPES)
        # The first failed collective: the engine's streams keep it, so every later
        # call of the optimizer would fail with it (OffloadAdam says so up front).
        self.failed = None
        _let_gloo_finish_at_exit()

    def _describe(self, code, count):
        call, rest = divmod(int(code), 64)
        dtype, op = divmod(rest, 4)
        what = self._CALLS[call] if 0 <= call < len(self._CALLS) else f"collective {call}"
        if what == "barrier":
            return what
        kind = self._dtypes[dtype] if 0 <= dtype < len(self._dtypes) else f"dtype {dtype}"
        return f"{what} of {int(count)} x {kind}" + (f" ({('sum', 'max')[op]})" if op < 2 else "")

    def _run(self, what, fn):
        try:
            fn()
        except RuntimeError as e:
            self.failed = self.failed or f"{what}: {e}"
            text = str(e)
            if "closed by peer" in text or "reset by peer" in text or "Broken pipe" in text:
                raise RuntimeError(f"{what}: another rank exited or failed (its connection "
                                   f"closed): see that rank's output for its error ({text})") \
                    from None
            if "Timed out" in text or "timed out" in text:
                raise RuntimeError(f"{what}: another rank did not join within the process "
                                   "group's timeout: it stopped calling the optimizer, or issues "
                                   "other calls (init_process_group(timeout=...) sets the wait) "
                                   f"({text})") from None
            raise

    def _agree(self, call, dtype, op, count):
        code = self._CALLS.index(call) * 64 + self._dtypes.index(dtype) * 4 + op
        mine = self._describe(code, count)
        header = torch.tensor([code, count, -code, -count], dtype=torch.float64)
        self._run(mine, lambda: dist.all_reduce(header, op=dist.ReduceOp.MAX, group=self.group))
        if header[0] != code or header[1] != count or header[2] != -code or header[3] != -count:
            other = (self._describe(header[0], header[1]) if header[0] != code or
                     header[1] != count else self._describe(-header[2], -header[3]))
            self.failed = self.failed or f"rank {self.rank} issued {mine}, another rank {other}"
            raise RuntimeError(
                f"rank {self.rank} issues {mine} while another rank issues {other}: every rank "
                "must call step(), save_checkpoint() and load_checkpoint() together (a rank "
                "skipped a step, or saves while another steps)")
        return mine

    @staticmethod
    def _tensor(mv, dtype, count):
        t = _BUFFER_DTYPES[dtype]
        if t in (torch.float16, torch.bfloat16):
            # Moved as bytes: gloo has neither bf16 nor int16.
            return torch.frombuffer(mv, dtype=torch.uint8, count=2 * count)
        return torch.frombuffer(mv, dtype=t, count=count)

    @staticmethod
    def _op(op):
        return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]

    def all_reduce(self, send, recv, count, dtype, op):
        what = self._agree("all-reduce", dtype, ("sum", "max").index(op), count)
        t = torch.frombuffer(send, dtype=_BUFFER_DTYPES[dtype], count=count).clone()
        self._run(what, lambda: dist.all_reduce(t, op=self._op(op), group=self.group))
        torch.frombuffer(recv, dtype=_BUFFER_DTYPES[dtype], count=count).copy_(t)

    def reduce_scatter(self, send, recv, recv_count, dtype, op):
        # gloo has no reduce_scatter: all-reduce a copy, keep this rank's block.
        what = self._agree("reduce-scatter", dtype, ("sum", "max").index(op), recv_count)
        full = torch.frombuffer(send, dtype=_BUFFER_DTYPES[dtype],
                                count=recv_count * self.world_size).clone()
        self._run(what, lambda: dist.all_reduce(full, op=self._op(op), group=self.group))
        r = torch.frombuffer(recv, dtype=_BUFFER_DTYPES[dtype], count=recv_count)
        r.copy_(full[self.rank * recv_count:(self.rank + 1) * recv_count])

    def all_gather(self, send, recv, send_count, dtype):
        what = self._agree("all-gather", dtype, 3, send_count)
        s = self._tensor(send, dtype, send_count).clone()  # send may alias recv
        out = [torch.empty_like(s) for _ in range(self.world_size)]
        self._run(what, lambda: dist.all_gather(out, s, group=self.group))
        self._tensor(recv, dtype, send_count * self.world_size).copy_(torch.cat(out))

    def barrier(self):
        what = self._agree("barrier", self._dtypes[0], 3, 0)
        self._run(what, lambda: dist.barrier(group=self.group))


# What a sticky CUDA error's message says (runtime/device.h kDeviceLostText):
# nothing in this process can recover.
_DEVICE_LOST = "the CUDA context is unusable"


def _outside_stacklevel():
    """The warnings stacklevel of the first caller outside this file and torch (whose
    decorators and pickler sit between the user's line and ours)."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


@functools.lru_cache(maxsize=None)
def _let_gloo_finish_at_exit():
    """gloo's worker thread drops its last tensors a moment after a collective
    returns, and dropping a tensor Python knows needs the GIL: if the interpreter
    is finalizing by then, that thread is ended inside a destructor and the
    process aborts ("terminate called without an active exception"). At exit,
    give it that moment with the GIL free (the process group may be left
    undestroyed, as many scripts do)."""
    atexit.register(time.sleep, 0.05)


def _grad_hook(ref, k):
    """overlap_backward's hook for registered param k; holds the optimizer weakly."""
    def hook(*_):
        optimizer = ref()
        if optimizer is not None:
            optimizer._grad_accumulated(k)
    return hook


def _one_thread(method):
    """An OffloadAdam method that one thread at a time may run: a call while another
    thread is inside one (a background checkpoint thread saving during step(), say) is
    refused with StrataError, never run beside it (the engine is not thread-safe, and a
    state_dict() between a step's parts would mix two steps). The thread that is inside
    may call further methods (a closure's zero_grad())."""
    op = method.__name__

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if op != "close" and isinstance(self.__dict__.get("_engine"), _Closed):
            raise _Closed.error(op)
        me = threading.get_ident()
        with self._owner_lock:
            owner = self._owner
            if owner is not None and owner[0] != me:
                raise StrataError(
                    f"OffloadAdam.{op}: {owner[1]}() is running in another thread; one thread "
                    "at a time drives the optimizer: wait for it to return (or guard the "
                    "optimizer with a lock)")
            if owner is None:
                self._owner = (me, op)
        try:
            return method(self, *args, **kwargs)
        finally:
            if owner is None:
                self._owner = None
    return run


class _Closed:
    """The engine of an OffloadAdam after close(): every use raises (the methods say
    which of theirs was called first: _one_thread)."""

    @staticmethod
    def error(op):
        return StrataError(f"OffloadAdam.{op}: the optimizer was closed (close() or the end "
                           "of its `with` block): build a new OffloadAdam")

    def __getattr__(self, name):
        raise self.error(name)


class _Registered:
    """A param the engine holds pointers to, as it was when registered (or rebound)."""
    __slots__ = ("param", "name", "where", "ptr", "grad_ptr", "shape", "dtype", "device")

    def __init__(self, param, name, where):
        self.param, self.name, self.where = param, name, where
        self.ptr = param.data_ptr()
        self.grad_ptr = 0  # the engine's grad buffer, set once it exists
        self.shape, self.dtype, self.device = tuple(param.shape), param.dtype, param.device

    def describe(self, index):
        name = f" ('{self.name}')" if self.name else ""
        return f"param {index}{name} ({self.where}, shape {self.shape})"


class _PickledOffloadAdam:
    """What an unpickled OffloadAdam is: a placeholder that refuses any use."""

    def __init__(self, step_count):
        self._step_count = step_count

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(
            f"an OffloadAdam pickled at step {self._step_count} was unpickled: the pickle "
            "holds no optimizer state (it lives in the engine). Build a new OffloadAdam and "
            "load_state_dict() what optimizer.state_dict() returned, or load_checkpoint(dir)")


class OffloadAdam(torch.optim.Optimizer):
    r"""Adam/AdamW whose fp32 master weights and moments live in host memory and on NVMe.

    A drop-in ``torch.optim.Optimizer``: param groups with their own ``lr``,
    ``betas``, ``eps`` and ``weight_decay`` (read at every ``step()``, so LR
    schedulers work), ``zero_grad(set_to_none=...)``, ``step(closure=None)``
    returning the closure's loss, ``state_dict()``/``load_state_dict()``.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``;
            checkpoints and exports record the names), or param-group dicts of
            either. All on one device (CPU, or one CUDA device), contiguous, of
            one dtype: float32, float16 (dynamic loss scaling, see below) or
            bfloat16.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (finite, lr >= 0,
            betas in [0, 1), eps > 0, weight_decay >= 0). weight_decay defaults
            to 0, as DeepSpeed's CPU Adam does; ``torch.optim.AdamW``'s default is
            0.01: pass it when replacing an AdamW built without one.
        amsgrad: torch's 6th argument, so positional calls written for
            ``torch.optim.AdamW`` mean the same; False, as True is refused.
            Every argument after it is keyword-only.
        maximize, foreach, capturable, differentiable, fused: torch's keyword
            arguments, accepted so configs written for ``torch.optim.AdamW``
            work: ``foreach`` and ``fused`` are implementation hints and are
            ignored; ``maximize``, ``capturable`` and ``differentiable`` are
            refused when True (as ``amsgrad``, and in param groups).
        adamw: True: decoupled weight decay (``AdamW``); False: L2 decay added
            to the gradient (``torch.optim.Adam(weight_decay=...)``).
        max_grad_norm: clip by global L2 norm, exactly like
            ``torch.nn.utils.clip_grad_norm_`` before the step (None: no clipping).
        offload: ``"cpu"`` (state in pinned DRAM) or ``"nvme"`` (in DRAM as far
            as ``host_budget`` allows, the rest in files under ``nvme_path``).
        nvme_path: directory (or list of directories, striped) for the NVMe
            tier; required with ``offload="nvme"``; created when missing. Each
            optimizer holds a lock on it (per rank) while it lives: a second
            optimizer on the same directory fails with the holder's pid.
        host_budget: pinned DRAM for state and staging, bytes or "8GiB".
            None: unlimited with "cpu", staging only with "nvme".
        gpu_fraction: partial offload. The share of the state (master weights
            and moments) kept in device memory and updated there by the fused
            device Adam, beside the CPU update of the rest: a number in
            [0, 1] (0, the default: everything offloaded; 1: nothing) or
            ``"auto"``: the largest share that fits ``device_budget``.
            Bitwise the same results at every fraction. With CPU params the
            "device" is host memory (no gain; for tests).
        device_budget: device memory the optimizer may use (its staging and
            the state it keeps there), bytes or "60GiB"; needed by
            ``gpu_fraction="auto"``. None: not limited.
        sub_group_size: elements per pipelined sub-group (default 1e9; smaller
            values overlap NVMe IO with the update at a finer grain), or
            ``"auto"``: the planner's choice (about 32 per rank, at least 4 Mi
            elements, with NVMe staging at most a quarter of ``host_budget``).
            ``state_dict()`` arrays load only into the same sub-groups.
        threads: CPU optimizer threads (None: all hardware threads).
        config: a DeepSpeed-style dict or JSON string (docs/config.md), merged
            over what the arguments above produce (its keys win). ``"auto"``
            values (Hugging Face's DeepSpeed configs) are filled from the
            arguments: ``optimizer.params.{lr,betas,eps,weight_decay}``,
            ``gradient_clipping``, ``fp16.enabled``, ``bf16.enabled``,
            ``zero_optimization.sub_group_size``.
        process_group: the ``torch.distributed`` group for multi-process
            training (None: the default group when initialized; on CPU the
            optimizer then makes a group of its own over the same ranks, so the
            trainer's collectives never meet its). Each rank owns 1/world of the
            state (ZeRO); gradients are averaged over ranks.
            CPU tensors use torch.distributed's collectives (gloo); CUDA
            tensors use NCCL, bootstrapped through the group.
        state_dict_dir: None (default): ``state_dict()`` holds the state as
            tensors (12 bytes per param in DRAM). A directory: ``state_dict()``
            saves an engine checkpoint there (streamed, sub-group by
            sub-group) and returns a small dict that names it;
            ``load_state_dict()`` of that dict loads it. For states larger
            than DRAM (the point of the NVMe tier).
        trace: None (default), or N >= 1 (True: 8): record the step timeline
            from construction on, keeping the newest N steps;
            ``write_trace(path)`` writes them. For one stretch of steps use
            the ``trace(path)`` context manager instead (docs/pytorch.md).
        overlap_backward: False (default), or True: a hook on every param
            reports its gradient to the engine as soon as autograd has
            accumulated it, so the statistics (and with several ranks the
            reduce-scatter and the copy to host memory) of each sub-group
            start while backward goes on. It needs every backward's gradients
            to be final: run the earlier backwards of a gradient accumulation
            inside ``with optimizer.no_sync():``, and do not change ``.grad``
            between backward and ``step()`` (clip with ``max_grad_norm``). A
            second gradient for a param before ``step()`` raises during
            backward (see "Overlap with backward" in docs/pytorch.md).

    Registration: the engine holds each param's memory. Before every
    ``step()`` the params are compared (pointers, shapes, dtypes, devices,
    ``requires_grad``, the groups' param lists) with what was registered: a
    param whose storage was replaced with the same shape and dtype
    (``model.double().float()``, ``p.data = p.data.clone()``, moves that
    reallocate) is re-registered; any other change raises an error that names
    the param and what changed. The engine never touches freed memory. Values
    written into a param between steps (``model.load_state_dict``, in-place
    ops under ``torch.no_grad()``) are where its next step starts; after a
    write through ``p.data`` call ``reload_params()``. ``close()`` releases the
    engine; an OffloadAdam cannot be copied, and pickles (with a warning) as a
    placeholder without its state that raises at any use.

    Gradients: ``step()`` reads each registered param's ``.grad``. Params with
    ``requires_grad=False`` at construction are not registered (never
    updated); turning ``requires_grad`` off (or on) later raises an error
    naming the param (build the optimizer after freezing). A ``.grad`` of
    None counts as a zero gradient: unlike torch.optim, which skips such a
    param, the param is still updated (decay, and the momentum it has), as in
    DeepSpeed's flat ZeRO buffers. Sparse gradients are refused. The engine
    owns one dense grad buffer per param; after ``zero_grad(set_to_none=False)``
    the params' ``.grad`` are those buffers, so backward accumulates straight
    into memory the engine reads (no copy). With ``set_to_none=True`` (or
    grads that autograd allocated), ``step()`` copies each grad into its
    buffer once.

    A failed step: when ``step()`` fails part way (an IO error on a later
    sub-group), some sub-groups hold the next step's values. Until that is
    resolved ``step()``, ``state_dict()`` and ``save_checkpoint()`` raise
    ``StrataError`` saying so: ``retry_step()`` finishes the step with the
    gradients it kept (bitwise a clean run's), ``load_checkpoint()`` or
    ``load_state_dict()`` replaces the state. Pending gradients are never
    applied again silently.

    fp16: with float16 params the engine runs DeepSpeed's dynamic loss scaler
    (``config={"fp16": {...}}`` tunes it). Scale the loss before backward and
    let ``step()`` unscale, clip, and skip steps whose gradients overflowed::

        loss = model(batch)
        optimizer.backward(loss)            # == optimizer.scale_loss(loss).backward()
        optimizer.step()                    # skipped (params unchanged) on overflow
        optimizer.zero_grad()
        optimizer.last_step()["skipped"], optimizer.loss_scale

    CUDA: engine work is ordered on PyTorch's current stream (the one at
    construction; a different current stream at ``step()``, ``zero_grad()`` or
    a checkpoint call is joined with ``wait_stream``), with no host
    synchronization beyond the CPU update.

    State: ``state_dict()`` holds the offloaded state of this rank (master
    weights, moments, step count, loss scaler) as CPU tensors, and loads back
    into an optimizer built the same way (same params, groups and world size);
    ``iter_state()`` yields it one sub-group at a time. ``load_state_dict()``
    also takes a ``torch.optim.Adam``/``AdamW`` state_dict (m, v and step; the
    master weights are the params' current values), to switch optimizers
    mid-run. ``save_checkpoint(dir)``/``load_checkpoint(dir)`` write and read
    the C++ engine's checkpoint format (a collective; all ranks pass the same
    dir), with the params' names and shapes: ``export_checkpoint`` and
    ``state_dict_from_checkpoint`` turn it into weights ``load_state_dict``
    takes.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, adamw=True, max_grad_norm=None, offload="cpu",
                 nvme_path=None, host_budget=None, config=None, sub_group_size=None,
                 threads=None, process_group=None, state_dict_dir=None, trace=None,
                 gpu_fraction=None, device_budget=None, overlap_backward=False):
        self._owner = None  # (thread id, method) inside a _one_thread method
        self._state_version = 0  # + 1 whenever the state may change (iter_state checks it)
        self._owner_lock = threading.Lock()
        if isinstance(params, torch.Tensor):
            raise TypeError("OffloadAdam: params argument given to the optimizer should be an "
                            f"iterable of Tensors or dicts, but got {torch.typename(params)}")
        # Positional as in torch.optim.Adam/AdamW; the Strata arguments are keyword-only
        # (a 6th positional argument was adamw=, so torch's amsgrad=False chose Adam-L2).
        # torch's keyword arguments: foreach and fused are implementation hints (ignored).
        del foreach, fused
        _check_flags("", {"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable,
                          "differentiable": differentiable})
        config = _config_dict(config)
        bad = _non_finite(config)
        if bad:
            raise ValueError(f"OffloadAdam: config {bad}; every number must be finite")
        lr = _scalar(lr)
        if isinstance(lr, (int, float)) and math.isfinite(lr) and lr < 0.0:
            raise ValueError(f"OffloadAdam: invalid learning rate {lr}; lr must be >= 0")
        _check_hyper("", lr, betas, eps, weight_decay)
        # The config's optimizer.params win over the arguments (a DeepSpeed config
        # carries the run's lr): they become the param groups' defaults.
        if not isinstance(config.get("optimizer", {}), dict):
            raise ValueError(f"OffloadAdam: config optimizer = {config['optimizer']!r}: expected "
                             "an object ({\"type\": ..., \"params\": {...}}, docs/config.md)")
        given = config.get("optimizer", {}).get("params", {})
        given = {k: v for k, v in given.items() if v != "auto"} if isinstance(given, dict) else {}
        if given.keys() & {"lr", "betas", "eps", "weight_decay"}:
            lr, betas = given.get("lr", lr), given.get("betas", betas)
            eps, weight_decay = given.get("eps", eps), given.get("weight_decay", weight_decay)
            _check_hyper("config optimizer.params: ", lr, betas, eps, weight_decay)
        if not isinstance(adamw, bool):
            raise ValueError(f"OffloadAdam: adamw={adamw!r}; use True (AdamW: decoupled weight "
                             "decay) or False (Adam: L2 in the gradient)")
        if threads is not None and not _is_count(threads):
            raise ValueError(f"OffloadAdam: threads={threads!r}; give a whole number of CPU "
                             "threads >= 1, or None for all")
        if sub_group_size is not None and sub_group_size != "auto" and not _is_count(
                sub_group_size):
            raise ValueError(f"OffloadAdam: sub_group_size={sub_group_size!r}; give a whole "
                             "number of elements >= 1 (e.g. 100_000_000 or 1e8), or 'auto'")
        if offload not in ("cpu", "nvme"):
            raise ValueError(f"OffloadAdam: offload={offload!r}; use 'cpu' or 'nvme'")
        if offload == "nvme" and not nvme_path:
            raise ValueError("OffloadAdam: offload='nvme' needs nvme_path (a directory on the "
                             "NVMe drive, or a list of them)")
        trace_steps = _trace_steps("OffloadAdam: trace", trace, none_ok=True)
        if gpu_fraction is not None and gpu_fraction != "auto" and not (
                isinstance(gpu_fraction, (int, float)) and not isinstance(gpu_fraction, bool)
                and 0.0 <= gpu_fraction <= 1.0):
            raise ValueError(f"OffloadAdam: gpu_fraction={gpu_fraction!r}; use a number in "
                             "[0, 1] or 'auto'")
        if gpu_fraction == "auto" and device_budget is None:
            raise ValueError("OffloadAdam: gpu_fraction='auto' needs device_budget (the device "
                             "memory the optimizer may use, e.g. '60GiB')")
        if not isinstance(overlap_backward, bool):
            raise ValueError(f"OffloadAdam: overlap_backward={overlap_backward!r}; use True or "
                             "False")
        if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"OffloadAdam: max_grad_norm={max_grad_norm}; use a positive, finite "
                             "value or None")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        params, self._names = _split_names(params)
        # Before torch.optim's own check, which only warns about a repeated tensor.
        _check_unique(params if params and isinstance(params[0], dict) else [{"params": params}])
        super().__init__(params, defaults)
        for gi, g in enumerate(self.param_groups):
            _check_hyper(f"param_groups[{gi}]: ", g["lr"], g["betas"], g["eps"],
                         g["weight_decay"])
            _check_flags(f"param_groups[{gi}] has ", g)

        # Frozen params (requires_grad=False) are not registered: the engine
        # would decay them, torch.optim leaves them alone.
        tensors = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not tensors:
            raise ValueError("OffloadAdam: no param requires grad; nothing to optimize")
        devices = sorted({str(p.device) for p in tensors})
        if len(devices) != 1:
            raise ValueError(f"OffloadAdam: params on more than one device ({', '.join(devices)}); "
                             "one optimizer drives one device: move them or use one optimizer "
                             "per device")
        dtypes = sorted({str(p.dtype) for p in tensors})
        if len(dtypes) != 1:
            raise ValueError(f"OffloadAdam: params of more than one dtype ({', '.join(dtypes)}); "
                             "use one dtype (float32, float16 or bfloat16) for all")
        self._dtype = tensors[0].dtype
        if self._dtype not in _PARAM_DTYPES:
            raise TypeError(f"OffloadAdam: params of dtype {self._dtype}; supported: float32, "
                            "float16, bfloat16")
        for i, p in enumerate(tensors):
            if p.is_sparse or not p.is_contiguous():
                raise ValueError(f"OffloadAdam: param {i} (shape {tuple(p.shape)}) is "
                                 f"{'sparse' if p.is_sparse else 'not contiguous'}; params "
                                 "must be dense and contiguous")
        self._device = tensors[0].device
        if self._device.type not in ("cpu", "cuda"):
            raise ValueError(f"OffloadAdam: params on {self._device}; supported: cpu, cuda")

        base = {
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": offload}},
            "optimizer": {"type": "AdamW" if adamw else "Adam",
                          "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                     "weight_decay": weight_decay}},
            "gradient_clipping": float(max_grad_norm or 0.0),
            # Bytes or a size string ("8GiB"): the engine's config parser checks it.
            "strata": {"host_budget": 0 if host_budget is None else host_budget},
        }
        if not adamw:
            base["optimizer"]["params"]["adam_w_mode"] = False
        if nvme_path:
            paths = [nvme_path] if isinstance(nvme_path, (str, os.PathLike)) else list(nvme_path)
            for path in paths:
                # A missing folder is made by the engine (as DeepSpeed does).
                if os.path.exists(path) and not os.path.isdir(path):
                    raise ValueError(f"OffloadAdam: nvme_path {str(path)!r} exists and is not a "
                                     "directory; give a directory (it is created if missing)")
            base["zero_optimization"]["offload_optimizer"]["nvme_path"] = [str(p) for p in paths]
        if sub_group_size is not None:
            base["zero_optimization"]["sub_group_size"] = (
                "auto" if sub_group_size == "auto" else int(sub_group_size))
        if threads is not None:
            base["strata"]["threads"] = int(threads)
        if gpu_fraction is not None:
            base["strata"]["gpu_fraction"] = gpu_fraction
        if device_budget is not None:
            base["strata"]["device_budget"] = device_budget
        if _PARAM_DTYPES[self._dtype]:
            base[_PARAM_DTYPES[self._dtype]] = {"enabled": True}
        if config:
            base = _merge(base, copy.deepcopy(config))
        _fill_auto(base, {
            "optimizer.params.lr": lr, "optimizer.params.betas": list(betas),
            "optimizer.params.eps": eps, "optimizer.params.weight_decay": weight_decay,
            "gradient_clipping": float(max_grad_norm or 0.0),
            "fp16.enabled": self._dtype == torch.float16,
            "bf16.enabled": self._dtype == torch.bfloat16,
            # "auto" stays "auto": the engine's planner picks the size.
            "zero_optimization.sub_group_size": (
                "auto" if sub_group_size is None else sub_group_size)})
        bad = _non_finite(base)
        if bad:
            raise ValueError(f"OffloadAdam: config {bad}; every number must be finite")
        device_cfg = base["zero_optimization"].get("offload_optimizer", {}).get("device")
        if nvme_path and device_cfg != "nvme":
            warnings.warn(f"OffloadAdam: nvme_path is given but the state is offloaded to "
                          f"{device_cfg!r}: nothing is written there; pass offload='nvme' to "
                          "keep there the state that host_budget leaves out of DRAM",
                          stacklevel=_outside_stacklevel())
        self._config = base
        # The engine reads and writes the tensors as the config's dtypes: they must agree.
        want = _PARAM_DTYPES[self._dtype] or "fp32"
        have = ("fp16" if base.get("fp16", {}).get("enabled") else
                "bf16" if base.get("bf16", {}).get("enabled") else "fp32")
        grad = base.get("strata", {}).get("grad_dtype", have)
        if have != want or grad != want:
            raise ValueError(f"OffloadAdam: the params are {self._dtype} but the config says "
                             f"params {have}, grads {grad}; drop the fp16/bf16/grad_dtype "
                             "settings from config (the params' dtype selects them)")
        # Case-insensitive, as the engine's parser and DeepSpeed read it.
        opt_type = base["optimizer"].get("type")
        if not (isinstance(opt_type, str) and opt_type.lower() in ("adam", "adamw")):
            raise ValueError(f"OffloadAdam: config optimizer.type {opt_type!r}: OffloadAdam runs "
                             "only Adam and AdamW (any case): set one of them, or drop the key "
                             "and choose with adamw=")

        # What the engine holds pointers to, in its order, and the groups as built.
        self._reg = []
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                if p.requires_grad:
                    where = f"param_groups[{gi}]['params'][{pi}]"
                    self._reg.append(_Registered(p, self._names.get(id(p), ""), where))
        self._group_ids = [[id(p) for p in g["params"]] for g in self.param_groups]
        clash = self._trained_elsewhere()
        if clash is not None:
            # The other optimizer may be garbage that only the cycle collector frees:
            # torch 1.13's OneCycleLR holds a bound method of itself, so after `del
            # optimizer, scheduler` both live on in a reference cycle. Collect once.
            gc.collect()
            clash = self._trained_elsewhere()
        if clash is not None:
            k, r = clash
            raise ValueError(
                f"OffloadAdam: {r.describe(k)} is already trained by another OffloadAdam "
                "that is alive; each would overwrite the other's update with its own master "
                "weights. Give each param to one optimizer, or drop the other one first: call "
                "its close(), or drop every reference to it (it survived a garbage "
                "collection, so a scheduler or another object still refers to it: `del "
                "optimizer` alone does not free it)")
        # One dense grad buffer per param; the engine reads grads from these.
        self._grad_bufs = [torch.zeros_like(r.param, memory_format=torch.contiguous_format)
                           for r in self._reg]
        for r, buf in zip(self._reg, self._grad_bufs):
            r.grad_ptr = buf.data_ptr()
        groups = []
        self._engine_group = []  # per torch group: its engine group, None when all frozen
        index = 0
        for g in self.param_groups:
            entries = []
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                r, buf = self._reg[index], self._grad_bufs[index]
                entries.append((r.name, r.ptr, buf.data_ptr(), p.numel(), r.shape))
                index += 1
            self._engine_group.append(len(groups) if entries else None)
            if entries:
                groups.append({"params": entries, **self._hyper_of(g)})

        comm = None
        self._comm = None  # the gloo communicator, when there is one
        self._group = process_group
        world = 1
        if dist.is_available() and dist.is_initialized():
            group = process_group if process_group is not None else dist.group.WORLD
            world = dist.get_world_size(group)
            rank = dist.get_rank(group)
            if rank < 0:
                raise ValueError(
                    f"OffloadAdam: this process (global rank {dist.get_rank()}) is not a member "
                    "of process_group; build the optimizer only on the group's ranks, or pass "
                    "a group this rank belongs to")
            if world > 1:
                self._group = group
                if self._device.type == "cuda":
                    obj = [_strata.nccl_unique_id() if rank == 0 else None]
                    dist.broadcast_object_list(obj, src=_global_rank(group, 0), group=group)
                    # NCCL never times out: the engine's watchdog aborts a collective
                    # that runs this long (torch's own NCCL default where hidden).
                    timeout = _group_timeout(group, self._device)
                    seconds = 600.0 if timeout is None else timeout.total_seconds()
                    strata.logger.info(
                        "OffloadAdam: NCCL collectives time out after %.0f s%s", seconds,
                        "" if timeout is not None else
                        " (the default: the process group's timeout could not be read)")
                    comm = ("nccl", rank, world, obj[0], seconds)
                else:
                    # The engine's collectives run on its own threads (during backward
                    # with overlap_backward), the trainer's on its own
                    # (dist.all_reduce(loss) before step()): on one gloo group they
                    # would meet mid-flight and abort the process. Over the default
                    # group, which every process builds the optimizer in, it takes a
                    # group of its own (a given process_group stays the trainer's
                    # choice: keep other collectives off it).
                    if process_group is None:
                        timeout = _group_timeout(group)
                        group = (dist.new_group(timeout=timeout) if timeout is not None
                                 else dist.new_group())
                    self._comm = _TorchDistributedComm(group, rank, world)
                    comm = ("python", rank, world, self._comm)

        device = "host"
        stream = None
        self._stream = None
        if self._device.type == "cuda":
            index_ = self._device.index if self._device.index is not None \
                else torch.cuda.current_device()
            device = f"cuda:{index_}"
            self._stream = torch.cuda.current_stream(self._device)
            stream = self._stream.cuda_stream
        self._state_dict_dir = (None if state_dict_dir is None
                                else os.path.abspath(os.fspath(state_dict_dir)))
        offload_cfg = self._config.get("zero_optimization", {}).get("offload_optimizer", {})
        paths = offload_cfg.get("nvme_path") or []
        self._nvme_paths = {os.path.realpath(p)
                            for p in ([paths] if isinstance(paths, str) else paths)}
        collected = False
        if any(o._nvme_paths & self._nvme_paths for o in list(_NVME_HOLDERS)):
            # As for the params above: a dropped optimizer on this directory may be
            # garbage in a reference cycle (OneCycleLR's) that still holds its lock.
            gc.collect()
            collected = True
        try:
            self._engine = _strata.Engine(device, json.dumps(self._config, allow_nan=False),
                                          groups, comm, stream)
        except StrataError as e:
            if "held by this process" not in str(e):
                # The engine names config keys; say which argument set the one it names.
                user_strata = config.get("strata") if isinstance(config.get("strata"), dict) else {}
                named = [f"{key} is the {arg}= argument ({value!r})"
                         for key, arg, value in (("strata.host_budget", "host_budget", host_budget),
                                                 ("strata.device_budget", "device_budget",
                                                  device_budget))
                         if value is not None and key in str(e) and arg not in user_strata]
                if named:
                    raise type(e)(f"{e}\nOffloadAdam: {'; '.join(named)}") from e
                raise
            survived = (" (it survived a garbage collection, so a scheduler or another "
                        "object still refers to it: `del optimizer` alone does not free it)"
                        if collected else "")
            raise type(e)(f"{e}\nOffloadAdam: an optimizer of this process still holds it (a "
                          "notebook cell run again?): call its close(), or drop every reference "
                          f"to it, before building this one{survived}") from e
        if self._nvme_paths:
            _NVME_HOLDERS.add(self)
        self._hypers = [self._hyper_of(g) for g in self.param_groups]
        # The update rule the engine resolved (config keys may override adamw=).
        self._adamw = bool(self.engine_config["optimizer"]["params"]["adam_w_mode"])
        # fp16: whether a backward since the last step() went through scale_loss().
        self._scaled = False
        self._warned_no_grad = False
        me = weakref.ref(self)
        for r in self._reg:
            _OWNERS[id(r.param)] = (weakref.ref(r.param), me)
        # Each param's torch version counter when the engine last wrote it or took it
        # as the master weight: a bump means the trainer wrote into it (see _adopt).
        self._versions = [r.param._version for r in self._reg]
        # Whether the params hold values the engine gave them (a step or a load) rather
        # than the trainer's own (load_state_dict keeps the trainer's: see there).
        self._published = False
        # Params whose own values a load_state_dict kept without comparing them with the
        # loaded master weights: the next step compares them (see load_state_dict).
        self._deferred = []
        # The step trace: steps kept by trace= (recording since construction), and
        # whether a trace() block records now.
        self._trace_steps = trace_steps
        self._trace_block = False
        if trace_steps:
            self._engine.trace_start(trace_steps)
        # overlap_backward: the params reported ready since the last step()/zero_grad(),
        # the no_sync() depth, a misuse that refuses step() until zero_grad(), the hooks.
        self._reported = bytearray(len(self._reg))
        self._handed = [None] * len(self._reg)  # each reported grad's (data_ptr, _version)
        self._no_sync = 0
        self._overlap_error = None
        self._hooks = {}
        if overlap_backward:
            self._install_grad_hooks(range(len(self._reg)))

    # --- torch.optim.Optimizer interface ---

    @staticmethod
    def _hyper_of(group, where=""):
        missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in group]
        if missing:
            raise ValueError(f"OffloadAdam: {where}has no {', '.join(missing)}; every param "
                             "group needs lr, betas, eps and weight_decay: set it back (its "
                             "default is in optimizer.defaults)")
        betas = group["betas"]
        if isinstance(betas, torch.Tensor) or not isinstance(betas, (tuple, list)) \
                or len(betas) != 2:
            raise ValueError(f"OffloadAdam: {where}betas is {betas!r}; give two numbers "
                             "(beta1, beta2)")
        return {"lr": _number(where, "lr", group["lr"]),
                "betas": tuple(_number(where, f"betas[{i}]", b) for i, b in enumerate(betas)),
                "eps": _number(where, "eps", group["eps"]),
                "weight_decay": _number(where, "weight_decay", group["weight_decay"])}

    def _sync_hypers(self):
        """Hands the groups' current hyperparameters (schedulers change them) to the engine."""
        for gi, g in enumerate(self.param_groups):
            _check_flags(f"param_groups[{gi}] has ", g)
            h = self._hyper_of(g, f"param_groups[{gi}]: ")
            if h != self._hypers[gi]:
                _check_hyper(f"param_groups[{gi}]: ", h["lr"], h["betas"], h["eps"],
                             h["weight_decay"])
                if self._engine_group[gi] is not None:
                    self._engine.set_group_hyper(self._engine_group[gi], h)
            self._hypers[gi] = h

    def _params(self):
        """The registered params, in the engine's order."""
        return [r.param for r in self._reg]

    @staticmethod
    def _comm_failed_text(failed, when=""):
        return (f"a collective of this optimizer failed{when} ({failed}); the engine's streams "
                "keep that failure, so it cannot run again (no retry_step()): on every rank, "
                "build a new OffloadAdam (after dist.destroy_process_group() and "
                "init_process_group() when a rank died) and load the last checkpoint")

    def _device_lost(self):
        """A step failed on a sticky CUDA error (runtime/device.h IsDeviceLost)."""
        return self._engine.step_failed and _DEVICE_LOST in self._engine.step_failure

    def _refuse_if_comm_failed(self, op):
        # gloo: the first collective _TorchDistributedComm saw fail; NCCL: the
        # watchdog's timeout or an asynchronous NCCL error. A lost GPU is said
        # by _refuse_if_failed instead: no rebuild in this process can help.
        if self._device_lost():
            return
        failed = self._engine.comm_failure
        if failed:
            raise StrataError(f"OffloadAdam.{op}: {self._comm_failed_text(failed, ' earlier')}")

    def _refuse_if_failed(self, op):
        if self._device_lost():
            raise StrataError(
                f"OffloadAdam.{op}: step {self._engine.step_count + 1} failed on an error "
                f"that leaves the GPU unusable in this process ({self._engine.step_failure}); "
                "restart the process and resume from the last checkpoint")
        incomplete = self._engine.incomplete_state
        if incomplete:
            raise StrataError(
                f"OffloadAdam.{op}: {incomplete} (load_checkpoint() or load_state_dict())")
        if self._engine.step_failed:
            raise StrataError(
                f"OffloadAdam.{op}: step {self._engine.step_count + 1} failed part way and is "
                f"not finished ({self._engine.step_failure}); its update reached some "
                "sub-groups only. Call retry_step() to finish it with the gradients it kept "
                "(the current .grad are not used), or load_checkpoint()/load_state_dict() to "
                "replace the state")

    def _check_groups_unchanged(self, op):
        """RuntimeError naming the group when the groups' param lists are not the ones
        the optimizer was built with."""
        if len(self.param_groups) != len(self._group_ids):
            raise RuntimeError(
                f"OffloadAdam.{op}: param_groups has {len(self.param_groups)} groups; the "
                f"optimizer was built with {len(self._group_ids)}. The offloaded layout is "
                "fixed at construction: build a new OffloadAdam over every group (carry the "
                "state over with save_checkpoint/load_checkpoint)")
        for gi, (g, ids) in enumerate(zip(self.param_groups, self._group_ids)):
            if len(g["params"]) != len(ids) or any(id(p) != i for p, i in zip(g["params"], ids)):
                raise RuntimeError(
                    f"OffloadAdam.{op}: param_groups[{gi}]['params'] is not the list of params "
                    "the optimizer was built with (params added, removed or replaced); the "
                    "offloaded layout is fixed: build a new OffloadAdam")
            for pi, p in enumerate(g["params"]):
                if p.requires_grad and id(p) not in self._registered_ids():
                    raise RuntimeError(
                        f"OffloadAdam.{op}: param_groups[{gi}]['params'][{pi}] (shape "
                        f"{tuple(p.shape)}) requires grad now but did not when the optimizer "
                        "was built, so it is not registered and would never be trained: build "
                        "the optimizer after unfreezing (or give frozen params their own "
                        "optimizer)")

    def _check_params(self, op, strict=True):
        """Compares every param with what the engine registered: re-registers a param
        whose storage was replaced (same shape, dtype, device), raises for any other
        change, naming the param. The engine never sees a stale pointer. Returns the
        indices of the params re-registered; with strict=False nothing is raised and
        the indices of the params changed otherwise come second."""
        if strict:
            self._check_groups_unchanged(op)
        problems = []
        moved = []
        for k, r in enumerate(self._reg):
            p = r.param
            what = None
            if not p.requires_grad:
                what = ("no longer requires grad; the engine would keep updating it (weight "
                        "decay, momentum). Freeze params before building the optimizer, or "
                        "build a new one over the params that train")
            elif p.dtype != r.dtype:
                what = (f"changed dtype from {r.dtype} to {p.dtype} (model.double()/.half()?); "
                        f"the engine reads and writes it as {r.dtype}: convert the model back, "
                        "or build the optimizer after converting")
            elif p.device != r.device:
                what = (f"moved from {r.device} to {p.device}; build the optimizer after "
                        "moving the model (model.to(device) first)")
            elif tuple(p.shape) != r.shape:
                what = f"changed shape from {r.shape} to {tuple(p.shape)}"
            elif p.is_sparse or not p.is_contiguous():
                what = "is no longer dense and contiguous; the engine needs contiguous params"
            else:
                # The grad buffer is the engine's, but it is also the param's .grad
                # after zero_grad(), and module.to()/.double() replace a grad's storage
                # as they do a param's.
                buf = self._grad_bufs[k]
                if (buf.dtype, tuple(buf.shape), buf.device) != (r.dtype, r.shape, r.device) \
                        or not buf.is_contiguous():
                    self._grad_bufs[k] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if p.data_ptr() != r.ptr or self._grad_bufs[k].data_ptr() != r.grad_ptr:
                    # Same shape, dtype and device in new memory (also while a failed
                    # step awaits retry_step(): it kept the grads it did not apply).
                    moved.append(k)
            if what and strict:
                raise RuntimeError(f"OffloadAdam.{op}: {r.describe(k)} {what}")
            if what:
                problems.append(k)
        if moved:
            self._rebind(moved)
        return moved if strict else (moved, problems)

    def _written(self, moved=()):
        """The params the trainer may have written since the engine last did: their
        torch version counter moved (in-place writes: model.load_state_dict, clamp_ or
        copy_ under no_grad), or their storage was replaced (`moved`)."""
        changed = set(moved)
        changed.update(k for k, r in enumerate(self._reg)
                       if r.param._version != self._versions[k])
        return sorted(changed)

    @torch.no_grad()
    def _engine_wrote(self, skip=()):
        """The engine wrote the params (all but `skip`): a step, a retry, a load. Their
        torch version counters move, as torch.optim's in-place updates move them, so
        autograd refuses a backward through a graph saved before the write ("modified
        by an inplace operation") instead of running it on the new weights; then the
        versions are marked as the engine's. (An in-place op on an empty view of the
        param moves its counter and touches no element.)"""
        skip = set(skip)
        for k, r in enumerate(self._reg):
            if k not in skip:
                r.param.detach().as_strided((0,), (1,)).zero_()
        self._mark_versions()

    def _mark_versions(self):
        """The params as they are now are what the engine holds."""
        self._versions = [r.param._version for r in self._reg]
        self._published = True
        self._deferred = []

    @torch.no_grad()
    def _adopt(self, indices):
        """For params `indices`: every element whose value differs from what the engine
        last wrote there (the fp32 master weight in the param's dtype) becomes the master
        weight; the moments stay. Elements the trainer left alone keep their fp32 master
        (a version bump without a change costs a read of the master weights, no
        precision)."""
        # The engine compares them in place (pinned DRAM, the NVMe extent buffer, device
        # state in pieces), a million elements at a time: no copy of the state. Returns
        # how many elements of this rank's shard it took.
        if not indices:
            return 0
        with self._on_current_stream():
            return self._engine.reload_params(list(indices))

    def _shard_elems(self, indices):
        """How many elements of params `indices` lie in this rank's shard."""
        layout, bounds = self._engine.layout(), self._engine.sub_groups()
        return sum(max(0, min(end, layout[k][0] + layout[k][1]) - max(begin, layout[k][0]))
                   for k in indices for begin, end in bounds)

    @staticmethod
    def _overlaps(begin, end, indices, layout):
        """Whether a param of `indices` has elements in the sub-group [begin, end)."""
        return any(max(begin, layout[k][0]) < min(end, layout[k][0] + layout[k][1])
                   for k in indices)

    @torch.no_grad()
    def _adopt_into(self, arr, begin, end, indices, layout):
        """What _adopt does, for one sub-group [begin, end) whose state `arr` (master |
        moments, CPU float32: a state_dict's) is in memory: the elements of params
        `indices` that differ from their master in the param's dtype are written into
        the master in `arr`. Returns how many did (0: none)."""
        bits = {torch.float32: torch.int32, torch.float16: torch.int16,
                torch.bfloat16: torch.int16}[self._dtype]
        changed = 0
        for k in indices:
            offset, elems = layout[k]
            flat = self._reg[k].param.detach().reshape(-1)
            # In pieces of 1 Mi elements: the temporaries stay small however large
            # the sub-group.
            for lo in range(max(begin, offset), min(end, offset + elems), 1 << 20):
                hi = min(end, offset + elems, lo + (1 << 20))
                value = flat[lo - offset:hi - offset].to("cpu")
                master = arr[lo - begin:hi - begin]
                differ = value.view(bits) != master.to(self._dtype).view(bits)
                count = int(differ.sum())
                if count:
                    master[differ] = value[differ].to(torch.float32)
                    changed += count
        return changed

    def _rebind(self, moved):
        """Re-registers the params in `moved` at their new storage (and grad buffer), in
        one call: a new tensor may sit where another moved param's old, freed one was,
        so the engine checks the params as they are after every move."""
        self._engine.rebind_params(
            [(k, self._reg[k].param.data_ptr(), self._grad_bufs[k].data_ptr()) for k in moved])
        for k in moved:
            r = self._reg[k]
            r.ptr, r.grad_ptr = r.param.data_ptr(), self._grad_bufs[k].data_ptr()
        self._install_grad_hooks([k for k in moved if k in self._hooks])

    # --- overlap_backward ---

    def _install_grad_hooks(self, indices):
        """Hooks params `indices` so each reports its gradient once autograd has
        accumulated it (replacing a hook they had)."""
        ref = weakref.ref(self)
        with torch.enable_grad():
            for k in indices:
                old = self._hooks.pop(k, None)
                if old is not None:
                    old[0].remove()
                p, hook = self._reg[k].param, _grad_hook(ref, k)
                if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                    self._hooks[k] = (p.register_post_accumulate_grad_hook(hook), None)
                else:
                    # A post hook on the param's AccumulateGrad node, which autograd holds
                    # weakly: kept alive here, or the next backward makes a new one.
                    node = p.expand_as(p).grad_fn.next_functions[0][0]
                    self._hooks[k] = (node.register_hook(hook), node)

    @torch.no_grad()
    def _grad_accumulated(self, k):
        """overlap_backward: param k's .grad holds this backward's gradient."""
        if self._no_sync or self._engine.step_failed:
            return  # an earlier micro-step; or retry_step() will not read .grad
        self._refuse_unscaled("backward")
        r = self._reg[k]
        if self._reported[k]:
            self._overlap_error = (
                f"OffloadAdam(overlap_backward=True): {r.describe(k)} got a second gradient "
                "before step(), after the engine took its first as final. For gradient "
                "accumulation run the earlier backwards inside `with optimizer.no_sync():`; "
                "a param whose gradient arrives in several pieces in one backward (weights "
                "shared across reentrant activation-checkpoint segments) needs "
                "overlap_backward=False")
            raise RuntimeError(self._overlap_error)
        p, buf, g = r.param, self._grad_bufs[k], r.param.grad
        if (g is None or g.is_sparse or tuple(g.shape) != r.shape or p.dtype != r.dtype
                or p.data_ptr() != r.ptr or buf.data_ptr() != r.grad_ptr):
            return  # step() checks it (and re-registers a moved param)
        if g.data_ptr() != buf.data_ptr():
            buf.copy_(g)
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            if current != self._stream:
                self._stream.wait_stream(current)
        self._engine.grad_ready(k)
        self._reported[k] = 1
        self._handed[k] = (g.data_ptr(), g._version)

    def _check_handed_grads(self):
        """overlap_backward: a .grad written after backward handed it to the engine
        (clip_grad_norm_, a scaling) would be ignored: refused."""
        for k in (k for k in range(len(self._reg)) if self._reported[k]):
            g = self._reg[k].param.grad
            if g is not None and (g.data_ptr(), g._version) != self._handed[k]:
                raise RuntimeError(
                    f"OffloadAdam(overlap_backward=True).step: the .grad of "
                    f"{self._reg[k].describe(k)} changed after backward handed it to the "
                    "engine (clip_grad_norm_, a GradScaler's unscale_, or another write into "
                    ".grad); the engine reads gradients during backward, so the change would "
                    "be ignored. Clip with OffloadAdam(max_grad_norm=...); with a GradScaler "
                    "(or any other change to the gradients after backward) use "
                    "overlap_backward=False. Call zero_grad() and run the backward again")

    @contextlib.contextmanager
    def no_sync(self):
        """For gradient accumulation with overlap_backward=True: the backwards inside
        are not the last micro-step, so their gradients are not handed to the engine
        (as DistributedDataParallel.no_sync()). Run the last backward outside. Without
        overlap_backward it changes nothing."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def __del__(self):
        for handle, _ in getattr(self, "_hooks", {}).values():
            try:
                handle.remove()
            except Exception:  # torch torn down first at interpreter exit
                pass

    def __copy__(self):
        raise TypeError(
            "OffloadAdam cannot be copied: its state lives in the engine (pinned memory, "
            "NVMe files, a lock on nvme_path), not in Python objects. Save "
            "optimizer.state_dict() (or save_checkpoint(dir)) and load it into a new "
            "OffloadAdam built over the new model's params")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce_ex__(self, protocol):
        # Pickled, an OffloadAdam is a placeholder without its state: torch 1.13's
        # OneCycleLR.state_dict() holds a bound method of the scheduler, so a
        # torch.save of it pickles the optimizer too, which must not fail.
        warnings.warn(
            "OffloadAdam pickled as a placeholder: its state lives in the engine and is not "
            "in the pickle (harmless inside a scheduler's state_dict, e.g. torch 1.13's "
            "OneCycleLR). To save the optimizer, save optimizer.state_dict() or call "
            "save_checkpoint(dir)", stacklevel=_outside_stacklevel())
        steps = (self._closed_step_count if isinstance(self._engine, _Closed)
                 else self._engine.step_count)
        return (_PickledOffloadAdam, (steps,))

    @_one_thread
    def close(self):
        """Releases the engine now: its host memory, its NVMe files and the lock on
        nvme_path (as `del optimizer` does once nothing else refers to it). Any later
        call raises. Also `with OffloadAdam(...) as optimizer:`."""
        if isinstance(self._engine, _Closed):
            return
        for handle, _ in self._hooks.values():
            handle.remove()
        self._hooks = {}
        for r in self._reg:
            param, owner = _OWNERS.get(id(r.param), (None, None))
            if owner is not None and owner() is self:
                del _OWNERS[id(r.param)]
        _NVME_HOLDERS.discard(self)
        self._closed_step_count = self._engine.step_count  # for a pickle after close
        # The engine's grad buffers (model-sized; GPU memory on CUDA) stay only where a
        # param's .grad still points at one.
        self._grad_bufs = []
        self._engine = _Closed()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _trained_elsewhere(self):
        """(k, registered param) of the first param another live OffloadAdam trains, or
        None; forgets the entries of freed optimizers and params."""
        for key in [key for key, (p, o) in _OWNERS.items() if p() is None or o() is None]:
            del _OWNERS[key]
        for k, r in enumerate(self._reg):
            param, _ = _OWNERS.get(id(r.param), (lambda: None, None))
            if param() is r.param:
                return k, r
        return None

    def _registered_ids(self):
        ids = getattr(self, "_reg_ids", None)
        if ids is None:
            ids = self._reg_ids = {id(r.param) for r in self._reg}
        return ids

    def add_param_group(self, param_group):
        if hasattr(self, "_engine"):
            raise RuntimeError(
                "OffloadAdam.add_param_group: not supported after construction: the offloaded "
                "state is laid out once, over every param, when the optimizer is built. Pass "
                "every group to the constructor (a group can start with lr=0 and get its "
                "learning rate from a scheduler later), or build a new OffloadAdam over all "
                "groups, whose state starts anew (a checkpoint or state_dict loads only into "
                "the params and groups it was saved from)")
        super().add_param_group(param_group)

    @contextlib.contextmanager
    def _on_current_stream(self):
        """Orders the engine calls inside on the current CUDA stream when it is not the
        one the engine was built on: the engine's stream waits for it before, and it
        waits for the engine's stream after (a loop under `with torch.cuda.stream(s):`)."""
        current = None
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            if current == self._stream:
                current = None
            else:
                self._stream.wait_stream(current)
        try:
            yield
        finally:
            if current is not None:
                current.wait_stream(self._stream)

    def _run(self, op):
        """Runs the engine call `op` (a method name) that updates the params, ordered on
        the current CUDA stream. By name: a bound method of the engine in this frame would
        be kept by the traceback of an exception it raises, and keep the engine (its
        memory, files and nvme_path lock) alive after close()."""
        try:
            with self._on_current_stream():
                getattr(self._engine, op)()
        except StrataError as e:
            if _DEVICE_LOST in str(e):
                # A sticky CUDA error (runtime/device.h IsDeviceLost): every later CUDA
                # call in this process fails, torch's too, so no retry_step() or load
                # here can succeed; the message says to restart. Checked before the
                # DataLoss advice below, which is for a damaged file.
                raise StrataError(
                    f"{e}\nOffloadAdam: no call in this process can recover from this "
                    "(retry_step() and load_checkpoint() fail the same way): restart the "
                    "process and resume with load_checkpoint() from the last checkpoint") from e
            failed = self._engine.comm_failure
            if failed:  # no retry_step() can succeed: the communicator is stopped
                raise StrataError(f"{e}\nOffloadAdam: {self._comm_failed_text(failed)}") from e
            if self._engine.step_failed:
                if str(e).startswith("DataLoss"):
                    raise StrataError(
                        f"{e}\nOffloadAdam: the step failed part way on state that is damaged: "
                        "load_checkpoint() or load_state_dict() replaces the state (a "
                        "retry_step() reads the same bytes again: only after the file was "
                        "restored)") from e
                raise StrataError(
                    f"{e}\nOffloadAdam: the step failed part way; call retry_step() to finish "
                    "it (once the cause is fixed), or load_checkpoint()/load_state_dict() to "
                    "replace the state") from e
            raise

    @_one_thread
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (a collective with torch.distributed); returns closure()'s loss."""
        self._refuse_if_comm_failed("step")
        self._refuse_if_failed("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._overlap_error:
            raise RuntimeError(f"{self._overlap_error}. Call zero_grad() and run the backward "
                               "again")
        self._refuse_unscaled("step")
        self._check_handed_grads()
        self._take_trainer_writes("step")
        self._sync_hypers()
        no_grad = []
        for k, (r, buf) in enumerate(zip(self._reg, self._grad_bufs)):
            if self._reported[k]:
                continue  # in its buffer, handed to the engine during backward
            g = r.param.grad
            if g is None:
                no_grad.append(k)
                buf.zero_()
            elif g.is_sparse:
                raise RuntimeError(f"OffloadAdam: {r.describe(k)} has a sparse gradient; "
                                   "OffloadAdam needs dense gradients "
                                   "(e.g. nn.Embedding(sparse=False))")
            elif tuple(g.shape) != r.shape:
                raise RuntimeError(f"OffloadAdam.step: {r.describe(k)} has a grad of shape "
                                   f"{tuple(g.shape)}")
            elif g.data_ptr() != buf.data_ptr():
                buf.copy_(g)
        if no_grad and not self._warned_no_grad:
            self._warned_no_grad = True
            names = ", ".join(self._reg[k].describe(k) for k in no_grad[:3])
            more = f" and {len(no_grad) - 3} more" if len(no_grad) > 3 else ""
            one = len(no_grad) == 1
            it, its = ("it", "its") if one else ("them", "their")
            warnings.warn(
                f"OffloadAdam.step: {names}{more} got no gradient (.grad is None). OffloadAdam "
                f"steps {it} as with a zero gradient, as every step steps every param: {its} "
                f"Adam moments decay, the update they still make {'moves' if one else 'move'} "
                f"{it}, and weight decay applies; torch.optim skips {it}. Freeze params that "
                "never train (requires_grad=False) before building the optimizer. Warned once",
                stacklevel=_outside_stacklevel())
        self._state_version += 1
        self._published = True  # the params are the master weights (adopted above)
        try:
            self._run("step")
        except BaseException:
            # Failed part way: retry_step() applies the gradients it kept. Failed before
            # the update (the engine keeps the hand-over): the next step() takes them.
            if self._engine.step_failed:
                self._reported = bytearray(len(self._reg))
                self._engine_wrote()  # some params may be written already
            raise
        self._engine_wrote()
        self._reported = bytearray(len(self._reg))
        self._scaled = False
        return loss

    @_one_thread
    @torch.no_grad()
    def retry_step(self):
        """Finishes a step that failed part way, with the gradients it kept (a collective).
        The params' current .grad are not read. StrataError when no step failed."""
        self._refuse_if_comm_failed("retry_step")
        self._check_params("retry_step")
        self._state_version += 1
        self._run("retry_step")
        self._engine_wrote()
        self._scaled = False  # the next step needs a scaled backward of its own

    @_one_thread
    @torch.no_grad()
    def reload_params(self, params=None):
        """Takes the params' current values as the fp32 master weights wherever they
        differ from what the optimizer last wrote there (elementwise; the moments stay).
        step() does this by itself for every write torch tracks (model.load_state_dict,
        in-place ops under torch.no_grad(), a replaced storage); a write through
        ``p.data`` (``p.data.clamp_(-c, c)``) is invisible to torch: call this after it.
        params: tensors of this optimizer (default: every param)."""
        self._refuse_if_failed("reload_params")
        self._refuse_if_comm_failed("reload_params")
        moved = self._check_params("reload_params")
        # With those a load kept as they were: they hold the trainer's values too.
        indices = set(self._written(moved)) | set(self._deferred)
        if params is None:
            indices.update(range(len(self._reg)))
        else:
            index = {id(r.param): k for k, r in enumerate(self._reg)}
            for i, p in enumerate([params] if isinstance(params, torch.Tensor) else params):
                if id(p) not in index:
                    raise ValueError(f"OffloadAdam.reload_params: params[{i}] (shape "
                                     f"{tuple(p.shape)}) is not a param this optimizer trains")
                indices.add(index[id(p)])
        self._state_version += 1
        self._adopt(sorted(indices))
        self._mark_versions()

    @property
    def step_failed(self):
        """True while a step that failed part way awaits retry_step() or a load."""
        return self._engine.step_failed

    @_one_thread
    def zero_grad(self, set_to_none=False):
        """Zeroes the grads. set_to_none=False (default) points each param's .grad
        at the engine's zeroed buffer, so the next backward accumulates in place."""
        self._refuse_if_comm_failed("zero_grad")
        # A param or grad buffer whose storage was replaced since the last step
        # (model.double().float() swaps a grad's storage too) is re-registered first:
        # the engine never zeroes freed memory.
        # The engine zeroes what it holds; a grad buffer changed otherwise (model.half()
        # gives it new storage of another dtype) is left to step(), which names it.
        _, problems = self._check_params("zero_grad", strict=False)
        engine_zeroes = all(self._grad_bufs[k].data_ptr() == self._reg[k].grad_ptr
                            for k in problems)
        if engine_zeroes:
            with self._on_current_stream():
                self._engine.zero_grad()
        self._forget_hand_over()
        self._scaled = False  # a scaled backward's gradients are gone with them
        for r, buf in zip(self._reg, self._grad_bufs):
            p = r.param
            compatible = (p.dtype == buf.dtype and p.device == buf.device and
                          p.shape == buf.shape)
            if set_to_none or not compatible:
                p.grad = None
            else:
                if not engine_zeroes:
                    buf.zero_()  # the engine zeroed none: the next backward adds to it
                p.grad = buf

    def _pack_groups(self):
        groups = []
        index = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        return groups

    def _header(self):
        return {"version": _STATE_DICT_VERSION, "rank": self._engine.rank,
                "world_size": self._engine.world_size,
                "param_shapes": [r.shape for r in self._reg],
                "param_dtype": str(self._dtype), "adamw": self._adamw}

    def iter_state(self):
        """Yields (sub_group, (begin, end), tensor) for this rank's offloaded state, one
        sub-group at a time: the tensor holds master | exp_avg | exp_avg_sq of flat
        elements [begin, end) (float32, CPU). Memory: one sub-group. A step or load
        between two sub-groups (from any thread) raises StrataError at the next one: the
        state read would mix two steps."""
        self._refuse_if_failed("iter_state")
        version = self._state_version
        n = self._engine.state_array_count
        for i, (begin, end) in enumerate(self._engine.sub_groups()):
            if self._state_version != version:
                raise StrataError(
                    f"OffloadAdam.iter_state: the state changed (a step or a load) after "
                    f"{i} of its sub-groups were read; the rest would be another step's. "
                    "Read the state between steps")
            t = torch.empty((end - begin) * n, dtype=torch.float32)
            self._engine.read_state(i, t.data_ptr(), t.numel())
            yield i, (begin, end), t

    @_one_thread
    def state_dict(self):
        """This rank's offloaded state and the param groups' hyperparameters: CPU tensors
        (12 bytes per param), or with state_dict_dir a reference to a checkpoint saved
        there (a few hundred bytes; the state streams to disk)."""
        self._refuse_if_failed("state_dict")
        state = self._header()
        if self._state_dict_dir is not None:
            self.save_checkpoint(self._state_dict_dir)
            state.update(kind="checkpoint", step=self._engine.step_count,
                         checkpoint=_strata.Checkpoint(self._state_dict_dir).save_dir)
        else:
            state.update(kind="arrays", sub_groups=self._engine.sub_groups(),
                         state_array_count=self._engine.state_array_count,
                         arrays=[t for _, _, t in self.iter_state()],
                         step=self._engine.step_count,
                         loss_scaler=self._engine.scaler_state())
        return {"state": {"strata": state}, "param_groups": self._pack_groups()}

    @_one_thread
    def load_state_dict(self, state_dict):
        """Loads a state_dict() of an optimizer built the same way (params, groups, ranks),
        or a torch.optim.Adam/AdamW state_dict (m, v, step; the master weights are the
        params' current values). Everything is checked before anything is written.

        The params: as with torch.optim, whatever the model holds is where the next
        step starts. A param the trainer wrote since the optimizer last wrote it (a
        step or a load; model.load_state_dict(W) before or after building the
        optimizer, an in-place write, a new .data) keeps its values, which become the
        master weights where they differ from the loaded ones in the param's dtype; the
        other elements keep the loaded fp32 master. Before the optimizer has written
        the params, the others keep their values too, compared with the loaded master
        at the next step (a model.load_state_dict in between is then a consistent
        resume). A param the trainer left alone since a step or load takes the loaded
        master weights (written into it at once: a rollback of the optimizer rolls the
        weights back too). So the order of the loads does not matter, and a
        consistent resume keeps the fp32 master of bf16/fp16 params bitwise."""
        try:
            state, saved_groups = state_dict["state"], state_dict["param_groups"]
        except (KeyError, TypeError):
            raise ValueError("OffloadAdam.load_state_dict: not an optimizer state_dict (no "
                             "'state' and 'param_groups')")
        self._state_version += 1
        kept = []
        if isinstance(state, dict) and "strata" in state:
            self._refuse_if_comm_failed("load_state_dict")
            self._refuse_mid_hand_over("load_state_dict")
            # Before anything is loaded: which params hold the trainer's values. Those it
            # wrote since the engine last wrote them or took them (their version counter
            # moved, or their storage was replaced: re-registered here) are compared
            # with the loaded master now. Before the engine has written the params (no
            # step or load that wrote them yet) the others are the trainer's too (the
            # values the optimizer was built over, perhaps a model.load_state_dict before
            # building it): they keep their values, unwritten, and the next step
            # compares them with the loaded master. A model.load_state_dict between this
            # load and that step then finds the master it was saved with, fp32 intact.
            moved = self._check_params("load_state_dict")
            written = self._written(moved)
            kept = [] if self._published else sorted(set(range(len(self._reg))) - set(written))
            self._load_strata_state(state["strata"], saved_groups, written, kept)
        else:
            self._check_groups_match(saved_groups)
            self._load_torch_adam_state(state, saved_groups)
        for g, saved in zip(self.param_groups, saved_groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        self._sync_hypers()
        self._engine_wrote(skip=kept)
        if kept:  # not written by this load: still the trainer's values
            self._published = False
            self._deferred = kept

    def _check_groups_match(self, saved_groups):
        if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(
                self.param_groups) or any(
                len(a.get("params", ())) != len(b["params"])
                for a, b in zip(saved_groups, self.param_groups)):
            raise ValueError("OffloadAdam.load_state_dict: the saved param groups differ in "
                             "number or size from this optimizer's")
        for gi, g in enumerate(saved_groups):
            _check_hyper(f"load_state_dict: param_groups[{gi}]: ", g.get("lr"), g.get("betas"),
                         g.get("eps"), g.get("weight_decay"))

    def _load_strata_state(self, s, saved_groups, written, kept):
        """Loads an OffloadAdam state_dict; the params in `written` (indices) keep their
        values, which become the master where they differ from it, and those in `kept`
        keep them as they are (load_state_dict). With `kept`, no param is written from
        the loaded master: the engine had not written them yet."""
        bad = "OffloadAdam.load_state_dict: "
        if not isinstance(s, dict) or s.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"{bad}version {s.get('version') if isinstance(s, dict) else s!r}; "
                             f"this build reads {_STATE_DICT_VERSION}")
        if s.get("world_size") != self._engine.world_size or s.get("rank") != self._engine.rank:
            raise ValueError(f"{bad}saved by rank {s.get('rank')} of {s.get('world_size')}, "
                             f"loading on rank {self._engine.rank} of {self._engine.world_size}; "
                             "use save_checkpoint/load_checkpoint to change the number of ranks")
        saved = [tuple(x) for x in s.get("param_shapes", ())]
        if saved != [r.shape for r in self._reg]:
            if len(saved) != len(self._reg):
                what = f"{len(saved)} tensors where this optimizer has {len(self._reg)}"
            else:
                i = next(i for i, r in enumerate(self._reg) if saved[i] != r.shape)
                name = f" ({self._reg[i].name})" if self._reg[i].name else ""
                what = (f"param {i}{name} was {list(saved[i])} where this optimizer's is "
                        f"{list(self._reg[i].shape)}")
            raise ValueError(f"{bad}the saved params have other shapes: {what}; load a "
                             "state_dict saved from the same model")
        # Adam and AdamW are one update where no group decays: then either loads.
        decays = [g.get("weight_decay", 0) for g in saved_groups] + \
            [g["weight_decay"] for g in self.param_groups]
        if "adamw" in s and s["adamw"] != self._adamw and any(decays):  # absent: older dicts
            mode = {True: "AdamW (adamw=True)", False: "Adam with L2 decay (adamw=False)"}
            raise ValueError(f"{bad}saved by an {mode[bool(s['adamw'])]} optimizer, loading "
                             f"into an {mode[self._adamw]} one: the state would go on under "
                             "another update rule; build the optimizer as the saved one was")
        self._check_groups_match(saved_groups)
        # Before anything is written: copied into param_groups, a refused flag would
        # fail every step after the load (and the load itself, late). A torch
        # state_dict's flags are checked in _load_torch_adam_state.
        for gi, g in enumerate(saved_groups):
            _check_flags(f"load_state_dict: param_groups[{gi}] has ", g)
        if s.get("kind") == "checkpoint":
            where = s.get("checkpoint")
            if isinstance(where, (str, os.PathLike)) and not os.path.isdir(where):
                # state_dict_dir keeps the newest two saves: an older state_dict names
                # one removed since (a trainer that keeps more checkpoint folders).
                raise ValueError(f"{bad}it names the save {os.fspath(where)!r} of a "
                                 "state_dict_dir, which no longer exists (state_dict_dir keeps "
                                 "the newest two saves, removing older ones): load a newer "
                                 "state_dict, or keep saves of your own with "
                                 "save_checkpoint(dir)")
            # The load writes every param from the checkpoint: the written and kept
            # ones whose values differ from it are set aside and put back, and the
            # written ones adopted.
            aside = self._values_differing_from(s["checkpoint"], sorted(set(written) | set(kept)))
            self.load_checkpoint(s["checkpoint"])
            if aside:
                with torch.no_grad():
                    for k, value in aside.items():
                        param = self._reg[k].param
                        param.copy_(value.view_as(param))
                self._adopt([k for k in sorted(aside) if k in set(written)])
            return
        sub_groups = [tuple(x) for x in self._engine.sub_groups()]
        n = self._engine.state_array_count
        if [tuple(x) for x in s.get("sub_groups", ())] != sub_groups \
                or s.get("state_array_count") != n:
            raise ValueError(f"{bad}the saved state is cut into other sub-groups "
                             "(sub_group_size or alignment changed); build the optimizer with "
                             "the same config")
        arrays = s.get("arrays")
        if not isinstance(arrays, (list, tuple)) or len(arrays) != len(sub_groups):
            raise ValueError(f"{bad}{len(arrays) if isinstance(arrays, (list, tuple)) else 'no'} "
                             f"state arrays for {len(sub_groups)} sub-groups")
        for i, (t, (begin, end)) in enumerate(zip(arrays, sub_groups)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 \
                    or t.numel() != (end - begin) * n:
                what = (f"a {type(t).__name__}" if not isinstance(t, torch.Tensor) else
                        f"{t.numel()} {t.dtype} elements")
                raise ValueError(f"{bad}state array {i} is {what}; sub-group {i} needs "
                                 f"{(end - begin) * n} float32 elements")
        step = s.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{bad}step is {step!r}; it must be an int")
        if not isinstance(s.get("loss_scaler"), dict):
            raise ValueError(f"{bad}no loss_scaler state")
        scaler = dict(s["loss_scaler"])
        saved_dtype = s.get("param_dtype")  # absent in state dicts of older builds
        if saved_dtype is not None and (saved_dtype == str(torch.float16)) != (
                self._dtype == torch.float16):
            # Saved with another loss scaling (bf16/fp32: scale 1; fp16: dynamic): this
            # optimizer keeps its own scaler, as a checkpoint load does.
            scaler = self._engine.scaler_state()
        self._engine.check_counters(step, scaler)
        # Everything holds: write. Only an IO error can stop it now.
        layout = self._engine.layout()
        try:
            for i, (t, (begin, end)) in enumerate(zip(arrays, sub_groups)):
                t = t.detach().to(device="cpu").contiguous()
                if self._overlaps(begin, end, written, layout):
                    # The params the trainer wrote win where they differ (a copy: the
                    # caller's state_dict stays as it was).
                    t = t.clone()
                    self._adopt_into(t, begin, end, written, layout)
                self._engine.write_state(i, t.data_ptr(), t.numel())
            self._engine.restore_counters(step, scaler)
            self._forget_hand_over()
        except StrataError as e:
            raise StrataError(f"{e}\nOffloadAdam.load_state_dict: the state is partly "
                              "written; load it again (or load a checkpoint)") from e
        # Every param follows the master weights now (the written ones keep their
        # values exactly; a step that failed part way had written some already). A
        # collective with several ranks, as the checkpoint kind's load. Before the
        # engine has written the params (the same on every rank) every param is the
        # trainer's, written or kept: nothing to write.
        if self._published:
            self._run("upload_params")

    @torch.no_grad()
    def _values_differing_from(self, directory, indices):
        """{k: a CPU copy of param k} for the params `indices` whose values differ from
        the master weights of the checkpoint in `directory` in the param's dtype (read one
        tensor at a time). {} when the checkpoint does not match the params: the load
        that follows names what differs."""
        if not indices:
            return {}
        try:
            ckpt = _strata.Checkpoint(os.fspath(directory))
            tensors = ckpt.tensors()
        except StrataError:
            return {}
        if len(tensors) != len(self._reg) or any(
                t["elems"] != r.param.numel() for t, r in zip(tensors, self._reg)):
            return {}
        bits = {torch.float32: torch.int32, torch.float16: torch.int16,
                torch.bfloat16: torch.int16}[self._dtype]
        kept = {}
        for k in indices:
            param = self._reg[k].param.detach().reshape(-1)
            if param.numel() == 0:
                continue
            master = torch.empty(param.numel(), dtype=torch.float32)
            ckpt.read_master(k, master.data_ptr(), master.numel())
            value = param.to("cpu")
            if bool((value.view(bits) != master.to(self._dtype).view(bits)).any()):
                kept[k] = value.clone()
        return kept

    def _load_torch_adam_state(self, state, saved_groups):
        bad = "OffloadAdam.load_state_dict: "
        if not isinstance(state, dict):
            raise ValueError(f"{bad}not an OffloadAdam or torch.optim Adam/AdamW state_dict")
        for gi, g in enumerate(saved_groups):
            for flag in _UNSUPPORTED_FLAGS:
                if g.get(flag):
                    # Such a group would refuse every step() after the load.
                    hint = ("" if flag in ("amsgrad", "maximize") else
                            f": set state_dict['param_groups'][{gi}]['{flag}'] = False "
                            "(the state itself loads as it is)")
                    raise ValueError(f"{bad}param_groups[{gi}] has {flag}=True; OffloadAdam "
                                     f"runs Adam/AdamW without {flag}{hint}")
            # Newer torch keeps AdamW as Adam with decoupled_weight_decay=True in every
            # group (older dicts cannot tell the two apart). Where a group decays, the
            # state would go on under the other rule with the saved weight_decay.
            decoupled = g.get("decoupled_weight_decay")
            if decoupled is not None and bool(decoupled) != self._adamw and (
                    g.get("weight_decay") or self.param_groups[gi]["weight_decay"]):
                saved = ("torch.optim.AdamW (decoupled_weight_decay=True)" if decoupled else
                         "torch.optim.Adam with L2 decay (decoupled_weight_decay=False)")
                here = "AdamW (adamw=True)" if self._adamw else "Adam with L2 decay (adamw=False)"
                raise ValueError(f"{bad}param_groups[{gi}] was saved by {saved} with "
                                 f"weight_decay {g.get('weight_decay')}; this optimizer runs "
                                 f"{here}: the decay would go on under another rule. Build "
                                 f"OffloadAdam with adamw={bool(decoupled)}")
        # torch numbers every param of every group, frozen ones included.
        flat = [p for g in self.param_groups for p in g["params"]]
        index_of = {id(p): i for i, p in enumerate(flat)}
        per_param, steps = [], set()
        for k, r in enumerate(self._reg):
            i = index_of[id(r.param)]
            st = state.get(i, state.get(str(i)))
            if st is None:
                per_param.append(None)
                continue
            if not isinstance(st, dict) or "max_exp_avg_sq" in st or not {
                    "step", "exp_avg", "exp_avg_sq"} <= set(st):
                raise ValueError(f"{bad}state {i} ({r.describe(k)}) is not Adam state "
                                 "(step, exp_avg, exp_avg_sq; no AMSGrad)")
            for key in ("exp_avg", "exp_avg_sq"):
                t = st[key]
                if not isinstance(t, torch.Tensor) or not t.is_floating_point() \
                        or t.numel() != r.param.numel():
                    raise ValueError(f"{bad}state {i} ({r.describe(k)}): {key} is not a float "
                                     f"tensor of {r.param.numel()} elements")
                # torch keeps the moments in the param's shape: another shape of as many
                # elements is another param's state (two layers swapped), which torch's
                # own step would refuse.
                if tuple(t.shape) != r.shape:
                    raise ValueError(f"{bad}state {i} ({r.describe(k)}): {key} has shape "
                                     f"{tuple(t.shape)} where the param's is {r.shape}; load "
                                     "a state_dict saved from the same model")
            step = float(st["step"])
            if not (math.isfinite(step) and step >= 0 and step == int(step)):
                raise ValueError(f"{bad}state {i}: step {step} is not a count")
            steps.add(int(step))
            per_param.append(st)
        if len(steps) > 1:
            raise ValueError(f"{bad}the params have taken different numbers of steps "
                             f"({sorted(steps)}); OffloadAdam keeps one step count")
        if not any(p is not None for p in per_param) and state:
            raise ValueError(f"{bad}its state belongs to none of this optimizer's params")
        step = steps.pop() if steps else 0
        scaler = self._engine.scaler_state()
        self._engine.check_counters(step, scaler)
        layout = self._engine.layout()
        n = self._engine.state_array_count
        for sg, (begin, end) in enumerate(self._engine.sub_groups()):
            arr = torch.zeros((end - begin) * n, dtype=torch.float32)
            for k, (offset, elems) in enumerate(layout):
                lo, hi = max(begin, offset), min(end, offset + elems)
                if lo >= hi:
                    continue
                src = [self._reg[k].param.detach()]
                st = per_param[k]
                if st is not None:
                    src += [st["exp_avg"], st["exp_avg_sq"]]
                for a, t in enumerate(src):
                    flat_t = t.reshape(-1)[lo - offset:hi - offset].to(device="cpu",
                                                                       dtype=torch.float32)
                    at = a * (end - begin) + lo - begin
                    arr[at:at + hi - lo] = flat_t
            self._engine.write_state(sg, arr.data_ptr(), arr.numel())
        self._engine.restore_counters(step, scaler)
        self._forget_hand_over()

    # --- Strata extras ---

    @_one_thread
    def save_checkpoint(self, directory):
        """Writes the C++ engine's checkpoint (docs/checkpoint.md) to `directory`, with the
        params' names and shapes. Refused while a failed step awaits retry_step()."""
        self._refuse_if_failed("save_checkpoint")
        self._refuse_if_comm_failed("save_checkpoint")
        self._refuse_mid_hand_over("save_checkpoint")
        # Weights the trainer wrote since the last step (a pretrained model loaded after
        # building the optimizer) are what the next step would train from: saved too.
        self._take_trainer_writes("save_checkpoint")
        self._sync_hypers()
        with self._on_current_stream():
            self._engine.save(os.fspath(directory))

    def _take_trainer_writes(self, op):
        """The params' values as master weights where the trainer wrote them since the
        optimizer last did (model.load_state_dict, in-place ops under no_grad, a replaced
        storage): before a step uses the master weights, and before a save writes them."""
        moved = self._check_params(op)
        written = self._written(moved)
        # The params a load kept as they were, now compared with its master weights: a
        # model loaded since (a consistent resume) matches them and keeps their fp32
        # precision; one never loaded goes on from its own weights, as with torch.optim.
        untouched = sorted(set(self._deferred) - set(written))
        if written or untouched:
            self._state_version += 1
            differing, total = self._adopt(untouched), self._shard_elems(untouched)
            self._adopt(written)
            self._mark_versions()
            if differing * 2 > total > 0:
                warnings.warn(
                    f"OffloadAdam.{op}: the model's params differed from the loaded "
                    f"state_dict's master weights in {differing} of {total} elements, and "
                    "were not written since: training goes on from the model's own weights, "
                    "as with torch.optim. To resume the saved weights, load the model's "
                    "state_dict too (before or after the optimizer's), or load_checkpoint()",
                    stacklevel=_outside_stacklevel())

    def _refuse_unscaled(self, op):
        """fp16: gradients not scaled by loss_scale would make the update that many times
        too small. Checked in step(), and with overlap_backward at the first hand-over,
        before this rank sends anything (the other ranks then wait for its retry)."""
        if not self._scaled and self._engine.loss_scale != 1.0:
            raise RuntimeError(
                f"OffloadAdam.{op}: the params are float16, so step() divides the gradients "
                f"by the loss scale ({self._engine.loss_scale:g}), and no backward since the "
                "last step went through optimizer.backward(loss) or "
                "optimizer.scale_loss(loss).backward(): a plain loss.backward() would make "
                "the update that many times too small. Call zero_grad() and run the backward "
                "as optimizer.backward(loss). For gradients set by hand, use a static "
                "scale of 1: config={'fp16': {'loss_scale': 1}}. Trainers that call "
                "loss.backward() themselves need bfloat16 or float32 params")

    def _forget_hand_over(self):
        """No param counts as reported any more: after zero_grad(), and after a load (the
        engine dropped the gradients handed over for the state it replaced)."""
        self._reported = bytearray(len(self._reg))
        self._overlap_error = None

    def _refuse_mid_hand_over(self, op):
        """overlap_backward with several ranks: between a backward and step() the handed-over
        gradients are reduced over the engine's communicator, where a checkpoint's
        collectives would meet them (gloo aborted the process)."""
        if self._engine.world_size > 1 and any(self._reported):
            raise StrataError(
                f"OffloadAdam.{op}: called between a backward and step() with "
                "overlap_backward=True on several ranks: the gradients that backward handed "
                "over are being reduced over the communicator the checkpoint would use. Call "
                "it after step() (or zero_grad()), before the next backward")

    @_one_thread
    def load_checkpoint(self, directory):
        """Reads a checkpoint written by save_checkpoint or the C++/C API: the state, the
        counters and the params; the groups' hyperparameters become the engine's. Shapes
        recorded in the checkpoint must match the params'."""
        self._refuse_if_comm_failed("load_checkpoint")
        self._check_params("load_checkpoint")
        self._refuse_mid_hand_over("load_checkpoint")
        self._state_version += 1
        with self._on_current_stream():
            self._engine.load(os.fspath(directory))
        self._forget_hand_over()
        self._engine_wrote()
        for gi, g in enumerate(self.param_groups):
            if self._engine_group[gi] is None:
                continue
            h = self._engine.group_hyper(self._engine_group[gi])
            g.update(lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"],
                     weight_decay=h["weight_decay"])
            self._hypers[gi] = self._hyper_of(g)

    @property
    def loss_scale(self):
        """The multiplier for the next backward (1 unless fp16)."""
        return self._engine.loss_scale

    def scale_loss(self, loss):
        """loss * loss_scale: call .backward() on it with fp16 params."""
        self._scaled = True
        return loss * self._engine.loss_scale

    def backward(self, loss, **kwargs):
        """scale_loss(loss).backward(**kwargs)."""
        self.scale_loss(loss).backward(**kwargs)

    def last_step(self):
        """What the last step did: step, skipped, loss_scale, grad_norm, clip_coef,
        nonfinite_elems (NaN/inf gradient elements: the step was skipped), per-stage
        times (seconds), bytes read/written on NVMe and moved H2D/D2H, and 'text', one line."""
        return self._engine.last_step()

    def plan(self):
        """The placement plan: 'text' (the table), bytes and sub-groups per tier,
        'rates' (strata.rates, or measured for gpu_fraction="auto"; 0: unknown)
        and 'estimate' (each resource's seconds per step at those rates)."""
        return self._engine.plan()

    @property
    def engine_config(self):
        """The effective engine config as a dict (docs/config.md)."""
        return json.loads(self._engine.config_json())

    @property
    def step_count(self):
        return self._engine.step_count

    # --- the step trace (docs/pytorch.md) ---

    def trace_path(self, path):
        """The file this rank's trace goes to: `path` itself with one rank; with
        several, ``.rank<N>`` inserted before the extension (``step.json`` ->
        ``step.rank1.json``), so ranks never write the same file."""
        path = os.fsdecode(os.fspath(path))
        if self._engine.world_size <= 1:
            return path
        root, ext = os.path.splitext(path)
        return f"{root}.rank{self._engine.rank}{ext}"

    def _trace_target(self, op, path):
        """This rank's trace file; OSError naming it unless its directory exists and
        is writable (checked before any step is recorded)."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"OffloadAdam.{op}: path is a {type(path).__name__}; give a file "
                            "path (str or os.PathLike)")
        path = self.trace_path(path)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(errno.ENOENT, f"OffloadAdam.{op}: directory {folder!r} of the "
                                    "trace file does not exist; create it or choose another path",
                                    path)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"OffloadAdam.{op}: directory {folder!r} of the "
                                  "trace file is not writable; choose another path", path)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, f"OffloadAdam.{op}: the trace file is a "
                                    "directory; give a file name", path)
        return path

    def _trace_other_data(self, first_step):
        info = self._engine.trace_info()
        return json.dumps({
            "source": "strata.torch.OffloadAdam",
            "params": sum(r.param.numel() for r in self._reg),
            "tensors": len(self._reg),
            "dtype": str(self._dtype).replace("torch.", ""),
            "world_size": self._engine.world_size,
            "rank": self._engine.rank,
            "device": self._engine.device,
            "sub_groups": len(self._engine.sub_groups()),
            "first_step": first_step,
            "last_step": self._engine.step_count,
            "steps_kept": info["steps"],
            "dropped_events": info["dropped"],
        })

    @contextlib.contextmanager
    def trace(self, path, steps=8):
        """Records the steps taken inside the ``with`` block and writes them to `path`
        as Chrome trace JSON (open it in https://ui.perfetto.dev or plot it with
        scripts/plot_trace.py) when the block ends, also when it raises (what was
        recorded is written, then the exception goes on). The ring keeps the newest
        `steps` steps. With several ranks each writes its own file (see trace_path);
        the block yields the path written. OSError before the block when the file's
        directory is missing or not writable."""
        if self._trace_steps:
            raise RuntimeError(f"OffloadAdam.trace: this optimizer records every step "
                               f"(trace={self._trace_steps}); call write_trace(path) instead")
        if self._trace_block:
            raise RuntimeError("OffloadAdam.trace: a trace() block is already recording; "
                               "nest no trace() blocks")
        steps = _trace_steps("OffloadAdam.trace: steps", steps)
        path = self._trace_target("trace", path)
        first = self._engine.step_count + 1
        self._engine.trace_start(steps)
        self._trace_block = True
        try:
            yield path
        except BaseException as e:
            try:
                self._finish_trace(path, first)
            except Exception as w:  # the block's own exception goes on
                if hasattr(e, "add_note"):
                    e.add_note(f"OffloadAdam.trace: the trace was not written: {w}")
            raise
        self._finish_trace(path, first)

    def _finish_trace(self, path, first):
        self._trace_block = False
        try:
            self._engine.trace_write(path, self._trace_other_data(first))
        finally:
            self._engine.trace_stop()

    def write_trace(self, path):
        """Writes the newest steps recorded since construction (``trace=N``) to `path`
        (per rank, see trace_path) as Chrome trace JSON; recording goes on. Returns
        the path written."""
        if not self._trace_steps:
            raise RuntimeError("OffloadAdam.write_trace: this optimizer records no trace; "
                               "build it with trace=N (N steps kept), or wrap steps in "
                               "`with optimizer.trace(path):`")
        path = self._trace_target("write_trace", path)
        self._engine.trace_write(path, self._trace_other_data(
            max(1, self._engine.step_count - self._trace_steps + 1)))
        return path


_EXPORT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                  "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _size_bytes(size):
    """An int, or "5GiB"/"500MB"/"1T" (binary units, as everywhere in strata)."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", str(size))
    if not m:
        raise ValueError(f"max_shard_size={size!r}; give bytes or a size like '5GiB'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def export_checkpoint(directory, out, dtype="fp32", max_shard_size=None, force=False):
    """Writes the weights of the checkpoint in `directory` (save_checkpoint's, or the
    C/C++ API's) as safetensors that ``model.load_state_dict`` takes: named as the
    optimizer's params were (pass ``model.named_parameters()`` to OffloadAdam), shaped,
    in `dtype` (torch.float32/bfloat16/float16 or "fp32"/"bf16"/"fp16"). `out` ending
    in .safetensors is one file; otherwise a directory that receives model.safetensors,
    or with `max_shard_size` (bytes or "5GiB") Hugging Face shards and
    model.safetensors.index.json. Streams: memory stays small whatever the model's
    size. Refuses an output inside the checkpoint, an existing file unless `force`,
    and anything that is not a regular file. A directory holds one layout: files of
    the other (model.safetensors beside shards, or shards of another count, which a
    loader could pick instead) are refused, or with `force` removed once the new
    files are written. Returns the files written."""
    if not isinstance(force, bool):
        raise ValueError(f"export_checkpoint: force={force!r}; use True or False")
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"export_checkpoint: dtype {dtype!r}; use torch.float32, "
                         "torch.bfloat16 or torch.float16")
    shard = 0 if max_shard_size is None else _size_bytes(max_shard_size)
    if max_shard_size is not None and shard <= 0:
        raise ValueError(f"export_checkpoint: max_shard_size={max_shard_size!r}; give a "
                         "positive size")
    return _strata.export_checkpoint(os.fspath(directory), os.fspath(out),
                                     _EXPORT_DTYPES[dtype], shard, bool(force))


def state_dict_from_checkpoint(directory, dtype=torch.float32):
    """The weights of the checkpoint in `directory` as an OrderedDict of shaped CPU
    tensors in `dtype` (torch.float32/bfloat16/float16 or "fp32"/"bf16"/"fp16"), named
    as the optimizer's params were. The params only: update ``model.state_dict()`` with
    it and load that (buffers, and params frozen when the optimizer was built, stay the
    model's). DeepSpeed's get_fp32_state_dict_from_zero_checkpoint, for models that fit
    in DRAM; use export_checkpoint for larger ones. Every chunk read is checked against
    its checksum."""
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"state_dict_from_checkpoint: dtype {dtype!r}; use torch.float32, "
                         "torch.bfloat16, torch.float16 or 'fp32', 'bf16', 'fp16'")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16,
             "fp16": torch.float16}[_EXPORT_DTYPES[dtype]]
    ckpt = _strata.Checkpoint(os.fspath(directory))
    out = OrderedDict()
    for i, t in enumerate(ckpt.tensors()):
        x = torch.empty(t["elems"], dtype=torch.float32)
        if t["elems"]:
            ckpt.read_master(i, x.data_ptr(), x.numel())
        shape = t["shape"] if t["shape"] is not None else [t["elems"]]
        out[t["name"]] = x.reshape(shape).to(dtype)
    if out and all(re.fullmatch(r"param\.[0-9]+", k) for k in out):
        warnings.warn(
            "state_dict_from_checkpoint: the optimizer that saved it was given params without "
            "names, so the keys are param.0 ... param.N (in registration order), which "
            "model.load_state_dict() matches to nothing (with strict=False it loads nothing, "
            "silently). Build the optimizer from model.named_parameters()",
            stacklevel=_outside_stacklevel())
    return out
