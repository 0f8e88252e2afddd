"""The SGLang engine on CPU: command line, environment, plugin discovery, the HTTP client against a fake
SGLang 0.5.17 server (:mod:`scripts.harness.fake_sglang_server`), the per-run key, memory tags, pause/flush, a server
that dies and restarts, recording and replay, and the version gate of the multimodal-RoPE fix.

Expected outputs of the fake's ``echo`` model are worked out by hand from its rules (its module docstring):
``1 + words % 5`` tokens ``10, 11, ...`` with log-probs ``-(k + 1) / 10 - (sum of pushed weights)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from slime.rollout.engines.base import EngineUnavailableError, GenerateRequest, SamplingParams
from slime.rollout.engines.sglang import server_plugin
from slime.rollout.engines.sglang.client import SGLangAuthError, SGLangClient, SGLangRequestError
from slime.rollout.engines.sglang.generation import generate_payload, parse_generate_response
from slime.rollout.engines.sglang.launch import (
    LOCALHOST,
    GPUStartLock,
    ServerProcess,
    ServerSpec,
    server_command,
    server_env,
    server_host,
    write_plugin_dist,
)
from slime.rollout.engines.sglang.versions import memory_tags_supported, needs_mrope_fix, release_tuple
from slime.utils.config import ConfigError
from scripts.harness.fake_sglang import FakeSGLangEngine
from tests.process_tree import all_processes, is_alive, read_proc, wait_for, wait_session_gone

REPO = Path(__file__).resolve().parents[1]
START_S = 180.0
"""Limit for a fake server to come up (a new Python process importing torch, slow under load)."""
IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def _free_port() -> int:
    from slime.ray.placement import free_port

    return free_port()


def _spec(tmp_path, *passthrough: str, tp: int = 1, colocated: bool = False) -> ServerSpec:
    return ServerSpec(model_path=str(tmp_path / "model"), tp_size=tp, host=LOCALHOST, port=_free_port(), seed=7,
                      colocated=colocated, passthrough=tuple(passthrough))


def _wait_healthy(engine, timeout_s: float = START_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not engine.health():
        assert time.monotonic() < deadline, f"fake server not healthy in {timeout_s} s:\n{engine.log_tail()}"
        time.sleep(0.2)


@pytest.fixture
def engine_factory(tmp_path):
    engines = []

    def make(*passthrough: str, tp: int = 1, colocated: bool = False, capacity: int = 8):
        engine = FakeSGLangEngine(_spec(tmp_path, *passthrough, tp=tp, colocated=colocated),
                                  tmp_path / f"engine-{len(engines)}", capacity=capacity)
        engines.append(engine)
        _wait_healthy(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def _params(max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)


def _echo(words: int, images: int, max_new: int = 8, shift: float = 0.0):
    """The fake echo model's answer, by its rules: (token ids, log-probs, finish reason, prompt tokens)."""
    n = min(max_new, 1 + words % 5)
    return [10 + k for k in range(n)], [-(k + 1) / 10 - shift for k in range(n)], \
        ("length" if n == max_new else "stop"), words + 4 * images


# ----------------------------------------------------------------------------- command line and environment


def test_server_command_has_slimes_flags_then_the_passthrough_and_no_secret(tmp_path):
    spec = ServerSpec(model_path="/ckpt", tp_size=2, host="127.0.0.1", port=31000, seed=43, colocated=True,
                      passthrough=("--mem-fraction-static", "0.7", "--cuda-graph-bs", "1", "2"))
    command = server_command(spec, python="/py")
    assert command == [
        "/py", "-m", "slime.rollout.engines.sglang.server_main", "--model-path", "/ckpt", "--tp-size", "2",
        "--base-gpu-id", "0", "--host", "127.0.0.1", "--port", "31000", "--random-seed", "43",
        "--enable-memory-saver", "--dtype", "bfloat16", "--mem-fraction-static", "0.7", "--cuda-graph-bs", "1", "2",
    ]  # fmt: skip
    not_colocated = server_command(dataclasses.replace(spec, colocated=False), python="/py")
    assert "--enable-memory-saver" not in not_colocated
    # a --dtype of the user's (--sglang-dtype) replaces the bfloat16 default, in either spelling
    for given in (("--dtype", "float16"), ("--dtype=float16",)):
        command_with_dtype = server_command(dataclasses.replace(spec, passthrough=given), python="/py")
        assert "bfloat16" not in command_with_dtype and command_with_dtype[-len(given):] == list(given)
    assert not any("key" in token for token in command)
    assert spec.url == "http://127.0.0.1:31000"


_STAND_IN_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/plugins.py": "def load_plugins():\n    pass\n",
    "sglang/srt/utils.py": "def kill_process_tree(pid, include_parent=True):\n    pass\n",
    # SGLang 0.5.17's parsing: argparse with --api-key / --admin-api-key taking one value each, and the fields
    # server_main's last guard reads (their names and defaults as in 0.5.17's ServerArgs)
    "sglang/srt/server_args.py": (
        "import argparse\n"
        "def prepare_server_args(argv):\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--model-path')\n"
        "    parser.add_argument('--host', default='127.0.0.1')\n"
        "    parser.add_argument('--api-key', type=str, default=None)\n"
        "    parser.add_argument('--admin-api-key', type=str, default=None)\n"
        "    parser.add_argument('--grpc-port', type=int, default=None)\n"
        "    parser.add_argument('--grpc-mode', action='store_true')\n"
        "    parser.add_argument('--smg-grpc-mode', action='store_true')\n"
        "    parser.add_argument('--tokenizer-worker-num', type=int, default=1)\n"
        "    parser.add_argument('--crash-dump-folder', default=None)\n"
        "    return parser.parse_args(argv)\n"
    ),
    "sglang/launch_server.py": (
        "import os, sys\n"
        "def run_server(args):\n"
        "    secret = open(os.environ['PROBE_SECRET_FILE']).read()\n"
        "    cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "    environ = open('/proc/self/environ', 'rb').read().decode()\n"
        "    print('keys', args.api_key == secret, args.admin_api_key == secret)\n"
        "    print('in argv', secret in ' '.join(sys.argv) or secret in cmdline, 'in env', secret in environ)\n"
    ),
}


@pytest.mark.parametrize("secret", ["-starts-with-a-dash", "plain_Secret-9"])
def test_the_server_hands_any_secret_to_sglangs_parser_and_never_to_its_argv(tmp_path, secret):
    """server_main against a stand-in of SGLang's modules (argparse as SGLang's): a token_urlsafe secret may
    start with "-", which argparse would take for an option if it were a separate value."""
    for name, text in _STAND_IN_SGLANG.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "secret").write_text(secret)  # for the check; not in the environment (nor pytest's test id)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), PROBE_SECRET_FILE=str(tmp_path / "secret"))
    done = subprocess.run([sys.executable, "-m", "slime.rollout.engines.sglang.server_main", "--model-path", "/m",
                           "--host", "127.0.0.1"],
                          input=secret + "\n", env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["keys True True", "in argv False in env False"]


def _stand_in_server(tmp_path, secret: str, *flags: str, extra_env: dict | None = None):
    """server_main against :data:`_STAND_IN_SGLANG` with slime's ``--host 127.0.0.1`` and then ``flags``."""
    for name, text in _STAND_IN_SGLANG.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "secret").write_text(secret)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), PROBE_SECRET_FILE=str(tmp_path / "secret"),
               **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "slime.rollout.engines.sglang.server_main", "--model-path", "/m",
                           "--host", "127.0.0.1", *flags], input=secret + "\n", env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("secret, flags, extra_env, named", [
    ("s3cret", ["--tokenizer-worker-num", "4"], None, "tokenizer_worker_num=4"),
    ("s3cret", ["--grpc-port", "30001"], None, "grpc_port=30001"),
    ("s3cret", ["--grpc-mode"], None, "grpc_mode is set"),
    ("s3cret", ["--smg-grpc-mode"], None, "smg_grpc_mode is set"),
    ("s3cret", ["--host", "0.0.0.0"], None, "host='0.0.0.0', not the '127.0.0.1' slime gave"),
    ("s3cret", ["--crash-dump-folder", "/tmp/d"], None, "crash_dump_folder='/tmp/d'"),
    ("s3cret", [], {"SGLANG_RUST_SERVER": "True"}, "SGLANG_RUST_SERVER is set"),
    ("", [], None, "no secret on standard input"),
])  # fmt: skip
def test_the_server_refuses_to_serve_with_resolved_arguments_that_skip_the_key(tmp_path, secret, flags, extra_env,
                                                                               named):
    """The last guard of server_main, on what SGLang's parser resolved (any route: here flags that slipped past
    the parse-time checks): exit code 2, the setting named, run_server never called."""
    done = _stand_in_server(tmp_path, secret, *flags, extra_env=extra_env)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "slime refuses to start this SGLang server" in done.stderr and named in done.stderr
    assert "keys" not in done.stdout  # run_server never ran
    assert not secret or secret not in done.stderr


def test_the_servers_last_guard_checks_each_field_of_sglangs_server_args():
    from slime.rollout.engines.sglang.server_main import UnsafeServerArgs, check_server_args, given_value

    safe = dict(grpc_port=None, grpc_mode=False, smg_grpc_mode=False, tokenizer_worker_num=1, host="10.0.0.5",
                api_key="k", admin_api_key="k", crash_dump_folder=None)
    check_server_args(types.SimpleNamespace(**safe), "10.0.0.5", "k", environ={})
    for field, bad in [("grpc_port", 9), ("grpc_mode", True), ("smg_grpc_mode", True), ("tokenizer_worker_num", 2),
                       ("host", "0.0.0.0"), ("api_key", "other"), ("admin_api_key", None),
                       ("crash_dump_folder", "/d")]:
        with pytest.raises(UnsafeServerArgs, match=field):
            check_server_args(types.SimpleNamespace(**{**safe, field: bad}), "10.0.0.5", "k", environ={})
    with pytest.raises(UnsafeServerArgs, match="SGLANG_RUST_SERVER"):
        check_server_args(types.SimpleNamespace(**safe), "10.0.0.5", "k", environ={"SGLANG_RUST_SERVER": "1"})
    check_server_args(types.SimpleNamespace(**safe), "10.0.0.5", "k", environ={"SGLANG_RUST_SERVER": "false"})
    with pytest.raises(UnsafeServerArgs, match="host"):  # no --host from slime: nothing to compare with
        check_server_args(types.SimpleNamespace(**safe), None, "k", environ={})
    assert given_value(["--host", "a", "--host", "b"], "--host") == "a"  # slime's own, first
    assert given_value(["--port", "1", "--host=h"], "--host") == "h" and given_value([], "--host") is None


_TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1,
               "vocab_size": 256, "max_position_embeddings": 128, "torch_dtype": "float32"}


def test_the_last_guard_refuses_sglangs_real_server_args_from_a_config_file(tmp_path):
    """SGLang 0.5.17's own prepare_server_args (ConfigArgumentMerger for --config, ServerArgs.__post_init__ on
    CPU): settings a config file gives reach ServerArgs past slime's flag checks, and the guard refuses them.
    Runs where SGLang is installed (e.g. /tmp/sgl-venv); skips elsewhere."""
    pytest.importorskip("sglang.srt.server_args")
    from sglang.srt.server_args import prepare_server_args

    from slime.rollout.engines.sglang.server_main import UnsafeServerArgs, check_server_args

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(_TINY_LLAMA))

    def resolved(config_text: str | None):
        argv = ["--model-path", str(tmp_path / "model"), "--host", "127.0.0.1", "--device", "cpu",
                "--api-key=k", "--admin-api-key=k"]
        if config_text is not None:
            (tmp_path / "sglang.yaml").write_text(config_text)
            argv += ["--config", str(tmp_path / "sglang.yaml")]
        return prepare_server_args(argv)

    check_server_args(resolved(None), "127.0.0.1", "k", environ={})  # slime's own command passes
    for text, named in [("tokenizer-worker-num: 4\n", "tokenizer_worker_num=4"),
                        ("smg-grpc-mode: true\n", "smg_grpc_mode is set"),
                        ("grpc-mode: true\n", "grpc_mode is set"),
                        ("crash-dump-folder: /tmp/dumps\n", "crash_dump_folder='/tmp/dumps'")]:
        server_args = resolved(text)
        with pytest.raises(UnsafeServerArgs, match=named):
            check_server_args(server_args, "127.0.0.1", "k", environ={})
    check_server_args(resolved("host: 0.0.0.0\n"), "127.0.0.1", "k", environ={})  # the command line wins over a file


def test_gpu_start_locks_serialise_engines_sharing_a_gpu_and_not_others(tmp_path):
    import threading

    first = GPUStartLock(["1", "0"], tmp_path)
    taken = {}

    def take(name, gpus):
        taken[name] = GPUStartLock(gpus, tmp_path)

    waiting = threading.Thread(target=take, args=("shares gpu 0", ["0"]))
    waiting.start()
    other = threading.Thread(target=take, args=("gpu 2", ["2"]))
    other.start()
    other.join(10)
    assert "gpu 2" in taken  # another GPU: no wait
    waiting.join(0.5)
    assert waiting.is_alive() and "shares gpu 0" not in taken  # blocked while the first start holds GPU 0
    first.release()
    first.release()  # idempotent
    waiting.join(10)
    assert taken["shares gpu 0"].held and not first.held
    assert not GPUStartLock([], tmp_path).held


def _lock_is_free(path):
    import fcntl

    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_a_gpu_start_lock_that_fails_part_way_holds_nothing(tmp_path):
    (tmp_path / "slime-sglang-start-gpu1.lock").mkdir()  # GPU 1's file cannot be opened as a file
    with pytest.raises(IsADirectoryError):
        GPUStartLock(["0", "1"], tmp_path)
    assert _lock_is_free(tmp_path / "slime-sglang-start-gpu0.lock")  # GPU 0's lock, taken first, was dropped


def test_gpu_start_lock_files_are_shared_by_every_user_of_the_node(tmp_path, monkeypatch):
    import stat

    old = os.umask(0o077)
    try:
        lock = GPUStartLock(["0"], tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "slime-sglang-start-gpu0.lock").stat().st_mode) == 0o666  # not the umask's 0600
    lock.release()
    # another user's file in a sticky /tmp: O_CREAT refused (fs.protected_regular), read-only is enough to flock
    real_open = os.open
    modes = []

    def foreign_open(path, flags, *args):
        modes.append(flags & (os.O_CREAT | os.O_RDWR | os.O_RDONLY | os.O_WRONLY))
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", foreign_open)
    lock = GPUStartLock(["0"], tmp_path)
    assert lock.held and modes == [os.O_RDWR | os.O_CREAT, os.O_RDONLY]
    assert not _lock_is_free(tmp_path / "slime-sglang-start-gpu0.lock")
    lock.release()
    assert _lock_is_free(tmp_path / "slime-sglang-start-gpu0.lock")
    monkeypatch.setattr(os, "open", lambda path, flags, *a: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.raises(PermissionError, match="cannot open the SGLang start lock .*gpu0.lock.*chmod a\\+r"):
        GPUStartLock(["0"], tmp_path)


def test_a_gpu_start_lock_that_is_a_symbolic_link_is_not_followed(tmp_path):
    """In a folder every user writes (/tmp), another user's link must not make slime create a file, or make one
    world-writable, wherever the link points."""
    import errno
    import stat

    target = tmp_path / "victim"
    (tmp_path / "slime-sglang-start-gpu0.lock").symlink_to(target)  # dangling: O_CREAT would create the target
    with pytest.raises(OSError, match="start lock .*gpu0.lock is a symbolic link") as refused:
        GPUStartLock(["0"], tmp_path)
    assert refused.value.errno == errno.ELOOP and not target.exists()
    target.write_text("mine")
    target.chmod(0o600)
    with pytest.raises(OSError, match="symbolic link"):
        GPUStartLock(["0"], tmp_path)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # not made world-writable


def test_a_second_engine_on_the_same_gpu_starts_its_server_once_the_first_is_healthy(tmp_path, monkeypatch):
    """SGLang sizes its caches from the memory free around its model load; two servers measuring at once
    on one GPU both see the other's allocations (a negative budget on the H200), so they start in turn."""
    import tempfile
    import threading

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = FakeSGLangEngine(_spec(tmp_path), tmp_path / "engine-0", capacity=4, gpu_ids=["0"])
    engines = {}
    second = threading.Thread(target=lambda: engines.setdefault(
        "second", FakeSGLangEngine(_spec(tmp_path), tmp_path / "engine-1", capacity=4, gpu_ids=["0"])))
    try:
        second.start()
        second.join(0.3)
        assert second.is_alive() and not list((tmp_path / "engine-1").glob("start-*/server.log"))
        second.join(30)  # nobody polls the first engine: its own watcher drops the lock once /health answers
        assert first.client.healthy()
        assert not second.is_alive()
        _wait_healthy(engines["second"])
    finally:
        first.shutdown()
        second.join(30)
        if "second" in engines:
            engines["second"].shutdown()


def test_servers_bind_loopback_on_one_node_and_the_node_address_across_nodes():
    assert server_host("10.0.0.5", 1) == "127.0.0.1"
    assert server_host("10.0.0.5", 3) == "10.0.0.5"
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="node's own address"):
            server_host(wildcard, 2)


def test_server_env_puts_the_plugin_first_and_turns_health_generation_off(tmp_path):
    base = {"PYTHONPATH": "/a:/b", "SLIME_SGLANG_PYTHONPATH": "/bundle", "SGLANG_PLUGINS": "other", "X": "1",
            "OMP_NUM_THREADS": "1"}
    env = server_env(base, tmp_path / "plugin", tmp_path / "reports")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "plugin"), "/bundle", str(REPO), "/a", "/b"]
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert env["SGLANG_PLUGINS"] == "other,slime_server_plugin"
    assert env["SLIME_SGLANG_REPORT_DIR"] == str(tmp_path / "reports") and env["X"] == "1"
    assert "SGLANG_PLUGINS" not in server_env({}, tmp_path, tmp_path)  # no allow-list: every plugin loads
    assert "OMP_NUM_THREADS" not in env  # Ray's actor value is not the server's
    assert server_env({"SLIME_SGLANG_OMP_NUM_THREADS": "8"}, tmp_path, tmp_path)["OMP_NUM_THREADS"] == "8"


def test_server_env_drops_the_variables_that_open_listeners_without_the_key(tmp_path, caplog):
    """SGLang 0.5.17 starts its native gRPC listener (no key check) from SGLANG_GRPC_PORT and replaces its HTTP
    server from SGLANG_RUST_SERVER; it renames the deprecated SGL_ spellings to SGLANG_ at import."""
    base = {"SGLANG_GRPC_PORT": "30001", "SGL_GRPC_PORT": "30002", "SGLANG_RUST_SERVER": "1",
            "SGL_RUST_SERVER": "true", "SGLANG_LOG_LEVEL": "info"}
    with caplog.at_level("WARNING", logger="slime.rollout.engines.sglang.launch"):
        env = server_env(base, tmp_path / "plugin", tmp_path / "reports")
    assert not {"SGLANG_GRPC_PORT", "SGL_GRPC_PORT", "SGLANG_RUST_SERVER", "SGL_RUST_SERVER"} & set(env)
    assert env["SGLANG_LOG_LEVEL"] == "info"  # the others pass
    warned = " | ".join(r.getMessage() for r in caplog.records)
    for name in ("SGLANG_GRPC_PORT", "SGL_GRPC_PORT", "SGLANG_RUST_SERVER", "SGL_RUST_SERVER"):
        assert f"does not inherit {name}: " in warned
    assert "skips the API-key check" in warned


def test_the_plugin_dist_makes_an_sglang_entry_point_for_processes_with_it_on_the_path(tmp_path):
    folder = write_plugin_dist(tmp_path / "plugin")
    probe = ("import importlib.metadata as m; "
             "print([(e.name, e.value) for e in m.entry_points(group='sglang.srt.plugins')])")
    found = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(folder)},
                           capture_output=True, text=True, check=True).stdout
    assert "('slime_server_plugin', 'slime.rollout.engines.sglang.server_plugin:register')" in found
    alone = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": ""},
                           capture_output=True, text=True, check=True).stdout
    assert "slime_server_plugin" not in alone  # nothing installed: only processes with the folder see it


# ----------------------------------------------------------------------------- requests and responses


def test_generate_payload_is_text_plus_base64_images_never_input_ids():
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, stop=["</s>"])
    payload = generate_payload(GenerateRequest("<|vision_start|><|image_pad|><|vision_end|>x", [IMAGE], params))
    assert payload == {
        "text": "<|vision_start|><|image_pad|><|vision_end|>x", "image_data": [IMAGE], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "top_k": -1, "stop": ["</s>"],
                            "no_stop_trim": True},
    }  # fmt: skip
    assert "image_data" not in generate_payload(GenerateRequest("text only", [], params))


def test_parse_generate_response_reads_meta_info_and_refuses_inconsistent_answers():
    body = {"text": "ab", "output_ids": [5, 6], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 11,
        "output_token_logprobs": [[-0.5, 5, None], [-1.25, 6, None]]}}
    out = parse_generate_response(body)
    assert (out.text, out.output_ids, out.output_log_probs, out.finish_reason, out.prompt_tokens) == (
        "ab", [5, 6], [-0.5, -1.25], "length", 11)
    with pytest.raises(SGLangRequestError, match="2 output tokens"):
        parse_generate_response({**body, "meta_info": {**body["meta_info"], "output_token_logprobs": [[-0.5, 5, None]]}})
    with pytest.raises(SGLangRequestError, match="unknown finish_reason"):
        parse_generate_response({**body, "meta_info": {**body["meta_info"], "finish_reason": {"type": "oops"}}})
    with pytest.raises(SGLangRequestError, match="return_logprob"):
        parse_generate_response({"text": "", "output_ids": [], "meta_info": {"prompt_tokens": 1}}, rid="r1")


def test_engine_generates_text_and_image_prompts_through_the_fake_server(engine_factory, tmp_path):
    engine = engine_factory("--fake-startup-s", "1")
    record = tmp_path / "exchanges.jsonl"
    engine.client.record = record
    requests = [GenerateRequest("one two three", [], _params(), rid="t"),
                GenerateRequest("an image of a triangle with sides", [IMAGE], _params(3), rid="i")]
    outputs = [engine.generate([r])[0] for r in requests]
    for out, (words, images, max_new) in zip(outputs, [(3, 0, 8), (7, 1, 3)]):
        ids, logprobs, finish, prompt_tokens = _echo(words, images, max_new)
        assert out.output_ids == ids and out.finish_reason == finish and out.prompt_tokens == prompt_tokens
        assert out.rid == {3: "t", 7: "i"}[words]  # meta_info.id names the request
        assert out.output_log_probs == pytest.approx(logprobs)
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["endpoint"] for r in sent] == ["/generate", "/generate"]
    assert sent[1]["request"]["image_data"] == [IMAGE] and "input_ids" not in sent[1]["request"]
    assert sent[1]["request"]["rid"].startswith("i#attempt-")  # unique per attempt, names the request
    assert engine.version == "0.5.17" and engine.memory_tags == ("weights", "kv_cache", "cuda_graph")
    assert engine.capacity == 8 and engine.max_requests_per_call == 8  # min(--sglang-requests-per-call 32, capacity)


def test_several_requests_go_in_one_batched_generate_call(engine_factory, tmp_path):
    """SGLang's batch form: one ``/generate`` with list fields (``[]`` images for a text prompt), answered in
    request order with the same outputs as single calls (the echo model's rules, computed here)."""
    engine = engine_factory()
    record = tmp_path / "exchanges.jsonl"
    engine.client.record = record
    requests = [GenerateRequest("one two three", [], _params(), rid="t"),
                GenerateRequest("an image of a triangle with sides", [IMAGE], _params(3), rid="i"),
                GenerateRequest("four words and images", [IMAGE, IMAGE], _params(), rid=None)]
    outputs = engine.generate(requests)
    for out, (words, images, max_new), rid in zip(outputs, [(3, 0, 8), (7, 1, 3), (4, 2, 8)], ["t", "i", None]):
        ids, logprobs, finish, prompt_tokens = _echo(words, images, max_new)
        assert (out.output_ids, out.finish_reason, out.prompt_tokens, out.rid) == (ids, finish, prompt_tokens, rid)
        assert out.output_log_probs == pytest.approx(logprobs)
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(sent) == 1 and sent[0]["endpoint"] == "/generate"
    body = sent[0]["request"]
    assert body["text"] == [r.text for r in requests] and body["image_data"] == [[], [IMAGE], [IMAGE, IMAGE]]
    assert [p["max_new_tokens"] for p in body["sampling_params"]] == [8, 3, 8] and body["return_logprob"] is True
    assert body["rid"][0].startswith("t#attempt-") and body["rid"][1].startswith("i#attempt-")
    assert len(set(body["rid"])) == 3 and "#attempt-" not in body["rid"][2]
    text_only = [GenerateRequest("a b", [], _params(), rid="x"), GenerateRequest("c", [], _params(), rid="y")]
    engine.generate(text_only)
    assert "image_data" not in json.loads(record.read_text().splitlines()[-1])["request"]


def test_a_batch_answered_with_another_number_of_outputs_is_refused(engine_factory, monkeypatch):
    engine = engine_factory()
    one = engine.client.generate({"text": "a b", "sampling_params": _params().to_sglang(), "return_logprob": True})
    monkeypatch.setattr(engine.client, "generate", lambda payload: [one])
    with pytest.raises(SGLangRequestError, match="a batch of 2 requests with 1 outputs"):
        engine.generate([GenerateRequest("a b", [], _params()), GenerateRequest("c d", [], _params())])


def _generate_http_calls(engine) -> int:
    return engine.client.server_info()["generate_http_calls"]


def test_a_refused_prompt_in_a_batch_is_named_and_the_others_complete_alone(engine_factory, tmp_path, caplog):
    """SGLang 0.5.17 refuses a batch with one prompt over ``--context-length`` as a whole (400, naming no request);
    the engine sends the batch's requests again one per call: the good ones complete (their answers are the echo
    model's, worked out here), and the error names the first refused rid with SGLang's reason."""
    engine = engine_factory("--context-length", "6")
    requests = [GenerateRequest("one two", [], _params(3), rid="r0"),  # 2 + 3 tokens <= 6
                GenerateRequest("a b c d e f g", [], _params(3), rid="r1"),  # 7 prompt tokens >= 6
                GenerateRequest("one", [IMAGE], _params(1), rid="r2"),  # 1 + 4 prompt tokens, + 1 = 6
                GenerateRequest("x y z", [], _params(4), rid="r3")]  # 3 + 4 = 7 > 6
    before = _generate_http_calls(engine)
    record = tmp_path / "exchanges.jsonl"
    engine.client.record = record
    with caplog.at_level("WARNING", logger="slime.rollout.engines.sglang.generation"), \
            pytest.raises(SGLangRequestError) as refused:
        engine.generate(requests)
    message = str(refused.value)
    assert message.startswith("SGLang refused request rid 'r1':") and refused.value.status == 400
    assert "The input (7 tokens) is longer than the model's context length (6 tokens)." in message
    assert "2 of a batch of 4 requests failed when sent alone: rid 'r1', rid 'r3'" in message
    assert "refused a batched /generate of 4 requests" in caplog.text and "one request per call" in caplog.text
    assert _generate_http_calls(engine) - before == 1 + 4  # the batch, then one call per request
    exchanges = [x for x in map(json.loads, record.read_text().splitlines()) if x["endpoint"] == "/generate"]
    assert [isinstance(x["request"]["text"], list) for x in exchanges] == [True] + [False] * 4
    assert exchanges[0]["status"] == 400 and "rid" not in json.dumps(exchanges[0]["response"])  # names no request
    alone = {x["request"]["rid"].partition("#")[0]: x for x in exchanges[1:]}
    assert {rid: x["status"] for rid, x in alone.items()} == {"r0": 200, "r1": 400, "r2": 200, "r3": 400}
    assert "Requested token count exceeds" in alone["r3"]["response"]["error"]["message"]
    for rid, (words, images, max_new) in {"r0": (2, 0, 3), "r2": (1, 1, 1)}.items():
        out = parse_generate_response(alone[rid]["response"], rid)
        ids, logprobs, finish, prompt_tokens = _echo(words, images, max_new)
        assert (out.output_ids, out.finish_reason, out.prompt_tokens, out.rid) == (ids, finish, prompt_tokens, rid)
        assert out.output_log_probs == pytest.approx(logprobs)
    assert engine.client.server_info()["generate_calls"] == 2  # only the good ones ran
    # a single request is not sent twice, and its refusal names it too
    before = _generate_http_calls(engine)
    with pytest.raises(SGLangRequestError, match=r"^SGLang refused request rid 'r1': .*400 The input \(7 tokens\)"):
        engine.generate([requests[1]])
    assert _generate_http_calls(engine) - before == 1


def test_a_refused_batch_whose_requests_complete_alone_returns_them_in_request_order(engine_factory, caplog):
    engine = engine_factory("--fake-refuse-batches", "1")
    requests = [GenerateRequest("an image of a triangle with sides", [IMAGE], _params(3), rid="i"),
                GenerateRequest("one two three", [], _params(), rid="t"),
                GenerateRequest("four words and images", [IMAGE, IMAGE], _params(), rid=None)]
    with caplog.at_level("WARNING", logger="slime.rollout.engines.sglang.generation"):
        outputs = engine.generate(requests)
    for out, (words, images, max_new), rid in zip(outputs, [(7, 1, 3), (3, 0, 8), (4, 2, 8)], ["i", "t", None]):
        ids, logprobs, finish, prompt_tokens = _echo(words, images, max_new)
        assert (out.output_ids, out.finish_reason, out.prompt_tokens, out.rid) == (ids, finish, prompt_tokens, rid)
        assert out.output_log_probs == pytest.approx(logprobs)
    assert "fake: batched /generate refused" in caplog.text and "refused the batch, not a request" in caplog.text
    info = engine.client.server_info()
    assert (info["generate_http_calls"], info["generate_calls"]) == (1 + 3, 3)
    assert [o.rid for o in engine.generate(requests[:2])] == ["i", "t"]  # the next batch is not refused: one call
    assert _generate_http_calls(engine) == 4 + 1


def test_a_batch_with_a_wrong_key_is_not_sent_again_one_by_one(engine_factory, tmp_path):
    engine = engine_factory()
    record = tmp_path / "exchanges.jsonl"
    engine.client = SGLangClient(engine.spec.url, "not-the-key", record=record)
    with pytest.raises(SGLangAuthError):
        engine.generate([GenerateRequest("a b", [], _params(), rid="a"), GenerateRequest("c", [], _params(), rid="c")])
    assert len(record.read_text().splitlines()) == 1


# ----------------------------------------------------------------------------- security


def _raw(engine, method: str, endpoint: str, body=None, key: str | None = None) -> int:
    conn = http.client.HTTPConnection(engine.client.host, engine.client.port, timeout=30)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request(method, endpoint, body=None if body is None else json.dumps(body), headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def test_requests_without_the_runs_key_are_refused_and_change_no_weight(engine_factory, tmp_path):
    engine = engine_factory()
    weights = engine.client.get("/tensors")
    bucket = [("model.visual.blocks.0.attn.qkv.weight", torch.full((2, 3), 0.5))]
    from slime.weight_sync.flattened import flatten, serialize_bucket_by_value

    update = {"serialized_named_tensors": [serialize_bucket_by_value(flatten(bucket))],
              "load_format": "flattened_bucket", "flush_cache": False}
    for key in (None, "wrong-key"):
        assert _raw(engine, "POST", "/update_weights_from_tensor", update, key) == 401
        assert _raw(engine, "POST", "/generate", {"text": "x", "sampling_params": {}}, key) == 401
        assert _raw(engine, "POST", "/release_memory_occupation", {"tags": ["weights"]}, key) == 401
        assert _raw(engine, "GET", "/server_info", None, key) == 401  # it would show the key
        with pytest.raises(SGLangAuthError, match="lacks the run's key"):
            SGLangClient(engine.spec.url, key).post("/update_weights_from_tensor", update)
    assert _raw(engine, "GET", "/health") == 200  # liveness needs no key (SGLang's rule)
    assert engine.client.get("/tensors") == weights == {}  # nothing was loaded
    engine.update_weights_from_tensor(bucket)
    assert engine.client.get("/tensors") == {"model.visual.blocks.0.attn.qkv.weight": [3.0, 6]}


def test_the_secret_is_in_no_command_log_recording_or_printed_config(engine_factory, tmp_path, capsys):
    from slime.arguments import config_to_argv, parse_args

    engine = engine_factory()
    secret = engine._secret
    engine.client.record = tmp_path / "rec.jsonl"
    assert engine.client.server_info()["api_key"] == secret  # the fake shows it to the key holder, as SGLang does
    engine.generate([GenerateRequest("a b", [], _params())])
    places = {
        "command": " ".join(engine.server_command()),
        "server log": engine.server.log_path.read_text(),
        "log tail": engine.log_tail(),
        "recording": engine.client.record.read_text(),
        "client repr": repr(engine.client),
        "process cmdline": Path(f"/proc/{engine.server.pid}/cmdline").read_bytes().decode(errors="replace"),
        "process environment": Path(f"/proc/{engine.server.pid}/environ").read_bytes().decode(errors="replace"),
        "captured output": "".join(capsys.readouterr()),
    }
    for where, text in places.items():
        assert secret not in text, where
    assert "<redacted>" in places["recording"]
    cfg = parse_args(["--hf-checkpoint", "x", "--prompt-data", "y", "--num-rollout", "1", "--rollout-batch-size",
                      "1", "--rollout-max-response-len", "4", "--train-backend", "fsdp", "--rollout-backend",
                      "scripts.harness.fake_sglang:FakeSGLangEngine", "--colocate", "--wandb-key", "wk-123"])
    argv = config_to_argv(cfg, redact=True)
    assert "wk-123" not in argv and not any("api-key" in a for a in argv)  # the engine's key is never a flag


def _run_cfg(ckpt, *extra):
    from slime.arguments import parse_args

    return parse_args(["--hf-checkpoint", str(ckpt), "--prompt-data", "y", "--num-rollout", "1",
                       "--rollout-batch-size", "1", "--rollout-max-response-len", "4", "--train-backend", "fsdp",
                       "--rollout-backend", "scripts.harness.fake_sglang:FakeSGLangEngine", "--colocate", *extra])


def test_servers_capture_routes_for_an_moe_checkpoint_whose_parity_check_replays_them(tiny_ckpt, tmp_path):
    def captures_routes(cfg) -> bool:  # what the engines are handed (SlimeConfig.engine_spec)
        return cfg.engine_spec(FakeSGLangEngine.parity_check).return_routed_experts

    assert captures_routes(_run_cfg(tiny_ckpt))
    assert not captures_routes(_run_cfg(tiny_ckpt, "--no-engine-parity-replay-routes"))
    assert not captures_routes(_run_cfg(tiny_ckpt, "--skip-engine-parity-check"))
    # R3: the trainer replays the engine's routes, so the servers capture them whatever the parity check does
    assert captures_routes(_run_cfg(tiny_ckpt, "--skip-engine-parity-check", "--use-rollout-routing-replay"))
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 2}}))
    assert not captures_routes(_run_cfg(dense))
    spec = ServerSpec(model_path="/ckpt", tp_size=1, host="127.0.0.1", port=1, seed=0, colocated=False,
                      return_routed_experts=True)
    assert server_command(spec, python="/py")[-3:] == ["--enable-return-routed-experts", "--dtype", "bfloat16"]
    given = dataclasses.replace(spec, passthrough=("--enable-return-routed-experts",))
    assert server_command(given, python="/py").count("--enable-return-routed-experts") == 1


def test_the_fake_server_returns_its_models_routes_as_sglang_encodes_them(tiny_ckpt, tmp_path, processor):
    """``--fake-model hf`` with ``--enable-return-routed-experts``: a request that asks gets, through the engine's
    decoding of SGLang's base64 int32 answer, the experts a plain forward of its model chooses (away from ties)."""
    from qwen35_helpers import hf_forward_routes
    from transformers import Qwen3_5MoeForConditionalGeneration

    from slime.data.image import decode_image

    spec = dataclasses.replace(_spec(tmp_path, "--fake-model", "hf"), model_path=str(tiny_ckpt),
                               return_routed_experts=True)
    engine = FakeSGLangEngine(spec, tmp_path / "engine")
    try:
        _wait_healthy(engine)
        assert engine.route_shape.num_layers == 4 and engine.route_shape.top_k == 2
        content = [{"type": "image"}, {"type": "text", "text": "Find x."}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}])
        params = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=3)
        asks = GenerateRequest(prompt, [IMAGE], params, rid="a", return_routed_experts=True)
        out, plain = engine.generate([asks, dataclasses.replace(asks, rid="b", return_routed_experts=False)])
    finally:
        engine.shutdown()
    assert plain.routed_experts is None
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    processed = processor(prompt, [decode_image(IMAGE)])
    routes, margin = hf_forward_routes(model, processed.input_ids + out.output_ids, processed.pixel_values,
                                       processed.image_grid_thw)
    n = out.prompt_tokens + len(out.output_ids) - 1
    assert out.routed_experts.shape == (n, 4, 2) and out.routed_experts.dtype.name == "uint8"
    clear = (margin[:n] > 1e-4).numpy()
    assert clear.mean() > 0.99
    assert (out.routed_experts[clear] == routes[:n].numpy()[clear]).all()


@pytest.mark.parametrize("flag", ["--sglang-api-key", "--sglang-admin-api-key"])
def test_the_key_flags_are_refused(flag):
    from slime.rollout.engines.sglang.config import SGLangEngineConfig
    from slime.rollout.engines.sglang.flags import extract_sglang_args

    sglang, _ = extract_sglang_args([flag, "mine"])
    with pytest.raises(ConfigError, match="per-run secret"):
        SGLangEngineConfig.check(None, sglang)


@pytest.mark.parametrize("flags, message", [
    (["--sglang-tokenizer-worker-num", "2"], "checks API keys only with one tokenizer worker"),
    (["--sglang-dp-size", "2"], "--sglang-enable-dp-attention"),
    (["--sglang-base-gpu-id", "1"], "CUDA_VISIBLE_DEVICES"),
    (["--sglang-nnodes", "2"], "spans one node"),
    (["--sglang-grpc-port", "9"], "bypasses"),
    # other routes to a listener without the key check, or to the key on disk
    (["--sglang-config", "sglang.yaml"], "--sglang-config is not passed through: SGLang merges the file's settings"),
    (["--sglang-grpc-mode"], "--sglang-grpc-mode is not passed through: .*never checks the API key"),
    (["--sglang-smg-grpc-mode"], "--sglang-smg-grpc-mode is not passed through: .*never checks the API key"),
    (["--sglang-nccl-init-addr", "10.0.0.1:5000"], "--sglang-nccl-init-addr is not passed through: .*--dist-init-addr"),
    (["--sglang-crash-dump-folder", "/tmp/d"], "--sglang-crash-dump-folder is not passed through: .*secret"),
    (["--sglang-crash-dump", "/tmp/d"], "abbreviates --sglang-crash-dump-folder"),
    (["--sglang-router-ip", "10.0.0.1"], "sglang-router is not used"),
    # SGLang's argparse expands unique prefixes: an abbreviation would slip past the checks above
    (["--sglang-grpc-por", "9"], "--sglang-grpc-por abbreviates --sglang-grpc-port"),
    (["--sglang-tokenizer-worker", "4"], "abbreviates --sglang-tokenizer-worker-num"),
    (["--sglang-api", "k"], "abbreviates --sglang-api-key"),
    (["--sglang-dp", "2"], "abbreviates --sglang-dp-size"),
    (["--sglang-server-concurrency", "0"], "one integer in 1..512"),
    (["--sglang-server-concurrency", "1000"], "one integer in 1..512"),
    (["--sglang-server-concurrency", "1", "2"], "one integer in 1..512"),
    (["--sglang-requests-per-call", "0"], "requests-per-call must be one integer in 1..512"),
    (["--sglang-server-concurrency", "8", "--sglang-requests-per-call", "16"], "requests-per-call .* in 1..8"),
    # SGLang 0.5.17 refuses every batched /generate holding an image under it (_validate_batch_tokenization_constraints)
    (["--sglang-enable-tokenizer-batch-encode"], "tokenizer-batch-encode: .*image prompt.*--sglang-requests-per-call 1"),
    (["--sglang-enable-tokenizer-batch", "--sglang-requests-per-call", "1"], "abbreviates"),
])  # fmt: skip
def test_sglang_flags_the_engine_cannot_honour_are_refused(flags, message):
    from slime.rollout.engines.sglang.config import SGLangEngineConfig
    from slime.rollout.engines.sglang.flags import (
        extract_sglang_args,
        requests_per_call,
        server_concurrency,
        slime_owned_args,
    )

    sglang, _ = extract_sglang_args(flags)
    with pytest.raises(ConfigError, match=message):
        SGLangEngineConfig.check(None, sglang)
    ok, _ = extract_sglang_args(["--sglang-server-concurrency", "64", "--sglang-dp-size", "2",
                                 "--sglang-enable-dp-attention", "--sglang-mem-fraction-static", "0.7"])
    SGLangEngineConfig.check(None, ok)
    assert server_concurrency(ok) == 64 and requests_per_call(ok) == 32
    small, _ = extract_sglang_args(["--sglang-server-concurrency", "16"])
    assert requests_per_call(small) == 16  # the default, cut to the concurrency
    single, _ = extract_sglang_args(["--sglang-enable-tokenizer-batch-encode", "--sglang-requests-per-call", "1"])
    SGLangEngineConfig.check(None, single)  # no batched call, so SGLang never batch-tokenises
    assert slime_owned_args(ok) == ({"server_concurrency": "64"},
                                    ["--dp-size", "2", "--enable-dp-attention", "--mem-fraction-static", "0.7"])


# ----------------------------------------------------------------------------- weights, memory, pause, flush


def test_memory_release_resume_and_weights_pushed_after_resume(engine_factory):
    engine = engine_factory(colocated=True)
    assert "--enable-memory-saver" in engine.server_command()
    engine.release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
    engine.release_memory_occupation(["kv_cache"])  # already released: not sent again (SGLang would not mind)
    with pytest.raises(SGLangRequestError, match="memory released"):
        engine.generate([GenerateRequest("a b", [], _params())])
    engine.resume_memory_occupation(["weights"])
    engine.resume_memory_occupation(["weights"])  # not released any more: not sent (SGLang would refuse it)
    engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
    out = engine.generate([GenerateRequest("a b", [], _params())])[0]
    assert out.output_ids == [0, 0, 0]  # the weights came back empty: pushed again below
    bucket = [("lm_head.weight", torch.tensor([[0.25, 0.5]], dtype=torch.bfloat16)), ("b", torch.tensor([1.0]))]
    engine.update_weights_from_tensor(bucket)
    out = engine.generate([GenerateRequest("a b", [], _params())])[0]
    ids, logprobs, _, _ = _echo(2, 0, shift=0.25 + 0.5 + 1.0)
    assert out.output_ids == ids and out.output_log_probs == pytest.approx(logprobs)


def test_cuda_graph_tag_is_dropped_where_the_server_lacks_it(engine_factory, tmp_path):
    assert memory_tags_supported(["kv_cache", "weights"]) == ("weights", "kv_cache")
    assert memory_tags_supported(None) == ("weights", "kv_cache", "cuda_graph")
    engine = engine_factory("--disable-cuda-graph")  # no graphs captured: nothing under that tag
    engine.client.record = tmp_path / "rec.jsonl"
    engine.release_memory_occupation(None)
    engine.resume_memory_occupation(None)
    sent = [json.loads(line)["request"] for line in engine.client.record.read_text().splitlines()]
    assert sent == [{"tags": ["weights", "kv_cache"]}, {"tags": ["weights", "kv_cache"]}]


def test_pause_abort_ends_requests_in_flight_and_flush_waits_for_them(engine_factory):
    import concurrent.futures

    engine = engine_factory("--fake-delay-s", "2")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(engine.generate, [GenerateRequest("a b c", [], _params())])
        wait_for(lambda: engine.client.server_info()["running"] == 1, 30, "the request to run at the server")
        flushing = pool.submit(engine.flush_cache)  # 400 while the request runs: retried until it is done
        engine.pause_generation("abort")
        assert running.result(timeout=60)[0].finish_reason == "abort"
        flushing.result(timeout=60)
    engine.continue_generation()
    assert engine.generate([GenerateRequest("a b c", [], _params())])[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="pause mode"):
        engine.pause_generation("later")


def test_abort_requests_cuts_the_calls_in_flight_and_keeps_serving(engine_factory):
    """Dynamic sampling's abort path: /pause_generation mode=abort, then /continue_generation."""
    import concurrent.futures

    engine = engine_factory("--fake-delay-s", "2")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(engine.generate, [GenerateRequest("a b c", [], _params())])
        wait_for(lambda: engine.client.server_info()["running"] == 1, 30, "the request to run at the server")
        engine.abort_requests()
        assert running.result(timeout=60)[0].finish_reason == "abort"
    assert engine.generate([GenerateRequest("a b c", [], _params())])[0].finish_reason == "stop"  # not paused


# ----------------------------------------------------------------------------- death, restart, shutdown


def test_a_dead_server_is_reported_and_a_restart_brings_a_new_one(engine_factory):
    engine = engine_factory("--fake-exit-after", "2")
    engine.generate([GenerateRequest("a", [], _params())])
    old_port, old_pid = engine.spec.port, engine.server.pid
    with pytest.raises(EngineUnavailableError, match="exited with code 1"):
        engine.generate([GenerateRequest("a", [], _params())])  # the second request kills it
    with pytest.raises(EngineUnavailableError, match="last lines"):
        engine.health()
    engine.restart()
    _wait_healthy(engine)
    assert engine.spec.port != old_port and engine.server.pid != old_pid
    assert engine.generate([GenerateRequest("a", [], _params())])[0].output_ids == [10, 11]


def test_a_restarted_server_gets_a_new_key_and_refuses_the_old_one(tmp_path):
    engine = FakeSGLangEngine(_spec(tmp_path), tmp_path / "engine-0", capacity=4,
                              env={"SGLANG_GRPC_PORT": "30001"})  # an actor environment with it set
    try:
        _wait_healthy(engine)
        environ = Path(f"/proc/{engine.server.pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith(b"SGLANG_GRPC_PORT=")]  # the server never saw it
        old_secret, old_client = engine._secret, engine.client
        engine.client.record = tmp_path / "rec.jsonl"
        engine.restart()
        _wait_healthy(engine)
        new_secret = engine._secret
        assert new_secret != old_secret and engine.client is not old_client
        assert _raw(engine, "POST", "/generate", {"text": "x", "sampling_params": {}}, old_secret) == 401
        assert _raw(engine, "GET", "/server_info", None, old_secret) == 401
        assert engine.client.server_info()["api_key"] == new_secret  # the new client carries the new key
        assert engine.generate([GenerateRequest("a", [], _params())])[0].output_ids == [10, 11]
        recording = engine.client.record.read_text()  # the recording goes on across the restart, redacted
        assert "/server_info" in recording and new_secret not in recording and old_secret not in recording
    finally:
        engine.shutdown()


def test_a_health_poll_during_a_restart_keeps_the_new_servers_start_lock(tmp_path, monkeypatch):
    """The old server is dead while the new one starts: a health() answer about the old one (it raises) must not
    drop the lock that the new server holds until its caches are sized."""
    import tempfile

    from slime.rollout.engines.sglang import engine as engine_module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engine = FakeSGLangEngine(_spec(tmp_path), tmp_path / "engine-0", capacity=4, gpu_ids=["0"])
    try:
        _wait_healthy(engine)
        engine.server.stop(grace_s=5)  # the server died
        polled = {}
        real_server_process = engine_module.ServerProcess

        def poll_then_start(*args, **kwargs):  # the new GPU lock is taken, the new server not yet started
            try:
                polled["health"] = engine.health()
            except EngineUnavailableError as e:
                polled["health"] = str(e)
            polled["lock file free"] = _lock_is_free(tmp_path / "slime-sglang-start-gpu0.lock")
            return real_server_process(*args, **kwargs)

        monkeypatch.setattr(engine_module, "ServerProcess", poll_then_start)
        engine.restart()
        assert "exited with code" in polled["health"]  # the poll saw the old, dead server
        assert polled["lock file free"] is False  # ... and left the new start's lock alone
        _wait_healthy(engine)
    finally:
        engine.shutdown()
    assert _lock_is_free(tmp_path / "slime-sglang-start-gpu0.lock")


def test_shutdown_stops_the_server_and_everything_in_its_session(engine_factory):
    engine = engine_factory()
    pid = engine.server.pid
    schedulers = [read_proc(p) for p in engine.client.server_info()["scheduler_pids"]]
    assert len(schedulers) == 1 and all(s is not None and s.sid == s.pgid == pid and is_alive(s) for s in schedulers)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        engine.shutdown()
        engine.shutdown()  # idempotent
        assert engine.server.exit_code() is not None
        wait_for(lambda: not any(is_alive(s) for s in schedulers), timeout_s=60,
                 what="the server's scheduler stand-in (its child, in its session) to be stopped with it")
        assert not wait_session_gone(pid, timeout_s=60)  # nobody left in the server's session
        for s in schedulers:  # the orderly stop (SIGTERM to the session) reached it, not only the main process
            assert (engine.server.log_path.parent / f"scheduler-{s.pid}.exit").read_text() == "SIGTERM"
        assert bystander.poll() is None  # a process the engine did not start is untouched
        assert not engine.health()
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


def test_a_server_whose_main_process_alone_is_killed_takes_its_session_with_it(engine_factory):
    """As Ray kills an exiting actor's direct children (and an OOM killer may): nothing in the main process runs,
    and the server's session guard (``exit_with_parent``) kills the rest of the session."""
    engine = engine_factory()
    pid = engine.server.pid
    schedulers = [read_proc(p) for p in engine.client.server_info()["scheduler_pids"]]
    assert len(schedulers) == 1 and all(s is not None and s.sid == pid and is_alive(s) for s in schedulers)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(is_alive(s) for s in schedulers), timeout_s=60,
             what="the scheduler stand-in of a server whose main process was killed to be killed by its guard")
    assert not wait_session_gone(pid, timeout_s=60)
    assert engine.server.exit_code() == -signal.SIGKILL
    with pytest.raises(EngineUnavailableError, match="exited with code -9"):
        engine.health()


_LEADER = """
import os, subprocess, sys, time
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(int(sys.argv[2]))]
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(" ".join(str(c.pid) for c in children))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
os._exit(3)
"""
"""A server's main process that starts ``argv[2]`` children in its session, writes their pids to ``argv[1]``
and exits with code 3, leaving them (as a crashed SGLang main process can leave its schedulers)."""


def _exited_leader(tmp_path, children: int):
    """A :class:`ServerProcess` whose main process has exited (code 3, seen through ``alive()`` and ``exit_code()``
    as ``health()`` sees it), and its children (:data:`_LEADER`)."""
    pids = tmp_path / "children"
    server = ServerProcess([sys.executable, "-c", _LEADER, str(pids), str(children)], dict(os.environ),
                           tmp_path / "server.log", secret="s3cret")
    wait_for(lambda: not server.alive(), timeout_s=START_S, what="the stand-in server to exit")
    assert server.exit_code() == 3, server.log_tail()
    kids = [read_proc(int(p)) for p in pids.read_text().split()]
    assert len(kids) == children and all(k is not None and k.sid == k.pgid == server.pid for k in kids)
    return server, kids


def _record_killpg(monkeypatch) -> list[tuple[int, int, bool]]:
    """Record every ``os.killpg(pgid, sig)`` with whether, at that moment, a process (a zombie counts) of session
    ``pgid`` exists: one that holds the number, so that the group cannot be another's."""
    calls = []
    real_killpg = os.killpg

    def killpg(pgid, sig):
        calls.append((pgid, sig, any(p.sid == pgid for p in all_processes())))
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", killpg)
    return calls


def test_stop_kills_the_children_of_a_server_whose_main_process_exited_first(tmp_path, monkeypatch):
    server, kids = _exited_leader(tmp_path, children=1)
    leader = read_proc(server.pid)
    assert leader is not None and leader.state == "Z"  # health polls did not reap it: the group's number is kept
    calls = _record_killpg(monkeypatch)
    server.stop(grace_s=5)
    assert calls == [(server.pid, signal.SIGKILL, True)]  # no SIGTERM to a dead main process; the number still ours
    wait_for(lambda: not is_alive(kids[0]), timeout_s=60, what="the child that outlived its server to be killed")
    assert server.process.returncode == 3  # reaped by stop(), after the group was killed
    server.stop()
    assert len(calls) == 1  # reaped: the number is never signalled again


def test_stop_terms_then_kills_the_group_of_a_running_server(tmp_path, monkeypatch):
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
           "time.sleep(600)"
    server = ServerProcess([sys.executable, "-c", code], dict(os.environ), tmp_path / "server.log", secret="")
    kids = wait_for(lambda: [p for p in all_processes() if p.ppid == server.pid], timeout_s=START_S,
                    what="the stand-in server's child")
    assert kids[0].sid == kids[0].pgid == server.pid
    calls = _record_killpg(monkeypatch)
    server.stop(grace_s=30)
    assert calls == [(server.pid, signal.SIGTERM, True), (server.pid, signal.SIGKILL, True)]
    assert server.process.returncode == -signal.SIGTERM
    wait_for(lambda: not is_alive(kids[0]), timeout_s=60, what="the running server's child to be stopped")


def test_stop_signals_no_group_once_the_server_and_its_session_are_gone(tmp_path, monkeypatch):
    server, _ = _exited_leader(tmp_path, children=0)
    calls = _record_killpg(monkeypatch)
    for _ in range(3):  # the restart path: health() saw it dead, then restart() stops it
        assert not server.alive() and server.exit_code() == 3
    server.stop(grace_s=5)
    assert [held for _, _, held in calls] == [True]  # signalled while the zombie held the number, then reaped
    assert read_proc(server.pid) is None or read_proc(server.pid).sid != server.pid
    server.stop()
    assert len(calls) == 1


@pytest.mark.parametrize("children", [1, 0])
def test_a_server_reaped_behind_its_back_is_not_signalled_and_its_survivors_are_named(tmp_path, monkeypatch, caplog,
                                                                                       children):
    """Something else reaps the main process (os.waitpid here): its number may now be anyone's, so stop() signals
    nothing and names the processes it finds in a session of that number (the surviving child here)."""
    server, kids = _exited_leader(tmp_path, children=children)
    os.waitpid(server.pid, 0)
    calls = _record_killpg(monkeypatch)
    try:
        with caplog.at_level("WARNING", logger="slime.rollout.engines.sglang.launch"):
            server.stop(grace_s=5)
            server.stop()
        assert calls == [] and server.exit_code() == 3
        warnings = [r.getMessage() for r in caplog.records if "reaped by something other than slime" in r.getMessage()]
        if children:
            assert len(warnings) == 1 and f"pid {kids[0].pid} (python" in warnings[0] and is_alive(kids[0])
        else:
            assert warnings == []
    finally:
        for kid in kids:
            if is_alive(kid):
                os.kill(kid.pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- recording and replay


def test_the_fake_replays_a_recording_made_through_the_client(engine_factory, tmp_path):
    engine = engine_factory()
    engine.update_weights_from_tensor([("w", torch.tensor([2.0]))])
    record = tmp_path / "rec.jsonl"
    engine.client.record = record
    request = GenerateRequest("four words right here", [IMAGE], _params())
    recorded = engine.generate([request])[0]
    assert recorded.output_log_probs[0] == pytest.approx(-0.1 - 2.0)
    replay = engine_factory("--replay", str(record))  # a fresh server without the weight: only the recording knows
    replayed = replay.generate([request])[0]
    assert dataclasses.asdict(replayed) == dataclasses.asdict(recorded)
    assert replay.generate([GenerateRequest("other words", [], _params())])[0].output_log_probs[0] == pytest.approx(-0.1)


RECORDED = REPO / "tests" / "fixtures" / "sglang_0.5.17_h200.jsonl"


@pytest.mark.skipif(not RECORDED.exists(), reason=f"{RECORDED.name} is recorded on the H200 (scripts/bench/h200_sglang.sh)")
def test_real_sglang_answers_recorded_on_the_h200_parse():
    generated = 0
    for line in RECORDED.read_text().splitlines():
        record = json.loads(line)
        if record["endpoint"] == "/generate" and record["status"] == 200:
            answers = record["response"] if isinstance(record["response"], list) else [record["response"]]  # a batch
            for out in map(parse_generate_response, answers):
                assert len(out.output_ids) == len(out.output_log_probs) > 0
                assert all(lp <= 0 for lp in out.output_log_probs) and out.prompt_tokens > 0
                generated += 1
        if record["status"] == 401:
            assert record["response"] == {"error": "Unauthorized"}
    assert generated > 0


# ----------------------------------------------------------------------------- the multimodal-RoPE fix


@pytest.mark.parametrize("version, affected", [
    ("0.5.16", False), ("0.5.17", True), ("0.5.17.post1", True), ("0.5.18rc0", True), ("0.5.18", True),
    ("0.5.19", False), ("0.5.19rc1", False), ("0.5.23", False), ("0.6", False), ("v0.5.17+cu130", True),
])  # fmt: skip
def test_the_fix_is_gated_on_the_affected_releases(version, affected):
    assert needs_mrope_fix(version) is affected


def test_release_tuple_refuses_non_versions():
    assert release_tuple("0.5") == (0, 5, 0)
    with pytest.raises(ValueError, match="not an SGLang version"):
        release_tuple("main")


class _Layer:
    """A stand-in for ``Qwen3_5AttentionDecoderLayer``: says which path ran."""

    def forward_prepare_cuda_fused(self, positions, hidden_states):
        return "fused", positions.shape

    def forward_prepare_native(self, positions, hidden_states):
        return "native", positions.shape


def test_the_fix_routes_2d_positions_to_the_native_path_only():
    layer_cls = type("Layer", (_Layer,), {})
    server_plugin.apply_rope_fix(layer_cls)
    server_plugin.apply_rope_fix(layer_cls)  # idempotent
    layer, hidden = layer_cls(), torch.zeros(5, 4)
    assert layer.forward_prepare_cuda_fused(torch.zeros(3, 5, dtype=torch.long), hidden) == ("native", (3, 5))
    assert layer.forward_prepare_cuda_fused(torch.zeros(5, dtype=torch.long), hidden) == ("fused", (5,))
    with pytest.raises(AttributeError):
        server_plugin.apply_rope_fix(type("Other", (), {"forward_prepare_cuda_fused": _Layer.forward_prepare_cuda_fused}))


@pytest.fixture
def fake_sglang_modules(monkeypatch, tmp_path):
    """Stand-ins for the SGLang classes the plugin patches, and its report folder."""
    @dataclasses.dataclass
    class ServerArgs:
        model_path: str = "/m"
        api_key: str | None = "s3cret-key"
        admin_api_key: str | None = "s3cret-key"

    class BaseTpWorker:
        def update_weights_from_tensor(self, req):
            return True, "Success"

    class Qwen3_5MoeForConditionalGeneration:
        def load_weights(self, weights):
            return {name for name, _ in weights}

    class EAGLEWorkerV2:
        def update_weights_from_tensor(self, req):
            return True, "Success"

    class Scheduler:
        def is_fully_idle(self):
            return True

        def flush_cache(self, empty_cache=True):
            return True

    classes = {server_plugin.SCHEDULER_TARGET: Scheduler, server_plugin.MROPE_FIX_TARGET: type("Layer", (_Layer,), {}),
               server_plugin.TOKENIZER_MANAGER_TARGET: type("TokenizerManager", (_TokenizerManager,), {}),
               "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
               "sglang.srt.server_args.ServerArgs": ServerArgs,
               "sglang.srt.managers.tp_worker.BaseTpWorker": BaseTpWorker,
               server_plugin.SPEC_WORKER_TARGET: EAGLEWorkerV2}
    monkeypatch.setattr(server_plugin, "_import_attr", lambda path, missing_ok=False: classes[path])
    module = server_plugin.MROPE_FIX_TARGET.rpartition(".")[0]
    spec_module, _, spec_class = server_plugin.SPEC_WORKER_TARGET.rpartition(".")
    armed: list[str] = []

    scheduler_module, _, scheduler_class = server_plugin.SCHEDULER_TARGET.rpartition(".")
    manager_module, _, manager_class = server_plugin.TOKENIZER_MANAGER_TARGET.rpartition(".")

    def arm_on_import(name, patch):  # SGLang imports the model module (and the speculative worker's) at once
        assert name in (module, spec_module, scheduler_module, manager_module)
        armed.append(name)
        if name == manager_module:
            patch(types.SimpleNamespace(**{manager_class: classes[server_plugin.TOKENIZER_MANAGER_TARGET]}))
            return
        if name == scheduler_module:
            patch(types.SimpleNamespace(**{scheduler_class: classes[server_plugin.SCHEDULER_TARGET]}))
            return
        if name == spec_module:
            patch(types.SimpleNamespace(**{spec_class: classes[server_plugin.SPEC_WORKER_TARGET]}))
            return
        patch(types.SimpleNamespace(**{server_plugin.MROPE_FIX_TARGET.rpartition(".")[2]:
                                       classes[server_plugin.MROPE_FIX_TARGET],
                                       "Qwen3_5MoeForConditionalGeneration": classes["Qwen3_5MoeForConditionalGeneration"]}))

    monkeypatch.setattr(server_plugin, "arm_on_import", arm_on_import)
    monkeypatch.setattr(server_plugin, "_write_report", lambda version, state, main: reports.append((version, state)))
    monkeypatch.delenv(server_plugin.MROPE_FIX_ENV, raising=False)
    monkeypatch.delenv(server_plugin.MAIN_PID_ENV, raising=False)
    monkeypatch.delenv(server_plugin.FAST_EXPERT_LOAD_ENV, raising=False)
    reports: list = []
    return types.SimpleNamespace(classes=classes, reports=reports, armed=armed)


@pytest.mark.parametrize("version, states, patched", [("0.5.17", ["pending", "applied"], True),
                                                      ("0.5.18", ["pending", "applied"], True),
                                                      ("0.5.19", ["not needed"], False)])
def test_register_applies_the_fix_where_the_installed_sglang_needs_it(fake_sglang_modules, monkeypatch, version,
                                                                      states, patched):
    monkeypatch.setattr(server_plugin.importlib.metadata, "version", lambda dist: version)
    server_plugin.register()
    layer = fake_sglang_modules.classes[server_plugin.MROPE_FIX_TARGET]()
    path, _ = layer.forward_prepare_cuda_fused(torch.zeros(3, 2), None)
    assert path == ("native" if patched else "fused")
    assert fake_sglang_modules.reports == [(version, state) for state in states]
    args = fake_sglang_modules.classes["sglang.srt.server_args.ServerArgs"]()
    assert "s3cret-key" not in f"{args=}" and "api_key='<redacted>'" in repr(args)  # redacted on every version
    assert fake_sglang_modules.classes["sglang.srt.managers.tp_worker.BaseTpWorker"]().update_weights_from_tensor(
        None) == (True, "Success")


@pytest.mark.parametrize("env, main, wrapped", [(None, False, True), ("0", False, True), (None, True, False)])
def test_register_wraps_the_moe_load_weights_in_scheduler_processes(fake_sglang_modules, monkeypatch, env, main,
                                                                    wrapped):
    from slime.rollout.engines.sglang import expert_load

    monkeypatch.setattr(expert_load, "STATS", expert_load.ExpertLoadStats())

    monkeypatch.setattr(server_plugin.importlib.metadata, "version", lambda dist: "0.5.19")
    if env is not None:
        monkeypatch.setenv(server_plugin.FAST_EXPERT_LOAD_ENV, env)
    if main:
        monkeypatch.setenv(server_plugin.MAIN_PID_ENV, str(os.getpid()))
    model_cls = fake_sglang_modules.classes["Qwen3_5MoeForConditionalGeneration"]
    server_plugin.register()
    assert getattr(model_cls.load_weights, expert_load._MARK, False) is wrapped
    assert model_cls().load_weights(iter([("a.weight", torch.zeros(1))])) == {"a.weight"}  # the rest streams through
    assert expert_load.STATS.disabled == ("SLIME_SGLANG_FAST_EXPERT_LOAD=0" if env == "0" else None)
    assert expert_load.STATS.load_weights_calls == (1 if wrapped else 0)  # timed also when the fast path is off
    state = ("0.5.19", "not needed")  # a fixed SGLang: no RoPE fix anywhere
    # rewritten after each wrapped load, and in the main process once its request front end is patched
    assert fake_sglang_modules.reports == [state] * (2 if wrapped or main else 1)


@pytest.mark.parametrize("main", [False, True])
def test_the_speculative_worker_waits_for_its_weight_copies_in_scheduler_processes(fake_sglang_modules, monkeypatch,
                                                                                   main):
    """With speculative decoding SGLang's scheduler updates weights through the EAGLE worker, not BaseTpWorker: it
    gets the same CUDA-stream wait (scheduler processes only; the HTTP server's process runs no model)."""
    monkeypatch.setattr(server_plugin.importlib.metadata, "version", lambda dist: "0.5.19")
    if main:
        monkeypatch.setenv(server_plugin.MAIN_PID_ENV, str(os.getpid()))
    worker = fake_sglang_modules.classes[server_plugin.SPEC_WORKER_TARGET]
    server_plugin.register()
    spec_module = server_plugin.SPEC_WORKER_TARGET.rpartition(".")[0]
    assert (spec_module in fake_sglang_modules.armed) is not main
    assert getattr(worker.update_weights_from_tensor, server_plugin._MARK, False) is not main
    assert worker().update_weights_from_tensor(None) == (True, "Success")  # the original's answer, unchanged


class _EmbeddingCache:  # SGLang's MultiModalStaticCache, as far as the patch uses it
    def __init__(self):
        self.mm_cache = {1: "old embedding"}

    def clear(self):
        self.mm_cache.clear()


@pytest.mark.parametrize("idle", [True, False])
def test_a_flush_empties_sglangs_multimodal_embedding_cache_when_idle(monkeypatch, idle):
    """SGLang's flush_cache leaves its multimodal embedding cache (keyed by image hash) in place, so after a weight
    sync a repeated image reuses the old vision tower's output (the H100 run's parity failure): the patched flush
    empties it first, when the scheduler is idle (as the flush itself is), and answers what SGLang's flush answers."""
    calls = []

    class Scheduler:
        def is_fully_idle(self):
            return idle

        def flush_cache(self, empty_cache=True):
            calls.append(dict(cache.mm_cache))  # what the cache held when SGLang's own flush ran
            return idle

    cache = _EmbeddingCache()
    monkeypatch.setitem(sys.modules, server_plugin.MM_EMBEDDING_MODULE, types.SimpleNamespace(embedding_cache=cache))
    server_plugin.clear_mm_embeddings_on_flush(Scheduler)
    server_plugin.clear_mm_embeddings_on_flush(Scheduler)  # idempotent
    assert Scheduler().flush_cache(empty_cache=False) is idle
    assert calls == [{} if idle else {1: "old embedding"}]
    assert cache.mm_cache == ({} if idle else {1: "old embedding"})
    monkeypatch.setitem(sys.modules, server_plugin.MM_EMBEDDING_MODULE, types.SimpleNamespace(embedding_cache=None))
    assert Scheduler().flush_cache() is idle  # no cache made (SGLANG_VLM_CACHE_SIZE_MB unset on a text server)


class _ReqState:  # SGLang 0.5.17's ReqState, as far as _wait_one_response uses it
    def __init__(self):
        self.out_list, self.finished, self.event = [], False, asyncio.Event()


class _TokenizerManager:
    """SGLang 0.5.17's request front end reduced to the race (``tokenizer_manager.py``): ``_wait_one_response`` is an
    async generator that reads ``rid_to_state[rid]`` when first advanced; ``_handle_batch_output`` deletes a finished
    request's state; ``_handle_batch_request`` makes every request's generator, then advances them together."""

    def __init__(self):
        self.rid_to_state = {}

    async def _wait_one_response(self, obj, request=None):
        state = self.rid_to_state[obj.rid]
        while True:
            await state.event.wait()
            out, finished = state.out_list[-1], state.finished
            state.out_list, _ = [], state.event.clear()
            yield out
            if finished:
                break

    def _handle_batch_output(self, rid, text, finished=True):
        state = self.rid_to_state[rid]
        state.out_list.append({"rid": rid, "text": text})
        state.finished = finished
        state.event.set()
        if finished:
            del self.rid_to_state[rid]

    async def batch(self, rids, finish_before_wait):
        """One batched /generate: requests in ``finish_before_wait`` finish before the waits start."""
        for rid in rids:
            self.rid_to_state[rid] = _ReqState()
        waits = [self._wait_one_response(types.SimpleNamespace(rid=rid)) for rid in rids]
        for rid in finish_before_wait:
            self._handle_batch_output(rid, f"early {rid}")
        tasks = [asyncio.ensure_future(wait.__anext__()) for wait in waits]
        await asyncio.sleep(0)  # the waits block on the running requests' events
        for rid in rids:
            if rid not in finish_before_wait:
                self._handle_batch_output(rid, f"late {rid}")
        return await asyncio.gather(*tasks)


def test_a_batched_request_that_finishes_before_its_wait_is_answered_not_refused():
    """SGLang 0.5.17 fails a whole batched /generate with HTTP 500 (KeyError in _wait_one_response) when one of its
    requests finishes before the batch's waits start (the H100 learning run: four batches of one-token answers); the
    wrapped method takes the state at the call, answers every request with its own output, and leaves no state
    behind."""
    rids = ["0:0", "0:1", "0:2"]
    with pytest.raises(KeyError, match="0:1"):  # the stand-in has SGLang's bug
        asyncio.run(_TokenizerManager().batch(rids, finish_before_wait={"0:1"}))

    manager_cls = type("Patched", (_TokenizerManager,), {})
    assert server_plugin.wait_with_state_taken_early(manager_cls)
    assert server_plugin.wait_with_state_taken_early(manager_cls)  # idempotent
    manager = manager_cls()
    outputs = asyncio.run(manager.batch(rids, finish_before_wait={"0:1"}))
    assert outputs == [{"rid": "0:0", "text": "late 0:0"}, {"rid": "0:1", "text": "early 0:1"},
                       {"rid": "0:2", "text": "late 0:2"}]
    assert manager.rid_to_state == {}  # the early state was put back for its read only

    async def stream():  # a request still running: its chunks pass through unchanged, in order
        manager.rid_to_state["s"] = _ReqState()
        wait = manager._wait_one_response(types.SimpleNamespace(rid="s"))
        manager._handle_batch_output("s", "chunk 1", finished=False)
        first = await wait.__anext__()
        manager._handle_batch_output("s", "chunk 2")
        return [first] + [chunk async for chunk in wait]

    assert [c["text"] for c in asyncio.run(stream())] == ["chunk 1", "chunk 2"] and manager.rid_to_state == {}


def test_the_batch_wait_fix_leaves_an_sglang_that_reads_the_state_at_the_call():
    class Fixed:  # sgl-project/sglang PR #36638's shape: a plain method returning the generator
        def _wait_one_response(self, obj, request=None):
            async def responses():
                yield obj.rid
            return responses()

    original = Fixed._wait_one_response
    assert not server_plugin.wait_with_state_taken_early(Fixed)
    assert Fixed._wait_one_response is original


@pytest.mark.parametrize("main", [False, True])
def test_register_patches_the_request_front_end_in_the_main_process(fake_sglang_modules, monkeypatch, main):
    monkeypatch.setattr(server_plugin.importlib.metadata, "version", lambda dist: "0.5.17")
    if main:
        monkeypatch.setenv(server_plugin.MAIN_PID_ENV, str(os.getpid()))
    manager = fake_sglang_modules.classes[server_plugin.TOKENIZER_MANAGER_TARGET]
    monkeypatch.setitem(server_plugin.BATCH_WAIT, "state", "pending")
    server_plugin.register()
    assert getattr(manager._wait_one_response, server_plugin._MARK, False) is main
    assert server_plugin.BATCH_WAIT["state"] == ("applied" if main else "scheduler process")
    if main:  # the report is written again once the front end is patched
        assert fake_sglang_modules.reports == [("0.5.17", "main process")] * 2


def test_the_engine_warns_when_the_main_process_lacks_the_batch_wait_fix(tmp_path, caplog):
    engine = FakeSGLangEngine.__new__(FakeSGLangEngine)  # only the report check, no server
    engine.spec, engine.report_dir = _spec(tmp_path, tp=1), tmp_path
    engine.server = types.SimpleNamespace(log_path=tmp_path / "server.log")
    engine.mrope_fix_disabled = False
    for fix, warned in (("applied", False), ("not needed", False), ("not found", True), (None, True)):
        for pid, main in enumerate((True, False)):
            report = {"pid": pid, "main": main, "sglang": "0.5.17", "mrope_fix": "main process" if main else "applied",
                      "mm_embedding_flush": "main process" if main else "applied", "memory_tags": ["weights"]}
            if fix is not None:
                report["batch_wait_fix"] = fix if main else "scheduler process"
            (tmp_path / f"{pid}.json").write_text(json.dumps(report))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            engine._check_reports()
        assert ("batched requests that finish before" in caplog.text) is warned
        if warned:
            assert f"['{fix or 'not reported'}']" in caplog.text and "server.log" in caplog.text


@pytest.mark.parametrize("main", [False, True])
def test_register_patches_the_schedulers_flush_in_scheduler_processes(fake_sglang_modules, monkeypatch, main):
    monkeypatch.setattr(server_plugin.importlib.metadata, "version", lambda dist: "0.5.17")
    if main:
        monkeypatch.setenv(server_plugin.MAIN_PID_ENV, str(os.getpid()))
    scheduler = fake_sglang_modules.classes[server_plugin.SCHEDULER_TARGET]
    monkeypatch.setitem(server_plugin.MM_FLUSH, "state", "main process")
    server_plugin.register()
    assert getattr(scheduler.flush_cache, server_plugin._MARK, False) is not main
    assert server_plugin.MM_FLUSH["state"] == ("main process" if main else "applied")  # what the report carries


def test_the_servers_main_process_reports_without_patching_the_model(fake_sglang_modules, monkeypatch):
    monkeypatch.setattr(server_plugin.importlib.metadata, "version", lambda dist: "0.5.17")
    monkeypatch.setenv(server_plugin.MAIN_PID_ENV, str(os.getpid()))
    fake_sglang_modules.classes[server_plugin.MROPE_FIX_TARGET] = type("Renamed", (), {})  # not even looked up
    server_plugin.register()
    assert fake_sglang_modules.reports == [("0.5.17", "main process")] * 2  # again once the front end is patched


def test_register_leaves_the_bug_in_when_asked_and_stops_when_the_fix_cannot_apply(fake_sglang_modules, monkeypatch):
    monkeypatch.setattr(server_plugin.importlib.metadata, "version", lambda dist: "0.5.17")
    monkeypatch.setenv(server_plugin.MROPE_FIX_ENV, "0")
    server_plugin.register()
    layer = fake_sglang_modules.classes[server_plugin.MROPE_FIX_TARGET]()
    assert layer.forward_prepare_cuda_fused(torch.zeros(3, 2), None)[0] == "fused"
    assert fake_sglang_modules.reports == [("0.5.17", "disabled")]
    monkeypatch.delenv(server_plugin.MROPE_FIX_ENV)
    fake_sglang_modules.classes[server_plugin.MROPE_FIX_TARGET] = type("Renamed", (), {})
    with pytest.raises(SystemExit, match="needs slime's multimodal-RoPE fix"):
        server_plugin.register()


def test_the_fix_waits_for_sglang_to_import_the_model_module(tmp_path, monkeypatch):
    package = tmp_path / "fakesglang_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "qwen.py").write_text(
        "class Layer:\n"
        "    def forward_prepare_cuda_fused(self, positions, hidden_states):\n        return 'fused'\n"
        "    def forward_prepare_native(self, positions, hidden_states):\n        return 'native'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patched = []
    server_plugin.arm_on_import("fakesglang_models.qwen",
                                lambda module: (server_plugin.apply_rope_fix(module.Layer), patched.append(module)))
    assert not patched and "fakesglang_models.qwen" not in sys.modules  # nothing imported by the plugin itself
    import importlib

    module = importlib.import_module("fakesglang_models.qwen")  # what SGLang's model loader does, later
    assert patched == [module] and module.Layer().forward_prepare_cuda_fused(torch.zeros(3, 2), None) == "native"
    assert not any(isinstance(f, server_plugin._PatchOnImport) for f in sys.meta_path)  # the hook is gone
    server_plugin.arm_on_import("fakesglang_models.qwen", patched.append)  # already imported: at once
    assert patched == [module, module]


def test_the_engine_refuses_a_server_without_the_plugin_or_without_the_fix(tmp_path):
    from slime.rollout.engines.sglang.engine import ServerReportError

    engine = FakeSGLangEngine.__new__(FakeSGLangEngine)  # only the report check, no server
    engine.spec, engine.report_dir = _spec(tmp_path, tp=2), tmp_path
    engine.server = types.SimpleNamespace(log_path=tmp_path / "server.log")
    engine.mrope_fix_disabled = False

    def reports(*entries):
        for path in tmp_path.glob("*.json"):
            path.unlink()
        for pid, (main, state) in enumerate(entries):
            (tmp_path / f"{pid}.json").write_text(json.dumps(
                {"pid": pid, "main": main, "sglang": "0.5.17", "mrope_fix": state, "memory_tags": ["weights"]}))

    reports((True, "main process"), (False, "applied"))  # one scheduler for --tp-size 2
    with pytest.raises(ServerReportError, match="1 scheduler"):
        engine._check_reports()
    reports((True, "main process"), (False, "applied"), (False, "disabled"))
    with pytest.raises(ServerReportError, match="multimodal-RoPE bug"):
        engine._check_reports()
    engine.mrope_fix_disabled = True  # the server was started with SLIME_SGLANG_MROPE_FIX=0
    reports((True, "main process"), (False, "disabled"), (False, "disabled"))
    engine._check_reports()  # asked for (the benchmark that measures the bug)
    assert engine.memory_tags == ("weights",) and engine.version == "0.5.17"
    engine.mrope_fix_disabled = False
    reports((True, "main process"), (False, "pending"), (False, "pending"))  # the model module never imported
    for architectures, refused in ((["Qwen3_5MoeForConditionalGeneration"], True),
                                   (["Qwen2_5_VLForConditionalGeneration"], False)):
        engine.client = types.SimpleNamespace(model_info=lambda: {"architectures": architectures})
        if refused:
            with pytest.raises(ServerReportError, match=r"\['pending'\]"):
                engine._check_reports()
        else:
            engine._check_reports()  # another architecture: the fix concerns it not


def test_the_engine_warns_when_a_scheduler_lacks_the_embedding_flush(tmp_path, caplog):
    engine = FakeSGLangEngine.__new__(FakeSGLangEngine)  # only the report check, no server
    engine.spec, engine.report_dir = _spec(tmp_path, tp=1), tmp_path
    engine.server = types.SimpleNamespace(log_path=tmp_path / "server.log")
    engine.mrope_fix_disabled = False
    for flush, warned in (("applied", False), ("not found", True), (None, True)):  # None: an older plugin's report
        for pid, main in enumerate((True, False)):
            report = {"pid": pid, "main": main, "sglang": "0.5.17", "mrope_fix": "main process" if main else "applied",
                      "memory_tags": ["weights"]}
            if flush is not None:
                report["mm_embedding_flush"] = "main process" if main else flush
            (tmp_path / f"{pid}.json").write_text(json.dumps(report))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            engine._check_reports()
        assert ("multimodal-embedding flush is" in caplog.text) is warned
        if warned:
            assert f"['{flush or 'not reported'}']" in caplog.text and "server.log" in caplog.text


def test_the_servers_launcher_process_imports_no_torch():
    """``server_main`` (every SGLang server's first process, and every fake server of these tests) reads the plugin's
    names; torch comes with SGLang, not with them (a second of start-up per server otherwise)."""
    code = ("import sys, slime.rollout.engines.sglang.server_main, slime.rollout.engines.sglang.server_plugin; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr
