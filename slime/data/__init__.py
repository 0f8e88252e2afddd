"""Prompt data: dataset rows -> prompt samples (:mod:`.dataset`), and the sample record (:mod:`.sample`)."""
