"""Live attacks: watch a federated run folder and attack each capture batch as it arrives.

The curious server writes each capture atomically (a hidden temporary folder renamed into
place), so a watcher sees only complete captures. Each poll attacks every new gradient capture
in one batched run under OUT/rRRRR-NN, while federated training goes on; the watch ends when the
federated run has written its final results and every capture is attacked.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedsim.atomic import atomic_write
from fedsim.capture import list_captures

from .config import ConfigError, RunConfig
from .pipeline import run_attack


def _finished(run_dir: Path) -> bool:
    return (run_dir / "results.json").is_file()


def watch(
    run_dir: Path | str,
    out_dir: Path | str,
    cfg: RunConfig,
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    settle_polls: int = 5,
    log: Callable[[str], Any] = print,
) -> list[dict[str, Any]]:
    """Attack captures under ``run_dir`` as they appear. Returns one summary per attacked batch."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done_file = out_dir / "attacked.json"
    attacked: set[str] = set(json.loads(done_file.read_text())) if done_file.exists() else set()
    summaries = []
    started = time.time()
    log(f"watching {run_dir} for captures (results in {out_dir})")
    while True:
        finished = _finished(run_dir)  # read BEFORE listing: no capture can follow a finished run
        new = [p for p in list_captures(run_dir) if p.name not in attacked]
        for _ in range(settle_polls):  # a round's captures land one by one: let the round settle
            if not new:
                break
            time.sleep(poll_s)
            more = [p for p in list_captures(run_dir) if p.name not in attacked]
            if len(more) == len(new):
                break
            new = more
        if new:
            round_no = int(new[0].name[1:5]) if new[0].name.startswith("r") else 0
            batch_dir = out_dir / f"r{round_no:04d}-{len(summaries):02d}"
            victims = dataclasses.replace(cfg.victims, source="captures", captures=str(run_dir), max_captures=0)
            batch_cfg = dataclasses.replace(cfg, victims=victims)
            log(f"attacking {len(new)} new capture(s) of round {round_no} -> {batch_dir}")
            try:
                result = run_attack(batch_cfg, batch_dir, progress=False, log=log, only=new)
            except ConfigError as err:  # every new capture was bad: reported, and the watch goes on
                log(f"skipped round {round_no}: {err}")
            else:
                result["captures"] = [p.name for p in new]
                summaries.append(result)
            attacked.update(p.name for p in new)
            atomic_write(done_file, json.dumps(sorted(attacked)))
            continue
        if finished:
            log(f"federated run finished; {len(attacked)} capture(s) attacked")
            return summaries
        if timeout_s is not None and time.time() - started > timeout_s:
            log("watch timed out")
            return summaries
        time.sleep(poll_s)
