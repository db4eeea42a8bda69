"""Static checks of deploy/ against the code, since no Docker engine or cluster runs here: the Dockerfile
(every stage's base has the tools its commands use, every entry point exists, no torch in the slim
image), .dockerignore, the compose files and the rendered Kubernetes overlays (kinds, images, probes on
real routes, every variable a real setting, GPUs on node managers only, no secret in a ConfigMap).

Each check returns problems as sentences (an empty list: all good), so tests/unit/test_compose.py,
tests/unit/test_kubernetes.py and ``python -m tests.bench.deploy`` share them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from stagetree.core.errors import StagetreeError
from stagetree.envcheck import unknown_variables

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "deploy" / "compose"
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = KUBERNETES / "overlays"

# Settings the deploy files may use before a settings class has them (none now: every name is real).
PENDING_SETTINGS: frozenset[str] = frozenset()
# Read by the S3 client library (boto3 / s3fs), not by a stagetree settings class.
STANDARD_VARIABLES = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"})
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|ACCESS_KEY|PRIVATE|_KEY$", re.IGNORECASE)
URL_WITH_PASSWORD = re.compile(r"://[^/\s:@]+:[^/\s@]+@")


def settings_classes() -> dict[str, type[BaseSettings]]:
    from stagetree.aggregator.settings import AggregatorSettings
    from stagetree.master.settings import MasterSettings
    from stagetree.nodemanager.settings import NodeManagerSettings

    return {
        "STAGETREE_MASTER_": MasterSettings,
        "STAGETREE_AGG_": AggregatorSettings,
        "STAGETREE_NM_": NodeManagerSettings,
    }


def variable_problem(var: str) -> str | None:
    """None when ``var`` is a real setting (or its ``_FILE`` variant, or an allowed standard variable)."""
    if var in STANDARD_VARIABLES or var in PENDING_SETTINGS:
        return None
    for prefix, cls in settings_classes().items():
        if var.startswith(prefix):
            bad = unknown_variables(cls, prefix, {var: "x"})
            return bad[0] if bad else None
    if var.startswith("STAGETREE_"):
        return f"{var}: no service reads STAGETREE_ variables outside {sorted(settings_classes())}"
    return None  # a third-party image's own variable (POSTGRES_*, KAFKA_*, MINIO_*)


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def settings_load_problems(where: str, env: Mapping[str, str]) -> list[str]:
    """Build each service's settings class from exactly ``env``, as its entry point does at start: a value
    of the wrong type (a word for a number) is a problem. ``_FILE`` variables naming files that only exist
    in the container are left out (their names are checked by ``variable_problem``)."""
    out = []
    usable = {
        k: v
        for k, v in env.items()
        if k not in PENDING_SETTINGS and not (k.endswith("_FILE") and not Path(v).exists() and "TLS__" not in k)
    }
    for prefix, cls in settings_classes().items():
        if not any(k.startswith(prefix) for k in usable):
            continue
        with _environ(usable):
            try:
                cls()
            except (ValidationError, StagetreeError, ValueError) as e:
                out.append(f"{where}: {cls.__name__} does not load from its environment: {e}")
    return out


def rest_routes() -> set[str]:
    """The paths the master's REST app serves (GET)."""
    import tempfile

    from stagetree.master.api.rest import create_rest_app
    from stagetree.master.app import MasterApp
    from stagetree.master.settings import MasterSettings
    from stagetree.master.store.schema import upgrade
    from stagetree.master.store.store import make_engine

    with tempfile.TemporaryDirectory() as d:  # the real app, on a throwaway SQLite database
        url = f"sqlite:///{d}/routes.db"
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        master = MasterApp.build(MasterSettings(database_url=url))
        try:
            app = create_rest_app(master)
        finally:
            master.close()
    return {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or set())}


def cli_problem(argv: list[str]) -> str | None:
    """None when ``stagetree <argv>`` is a command the CLI knows (parsed by the real parser)."""
    import importlib

    from stagetree.cli import GROUPS

    if not argv or argv[0] not in GROUPS:
        return f"`stagetree {' '.join(argv)}`: no such command group (known: {sorted(GROUPS)})"
    module, keep_word, _ = GROUPS[argv[0]]
    parser = importlib.import_module(module)._parser()
    try:
        parser.parse_args(argv if keep_word else argv[1:])
    except SystemExit:
        return f"`stagetree {' '.join(argv)}` is not a command the CLI accepts"
    return None


# -- Dockerfile ------------------------------------------------------------------------------------------

# What a base image provides (checked against the images' documentation; a new base needs a line here).
BASE_TOOLS: dict[str, set[str]] = {
    "python:": {"python", "python3", "pip", "sh", "useradd", "mkdir", "chown", "rm", "ls", "apt-get"},
    "nvidia/cuda:": {"sh", "useradd", "mkdir", "chown", "rm", "ls", "apt-get"},  # no Python
}
APT_PROVIDES = {"python3": {"python3"}, "python3-venv": set(), "ca-certificates": set()}
SHELL_BUILTINS = {"cd", "export", "set", "true", "echo", "test", "["}


@dataclass
class Stage:
    name: str
    base: str
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in joined.splitlines():
        if not line.strip():
            continue
        op, _, rest = line.strip().partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, base))
        elif op == "ARG":
            key, _, default = rest.partition("=")
            (stages[-1].args if stages else global_args)[key] = default.strip('"')
        elif stages:
            if op == "ENV":
                for k, v in re.findall(r"(\w+)=(\S+)", rest):
                    stages[-1].env[k] = v
            stages[-1].instructions.append((op, rest))
    return global_args, stages


def _commands(run: str) -> list[list[str]]:
    out = []
    for part in re.split(r"&&|\|\||;|\|", run):
        try:
            words = shlex.split(part)
        except ValueError:
            words = part.split()
        while words and re.match(r"^\w+=", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


def dockerfile_problems(text: str, dockerignore: str | None = None) -> list[str]:
    _, stages = parse_dockerfile(text)
    problems: list[str] = []
    names = [s.name for s in stages]
    for i, st in enumerate(stages):
        base_tools = next((tools for prefix, tools in BASE_TOOLS.items() if st.base.startswith(prefix)), None)
        if st.base in names[:i]:
            base_tools = set()  # from an earlier stage: not used here
        if base_tools is None:
            problems.append(f"stage {st.name}: base {st.base!r} is not one whose tools are known (BASE_TOOLS)")
            continue
        tools = set(base_tools)
        entrypoint: list[str] = []
        for op, rest in st.instructions:
            if op == "COPY":
                src = rest.split()
                from_stage = next((w.split("=", 1)[1] for w in src if w.startswith("--from=")), None)
                if from_stage is not None and from_stage not in names[:i]:
                    problems.append(f"stage {st.name}: COPY --from={from_stage}, which is no earlier stage")
                if from_stage is None:
                    for path in [w for w in src[:-1] if not w.startswith("--")]:
                        if not (ROOT / path).exists():
                            problems.append(f"stage {st.name}: COPY {path}: no such file in the repository")
                        elif dockerignore is not None and _ignored(path, dockerignore):
                            problems.append(f"stage {st.name}: COPY {path}, which .dockerignore leaves out")
            if op == "RUN":
                for words in _commands(rest):
                    cmd = words[0]
                    if cmd in SHELL_BUILTINS:
                        continue
                    if cmd not in tools:
                        problems.append(f"stage {st.name}: RUN uses `{cmd}`, which its base {st.base} lacks")
                    if cmd == "apt-get" and "install" in words:
                        for pkg in words[words.index("install") + 1 :]:
                            if not pkg.startswith("-"):
                                tools |= APT_PROVIDES.get(pkg, set())
                    if cmd.startswith("python") and words[1:3] == ["-m", "venv"]:
                        venv = words[3]
                        if f"{venv}/bin" in st.env.get("PATH", ""):
                            tools |= {"python", "python3", "pip"}
                    if cmd in ("pip", "python") and cmd in tools and "install" in words and "stagetree" in rest:
                        tools.add("stagetree")
            if op == "ENTRYPOINT":
                entrypoint = [str(w) for w in yaml.safe_load(rest)]
        if entrypoint and entrypoint[0] not in tools:
            problems.append(f"stage {st.name}: ENTRYPOINT {entrypoint[0]!r} is not installed in it")
    problems += _image_contract_problems(stages)
    return problems


def _image_contract_problems(stages: list[Stage]) -> list[str]:
    """The two images: ``service`` without torch, ``nodemanager`` with torch from real build arguments."""
    problems: list[str] = []
    by_name = {s.name: s for s in stages}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    scripts, extras = project["scripts"], project["optional-dependencies"]
    if scripts.get("stagetree") != "stagetree.cli:main":
        problems.append("pyproject: the `stagetree` entry point is not stagetree.cli:main")
    for name in ("service", "nodemanager"):
        if name not in by_name:
            problems.append(f"Dockerfile: no `{name}` stage")
    if problems:
        return problems
    service_runs = " ".join(r for op, r in by_name["service"].instructions if op == "RUN")
    wanted = re.findall(r"\[([\w,]+)\]", service_runs)
    for extra in ",".join(wanted).split(","):
        deps = " ".join(extras.get(extra, []))
        if re.search(r"\btorch\b", deps) or "nodemanager" in deps:
            problems.append(f"service image: extra [{extra}] pulls torch; the slim image must not")
    if "torch" in service_runs:
        problems.append("service image: installs torch")
    if not by_name["nodemanager"].base.startswith("nvidia/cuda:"):
        problems.append("nodemanager image: not on a CUDA base")
    nm = by_name["nodemanager"]
    nm_runs = " ".join(r for op, r in nm.instructions if op == "RUN")
    for arg in ("TORCH_VERSION", "TORCH_INDEX_URL"):
        if arg not in nm.args:
            problems.append(f"nodemanager image: no build argument {arg}")
        elif "${" + arg + "}" not in nm_runs:
            problems.append(f"nodemanager image: build argument {arg} is never used")
    if "--index-url" not in nm_runs:
        problems.append("nodemanager image: torch is not installed from TORCH_INDEX_URL (--index-url)")
    return problems


def _ignored(path: str, dockerignore: str) -> bool:
    """Whether .dockerignore leaves ``path`` out of the context (last matching pattern wins)."""
    import fnmatch

    ignored = False
    for raw in dockerignore.splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/").removeprefix("**/")
        if fnmatch.fnmatch(path.rstrip("/"), pat) or fnmatch.fnmatch(path.split("/")[-1], pat):
            ignored = not neg
    return ignored


# -- compose -----------------------------------------------------------------------------------------------


def _substitute(value: str, env: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2) or "", m.group(3) or ""
        got = env.get(name, "")
        if op == ":-" and not got:
            return default
        return got

    return re.sub(r"\$\{(\w+)(:[-?])?([^}]*)\}", one, value).replace("$$", "$")


def env_example() -> dict[str, str]:
    out = {}
    for line in (COMPOSE / ".env.example").read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k] = v
    return out


def compose_files() -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(COMPOSE.glob("compose*.yaml"))}


def compose_problems() -> tuple[int, list[str]]:
    """(services checked, problems) over compose.yaml and its override files."""
    problems: list[str] = []
    files = compose_files()
    base = files["compose.yaml"]
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    _, stages = parse_dockerfile(dockerfile)
    targets = {s.name for s in stages}
    routes = rest_routes()
    dotenv = env_example()
    declared_secrets = set(base.get("secrets") or {})
    for doc in files.values():
        declared_secrets |= set(doc.get("secrets") or {})
    checked = 0
    for fname, doc in files.items():
        for name, svc in (doc.get("services") or {}).items():
            checked += 1
            where = f"{fname}:{name}"
            full = {**base["services"].get(name, {}), **svc}
            build = full.get("build")
            if isinstance(build, dict) and build.get("target") not in targets:
                problems.append(f"{where}: builds target {build.get('target')!r}, not a Dockerfile stage")
            env = {str(k): _substitute(str(v), dotenv) for k, v in (svc.get("environment") or {}).items()}
            for var in env:
                if (p := variable_problem(var)) is not None:
                    problems.append(f"{where}: {p}")
                ours = not name.startswith(("postgres", "minio"))  # third-party images read plain variables
                if ours and SECRET_NAME.search(var) and not var.endswith("_FILE") and var not in STANDARD_VARIABLES:
                    problems.append(f"{where}: {var} holds a secret in a variable; use {var}_FILE and a secret")
            if isinstance(build, dict):
                problems += settings_load_problems(where, env)
            for s in svc.get("secrets") or []:
                if s not in declared_secrets:
                    problems.append(f"{where}: secret {s!r} is not declared")
            cmd = full.get("command")
            built = isinstance(build, dict) and cmd is not None and fname == "compose.yaml"
            if built and (p := cli_problem([_substitute(str(a), dotenv) for a in cmd])) is not None:
                problems.append(f"{where}: {p}")
            hc = svc.get("healthcheck") or {}
            for url in re.findall(r"https?://[^/'\"]+(/[^'\" ]*)", " ".join(map(str, hc.get("test") or []))):
                if name == "master" and url not in routes:
                    problems.append(f"{where}: the health check asks {url}, which the REST app does not serve")
            for dep in full.get("depends_on") or {}:
                if dep not in base["services"]:
                    problems.append(f"{where}: depends on unknown service {dep}")
    return checked, problems


# -- Kubernetes ----------------------------------------------------------------------------------------------


def kubectl() -> str | None:
    return shutil.which("kubectl")


def overlays() -> list[Path]:
    return sorted(p for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").exists())


def render(overlay: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize <overlay>`` (offline), as documents."""
    binary = kubectl()
    if binary is None:
        raise RuntimeError("kubectl is not installed")
    out = subprocess.run([binary, "kustomize", str(overlay)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


STAGETREE_COMPONENTS = {
    ("Deployment", "stagetree-master"): ("master", "stagetree"),
    ("Deployment", "stagetree-aggregator"): ("aggregator", "stagetree"),
    ("Job", "stagetree-migrate"): ("migrate", "stagetree"),
    ("DaemonSet", "stagetree-nodemanager"): ("nodemanager", "stagetree-nodemanager"),
}
WORKLOADS = {"Deployment", "DaemonSet", "Job", "StatefulSet"}


def _image_repo(image: str) -> str:
    return image.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]


def manifest_problems(docs: list[dict[str, Any]], where: str = "") -> list[str]:
    problems: list[str] = []
    routes = rest_routes()
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    configmaps = by_kind.get("ConfigMap", {})
    secrets = by_kind.get("Secret", {})

    def p(msg: str) -> None:
        problems.append(f"{where}{msg}")

    for (kind, name), _ in STAGETREE_COMPONENTS.items():
        if name not in by_kind.get(kind, {}):
            p(f"no {kind} {name}")
    master_svc = by_kind.get("Service", {}).get("stagetree-master")
    if master_svc is None:
        p("no Service stagetree-master")
    if not by_kind.get("NetworkPolicy"):
        p("no NetworkPolicy")
    for prefix in ("stagetree-auth", "stagetree-database", "stagetree-s3"):
        if not any(n.startswith(prefix) for n in secrets):
            p(f"no Secret {prefix}")

    for cm_name, cm in configmaps.items():
        for key, value in (cm.get("data") or {}).items():
            if SECRET_NAME.search(key) or URL_WITH_PASSWORD.search(str(value)):
                p(f"ConfigMap {cm_name}: {key} is a secret; put it in a Secret")
            if (msg := variable_problem(key)) is not None:
                p(f"ConfigMap {cm_name}: {msg}")

    for kind in WORKLOADS:
        for name, w in by_kind.get(kind, {}).items():
            spec = w["spec"]["template"]["spec"]
            component = STAGETREE_COMPONENTS.get((kind, name))
            for c in spec.get("containers", []):
                cw = f"{kind} {name}/{c['name']}"
                res = c.get("resources") or {}
                if not res.get("requests"):
                    p(f"{cw}: no resource requests")
                gpus = {k for part in res.values() for k in part if k == "nvidia.com/gpu"}
                if gpus and (component is None or component[0] != "nodemanager"):
                    p(f"{cw}: asks for nvidia.com/gpu; only node managers run on GPUs")
                if component is None:
                    continue
                if _image_repo(c["image"]) != component[1]:
                    p(f"{cw}: image {c['image']} is not the {component[1]} image")
                if (msg := cli_problem([str(a) for a in c.get("args") or []])) is not None:
                    p(f"{cw}: {msg}")
                env: dict[str, str] = {}
                for ref in c.get("envFrom") or []:
                    cm_name = (ref.get("configMapRef") or {}).get("name")
                    if cm_name not in configmaps:
                        p(f"{cw}: envFrom ConfigMap {cm_name} does not exist")
                    else:
                        env.update({k: str(v) for k, v in (configmaps[cm_name].get("data") or {}).items()})
                for e in c.get("env") or []:
                    if (msg := variable_problem(e["name"])) is not None:
                        p(f"{cw}: {msg}")
                    if "value" in e:
                        if SECRET_NAME.search(e["name"]) and not e["name"].endswith("_FILE"):
                            p(f"{cw}: {e['name']} is a secret given as a plain value")
                        env[e["name"]] = str(e["value"])
                    ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                    if ref and ref["name"] not in secrets:
                        p(f"{cw}: {e['name']} refers to a Secret {ref['name']} that does not exist")
                problems.extend(f"{where}{m}" for m in settings_load_problems(cw, env))
                tls = any(k.startswith("STAGETREE_MASTER_TLS__CERT") for k in env)
                ports = {pt.get("name") for pt in c.get("ports") or []} | {
                    pt.get("containerPort") for pt in c.get("ports") or []
                }
                for probe_name in ("readinessProbe", "livenessProbe"):
                    probe = c.get(probe_name)
                    if probe is None:
                        if component[0] == "master":
                            p(f"{cw}: no {probe_name}")
                        continue
                    get = probe.get("httpGet")
                    if get is None:
                        continue
                    if get.get("path") not in routes:
                        p(f"{cw}: {probe_name} asks {get.get('path')}, which the REST app does not serve")
                    if get.get("port") not in ports:
                        p(f"{cw}: {probe_name} port {get.get('port')} is not a port of the container")
                    if (get.get("scheme", "HTTP") == "HTTPS") != tls:
                        p(f"{cw}: {probe_name} scheme {get.get('scheme', 'HTTP')} does not match the master's TLS")
            for v in spec.get("volumes") or []:
                sec = (v.get("secret") or {}).get("secretName")
                if sec and sec not in secrets:
                    p(f"{kind} {name}: volume {v['name']} mounts a Secret {sec} that does not exist")
            if component is not None and component[0] == "nodemanager":
                if "nvidia.com/gpu.present" not in (spec.get("nodeSelector") or {}) and not spec.get("affinity"):
                    p(f"{kind} {name}: no nodeSelector for GPU nodes")
                if not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations") or []):
                    p(f"{kind} {name}: does not tolerate the nvidia.com/gpu taint")
                limits = (spec["containers"][0].get("resources") or {}).get("limits") or {}
                if "nvidia.com/gpu" not in limits:
                    p(f"{kind} {name}: no nvidia.com/gpu limit")
    return problems


def kubernetes_problems() -> tuple[int, int, list[str]]:
    """(overlays, manifests checked, problems) over every overlay."""
    found = overlays()
    checked, problems = 0, []
    for overlay in found:
        docs = render(overlay)
        checked += len(docs)
        problems += manifest_problems(docs, f"{overlay.name}: ")
    return len(found), checked, problems
