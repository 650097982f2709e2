"""Shared-memory segment names are never fixed, and only dead creators' segments are cleaned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gearshift.worker import shm_segments


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(done.stdout)


def test_names_carry_key_pid_and_a_random_part() -> None:
    a = shm_segments.segment_name("gearshift-x-", "ns/name-g0", "-l3")
    b = shm_segments.segment_name("gearshift-x-", "ns/name-g0", "-l3")
    assert a != b
    assert a.startswith(f"gearshift-x-ns_name_g0-{os.getpid()}-") and a.endswith("-l3")
    assert shm_segments.group_key({"GEARSHIFT_GROUP_NAME": "demo-g1"}) == "demo_g1"
    assert shm_segments.group_key({}) == "local"


def test_clean_stale_removes_only_dead_creators_of_its_prefix_and_key(tmp_path: Path) -> None:
    dead = _dead_pid()
    names = {
        "dead": f"gearshift-x-g0-{dead}-abcdef",
        "dead_suffix": f"gearshift-x-g0-{dead}-abcdef-l2",
        "live": f"gearshift-x-g0-{os.getpid()}-abcdef",
        "other_key": f"gearshift-x-g1-{dead}-abcdef",
        "other_prefix": f"gearshift-y-g0-{dead}-abcdef",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    removed = shm_segments.clean_stale("gearshift-x-", "g0", tmp_path)
    assert sorted(removed) == sorted([names["dead"], names["dead_suffix"]])
    assert shm_segments.clean_stale("gearshift-x-", None, tmp_path) == [names["other_key"]]
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {names["live"], names["other_prefix"]}
    assert shm_segments.segments("gearshift-x-", "g0", tmp_path) == [names["live"]]


_HARD_EXIT = """
import sys, time, threading
from gearshift.worker.policies.seesaw.host_kv import HostKVStore, PageShape
from gearshift.worker.policies.sidp.shared_weights import Segment, new_segment_name
from gearshift.worker.shm_segments import hard_exit
import torch
tag = sys.argv[1]
store = HostKVStore.create(tag, PageShape(2, 1, 4, 8, torch.float32), 4)
seg = Segment(new_segment_name(tag, 0), 4096, create=True)
attached = Segment(seg.name, 4096, create=False)  # a reader's mapping: never unlinked by it
print(store.name, seg.name, flush=True)
# The watchdog's thread ends the process while the main thread is blocked (as in a collective).
threading.Thread(target=lambda: (time.sleep(0.2), hard_exit(3)), daemon=True).start()
time.sleep(60)
"""


def test_hard_exit_unlinks_the_segments_this_process_created() -> None:
    """A watchdog verdict ends the process with ``os._exit`` (no ``finally`` runs): the Seesaw
    host KV store and SiDP weight segments it created must not outlive it."""
    tag = f"hardexit{os.getpid()}"
    done = subprocess.run(
        [sys.executable, "-c", _HARD_EXIT, tag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    names = done.stdout.split()
    assert len(names) == 2 and all(tag in n for n in names), done.stdout
    assert not [n for n in names if (shm_segments.SHM_DIR / n).exists()]


def test_created_by_keeps_only_the_segments_of_the_given_creators() -> None:
    mine = shm_segments.segment_name("gearshift-sidp-", "local", "-l0-t0")
    other = f"gearshift-sidp-local-{os.getpid() + 1}-0123456789ab-l1-t0"
    also_mine = shm_segments.segment_name("gearshift-kv-", "k")  # no suffix
    names = [mine, other, also_mine, "gearshift-sidp-garbage"]
    assert shm_segments.created_by(names, [os.getpid()]) == [mine, also_mine]
    assert shm_segments.created_by(names, [os.getpid() + 1]) == [other]
    assert shm_segments.created_by(names, []) == []
