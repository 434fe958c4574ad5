"""The Dockerfile, its .dockerignore and the README's Docker commands agree with pyproject and the CLI."""

from __future__ import annotations

import fnmatch
import itertools
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from model.shipped import SHIPPED_MODEL
from server.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
# What the base image provides and pip must leave alone.
IMAGE_OWNED = re.compile(r"^(torch|triton|nvidia-[a-z0-9-]+)$")
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# pip install options that take a value as the next word
PIP_VALUE_OPTIONS = {
    "-c", "--constraint", "-r", "--requirement", "-e", "--editable", "-i", "--index-url", "--extra-index-url",
    "-f", "--find-links", "-t", "--target", "--prefix", "--root", "-C", "--config-settings", "--src", "--platform",
    "--python-version", "--implementation", "--abi", "--upgrade-strategy", "--root-user-action", "--progress-bar",
    "--report", "--cache-dir", "--log", "--only-binary", "--no-binary",
}  # fmt: skip
PIP_REPLACING_OPTIONS = {"-U", "--upgrade", "--force-reinstall", "-I", "--ignore-installed"}
DOCKER_RUN_VALUE_OPTIONS = {
    "-p", "--publish", "-v", "--volume", "-e", "--env", "--env-file", "--name", "--gpus", "--ipc", "--shm-size",
    "--network", "--entrypoint", "-w", "--workdir", "-u", "--user", "--mount", "--runtime", "--ulimit", "--device",
}  # fmt: skip


def instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's (INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical = pending + stripped
        pending = ""
        keyword, _, rest = logical.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def shell_commands(script: str) -> list[list[str]]:
    """A RUN line's simple commands, split at && || ; | and without redirections."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    words = iter(lexer)
    for word in words:
        if word in ("&&", "||", ";", "|", "&"):
            commands.append([])
        elif word in (">", ">>", "<", "2>", "&>"):
            next(words, None)
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def pip_installs(commands: list[list[str]]) -> list[list[str]]:
    """The arguments after `install` of every `pip install` / `python -m pip install` among the commands."""
    found = []
    for words in commands:
        for i, word in enumerate(words[:-1]):
            if Path(word).name in ("pip", "pip3") and words[i + 1] == "install":
                found.append(words[i + 2 :])
                break
    return found


def pip_targets(args: list[str]) -> tuple[set[str], list[str]]:
    """(options given, positional targets: requirement strings or local paths)."""
    options: set[str] = set()
    targets: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            name = arg.split("=", 1)[0]
            options.add(name)
            skip = name in PIP_VALUE_OPTIONS and "=" not in arg
        else:
            targets.append(arg)
    return options, targets


def is_local_path(target: str) -> bool:
    return target.startswith((".", "/")) or "/" in target.split("[", 1)[0]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions((ROOT / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def pip_lines(dockerfile) -> list[list[str]]:
    runs = [pip_installs(shell_commands(args)) for keyword, args in dockerfile if keyword == "RUN"]
    found = [line for run in runs for line in run]
    assert found, "no `pip install` in any RUN line"
    return found


def only(dockerfile, keyword: str) -> str:
    found = [args for key, args in dockerfile if key == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def entrypoint(dockerfile) -> list[str]:
    words = json.loads(only(dockerfile, "ENTRYPOINT"))
    assert isinstance(words, list) and all(isinstance(w, str) for w in words), "ENTRYPOINT must be exec (JSON) form"
    return words


def readme_docker_commands() -> tuple[list[str], list[str]]:
    """The README Docker section's `docker build` and `docker run` words."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Docker\n", 1)
    assert len(section) == 2, "README has no '## Docker' section"
    body = section[1].split("\n## ", 1)[0]
    build = [shlex.split(line) for line in body.splitlines() if line.startswith("docker build ")]
    run = [shlex.split(line) for line in body.splitlines() if line.startswith("docker run ")]
    assert len(build) == 1 and len(run) == 1, "the Docker section needs one `docker build` and one `docker run` line"
    return build[0], run[0]


def run_image_and_args(run: list[str]) -> tuple[str, list[str]]:
    """`docker run [options] IMAGE [args]` -> (IMAGE, args)."""
    words = iter(run[2:])
    for word in words:
        if word.startswith("-"):
            if word in DOCKER_RUN_VALUE_OPTIONS:
                next(words)
            continue
        return word, list(words)
    raise AssertionError(f"no image in {' '.join(run)!r}")


def build_tag(build: list[str]) -> str:
    for i, word in enumerate(build):
        if word in ("-t", "--tag"):
            return build[i + 1]
        if word.startswith("--tag="):
            return word.split("=", 1)[1]
    raise AssertionError(f"`{' '.join(build)}` tags no image")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, approximately: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(p, glob) for p in prefixes):
            ignored = not negated
    return ignored


def test_base_image_is_a_pinned_pytorch_cuda_runtime(dockerfile):
    image = only(dockerfile, "FROM").split()[0]
    name, _, tag = image.partition(":")
    assert name == "pytorch/pytorch", f"FROM {image}: torch must come from PyTorch's own image"
    assert re.fullmatch(r"\d+\.\d+\.\d+-cuda12\.\d+-cudnn\d+-runtime", tag), f"FROM {image}: pin a CUDA 12 runtime tag"


def test_entrypoint_is_the_serve_console_script(dockerfile, pyproject):
    words = entrypoint(dockerfile)
    scripts = pyproject["project"]["scripts"]
    assert words[0] in scripts, f"ENTRYPOINT runs {words[0]!r}, not a [project.scripts] entry ({sorted(scripts)})"
    assert scripts[words[0]] == "server.cli:main"
    assert words[1:2] == ["serve"], f"ENTRYPOINT {words}: the subcommand must be `serve`"


def test_entrypoint_without_a_model_serves_the_shipped_model_on_the_exposed_port(dockerfile):
    cmd = json.loads(only(dockerfile, "CMD") or "[]")
    args = build_parser().parse_args(entrypoint(dockerfile)[1:] + cmd)
    assert args.model == SHIPPED_MODEL
    assert args.host == "0.0.0.0", "inside a container the server must listen on every interface"
    assert args.device == "cuda"
    exposed = {int(port.split("/")[0]) for key, value in dockerfile if key == "EXPOSE" for port in value.split()}
    assert args.port in exposed, f"the server listens on {args.port}, the image exposes {sorted(exposed)}"


def test_a_c_compiler_is_installed_for_tritons_launchers(dockerfile):
    """Triton compiles a launcher with gcc (or clang) and the C library's headers the first time a kernel runs; the
    image must have them before it drops root, whatever the base image carries."""
    before_user = dockerfile[: [key for key, _ in dockerfile].index("USER")]
    installed: set[str] = set()
    for key, args in before_user:
        if key == "RUN":
            for words in shell_commands(args):
                words = list(itertools.dropwhile(lambda w: "=" in w, words))  # after VAR=value prefixes
                if words[:1] in (["apt-get"], ["apt"]) and "install" in words:
                    installed.update(w for w in words[words.index("install") + 1 :] if not w.startswith("-"))
    assert installed & {"gcc", "clang", "build-essential"}, f"no C compiler among apt's installs {sorted(installed)}"
    assert installed & {"libc6-dev", "build-essential"}, f"no libc headers among apt's installs {sorted(installed)}"


def test_multicast_is_off_by_default(dockerfile):
    env: dict[str, str] = {}
    for key, value in dockerfile:
        if key == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(value) if "=" in word)
    for name, want in MULTICAST_OFF.items():
        assert env.get(name) == want, f"ENV {name}={env.get(name)!r}, want {want}"


def test_every_package_and_the_build_files_are_copied(dockerfile, pyproject):
    sources: set[str] = set()
    for key, value in dockerfile:
        if key == "COPY":
            words = [w for w in shlex.split(value) if not w.startswith("--")]
            sources.update(w.rstrip("/") for w in words[:-1])
    needed = [*pyproject["tool"]["setuptools"]["packages"], "pyproject.toml", pyproject["project"]["readme"], "configs"]
    for path in needed:
        assert path in sources or "." in sources, f"{path} is not COPY'd (COPY sources: {sorted(sources)})"


def test_dockerignore_keeps_what_the_image_needs_and_drops_build_outputs(pyproject):
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    needed = ["pyproject.toml", pyproject["project"]["readme"]]
    for top in [*pyproject["tool"]["setuptools"]["packages"], "configs"]:
        needed += [
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / top).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        ]
    assert any(p.startswith("model/checkpoints/") for p in needed), "the shipped checkpoint is missing from model/"
    dropped = [p for p in needed if dockerignored(p, patterns)]
    assert not dropped, f".dockerignore drops files the image needs: {dropped[:5]}"
    for stale in ("build/lib/server/cli.py", "flashnext.egg-info/PKG-INFO", "server/__pycache__/cli.cpython-311.pyc"):
        assert dockerignored(stale, patterns), f".dockerignore lets {stale} into the build context"


def test_pip_never_installs_or_upgrades_torch(pip_lines):
    for args in pip_lines:
        options, targets = pip_targets(args)
        replacing = options & PIP_REPLACING_OPTIONS
        assert not replacing, f"pip install {' '.join(args)}: {sorted(replacing)} could replace the image's torch"
        assert not options & {"-r", "--requirement"}, "pip install -r hides what it installs; list requirements"
        for target in targets:
            if is_local_path(target):
                assert "--no-deps" in options, f"pip install {target} without --no-deps would resolve torch again"
            else:
                name = Requirement(target).name.lower()
                assert not IMAGE_OWNED.match(name), f"pip install {target}: {name} must come from the base image"


def test_pip_installs_exactly_the_other_runtime_dependencies(pip_lines, pyproject):
    listed: dict[str, str] = {}
    for args in pip_lines:
        _, targets = pip_targets(args)
        for target in targets:
            if not is_local_path(target):
                req = Requirement(target)
                listed[req.name.lower()] = str(req.specifier)
    wanted = {}
    for line in pyproject["project"]["dependencies"]:
        req = Requirement(line)
        if not IMAGE_OWNED.match(req.name.lower()):
            wanted[req.name.lower()] = str(req.specifier)
    assert listed == wanted, f"Dockerfile installs {listed}, pyproject needs {wanted} (besides torch and triton)"


def test_readme_run_uses_the_built_image_and_serves_the_mounted_model_at_tp2(dockerfile):
    build, run = readme_docker_commands()
    tag = build_tag(build)
    image, args = run_image_and_args(run)
    assert image == tag, f"README builds {tag!r} but runs {image!r}"
    assert build[-1] == ".", "README's docker build must use the repository root as context"
    parsed = build_parser().parse_args(entrypoint(dockerfile)[1:] + args)
    volumes = [run[i + 1] for i, word in enumerate(run) if word in ("-v", "--volume")]
    mounted = [v.split(":")[1] for v in volumes]
    assert any(parsed.model.is_relative_to(m) for m in mounted), f"model {parsed.model} is not under a volume {volumes}"
    assert parsed.tp == 2
