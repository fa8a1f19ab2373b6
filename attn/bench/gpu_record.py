"""What ``attn gpu-check`` records, and how: the run's flat folder (:data:`FILES`, described
in docs/gpu.md), a stage's context, the writers of results.json and results.md (rewritten
after every stage, so a run killed in its third stage keeps the first two), and ``--merge``.
Every row repeats the header's :data:`ROW_ORIGIN`, so rows of merged runs keep their origin.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = 1
STATUSES = ("done", "skipped", "failed", "out of time")
# fields of the header that every row repeats
ROW_ORIGIN = ("device_name", "torch", "triton", "date", "command")
FILES = ("results.json", "results.md", "pytest.txt", "log.txt", "speed.png", "memory.png",
         "decode.png", "fused_cuda_table.json")


@dataclass
class StageContext:
    """What a stage function gets in its own process: where to log and record, and its time
    box. Rows and notes go to ``scratch`` (JSON lines outside the output folder) and reach
    results.json when the stage ends or is cut."""

    name: str
    out: str
    scratch: str
    deadline: float  # time.time() at which the stage is cut
    dry_run: bool
    cores: int
    tests: str  # the repository's tests folder (correctness stage)
    budget_s: float = 0.0  # the stage's whole box, for plans that scale with it
    env: dict = field(default_factory=dict)  # the ceilings measured by the env stage

    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, line: str) -> None:
        """One progress line: printed, and appended to log.txt at once."""
        text = f"[{self.name}] {line}"
        print(text, flush=True)
        with open(Path(self.out) / "log.txt", "a") as f:
            f.write(text + "\n")

    def _put(self, record: dict) -> None:
        with open(self.scratch, "a") as f:
            f.write(json.dumps(record, allow_nan=False, default=str) + "\n")

    def row(self, **fields) -> None:
        self._put({"row": {"stage": self.name, **fields}})

    def dropped(self, what: str, why: str) -> None:
        """A point the stage leaves out to fit its box (or that cannot run here at all)."""
        self._put({"dropped": f"{what}: {why}"})
        self.log(f"dropped {what}: {why}")

    def running(self, what: str) -> None:
        """The point now running: named in the status if the box cuts the stage there."""
        self._put({"running": what})

    def info(self, **fields) -> None:
        """Stage-level facts (the env stage's device, a pick of the autotuner)."""
        self._put({"info": fields})


def exc_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (cut to ``limit`` characters): a failed point's
    note."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:limit]}"


def read_scratch(path: str | Path) -> dict:
    """A stage's records: rows, dropped points, info, the last point started."""
    got = {"rows": [], "dropped": [], "info": {}, "running": None, "error": None}
    p = Path(path)
    if not p.exists():
        return got
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        for kind, value in rec.items():  # one of row, dropped, info, running, error
            if kind in ("row", "dropped"):
                got["rows" if kind == "row" else "dropped"].append(value)
            elif kind == "info":
                got["info"].update(value)
            else:
                got[kind] = value
    return got


def stage_entry(status: str, *, why: str = "", seconds: float = 0.0, dropped=(),
                budget_s: float = 0.0) -> dict:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    return {"status": status, "why": why, "seconds": round(seconds, 1),
            "budget_s": round(budget_s, 1), "dropped": list(dropped)}


def write_results(out: Path, doc: dict) -> None:
    """results.json and results.md from the run so far (after every stage)."""
    from attn.bench import gpu_tables

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False, default=str) + "\n")
    tmp.replace(out / "results.json")  # a kill mid-write leaves the previous file whole
    (out / "results.md").write_text(gpu_tables.markdown(doc))


def merge_rows(path: str | Path, rows: list[dict], about: str) -> dict:
    """Merge ``rows`` into the committed table at ``path`` (``{"about", "rows"}``): a row
    replaces the one with its ``key``, rows sorted by key; returns the table written. The
    tables a GPU run measures (the fused-cuda verification, the tuned triton configs)."""
    path = Path(path)
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    merged = {r["key"]: r for r in old}
    merged.update({r["key"]: r for r in rows})
    table = {"about": about, "rows": sorted(merged.values(), key=lambda r: r["key"])}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table


def load(folder: str | Path) -> dict:
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise ValueError(f"--merge: {folder} has no results.json")
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA or "stages" not in doc:
        raise ValueError(f"--merge: {path} is not an attn gpu-check result")
    return doc


_RANK = {"done": 3, "failed": 2, "out of time": 1, "skipped": 0}


def merge(docs: list[dict], command: str) -> dict:
    """Join runs: every row of every run (each row names its run), and per stage the status
    of the run that got furthest with it (done, then failed, then out of time, then
    skipped); a tie goes to the later run."""
    stages: dict[str, dict] = {}
    for i, doc in enumerate(docs):
        for name, entry in doc["stages"].items():
            old = stages.get(name)
            if old is None or _RANK[entry["status"]] >= _RANK[old["status"]]:
                stages[name] = {**entry, "run": i}
    header = {**docs[-1]["header"], "command": command, "merged": True,
              "runs": [d["header"] for d in docs],
              "elapsed_s": sum(d["header"].get("elapsed_s", 0) for d in docs)}
    return {"schema": SCHEMA, "header": header, "stages": stages,
            "rows": [r for d in docs for r in d["rows"]]}


def merge_folders(folders: list[Path], out: Path, command: str) -> dict:
    """``attn gpu-check --merge``: results.json and results.md of the joined runs, their
    pytest.txt and log.txt one after the other, and the PNGs drawn again from all rows."""
    from attn.bench import gpu_tables

    docs = [load(f) for f in folders]
    doc = merge(docs, command)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("pytest.txt", "log.txt"):
        parts = [f"== {f} ==\n{(Path(f) / name).read_text()}" for f in folders
                 if (Path(f) / name).is_file()]
        if parts:
            (out / name).write_text("\n".join(parts))
    doc["header"]["plots"] = [p.name for p in gpu_tables.plots(doc, out)]
    write_results(out, doc)
    return doc
