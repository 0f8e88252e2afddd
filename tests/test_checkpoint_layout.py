"""slime.checkpoints.layout: what a failed checkpoint write is blamed on."""

from __future__ import annotations

import collections

import pytest

from slime.checkpoints import layout as ckpt

Usage = collections.namedtuple("Usage", "total used free")
ZIP_ERROR = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # torch's full disk


def test_a_full_disk_is_named_with_free_and_needed_sizes(tmp_path, monkeypatch):
    probed = []

    def usage(path):
        probed.append(path)
        return Usage(100 << 30, 99 << 30, 3 << 29)  # 1.5 GiB free

    monkeypatch.setattr(ckpt.shutil, "disk_usage", usage)
    folder = tmp_path / "ckpt" / "iter_0000006" / "trainer"  # not created yet: its nearest existing parent is probed
    err = ckpt.explain_write_failure(folder, 45 << 30, ZIP_ERROR)
    assert isinstance(err, ckpt.CheckpointError) and err.__cause__ is ZIP_ERROR
    assert probed == [tmp_path]
    message = str(err)
    assert "1.50 GiB free" in message and "45.0 GiB" in message and str(folder) in message
    assert "--no-save-optim" in message and "unexpected pos" in message


def test_an_error_on_a_disk_with_room_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: Usage(100 << 30, 10 << 30, 90 << 30))
    assert ckpt.explain_write_failure(tmp_path, 45 << 30, ZIP_ERROR) is ZIP_ERROR


@pytest.mark.parametrize("free, needed, blamed", [(10, 11, True), (11, 11, False), (0, 1, True)])
def test_the_disk_is_blamed_exactly_when_it_holds_less_than_the_write(tmp_path, monkeypatch, free, needed, blamed):
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: Usage(100, 100 - free, free))
    assert isinstance(ckpt.explain_write_failure(tmp_path, needed, ZIP_ERROR), ckpt.CheckpointError) is blamed
