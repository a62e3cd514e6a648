"""What `pie engines`, `pie doctor` and `pie plan --emit` show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pie.contract import EngineStatus
from pie.plugins import EngineError, EngineRegistry, requested_engines
from pie.probe_cache import ProbeCache

KNOWN_ENGINES = {
    "cpu": "pie-engine-cpu",
    "cuda": "pie-engine-cuda",
    "metal": "pie-engine-metal",
    "vulkan": "pie-engine-vulkan",
    "wgpu": "pie-engine-wgpu",
    "xla": "pie-engine-xla",
}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _status_record(status: EngineStatus) -> dict[str, Any]:
    return {
        "name": status.name,
        "version": status.version,
        "distribution": status.distribution,
        "status": status.status,
        "reason": status.reason,
        "fix": status.fix,
        "priority": status.info.priority if status.info else None,
        "kernel_languages": list(status.info.kernel_languages) if status.info else [],
        "devices": [
            {
                "key": d.key,
                "name": d.name,
                "vendor": d.vendor,
                "architecture": d.architecture,
                "kind": d.kind,
                "memory_bytes": d.memory_bytes,
                "driver": d.driver,
            }
            for d in status.devices
        ],
    }


def engines_report(registry: EngineRegistry | None = None, cached: bool = True) -> dict[str, Any]:
    """Every engine's status and the choice. ``cached`` reuses remembered probes; without it every
    engine is probed afresh and every remembered probe forgotten (`pie engines --refresh`)."""
    if registry is None:
        cache = ProbeCache()
        if not cached:
            cache.clear()
        registry = EngineRegistry(probe_cache=cache)
    statuses = registry.statuses(cached=cached)
    try:
        name, why = registry.choose(cached=cached)
        device = registry.status(name, cached=True).devices[0]
        chosen: dict[str, Any] = {"engine": name, "device": device.key, "reason": why}
    except EngineError as exc:
        chosen = {"engine": None, "device": None, "reason": str(exc)}
    return {"engines": [_status_record(s) for s in statuses], "chosen": chosen, "unloaded": registry.unloaded}


def format_engines(report: dict[str, Any]) -> str:
    rows = [("ENGINE", "VERSION", "DISTRIBUTION", "STATUS", "KERNELS", "DEVICES")]
    reasons: dict[int, str] = {}
    for e in report["engines"]:
        devices = "; ".join(f"{d['key']} {d['name']} ({d['kind']}, {_gib(d['memory_bytes'])})" for d in e["devices"])
        rows.append((e["name"], e["version"], e["distribution"], e["status"], ",".join(e["kernel_languages"]), devices or "-"))
        if e["reason"]:
            reasons[len(rows) - 1] = e["reason"] + (f"\n    fix: {e['fix']}" if e["fix"] else "")
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for index, row in enumerate(rows):
        lines.append(("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5]).rstrip())
        if index in reasons:
            lines.append(f"    why: {reasons[index]}")
    if len(rows) == 1:
        lines.append(f"({report['unloaded'] or 'no engine installed: pip install pie-engine-cpu'})")
    chosen = report["chosen"]
    if chosen["engine"]:
        lines.append(f"\nchosen: {chosen['engine']} on {chosen['device']} ({chosen['reason']})")
    else:
        lines.append(f"\nchosen: none ({chosen['reason']})")
    return "\n".join(lines)


def doctor_report(registry: EngineRegistry | None = None) -> tuple[str, bool]:
    """Text for `pie doctor`, and whether at least one engine can run. Every engine is examined afresh
    (and what is found remembered for `pie engines`)."""
    registry = registry or EngineRegistry(probe_cache=ProbeCache())
    lines: list[str] = []
    any_ok = False
    installed = set(registry.names())
    diagnoses = registry.diagnoses()
    for status in registry.statuses():
        any_ok |= status.status == "ok"
        lines.append(
            f"{status.name} ({status.distribution} {status.version}): {status.status}"
            + (f" - {status.reason}" if status.reason else "")
        )
        if status.fix:  # it never loaded: the fix is all there is to say
            lines.append(f"  fix: {status.fix}")
            continue
        for item in diagnoses.get(status.name, []):
            mark = "ok" if item.ok else "!!"
            lines.append(f"  [{mark}] {item.what}: {item.detail}")
            if not item.ok and item.fix:
                lines.append(f"       fix: {item.fix}")
    if registry.unloaded and not installed:  # they may well be installed: none was looked for
        return f"no engine is loaded: {registry.unloaded}", False
    for name, dist in KNOWN_ENGINES.items():
        if name not in installed:
            lines.append(f"{name}: not installed (pip install {dist})")
    if not any_ok:
        requested = requested_engines()
        unknown = [name for name in requested or () if name not in installed]
        if unknown:
            lines.append(f"\nPIE_ENGINES names {', '.join(unknown)}, which is not installed (installed: "
                         f"{', '.join(sorted(installed)) or 'none'}); unset it, or name an installed engine")
        elif requested:
            lines.append(f"\nno engine PIE_ENGINES names ({', '.join(requested)}) can run here")
        else:
            lines.append("\nno engine can run here; install pie-engine-cpu: pip install pie-engine-cpu")
    return "\n".join(lines), any_ok


def emit_sources(plan: Any, folder: str) -> int:
    """Write each step's generated source (where the engine can show it) into ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for index, step in enumerate(plan.steps):
        source = plan.device.source(step.request)
        if source is None:
            continue
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{index:04d}-{step.region}-{step.kernel}")
        (out / f"{safe}.txt").write_text(source, encoding="utf-8")
        written += 1
    return written
