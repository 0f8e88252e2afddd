"""Training backends behind one training step (:mod:`slime.backends.step`), by ``--train-backend``
(:mod:`slime.backends.registry`); shared flags in :mod:`slime.backends.config`, each backend's in its ``config.py``.
"""
