"""Prompt data: dataset rows -> prompt samples, and the sample record itself.

- :mod:`.config`: the prompt-data flags (no heavy imports);
- :mod:`.sources`: rows from a file, a folder or the hub, as an Arrow table;
- :mod:`.dataset`: rows -> prompt samples, skips, shuffle and the resumable cursor;
- :mod:`.image`: image values of rows -> RGB images, and back to base64;
- :mod:`.processor`: the Qwen3.5 prompt processor (chat template, resize, pixel patches, token ids);
- :mod:`.sample`: :class:`~slime.data.sample.Sample`, the record that crosses process boundaries.
"""
