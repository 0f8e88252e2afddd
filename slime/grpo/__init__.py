"""GRPO: the algorithm's math, shared by every training backend (sources and departures: ``docs/design/grpo.md``)."""
