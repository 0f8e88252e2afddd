"""The SGLang rollout engine (``--rollout-backend sglang``): :mod:`.engine` (the engine), :mod:`.generation` (one
``/generate`` call), :mod:`.client` (HTTP), :mod:`.launch` (command line, environment, process), :mod:`.server_main`
and :mod:`.server_plugin` (code run in the server's processes), :mod:`.expert_load`, :mod:`.versions` and
:mod:`.config` (parse-time checks).  Importing this package imports neither SGLang nor the engine module.
"""
