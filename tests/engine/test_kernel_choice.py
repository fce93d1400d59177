"""Kernel choices measured once a machine and kept (engine/layers/kernel_choice.py): a
second process, or a second engine in one process, takes the first one's choice even when
its own measurement would say otherwise; a kept choice that no longer holds is measured
again; a cache that cannot be written keeps the choice in the process."""

from __future__ import annotations

import subprocess
import sys

from engine.layers.kernel_choice import ChoiceCache, machine_key


def test_the_first_measurement_is_kept_for_every_later_one(tmp_path):
    path = tmp_path / "choices.json"
    first = ChoiceCache(path).choose("linear [8, 4]", lambda: "a")
    measured = []
    again = ChoiceCache(path).choose("linear [8, 4]", lambda: measured.append(1) or "b")
    assert (first, again, measured) == ("a", "a", [])
    assert ChoiceCache(path).choose("linear [16, 4]", lambda: "b") == "b"   # other key
    assert machine_key() in path.read_text()


def test_a_kept_choice_that_no_longer_holds_is_measured_again(tmp_path):
    path = tmp_path / "choices.json"
    ChoiceCache(path).choose("k", lambda: "gone")
    assert ChoiceCache(path).choose("k", lambda: "new", lambda n: n != "gone") == "new"
    assert ChoiceCache(path).choose("k", lambda: "other") == "new"


def test_processes_that_start_together_agree(tmp_path):
    """Each process would measure its own pid; all must come back with one answer."""
    path = tmp_path / "choices.json"
    code = ("import os, sys; from pathlib import Path; "
            "from engine.layers.kernel_choice import ChoiceCache; "
            "print(ChoiceCache(Path(sys.argv[1])).choose('k', lambda: str(os.getpid())))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    answers = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert len(answers) == 1 and answers.pop().isdigit()


def test_an_unwritable_cache_keeps_the_choice_in_the_process(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = ChoiceCache(blocker / "sub" / "choices.json")
    assert cache.choose("k", lambda: "a") == "a"
    assert cache.choose("k", lambda: "b") == "a"


def test_the_cache_is_keyed_on_the_cpu(tmp_path, monkeypatch):
    """A choice measured on one CPU is not read on another (a shared home directory, a
    disk image moved between machines): the other measures its own."""
    from engine.layers import kernel_choice
    path = tmp_path / "choices.json"
    monkeypatch.setattr(kernel_choice, "machine_key", lambda: "Xeon [amx_bf16] torch 2.13")
    assert ChoiceCache(path).choose("linear [8, 4]", lambda: "onednn") == "onednn"
    monkeypatch.setattr(kernel_choice, "machine_key", lambda: "EPYC [avx512_bf16] torch 2.13")
    measured = []
    assert ChoiceCache(path).choose("linear [8, 4]",
                                    lambda: measured.append(1) or "bf16_gemm") == "bf16_gemm"
    assert measured == [1]
    assert ChoiceCache(path).kept() == {"linear [8, 4]": "bf16_gemm"}
    monkeypatch.setattr(kernel_choice, "machine_key", lambda: "Xeon [amx_bf16] torch 2.13")
    cache = ChoiceCache(path)
    assert cache.choose("linear [8, 4]", lambda: "measured again") == "onednn"
    assert cache.made() == cache.kept() == {"linear [8, 4]": "onednn"}
