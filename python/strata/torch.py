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

import json
import os
import re

import torch
import torch.distributed as dist

from strata import _strata
from strata._strata import InvalidArgumentError, ResourceExhaustedError, StrataError

__all__ = ["OffloadAdam", "StrataError", "InvalidArgumentError", "ResourceExhaustedError"]

_PARAM_DTYPES = {torch.float32: None, torch.float16: "fp16", torch.bfloat16: "bf16"}
_BUFFER_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_STATE_DICT_VERSION = 1


def _merge(base, override):
    """Deep merge of two config dicts; `override` wins."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _split_names(params):
    """Accepts tensors, (name, tensor) pairs (model.named_parameters()) or group dicts of
    either; returns what torch.optim.Optimizer takes and {id(tensor): name}."""
    names = {}

    def strip(seq):
        seq = [seq] if isinstance(seq, torch.Tensor) else list(seq)
        out = []
        for x in seq:
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
                names[id(x[1])] = x[0]
                x = x[1]
            out.append(x)
        return out

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


class _TorchDistributedComm:
    """The engine's collectives over torch.distributed (CPU tensors, e.g. gloo).

    Called from the engine's stream thread with the GIL held, one collective at
    a time, in the same order on every rank. The memoryviews are raw bytes of
    the engine's buffers; tensors made from them share that memory.
    """

    def __init__(self, group, rank, world_size):
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @staticmethod
    def _view(mv, dtype, count):
        t = _BUFFER_DTYPES[dtype]
        if t in (torch.float16, torch.bfloat16):
            # Moved as bytes: gloo has neither bf16 nor int16, and nothing is summed here.
            return torch.frombuffer(mv, dtype=torch.uint8, count=2 * count)
        return torch.frombuffer(mv, dtype=t, count=count)

    @staticmethod
    def _op(op):
        return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]

    def all_reduce(self, send, recv, count, dtype, op):
        s = torch.frombuffer(send, dtype=_BUFFER_DTYPES[dtype], count=count)
        r = torch.frombuffer(recv, dtype=_BUFFER_DTYPES[dtype], count=count)
        if s.data_ptr() != r.data_ptr():
            r.copy_(s)
        dist.all_reduce(r, op=self._op(op), group=self.group)

    def reduce_scatter(self, send, recv, recv_count, dtype, op):
        # gloo has no reduce_scatter: all-reduce a copy, keep this rank's block.
        full = torch.frombuffer(send, dtype=_BUFFER_DTYPES[dtype],
                                count=recv_count * self.world_size).clone()
        dist.all_reduce(full, op=self._op(op), group=self.group)
        r = torch.frombuffer(recv, dtype=_BUFFER_DTYPES[dtype], count=recv_count)
        r.copy_(full[self.rank * recv_count:(self.rank + 1) * recv_count])

    def all_gather(self, send, recv, send_count, dtype):
        s = self._view(send, dtype, send_count).clone()  # send may alias recv
        r = self._view(recv, dtype, send_count * self.world_size)
        dist.all_gather(list(r.chunk(self.world_size)), s, group=self.group)

    def barrier(self):
        dist.barrier(group=self.group)


class OffloadAdam(torch.optim.Optimizer):
    r"""Adam/AdamW whose fp32 master weights and moments live in host memory and on NVMe.

    A drop-in ``torch.optim.Optimizer``: param groups with their own ``lr``,
    ``betas``, ``eps`` and ``weight_decay`` (read at every ``step()``, so LR
    schedulers work), ``zero_grad(set_to_none=...)``, ``step(closure=None)``
    returning the closure's loss, ``state_dict()``/``load_state_dict()``.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``;
            checkpoints record the names), or param-group dicts of either. All
            on one device (CPU, or one CUDA device), contiguous, of one dtype:
            float32, float16 (dynamic loss scaling, see below) or bfloat16.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        adamw: True: decoupled weight decay (``AdamW``); False: L2 decay added
            to the gradient (``torch.optim.Adam(weight_decay=...)``).
        max_grad_norm: clip by global L2 norm, exactly like
            ``torch.nn.utils.clip_grad_norm_`` before the step (None: no clipping).
        offload: ``"cpu"`` (state in pinned DRAM) or ``"nvme"`` (in DRAM as far
            as ``host_budget`` allows, the rest in files under ``nvme_path``).
        nvme_path: directory (or list of directories, striped) for the NVMe
            tier; required with ``offload="nvme"``; created when missing.
        host_budget: pinned DRAM for state and staging, bytes or "8GiB".
            None: unlimited with "cpu", staging only with "nvme".
        sub_group_size: elements per pipelined sub-group (default 1e9; smaller
            values overlap NVMe IO with the update at a finer grain).
        threads: CPU optimizer threads (None: all hardware threads).
        config: a DeepSpeed-style dict or JSON string (docs/config.md), merged
            over what the arguments above produce (its keys win).
        process_group: the ``torch.distributed`` group for multi-process
            training (None: the default group when initialized). Each rank owns
            1/world of the state (ZeRO); gradients are averaged over ranks.
            CPU tensors use torch.distributed's collectives (gloo); CUDA
            tensors use NCCL, bootstrapped through the group.

    Gradients: ``step()`` reads each param's ``.grad``. Params with
    ``requires_grad=False`` are not registered (never updated). A ``.grad`` of
    None counts as a zero gradient: unlike torch.optim, which skips such a
    param, the param is still updated (decay, and the momentum it has), as in
    DeepSpeed's flat ZeRO buffers. Sparse gradients are refused. The engine owns one dense grad buffer per
    param; after ``zero_grad(set_to_none=False)`` the params' ``.grad`` are
    those buffers, so backward accumulates straight into memory the engine
    reads (no copy). With ``set_to_none=True`` (or grads that autograd
    allocated), ``step()`` copies each grad into its buffer once.

    fp16: with float16 params the engine runs DeepSpeed's dynamic loss scaler
    (``config={"fp16": {...}}`` tunes it). Scale the loss before backward and
    let ``step()`` unscale, clip, and skip steps whose gradients overflowed::

        loss = model(batch)
        optimizer.backward(loss)            # == optimizer.scale_loss(loss).backward()
        optimizer.step()                    # skipped (params unchanged) on overflow
        optimizer.zero_grad()
        optimizer.last_step()["skipped"], optimizer.loss_scale

    CUDA: engine work is ordered on PyTorch's current stream (the one at
    construction; a different current stream at ``step()`` is joined with
    ``wait_stream``), with no host synchronization beyond the CPU update.

    State: ``state_dict()`` holds the offloaded state of this rank (master
    weights, moments, step count, loss scaler) as CPU tensors, and loads back
    into an optimizer built the same way (same params, groups and world size).
    ``save_checkpoint(dir)``/``load_checkpoint(dir)`` write and read the C++
    engine's checkpoint format (a collective; all ranks pass the same dir).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adamw=True, max_grad_norm=None, offload="cpu", nvme_path=None, host_budget=None,
                 config=None, sub_group_size=None, threads=None, process_group=None):
        if not 0.0 <= lr:
            raise ValueError(f"OffloadAdam: invalid learning rate {lr}")
        if not 0.0 < eps:
            raise ValueError(f"OffloadAdam: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"OffloadAdam: invalid betas {betas}; each must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"OffloadAdam: invalid weight_decay {weight_decay}")
        if offload not in ("cpu", "nvme"):
            raise ValueError(f"OffloadAdam: offload={offload!r}; use 'cpu' or 'nvme'")
        if offload == "nvme" and not nvme_path:
            raise ValueError("OffloadAdam: offload='nvme' needs nvme_path (a directory on the "
                             "NVMe drive, or a list of them)")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"OffloadAdam: max_grad_norm={max_grad_norm}; use a positive "
                             "value or None")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        params, self._names = _split_names(params)
        super().__init__(params, defaults)

        # Frozen params (requires_grad=False) are not registered: the engine
        # would decay them, torch.optim leaves them alone.
        tensors = self._params()
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
            base["zero_optimization"]["sub_group_size"] = int(sub_group_size)
        if threads is not None:
            base["strata"]["threads"] = int(threads)
        if _PARAM_DTYPES[self._dtype]:
            base[_PARAM_DTYPES[self._dtype]] = {"enabled": True}
        if config is not None:
            if isinstance(config, str):
                config = json.loads(config)
            base = _merge(base, config)
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
        if base["optimizer"].get("type") not in ("Adam", "AdamW"):
            raise ValueError(f"OffloadAdam: config optimizer.type {base['optimizer'].get('type')!r};"
                             " OffloadAdam runs Adam or AdamW (use adamw=)")

        # One dense grad buffer per param; the engine reads grads from these.
        self._grad_bufs = [torch.zeros_like(p, memory_format=torch.contiguous_format)
                           for p in tensors]
        groups = []
        self._engine_group = []  # per torch group: its engine group, None when all frozen
        index = 0
        for gi, g in enumerate(self.param_groups):
            entries = []
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                buf = self._grad_bufs[index]
                entries.append((self._names.get(id(p), ""), p.data_ptr(), buf.data_ptr(),
                                p.numel()))
                index += 1
            self._engine_group.append(len(groups) if entries else None)
            if entries:
                groups.append({"params": entries, **self._hyper_of(g)})

        comm = None
        self._group = process_group
        world = 1
        if dist.is_available() and dist.is_initialized():
            group = process_group if process_group is not None else dist.group.WORLD
            world = dist.get_world_size(group)
            rank = dist.get_rank(group)
            if world > 1:
                self._group = group
                if self._device.type == "cuda":
                    obj = [_strata.nccl_unique_id() if rank == 0 else None]
                    dist.broadcast_object_list(obj, src=_global_rank(group, 0), group=group)
                    comm = ("nccl", rank, world, obj[0])
                else:
                    comm = ("python", rank, world, _TorchDistributedComm(group, rank, world))

        device = "host"
        stream = None
        self._stream = None
        if self._device.type == "cuda":
            index_ = self._device.index if self._device.index is not None \
                else torch.cuda.current_device()
            device = f"cuda:{index_}"
            self._stream = torch.cuda.current_stream(self._device)
            stream = self._stream.cuda_stream
        self._engine = _strata.Engine(device, json.dumps(self._config), groups, comm, stream)
        self._hypers = [self._hyper_of(g) for g in self.param_groups]

    # --- torch.optim.Optimizer interface ---

    @staticmethod
    def _hyper_of(group):
        return {"lr": float(group["lr"]), "betas": tuple(float(b) for b in group["betas"]),
                "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])}

    def _sync_hypers(self):
        """Hands the groups' current hyperparameters (schedulers change them) to the engine."""
        for gi, g in enumerate(self.param_groups):
            h = self._hyper_of(g)
            if h != self._hypers[gi] and self._engine_group[gi] is not None:
                self._engine.set_group_hyper(self._engine_group[gi], h)
            self._hypers[gi] = h

    def _params(self):
        """The registered params: every group's params that require grad, in order."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def add_param_group(self, param_group):
        if hasattr(self, "_engine"):
            raise RuntimeError("OffloadAdam: add_param_group after construction is not supported "
                               "(the offloaded layout is fixed); pass every group to the "
                               "constructor")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (a collective with torch.distributed); returns closure()'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hypers()
        for i, (p, buf) in enumerate(zip(self._params(), self._grad_bufs)):
            g = p.grad
            if g is None:
                buf.zero_()
            elif g.is_sparse:
                raise RuntimeError(f"OffloadAdam: param {i} (shape {tuple(p.shape)}) has a "
                                   "sparse gradient; OffloadAdam needs dense gradients "
                                   "(e.g. nn.Embedding(sparse=False))")
            elif g.data_ptr() != buf.data_ptr():
                buf.copy_(g)
        current = None
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            if current != self._stream:
                self._stream.wait_stream(current)
        self._engine.step()
        if current is not None and current != self._stream:
            current.wait_stream(self._stream)
        return loss

    def zero_grad(self, set_to_none=False):
        """Zeroes the grads. set_to_none=False (default) points each param's .grad
        at the engine's zeroed buffer, so the next backward accumulates in place."""
        self._engine.zero_grad()
        for p, buf in zip(self._params(), self._grad_bufs):
            p.grad = None if set_to_none else buf

    def state_dict(self):
        """This rank's offloaded state (CPU tensors) and the param groups' hyperparameters."""
        arrays = []
        n = self._engine.state_array_count
        for i, (begin, end) in enumerate(self._engine.sub_groups()):
            t = torch.empty((end - begin) * n, dtype=torch.float32)
            self._engine.read_state(i, t.data_ptr(), t.numel())
            arrays.append(t)
        groups = []
        index = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        state = {
            "version": _STATE_DICT_VERSION,
            "rank": self._engine.rank,
            "world_size": self._engine.world_size,
            "param_shapes": [tuple(p.shape) for p in self._params()],
            "sub_groups": self._engine.sub_groups(),
            "state_array_count": n,
            "arrays": arrays,
            "step": self._engine.step_count,
            "loss_scaler": self._engine.scaler_state(),
        }
        return {"state": {"strata": state}, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Loads a state_dict() of an optimizer built the same way (params, groups, ranks)."""
        try:
            s = state_dict["state"]["strata"]
            saved_groups = state_dict["param_groups"]
        except (KeyError, TypeError):
            raise ValueError("OffloadAdam.load_state_dict: not an OffloadAdam state_dict (no "
                             "state['strata']); torch.optim state cannot carry offloaded state")
        if s.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"OffloadAdam.load_state_dict: version {s.get('version')}; this "
                             f"build reads {_STATE_DICT_VERSION}")
        if s["world_size"] != self._engine.world_size or s["rank"] != self._engine.rank:
            raise ValueError(f"OffloadAdam.load_state_dict: saved by rank {s['rank']} of "
                             f"{s['world_size']}, loading on rank {self._engine.rank} of "
                             f"{self._engine.world_size}; use save_checkpoint/load_checkpoint "
                             "to change the number of ranks")
        shapes = [tuple(p.shape) for p in self._params()]
        if [tuple(x) for x in s["param_shapes"]] != shapes:
            raise ValueError("OffloadAdam.load_state_dict: the saved params have other shapes "
                             f"({len(s['param_shapes'])} tensors) than this optimizer's "
                             f"({len(shapes)} tensors)")
        if len(saved_groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"])
                for a, b in zip(saved_groups, self.param_groups)):
            raise ValueError("OffloadAdam.load_state_dict: the saved param groups differ in "
                             "number or size from this optimizer's")
        if [tuple(x) for x in s["sub_groups"]] != [tuple(x) for x in self._engine.sub_groups()] \
                or s["state_array_count"] != self._engine.state_array_count:
            raise ValueError("OffloadAdam.load_state_dict: the saved state is cut into other "
                             "sub-groups (sub_group_size or alignment changed); build the "
                             "optimizer with the same config")
        for i, t in enumerate(s["arrays"]):
            t = t.to(dtype=torch.float32, device="cpu").contiguous()
            self._engine.write_state(i, t.data_ptr(), t.numel())
        self._engine.restore_counters(int(s["step"]), dict(s["loss_scaler"]))
        for g, saved in zip(self.param_groups, saved_groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v

    # --- Strata extras ---

    def save_checkpoint(self, directory):
        """Writes the C++ engine's checkpoint (docs/checkpoint.md) to `directory`."""
        self._sync_hypers()
        self._engine.save(str(directory))

    def load_checkpoint(self, directory):
        """Reads a checkpoint written by save_checkpoint or the C++/C API: the state, the
        counters and the params; the groups' hyperparameters become the engine's."""
        self._engine.load(str(directory))
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
        return loss * self._engine.loss_scale

    def backward(self, loss, **kwargs):
        """scale_loss(loss).backward(**kwargs)."""
        self.scale_loss(loss).backward(**kwargs)

    def last_step(self):
        """What the last step did: step, skipped, loss_scale, grad_norm, clip_coef, per-stage
        times (seconds), bytes read/written on NVMe and moved H2D/D2H, and 'text', one line."""
        return self._engine.last_step()

    def plan(self):
        """The placement plan: 'text' (the table) and bytes and sub-groups per tier."""
        return self._engine.plan()

    @property
    def engine_config(self):
        """The effective engine config as a dict (docs/config.md)."""
        return json.loads(self._engine.config_json())

    @property
    def step_count(self):
        return self._engine.step_count
