"""``python -m slime``: the same command line as ``python -m slime.train`` (its usage line already says ``slime``)."""

from slime.train import main

if __name__ == "__main__":  # spawned reward workers import this module as __mp_main__: they must not run a run
    main()
