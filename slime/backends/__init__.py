"""Training backends behind one trainer interface (:mod:`slime.backends.base`), by ``--train-backend``
(:mod:`slime.backends.registry`); shared flags in :mod:`slime.backends.config`, each backend's in its ``config.py``.
"""
