"""``import stagetree`` is light (nothing heavy until a name is used) and every public name resolves."""

from __future__ import annotations

import subprocess
import sys

import stagetree

PROBE = """
import sys
import stagetree
assert "grpc" not in sys.modules and "torch" not in sys.modules, "import stagetree must stay light"
for name in stagetree.__all__:
    if name not in ("Trainer", "TorchTrainer", "ResumableLoader"):
        getattr(stagetree, name)
assert "torch" not in sys.modules, "only stagetree.Trainer, TorchTrainer and ResumableLoader may import torch"
print("ok")
"""


def test_import_is_light_and_names_resolve() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_public_names() -> None:
    assert stagetree.connect.__module__ == "stagetree.client.sdk"
    assert stagetree.Study.create is not None and stagetree.drive.__module__ == "stagetree.client.driver"
    assert {"ASHA", "PBT", "GridSearchSpace", "MultiStep", "Warmup", "InvalidArgument", "Trainer"} <= set(
        stagetree.__all__
    )
    assert "Trainer" in dir(stagetree)
    assert {"TorchTrainer", "ResumableLoader"} <= set(stagetree.__all__)
