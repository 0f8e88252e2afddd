"""Run a function on N fresh processes that form one ``torch.distributed`` group, for the tests and benchmarks.

Every multi-process test goes through :func:`spawn_ranks`, which removes two sources of flakes:

- **No TCP port.** The ranks meet through a ``FileStore`` in a fresh temporary folder, so no
  port is picked, freed and then bound by someone else (another test run on the machine, a
  Ray worker, any outgoing connection), and no rank can join a foreign rendezvous.
- **No interpreter shutdown with gloo threads alive.** A rank that has finished waits for its
  peers (barrier), destroys the process group, flushes its output and leaves with
  ``os._exit``.  The reason: with FSDP2 / DTensor, ``destroy_process_group()`` does not free
  the gloo process group (DTensor's sharding caches keep the device mesh, and with it the
  group, alive), so its ``pt_gloo_runloop`` threads live on.  A worker thread that drops the
  last reference to a tensor the Python side has already let go must take the GIL; if the
  interpreter starts finalising while it waits for it, CPython 3.11 ends the thread with
  ``pthread_exit``, whose forced unwind through a ``noexcept`` C++ destructor calls
  ``std::terminate``: "terminate called without an active exception", SIGABRT, and the
  test fails although every rank did its work (``tests/test_fsdp_backend.py``,
  ``[per-sample,mbs1]``, in a full suite run on a loaded 2-core machine).
  ``os._exit`` never finalises the interpreter, so no thread can be caught that way.

A rank that raises still reports its traceback through ``torch.multiprocessing`` (the parent
re-raises it as ``ProcessRaisedException``); its peers are then terminated by the parent.

**CPU ranks come from a fork server** (the standard library's ``forkserver`` start method) that has imported
:data:`PRELOAD` once: a spawned interpreter spends about 7 s of CPU importing torch, transformers and slime's
backends before its first line of work, and a 2-core machine pays that twice for every test that spawns ranks.  Each
rank is a fork of the server (which has run no torch operation, so no thread pool is copied), given the parent's
current environment (the server's is that of its start; multiprocessing sets the working directory).  CUDA ranks
are spawned as before.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime.utils.forkserver import forkserver_context

GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective may wait for a peer before the group raises (generous: loaded CI machines)."""
PRELOAD = ("torch", "torch.distributed", "transformers", "slime.backends.fsdp.backend",
           "slime.backends.megatron.backend")
"""Modules the CPU ranks' fork server imports once (a missing optional one, megatron-core, is skipped)."""


def spawn_ranks(fn, *args, world_size: int = 2, device: str = "cpu") -> None:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned processes joined in one process group.

    The default group exists when ``fn`` starts: gloo for ``device="cpu"``, NCCL for CUDA
    tensors plus gloo for CPU tensors with ``device="cuda"`` (each rank then uses GPU
    ``rank``).  ``fn`` and ``args`` must be picklable (module-level functions).  Each rank
    runs torch with one intra-op thread.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is in the message).
        torch.multiprocessing.ProcessExitedException: a rank died (signal or exit code).
    """
    store_dir = tempfile.mkdtemp(prefix="slime-test-rendezvous-")
    if device == "cpu":
        forkserver_context(PRELOAD)  # counts only before the server starts: tests/conftest.py adds it at start-up
    try:
        mp.start_processes(
            _rank_main,
            args=(fn, world_size, os.path.join(store_dir, "store"), device, args, dict(os.environ)),
            nprocs=world_size,
            join=True,
            start_method="forkserver" if device == "cpu" else "spawn",
        )
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def _rank_main(rank: int, fn, world_size: int, store_path: str, device: str, args: tuple,
               environ: dict[str, str]) -> None:
    os.environ.clear()  # a forked rank has the fork server's environment (multiprocessing sets the working directory)
    os.environ.update(environ)
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend="cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
        store=dist.FileStore(store_path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=GROUP_TIMEOUT,
    )
    try:
        fn(rank, *args)
        dist.barrier()  # nobody closes its connections while a peer still talks to it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Only reached on success (an exception goes to torch.multiprocessing, which records it).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
