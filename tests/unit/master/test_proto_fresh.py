"""The committed generated code in services/proto is what scripts/gen_proto.py produces now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_proto_code_is_fresh() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_generated_code_imports_as_stagetree_proto() -> None:
    from stagetree.proto.stagetree.v1 import master_pb2, master_pb2_grpc

    assert master_pb2.DESCRIPTOR.package == "stagetree.v1"
    assert hasattr(master_pb2_grpc, "MasterServiceStub")
