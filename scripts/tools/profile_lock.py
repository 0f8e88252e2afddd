#!/usr/bin/env python3
"""Read and check a pinned install profile (requirements/gpu.txt is one).

A lock file is a pip requirements file: one ``name==version`` a line, usable as ``pip install -c``.
Comment lines that start with ``#!`` are directives for this tool, scripts/setup_env.sh and
scripts/offline_bundle.sh (pip reads them as comments):

  #! python 3.12                 the CPython minor version the lock is for (wheels are cp312)
  #! section NAME [no-deps]      the pins below belong to section NAME, up to the next section line
  #! allow PKG REQ: reason       PKG declares a requirement on REQ that the lock knowingly does not meet

Sections: ``torch`` (torch and what GPU images ship with it: triton, CUDA libraries, torchvision),
``base`` (slime's dependencies and the ``test`` extra), one per heavy pip extra (``megatron``,
``sglang``), and ``build`` (slime's build requirements: only wheelhouses need them). A ``no-deps``
section is installed with ``pip install --no-deps`` from its pins alone, because its packages'
declared closure is not installable next to the rest (see the allow lines in the lock).

  profile_lock.py sections LOCK --extras test,megatron [--no-deps]   sections those extras need
  profile_lock.py pins LOCK --sections sglang [--skip-have FREEZE]
  profile_lock.py pin LOCK torch                              the pinned version of one package
  profile_lock.py check LOCK [--resolve]                      needs a package index (see --help)
  profile_lock.py check LOCK --offline                        no index: the installed packages' metadata
  profile_lock.py torch-build torch==2.13.0 [-- PIP_ARGS]     is the build pip would install a CPU build?

Stdlib only, except ``check`` and ``torch-build`` (use ``packaging``, which pip vendors).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ALWAYS_SECTIONS = ("torch", "base", "build")
"""Sections every selection of extras installs (``build`` only goes into wheelhouses)."""


class LockError(ValueError):
    """A lock file that cannot be read: the message names the file, line and the problem."""


def normalize(name: str) -> str:
    """PEP 503 normalised project name (``Jinja2`` -> ``jinja2``, ``ml_dtypes`` -> ``ml-dtypes``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public_version(version: str) -> str:
    """The version without its PEP 440 local label: ``2.11.0+cu130`` -> ``2.11.0``."""
    return version.split("+", 1)[0]


@dataclass
class Section:
    name: str
    no_deps: bool = False
    pins: dict[str, str] = field(default_factory=dict)  # normalised name -> version
    spelled: dict[str, str] = field(default_factory=dict)  # normalised name -> name as written


@dataclass
class Lock:
    path: Path
    python: str | None
    sections: dict[str, Section]
    allows: dict[tuple[str, str], str]  # (package, requirement name) -> reason

    def pins(self, sections: list[str] | None = None) -> dict[str, str]:
        """Pins of the given sections (all by default), as normalised name -> version.

        Raises LockError if one package is pinned to two versions in the selected sections."""
        out: dict[str, str] = {}
        for name in sections if sections is not None else list(self.sections):
            sec = self.sections.get(name)
            if sec is None:
                continue
            for pkg, ver in sec.pins.items():
                if out.get(pkg, ver) != ver:
                    raise LockError(f"{self.path}: {pkg} is pinned to {out[pkg]} and {ver} in different sections")
                out[pkg] = ver
        return out

    def spelled(self, pkg: str) -> str:
        for sec in self.sections.values():
            if pkg in sec.spelled:
                return sec.spelled[pkg]
        return pkg


_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")


def read_lock(path: str | os.PathLike) -> Lock:
    """Parse a lock file (format in the module docstring).

    Raises LockError naming the file and line for anything other than an exact ``name==version``
    pin, a directive or a comment, and for a package pinned twice in one section."""
    path = Path(path)
    python = None
    sections: dict[str, Section] = {}
    allows: dict[tuple[str, str], str] = {}
    current = Section("base")
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        where = f"{path}:{lineno}"
        if line.startswith("#!"):
            words = line[2:].split()
            if not words:
                continue
            if words[0] == "python" and len(words) == 2:
                python = words[1]
            elif words[0] == "section" and len(words) in (2, 3) and (len(words) == 2 or words[2] == "no-deps"):
                current = sections.setdefault(words[1], Section(words[1], no_deps=len(words) == 3))
            elif words[0] == "allow" and len(words) >= 3 and ":" in line:
                head, reason = line[2:].split(":", 1)
                _, pkg, req = head.split()[:3]
                allows[(normalize(pkg), normalize(req))] = reason.strip()
            else:
                raise LockError(f"{where}: unknown directive {line!r} (python X.Y | section NAME [no-deps] | allow PKG REQ: reason)")
            continue
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        m = _PIN.match(line)
        if not m:
            raise LockError(f"{where}: {line!r} is not an exact pin (name==version)")
        pkg = normalize(m.group(1))
        if pkg in current.pins:
            raise LockError(f"{where}: {m.group(1)} is pinned twice in section {current.name}")
        sections.setdefault(current.name, current)
        current.pins[pkg] = m.group(2)
        current.spelled[pkg] = m.group(1)
    return Lock(path, python, sections, allows)


def sections_for(lock: Lock, extras: list[str]) -> list[str]:
    """The lock's sections that ``pip install slime[extras]`` needs: the always-sections, then one
    per extra that has a section of its own (``test`` lives in ``base``)."""
    names = [s for s in ALWAYS_SECTIONS if s in lock.sections]
    names += [e for e in extras if e in lock.sections and e not in names]
    return names


def read_freeze(path: str | os.PathLike) -> dict[str, str]:
    """``pip freeze`` output -> normalised name -> version (editable and URL lines are skipped)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        m = _PIN.match(line.strip())
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


# ----------------------------------------------------------------------------------------------
# Target platform flags for pip (download / dry-run for another Python and platform).

def platform_tags(platform: str) -> list[str]:
    """pip ``--platform`` values for a target: ``manylinux_2_N_ARCH`` expands to every manylinux
    tag that a glibc 2.N system accepts (pip matches ``--platform`` exactly); any other tag is
    returned as it is."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    legacy = {5: "manylinux1", 12: "manylinux2010", 17: "manylinux2014"}
    tags += [f"{name}_{arch}" for n, name in sorted(legacy.items(), reverse=True) if glibc >= n]
    return tags


def pip_target_args(python_version: str, platform: str) -> list[str]:
    """Arguments that make pip choose wheels for CPython ``python_version`` on ``platform``."""
    nodot = python_version.replace(".", "")
    # --ignore-requires-python: older pips check Requires-Python against the running interpreter even
    # with --python-version; `check` tests each pin's Requires-Python against the target itself.
    args = ["--only-binary=:all:", "--ignore-requires-python", "--python-version", python_version, "--implementation", "cp",
            "--abi", f"cp{nodot}", "--abi", "abi3", "--abi", "none"]
    for tag in platform_tags(platform) + ["any"]:
        args += ["--platform", tag]
    return args


# ----------------------------------------------------------------------------------------------
# check: every pin has a wheel for the target, and the pins meet each other's declared requirements.

def _packaging():
    try:
        from packaging.markers import Marker  # noqa: F401
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet  # noqa: F401
        from packaging.version import Version
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore
        from pip._vendor.packaging.version import Version  # type: ignore
    return Requirement, Version


def _packaging_specifier():
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore
    return SpecifierSet


def _pip(args: list[str], python: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, env=env)


def fetch_metadata(pins: dict[str, str], python_version: str, platform: str, pip_args: list[str],
                   python: str = sys.executable) -> dict[str, dict]:
    """Core metadata of each pinned wheel for the target, without downloading the wheels.

    ``pip install --dry-run --no-deps --report`` with ``--use-feature=fast-deps`` reads each
    wheel's METADATA through HTTP range requests (torch's 530 MB wheel costs a few kB).
    Returns normalised name -> the report's ``metadata`` dict. Raises RuntimeError with pip's
    output when a pin has no wheel for the target or the index cannot be reached."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp, "pins.txt")
        req.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
        report = Path(tmp, "report.json")
        proc = _pip(["install", "--dry-run", "--no-deps", "--ignore-installed", "--use-feature=fast-deps",
                     "--quiet", "--report", str(report), "--target", str(Path(tmp, "t")),
                     *pip_target_args(python_version, platform), *pip_args, "-r", str(req)], python)
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(f"pip could not fetch the metadata of the pins:\n{proc.stdout}{proc.stderr}")
        items = json.loads(report.read_text())["install"]
    return {normalize(i["metadata"]["name"]): i["metadata"] for i in items}


def installed_metadata(pins: dict[str, str]) -> dict[str, dict]:
    """Core metadata of the pins that this interpreter has installed at the pinned version, in the
    shape of pip's ``--report`` (``name``, ``version``, ``requires_dist``, ``requires_python``).

    A local label of the installed version is ignored (``2.13.0+cpu`` is the pin ``2.13.0``), so
    the metadata is that of the build installed here, which is the one the profile is for when this
    environment was set up from it.  Returns normalised name -> metadata."""
    import importlib.metadata

    out = {}
    for dist in importlib.metadata.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if name in pins and public_version(dist.version) == public_version(pins[name]) and name not in out:
            out[name] = {"name": dist.metadata["Name"], "version": dist.version, "requires_dist": dist.requires or [],
                         "requires_python": dist.metadata.get("Requires-Python")}
    return out


def target_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of CPython ``python_version`` on Linux x86-64."""
    return {"python_version": python_version, "python_full_version": python_version + ".0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "implementation_version": python_version + ".0", "os_name": "posix", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
            "platform_version": "", "extra": ""}


def unmet_requirements(metadata: dict[str, dict], roots: dict[str, set[str]], python_version: str,
                       versions: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """Declared requirements of the packages in ``metadata`` that the same set does not meet.

    ``roots`` maps packages to the extras requested of them (slime's own, say); extras that one
    package requests of another (``fsspec[http]``) are followed. ``versions``: normalised name ->
    version of every package of the set (default: those in ``metadata``; give the pins when some
    have no metadata, as offline). Returns (package, requirement, what the set has) triples, e.g.
    ("sglang", "tilelang==0.1.11", "0.1.15")."""
    Requirement, Version = _packaging()
    env = target_environment(python_version)
    versions = dict(versions) if versions is not None else {n: m["version"] for n, m in metadata.items()}
    extras: dict[str, set[str]] = {n: set(e) for n, e in roots.items()}
    unmet: dict[tuple[str, str], str] = {}
    changed = True
    while changed:  # follow requested extras to a fixed point
        changed = False
        for pkg, meta in metadata.items():
            for text in meta.get("requires_dist") or []:
                req = Requirement(text)
                active = [e for e in [""] + sorted(extras.get(pkg, ())) if req.marker is None
                          or req.marker.evaluate(dict(env, extra=e))]
                if not active:
                    continue
                name = normalize(req.name)
                have = versions.get(name)
                if have is None or not req.specifier.contains(Version(have), prereleases=True):
                    unmet[(pkg, str(req).split(";")[0].strip())] = have or "missing"
                    continue
                new = set(req.extras) - extras.setdefault(name, set())
                if new:
                    extras[name] |= new
                    changed = True
    return [(p, r, h) for (p, r), h in sorted(unmet.items())]


def slime_requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """slime's declared dependencies plus those of ``extras``, from pyproject.toml."""
    import tomllib
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return reqs


def check(lock: Lock, pyproject: Path, extras_sets: list[list[str]], python_version: str, platform: str,
          pip_args: list[str], resolve: bool, offline: bool = False) -> tuple[list[str], list[str]]:
    """Problems of ``lock`` for the target, and the pins left unchecked (empty lists: none).

    - every pin has a wheel for CPython ``python_version`` on ``platform``;
    - with ``resolve``: pip's own resolver, run on slime with every extra whose section is
      installed with dependencies, under ``-c lock``, picks exactly the lock's versions and
      nothing outside it (``pip install --dry-run``, metadata only);
    - for each list of extras in ``extras_sets``: the sections they select meet slime's declared
      requirements and every package's declared requirements (markers evaluated for the target),
      except the ``#! allow`` lines; an allow line that no longer matches anything is a problem too.

    With ``offline`` no index is asked: the metadata are those of the pins installed here at the
    pinned version (:func:`installed_metadata`).  slime's own requirements are checked in full
    (they need no metadata), and so is every requirement of an installed pin, so a missing pin
    of either kind is found; the pins not installed here are returned as unchecked (their
    wheels and requirements need an index), and so are allow lines of such packages.
    Raises RuntimeError when the index cannot be reached (not ``offline``)."""
    Requirement, Version = _packaging()
    problems = []
    all_pins = lock.pins()
    metadata: dict[str, dict] = {}
    if offline:
        if resolve:
            raise RuntimeError("--resolve needs a package index; drop --offline")
        metadata.update(installed_metadata(all_pins))
    else:
        # The pins outside the resolver's sections are fetched while it runs (both wait on the index), then any pin
        # it did not resolve at the pinned version.
        covered = lock.pins(resolver_sections(lock)) if resolve else {}
        outside = {n: v for n, v in all_pins.items() if n not in covered}
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            fetching = pool.submit(fetch_metadata, outside, python_version, platform, pip_args) if outside else None
            if resolve:
                resolved, problems = resolve_with_pip(lock, pyproject, python_version, platform, pip_args)
                metadata.update(resolved)
            if fetching is not None:
                metadata.update(fetching.result())
        rest = {n: v for n, v in all_pins.items() if metadata.get(n, {}).get("version") != v}
        if rest:
            metadata.update(fetch_metadata(rest, python_version, platform, pip_args))
    unchecked = sorted(f"{pkg}=={ver}" for pkg, ver in all_pins.items() if pkg not in metadata) if offline else []
    from_spec = _packaging_specifier()
    for pkg, ver in all_pins.items():
        if pkg not in metadata:
            if not offline:
                problems.append(f"{pkg}=={ver}: no wheel for the target")
        elif metadata[pkg].get("requires_python") and not from_spec(metadata[pkg]["requires_python"]).contains(
                Version(python_version + ".0")):
            problems.append(f"{pkg}=={ver} requires Python {metadata[pkg]['requires_python']}, the target is {python_version}")
    used_allows = set()
    for extras in extras_sets:
        names = sections_for(lock, extras)
        pins = lock.pins([n for n in names if n != "build"])
        meta = {n: metadata[n] for n in pins if n in metadata}
        for text in slime_requirements(pyproject, extras):
            req = Requirement(text)
            have = pins.get(normalize(req.name))
            if have is None or not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"slime[{','.join(extras)}] needs {req} but the lock has {have or 'nothing'}")
        for pkg, req, have in unmet_requirements(meta, {}, python_version, versions=pins):
            key = (pkg, normalize(Requirement(req).name))
            if key in lock.allows:
                used_allows.add(key)
                continue
            problems.append(f"[{'+'.join(names)}] {pkg} needs {req}, the lock has {have}")
    if "build" in lock.sections:  # pip's isolated build environment holds the build section alone
        build = lock.sections["build"].pins
        import tomllib
        for text in tomllib.loads(pyproject.read_text())["build-system"]["requires"]:
            req = Requirement(text)
            have = build.get(normalize(req.name))
            if have is None or not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"slime's build requirement {req} is not in the build section (it has {have or 'nothing'})")
        for pkg, req, have in unmet_requirements({n: metadata[n] for n in build if n in metadata}, {}, python_version,
                                                 versions=build):
            problems.append(f"[build] {pkg} needs {req}, the build section has {have}")
    for key in sorted(set(lock.allows) - used_allows):
        if key[0] in metadata:  # offline, an allow of a package without metadata cannot be judged
            problems.append(f"'#! allow {key[0]} {key[1]}' is not needed any more: remove it")
    return problems, unchecked


def _resolver_extras(lock: Lock) -> list[str]:
    """The extras whose sections are installed with dependencies (not ``no-deps``)."""
    return [e for e in lock.sections if e not in ALWAYS_SECTIONS and not lock.sections[e].no_deps]


def resolver_sections(lock: Lock) -> list[str]:
    """The sections :func:`resolve_with_pip` resolves: slime with ``test`` and every extra installed with
    dependencies, the build section left out."""
    return [n for n in sections_for(lock, _resolver_extras(lock) + ["test"]) if n != "build"]


def resolve_with_pip(lock: Lock, pyproject: Path, python_version: str, platform: str, pip_args: list[str]
                     ) -> tuple[dict[str, dict], list[str]]:
    """Run pip's resolver (``pip install --dry-run --ignore-installed``, metadata only) on slime's
    requirements with ``test`` and every extra whose section is not no-deps, under ``-c lock``.
    Returns the resolved packages' metadata and the problems: a package the selected sections do
    not pin, or a version other than the pin."""
    extras = _resolver_extras(lock)
    names = resolver_sections(lock)
    pins = lock.pins(names)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp, "req.txt")
        req.write_text("\n".join(slime_requirements(pyproject, extras + ["test"])) + "\n")
        report = Path(tmp, "report.json")
        proc = _pip(["install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps", "--quiet",
                     "--report", str(report), "--target", str(Path(tmp, "t")),
                     *pip_target_args(python_version, platform), *pip_args, "-c", str(lock.path),
                     "-r", str(req)], sys.executable)
        if proc.returncode != 0 or not report.exists():
            if "ResolutionImpossible" not in proc.stdout + proc.stderr:
                raise RuntimeError(f"pip could not run the resolver:\n{proc.stdout}{proc.stderr}")
            return {}, [f"pip cannot resolve slime[{','.join(extras + ['test'])}] under -c {lock.path}:\n"
                        f"{proc.stdout}{proc.stderr}"]
        got = {normalize(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}
    problems = [f"pip resolved {n}=={m['version']}, which the sections {'+'.join(names)} do not pin"
                for n, m in sorted(got.items()) if n not in pins]
    problems += [f"pip resolved {n}=={m['version']} against the pin {pins[n]}"
                 for n, m in sorted(got.items()) if n in pins and pins[n] != m["version"]]
    return got, problems


# ----------------------------------------------------------------------------------------------
# torch-build: which torch build pip would install here, a CPU or a GPU one?

GPU_LOCAL_LABELS = ("cu", "rocm", "xpu")
"""PEP 440 local labels of torch's accelerator builds (``2.11.0+cu130``, ``+rocm6.4``, ``+xpu``)."""
GPU_RUNTIME_PREFIXES = ("nvidia-", "cuda-", "pytorch-triton-rocm", "pytorch-triton-xpu")
"""Distributions that only accelerator builds of torch require (CUDA libraries, ROCm / XPU triton)."""


def torch_build_kind(metadata: dict, environment: dict[str, str] | None = None) -> tuple[str, str]:
    """``("cpu" | "gpu", why)`` for one torch build, from its core metadata (pip ``--report`` shape).

    A build is a GPU build when its version carries an accelerator label (:data:`GPU_LOCAL_LABELS`)
    or when, on this machine (``environment``: PEP 508 marker values, default the running
    interpreter's), it requires an accelerator runtime (:data:`GPU_RUNTIME_PREFIXES`): PyPI's Linux
    wheels of torch are CUDA builds without a label that require ``nvidia-*`` packages there, while
    PyPI's macOS wheels and every wheel of PyTorch's CPU index (``+cpu``) require none."""
    Requirement, _ = _packaging()
    version = metadata["version"]
    label = version.partition("+")[2]
    if label.startswith(GPU_LOCAL_LABELS):
        return "gpu", f"torch {version} is a +{label} build"
    runtime = []
    for text in metadata.get("requires_dist") or []:
        req = Requirement(text)
        if normalize(req.name).startswith(GPU_RUNTIME_PREFIXES) and (
                req.marker is None or req.marker.evaluate(environment)):
            runtime.append(normalize(req.name))
    if runtime:
        shown = ", ".join(runtime[:3]) + (f" and {len(runtime) - 3} more" if len(runtime) > 3 else "")
        return "gpu", f"torch {version} is a GPU build: it requires {shown} here"
    return "cpu", f"torch {version} is a CPU build"


def probe_build(requirement: str, pip_args: list[str], python: str = sys.executable) -> dict:
    """The distribution ``pip install requirement`` would take from pip's sources (its configuration
    plus ``pip_args``), without installing it: ``pip install --dry-run --no-deps --ignore-installed
    --report``.  pip reads the chosen wheel's metadata: a local wheel in place, or from an index the
    PEP 658 ``.metadata`` file where it serves one, else the whole wheel; so ask only sources whose
    answer is cheap (local files with ``--no-index``, or a CPU index).

    Returns the report's item: ``download_info.url`` and ``metadata``.
    Raises RuntimeError with pip's output when pip finds no such distribution."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        proc = _pip(["install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet", "--report", str(report),
                     *pip_args, requirement], python)
        if proc.returncode != 0 or not report.exists():
            lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith("ERROR")]
            raise RuntimeError(" ".join(lines) or (proc.stderr + proc.stdout).strip() or f"pip exited with {proc.returncode}")
        items = json.loads(report.read_text())["install"]
    if not items:
        raise RuntimeError(f"pip would install nothing for {requirement}")
    return items[0]


# ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sections", help="sections that a list of slime extras needs")
    p.add_argument("lock")
    p.add_argument("--extras", default="", help="comma-separated slime extras, e.g. test,megatron,sglang")
    p.add_argument("--no-deps", action="store_true", help="only the selected sections installed with --no-deps")
    p = sub.add_parser("pins", help="print name==version for some sections")
    p.add_argument("lock")
    p.add_argument("--sections", default="", help="comma-separated; default: all")
    p.add_argument("--skip-have", metavar="FREEZE", help="leave out pins that this pip freeze has at the same version")
    p = sub.add_parser("pin", help="print the pinned version of one package (nothing if unpinned)")
    p.add_argument("lock")
    p.add_argument("package")
    p = sub.add_parser("check", help="needs a package index: every pin has a wheel for the target, and the pins meet "
                                     "each other's and slime's declared requirements (except '#! allow' lines)")
    p.add_argument("lock")
    p.add_argument("--pyproject", default=str(Path(__file__).resolve().parents[2] / "pyproject.toml"))
    p.add_argument("--python-version", default=None, help="default: the lock's '#! python' line")
    p.add_argument("--platform", default="manylinux_2_34_x86_64",
                   help="target platform; manylinux_2_N_ARCH means every manylinux tag of glibc <= 2.N")
    p.add_argument("--resolve", action="store_true",
                   help="also run pip's resolver on the sections installed with dependencies")
    p.add_argument("--offline", action="store_true",
                   help="ask no index: check with the metadata of the pins installed in this python at the pinned "
                        "version (slime's requirements and those pins' requirements in full; the other pins are "
                        "listed as unchecked)")
    p.add_argument("pip_args", nargs="*", help="after --: extra pip arguments (e.g. --index-url URL)")
    p = sub.add_parser("torch-build", help="which build of a torch requirement pip would install here (its configured "
                                           "sources plus the pip arguments after --), without installing it: prints "
                                           "'cpu|gpu VERSION URL: why'; exit 0 for a CPU build, 1 for a GPU build, 2 "
                                           "when pip finds none")
    p.add_argument("requirement", help="e.g. torch==2.13.0")
    p.add_argument("--local-only", action="store_true",
                   help="ask no index (pip --no-index): only pip's find-links, e.g. wheels on local disk")
    p.add_argument("pip_args", nargs="*", help="after --: extra pip arguments (e.g. --index-url URL)")
    args = parser.parse_args(argv)
    if args.cmd == "torch-build":
        try:
            item = probe_build(args.requirement, (["--no-index"] if args.local_only else []) + args.pip_args)
        except RuntimeError as err:
            print(f"none: pip finds no {args.requirement} ({err})")
            return 2
        kind, why = torch_build_kind(item["metadata"])
        print(f"{kind} {item['metadata']['version']} {item.get('download_info', {}).get('url', '?')}: {why}")
        return 0 if kind == "cpu" else 1
    try:
        lock = read_lock(args.lock)
        if args.cmd == "sections":
            names = sections_for(lock, [e for e in args.extras.split(",") if e])
            print(" ".join(n for n in names if lock.sections[n].no_deps or not args.no_deps))
        elif args.cmd == "pins":
            names = [s for s in args.sections.split(",") if s] or None
            have = read_freeze(args.skip_have) if args.skip_have else {}
            for pkg, ver in lock.pins(names).items():
                if have.get(pkg) != ver:
                    print(f"{lock.spelled(pkg)}=={ver}")
        elif args.cmd == "pin":
            ver = lock.pins().get(normalize(args.package))
            if ver:
                print(ver)
        else:
            pyver = args.python_version or lock.python or f"{sys.version_info[0]}.{sys.version_info[1]}"
            extras = [e for e in lock.sections if e not in ALWAYS_SECTIONS]
            sets = [["test"]] + [["test", e] for e in extras] + ([["test", *extras]] if len(extras) > 1 else [])
            problems, unchecked = check(lock, Path(args.pyproject), sets, pyver, args.platform, args.pip_args,
                                        args.resolve, offline=args.offline)
            for line in problems:
                print(line)
            where = "offline (installed metadata)" if args.offline else args.platform
            skipped = f"; {len(unchecked)} pins not installed here, unchecked: {' '.join(unchecked)}" if unchecked else ""
            print(f"{args.lock}: {len(lock.pins())} pins, Python {pyver}, {where}: "
                  f"{'OK' if not problems else f'{len(problems)} problem(s)'}{skipped}")
            return 1 if problems else 0
    except (LockError, OSError, RuntimeError) as err:
        print(f"profile_lock.py: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
