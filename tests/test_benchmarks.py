"""Every maintained benchmark's `--quick` smoke run, as a user runs it
(`python -m benchmarks.<group>.<name> --quick` from the checkout): it exits 0 and prints
its figures. Peers (llama.cpp) and Ray are skipped by --quick; what runs is ours, on the
embedded model, so a benchmark that reaches into engine internals fails here when they
move instead of rotting until someone runs it by hand."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUM = r"[0-9]+(\.[0-9]+)?"

# module -> what its output must show (a regex over stdout): its table, with a figure
QUICK = {
    "race.compare": rf"\| single-stream decode tok/s \(c=1, p50\) \| {NUM} \|",
    "race.fidelity": r"\| default \| [0-9]+/4 \| [0-9]+% \|",
    "race.startup_memory": rf"\| tokenmill \| {NUM} \| {NUM} \|",
    "race.ab_servers": rf"greedy decode tok/s \(c=1\) +B +{NUM}",
    "engine.engine_speed": r'"tg128": [0-9.e+-]+',
    "engine.lora": rf"\| 4 streams, 4 adapters \| {NUM} \| {NUM}x \|",
    "engine.kv_disk": rf"after a restart, from disk +{NUM} +\({NUM}x; [0-9]+ tokens cached\)",
    "engine.model_speed": rf"\| int4 \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|",
    "engine.offline_throughput": rf"\| 4 \| {NUM} \| {NUM}x \|",
    "engine.prefix_cache": rf"\| cold / warm \| {NUM}x \|",
    "engine.quality": rf"int4\+decode +{NUM} +[+-]{NUM}% +{NUM}%",
    "engine.sampled_speed": rf"\| temperature 1, min_p 0.05 \| {NUM} \| {NUM}x \|",
    "engine.structured": r"constrained [0-9]/4",
    "serving.embeddings": rf"\| tokenmill, all-MiniLM-L6-v2 encoder \| {NUM} \| {NUM} \|",
    "serving.dialect_overhead": rf"/v1/messages +decode +{NUM} tok/s at the client",
    "serving.server_overhead": rf"server, process +{NUM} +{NUM} +{NUM}",
    "serving.spec_decode": r"answers that differ from off's: 0 \(must be 0\)",
    "serving.slo_autotune": rf"tracing: single-stream decode {NUM} tok/s on",
    "serving.cluster_routing": rf"\| `tokenmill serve` \(2 threads\) \| {NUM} \| {NUM} \|",
    "serving.cluster_sim": rf"\| 2 \| affinity \| {NUM} \|",
    "serving.batch_interference": r"aims: p99 TTFT ratio",
    "serving.model_swap": rf"both resident: {NUM} MiB against {NUM} MiB",
    "soak.run": r"verdict: PASS",
    "serving.shadow_overhead": rf"\| on, gaps \| {NUM} \| {NUM} \| [0-9]+ \|",
    "serving.agent_trace": rf"\| prompt tokens served from cache \| {NUM}% \| {NUM}% \| {NUM}x \|",
}
# run with more than --quick by their own test, which also checks the QUICK pattern above
ELSEWHERE = {"soak.run": "tests/test_soak.py (--quick --faults, its JSON judged)"}


def run(module: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(set(QUICK) - set(ELSEWHERE)))
def test_quick_run(module: str) -> None:
    proc = run(module, "--quick")
    tail = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, tail
    assert re.search(QUICK[module], proc.stdout), f"no figures matching {QUICK[module]!r}{tail}"


def test_every_benchmark_has_a_quick_run() -> None:
    """A new benchmark script joins QUICK (or is a module the benchmarks share)."""
    shared = {"race.peers", "race.table", "race.naive_server", "gpu.paged", "soak.traffic", "soak.batches",
              "soak.probe", "soak.faults", "soak.report", "serving.st_onnx"}
    found = {f"{p.parent.name}.{p.stem}" for p in ROOT.glob("benchmarks/*/*.py") if p.stem != "__init__"}
    assert found - shared - {"gpu.check", "gpu.engine_check"} == set(QUICK)


@pytest.mark.slow
def test_gpu_engine_check_on_cpu(tmp_path: Path) -> None:
    """The engine's torch-runner check on a CPU: every phase ok (tokens against the CPU,
    graphs on and off equal), throughput figures written."""
    out = tmp_path / "engine.json"
    proc = run("gpu.engine_check", "--device", "cpu", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases = json.loads(out.read_text())["phases"]
    assert phases["parity"]["ok"] and phases["graphs"]["ok"]
    assert phases["decode_c4"]["eager"]["output_tok_s"] > 0


@pytest.mark.slow
def test_gpu_check_on_cpu(tmp_path: Path) -> None:
    """The device check's CPU path: tiny configs, every phase run (no time budget), the
    paged decoder's logits and greedy tokens against transformers', batched against alone."""
    out = tmp_path / "check.json"
    proc = run("gpu.check", "--device", "cpu", "--quick", "--out", str(out), "--budget-s", "100000")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["done"] and report["ok"]
    phases = {(p["model"], p["phase"]): p for p in report["phases"]}
    for model in ("tiny-llama", "tiny-qwen2"):
        for name in ("build", "parity", "batched_equals_alone", "cuda_graphs_capture", "decode_c1", "decode_c4",
                     "ttft"):
            assert phases[(model, name)]["status"] == "ok", phases.get((model, name))
        parity = phases[(model, "parity")]
        assert parity["logits"]["max_abs_err_vs_fp32"] <= parity["logits"]["tolerance"]
        assert parity["greedy"]["teacher_forced_unexplained"] == 0
        assert phases[(model, "batched_equals_alone")]["unexplained_divergences"] == 0
        c4 = phases[(model, "decode_c4")]
        assert c4["ours_eager"]["output_tok_s"] > 0 and c4["transformers"]["output_tok_s"] > 0
        assert c4["ours_eager"]["bucket"] == 4
