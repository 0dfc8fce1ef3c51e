"""What checkpoints and exports do to the files around them: retention removes
only Strata's own saves (never the user's files named step-*)."""
import json
import os
import re

import pytest
import torch

from strata.torch import OffloadAdam

SAVE_NAME = re.compile(r"step-\d{10}-[0-9a-f]{12}")


def trained(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = OffloadAdam(model.named_parameters(), **kwargs)
    return model, opt


def step(model, opt):
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def users_files(root):
    """A user's files named step-*, as a training script leaves them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "step-1000.pt").write_bytes(b"weights at step 1000")
    (root / "step-500").mkdir()
    (root / "step-500" / "model.pt").write_bytes(b"weights at step 500")
    return {"step-1000.pt": b"weights at step 1000",
            os.path.join("step-500", "model.pt"): b"weights at step 500"}


def saves_in(root):
    return sorted(p.name for p in root.iterdir() if SAVE_NAME.fullmatch(p.name))


@pytest.mark.parametrize("how", ["save_checkpoint", "state_dict_dir"])
def test_saves_keep_the_users_step_files_and_prune_their_own(tmp_path, how):
    runs = tmp_path / "runs"
    want = users_files(runs)
    model, opt = trained(**({"state_dict_dir": runs} if how == "state_dict_dir" else {}))
    published = []
    for _ in range(4):
        step(model, opt)
        if how == "state_dict_dir":
            opt.state_dict()
        else:
            opt.save_checkpoint(runs)
        published.append(json.loads((runs / "latest.json").read_text())["checkpoint"])
        for name, data in want.items():
            assert (runs / name).read_bytes() == data, f"{name} was removed by a save"
    # Strata's own older saves are pruned as documented: the newest two stay.
    assert saves_in(runs) == sorted(published[-2:])
