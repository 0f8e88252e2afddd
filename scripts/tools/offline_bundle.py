#!/usr/bin/env python3
"""Wheelhouses for air-gapped GPU nodes: build one where there is a package index, prepare it there.

Build (a machine with a package index; nothing is installed on it):

  scripts/offline_bundle.sh OUTDIR [--extras test,megatron,sglang] [--no-torch] [--have FREEZE]
                                   [--form wheels|packed] [--part-size 45M] [-- PIP_DOWNLOAD_ARGS]

downloads every wheel of the GPU profile (requirements/gpu.txt) that the chosen slime extras need,
for the profile's Python (cp312) on manylinux x86-64, with `pip download --no-deps` of the exact
pins (so nothing is resolved again and torch is never fetched unless asked for). On the node:

  SLIME_WHEELHOUSE=DIR bash examples/geo3k_vlm/run_geo3k_qwen35.sh     (or scripts/run_tests.sh)

scripts/setup_env.sh then installs with `pip install --no-index --find-links` (form `wheels`), or
unpacks the pre-installed tree onto PYTHONPATH (form `packed`); it calls `offline_bundle.py
prepare DIR`, which gathers split parts, checks their sha256 and unpacks them.

What each form leaves out:
  wheels   the torch section with --no-torch (torch, torchvision, torchaudio, triton, the CUDA
           libraries: GPU images ship them; torch alone is 531 MB); with --have FREEZE every pin that the target's
           `pip freeze` already has at the same version; with --no-keep-fa3, sglang-kernel's FA3
           (flash_ops) and sm100 builds (383 MB -> 25 MB, the full packed profile 8 parts -> 5: then
           serve with the triton attention backends, never fa3); SGLang's optional kernels that requirements/gpu.txt leaves out
           (its '#! allow' lines: FA4, CuTe DSL, MLA, humming, helion, tilelang 0.1.11).
  packed   the same, and always the torch section (it cannot replace an installed torch); the
           wheels installed (--no-deps --target) into one tree, debug symbols stripped from large
           .so files, C++ static libraries and the z3 CLI removed, packed with xz -9. Smaller to
           carry (SGLang alone: 84.5 MB against 219 MB of wheels), but pip does not see it: it
           shadows the environment's packages through PYTHONPATH, and `pip check` cannot vouch for it.
With --part-size the result is split into folders OUTDIR/part-000, part-001, ... of at most that
size each (for transfers with a size limit; part-000 also holds the manifest); copy every part
folder's files into one folder on the node (`cp part-*/* DIR`) and point SLIME_WHEELHOUSE at it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_lock import LockError, normalize, pip_target_args, public_version, read_freeze, read_lock, sections_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "slime-wheelhouse.json"
FORMAT = 1
# sglang-kernel files that --no-keep-fa3 drops: FA3 (flash_ops) and the sm100 (Blackwell) build.
SGL_KERNEL_TRIM = (re.compile(r"^sgl_kernel/flash_ops\.abi3\.so$"), re.compile(r"^sgl_kernel/sm100/"))
# In the packed tree: files unused from Python (static C++ libraries, CLIs, extensions for other Pythons).
PACKED_DROP = (re.compile(r"\.a$"), re.compile(r"^bin/z3$"), re.compile(r"\.cpython-3(?!12)\d+-x86_64-linux-gnu\.so$"))


class BundleError(RuntimeError):
    """A wheelhouse that cannot be built or prepared; the message says which file and what to do."""


def parse_size(text: str) -> int:
    """'45M' -> 47185920 bytes (K, M, G are powers of 1024; a bare number is bytes)."""
    m = re.fullmatch(r"(\d+)([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"--part-size {text!r}: give a positive size such as 45M or 2G")
    return int(m.group(1)) * 1024 ** " KMG".index((m.group(2) or " ").upper())


def sha256_of(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def trim_wheel(wheel: Path, patterns) -> list[str]:
    """Rewrite ``wheel`` without the members matching ``patterns`` (and their RECORD lines).
    Returns the removed member names."""
    removed = []
    tmp = wheel.with_suffix(".trim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if any(p.search(info.filename) for p in patterns):
                removed.append(info.filename)
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(True)
                               if not any(p.search(line.split(",", 1)[0]) for p in patterns)).encode()
            dst.writestr(info, data)
    if removed:
        tmp.replace(wheel)
    else:
        tmp.unlink()
    return removed


def split_file(path: Path, outdir: Path, part_size: int) -> list[str]:
    """Cut ``path`` into chunks of ``part_size`` bytes, one folder each (outdir/part-000/...,
    each with a copy of the manifest, written later). Returns the chunk names in order."""
    names = []
    with open(path, "rb") as f:
        for i in range(10 ** 6):
            block = f.read(part_size)
            if not block:
                break
            name = f"{path.name}.{i:03d}"
            folder = outdir / f"part-{i:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(block)
            names.append(name)
    return names


def build(args: argparse.Namespace) -> dict:
    """Build the wheelhouse described by ``args`` (see the module docstring); returns the manifest."""
    lock = read_lock(args.profile)
    python_version = args.python_version or lock.python
    if not python_version:
        raise BundleError(f"{args.profile} has no '#! python X.Y' line: pass --python-version")
    extras = [e for e in args.extras.split(",") if e]
    unknown = [e for e in extras if e not in known_extras(lock)]
    if unknown:
        raise BundleError(f"--extras {args.extras}: unknown extra(s) {unknown}; slime has {sorted(known_extras(lock))}")
    no_torch = args.no_torch or args.form == "packed"
    sections = [s for s in sections_for(lock, extras) if not (no_torch and s == "torch")]
    if args.form == "packed":
        sections = [s for s in sections if s != "build"]
    pins = lock.pins(sections)
    build_pins = build_requirements(lock) if args.form == "wheels" else {}
    left_out: dict[str, list[str]] = {}
    if no_torch and "torch" in lock.sections:
        left_out["torch section (--no-torch)" if args.form == "wheels" else "torch section (packed form)"] = [
            f"{lock.spelled(n)}=={v}" for n, v in lock.sections["torch"].pins.items()]
    if args.have:
        have = {n: public_version(v) for n, v in read_freeze(args.have).items()}
        skipped = [n for n, v in pins.items() if have.get(n) == public_version(v) and n not in build_pins]
        left_out[f"on the target already (--have {Path(args.have).name})"] = [f"{lock.spelled(n)}=={pins[n]}" for n in skipped]
        for n in skipped:
            del pins[n]
    pins.update(build_pins)

    outdir = Path(args.outdir).resolve()
    if outdir.exists() and any(outdir.iterdir()):
        if not args.force:
            raise BundleError(f"{outdir} is not empty: pass --force to replace it")
        shutil.rmtree(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="slime-bundle-"))
    try:
        wheels = work / "wheels"
        req = work / "pins.txt"
        req.write_text("".join(f"{lock.spelled(n)}=={v}\n" for n, v in sorted(pins.items())))
        print(f"[bundle] downloading {len(pins)} wheels for CPython {python_version} on {args.platform}"
              f" (sections {'+'.join(sections)})", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels),
               *pip_target_args(python_version, args.platform), *args.pip_args, "-r", str(req)]
        proc = subprocess.run(cmd, text=True, capture_output=True)
        if proc.returncode != 0:
            raise BundleError(f"pip download failed:\n{proc.stdout}{proc.stderr}")
        trimmed = []
        if not args.keep_fa3:
            for whl in wheels.glob("sglang_kernel-*.whl"):
                removed = trim_wheel(whl, SGL_KERNEL_TRIM)
                if removed:
                    trimmed.append(f"{whl.name}: {', '.join(removed)}")
        if trimmed:
            left_out["trimmed (--no-keep-fa3)"] = trimmed
        files = sorted(wheels.glob("*.whl"))
        manifest = {
            "format": FORMAT, "form": args.form, "profile": str(Path(args.profile)),
            "profile_sha256": sha256_of([Path(args.profile)]), "python": python_version,
            "platform": args.platform, "extras": extras, "sections": sections, "left_out": left_out,
            "wheels": [{"name": f.name, "bytes": f.stat().st_size} for f in files],
            "wheel_bytes": sum(f.stat().st_size for f in files),
        }
        if args.form == "wheels":
            payload = files
            if args.part_size:
                archive = work / "wheelhouse.tar"
                with tarfile.open(archive, "w") as tar:  # wheels are compressed already
                    for f in files:
                        tar.add(f, arcname=f.name)
                payload = [archive]
        else:
            archive = work / "site.tar.xz"
            site = work / "site"
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                                   "--no-compile", "--target", str(site),
                                   *pip_target_args(python_version, args.platform), *map(str, files)],
                                  text=True, capture_output=True)
            if proc.returncode != 0:
                raise BundleError(f"pip install --target failed:\n{proc.stdout}{proc.stderr}")
            manifest["packed_dropped"] = slim_site(site)
            manifest["site_bytes"] = sum(p.stat().st_size for p in site.rglob("*") if p.is_file() and not p.is_symlink())
            pack_xz(site, archive)
            payload = [archive]
        if args.part_size and len(payload) == 1 and payload[0].suffix in (".tar", ".xz"):
            manifest["archive"] = payload[0].name
            manifest["archive_sha256"] = sha256_of(payload)
            manifest["archive_bytes"] = payload[0].stat().st_size
            manifest["parts"] = split_file(payload[0], outdir, args.part_size)
            # One manifest, in the first part (identical copies would collide in `cp part-*/* DIR`).
            (outdir / "part-000" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        else:
            for f in payload:
                shutil.move(str(f), outdir / f.name)
            if args.form == "packed":
                manifest["archive"] = payload[0].name
                manifest["archive_sha256"] = sha256_of([outdir / payload[0].name])
                manifest["archive_bytes"] = (outdir / payload[0].name).stat().st_size
            (outdir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary(manifest, outdir)
    return manifest


def known_extras(lock) -> set[str]:
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project.get("optional-dependencies", {})) | {s for s in lock.sections if s not in ("torch", "base", "build")}


def build_requirements(lock) -> dict[str, str]:
    """The lock's build section plus slime's [build-system] requirements at the lock's versions: pip
    builds an editable install from a wheelhouse in an isolated environment that needs them (and
    their closure, which the build section lists) as wheels."""
    import tomllib
    reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    pins = lock.pins()
    out = dict(lock.sections["build"].pins) if "build" in lock.sections else {}
    for text in reqs:
        name = normalize(re.split(r"[<>=!~;\[ ]", text, 1)[0])
        if name not in pins:
            raise BundleError(f"{lock.path}: slime's build requirement {text!r} is not pinned (add it to the build section)")
        out[name] = pins[name]
    return out


def slim_site(site: Path) -> list[str]:
    """Drop what Python never loads from an installed tree and strip debug symbols from .so files
    over 5 MB (when ``strip`` exists). Returns the removed paths."""
    dropped = []
    for p in sorted(site.rglob("*")):
        rel = p.relative_to(site).as_posix()
        if p.is_file() and any(r.search(rel) for r in PACKED_DROP):
            p.unlink()
            dropped.append(rel)
    strip = shutil.which("strip")
    if strip:
        for p in site.rglob("*.so*"):
            if p.is_file() and not p.is_symlink() and p.stat().st_size > 5 * 2 ** 20:
                subprocess.run([strip, "--strip-debug", str(p)], capture_output=True)
    return dropped


def pack_xz(site: Path, archive: Path) -> None:
    """tar + xz -9 of ``site`` (xz's threads where the xz program exists, else Python's lzma)."""
    xz = shutil.which("xz")
    if xz:
        with open(archive, "wb") as out:
            tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
            comp = subprocess.run([xz, "-9", f"-T{os.cpu_count() or 1}", "-c"], stdin=tar.stdout, stdout=out)
            tar.stdout.close()
            if tar.wait() != 0 or comp.returncode != 0:
                raise BundleError(f"packing {site} failed")
    else:
        with tarfile.open(archive, "w:xz", preset=9) as tar:
            tar.add(site, arcname=".")


def summary(manifest: dict, outdir: Path) -> None:
    mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
    print(f"[bundle] {outdir}: {len(manifest['wheels'])} wheels, {mb(manifest['wheel_bytes'])} as wheels", end="")
    if manifest["form"] == "packed":
        print(f"; packed tree {mb(manifest['site_bytes'])} -> {mb(manifest['archive_bytes'])} xz", end="")
    if manifest.get("parts"):
        print(f"; {len(manifest['parts'])} parts: {', '.join(sorted(p.name for p in outdir.glob('part-*')))}", end="")
    print()
    for why, items in manifest["left_out"].items():
        print(f"[bundle] left out, {why}: {len(items)}")
    print(f"[bundle] on the node: SLIME_WHEELHOUSE=<folder with {'every part folder' + chr(39) + 's files' if manifest.get('parts') else 'these files'}>"
          f" bash examples/geo3k_vlm/run_geo3k_qwen35.sh")


# ----------------------------------------------------------------------------------------------
# prepare: on the node, turn SLIME_WHEELHOUSE into something pip or PYTHONPATH can use.

def _extract(archive_paths: list[Path], dest: Path) -> None:
    """Extract the tar (plain or xz) made of the concatenated ``archive_paths`` into ``dest``."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    joined = archive_paths[0]
    if len(archive_paths) > 1:
        joined = tmp / "joined"
        with open(joined, "wb") as out:
            for p in archive_paths:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
    target = tmp / "tree"
    with tarfile.open(joined) as tar:
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(target, **kwargs)
    shutil.rmtree(dest, ignore_errors=True)
    target.rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)


def prepare(folder: Path, site_dir: Path | None, python_version: str) -> dict[str, str]:
    """Check and unpack the wheelhouse in ``folder``; returns shell variables for setup_env.sh:
    SLIME_WH_FORM (wheels | packed), SLIME_WH_LINKS (a folder of wheels for --find-links) or
    SLIME_WH_SITE (the unpacked tree for PYTHONPATH), SLIME_WH_EXTRAS, SLIME_WH_SECTIONS.

    Raises BundleError when the folder is missing, holds no wheels and no manifest, misses parts
    (naming them), fails its sha256, or was built for another Python."""
    if not folder.is_dir():
        raise BundleError(f"SLIME_WHEELHOUSE={folder}: no such folder")
    mpath = folder / MANIFEST
    if not mpath.exists():
        if any(folder.glob("*.tar*.[0-9][0-9][0-9]")):
            raise BundleError(f"SLIME_WHEELHOUSE={folder} has parts but no {MANIFEST}: it travels in part-000, copy it too")
        if not any(folder.glob("*.whl")):
            raise BundleError(f"SLIME_WHEELHOUSE={folder}: no {MANIFEST} and no .whl files "
                              "(build one with scripts/offline_bundle.sh)")
        return {"SLIME_WH_FORM": "wheels", "SLIME_WH_LINKS": str(folder), "SLIME_WH_EXTRAS": "", "SLIME_WH_SECTIONS": ""}
    manifest = json.loads(mpath.read_text())
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{mpath}: format {manifest.get('format')}, this slime reads format {FORMAT}: rebuild it")
    if manifest["python"] != python_version:
        raise BundleError(f"{mpath}: built for Python {manifest['python']}, this python is {python_version} "
                          "(rebuild with --python-version, or run with that Python)")
    out = {"SLIME_WH_FORM": manifest["form"], "SLIME_WH_EXTRAS": ",".join(manifest["extras"]),
           "SLIME_WH_SECTIONS": ",".join(manifest["sections"])}
    sha = manifest.get("archive_sha256")
    tmp_root = Path(os.environ.get("TMPDIR", "/tmp"))
    if manifest.get("parts"):
        missing = [p for p in manifest["parts"] if not (folder / p).exists()]
        if missing:
            raise BundleError(f"SLIME_WHEELHOUSE={folder} has {len(manifest['parts']) - len(missing)} of "
                              f"{len(manifest['parts'])} parts; missing: {', '.join(missing)} "
                              "(copy every part folder's files into this folder)")
        archive = [folder / p for p in manifest["parts"]]
    elif manifest["form"] == "packed":
        archive = [folder / manifest["archive"]]
    else:
        return dict(out, SLIME_WH_LINKS=str(folder))
    dest = (site_dir if manifest["form"] == "packed" and site_dir else tmp_root / f"slime-wheelhouse-{sha[:12]}")
    stamp = dest / ".slime-wheelhouse-sha256"
    if not (stamp.exists() and stamp.read_text().strip() == sha):
        got = sha256_of(archive)
        if got != sha:
            raise BundleError(f"SLIME_WHEELHOUSE={folder}: sha256 of {manifest.get('archive')} is {got}, the manifest "
                              f"says {sha}: a part is damaged or from another build")
        print(f"[setup] unpacking {manifest['archive']} ({manifest['archive_bytes'] / 1e6:.1f} MB) into {dest}",
              file=sys.stderr, flush=True)
        _extract(archive, dest)
        stamp.write_text(sha + "\n")
    key = "SLIME_WH_SITE" if manifest["form"] == "packed" else "SLIME_WH_LINKS"
    return dict(out, **{key: str(dest)})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare"]:
        p = argparse.ArgumentParser(prog="offline_bundle.py prepare",
                                    description="check and unpack SLIME_WHEELHOUSE (used by scripts/setup_env.sh)")
        p.add_argument("folder", type=Path)
        p.add_argument("--site-dir", type=Path, default=None, help="where a packed tree is unpacked")
        args = p.parse_args(argv[1:])
        try:
            env = prepare(args.folder.resolve(), args.site_dir, f"{sys.version_info[0]}.{sys.version_info[1]}")
        except BundleError as err:
            print(f"[setup] {err}", file=sys.stderr)
            return 2
        print("\n".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
        return 0
    pip_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, pip_args = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="scripts/offline_bundle.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", help="output folder (created; must be empty unless --force)")
    parser.add_argument("--profile", default=str(ROOT / "requirements" / "gpu.txt"),
                        help="lock file (default: requirements/gpu.txt)")
    parser.add_argument("--extras", default="test,megatron,sglang",
                        help="slime extras the node will install (default: test,megatron,sglang, what set-up "
                             "installs on a GPU node); the wheelhouse records them and set-up installs exactly these")
    parser.add_argument("--python-version", default=None, help="target CPython X.Y (default: the lock's '#! python')")
    parser.add_argument("--platform", default="manylinux_2_34_x86_64",
                        help="target platform; manylinux_2_N_ARCH takes every manylinux wheel a glibc 2.N system accepts "
                             "(default manylinux_2_34_x86_64: SGLang 0.5.17's wheel needs glibc 2.34)")
    parser.add_argument("--no-torch", action="store_true",
                        help="leave out the torch section (the node's image ships torch 2.11.0 and its CUDA libraries)")
    parser.add_argument("--have", metavar="FREEZE", help="`pip freeze` of the target: leave out every pin it already has")
    parser.add_argument("--form", choices=("wheels", "packed"), default="wheels",
                        help="wheels (default; pip installs them) or packed (one pre-installed tree, xz)")
    parser.add_argument("--part-size", type=parse_size, default=None, metavar="SIZE",
                        help="split into folders part-000, part-001, ... of at most SIZE each (e.g. 45M)")
    parser.add_argument("--keep-fa3", action=argparse.BooleanOptionalAction, default=True,
                        help="keep sglang-kernel's FA3 and sm100 builds (default: SGLang then serves at its defaults, "
                        "FA3 attention and CUDA graphs); --no-keep-fa3 drops them (383 MB -> 25 MB of wheels) and "
                        "the servers need --sglang-attention-backend triton --sglang-mm-attention-backend triton_attn")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUTDIR")
    args = parser.parse_args(argv)
    args.pip_args = pip_args
    try:
        build(args)
    except (BundleError, LockError, OSError) as err:
        print(f"[bundle] {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
