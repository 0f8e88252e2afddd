"""The SGLang rollout engine (``--rollout-backend sglang``), one module per concept:

- :mod:`.engine`: :class:`~.engine.SGLangEngine`, the :class:`~slime.rollout.engines.base.RolloutEngine`
  over one SGLang server (generation, weights, memory, pause/continue/flush, health, restart);
- :mod:`.generation`: one engine call on ``/generate`` (request bodies, answers, a refused batch resent
  one request per call);
- :mod:`.client`: the HTTP client of SGLang 0.5.17's native API (payloads, errors, the per-run key);
- :mod:`.launch`: the server's command line, environment, process and log;
- :mod:`.server_main`: the server process's entry point (SGLang's ``launch_server`` with the key from stdin);
- :mod:`.server_plugin`: code that runs inside every SGLang process (the version-gated multimodal-RoPE
  fix, secrets out of the logs, synchronous tensor updates, a report per process);
- :mod:`.versions`: facts about SGLang releases (which carry the multimodal-RoPE bug, memory tags);
- :mod:`.config`: parse-time checks of the ``--sglang-*`` flags (importable without SGLang).

Importing this package imports neither SGLang nor the engine module.
"""
