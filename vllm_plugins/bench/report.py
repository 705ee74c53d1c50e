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


# The per-category table's columns: header, and the cell (None: no value).
COLUMNS = (
    ("category", lambda r: r["category"]),
    ("method", lambda r: r["method"]),
    ("MAT", lambda r: f"{r['MAT']:.2f}"),
    ("tok/s", lambda r: f"{r['tok/s']:.1f}"),
    ("speedup", lambda r: None if r.get("speedup") is None else f"{r['speedup']:.2f}x"),
    ("mismatches", lambda r: None if r.get("mismatches") is None
     else f"{r['mismatches']}/{r['requests']}"),
)


def markdown(rows: list[dict]) -> str:
    """The per-category table, then each method's acceptance over the run.

    A column that no row has a value for is left out: speedups and mismatch
    counts need the no-speculation engine, which ``--mat-only`` skips.
    Acceptance (accepted / drafted tokens) comes from an engine's counters,
    which a batch shares among its requests' categories, so it is given per
    method, not per category.
    """
    cols = [(h, cell) for h, cell in COLUMNS if any(cell(r) is not None for r in rows)]
    lines = ["| " + " | ".join(h for h, _ in cols) + " |",
             "|" + "|".join("---" if h in ("category", "method") else "---:"
                            for h, _ in cols) + "|"]
    for r in rows:
        cells = (cell(r) for _, cell in cols)
        lines.append("| " + " | ".join("" if c is None else c for c in cells) + " |")
    accepted = [(r["method"], r["acceptance"]) for r in rows
                if r["category"] == "overall" and r.get("acceptance") is not None]
    if accepted:
        lines += ["", "| method | acceptance (accepted / drafted) |", "|---|---:|"]
        lines += [f"| {m} | {a:.2f} |" for m, a in accepted]
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    # MAT-only runs (no baseline) have no speedups: one panel.
    keys = ("MAT", "speedup") if any(r.get("speedup") for r in rows) else ("MAT",)
    width_in = max(8, len(cats) * 1.3)
    fig, axes = plt.subplots(1, len(keys), squeeze=False,
                             figsize=(width_in if len(keys) == 2 else width_in / 2 + 2, 4.5))
    axes = axes[0]
    width = 0.8 / max(len(methods), 1)
    for ax, key in zip(axes, keys):
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


def ratio_ci(base: list[float], other: list[float], *, level: float = 0.95,
             n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """sum(base) / sum(other) and its bootstrap interval over paired batches.

    Each batch ran on every engine back to back, so host noise that lasts a
    batch hits both sides of a pair; resampling pairs measures what is left.
    """
    import numpy as np

    b = np.asarray(base, dtype=np.float64)
    o = np.asarray(other, dtype=np.float64)
    if len(b) == 0 or o.sum() <= 0:
        return float("nan"), float("nan"), float("nan")
    point = float(b.sum() / o.sum())
    if len(b) < 2:
        return point, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(b), size=(n_boot, len(b)))
    ratios = b[idx].sum(1) / np.maximum(o[idx].sum(1), 1e-12)
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return point, float(lo), float(hi)


def controller_delta(before: dict | None, after: dict) -> dict:
    """What a draft-length controller did between two stats() snapshots
    (counters subtract; the cost model is the one learned by ``after``)."""
    before = before or {}
    out = {"policy": after.get("policy")}
    for key in ("steps", "decisions", "zero_choices", "no_draft", "probes",
                "explore_steps", "rest_steps", "idle_probes"):
        if key in after:
            out[key] = after[key] - before.get(key, 0)
    hist = after.get("k_histogram")
    if hist is not None:
        prev = before.get("k_histogram") or [0] * len(hist)
        h = [a - b for a, b in zip(hist, prev)]
        out["k_histogram"] = h
        total = sum(h)
        out["mean_k"] = sum(i * v for i, v in enumerate(h)) / total if total else 0.0
    if out.get("decisions"):
        out["zero_fraction"] = out.get("zero_choices", 0) / out["decisions"]
    if "cost_model" in after:
        out["cost_model"] = after["cost_model"]
    if "trees" in after:
        out["trees"] = _trees_delta(before.get("trees") or {}, after["trees"])
    return out


def _trees_delta(before: dict, after: dict) -> dict:
    """The tree policy's counts between two snapshots: request-steps that
    offered a tree, nodes offered and kept per such row, and steps verified
    in the tree shape or as re-laid chains (its stats give means over its
    life; the totals behind them subtract)."""
    def total(snap, key):
        return snap.get(key, 0.0) * snap.get("rows", 0)

    rows = after.get("rows", 0) - before.get("rows", 0)
    out = {"rows": rows}
    for key in ("mean_nodes_offered", "mean_nodes_kept"):
        out[key] = (total(after, key) - total(before, key)) / rows if rows else 0.0
    for key in ("tree_steps", "chain_steps"):
        out[key] = after.get(key, 0) - before.get(key, 0)
    return out


def tree_markdown(rows: list[dict]) -> str:
    """One line per (batch size, method) whose policy shaped trees: how many
    nodes it was offered and kept per request-step, and in which shape its
    steps were verified."""
    lines = ["| batch | method | tree rows | nodes offered / row | nodes kept / row | "
             "steps as tree / as chain |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        t = r.get("trees")
        if t and t.get("rows"):
            lines.append(f"| {r['batch']} | {r['method']} | {t['rows']} | "
                         f"{t['mean_nodes_offered']:.1f} | {t['mean_nodes_kept']:.1f} | "
                         f"{t['tree_steps']} / {t['chain_steps']} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def controller_markdown(rows: list[dict]) -> str:
    """One line per (batch size, method): how often k = 0, the k histogram,
    steps rested, and the learned step-time curve t = a + b*tokens + c*batch
    (+ d on a step that verifies drafts, + e on a step of a new token count,
    + f on a step that verifies trees, or + g a token of such a step)."""
    lines = ["| batch | method | decisions | k = 0 | mean k | k histogram (0..K) | "
             "explore steps | rest steps / steps | learned t(step) |",
             "|---:|---|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        cm = r.get("cost_model") or {}
        if cm.get("warm"):
            curve = (f"{1e3 * cm['intercept_s']:.1f} ms + {1e3 * cm['per_token_s']:.2f} "
                     f"ms/token + {1e3 * cm['per_request_s']:.2f} ms/request")
            if cm.get("verify_step_s") is not None:
                curve += (f"; verifying +{1e3 * cm['verify_step_s']:.1f} ms, "
                          f"new size +{1e3 * cm.get('new_shape_s', 0.0):.1f} ms")
            if cm.get("tree_token_s"):
                curve += f"; tree token +{1e3 * cm['tree_token_s']:.2f} ms"
            elif cm.get("tree_step_s") is not None:
                curve += f"; tree step +{1e3 * cm['tree_step_s']:.1f} ms"
        else:
            curve = "prior" if cm else ""
        zf = r.get("zero_fraction")
        rest = (f"{r['rest_steps']} / {r.get('steps', 0)}" if "rest_steps" in r else "")
        lines.append(
            f"| {r['batch']} | {r['method']} | {r.get('decisions', 0)} | "
            f"{'' if zf is None else f'{100 * zf:.1f}%'} | {r.get('mean_k', 0):.2f} | "
            f"{' '.join(map(str, r.get('k_histogram', [])))} | "
            f"{r.get('explore_steps', '')} | {rest} | {curve} |")
    return "\n".join(lines)


def speedup_plot(summary: list[dict], path: str, title: str) -> None:
    """Overall speedup over no speculation per batch size, with intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in summary))
    sizes = sorted({r["batch"] for r in summary})
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods:
        pts = sorted((r["batch"], r["speedup"], r["lo"], r["hi"]) for r in summary
                     if r["method"] == m)
        x = [sizes.index(p[0]) for p in pts]
        y = [p[1] for p in pts]
        err = [[max(p[1] - p[2], 0) if p[2] == p[2] else 0 for p in pts],
               [max(p[3] - p[1], 0) if p[3] == p[3] else 0 for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m)
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"batch {s}" for s in sizes])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("speedup over no speculation (95% CI)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def wide_markdown(rows: list[dict], methods: list[str] | None = None) -> str:
    """One line per category, "MAT / speedup" per method (the docs' layout)."""
    methods = methods or [m for m in dict.fromkeys(r["method"] for r in rows)
                          if m != "none"]
    cats = list(dict.fromkeys(r["category"] for r in rows))
    by = {(r["category"], r["method"]): r for r in rows}
    head = "| category | none tok/s | " + " | ".join(
        f"{m} MAT / speedup" for m in methods) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(methods)]
    for c in cats:
        base = by.get((c, "none"))
        cells = []
        for m in methods:
            r = by.get((c, m))
            cells.append("" if r is None else
                         f"{r['MAT']:.2f} / {r['speedup']:.2f}x" if r["speedup"]
                         else f"{r['MAT']:.2f} / -")
        tps = "" if base is None else f"{base['tok/s']:.1f}"
        lines.append(f"| {c} | {tps} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mat_by_size_plot(rows: list[dict], sizes: dict[int, str], path: str, title: str,
                     baseline: str | None = None) -> None:
    """Overall MAT against draft size ({size: method}), one grey line per
    category behind it, and ``baseline``'s overall MAT as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mat = {(r["category"], r["method"]): r["MAT"] for r in rows}
    xs = sorted(sizes)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c in dict.fromkeys(r["category"] for r in rows):
        if c != "overall":
            ax.plot(xs, [mat[c, sizes[x]] for x in xs], color="0.8", lw=0.8)
    ax.plot(xs, [mat["overall", sizes[x]] for x in xs], "o-", label="overall")
    if baseline is not None:
        ax.axhline(mat["overall", baseline], ls="--", label=f"{baseline}, overall")
    ax.set_xticks(xs)
    ax.set_xlabel("draft size (nodes per request)")
    ax.set_ylabel("MAT (grey: one line per category)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
