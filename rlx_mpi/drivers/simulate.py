"""``rlx-mpi plan ... --simulate [generate|score]``: how long a job will take, before it is queued.

`simulate_plan` turns ``plan``'s model, placement and flags, the prompt file (its tokens: the
prefix cache's hits) and a calibration (``probe --calibrate``; without one the roofline) into
the inputs of `engine.simulate`, runs it for the planned layout (and with ``--compare`` for
every replicas x stages x tp the ranks allow), and prints the prediction, or one JSON object
(``--json``), and the ``--time-limit`` check. No MPI.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from ..errors import ConfigError

__all__ = ["simulate_plan", "parse_time_limit", "time_limit_line", "layouts", "cache_bytes"]

ROOFLINE = "the roofline (no calibration: a bound, not a measurement; run rlx-mpi probe --calibrate)"
STARTUP_FIXED_S = 2.5  # MPI start, imports, the numba cache's load, the agreed steps (warm caches: 2.3-2.6 s here)
FINISH_S = 0.5  # the last row to the launcher's exit (simulate_plan's note)
STARTUP_READ_GBPS = 0.25  # a rank's weights read from HDF5 and made resident (medium f32, 0.49 GB: 2.2 s here)


def parse_time_limit(text: str, where: str = "plan --time-limit") -> float:
    """Seconds of a batch queue's limit: Slurm's [D-]HH:MM:SS / MM:SS / minutes, or 90s, 45m, 2h, 1.5h."""
    t = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if m:
        d, a, b, c = (int(x) if x else None for x in m.groups())
        if b is None:  # Slurm: a bare number is minutes
            secs = a * 60
        elif c is None:
            secs = (a * 3600 + b * 60) if d is not None else (a * 60 + b)
        else:
            secs = a * 3600 + b * 60 + c
        secs += (d or 0) * 86400
    else:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|m|min|h)", t)
        if not m:
            raise ConfigError(where, f"got {text!r}", "give a Slurm time (2:00:00, 1-00:00:00, 90) or 90s, 45m, 2h")
        secs = float(m.group(1)) * {"s": 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
    if secs <= 0:
        raise ConfigError(where, f"got {text!r}", "give a limit > 0")
    return float(secs)


def _human(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    h, m = divmod(int(round(s / 60)), 60)
    return f"{h} h" + (f" {m} min" if m else "")


def time_limit_line(job_s: float, limit_s: float, ranks: int) -> str:
    """The ``--time-limit`` sentence: fits, or how many times the job requeues."""
    need = f"this job needs ~{_human(job_s)} on {ranks} rank{'s' if ranks != 1 else ''}; your limit is {_human(limit_s)}"
    if job_s <= limit_s:
        share = 100 * job_s / limit_s
        return f"{need}: it fits ({'under 1' if share < 1 else f'{share:.0f}'} % of the limit)"
    n = math.ceil(job_s / limit_s) - 1
    return f"{need}: it will requeue {'once' if n == 1 else f'{n} times'} (resumes are free)"


def layouts(ranks: int, n_layers: int, tp_ok) -> list[tuple[int, int]]:
    """(replicas, tp) of every grid the ranks allow: replicas x stages x tp = ranks, stages <= layers."""
    out = []
    for r in range(1, ranks + 1):
        for t in range(1, ranks // r + 1):
            if ranks % (r * t) == 0 and ranks // (r * t) <= n_layers and tp_ok(t):
                out.append((r, t))
    return out


def _weight_scale(precision: str) -> float:
    from ..config import Precision

    return Precision(precision).bytes_per_param / 4.0


def _layout(grid: Any, tp: int) -> Any:
    from ..engine.simulate import Layout

    stages = grid.replicas[0]
    precs = tuple(a.precision.split(",")[0] for a in stages)
    return Layout(replicas=len(grid.replicas), layers=tuple(len(a.layers) for a in stages), precisions=precs, tp=tp,
                  weight_scales=tuple(_weight_scale(p) for p in precs))


def _startup_s(cost: Any, layout: Any, cal: Any, stored: str | None, per_host: int = 1) -> float:
    """The slowest stage's start-up: the launch, the kernels' load and its weights made resident
    (the note). With the calibration's measured `Startup` (`model.calibration`); without it, an
    estimate from this host's jobs (`STARTUP_FIXED_S`, `STARTUP_READ_GBPS`). ``stored``: the
    checkpoint's precision (None: the precision each stage holds); ``per_host``: ranks a host.

    Note: what a stage's load costs. A stage held as stored (f32 from f32) is read and made
    resident at the calibration's ``load_gbps``, measured on that path; on the 2-core AMD VM most
    of it is the fresh memory the stage is written into (``touch_gbps``: 0.36 GB/s after the host
    took the pages back; the rest, 1 / load - 1 / touch, ~0.3 s a GB, is h5py's reads and the
    fusing). A stage converted at load (q4 from an f32 checkpoint) reads the stored bytes into
    temporaries that are freed and written again at once (never fresh), converts them (the
    calibration's ``convert`` past f32's own making resident), and faults in only what it holds:
    so its stored bytes are priced at the read's part of the load, its held bytes at the touch
    rate. Before, the stored bytes were priced at the whole load rate: the 1-rank q4 job's
    0.89 GB, 2.8 s, where its build took 2.0-2.1 s in all (h5py's reads 0.5 s, the quantizer
    1.3 s); the whole job priced 43 % long.

    The kernels. A host's first rank loads (or compiles) the family's kernels while its others
    wait (`Cluster.warm_up`); each other rank then loads them from numba's cache before its
    first read: in the 2-rank q4 job, rank 1's first read came 0.42-0.59 s after rank 0's, as
    long again as the warm-up. So a host of more ranks than one pays the kernels twice."""
    measured = getattr(cal, "startup", None)
    worst = 0.0
    for s, n in enumerate(layout.layers):
        weights = (n * cost.layer_bytes / 4.0 + (cost.embed_bytes / 4.0 if s == 0 else 0.0) +
                   (cost.head_bytes / 4.0 if s == layout.stages - 1 else 0.0)) / layout.tp  # (f32-priced bytes: weights)
        held = layout.precisions[s]
        held_bytes = weights * 4.0 * layout.weight_scales[s]
        stored_bytes = weights * 4.0 * _weight_scale(stored) if stored else held_bytes
        converted = stored is not None and stored != held
        if not measured:
            t = stored_bytes / (STARTUP_READ_GBPS * 1e9)
        elif converted:  # (the note: the read's part of the load, then the held bytes' fresh memory)
            t = max(0.0, stored_bytes / (measured.load_gbps * 1e9) - measured.touch_s(stored_bytes)) + \
                measured.touch_s(held_bytes)
        else:
            t = held_bytes / (measured.load_gbps * 1e9)
        if cal is not None and converted:
            t += weights * max(0.0, cal.convert.get(held, 0.0) - cal.convert.get("f32", 0.0))
        if measured:
            t += measured.kernels_s(held) * (2 if per_host > 1 else 1)  # (the note's kernels)
        worst = max(worst, t)
    return (measured.launch_s if measured else STARTUP_FIXED_S) + worst


def simulate_plan(args: Any, job: Any, family: Any, cfg: Any, grid: Any, tp: int, plan_for) -> int:
    """Predict the job (the module note); ``plan_for(replicas, tp)`` places another layout.

    Note: the finish. After its last row a job writes its outputs and its table, meets at the
    finish barrier, runs MPI_Finalize, and the interpreter and the launcher exit: the bench's
    jobs on the 2-core AMD VM took 0.44-0.56 s from the summary line to the launcher's exit on
    1 rank, 0.57-0.67 s on 2 (a bare mpi4py process: 0.21-0.25 s; strace: the stage's weights
    unmapped in 0.02 s, then ~0.35 s of the interpreter's teardown before the barrier), so
    `FINISH_S`, a constant: it left every whole-job prediction ~0.5 s short."""
    from ..engine.simulate import simulate_generate, simulate_score
    from ..errors import RlxError
    from ..model.calibration import load_calibration
    from ..model.cost import Machine

    what = args.simulate
    if not args.prompts and not (job and (job.generate.prompts if what == "generate" else job.score.prompts)):
        raise ConfigError("plan --simulate", "no prompt file given", "pass --prompts FILE (or set the job's "
                          f"[{what}] prompts)")
    cal = load_calibration(args.calibration) if args.calibration else None
    machine = Machine(gflops=args.gflops or Machine.gflops)
    priced_by = f"calibration {args.calibration}" if cal else ROOFLINE
    dims = family.dims(cfg)
    work = _read_work(args, job, family, cfg, dims, what)

    def predict(g: Any, t: int) -> Any:
        layout = _layout(g, t)
        # a host's ranks share its cores: the rates measured with as many ranks a host (the calibration's
        # hosts filled as when it was measured, unless --ranks-per-host says otherwise)
        per_host = args.ranks_per_host or (min(layout.ranks, cal.local_size) if cal is not None else 1)
        c = cal.sharing(per_host) if cal is not None else None
        p = (_generate if what == "generate" else _score)(work, job, args, family, cfg, layout, c, machine, priced_by,
                                                          per_host)
        return dataclasses.replace(p, finish_s=FINISH_S)

    main = predict(grid, tp)
    compared = []
    if args.compare:
        host = args.ranks_per_host or args.ranks  # (no --ranks-per-host: one host, as the calibration's)
        for r, t in layouts(args.ranks, dims.n_layers, lambda t: _tp_ok(family, cfg, t)):
            name = (f"{r} replicas x " if r > 1 else "") + f"{args.ranks // (r * t)} stage" + \
                ("s" if args.ranks // (r * t) > 1 else "") + f" x tp {t}"
            if t > 1 and host % t:
                compared.append((name, f"a TP group of {t} would span hosts of {host} ranks"))
                continue
            try:
                compared.append(predict(plan_for(r, t), t))
            except RlxError as e:
                compared.append((name, str(e).splitlines()[0].split(": ", 1)[-1].split(";")[0]))
        ok = sorted((p for p in compared if not isinstance(p, tuple)), key=lambda p: p.predicted_wall_s)
        compared = ok + [p for p in compared if isinstance(p, tuple)]
    limit = parse_time_limit(args.time_limit) if args.time_limit else None
    if args.json:
        doc = {**main.to_json(), "ranks": args.ranks, "prompts": work["lines"],
               "startup_priced_by": "calibration" if getattr(cal, "startup", None) else "estimate"}
        if limit is not None:
            doc["time_limit_s"], doc["time_limit"] = limit, time_limit_line(main.job_s, limit, args.ranks)
        if args.compare:
            doc["compare"] = [p.to_json() if not isinstance(p, tuple) else {"layout": p[0], "error": p[1]}
                              for p in compared]
        print(json.dumps(doc, indent=2))
        return 0
    print(f"simulated {what}: {work['lines']} {'prompts' if what == 'generate' else 'lines'} of {work['path']} "
          f"on {args.ranks} ranks = {main.layout}, priced by {priced_by}")
    unit = "new tokens" if what == "generate" else "line tokens"
    print(f"predicted wall {_human(main.predicted_wall_s)} ({main.predicted_wall_s:.3f} s) + start-up ~"
          f"{_human(main.startup_s)}{'' if getattr(cal, 'startup', None) else ' (estimated: this calibration has none)'}"
          f" + finish ~{_human(main.finish_s)} = job ~{_human(main.job_s)}"
          f": {main.tokens} {unit}, {main.tokens_per_s:.1f} tokens/s; first "
          f"{'row' if what == 'generate' else 'round'} after {main.first_row_s:.3f} s; {main.steps} "
          f"{'steps' if what == 'generate' else 'microbatches'}"
          + (f"; prefix cache: {main.prefix_hits} prompt positions reused" if main.prefix_hits else ""))
    for s, b in enumerate(main.busy):
        frac = min(1.0, b / main.predicted_wall_s) if main.predicted_wall_s else 0.0
        print(f"  stage {s}: busy {b:.3f} s ({100 * frac:.0f} %), bubble {100 * (1 - frac):.0f} %")
    if args.compare:
        print("layouts the ranks allow, by predicted wall time:")
        for p in compared:
            if isinstance(p, tuple):
                print(f"  {p[0]:<28} does not fit: {p[1]}")
            else:
                print(f"  {p.layout:<28} {p.predicted_wall_s:10.3f} s  {p.tokens_per_s:10.1f} tokens/s")
    if limit is not None:
        print(time_limit_line(main.job_s, limit, args.ranks))
    return 0


def _tp_ok(family: Any, cfg: Any, t: int) -> bool:
    try:
        family.check_tp(cfg, t, "plan --compare")
        return True
    except ConfigError:
        return False


def _read_work(args: Any, job: Any, family: Any, cfg: Any, dims: Any, what: str) -> dict:
    """The prompt file's rows (tokens and limits), read as the command reads it."""
    from pathlib import Path

    from ..io.tokenizer import load_tokenizer

    path = Path(args.prompts or (job.generate.prompts if what == "generate" else job.score.prompts))
    stored = None  # the checkpoint's stored format (a job's file; a model from flags is held as stored)
    if job is not None and job.model.checkpoint.is_file() and not (args.preset or args.hf_config):
        from ..model.checkpoint import stored_precision

        stored = stored_precision(job.model.checkpoint)[0]
    tokenizer = load_tokenizer(job.model.checkpoint) if job is not None and job.model.checkpoint.exists() else None
    if what == "score":
        from ..io.scoring import read_score_prompts

        lines = read_score_prompts(path, vocab_size=dims.vocab_size, max_positions=dims.max_positions,
                                   tokenizer=tokenizer)
        return {"path": path.name, "lines": len(lines), "score": [(tuple(p.tokens), p.start) for p in lines],
                "stored": stored}
    from ..engine.records import Request
    from ..io.batch_io import read_requests

    new = args.max_new_tokens or (job.generate.max_new_tokens if job else 32)
    prompts = read_requests(path, vocab_size=dims.vocab_size, max_positions=dims.max_positions, max_new_tokens=new,
                            tokenizer=tokenizer, check_constraint=lambda c, where: None)
    rows = []
    for p in prompts:
        if p.error is not None:
            continue
        s = p.settings
        limit = (p.request["max_new_tokens"] if p.request else (s.max_tokens or new)) if s else new
        rows += [Request(p.index, p.id, tuple(p.tokens), j, max_new_tokens=limit) for j in range(s.n if s else 1)]
    return {"path": path.name, "lines": len(prompts), "rows": rows, "new": new, "stored": stored}


def _prefix_on(args: Any, job: Any, family: Any, what: str) -> bool:
    wanted = not args.no_prefix_cache and (job is None or (job.generate if what == "generate" else job.score).prefix_cache)
    kv_ok = job is None or all(job.kv_for(r).policy == "full" for r in range(args.ranks))
    return bool(wanted and kv_ok and getattr(family, "prefix_cache", False))


def _generate(work, job, args, family, cfg, layout, cal, machine, priced_by, per_host=1):
    from ..engine.block_pool import BLOCK_SIZE, PREFIX_POOL_ROWS, BlockPool
    from ..engine.scheduler import split_batch
    from ..engine.simulate import simulate_generate

    from ..config import PREFILL_CHUNK

    rows = work["rows"]
    batch = args.batch or (job.generate.batch if job else 4)
    groups = args.groups or (job.generate.groups if job else 0) or layout.stages
    batch = split_batch(len(rows), groups * layout.replicas, batch)
    chunk = args.prefill_chunk if args.prefill_chunk is not None else (job.generate.prefill_chunk if job else PREFILL_CHUNK)
    seq = max((len(r.tokens) + (r.max_new_tokens or work["new"]) for r in rows), default=1)
    cost = family.cost(cfg, groups * batch, seq)
    pool, paged = None, False
    if _prefix_on(args, job, family, "generate") and chunk:
        blocks = -(-(PREFIX_POOL_ROWS + groups * batch) * seq // BLOCK_SIZE)
        pool, paged = (lambda: BlockPool(blocks, BLOCK_SIZE)), True
    return simulate_generate(rows, cost, layout, batch=batch, groups=groups, max_new_tokens=work["new"],
                             prefill_chunk=chunk, pool=pool, paged=paged, cal=cal, machine=machine,
                             startup_s=_startup_s(cost, layout, cal, work.get("stored"), per_host), priced_by=priced_by,
                             first_s=_first_touch_s(cost, layout, cal, groups * batch, PREFIX_POOL_ROWS if pool else 0))


def cache_bytes(cost: Any, layout: Any, rows: int, pool_rows: int) -> list[float]:
    """A stage's KV cache on one rank: ``rows`` rows of the job's longest sequence and, with the
    prefix cache, ``pool_rows`` more (the pool `GenerateDriver` allocates), its layers, its TP share."""
    per_layer = cost.kv_bytes_per_layer * (rows + pool_rows) / max(1, rows) / layout.tp
    return [n * per_layer for n in layout.layers]


def _first_touch_s(cost: Any, layout: Any, cal: Any, rows: int, pool_rows: int) -> list[float]:
    """A stage's KV cache (`cache_bytes`) faulted in at its first step (`engine.simulate`'s
    first-touch note), priced at the calibration's fresh-memory rate; the roofline leaves it out."""
    startup = getattr(cal, "startup", None)
    return [startup.touch_s(b) for b in cache_bytes(cost, layout, rows, pool_rows)] if startup else []


def _score(work, job, args, family, cfg, layout, cal, machine, priced_by, per_host=1):
    from ..engine.simulate import ScoreMicrobatch, simulate_score
    from .score import MIN_TOKENS, REUSE_BUDGETS, REUSE_ROWS_MAX, plan_rounds

    lines = work["score"]
    budget = job.score.batch if job else 2048
    per_round = max(job.run.microbatches if job else 1, 2 * layout.stages)
    rounds = plan_rounds([len(t) for t, _ in lines], budget, per_round)
    longest = max(len(t) for t, _ in lines)
    cost = family.cost(cfg, 1, longest)
    plans, scored = [], []
    pool = None
    if _prefix_on(args, job, family, "score"):
        from ..engine.admission import plan_reuse
        from ..engine.block_pool import BLOCK_SIZE, PREFIX_POOL_ROWS, BlockPool

        pool = BlockPool(-(-PREFIX_POOL_ROWS * longest // BLOCK_SIZE), BLOCK_SIZE)
        rows = max(len(mb.lines) for r in rounds for mb in r)
        reuse_rows = min(max(rows, REUSE_BUDGETS * budget // longest), REUSE_ROWS_MAX)
    for mbs in rounds:
        ks = sorted(k for mb in mbs for k in mb.lines)
        scored.append(sum(len(lines[k][0]) for k in ks))
        if pool is None:
            plans.append([ScoreMicrobatch(len(mb.lines), mb.length) for mb in mbs])
        else:
            plan = plan_reuse([(k, lines[k][0], lines[k][1]) for k in ks], pool, budget, per_round, reuse_rows,
                              MIN_TOKENS)
            plans.append([ScoreMicrobatch(len(r.lines), r.width, r.start) for r in plan])
    p = simulate_score(plans, scored, cost, layout, cal=cal, machine=machine,
                       startup_s=_startup_s(cost, layout, cal, work.get("stored"), per_host), priced_by=priced_by)
    if pool is not None:
        p.prefix_hits = sum(mb.rows * mb.start for r in plans for mb in r)
    return p
