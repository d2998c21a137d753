"""In-process profiler of the operator for ``bench_fleet.py --profile DIR`` (not imported
by anything else: ``bench_fleet.py`` puts this folder on the operator's ``PYTHONPATH``).

Active only in a ``ckpt-operator`` process with ``FLEETPROF_DIR`` set:

* a sampling thread (``FLEETPROF_HZ``, default 200/s) counts the Python stacks of every
  thread that is not idle (waiting in ``select``, on a queue or a lock, reading a
  socket); ``SIGUSR2`` (and the exit) writes those since the previous dump as collapsed
  stacks (``stacks-<n>.txt``, flame-graph input);
* ``SIGUSR1`` writes ``heap-<n>.txt``: after ``gc.collect()``, the live objects by type,
  the sizes of the operator's caches, and (with ``FLEETPROF_TRACEMALLOC=1``, tracing from
  the first dump on with ``FLEETPROF_FRAMES`` frames) the top allocation sites of what
  was allocated since the first dump and still lives; then ``malloc_trim(0)`` and the
  RSS before/after it.
"""

from __future__ import annotations

import atexit
import collections
import cProfile
import ctypes
import gc
import os
import signal
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from types import FrameType

_IDLE = {
    *("select", "_worker", "wait", "read", "readinto", "recv_into", "do_poll"),
    *("_wait_for_tstate_lock", "get"),
}


def _where(frame: FrameType) -> str:
    code = frame.f_code
    parts = code.co_filename.split("/")
    short = "/".join(parts[-2:])
    return f"{short}:{code.co_name}"


class _Sampler:
    def __init__(self, out: Path, hz: float) -> None:
        self.out = out
        self.interval = 1.0 / hz
        self.counts: collections.Counter[str] = collections.Counter()
        self.idle = 0
        self.dumps = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="fleetprof", daemon=True)

    def run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if frame.f_code.co_name in _IDLE:
                    self.idle += 1
                    continue
                stack: list[str] = []
                f: FrameType | None = frame
                while f is not None:
                    stack.append(_where(f))
                    f = f.f_back
                group = names.get(ident, "?").rstrip("0123456789_")
                self.counts[";".join([group, *reversed(stack)])] += 1

    def dump(self, *_: object) -> None:
        """Write the samples since the last dump (``stacks-<n>.txt``) and start afresh."""
        counts, idle = self.counts, self.idle
        self.counts, self.idle = collections.Counter(), 0
        self.dumps += 1
        with open(self.out / f"stacks-{self.dumps}.txt", "w") as f:
            for stack, n in counts.most_common():
                f.write(f"{stack} {n}\n")
            f.write(f"idle {idle}\n")


Row = tuple[int, float, float]  # calls, own CPU seconds, CPU seconds with callees


class _Deterministic:
    """cProfile in every thread, timed by the thread's CPU clock; ``dump`` writes the
    functions' calls and CPU time since the previous dump (``profile-<n>.txt``)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.profilers: list[tuple[str, cProfile.Profile]] = []
        self.last: dict[tuple[str, str], Row] = {}
        self.dumps = 0
        self._add("MainThread").enable()
        run = threading.Thread.run
        add = self._add

        def profiled(thread: threading.Thread) -> None:
            prof = add(thread.name.rstrip("0123456789_"))
            prof.enable()
            try:
                run(thread)
            finally:
                prof.disable()

        threading.Thread.run = profiled  # type: ignore[method-assign]

    def _add(self, group: str) -> cProfile.Profile:
        prof = cProfile.Profile(time.thread_time)
        self.profilers.append((group, prof))
        return prof

    def _totals(self) -> dict[tuple[str, str], Row]:
        rows: dict[tuple[str, str], Row] = {}
        for group, prof in list(self.profilers):
            for e in prof.getstats():
                code = e.code
                label = (
                    f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_firstlineno}"
                    f"({code.co_name})"
                    if not isinstance(code, str)
                    else code
                )
                n, tt, ct = rows.get((group, label), (0, 0.0, 0.0))
                rows[(group, label)] = (n + e.callcount, tt + e.inlinetime, ct + e.totaltime)
        return rows

    def dump(self, *_: object) -> None:
        now = self._totals()
        diff: dict[tuple[str, str], Row] = {}
        for key, (n, tt, ct) in now.items():
            n0, tt0, ct0 = self.last.get(key, (0, 0.0, 0.0))
            if n > n0:
                diff[key] = (n - n0, tt - tt0, ct - ct0)
        self.last = now
        self.dumps += 1
        groups: collections.Counter[str] = collections.Counter()
        by_func: dict[str, Row] = {}
        for (group, label), (n, tt, ct) in diff.items():
            groups[group] += tt  # type: ignore[assignment]
            n0, tt0, ct0 = by_func.get(label, (0, 0.0, 0.0))
            by_func[label] = (n0 + n, tt0 + tt, ct0 + ct)
        lines = [f"cpu by thread group: {dict(groups)}", "--- by own time"]
        for label, (n, tt, ct) in sorted(by_func.items(), key=lambda kv: -kv[1][1])[:80]:
            lines.append(f"{tt:9.3f} {ct:9.3f} {n:9d} {label}")
        lines.append("--- by time with callees")
        for label, (n, tt, ct) in sorted(by_func.items(), key=lambda kv: -kv[1][2])[:150]:
            lines.append(f"{tt:9.3f} {ct:9.3f} {n:9d} {label}")
        (self.out / f"profile-{self.dumps}.txt").write_text("\n".join(lines) + "\n")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cache_sizes() -> dict[str, int]:
    out: dict[str, int] = {}
    for obj in gc.get_objects():
        kind = type(obj).__name__
        if kind in ("ObjectCache", "PodIndex", "RecoveryScheduler", "RetentionLoop"):
            inner = getattr(obj, "_items", None) or getattr(obj, "_by_job", None)
            inner = inner or getattr(obj, "_tasks", None) or getattr(obj, "_policies", None)
            out[f"{kind}@{id(obj):x}"] = len(inner or ())
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks"),
            *("fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


def _glibc() -> list[str]:
    """glibc malloc's totals (``mallinfo2``): bytes in use, free inside its heaps, mmapped;
    and the RSS by kind of mapping (``/proc/self/smaps``: heap, anonymous, stacks, files)."""
    lines = []
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
        fn.restype = _MallInfo2
        m = fn()
        lines.append(
            f"glibc in use {m.uordblks / 2**20:.1f} MiB, free in heaps {m.fordblks / 2**20:.1f} "
            f"MiB, heaps {m.arena / 2**20:.1f} MiB, mmapped {m.hblkhd / 2**20:.1f} MiB"
        )
    except (OSError, AttributeError):
        pass
    kinds: collections.Counter[str] = collections.Counter()
    kind = "?"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's header line
                path = head[5] if len(head) > 5 else ""
                kind = path if path.startswith("[") else ("file" if path else "anonymous")
            elif head[0] == "Rss:":
                kinds[kind] += int(head[1]) * 1024
    lines.append(
        "rss by mapping: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in kinds.most_common())
    )
    return lines


def _mallocstats(out: Path) -> list[str]:
    """pymalloc's arena summary (``sys._debugmallocstats`` writes it to fd 2)."""
    path = out / ".mallocstats"
    saved = os.dup(2)
    try:
        with open(path, "w") as f:
            os.dup2(f.fileno(), 2)
            sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    keep = ("# arenas", "# bytes in", "Total")
    return [
        f"pymalloc {line.strip()}"
        for line in path.read_text().splitlines()
        if line.startswith(keep)
    ]


#: ids of the objects the first heap dump found (later dumps list the others alive)
_BASELINE: set[int] = set()


def _survivors(objects: list[object]) -> list[str]:
    """The objects alive now that the first dump did not see: by type, and for the
    commonest types who holds them (the referrers' types, one level up)."""
    new = {id(o): o for o in objects if id(o) not in _BASELINE}
    by_type = collections.Counter(type(o).__qualname__ for o in new.values())
    lines = [f"new {n} {t}" for t, n in by_type.most_common(25)]
    top = {t for t, _ in by_type.most_common(8)}
    holders: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in objects:  # one pass over everything: who refers to a new object of a top type
        for o in gc.get_referents(r):
            kind = type(o).__qualname__
            if kind in top and id(o) in new:
                name = type(r).__qualname__
                if isinstance(r, dict):
                    name += "{" + ",".join(sorted(map(str, list(r)[:4])))[:100] + "}"
                holders[kind][name] += 1
    for kind in sorted(top, key=lambda k: -by_type[k]):
        lines += [f"held {kind} <- {n} {h}" for h, n in holders[kind].most_common(6)]
    return lines


def _heap(out: Path, counter: list[int]) -> None:
    counter[0] += 1
    gc.collect()
    objects = gc.get_objects()
    types = collections.Counter(type(o).__qualname__ for o in objects)
    lines = [f"rss {_rss() / 2**20:.1f} MiB", f"gc objects {sum(types.values())}"]
    lines += [f"cache {k} {v}" for k, v in _cache_sizes().items()]
    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        stats = snap.statistics("lineno")
        lines.append(f"traced {sum(s.size for s in stats) / 2**20:.1f} MiB")
        lines += [f"alloc {s.size / 2**10:.0f} KiB x{s.count} {s.traceback}" for s in stats[:40]]
        # traced since the first dump: what lives now of what was allocated after it
        by_site = sorted(snap.statistics("traceback"), key=lambda s: s.count, reverse=True)
        for s in by_site[:40]:
            where = " <- ".join(str(f) for f in reversed(s.traceback))
            lines.append(f"since-first {s.count} blocks {s.size / 2**10:.0f} KiB {where}")
    elif os.environ.get("FLEETPROF_TRACEMALLOC") == "1":
        # from the first dump (the baseline) on: startup untraced (slow), and every block
        # traced later is one allocated after the baseline
        tracemalloc.start(int(os.environ.get("FLEETPROF_FRAMES", "1")))
    if _BASELINE:
        lines += _survivors(objects)
    else:
        _BASELINE.update(id(o) for o in objects)
    del objects
    lines += [f"type {n} {t}" for t, n in types.most_common(60)]
    lines += _mallocstats(out)
    lines += _glibc()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        lines.insert(1, f"rss after malloc_trim {_rss() / 2**20:.1f} MiB")
    except OSError:
        pass
    (out / f"heap-{counter[0]}.txt").write_text("\n".join(lines) + "\n")


def _install() -> None:
    where = os.environ.get("FLEETPROF_DIR")
    if not where or not sys.argv or not sys.argv[0].endswith("ckpt-operator"):
        return
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    hz = float(os.environ.get("FLEETPROF_HZ", "200"))
    if os.environ.get("FLEETPROF_MODE") == "cprofile":
        prof = _Deterministic(out)
        atexit.register(prof.dump)
        signal.signal(signal.SIGUSR2, prof.dump)
    elif hz > 0:
        sampler = _Sampler(out, hz)
        sampler.thread.start()
        atexit.register(sampler.dump)
        signal.signal(signal.SIGUSR2, sampler.dump)
    else:  # no CPU profile: the bench's SIGUSR2 must not end the operator
        signal.signal(signal.SIGUSR2, lambda *_: None)
    counter = [0]
    signal.signal(signal.SIGUSR1, lambda *_: _heap(out, counter))


_install()
