"""`stagetree up` as a new user starts it: the addresses it prints work, it shows the admin token and a
status line; on an install without the embedded extra it says which extra to install."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def test_up_prints_working_addresses_the_admin_token_and_a_status_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stagetree.cli", "up", "--home", str(tmp_path / "home"), "--port", "0"]
    cmd += ["--http-port", "0", "--workers", "1", "--status-every", "0.3", "--admin-token", "adm-123"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while not any(ln.startswith("studies ") for ln in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        docs = re.search(r"docs (http://\S+/api/v1/docs)", text)
        assert docs is not None, text
        with urllib.request.urlopen(docs.group(1), timeout=10) as resp:
            assert resp.status == 200 and "swagger" in resp.read().decode().lower()
        assert re.search(r"admin\s+adm-123\b", text)
        url = re.search(r"export STAGETREE_URL=(http://\S+)\)", text)  # not the default port: the CLI's variable
        assert url is not None and docs.group(1) == f"{url.group(1)}/api/v1/docs", text
        dash = re.search(r"dashboard\s+(http://\S+/dashboard/)#token=(\S+)", text)  # a URL that signs in
        token = re.search(r"^\s+token\s+(\S+)", text, re.M)
        assert dash is not None and token is not None and dash.group(2) == token.group(1), text
        with urllib.request.urlopen(dash.group(1), timeout=10) as resp:
            assert resp.status == 200 and "echarts.min.js" in resp.read().decode()
        status = next(ln for ln in lines if ln.startswith("studies "))
        assert re.fullmatch(
            r"studies 0 \| requests 0 waiting, 0 running, 0 done, 0 failed, 0 cancelled \| slots 0/1 busy\n", status
        ), status
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_up_without_the_embedded_extra_names_it(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['sqlalchemy'] = None; from stagetree import cli;"
        f"sys.exit(cli.main(['up', '--home', {str(tmp_path)!r}, '--port', '0', '--http-port', '-1']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert out.returncode == 2, out.stderr
    assert "lacks the package 'sqlalchemy'" in out.stderr and "pip install 'stagetree[embedded]'" in out.stderr
    assert "Traceback" not in out.stderr
