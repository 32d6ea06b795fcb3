"""`make gpu-check`: the prepared GPU run of finetune, in one command, inside a time budget.

    python bench/gpu_check.py --budget 480 --out outputs/gpu-check [--wheels .whl] [--only bench,long-context]
    python bench/gpu_check.py --download-wheels .whl     # before, on a machine that reaches PyPI

A GPU machine is lent for minutes, its start and idle time included (shared/GPU.md), so what it should run
is one command, prepared and dry-run elsewhere, that stops itself inside its budget. In order, each step
capped (`STEPS`), each started only with at least its least worth starting, after what the selected steps
after it need to start is set aside (so no step starves the ones after it), and skipped with a line otherwise:

1. environment (always): the wheels in --wheels (what the machine's own Python lacks: datasets, bitsandbytes,
   the transformers and peft versions finetune is tested with, the `gpu` extra's liger-kernel) installed into a
   temporary path put first on PYTHONPATH, then one line: GPU, torch, CUDA and the packages' versions;
2. test-gpu: the `cuda`-marked tests that run in-process (kernels, synchronizations, memory), at most 60 s;
3. demo: the offline demo trained on one GPU (single_gpu.yaml, 1 process), its wall time and exact match;
   grpo: the demo's second stage by online RL (make demo-grpo) on one GPU: its wall time, generation
   tokens/s, step seconds, and the exact match before and after;
   decode: rollout decoding at the 1B shape, 64 rows of 512 new tokens, each way (transformers' generate, the
   dynamic loop, the static cache eager and replayed as CUDA graphs): tokens/s, the fraction of the
   memory-bandwidth bound (bench/decode_gpu.py), at most 120 s;
4. bench: bench/gpu.py's best-known variant (chunked loss, varlen attention) eager, with regional compilation,
   and with liger-kernel's fused kernels, at micro-batch 16: tokens/s, MFU, fill and peak memory, at most 180 s;
   each launch records one late step with the torch profiler (left out of its rates), which costs no launch of
   its own;
5. profile: the operator table of the fastest of those;
6. long-context: the longest row Llama-3.2-1B (full) and Llama-3.1-8B (LoRA) train on the GPU, without and with
   train.activation_offload, and their tokens/s (bench/long_context_gpu.py), at most 150 s;
7. test-launches: the `cuda`-marked tests that launch the tiny recipe (about 20 s a launch).

`--only` (make gpu-check STEPS=...) runs the named steps alone: what a first command missed.

Without a GPU each step runs its CPU form ("no GPU: dry run"): the CUDA tests collected, not run; the demo
for a few steps; bench/gpu.py --quick. The tests run that, so a broken check shows in CI, not on the GPU.

Everything lands in --out, at most 8 files (what the device tool brings back): summary.md and summary.json,
a log per kind of step (test-gpu.log for both test steps, demo.log, bench.log), bench/gpu.py's results
(<date>-<commit>-gpu.json and .md) and the profile's operator table. Exit status 1 if a step failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# What a GPU machine's Python lacks or holds in other versions than finetune is tested with; the versions
# are this environment's (the one `make setup` built), so the GPU runs what CI ran.
WHEELS = ["transformers", "peft", "datasets", "dill", "multiprocess", "fsspec", "bitsandbytes"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
VERSIONS = [
    "torch", "accelerate", "transformers", "peft", "datasets", "bitsandbytes", "safetensors", "tokenizers", "triton",
    "liger-kernel",
]  # fmt: skip
# The best-known variant, and the two ways to fuse its elementwise work: which pays is what this measures.
BEST_VARIANTS = [
    "chunked loss, varlen attention", "chunked loss, varlen attention, regional compile",
    "chunked loss, varlen attention, liger kernels",
]  # fmt: skip
MICRO_BATCHES = ["16"]  # the best of 8 and 16 on an H200 (2026-11-28): two launches fit the step's 150 s
PYTEST_CLOSING = re.compile(r"\d+ (passed|failed|skipped|errors?|deselected)|tests? collected")


@dataclass
class Step:
    """One step of the check: how it ended, in how long, and what a reader of the summary needs to know."""

    name: str
    status: str = "passed"  # passed | failed | timed out | skipped
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)


@dataclass
class Check:
    """What every step shares: the budget's clock, where files go, the environment the commands run in."""

    budget_seconds: float
    out: Path
    work: Path
    gpu: bool
    env: dict[str, str]
    wheels: str | None = None
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_seconds - (time.monotonic() - self.started)

    def run(self, command: list[str], log: str, cap: float) -> tuple[int | None, str]:
        """Run `command` with its output appended to `log` in --out; kill it and all it started after `cap`
        seconds (returncode None). Returns the returncode and what this command printed."""
        path = self.out / log
        start = path.stat().st_size if path.exists() else 0
        with path.open("a") as sink:
            sink.write(f"$ {' '.join(command)}\n")
            sink.flush()
            process = subprocess.Popen(
                command, cwd=REPO, env=self.env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                returncode = process.wait(timeout=max(cap, 1))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the launcher's workers too: they share its session
                process.wait()
                returncode = None
                sink.write(f"\n[gpu-check: stopped after {cap:.0f} s]\n")
        with path.open() as text:
            text.seek(start)
            return returncode, text.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=480, help="seconds for the whole check")
    parser.add_argument("--out", default=str(REPO / "outputs" / "gpu-check"), help="the folder of results")
    parser.add_argument("--work", default=str(REPO / "outputs" / "gpu-check-work"), help="models, data, runs")
    parser.add_argument("--wheels", help="a folder of wheels to install into a temporary path first")
    parser.add_argument("--download-wheels", metavar="FOLDER", help="download the GPU machine's wheels, then stop")
    parser.add_argument("--print-environment", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--only",
        type=_step_names,
        help="comma-separated steps to run (the environment always runs), e.g. bench,long-context: what a first "
        f"command missed. Steps: {', '.join(step.name for step in STEPS)}",
    )
    args = parser.parse_args()
    if args.download_wheels:
        download_wheels(Path(args.download_wheels))
        return
    if args.print_environment:
        print(environment_line())
        return
    import torch

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # one check's files only (the device tool brings back 8); the folder stays
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1"}
    check = Check(args.budget, out, work, torch.cuda.is_available(), env, args.wheels)
    print("gpu-check: " + (f"{torch.cuda.get_device_name(0)}" if check.gpu else "no GPU: dry run"), flush=True)
    selected = [step for step in STEPS if step.always or not args.only or step.name in args.only]
    steps: list[Step] = []
    for index, planned in enumerate(selected):
        step = Step(planned.name)
        # What the steps after this one need to start is kept from it: no step starves the ones after it.
        room = check.left() - (0 if planned.always else sum(later.least for later in selected[index + 1 :]))
        if room < planned.least:
            step.status = "skipped"
            step.lines.append(f"skipped: {max(room, 0):.0f} s of the budget left, the step needs {planned.least:.0f}")
        else:
            start = time.monotonic()
            try:
                planned.body(check, step, min(planned.cap * (1 if check.gpu else DRY_RUN_SLACK), room))
            except Exception as error:  # a broken step is reported, and the next ones still run
                step.status = "failed"
                step.lines.append(f"{type(error).__name__}: {error}")
            step.seconds = round(time.monotonic() - start, 1)
        steps.append(step)
        print(f"gpu-check: {step.name}: {step.status} ({step.seconds:.0f} s)", *step.lines, sep="\n  ", flush=True)
    write_summary(check, steps)
    sys.exit(1 if any(step.status in ("failed", "timed out") for step in steps) else 0)


def environment(check: Check, step: Step, cap: float) -> None:
    """Install the carried wheels into a fresh temporary path ahead of the machine's own packages."""
    paths = [str(REPO)]
    if check.wheels:
        files = sorted(str(p) for p in Path(check.wheels).glob("*.whl"))
        site = tempfile.mkdtemp(prefix="finetune-wheels-")
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        returncode, output = check.run([*install, "--target", site, *files], "summary.log", cap)
        if returncode != 0:
            step.status = "failed"
            step.lines.append(f"installing {len(files)} wheels failed: {output.strip()[-500:]}")
            return
        paths.insert(0, site)
        step.lines.append(f"wheels installed into {site}: {', '.join(Path(f).name for f in files)}")
    check.env["PYTHONPATH"] = os.pathsep.join([*paths, check.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    returncode, output = check.run([sys.executable, __file__, "--print-environment"], "summary.log", cap)
    step.lines.append(output.strip().splitlines()[-1] if output.strip() else "no environment line")
    if returncode != 0:
        step.status = "failed"


def environment_line() -> str:
    import platform

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    cuda = torch.version.cuda or "none"
    versions = []
    for name in VERSIONS:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    return f"{device}; CUDA {cuda}; Python {platform.python_version()}; " + ", ".join(versions)


def tests(check: Check, step: Step, cap: float) -> None:
    """The `cuda`-marked tests that run in this process (kernels, synchronizations, memory); without a GPU,
    collected only. The launched ones are a step of their own (`test-launches`), late: each costs a launch."""
    _pytest(check, step, cap, "cuda and not multiprocess")


def test_launches(check: Check, step: Step, cap: float) -> None:
    """The `cuda`-marked tests that launch the tiny recipe as users do (bf16 over NCCL, async checkpoints and
    their resume, pinned-memory offload, QLoRA): about 20 s a launch."""
    _pytest(check, step, cap, "cuda and multiprocess")


def _pytest(check: Check, step: Step, cap: float, marks: str) -> None:
    command = [sys.executable, "-m", "pytest", "-m", marks, "-rfEs", "-q", "-p", "no:cacheprovider"]
    command += ["--durations", "5"] if check.gpu else ["--collect-only"]  # the slowest, for the next split
    returncode, output = check.run(command, "test-gpu.log", cap)
    closing = [line for line in output.splitlines() if PYTEST_CLOSING.search(line)]
    step.lines.append(closing[-1].strip("= ") if closing else "no pytest summary line")
    step.lines += [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))][:10]
    _ended(step, returncode, cap)


def demo(check: Check, step: Step, cap: float) -> None:
    """`make demo` on one device: build, train on single_gpu.yaml with 1 process, report exact match."""
    deadline = time.monotonic() + cap
    root = check.work / "demo"
    build = [sys.executable, "-m", "finetune", "demo", "build", "--dir", str(root)]
    returncode, _ = check.run(build, "demo.log", cap)
    if not _ended(step, returncode, cap, "demo build"):
        return
    run = root / "run"
    # CPU form: a few steps and one evaluation of 16 lists show the command works; the 300 steps are the GPU's to time.
    cpu_form = {
        "train.max_steps": 10, "train.eval_every_steps": 10, "eval.generate.samples": 16, "optim.warmup_steps": 2
    }  # fmt: skip
    short = {} if check.gpu else cpu_form
    train = _demo_train("tiny_llama.yaml", root, run, short)
    start = time.monotonic()
    returncode, output = check.run(train, "demo.log", deadline - time.monotonic())
    step.lines.append(f"training: {time.monotonic() - start:.1f} s wall ({_last_line(output, 'step')})")
    if not _ended(step, returncode, cap, "demo training"):
        return
    report = [sys.executable, "-m", "finetune", "demo", "report", "--dir", str(root), "--run", str(run)]
    returncode, output = check.run(report, "demo.log", deadline - time.monotonic())
    step.lines += [line.strip() for line in output.splitlines() if "exact match" in line or "%)" in line]
    _ended(step, returncode, cap, "demo report")


def grpo(check: Check, step: Step, cap: float) -> None:
    """`make demo-grpo` on one device: the demo's reverser trained 40 steps, then GRPO with the exact-reversal
    reward; its wall time, generation and step rates, and exact match before and after (from the runs' logs)."""
    deadline = time.monotonic() + cap
    root = check.work / "demo"
    if not (root / "data" / "prompts_train.jsonl").exists():
        build = [sys.executable, "-m", "finetune", "demo", "build", "--dir", str(root)]
        if not _ended(step, check.run(build, "demo.log", cap)[0], cap, "demo build"):
            return
    partial, run = root / "run-partial", root / "run-grpo"
    steps = 40 if check.gpu else 4
    first = _demo_train("tiny_llama.yaml", root, partial, {"train.max_steps": steps, "train.eval_every_steps": steps})
    returncode, _ = check.run(first, "demo.log", deadline - time.monotonic())
    if not _ended(step, returncode, cap, "the partly trained reverser"):
        return
    data = {
        "data.train_path": root / "data" / "prompts_train.jsonl",
        "data.eval_path": root / "data" / "prompts_eval.jsonl",
    }
    # CPU form: 2 steps, each logged, and an evaluation of 16 lists.
    cpu_form = {"train.max_steps": 2, "train.eval_every_steps": 2, "train.log_every_steps": 1}
    short = {} if check.gpu else {**cpu_form, "eval.generate.samples": 16}
    second = _demo_train("tiny_llama_grpo.yaml", root, run, {**data, **short}, base=partial / "final")
    start = time.monotonic()
    returncode, _ = check.run(second, "demo.log", deadline - time.monotonic())
    seconds = time.monotonic() - start
    if not _ended(step, returncode, cap, "GRPO training"):
        return
    logged = _logged(run / "metrics.jsonl")
    rates, step_seconds = _series(logged, "generation/tokens_per_second"), _series(logged, "step_seconds")
    rewards = _series(logged, "reward")
    before = _series(_logged(partial / "metrics.jsonl"), "eval_exact_match")[-1]
    after = _series(logged, "eval_exact_match")[-1]
    step.lines += [
        f"training: {seconds:.1f} s wall, {len(step_seconds)} logged windows, median step "
        f"{statistics.median(step_seconds):.3f} s, generation {statistics.median(rates):.0f} tokens/s (median)",
        f"reward (training batches): first window {rewards[0]:.3f}, last {rewards[-1]:.3f}",
        f"exact match on the held-out lists: before {before:.3f}, after {after:.3f}",
    ]


def _demo_train(recipe: str, root: Path, run: Path, overrides: dict, base: Path | None = None) -> list[str]:
    """The command that trains a demo recipe on one device (single_gpu.yaml, 1 process, fp32) into `run`."""
    overrides = {
        "model.name_or_path": base or root / "base",
        "data.train_path": root / "data" / "train.jsonl",
        "data.eval_path": root / "data" / "eval.jsonl",
        "output.dir": run,
        "output.trackers": "[]",
        **overrides,
    }
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(REPO / "accelerate_configs" / "single_gpu.yaml"), "--num_processes", "1", "--mixed_precision", "no",
        "-m", "finetune", "train", str(REPO / "recipes" / "demo" / recipe),
        *[f"{key}={value}" for key, value in overrides.items()],
    ]  # fmt: skip


def _logged(metrics: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _series(logged: list[dict], key: str) -> list[float]:
    """`key`'s values, in order, from the rows that log it."""
    return [row[key] for row in logged if key in row]


def decode(check: Check, step: Step, cap: float) -> None:
    """bench/decode_gpu.py: rollout decoding at the 1B shape, 64 rows of 512 new tokens, each way `complete`
    decodes (generate, the dynamic loop, the static cache eager and as CUDA graphs): tokens/s and the fraction of
    the memory-bandwidth bound, a summary line each (its log shares bench.log: the device tool brings back 8 files)."""
    results = check.work / "decode"
    shutil.rmtree(results, ignore_errors=True)
    command = [sys.executable, str(REPO / "bench" / "decode_gpu.py"), "--out", str(results)]
    returncode, _ = check.run(command + ([] if check.gpu else ["--quick"]), "bench.log", cap)
    tables = sorted(results.glob("*-decode.md"))
    if tables:
        rows = tables[-1].read_text().splitlines()
        step.lines += [line for line in rows if line.startswith("| ") and "---" not in line]
    _ended(step, returncode, cap, "bench/decode_gpu.py")
    if any(" | failed: " in line for line in step.lines):
        step.status = "failed"


def bench(check: Check, step: Step, cap: float) -> None:
    """bench/gpu.py: the best-known variant eager, compiled and with liger's kernels, at micro-batch 16, each
    launch profiling one late step (left out of its rates): the profile step keeps the fastest one's table."""
    command = [sys.executable, str(REPO / "bench" / "gpu.py"), "--micro-batch", *MICRO_BATCHES]
    command += [arg for name in BEST_VARIANTS for arg in ("--variant", name)]
    command += ["--work", str(check.work / "bench"), "--out", str(check.work / "results")]
    # After allocator warm-up and compilation; --quick runs 6 steps.
    command += ["--steps", "10", "--profile", "9,9"] if check.gpu else ["--quick", "--profile", "5,5"]
    shutil.rmtree(check.work / "results", ignore_errors=True)
    returncode, _ = check.run(command, "bench.log", cap)
    results = _bench_results(check.work / "results")
    if results is None:
        step.status = "failed" if returncode is not None else "timed out"
        step.lines.append("bench/gpu.py finished no variant (bench.log says why)")
        return
    for suffix in (".json", ".md"):
        shutil.copy(results["_stem"].with_suffix(suffix), check.out)
    for row in results["rows"]:
        if "error" in row:
            step.lines.append(f"{row['variant']}, micro-batch {row['micro_batch']}: failed: {row['error']}")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        step.lines.append(
            f"{row['variant']}, micro-batch {row['micro_batch']}: {row['tokens_per_second_per_gpu']:.0f} tokens/s, "
            f"MFU {mfu}, fill {row['fill']:.3f}, peak {row['peak_memory_bytes'] / 2**30:.1f} GiB"
        )
    _ended(step, returncode, cap, "bench/gpu.py")
    if any("error" in row for row in results["rows"]):
        step.status = "failed"


def profile(check: Check, step: Step, cap: float) -> None:
    """The operator table of the fastest variant's profiled step, beside the results."""
    results = _bench_results(check.work / "results")
    rows = [row for row in (results or {"rows": []})["rows"] if "error" not in row]
    if not rows:
        step.status = "skipped"
        step.lines.append("skipped: no variant was measured")
        return
    best = max(rows, key=lambda row: row["tokens_per_second_per_gpu"])
    slug = best["variant"].replace(" ", "-").replace(",", "")
    table = Path(f"{results['_stem']}-profile-{slug}-mb{best['micro_batch']}.txt")
    shutil.copy(table, check.out)
    step.lines.append(f"{best['variant']}, micro-batch {best['micro_batch']}: {table.name}")
    lines = table.read_text().splitlines()
    step.lines += [re.sub(r"\s{2,}", "  ", line.strip()) for line in lines[1:2] + lines[3:13]]


def long_context(check: Check, step: Step, cap: float) -> None:
    """bench/long_context_gpu.py: the longest row Llama-3.2-1B (full) and Llama-3.1-8B (LoRA) train on this GPU,
    without and with activation offload, and their tokens/s; its results go into the summary (no file of its own:
    the folder's 8 are taken). Without a GPU, its tiny CPU form."""
    results = check.work / "long_context.json"
    command = [sys.executable, str(REPO / "bench" / "long_context_gpu.py"), str(results), "--budget", str(cap - 30)]
    returncode, output = check.run(command + ([] if check.gpu else ["--quick"]), "bench.log", cap)
    if returncode != 0 or not results.exists():
        step.status = "failed" if returncode is not None else "timed out"
        step.lines.append(output.strip().splitlines()[-1] if output.strip() else "no output")
        return
    for run in json.loads(results.read_text())["runs"]:
        longest = run["longest"]
        tried = ", ".join(f"{t['length']:,}{'' if t['fits'] else ' (out of memory)'}" for t in run["tried"])
        fit = f"{longest['length']:,} tokens at {longest['tokens_per_second']:.0f} tokens/s" if longest else "none"
        step.lines.append(
            f"{run['case']}{', offload' if run['offload'] else ''}: longest {fit} (tried {tried}); "
            f"the plan's {run['planned']:,}"
        )


@dataclass(frozen=True)
class Planned:
    """A step of the check: its cap in seconds, and the least worth starting it with (kept for it from the steps
    before). The caps sum past a budget of 8 minutes on purpose: a step that ends early leaves its time on."""

    name: str
    cap: float
    least: float
    body: Callable[[Check, Step, float], None]
    always: bool = False  # run whatever --only says and the budget holds: the others need what it sets up


DRY_RUN_SLACK = 3
"""Each step's cap is the GPU machine's (its time is scarce); a dry run on CPU shows that the commands work, on a
machine it may share (make test runs two test files at a time): its caps are this many times longer."""

STEPS = [
    Planned("environment", 60, 5, environment, always=True),
    Planned("test-gpu", 60, 30, tests),
    Planned("demo", 90, 40, demo),
    Planned("grpo", 75, 45, grpo),
    Planned("decode", 120, 60, decode),
    Planned("bench", 180, 60, bench),
    Planned("profile", 5, 1, profile),
    Planned("long-context", 150, 90, long_context),
    Planned("test-launches", 120, 60, test_launches),
]


def _step_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in {step.name for step in STEPS}]
    if unknown:
        raise argparse.ArgumentTypeError(f"no step {unknown[0]!r}; the steps: {', '.join(s.name for s in STEPS)}")
    return names


def _bench_results(folder: Path) -> dict | None:
    """bench/gpu.py's results in `folder` (it rewrites them after every launch), with their path's stem."""
    found = sorted(folder.glob("*-gpu*.json"))
    return json.loads(found[0].read_text()) | {"_stem": found[0].with_suffix("")} if found else None


def _ended(step: Step, returncode: int | None, cap: float, what: str = "the command") -> bool:
    """Record how a command ended on its step; True when it succeeded."""
    if returncode is None:
        step.status = "timed out"
        step.lines.append(f"{what} stopped at the step's cap of {cap:.0f} s")
    elif returncode != 0:
        step.status = "failed"
        step.lines.append(f"{what} exited {returncode}")
    return returncode == 0


def _last_line(output: str, word: str) -> str:
    lines = [line.strip() for line in output.splitlines() if word in line]
    return lines[-1][-160:] if lines else "no progress line"


def write_summary(check: Check, steps: list[Step]) -> None:
    """summary.json and summary.md; the environment step's own commands and output close summary.md."""
    commit = os.environ.get("BENCH_COMMIT") or _git_commit()
    mode = "GPU" if check.gpu else "no GPU: dry run"
    summary = {"commit": commit, "mode": mode, "budget_seconds": check.budget_seconds}
    (check.out / "summary.json").write_text(json.dumps({**summary, "steps": [asdict(s) for s in steps]}, indent=2))
    lines = [f"# gpu-check at {commit} ({mode}), budget {check.budget_seconds:.0f} s", ""]
    for step in steps:
        lines += [f"## {step.name}: {step.status} ({step.seconds:.0f} s)", "", "```", *step.lines, "```", ""]
    log = check.out / "summary.log"
    if log.exists():  # folded in: the device tool brings back 8 files
        lines += ["## the environment step's commands", "", "```", log.read_text().rstrip(), "```", ""]
        log.unlink()
    (check.out / "summary.md").write_text("\n".join(lines))


def _git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def _gpu_extra() -> list[str]:
    """The `gpu` extra's pins (pyproject.toml): what a CPU machine never installs (liger-kernel's Triton kernels)."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]


def download_wheels(folder: Path) -> None:
    """The wheels a GPU machine (Python 3.12, x86-64 Linux, no network) needs, at this environment's versions."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.whl"):
        stale.unlink()  # one version of each: two stop the install there
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS] + _gpu_extra()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    command += ["--implementation", "cp", *[arg for p in PLATFORMS for arg in ("--platform", p)], "-d", str(folder)]
    subprocess.run([*command, *pins], check=True)
    total = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"{len(pins)} wheels in {folder}, {total / 2**20:.1f} MiB: {', '.join(pins)}")


if __name__ == "__main__":
    main()
