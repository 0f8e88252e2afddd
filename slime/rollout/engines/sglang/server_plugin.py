"""slime's SGLang plugin: code that runs inside every process of the SGLang servers the engine starts.

SGLang loads *general plugins* (entry-point group ``sglang.srt.plugins``) in each of its processes; the engine makes
this module one for its own servers only, through a ``*.dist-info`` folder on the server's ``PYTHONPATH``
(:func:`slime.rollout.engines.sglang.launch.write_plugin_dist`).  :func:`register` applies, in every process: the
multimodal-RoPE fix where the SGLang release needs it (:func:`apply_rope_fix`), secrets out of the logs
(:func:`redact_server_args`), weight updates that have finished when they answer
(:func:`synchronize_after_tensor_update`), the multimodal embedding cache emptied with every flush
(:func:`clear_mm_embeddings_on_flush`), batched requests that finish before SGLang waits for them answered
(:func:`wait_with_state_taken_early`), fused experts in a few copies (:mod:`.expert_load`), and one JSON report
per process, which the engine checks (:func:`read_reports`).  Details: ``docs/design/sglang_engine.md``.  SGLang is
imported only inside functions, and so is :mod:`.expert_load` (torch): the server's launcher process
(``server_main``) and the engine read this module's names without paying for torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from slime.rollout.engines.sglang.versions import MROPE_FIX_TARGET, needs_mrope_fix

ENTRY_POINT_GROUP = "sglang.srt.plugins"
"""SGLang's entry-point group of general plugins."""
ENTRY_POINT_NAME = "slime_server_plugin"
"""This plugin's name (add it to ``SGLANG_PLUGINS`` when that allow-list is set)."""
ENTRY_POINT = f"{__name__}:register"

REPORT_DIR_ENV = "SLIME_SGLANG_REPORT_DIR"
"""Folder for the per-process reports (set by the engine)."""
MAIN_PID_ENV = "SLIME_SGLANG_MAIN_PID"
"""Pid of the server's main process (set by :mod:`.server_main` before SGLang starts its children)."""
MROPE_FIX_ENV = "SLIME_SGLANG_MROPE_FIX"
"""``0`` leaves the multimodal-RoPE bug in; anything else (default) applies the fix where needed."""

SPEC_WORKER_TARGET = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
"""SGLang 0.5.17's EAGLE worker (MTP drafting), whose ``update_weights_from_tensor`` the scheduler calls instead of
``BaseTpWorker``'s when speculative decoding is on (``scheduler_components/weight_updater.py``)."""

SCHEDULER_TARGET = "sglang.srt.managers.scheduler.Scheduler"
"""The scheduler, whose ``flush_cache`` (:func:`clear_mm_embeddings_on_flush`) every weight sync ends with."""
MM_EMBEDDING_MODULE = "sglang.srt.managers.mm_utils"
"""Where SGLang keeps its multimodal embedding cache (the module attribute ``embedding_cache``)."""
MM_FLUSH = {"state": "main process"}
"""This process's state of :func:`clear_mm_embeddings_on_flush`, in its report (``mm_embedding_flush``): ``"main
process"`` (runs no model), ``"pending"`` (until SGLang imports its scheduler module), ``"applied"``, ``"not found"``."""

TOKENIZER_MANAGER_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
"""The main process's request front end, whose ``_wait_one_response`` :func:`wait_with_state_taken_early` wraps."""
BATCH_WAIT = {"state": "pending"}
"""This process's state of :func:`wait_with_state_taken_early`, in its report (``batch_wait_fix``): ``"scheduler
process"`` (no front end), ``"pending"`` (until SGLang imports its tokenizer manager), ``"applied"``, ``"not needed"``
(the method already takes the state when called), ``"not found"``."""

FAST_EXPERT_LOAD_ENV = "SLIME_SGLANG_FAST_EXPERT_LOAD"
"""``0`` leaves fused expert tensors to SGLang's own per-expert loader (:mod:`.expert_load`); default on."""
FAST_EXPERT_LOAD_TARGETS = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
"""The classes of ``sglang.srt.models.qwen3_5`` whose ``load_weights`` :mod:`.expert_load` wraps."""

_MARK = "_slime_patched"


def register() -> None:
    """The entry point SGLang calls in each process (see the module docstring).

    Raises:
        SystemExit: the installed SGLang needs the multimodal-RoPE fix and it cannot be applied.
    """
    version = importlib.metadata.version("sglang")
    main = str(os.getpid()) == os.environ.get(MAIN_PID_ENV)
    if not needs_mrope_fix(version):
        state = "not needed"
    elif main:  # the HTTP server's process runs no model: the schedulers carry the fix
        state = "main process"
    elif os.environ.get(MROPE_FIX_ENV, "1") == "0":
        state = "disabled"
        print(f"[slime] WARNING: SGLang {version} has the Qwen3.5 multimodal-RoPE bug and {MROPE_FIX_ENV}=0 "
              "leaves it in: image tokens get wrong rotary positions", file=sys.stderr, flush=True)
    else:
        state = "pending"  # "applied" once SGLang imports the model module (arm_on_import)
    fast_experts = not main  # wrapped also when off: the report then times SGLang's own loading
    from slime.rollout.engines.sglang import expert_load

    if os.environ.get(FAST_EXPERT_LOAD_ENV, "1") == "0":
        expert_load.STATS.disabled = f"{FAST_EXPERT_LOAD_ENV}=0"
    redact_server_args(_import_attr("sglang.srt.server_args.ServerArgs"))
    worker = _import_attr("sglang.srt.managers.tp_worker.BaseTpWorker", missing_ok=True)
    if worker is not None:
        synchronize_after_tensor_update(worker)
    report = {"version": version, "state": state, "main": main}

    def save_report() -> None:
        _write_report(report["version"], report["state"], report["main"])

    MM_FLUSH["state"] = "main process" if main else "pending"
    BATCH_WAIT["state"] = "pending" if main else "scheduler process"
    if not main:  # before the first report: the scheduler module is imported already (the process's entry point)
        scheduler_module, _, scheduler_class = SCHEDULER_TARGET.rpartition(".")
        arm_on_import(scheduler_module, lambda module: _patch_scheduler(getattr(module, scheduler_class, None)))
    save_report()
    if main:  # the request front end lives in the main process, which imports it after loading the plugins

        def patch_manager(module) -> None:
            _patch_tokenizer_manager(getattr(module, TOKENIZER_MANAGER_TARGET.rpartition(".")[2], None))
            save_report()

        arm_on_import(TOKENIZER_MANAGER_TARGET.rpartition(".")[0], patch_manager)
    else:
        spec_module, _, spec_class = SPEC_WORKER_TARGET.rpartition(".")
        arm_on_import(spec_module, lambda module: getattr(module, spec_class, None) is not None
                      and synchronize_after_tensor_update(getattr(module, spec_class)))
    if state != "pending" and not fast_experts:
        return
    module_name, _, class_name = MROPE_FIX_TARGET.rpartition(".")

    def patch(module) -> None:
        if state == "pending":
            try:
                apply_rope_fix(getattr(module, class_name))
            except AttributeError as e:
                raise SystemExit(
                    f"[slime] SGLang {version} needs slime's multimodal-RoPE fix, but it cannot be applied to "
                    f"{MROPE_FIX_TARGET}: {e}. Use an SGLang release >= 0.5.19 (which has the fix) or 0.5.17"
                ) from e
            report["state"] = "applied"
            save_report()
        if fast_experts:
            for model_cls in FAST_EXPERT_LOAD_TARGETS:
                cls = getattr(module, model_cls, None)
                if cls is None or not hasattr(cls, "load_weights"):
                    print(f"[slime] fast expert load: {module_name}.{model_cls} not found; SGLang's loader "
                          "loads its experts", file=sys.stderr, flush=True)
                    continue
                expert_load.wrap_load_weights(cls, expert_load.STATS, on_load=save_report)  # the report gets the figures

    arm_on_import(module_name, patch)


class _PatchingLoader(importlib.abc.Loader):
    """Runs ``patch(module)`` right after ``loader`` has executed the module."""

    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A finder for one module name that hands out the real spec with a :class:`_PatchingLoader`."""

    def __init__(self, module_name: str, patch):
        self.module_name, self.patch = module_name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                sys.meta_path.remove(self)  # once
                spec.loader = _PatchingLoader(spec.loader, self.patch)
                return spec
        return None


def arm_on_import(module_name: str, patch) -> None:
    """Call ``patch(module)`` once ``module_name`` is imported: now if it is, else right after SGLang imports it (a
    ``sys.meta_path`` hook), so that the plugin imports no model code (which could touch a GPU too early)."""
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _PatchOnImport(module_name, patch))


def apply_rope_fix(layer_cls: type) -> None:
    """Route ``layer_cls.forward_prepare_cuda_fused(positions, hidden_states)`` to ``forward_prepare_native`` when
    ``positions.ndim == 2`` (M-RoPE ``[3, T]``), as SGLang >= 0.5.19 does; idempotent.

    Raises:
        AttributeError: ``layer_cls`` lacks either method (another SGLang layout).
    """
    fused = layer_cls.forward_prepare_cuda_fused
    layer_cls.forward_prepare_native  # noqa: B018 - AttributeError here, not at the first image request
    if getattr(fused, _MARK, False):
        return

    @functools.wraps(fused)
    def forward_prepare_cuda_fused(self, positions, hidden_states, *args, **kwargs):
        if positions.ndim == 2:
            return self.forward_prepare_native(positions, hidden_states, *args, **kwargs)
        return fused(self, positions, hidden_states, *args, **kwargs)

    setattr(forward_prepare_cuda_fused, _MARK, True)
    layer_cls.forward_prepare_cuda_fused = forward_prepare_cuda_fused


REDACTED = "'<redacted>'"
SECRET_FIELDS = ("api_key", "admin_api_key")


def redact_server_args(server_args_cls: type) -> None:
    """Make ``repr(ServerArgs)`` show :data:`SECRET_FIELDS` as ``'<redacted>'`` (idempotent)."""
    original = server_args_cls.__repr__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __repr__(self):
        text = original(self)
        for field in SECRET_FIELDS:
            value = getattr(self, field, None)
            if value:
                text = text.replace(repr(value), REDACTED)
        return text

    setattr(__repr__, _MARK, True)
    server_args_cls.__repr__ = __repr__


def synchronize_after_tensor_update(worker_cls: type) -> None:
    """After ``worker_cls.update_weights_from_tensor`` returns, wait for the worker's CUDA stream, so
    that the copies from the trainer's IPC buffers are done before SGLang answers (idempotent)."""
    original = worker_cls.update_weights_from_tensor
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def update_weights_from_tensor(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        import torch

        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        return result

    setattr(update_weights_from_tensor, _MARK, True)
    worker_cls.update_weights_from_tensor = update_weights_from_tensor


def clear_mm_embeddings_on_flush(scheduler_cls: type) -> None:
    """Make ``scheduler_cls.flush_cache`` also empty SGLang's multimodal embedding cache when the scheduler is idle
    (idempotent).

    SGLang (0.5.17 seen) keeps the vision tower's output per image hash in ``mm_utils.embedding_cache``
    (``SGLANG_VLM_CACHE_SIZE_MB``, 4 GiB by default) and its ``flush_cache`` resets the KV and radix caches but not
    that one (sgl-project/sglang PR #36468, open), so after a weight sync an image seen before is embedded with the old
    vision weights.  The H100 run of 2026-12-06 showed it: the colour task (6 images, every rollout) with the vision
    tower training failed the engine parity check after the first sync (image gap 2.42 trainer floors, text 0.61),
    and passed it with the tower frozen (0.57 / 0.60).  Every weight sync ends with ``flush_cache``
    (:meth:`slime.weight_sync.base.WeightTransport.end_sync`); the cache is emptied first, so that the flush's
    ``empty_cache`` also returns the embeddings' device memory (colocated trainers need it).
    """
    original = scheduler_cls.flush_cache
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def flush_cache(self, *args, **kwargs):
        if self.is_fully_idle():  # as the flush itself: requests in flight keep what they hold
            cache = getattr(sys.modules.get(MM_EMBEDDING_MODULE), "embedding_cache", None)
            if cache is not None:
                cache.clear()
        return original(self, *args, **kwargs)

    setattr(flush_cache, _MARK, True)
    scheduler_cls.flush_cache = flush_cache


def wait_with_state_taken_early(manager_cls: type) -> bool:
    """Make ``manager_cls._wait_one_response(obj, request)`` take the request's state when it is called, not when
    its generator first runs; returns False (nothing changed) where the method is not an async generator function
    (an SGLang that already does so).  Idempotent.

    SGLang 0.5.17's ``_wait_one_response`` is an async generator whose first line reads ``rid_to_state[obj.rid]``.
    A batched ``/generate`` makes one generator per request and runs them all only after the batch is sent, so a
    request that finishes in between (a one-token answer, or a prompt the radix cache serves) has had its state
    deleted by ``_handle_batch_output``, and the read raises ``KeyError``: SGLang answers the whole batch with HTTP
    500 (sgl-project/sglang PR #36638 fixes it upstream; seen four times in 20 rollouts of the colour task at real
    width, H100, 2026-12-06).  The wrapper reads the state at the call; if it is gone when the generator first runs,
    it is put back for the original's read and removed after the original's first answer, which that finished state
    already holds.  A request still running is passed through untouched.
    """
    import inspect

    original = manager_cls._wait_one_response
    if getattr(original, _MARK, False):
        return True
    if not inspect.isasyncgenfunction(original):
        return False

    @functools.wraps(original)
    def _wait_one_response(self, obj, request=None):
        state = self.rid_to_state.get(obj.rid)
        responses = original(self, obj, request)
        return responses if state is None else _restoring(self.rid_to_state, obj.rid, state, responses)

    setattr(_wait_one_response, _MARK, True)
    manager_cls._wait_one_response = _wait_one_response
    return True


async def _restoring(states: dict, rid: str, state, responses):
    """Yield what ``responses`` yields; ``states[rid] = state`` for its first read if ``rid`` left ``states`` before
    it ran, removed again at its first answer (or its end)."""
    restored = rid not in states
    if restored:
        states[rid] = state
    try:
        async for response in responses:
            if restored and states.get(rid) is state:
                del states[rid]
            restored = False
            yield response
    finally:
        if restored and states.get(rid) is state:
            del states[rid]
        await responses.aclose()


def _patch_tokenizer_manager(manager_cls: type | None) -> None:
    if manager_cls is None or not hasattr(manager_cls, "_wait_one_response"):
        BATCH_WAIT["state"] = "not found"
        print(f"[slime] WARNING: {TOKENIZER_MANAGER_TARGET}._wait_one_response not found: a batched /generate whose "
              "request finishes before SGLang waits for it may fail (HTTP 500; slime resends it)",
              file=sys.stderr, flush=True)
        return
    BATCH_WAIT["state"] = "applied" if wait_with_state_taken_early(manager_cls) else "not needed"


def _patch_scheduler(scheduler_cls: type | None) -> None:
    if scheduler_cls is None or not hasattr(scheduler_cls, "flush_cache"):
        MM_FLUSH["state"] = "not found"  # the engine warns, naming the server log
        print(f"[slime] WARNING: {SCHEDULER_TARGET}.flush_cache not found: SGLang's multimodal embedding cache may "
              "outlive weight syncs (vision tower outputs of old weights)", file=sys.stderr, flush=True)
        return
    clear_mm_embeddings_on_flush(scheduler_cls)
    MM_FLUSH["state"] = "applied"


def _import_attr(path: str, missing_ok: bool = False):
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        if missing_ok:
            return None
        raise


def _write_report(version: str, state: str, main: bool) -> None:
    from slime.rollout.engines.sglang import expert_load

    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return
    try:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

        memory_tags = list(GPU_MEMORY_ALL_TYPES)
    except ImportError:
        memory_tags = None
    report = {
        "pid": os.getpid(),
        "main": main,
        "sglang": version,
        "mrope_fix": state,
        "mm_embedding_flush": MM_FLUSH["state"],
        "batch_wait_fix": BATCH_WAIT["state"],
        "memory_tags": memory_tags,
        "expert_load": expert_load.STATS.as_dict(),
    }
    path = Path(folder) / f"{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)


def read_reports(folder: str | os.PathLike) -> list[dict]:
    """The reports of :func:`register` in ``folder``, one per SGLang process that loaded the plugin
    (unreadable files skipped), sorted by pid."""
    reports = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(reports, key=lambda r: r.get("pid", 0))
