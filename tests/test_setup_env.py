"""scripts/setup_env.sh, the two profiles (requirements/cpu.txt, gpu.txt) and the offline wheelhouse.

Offline tests: profile selection (forced, and by a fake `nvidia-smi` on PATH), the lock files
against pyproject.toml, `profile_lock.py check --offline` on both locks (a missing pin is found
with no index), the requirement checker on hand-made metadata, where the CPU profile takes its
torch from (local files, else a CPU index, never a CUDA build: fake indexes of tiny hand-made
torch wheels), and a wheelhouse of tiny hand-made wheels that scripts/offline_bundle.sh builds and
set-up installs from with no index into a fresh venv. One test needs a package index (marked
`network`, skipped without one): the GPU profile resolves for CPython 3.12 on manylinux x86-64,
from wheel metadata only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "tools"))

import profile_lock  # noqa: E402

PYVER = f"{sys.version_info[0]}.{sys.version_info[1]}"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child set-up: no pip configuration of this machine (its find-links and
    extra indexes), no SLIME_* variables of the caller, and a PATH without any nvidia-smi."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIME_", "PIP_", "VIRTUAL_ENV"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    path = [d for d in env.get("PATH", "").split(os.pathsep) if d and not Path(d, "nvidia-smi").exists()]
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), *path])
    env.update(extra)
    return env


def fake_nvidia_smi(folder: Path, gpus: int, fail: bool = False) -> Path:
    """An nvidia-smi that lists `gpus` GPUs for `-L`, or fails the way it does without a driver."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    if fail:
        body = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9'
    else:
        body = "\n".join(f'echo "GPU {i}: NVIDIA H200 (UUID: GPU-{i:08d})"' for i in range(gpus))
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return folder


def dry_run(env: dict[str, str], root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "setup_env.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------------------
# Profile selection


@pytest.mark.parametrize("gpus,fail,forced,expected,why", [
    (2, False, None, "gpu", "nvidia-smi lists 2 GPU(s)"),
    (1, False, None, "gpu", "nvidia-smi lists 1 GPU(s)"),
    (0, False, None, "cpu", "nvidia-smi lists no GPU"),
    (0, True, None, "cpu", "nvidia-smi lists no GPU"),     # installed, but no driver
    (None, False, None, "cpu", "nvidia-smi lists no GPU"),  # not installed
    (2, False, "cpu", "cpu", "SLIME_PROFILE=cpu"),
    (None, False, "gpu", "gpu", "SLIME_PROFILE=gpu"),
])
def test_profile_selection(tmp_path, gpus, fail, forced, expected, why):
    env = clean_env(SLIME_VENV="none")
    if gpus is not None:
        env["PATH"] = f"{fake_nvidia_smi(tmp_path / 'bin', gpus, fail)}{os.pathsep}{env['PATH']}"
    if forced:
        env["SLIME_PROFILE"] = forced
    proc = dry_run(env)
    assert f"[setup] profile: {expected} ({why}); pins: requirements/{expected}.txt" in proc.stdout, proc.stdout + proc.stderr
    if expected == "gpu" and PYVER != "3.12":
        # The GPU lock is for CPython 3.12: any other interpreter is refused with the fix named.
        assert proc.returncode == 1
        assert "locked for CPython 3.12" in proc.stderr and "SLIME_PYTHON=python3.12" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert f"[setup] python: " in proc.stdout


def test_unknown_profile_is_refused():
    proc = dry_run(clean_env(SLIME_VENV="none", SLIME_PROFILE="tpu"))
    assert proc.returncode == 1
    assert "SLIME_PROFILE=tpu: use cpu or gpu" in proc.stderr


def test_cpu_profile_keeps_the_installed_torch_and_admits_its_local_label():
    import importlib.metadata

    have = importlib.metadata.version("torch")  # 2.13.0+cpu on the CPU machines
    proc = dry_run(clean_env(SLIME_VENV="none", SLIME_PROFILE="cpu"))
    pin = profile_lock.read_lock(ROOT / "requirements" / "cpu.txt").pins()["torch"]
    if profile_lock.public_version(have) == pin:
        assert f"[setup] torch: keep torch {have} (the cpu profile pins {pin})" in proc.stdout
    else:
        assert f"[setup] torch: install torch=={pin} (replacing torch {have})" in proc.stdout


# ------------------------------------------------------------------------------------------------
# The lock files


def test_gpu_lock_pins_the_stack_the_issue_names():
    lock = profile_lock.read_lock(ROOT / "requirements" / "gpu.txt")
    assert lock.python == "3.12"
    assert set(lock.sections) == {"torch", "base", "megatron", "sglang", "build"}
    assert lock.sections["sglang"].no_deps and not lock.sections["base"].no_deps
    pins = lock.pins()  # raises if one package had two versions in two sections
    expected = {"torch": "2.11.0", "transformers": "5.12.1", "tokenizers": "0.22.2", "sglang": "0.5.17",
                "sglang-kernel": "0.4.5", "flashinfer-python": "0.6.15.post1", "megatron-core": "0.16.1",
                "flash-linear-attention": "0.6.0", "fla-core": "0.6.0", "tilelang": "0.1.15",
                "apache-tvm-ffi": "0.1.11", "torch-c-dlpack-ext": "0.1.5", "z3-solver": "4.15.4.0",
                "triton": "3.6.0", "ray": "2.60.0", "math-verify": "0.9.0"}
    assert {k: pins.get(k) for k in expected} == expected
    assert "torch" in lock.sections["torch"].pins and "tilelang" in lock.sections["megatron"].pins


@pytest.mark.parametrize("profile,python", [("cpu", "3.11"), ("gpu", "3.12")])
def test_pyproject_admits_each_profile(profile, python):
    """Every dependency of slime (and of the extras that profile installs) admits the profile's pin."""
    lock = profile_lock.read_lock(ROOT / "requirements" / f"{profile}.txt")
    pins = lock.pins()
    extras = ["test"] if profile == "cpu" else ["test", "megatron", "sglang"]
    env = profile_lock.target_environment(python)
    for text in profile_lock.slime_requirements(ROOT / "pyproject.toml", extras):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        have = pins.get(profile_lock.normalize(req.name))
        assert have is not None, f"{profile} profile does not pin {req.name}"
        assert req.specifier.contains(Version(have), prereleases=True), f"pyproject wants {req}, {profile} pins {have}"


def test_sections_for_extras():
    lock = profile_lock.read_lock(ROOT / "requirements" / "gpu.txt")
    assert profile_lock.sections_for(lock, ["test"]) == ["torch", "base", "build"]
    assert profile_lock.sections_for(lock, ["test", "sglang", "megatron"]) == ["torch", "base", "build", "sglang", "megatron"]


def test_lock_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "lock.txt"
    bad.write_text("#! section base\nnumpy==2.5.2\nray>=2\n")
    with pytest.raises(profile_lock.LockError, match=r"lock.txt:3: 'ray>=2' is not an exact pin"):
        profile_lock.read_lock(bad)
    bad.write_text("#! section base\nnumpy==2.5.2\n#! section extra\nNumPy==2.4.6\n")
    with pytest.raises(profile_lock.LockError, match="numpy is pinned to 2.5.2 and 2.4.6"):
        profile_lock.read_lock(bad).pins()


def test_unmet_requirements_follow_markers_and_extras():
    meta = {
        "app": {"version": "1.0", "requires_dist": [
            "lib>=2", "opt==1.0; extra == 'fast'", "old; python_version < '3.0'", "new>=1; python_version >= '3.12'",
            "winonly; sys_platform == 'win32'", "kit[gpu]==3.0"]},
        "lib": {"version": "1.5", "requires_dist": []},
        "kit": {"version": "3.0", "requires_dist": ["cu==13.0; extra == 'gpu'"]},
        "cu": {"version": "12.9", "requires_dist": None},
    }
    got = profile_lock.unmet_requirements(meta, {}, "3.12")
    # by hand: lib 1.5 < 2; new is required on 3.12 and missing; kit[gpu] asks cu==13.0, the set has 12.9
    assert got == [("app", "lib>=2", "1.5"), ("app", "new>=1", "missing"), ("kit", "cu==13.0", "12.9")]
    got = profile_lock.unmet_requirements(meta, {"app": {"fast"}}, "3.11")
    assert got == [("app", "lib>=2", "1.5"), ("app", "opt==1.0", "missing"), ("kit", "cu==13.0", "12.9")]


def test_platform_tags_cover_older_glibc():
    tags = profile_lock.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags) and "manylinux_2_29_x86_64" not in tags
    assert profile_lock.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def check_offline(lock: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "tools" / "profile_lock.py"), "check", str(lock),
                           "--offline", "--pyproject", str(ROOT / "pyproject.toml")],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_lock_check_offline_passes(profile):
    """`check --offline` asks no index: slime's requirements against the pins, and the declared
    requirements of every pin installed here at its pinned version against the pins."""
    proc = check_offline(ROOT / "requirements" / f"{profile}.txt")
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "offline (installed metadata): OK" in summary, summary
    import importlib.metadata

    if profile == "cpu" and profile_lock.public_version(importlib.metadata.version("torch")) == "2.13.0":
        assert "unchecked" not in summary, summary  # this venv is the CPU profile: every pin was checked


def test_lock_check_offline_finds_a_missing_pin(tmp_path):
    """A pin dropped from each lock is found with no index: idna (httpx and requests require it,
    read from their installed metadata) from the CPU lock, math-verify (slime's own requirement)
    from the GPU lock."""
    for profile, dropped, expected in [("cpu", "idna==", "httpx needs idna, the lock has missing"),
                                       ("gpu", "math-verify==", "slime[test] needs math-verify==0.9.0 but the lock has nothing")]:
        text = (ROOT / "requirements" / f"{profile}.txt").read_text()
        assert f"\n{dropped}" in text
        lock = tmp_path / f"{profile}.txt"
        lock.write_text("".join(line for line in text.splitlines(keepends=True) if not line.startswith(dropped)))
        proc = check_offline(lock)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert expected in proc.stdout, proc.stdout


@pytest.mark.network
def test_gpu_profile_resolves_for_cp312_manylinux(tmp_path):
    """pip's resolver accepts the GPU lock (torch + base + megatron) for CPython 3.12 on manylinux
    x86-64 and picks exactly its versions; every pin, the no-deps SGLang section included, has a
    wheel there and meets the others' declared requirements except the lock's '#! allow' lines.
    Metadata only (pip's fast-deps range requests): torch's 530 MB wheel is never downloaded.  Slow (about 30 s,
    the index's latency): pip reads the metadata of the lock's 215 wheels one request at a time; the no-deps pins
    are fetched while the resolver runs."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tools" / "profile_lock.py"), "check",
                           str(ROOT / "requirements" / "gpu.txt"), "--resolve"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PIP_NO_CACHE_DIR="1"))
    out = proc.stdout + proc.stderr
    offline = ("Failed to establish a new connection", "Temporary failure in name resolution",
               "Network is unreachable", "Max retries exceeded", "Could not fetch URL", "timed out")
    if proc.returncode == 2 and any(s in out for s in offline):
        pytest.skip("no package index reachable")
    assert proc.returncode == 0, out
    assert out.strip().endswith("Python 3.12, manylinux_2_34_x86_64: OK"), out


# ------------------------------------------------------------------------------------------------
# Wheelhouse: build with scripts/offline_bundle.sh, install with no index into a fresh venv


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel: module `name` whose VERSION is `version`."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d.encode()).digest()).rstrip(b'=').decode()},{len(d)}\n"
        for p, d in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for p, d in files.items():
            zf.writestr(p, d)
        zf.writestr(f"{dist}/RECORD", record)
    return path


# ------------------------------------------------------------------------------------------------
# The CPU profile's torch: a CPU build, from local files or a CPU index, never a CUDA build


CUDA_RUNTIME = "nvidia-cublas==13.1.0.3; platform_system == 'Linux'"  # as PyPI's Linux torch declares it


@pytest.mark.parametrize("version, requires, system, kind, why", [
    ("2.13.0+cpu", ["filelock", "sympy>=1.13.3"], "Linux", "cpu", "torch 2.13.0+cpu is a CPU build"),
    ("2.13.0", ["filelock", CUDA_RUNTIME], "Linux", "gpu", "is a GPU build: it requires nvidia-cublas here"),
    ("2.13.0", ["filelock", CUDA_RUNTIME], "Darwin", "cpu", "is a CPU build"),  # PyPI's macOS wheel
    ("2.11.0+cu130", [], "Linux", "gpu", "is a +cu130 build"),
    ("2.9.0+rocm6.4", ["pytorch-triton-rocm==3.5.0"], "Linux", "gpu", "is a +rocm6.4 build"),
])  # fmt: skip
def test_torch_build_kind(version, requires, system, kind, why):
    env = dict(profile_lock.target_environment("3.11"), platform_system=system)
    got, text = profile_lock.torch_build_kind({"version": version, "requires_dist": requires}, env)
    assert got == kind and why in text, text


def simple_index(root: Path, *wheels: Path) -> str:
    """A PEP 503 index on disk serving `wheels`; returns its file:// URL."""
    for wheel in wheels:
        project = root / "simple" / profile_lock.normalize(wheel.name.split("-")[0])
        project.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="{w.as_uri()}">{w.name}</a>\n' for w in wheels if w.name.split("-")[0] == wheel.name.split("-")[0])
        (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return (root / "simple").as_uri()


@pytest.fixture(scope="module")
def torch_sources(tmp_path_factory) -> dict[str, Path | str]:
    """Tiny stand-ins for torch 2.13.0: a CUDA build as PyPI's Linux one (no label, requires a CUDA
    library no index has), and the CPU build (+cpu) as local files and as a CPU index."""
    root = tmp_path_factory.mktemp("torch-sources")
    cuda = make_wheel(root / "cuda-files", "torch", "2.13.0", ("nvidia-cublas==13.1.0.3",))
    cpu = make_wheel(root / "cpu-files", "torch", "2.13.0+cpu")
    return {"cuda_files": cuda.parent, "cpu_files": cpu.parent, "cuda_index": simple_index(root / "cuda-index", cuda),
            "cpu_index": simple_index(root / "cpu-index", cpu)}


@pytest.fixture(scope="module")
def python_without_torch(tmp_path_factory) -> Path:
    """The bin folder of a fresh venv (with pip, without torch): set-up has to install torch there."""
    return fresh_venv(tmp_path_factory.mktemp("no-torch") / "venv", torch_version=None) / "bin"


def cpu_dry_run(bin_dir: Path, **extra: str) -> subprocess.CompletedProcess:
    env = clean_env(SLIME_VENV="none", SLIME_PROFILE="cpu", **extra)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return dry_run(env)


def test_cpu_profile_takes_torch_from_local_files_first(torch_sources, python_without_torch):
    """As on CI and the project's machines: the CPU wheel on local disk (pip's find-links), while
    pip's index serves a CUDA build; SLIME_TORCH_INDEX_URL (here unreachable) is never asked."""
    proc = cpu_dry_run(python_without_torch, PIP_FIND_LINKS=str(torch_sources["cpu_files"]),
                       PIP_INDEX_URL=torch_sources["cuda_index"], SLIME_TORCH_INDEX_URL="https://unreachable.invalid/cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheel = (torch_sources["cpu_files"] / "torch-2.13.0+cpu-py3-none-any.whl").as_uri()
    assert f"[setup] torch: install torch==2.13.0 from pip's find-links: cpu 2.13.0+cpu {wheel}" in proc.stdout, proc.stdout


@pytest.mark.parametrize("find_links", [None, "cuda_files"])
def test_cpu_profile_takes_torch_from_the_cpu_index_otherwise(torch_sources, python_without_torch, find_links):
    """A Linux laptop: pip's index (PyPI) has only the CUDA build and no local file holds a CPU one
    (none, or a CUDA wheel): the CPU build comes from SLIME_TORCH_INDEX_URL."""
    extra = {"PIP_FIND_LINKS": str(torch_sources[find_links])} if find_links else {}
    proc = cpu_dry_run(python_without_torch, PIP_INDEX_URL=torch_sources["cuda_index"],
                       SLIME_TORCH_INDEX_URL=torch_sources["cpu_index"], **extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = next(line for line in proc.stdout.splitlines() if line.startswith("[setup] torch:"))
    assert plan.startswith(f"[setup] torch: install torch==2.13.0 from SLIME_TORCH_INDEX_URL={torch_sources['cpu_index']}: "
                           "cpu 2.13.0+cpu"), plan
    local = "gpu 2.13.0" if find_links else "none: pip finds no torch==2.13.0"
    assert f"(pip's find-links: {local}" in plan, plan


def test_cpu_profile_never_installs_a_cuda_torch(torch_sources, python_without_torch):
    """An index that serves only a CUDA build as SLIME_TORCH_INDEX_URL: set-up stops and says why."""
    proc = cpu_dry_run(python_without_torch, PIP_INDEX_URL=torch_sources["cuda_index"],
                       SLIME_TORCH_INDEX_URL=torch_sources["cuda_index"])
    assert proc.returncode == 1
    assert "the cpu profile needs a CPU build of torch==2.13.0, and none was found" in proc.stderr, proc.stderr
    assert "torch 2.13.0 is a GPU build: it requires nvidia-cublas here" in proc.stderr, proc.stderr


STUB_BACKEND = '''"""In-tree PEP 517/660 backend of the stub project: an editable wheel that puts the project on sys.path."""
import base64, hashlib, os, tomllib, zipfile

def _meta():
    p = tomllib.load(open("pyproject.toml", "rb"))["project"]
    lines = [f"Metadata-Version: 2.1", f"Name: {p['name']}", f"Version: {p['version']}"]
    lines += [f"Requires-Dist: {r}" for r in p.get("dependencies", [])]
    for extra, reqs in p.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f"Requires-Dist: {r}; extra == '{extra}'" for r in reqs]
    return p["name"], p["version"], "\\n".join(lines) + "\\n"

def _wheel(directory, files):
    name, version, _ = _meta()
    fn = f"{name}-{version}-py3-none-any.whl"
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(os.path.join(directory, fn), "w") as zf:
        rec = []
        for path, data in files.items():
            zf.writestr(path, data)
            h = base64.urlsafe_b64encode(hashlib.sha256(data.encode()).digest()).rstrip(b"=").decode()
            rec.append(f"{path},sha256={h},{len(data)}")
        zf.writestr(f"{dist}/RECORD", "\\n".join(rec + [f"{dist}/RECORD,,"]) + "\\n")
    return fn

def _files(extra):
    name, version, meta = _meta()
    dist = f"{name}-{version}.dist-info"
    return dict(extra, **{f"{dist}/METADATA": meta,
                          f"{dist}/WHEEL": "Wheel-Version: 1.0\\nGenerator: stub\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"})

def get_requires_for_build_wheel(config_settings=None): return []
def get_requires_for_build_editable(config_settings=None): return []
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, _files({"slime/__init__.py": open("slime/__init__.py").read()}))
def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, _files({"slime_stub.pth": os.getcwd() + "\\n"}))
'''


@pytest.fixture(scope="module")
def stub_repo(tmp_path_factory) -> Path:
    """A copy of the set-up scripts around a stub `slime` whose profile pins tiny local wheels:
    torch (stands for the image's), base deps, and a no-deps section whose package declares a
    requirement that no index has (it must never be resolved)."""
    root = tmp_path_factory.mktemp("stub") / "repo"
    (root / "scripts" / "tools").mkdir(parents=True)
    (root / "requirements").mkdir()
    (root / "slime").mkdir()
    for rel in ("scripts/setup_env.sh", "scripts/offline_bundle.sh", "scripts/tools/profile_lock.py",
                "scripts/tools/offline_bundle.py"):
        shutil.copy2(ROOT / rel, root / rel)
    (root / "slime" / "__init__.py").write_text("import slimedep_a\n")
    (root / "stub_backend.py").write_text(STUB_BACKEND)
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "stub_backend"\nbackend-path = ["."]\n\n'
        '[project]\nname = "slime"\nversion = "0.1.0"\ndependencies = ["torch>=2.11.0,<=2.13.0", "slimedep-a>=1"]\n\n'
        '[project.optional-dependencies]\ntest = []\nsglang = ["slimedep-c==3.0"]\n')
    (root / "requirements" / "cpu.txt").write_text("torch==2.13.0\nslimedep-a==1.0\nslimedep-b==2.0\n")
    (root / "requirements" / "gpu.txt").write_text(
        f"#! python {PYVER}\n#! section torch\ntorch==2.11.0\n#! section base\nslimedep-a==1.0\nslimedep-b==2.0\n"
        "#! section sglang no-deps\n#! allow slimedep-c not-on-any-index: test\nslimedep-c==3.0\n#! section build\n")
    index = root.parent / "index"
    make_wheel(index, "torch", "2.11.0")
    make_wheel(index, "slimedep_a", "1.0", ("slimedep-b==2.0",))
    make_wheel(index, "slimedep_b", "2.0")
    make_wheel(index, "slimedep_b", "2.1")  # newer, but the lock says 2.0
    make_wheel(index, "slimedep_c", "3.0", ("not-on-any-index==1.0",))
    return root


def bundle(repo: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(repo / "scripts" / "offline_bundle.sh"), str(out), "--profile",
                           str(repo / "requirements" / "gpu.txt"), "--extras", "test,sglang", "--force", *args,
                           "--", "--no-index", "--find-links", str(repo.parent / "index")],
                          env=clean_env(SLIME_BUNDLE_PYTHON=sys.executable), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def fresh_venv(path: Path, torch_version: str | None) -> Path:
    """A new venv without pip's upgrade; `torch_version` installs a metadata-only torch (an image's)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    if torch_version:
        site = subprocess.run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        info = Path(site, f"torch-{torch_version}.dist-info")
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
        (info / "INSTALLER").write_text("image\n")
        (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
    return path


def installed(venv: Path) -> dict[str, str]:
    code = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def setup(repo: Path, venv: Path, wheelhouse: Path, **extra: str) -> subprocess.CompletedProcess:
    env = clean_env(SLIME_PROFILE="gpu", SLIME_VENV=str(venv), SLIME_WHEELHOUSE=str(wheelhouse),
                    TMPDIR=str(venv.parent), **extra)  # unpacked parts land next to the venv
    return subprocess.run(["bash", str(repo / "scripts" / "setup_env.sh")], env=env, capture_output=True,
                          text=True, timeout=600)


def test_wheelhouse_in_parts_installs_offline_and_keeps_torch(stub_repo, tmp_path):
    """The air-gapped path on an image: parts gathered in one folder, torch kept, idempotent; then
    the packed form of the same profile on PYTHONPATH."""
    out = tmp_path / "wh"
    proc = bundle(stub_repo, out, "--no-torch", "--part-size", "2K")
    manifest = json.loads((out / "part-000" / "slime-wheelhouse.json").read_text())
    # torch left out, the lock's slimedep-b 2.0 (not the newer 2.1), the no-deps section without its requirement
    assert sorted(w["name"] for w in manifest["wheels"]) == [
        "slimedep_a-1.0-py3-none-any.whl", "slimedep_b-2.0-py3-none-any.whl", "slimedep_c-3.0-py3-none-any.whl"]
    assert manifest["left_out"]["torch section (--no-torch)"] == ["torch==2.11.0"]
    parts = sorted(p.name for p in out.iterdir())
    assert len(parts) == len(manifest["parts"]) >= 2, parts  # 3 tiny wheels in a tar > 2 KiB
    assert "left out, torch section (--no-torch): 1" in proc.stdout

    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for part in parts[:-1]:
        for f in (out / part).iterdir():
            shutil.copy2(f, gathered)
    venv = fresh_venv(tmp_path / "venv", torch_version="2.11.0+cu130")
    proc = setup(stub_repo, venv, gathered)
    assert proc.returncode == 1
    assert f"missing: {manifest['parts'][-1]}" in proc.stderr, proc.stderr

    for f in (out / parts[-1]).iterdir():
        shutil.copy2(f, gathered)
    proc = setup(stub_repo, venv, gathered)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (stub_repo / ".setup.log").read_text()
    assert "[setup] keep torch 2.11.0+cu130 (the gpu profile pins 2.11.0)" in proc.stdout
    have = installed(venv)
    assert have["torch"] == "2.11.0+cu130"  # the image's, untouched
    assert (have["slimedep_a"], have["slimedep_b"], have["slimedep_c"]) == ("1.0", "2.0", "3.0")
    assert "not-on-any-index" not in have
    # idempotent: a second call installs nothing
    proc = setup(stub_repo, venv, gathered)
    assert proc.returncode == 0 and "[setup] installing" not in proc.stdout, proc.stdout

    # packed form: unpacked once into SLIME_SITE_DIR, which PYTHONPATH puts before site-packages
    packed = tmp_path / "packed"
    bundle(stub_repo, packed, "--form", "packed")
    manifest = json.loads((packed / "slime-wheelhouse.json").read_text())
    assert manifest["form"] == "packed" and "torch" not in manifest["sections"]
    site = tmp_path / "site"
    env = clean_env(SLIME_PROFILE="gpu", SLIME_VENV=str(venv), SLIME_WHEELHOUSE=str(packed), SLIME_SITE_DIR=str(site))
    script = (f"source {stub_repo}/scripts/setup_env.sh && "
              'python -c "import slimedep_b, slimedep_c; print(slimedep_b.__file__, slimedep_b.VERSION)"')
    for _ in range(2):  # the second call finds the tree unpacked
        proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        path, version = proc.stdout.split()[-2:]
        assert Path(path).is_relative_to(site) and version == "2.0"
    assert "unpacking" not in proc.stderr


def test_mismatched_torch_is_replaced_from_the_wheelhouse_or_refused(stub_repo, tmp_path):
    venv = fresh_venv(tmp_path / "venv", torch_version="2.10.0+cu128")
    bundle(stub_repo, tmp_path / "no-torch", "--no-torch")
    proc = setup(stub_repo, venv, tmp_path / "no-torch")
    assert proc.returncode == 1
    assert "built with --no-torch, and this python has 2.10.0+cu128" in proc.stderr, proc.stderr

    bundle(stub_repo, tmp_path / "wh", "--extras", "test")  # the last --extras wins: no sglang section
    proc = setup(stub_repo, venv, tmp_path / "wh")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[setup] install torch==2.11.0 (replacing torch 2.10.0+cu128)" in proc.stdout
    have = installed(venv)
    assert have["torch"] == "2.11.0" and "slimedep_c" not in have
    proc = setup(stub_repo, venv, tmp_path / "wh", SLIME_EXTRAS="test,sglang")
    assert proc.returncode == 1
    assert "needs the sglang section" in proc.stderr and "--extras test,sglang" in proc.stderr


def test_cpu_profile_installs_the_cpu_torch_from_the_cpu_index(stub_repo, torch_sources, tmp_path):
    """The laptop path for real, into a new venv: torch 2.13.0+cpu from SLIME_TORCH_INDEX_URL while
    pip's index serves the CUDA build (whose CUDA library no index has: pulling it would fail), then
    slime's dependencies at the lock's versions; a second call installs nothing."""
    venv = tmp_path / "venv"
    env = clean_env(SLIME_PROFILE="cpu", SLIME_VENV=str(venv), PIP_INDEX_URL=torch_sources["cuda_index"],
                    PIP_FIND_LINKS=str(stub_repo.parent / "index"), SLIME_TORCH_INDEX_URL=torch_sources["cpu_index"])
    calls = []
    for _ in range(2):
        proc = subprocess.run(["bash", str(stub_repo / "scripts" / "setup_env.sh")], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr + (stub_repo / ".setup.log").read_text()
        calls.append(proc)
    assert "[setup] installing" not in proc.stdout, proc.stdout  # the second call
    # the first: the line before pip's quiet minute says what runs and where its output goes
    lines = calls[0].stdout.splitlines()
    assert lines[-1].startswith("[setup] done in"), lines
    assert lines[-2] == (f"[setup] pip is installing quietly (a minute or more on a fresh machine); its output: "
                         f"{stub_repo / '.setup.log'} (tail -f it to follow)"), lines
    have = installed(venv)
    assert have["torch"] == "2.13.0+cpu"
    assert (have["slimedep_a"], have["slimedep_b"]) == ("1.0", "2.0") and "nvidia-cublas" not in have


# ------------------------------------------------------------------------------------------------
# sglang-kernel's FA3: kept by default (SGLang serves at its defaults), dropped with --no-keep-fa3


def _kernel_wheel(folder: Path) -> Path:
    """A stand-in sglang-kernel wheel with an FA3 library, an sm100 build and one library that always stays."""
    folder.mkdir(parents=True, exist_ok=True)
    members = {"sgl_kernel/__init__.py": "", "sgl_kernel/common_ops.abi3.so": "x" * 10,
               "sgl_kernel/flash_ops.abi3.so": "y" * 10, "sgl_kernel/sm100/common_ops.abi3.so": "z" * 10}
    dist = "sglang_kernel-0.4.5.dist-info"
    record = "".join(f"{name},sha256=0,{len(data)}\n" for name, data in members.items()) + f"{dist}/RECORD,,\n"
    path = folder / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}/RECORD", record)
    return path


def test_no_keep_fa3_drops_exactly_the_fa3_and_sm100_members_and_their_record_lines(tmp_path):
    import offline_bundle

    wheel = _kernel_wheel(tmp_path)
    removed = offline_bundle.trim_wheel(wheel, offline_bundle.SGL_KERNEL_TRIM)
    assert sorted(removed) == ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so"]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = zf.read("sglang_kernel-0.4.5.dist-info/RECORD").decode()
    assert names == {"sgl_kernel/__init__.py", "sgl_kernel/common_ops.abi3.so", "sglang_kernel-0.4.5.dist-info/RECORD"}
    assert "flash_ops" not in record and "sm100" not in record and "common_ops.abi3.so," in record


@pytest.mark.parametrize("flags, keep", [([], True), (["--keep-fa3"], True), (["--no-keep-fa3"], False)])
def test_the_wheelhouse_keeps_fa3_unless_told_not_to(monkeypatch, tmp_path, flags, keep):
    import offline_bundle

    seen = {}
    monkeypatch.setattr(offline_bundle, "build", lambda args: seen.setdefault("keep_fa3", args.keep_fa3))
    assert offline_bundle.main([str(tmp_path / "wh"), *flags]) == 0
    assert seen["keep_fa3"] is keep
