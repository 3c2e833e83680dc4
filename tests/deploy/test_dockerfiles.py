"""deploy/docker: the engine and operator Dockerfiles, parsed (no Docker engine here, so nothing is built).

They are held to the contracts others rely on: the engine image's jemalloc path and uid (operator/render.py), the
torch/torch_npu pairing, the operator image's entrypoint and uid (the Helm chart), no torch in the operator image,
and build contexts that hold exactly what the images copy.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "USER", "WORKDIR", "EXPOSE", "ENTRYPOINT", "CMD",
                "LABEL", "SHELL", "HEALTHCHECK", "STOPSIGNAL", "VOLUME", "ONBUILD"}


@dataclass
class Stage:
    base: str
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [args for ins, args in self.steps if ins == instruction]

    def last(self, instruction: str) -> str:
        found = self.all(instruction)
        assert found, f"no {instruction} in the stage FROM {self.base}"
        return found[-1]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse(path: Path) -> Dockerfile:
    """Dockerfile -> stages of (INSTRUCTION, arguments); line continuations joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments inside a continued instruction are skipped too, as Docker does
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, f"{path.name}: dangling line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        assert instruction in INSTRUCTIONS, f"{path.name}: unknown instruction {instruction}"
        args = args.strip()
        if instruction == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m, f"{path.name}: FROM {args}"
            stages.append(Stage(base=m.group(1), name=m.group(2)))
        elif not stages:
            assert instruction == "ARG", f"{path.name}: {instruction} before the first FROM"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].steps.append((instruction, args))
    assert stages, f"{path.name}: no FROM"
    return Dockerfile(global_args, stages)


def stage_arg(stage: Stage, name: str) -> str:
    for args in stage.all("ARG"):
        key, _, default = args.partition("=")
        if key == name:
            return default
    raise AssertionError(f"no ARG {name}")


def exec_form(args: str) -> list[str]:
    value = json.loads(args)  # the exec (JSON) form: no shell between the runtime and the process
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def user_id(stage: Stage) -> int:
    user = stage.last("USER").split(":")[0]
    assert user.isdigit(), f"USER {user}: numeric, so runAsNonRoot can verify it"
    return int(user)


def copied_sources(dockerfile: Dockerfile) -> set[str]:
    sources: set[str] = set()
    for stage in dockerfile.stages:
        for args in stage.all("COPY"):
            if args.startswith("--from="):
                continue
            *srcs, _dest = args.split()
            sources.update(s.rstrip("/") for s in srcs)
    return sources


def dockerignore_keeps(path: Path, candidate: str) -> bool:
    """The last matching pattern wins; `!` re-includes."""
    keep = True
    for raw in path.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(candidate, pattern) or fnmatch.fnmatch(candidate.split("/")[0], pattern):
            keep = negate
    return keep


@pytest.fixture(scope="module")
def engine() -> Dockerfile:
    return parse(DOCKER / "engine.Dockerfile")


@pytest.fixture(scope="module")
def operator_image() -> Dockerfile:
    return parse(DOCKER / "operator.Dockerfile")


def test_engine_image_is_built_on_ascends_cann_image_for_910b_with_python_311(engine: Dockerfile) -> None:
    assert engine.final.base == "${CANN_IMAGE}"
    image = engine.global_args["CANN_IMAGE"]
    repository, _, tag = image.partition(":")
    assert repository in ("quay.io/ascend/cann", "ascendai/cann", "docker.io/ascendai/cann")
    m = re.fullmatch(r"(?P<cann>[0-9a-z.]+)-(?P<chip>[0-9a-z]+)-(?P<os>[a-z]+[0-9.]+)-(?P<python>py[0-9.]+)", tag)
    assert m, tag
    assert m["cann"].startswith("8.") and m["chip"] == "910b" and m["python"] == "py3.11" and m["os"]


def test_engine_torch_and_torch_npu_versions_match(engine: Dockerfile) -> None:
    torch = stage_arg(engine.final, "TORCH_VERSION")
    torch_npu = stage_arg(engine.final, "TORCH_NPU_VERSION")
    assert re.fullmatch(r"\d+\.\d+\.\d+", torch)
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", torch_npu)
    assert torch_npu.split(".post")[0] == torch  # torch_npu X.Y.Z[.postN] is built against torch X.Y.Z
    runs = " ".join(engine.final.all("RUN"))
    assert '"torch==${TORCH_VERSION}"' in runs and '"torch_npu==${TORCH_NPU_VERSION}"' in runs
    assert "[engine]" in runs and "--constraint" in runs  # npuserve[engine] may not move torch


def test_engine_image_provides_jemalloc_where_the_renderer_preloads_it(engine: Dockerfile) -> None:
    from npuserve.operator.render import JEMALLOC_PATH

    runs = engine.final.all("RUN")
    jemalloc = [r for r in runs if "libjemalloc2" in r]
    assert len(jemalloc) == 1
    assert "ln -sf" in jemalloc[0] and JEMALLOC_PATH in jemalloc[0]
    assert f"test -e {JEMALLOC_PATH}" in jemalloc[0]  # the build fails if the link dangles


def test_engine_image_runs_as_the_renderers_uid_with_npuserve_as_entrypoint(engine: Dockerfile) -> None:
    from npuserve.engine_contract import serve_command
    from npuserve.operator.render import ENGINE_UID

    assert user_id(engine.final) == ENGINE_UID != 0
    assert str(ENGINE_UID) == stage_arg(engine.final, "ENGINE_UID")
    assert exec_form(engine.final.last("ENTRYPOINT")) == ["npuserve"]
    # pods replace the entrypoint with the same program
    assert serve_command("/models", "/etc/npuserve/config.json")[0] == "npuserve"
    steps = [ins for ins, _ in engine.final.steps]
    assert steps.index("USER") > max(i for i, ins in enumerate(steps) if ins == "RUN")  # nothing runs as root after


def test_operator_image_is_slim_python_without_torch(operator_image: Dockerfile) -> None:
    assert operator_image.final.base == "python:3.11-slim"
    runs = " ".join(operator_image.final.all("RUN"))
    assert "[operator]" in runs and "[engine]" not in runs and "[dev]" not in runs
    assert "find_spec('torch') is None" in runs  # the build fails if anything pulls torch in
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(dep.startswith(("torch", "npuserve[")) for dep in extras["operator"])


def test_operator_image_matches_the_chart(operator_image: Dockerfile) -> None:
    assert exec_form(operator_image.final.last("ENTRYPOINT")) == ["npuserve", "operator"]
    values = yaml.safe_load((REPO / "deploy" / "helm" / "npuserve" / "values.yaml").read_text())
    assert user_id(operator_image.final) == values["podSecurityContext"]["runAsUser"] != 0
    assert str(values["livenessProbe"]["port"]) in operator_image.final.last("EXPOSE").split()


@pytest.mark.parametrize("name", ["engine", "operator"])
def test_build_context_holds_what_the_image_copies(name: str) -> None:
    dockerfile = parse(DOCKER / f"{name}.Dockerfile")
    ignore = DOCKER / f"{name}.Dockerfile.dockerignore"
    sources = copied_sources(dockerfile)
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(package_dirs.values()) | {"pyproject.toml", "README.md"} == sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert dockerignore_keeps(ignore, source), f"{ignore.name} drops {source}"
    for dropped in (".venv", ".git", ".cluster", "build", "tests", "engine/__pycache__"):
        assert not dockerignore_keeps(ignore, dropped), f"{ignore.name} keeps {dropped}"
    # Sources go into a wheel-building stage only; the final image gets the wheel, not the tree.
    assert not [a for a in dockerfile.final.all("COPY") if not a.startswith("--from=")]
