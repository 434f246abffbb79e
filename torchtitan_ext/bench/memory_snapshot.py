"""Where a run's reserved GPU memory came from, read from a CUDA allocator snapshot.

torchtitan writes one snapshot per rank when training runs with ``--profiler.enable_memory_snapshot``
(``<dump_folder>/profiling/memory_snapshot/step_<N>/<rank>_step_<N>.pickle``, every
``--profiler.memory_snapshot_freq`` steps). The peak that torchtitan logs as ``memory`` is what the
allocator reserved; the summary answers why it is larger than what tensors needed:

- ``reserved_gib`` / ``allocated_gib``: at the snapshot; ``free_in_segments_gib`` is their difference
  (memory the allocator holds without a tensor in it) and ``largest_free_block_mib`` its largest piece.
- ``peak_allocated_gib``: the most that tensors held at once over the recorded history.
- ``growth``: every time the allocator reserved more (``cudaMalloc`` of a segment, or pages mapped
  into an expandable segment): how much, when (seconds after the first recorded event), what tensors
  held then, the free memory its stream already held (``free_on_stream_mib``; each stream has its own
  segments) and the request that did not fit (``request_mib``), with the code that asked (``site``:
  the innermost frame outside torch; compiled graphs appear as their generated files). A request
  smaller than the free memory of its stream grew the reserve because no free piece was large enough:
  fragmentation (``while_the_stream_had_room_gib`` sums those growths).
- ``growth_by_site``: reserve growth summed by site; ``live_at_last_growth``: what tensors held the
  memory, by site, when the reserve grew for the last time (the moment that set the final reserve).
- ``growth_by_step``: reserve growth per training step (``"0"``: before step 1), from the step starts
  in torchtitan's structured log of the same rank (``<dump_folder>/structured_logs``, found next to the
  snapshot); ``steps_from`` names that log, or says why growth is not split by step.

``reserved_gib_at_first_event``: what was reserved when the recorded history begins: torchtitan starts
recording once the model is built, and the allocator keeps a ring buffer of events
(``--profiler.memory_snapshot_max_entries``) that drops the oldest once full.
"""

import bisect
import json
import os
import pickle
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

GIB = 1024**3
MIB = 1024**2
GROWTH_ACTIONS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
ALLOCATED_STATES = ("active_allocated", "active_pending_free")
BEFORE_HISTORY = "allocated before the recorded history"
TORCH_FRAME = re.compile(r"[/\\]torch[/\\]")
SNAPSHOT_RANK = re.compile(r"^(\d+)_step_\d+(?:_exit)?\.pickle$")
STRUCTURED_LOGS = "structured_logs"
CLOCK_SLACK_US = 60_000_000
"""How far outside its structured log's time span a snapshot event may lie and still be given a step."""


def snapshot_files(paths: list[str], error: Callable[[str], NoReturn]) -> list[str]:
    """``paths`` with each folder replaced by the ``.pickle`` files under it, sorted; ``error`` is called
    for a folder without any."""
    files = []
    for path in paths:
        if not os.path.isdir(path):
            files.append(path)
            continue
        found = sorted(str(p) for p in Path(path).rglob("*.pickle"))
        if not found:
            error(f"memory {path}: the folder holds no .pickle snapshots")
        files += found
    return files


def structured_log_of(snapshot_path: str) -> str | None:
    """The newest structured log torchtitan wrote for the snapshot's rank (torchtitan names snapshots
    ``<rank>_step_<N>.pickle`` and logs ``<dump_folder>/structured_logs/training.global_rank_<rank>.*.jsonl``),
    looked for in the folders above the snapshot; None when there is none."""
    path = Path(snapshot_path).resolve()
    match = SNAPSHOT_RANK.match(path.name)
    if match is None:
        return None
    for folder in list(path.parents)[:5]:
        logs = sorted((folder / STRUCTURED_LOGS).glob(f"training.global_rank_{int(match.group(1))}.*.jsonl"))
        if logs:
            return str(logs[-1])
    return None


def step_starts(log_path: str) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """``([(time_us, step)] of every step start, (first, last) time_us of the log)`` from a structured log."""
    starts, times = [], []
    with open(log_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "time_us" not in record:
                continue
            times.append(record["time_us"])
            if record.get("log_type_name") == "step_start" and "step" in record:
                starts.append((record["time_us"], int(record["step"])))
    if not times:
        raise ValueError("no timed records")
    return sorted(starts), (min(times), max(times))


def steps_of(growth_times_us: list[int], snapshot_path: str) -> tuple[list[int] | None, str]:
    """The training step of each growth (0: before step 1) and where the steps came from; ``None`` and
    the reason when the snapshot has no structured log whose clock spans its events."""
    log = structured_log_of(snapshot_path)
    if log is None:
        return None, f"not split by step: no {STRUCTURED_LOGS}/ of this rank above the snapshot"
    try:
        starts, (first_us, last_us) = step_starts(log)
    except (OSError, ValueError) as e:
        return None, f"not split by step: {log}: {e}"
    if not starts:
        return None, f"not split by step: {log} records no step start"
    if any(t < first_us - CLOCK_SLACK_US or t > last_us + CLOCK_SLACK_US for t in growth_times_us):
        return None, f"not split by step: the snapshot's times lie outside {log}'s"
    start_times = [t for t, _ in starts]
    steps = []
    for t in growth_times_us:
        index = bisect.bisect_right(start_times, t)
        steps.append(starts[index - 1][1] if index else 0)
    return steps, log


def frame_text(frame: dict) -> str:
    return f"{os.path.basename(frame.get('filename', '?'))}:{frame.get('line', '?')} {frame.get('name', '?')}"


def site(frames: list[dict]) -> str:
    """The innermost frame outside torch's own package (frames are innermost first); the innermost
    frame when every frame is torch's, ``"unknown"`` when the event has no frames."""
    if not frames:
        return "unknown"
    outside = next((f for f in frames if not TORCH_FRAME.search(f.get("filename", ""))), frames[0])
    return frame_text(outside)


def device_of(snapshot: dict) -> int:
    """The device whose trace the snapshot recorded (torchtitan records one device per rank)."""
    traces = snapshot.get("device_traces", [])
    recorded = [i for i, trace in enumerate(traces) if trace]
    if recorded:
        return recorded[0]
    devices = {segment["device"] for segment in snapshot["segments"]}
    if not devices:
        raise ValueError("the snapshot has neither segments nor recorded events")
    return min(devices)


def gib(size: float) -> float:
    return round(size / GIB, 3)


def allocated_change(event: dict) -> int:
    """Bytes the event adds to what tensors hold (``free_completed``: the memory is reusable again)."""
    return {"alloc": event["size"], "free_completed": -event["size"]}.get(event["action"], 0)


def reserved_change(event: dict) -> int:
    """Bytes the event adds to what the allocator holds."""
    return GROWTH_ACTIONS.get(event["action"], 0) * event["size"]


def summarize(path: str, top: int = 10) -> dict:
    """The summary of one snapshot file (see the module docstring)."""
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError("not a CUDA memory snapshot (no 'segments')")
    device = device_of(snapshot)
    segments = [s for s in snapshot["segments"] if s["device"] == device]
    events = snapshot.get("device_traces", [])[device] if snapshot.get("device_traces") else []
    blocks = [b for s in segments for b in s["blocks"]]
    free_blocks = [b["size"] for b in blocks if b["state"] == "inactive"]
    reserved_by_stream_end, allocated_by_stream_end = Counter(), Counter()
    for segment in segments:
        stream = segment.get("stream", 0)
        reserved_by_stream_end[stream] += segment["total_size"]
        allocated_by_stream_end[stream] += sum(b["size"] for b in segment["blocks"] if b["state"] in ALLOCATED_STATES)
    reserved_end, allocated_end = sum(reserved_by_stream_end.values()), sum(allocated_by_stream_end.values())

    # Replay from the first recorded event: the state then is the snapshot's less every change since.
    reserved, allocated = Counter(reserved_by_stream_end), Counter(allocated_by_stream_end)
    for event in events:
        reserved[event.get("stream", 0)] -= reserved_change(event)
        allocated[event.get("stream", 0)] -= allocated_change(event)
    reserved_at_start, start_us = sum(reserved.values()), events[0].get("time_us", 0) if events else 0
    peak_allocated = total_allocated = sum(allocated.values())
    allocated_in_history = {e["addr"] for e in events if e["action"] == "alloc"}
    live = {
        b["address"]: (b["size"], site(b["frames"]) if b.get("frames") else BEFORE_HISTORY)
        for b in blocks
        if b["state"] in ALLOCATED_STATES and b["address"] not in allocated_in_history
    }
    growths: list[dict] = []
    growth_times_us: list[int] = []
    pending_request: dict | None = None
    live_at_last_growth: dict[int, tuple[int, str]] = {}
    for event in events:
        action, size, stream = event["action"], event["size"], event.get("stream", 0)
        if reserved_change(event) > 0:
            growth_times_us.append(event.get("time_us", start_us))
            pending_request = {
                "seconds": round((event.get("time_us", start_us) - start_us) / 1e6, 3),
                "size_mib": round(size / MIB, 1),
                "reserved_gib_after": gib(sum(reserved.values()) + size),
                "allocated_gib": gib(total_allocated),
                "free_on_stream_mib": round((reserved[stream] - allocated[stream]) / MIB, 1),
                "request_mib": None,
                "site": site(event.get("frames", [])),
                "stack": [frame_text(f) for f in event.get("frames", [])[:8]],
            }
            growths.append(pending_request)
            live_at_last_growth = dict(live)
            unaccounted = total_allocated - sum(size for size, _ in live.values())
            if unaccounted > 0:
                live_at_last_growth[-1] = (unaccounted, BEFORE_HISTORY)
        reserved[stream] += reserved_change(event)
        allocated[stream] += allocated_change(event)
        total_allocated += allocated_change(event)
        peak_allocated = max(peak_allocated, total_allocated)
        if action == "alloc":
            live[event["addr"]] = (size, site(event.get("frames", [])))
            if pending_request is not None:
                pending_request["request_mib"] = round(size / MIB, 1)
                pending_request["site"] = site(event.get("frames", []))
                pending_request = None
        elif action == "free_completed":
            live.pop(event["addr"], None)

    by_site, counts = Counter(), Counter()
    for growth in growths:
        by_site[growth["site"]] += growth["size_mib"]
        counts[growth["site"]] += 1
    live_by_site = Counter()
    for size, where in live_at_last_growth.values():
        live_by_site[where] += size
    steps, steps_from = steps_of(growth_times_us, path) if growths else (None, "no growth recorded")
    by_step = Counter()
    for growth, step in zip(growths, steps or [], strict=False):
        growth["step"] = step
        by_step[step] += growth["size_mib"]
    with_room = [g for g in growths if g["request_mib"] is not None and g["free_on_stream_mib"] >= g["request_mib"]]
    return {
        "snapshot": path,
        "device": device,
        "events": len(events),
        "expandable_segments": any(s.get("is_expandable", False) for s in segments),
        "reserved_gib": gib(reserved_end),
        "allocated_gib": gib(allocated_end),
        "free_in_segments_gib": gib(reserved_end - allocated_end),
        "largest_free_block_mib": round(max(free_blocks, default=0) / MIB, 1),
        "reserved_gib_by_stream": {str(stream): gib(size) for stream, size in reserved_by_stream_end.most_common()},
        "reserved_gib_at_first_event": gib(reserved_at_start),
        "peak_allocated_gib": gib(peak_allocated),
        "growth": {
            "count": len(growths),
            "gib": gib(sum(g["size_mib"] for g in growths) * MIB),
            "while_the_stream_had_room_gib": gib(sum(g["size_mib"] for g in with_room) * MIB),
        },
        "growth_by_site": [
            {"site": where, "gib": gib(mib * MIB), "count": counts[where]} for where, mib in by_site.most_common(top)
        ],
        "growth_by_step": {str(step): gib(mib * MIB) for step, mib in sorted(by_step.items())} if steps else None,
        "steps_from": steps_from,
        "largest_growths": sorted(growths, key=lambda g: -g["size_mib"])[:top],
        "last_growth": growths[-1] if growths else None,
        "live_at_last_growth": [{"site": where, "gib": gib(size)} for where, size in live_by_site.most_common(top)],
    }


def print_summary(summary: dict) -> None:
    kind = "expandable segments" if summary["expandable_segments"] else "fixed segments"
    print(f"{summary['snapshot']}: device {summary['device']}, {summary['events']:,} recorded events, {kind}")
    print(
        f"reserved {summary['reserved_gib']:.2f} GiB, allocated {summary['allocated_gib']:.2f} GiB at the snapshot "
        f"({summary['free_in_segments_gib']:.2f} GiB held without a tensor, largest free piece "
        f"{summary['largest_free_block_mib']:.0f} MiB); peak allocated {summary['peak_allocated_gib']:.2f} GiB"
    )
    if len(summary["reserved_gib_by_stream"]) > 1:
        print(
            "reserved by stream (GiB): " + ", ".join(f"{s}: {g}" for s, g in summary["reserved_gib_by_stream"].items())
        )
    if summary["reserved_gib_at_first_event"] > 0:
        print(f"the recorded history starts with {summary['reserved_gib_at_first_event']:.2f} GiB already reserved")
    growth = summary["growth"]
    print(
        f"the reserve grew {growth['count']} times by {growth['gib']:.2f} GiB in all, "
        f"{growth['while_the_stream_had_room_gib']:.2f} GiB of it for requests smaller than the free memory "
        "their stream already held (fragmentation); by site (GiB, times):"
    )
    for row in summary["growth_by_site"]:
        print(f"  {row['gib']:8.3f} {row['count']:5d}  {row['site']}")
    if summary["growth_by_step"]:
        print(
            "by training step (GiB; step 0: before step 1): "
            + ", ".join(f"{step}: {g:.3f}" for step, g in summary["growth_by_step"].items())
        )
    elif summary["growth"]["count"]:
        print(f"growth {summary['steps_from']}")
    last = summary["last_growth"]
    if last:
        during = f" (step {last['step']})" if "step" in last else ""
        print(
            f"last growth at {last['seconds']:.1f} s{during}: +{last['size_mib']:.0f} MiB "
            f"to {last['reserved_gib_after']:.2f} GiB for a {last['request_mib']} MiB request from {last['site']}, "
            f"with {last['allocated_gib']:.2f} GiB allocated; what held memory then (GiB):"
        )
        for row in summary["live_at_last_growth"]:
            print(f"  {row['gib']:8.3f}  {row['site']}")
