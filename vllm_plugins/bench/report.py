"""Per-category aggregation, a markdown table and a PNG plot."""

from __future__ import annotations

from collections import defaultdict


class Tally:
    """Sums per (method, category): tokens, forwards, seconds, mismatches."""

    def __init__(self):
        self.rows = defaultdict(lambda: {"tokens": 0, "forwards": 0, "seconds": 0.0,
                                         "mismatches": 0, "requests": 0})

    def add(self, method, category, tokens, forwards, seconds, mismatch):
        for key in ((method, category), (method, "overall")):
            r = self.rows[key]
            r["tokens"] += tokens
            r["forwards"] += forwards
            r["seconds"] += seconds
            r["mismatches"] += int(mismatch)
            r["requests"] += 1

    def table(self, methods, categories, acceptance: dict | None = None) -> list[dict]:
        out = []
        for cat in [*categories, "overall"]:
            base = self.rows.get(("none", cat))
            for m in methods:
                r = self.rows.get((m, cat))
                if r is None or r["forwards"] == 0:
                    continue
                tps = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
                speed = (base["seconds"] / r["seconds"]
                         if base and r["seconds"] and base["tokens"] == r["tokens"]
                         else (tps / (base["tokens"] / base["seconds"]) if base else None))
                out.append({
                    "category": cat, "method": m,
                    "MAT": r["tokens"] / r["forwards"],
                    "acceptance": (acceptance or {}).get(m) if cat == "overall" else None,
                    "tok/s": tps, "speedup": speed,
                    "mismatches": r["mismatches"], "requests": r["requests"],
                })
        return out


def markdown(rows: list[dict]) -> str:
    head = "| category | method | MAT | accept | tok/s | speedup | mismatches |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['category']} | {r['method']} | {r['MAT']:.2f} | {acc} | "
                     f"{r['tok/s']:.1f} | {sp} | {r['mismatches']}/{r['requests']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, len(cats) * 1.3), 4.5))
    width = 0.8 / max(len(methods), 1)
    for ax, key in zip(axes, ("MAT", "speedup")):
        for j, m in enumerate(methods):
            vals = [next((r[key] or 0 for r in rows
                          if r["category"] == c and r["method"] == m), 0) for c in cats]
            ax.bar([i + j * width for i in range(len(cats))], vals, width, label=m)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(cats))])
        ax.set_xticklabels(cats, rotation=45, ha="right", fontsize=8)
        ax.set_title(key)
        ax.axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def title(model: str, settings: str) -> str:
    """The line that says what ran where and when, on tables and plots."""
    import os
    import platform
    import time
    from pathlib import Path

    return (f"{Path(model).name} {settings} "
            f"{platform.processor() or platform.machine()} {os.cpu_count()} cpus "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def write(out_dir: str, stem: str, rows: list[dict], heading: str, data: dict) -> str:
    """Prints the table; writes STEM.md, STEM.png and STEM.json under out_dir."""
    import json
    from pathlib import Path

    table = markdown(rows)
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, str(out / f"{stem}.png"), heading)
    (out / f"{stem}.md").write_text(f"{heading}\n\n{table}\n")
    (out / f"{stem}.json").write_text(json.dumps({"rows": rows, **data}, indent=1,
                                                 default=str))
    print(f"\nwrote {out}/{stem}.md, {stem}.png, {stem}.json")
    return table
