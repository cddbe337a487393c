"""agent/durable.py: a replaced tree is missing only between two renames, and put back if the second fails."""
from __future__ import annotations

import os

import pytest

from agent import durable


def tree(root, text: str):
    root.mkdir()
    (root / "weights").write_text(text)
    return root


def test_the_old_tree_stays_in_place_while_the_new_one_is_synced(tmp_path, monkeypatch):
    """The new bundle is synced before the old one moves aside (the fsync takes seconds for 90 MB), so a build
    interrupted meanwhile leaves the old bundle in place."""
    dest, new = tree(tmp_path / "b", "old"), tree(tmp_path / ".b.tmp", "new")
    seen = []
    sync = durable.sync_tree
    monkeypatch.setattr(durable, "sync_tree", lambda p: (seen.append((dest / "weights").read_text()), sync(p)))
    durable.replace_tree(new, dest, tmp_path / ".b.old")
    assert seen == ["old"] and (dest / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_failed_final_rename_puts_the_old_tree_back(tmp_path, monkeypatch):
    dest, new = tree(tmp_path / "b", "old"), tree(tmp_path / ".b.tmp", "new")
    replace = os.replace

    def fail_second(src, dst):
        if str(src).endswith(".b.tmp"):
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second)
    with pytest.raises(OSError, match="No space"):
        durable.replace_tree(new, dest, tmp_path / ".b.old")
    assert (dest / "weights").read_text() == "old" and not (tmp_path / ".b.old").exists()


@pytest.mark.parametrize("after", ["aside", "into place"])
def test_an_interrupt_at_either_rename_leaves_a_whole_tree_at_dest(after, tmp_path, monkeypatch):
    """Ctrl-C right after the old bundle moved aside leaves the old tree at dest (that rename is inside the
    recovery), and right after the new one moved in leaves the new tree (the old one is not put back onto
    it, which would fail with "Directory not empty")."""
    dest, new = tree(tmp_path / "b", "old"), tree(tmp_path / ".b.tmp", "new")
    replace = os.replace

    def interrupted(src, dst):
        replace(src, dst)
        if (after == "aside") == str(dst).endswith(".b.old"):
            monkeypatch.setattr(os, "replace", replace)
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        durable.replace_tree(new, dest, tmp_path / ".b.old")
    assert (dest / "weights").read_text() == ("old" if after == "aside" else "new")


def test_create_new_works_where_there_are_no_hard_links_and_never_replaces(tmp_path, monkeypatch):
    """A signing key often lives on a vfat USB stick, which has no hard links (link(2) fails with EPERM)."""
    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    durable.create_new(tmp_path / "key", b"secret", 0o600)
    assert (tmp_path / "key").read_bytes() == b"secret" and (tmp_path / "key").stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        durable.create_new(tmp_path / "key", b"other")
    assert (tmp_path / "key").read_bytes() == b"secret" and sorted(p.name for p in tmp_path.iterdir()) == ["key"]
