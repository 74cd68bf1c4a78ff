"""Review fixes of the benchmark scripts (scripts/bench_network.py, bench_core.py, bench_fab_install.py).

Nothing here starts Flower or touches the network: the simulation is a stub, the sampler watches a child of this
test, bench_core's heavy steps are replaced."""

from __future__ import annotations

import math
import json
import os
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import scripts.bench_network as bn

NAN = float("nan")


# ------------------------------------------------------------------------------------------------ --simulation exit
def _stub_simulation(monkeypatch: pytest.MonkeyPatch, status: str) -> None:
    import scripts.simulate as sim

    def run_simulation(*_a, **_k):  # the status a run gets; no process is started
        return {"status": status, "status-details": "stub", "seconds": 0.1}

    monkeypatch.setattr(sim, "run_simulation", run_simulation)


@pytest.mark.parametrize(("status", "rc"), [("finished:failed", 1), ("finished:completed", 0)])
def test_simulation_exit_code_follows_completion(tmp_path, monkeypatch, capsys, status, rc):
    """bench_simulation never set result["ok"] and _run_parts read a missing "ok" as success: a failed simulation
    exited 0."""
    _stub_simulation(monkeypatch, status)
    assert bn.main(["--simulation", "--workdir", str(tmp_path)]) == rc
    capsys.readouterr()


class _FakeCgroup:
    """scripts.memcgroup.MemoryCgroup's surface as bench_network uses it; the report says ``oom_kills``."""

    oom_kills = 0

    def __init__(self, name: str, limit_mb: float | None = None) -> None:
        self.version, self.path, self.limit_mb, self.no_swap = 1, Path("/fake") / name, limit_mb, True

    def create(self):
        return self

    def remove(self) -> bool:
        return True

    def join(self) -> None:
        pass

    def read(self) -> None:
        pass

    def kill(self) -> int:
        return 0

    def report(self):
        from scripts.memcgroup import CgroupReport

        return CgroupReport(1, str(self.path), self.limit_mb, 500.0, type(self).oom_kills, True)


@pytest.mark.parametrize(("oom_kills", "rc"), [(1, 1), (0, 0)])
def test_simulation_oom_kill_under_limit_fails_the_exit_code(tmp_path, monkeypatch, capsys, oom_kills, rc):
    """A run that finished although the cgroup's OOM killer struck (Ray retries) did not fit under the limit."""
    _stub_simulation(monkeypatch, "finished:completed")
    monkeypatch.setattr(_FakeCgroup, "oom_kills", oom_kills)
    monkeypatch.setattr(bn, "MemoryCgroup", _FakeCgroup)
    assert bn.main(["--simulation", "--sim-memory-limit-mb", "512", "--workdir", str(tmp_path)]) == rc
    capsys.readouterr()


def test_simulation_pss_label_says_pages_are_split_outside_the_tree(tmp_path, monkeypatch, capsys):
    _stub_simulation(monkeypatch, "finished:completed")
    bn.main(["--simulation", "--workdir", str(tmp_path)])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("peak memory"))
    assert "outside the tree" in line
    assert "counts shared pages once" not in bn.__doc__


def test_sim_lean_ray_reaches_run_simulation_and_the_report_and_needs_the_simulation_part(tmp_path, monkeypatch,
                                                                                          capsys):
    import scripts.simulate as sim

    seen = []
    monkeypatch.setattr(sim, "run_simulation", lambda *_a, **k: seen.append(k["lean_ray"]) or
                        {"status": "finished:completed", "status-details": "stub", "seconds": 0.1})
    for flags in ([], ["--sim-lean-ray"]):
        assert bn.main(["--simulation", *flags, "--workdir", str(tmp_path / str(len(flags)))]) == 0
    assert seen == [False, True]
    out = capsys.readouterr().out
    assert "Ray head: the one Flower's ray.init starts in flwr-simulation" in out
    assert "Ray head: simulate.py's lean head (scripts/lean_ray.py)" in out
    assert json.loads((tmp_path / "1" / "bench_network.json").read_text())["simulation"]["lean-ray"] is True
    with pytest.raises(SystemExit) as exc:
        bn.main(["--network", "--sim-lean-ray", "--workdir", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert "--sim-lean-ray applies to part 2 (--simulation)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ marker race
def _children_still_us(timeout: float = 20.0) -> list[int]:
    """Children of this process that have not exec'd yet (same command line as this process)."""
    own = Path("/proc/self/cmdline").read_bytes()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                ppid = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == os.getpid() and Path(f"/proc/{entry.name}/cmdline").read_bytes() == own:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
        if found:
            return found
        time.sleep(0.02)
    return []


def test_sampler_counts_a_child_scanned_between_fork_and_exec():
    """A scan while a child of the benchmark is forked but not yet exec'd (its environment is still the
    benchmark's, without the marker) cached "no marker" for good: the process was never counted after its exec."""
    token = "race-" + secrets.token_hex(4)
    sampler = bn.ProcTreeSampler("PGVI_BENCH_ID", token, 0.5, exclude={os.getpid()})
    r, w = os.pipe()
    box: dict[str, subprocess.Popen] = {}
    env = dict(os.environ, PGVI_BENCH_ID=token)
    # the child blocks in preexec_fn (after fork, before exec) until the scan is done
    spawn = threading.Thread(target=lambda: box.setdefault(
        "p", subprocess.Popen(["/bin/sleep", "60"], env=env, preexec_fn=lambda: os.read(r, 1))))
    spawn.start()
    try:
        assert _children_still_us(), "the child never showed up between fork and exec"
        sampler.scan()
        assert sampler.timeline[-1][3] == 0  # not marked yet: the benchmark's own environment
        os.write(w, b"x")
        spawn.join(timeout=30)
        assert Path(f"/proc/{box['p'].pid}/cmdline").read_bytes().startswith(b"/bin/sleep")
        sampler.scan()
        assert sampler.timeline[-1][3] == 1
        assert [p.pid for p in sampler.procs.values()] == [box["p"].pid]
    finally:
        os.write(w, b"x")  # never leave the child blocked
        spawn.join(timeout=30)
        if "p" in box:
            box["p"].kill()
            box["p"].wait()
        os.close(r)
        os.close(w)


def test_sampler_still_caches_a_process_without_the_marker():
    """Processes that run their own program are read once (the cache is kept for them)."""
    sampler = bn.ProcTreeSampler("PGVI_BENCH_ID", "none-" + secrets.token_hex(4), 0.5, exclude={os.getpid()})
    p = subprocess.Popen(["/bin/sleep", "60"])
    try:
        while Path(f"/proc/{p.pid}/cmdline").read_bytes() != b"/bin/sleep\x0060\x00":
            time.sleep(0.01)
        sampler.scan()
        start = int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        assert sampler._has_marker[(p.pid, start)] is False  # noqa: SLF001
    finally:
        p.kill()
        p.wait()


# ------------------------------------------------------------------------------------------------ own CPU
def test_other_work_leaves_out_the_benchmarks_own_cpu():
    """The sampler's thread and its `ss` children ran in the benchmark process, which is excluded from the tree:
    their CPU was reported as other work on the machine."""
    sampler = bn.ProcTreeSampler("PGVI_DEPLOY_ID", "none-" + secrets.token_hex(4), 0.25, exclude={os.getpid()})
    sampler.scan()
    t0 = sampler.timeline[-1][0]
    c0 = time.process_time()
    while time.process_time() - c0 < 0.3:  # this process's own work (the sampler's, in a real run)
        pass
    # a child this process waits for (an `ss` call, in a real run)
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.3: pass"], check=True)
    time.sleep(0.05)
    sampler.scan()
    t1 = sampler.timeline[-1][0]
    split = sampler.cpu_split(t0, t1)
    assert split["cpu-s-ours"] == 0  # no process carries the marker
    assert split["cpu-s-benchmark"] >= 0.55
    assert split["cpu-s-other-work"] == pytest.approx(split["cpu-s-machine"] - split["cpu-s-benchmark"])


# ------------------------------------------------------------------------------------------------ NaN rounds
def _rounds(overheads: list[float], bytes_per_update: list[float] | None = None) -> list[dict[str, float]]:
    bpu = bytes_per_update or [bn.PAYLOAD_BYTES * 1.0001 if not math.isnan(o) else NAN for o in overheads]
    return [{"round": i + 1, "overhead-frac": o, "bytes-per-update": b}
            for i, (o, b) in enumerate(zip(overheads, bpu))]


@pytest.mark.parametrize("overheads", [[0.05, NAN, 0.07], [NAN, 0.05, 0.07], [0.05, 0.07, NAN]])
def test_a_round_without_data_is_named_and_misses_the_target(overheads):
    """max() skipped a NaN round unless it came first: [0.05, nan, 0.07] was MET, [nan, 0.05, 0.07] MISSED."""
    k = overheads.index(next(o for o in overheads if math.isnan(o))) + 1
    targets, lines = bn.judge_rounds(_rounds(overheads), 1.016)
    assert targets["overhead<=10%"] is False
    assert targets["bytes<=1.05x"] is False
    assert targets["rounds-without-overhead"] == [k]
    assert targets["worst-overhead-frac"] == pytest.approx(0.07)
    for line in lines:
        assert f"no data for round {k}" in line and line.endswith("MISSED")


def test_rounds_with_data_are_judged_on_the_worst_round():
    targets, lines = bn.judge_rounds(_rounds([0.05, 0.09, 0.07]), 1.016)
    assert targets["overhead<=10%"] is True and targets["bytes<=1.05x"] is True
    assert all(line.endswith("MET") and "no data" not in line for line in lines)
    targets, _ = bn.judge_rounds(_rounds([0.05, 0.11, 0.07]), 1.016)
    assert targets["overhead<=10%"] is False
    assert bn.worst_of_rounds(_rounds([NAN, NAN]), "overhead-frac")[1] == [1, 2]


# ------------------------------------------------------------------------------------------------ bench_core
@pytest.fixture()
def bench_core(monkeypatch):
    """scripts/bench_core.py with its heavy steps replaced: no epochs, no matmul peak, no compute settings."""
    from scripts import bench_core as bc

    monkeypatch.setattr(bc, "configure_compute", lambda threads: None)
    monkeypatch.setattr(bc, "set_flush_denormals", lambda on: None)
    monkeypatch.setattr(bc, "cpu_description", lambda: "stub cpu")
    monkeypatch.setattr(bc, "kernel_description", lambda: "stub kernels")
    monkeypatch.setattr(bc, "local_gvi", lambda *a, **k: types.SimpleNamespace(objective_trace=[0.0], path="stub"))
    monkeypatch.setattr(bc, "matmul_peak", lambda sizes: (1.0, 1.0, {256: (1.0, 1.0)}))
    monkeypatch.setattr(bc, "step_floors", lambda *a, **k: None)
    return bc


SMALL = ["--threads", "1", "--n", "64", "--batch", "16", "--hidden", "4", "--samples", "2", "--repeats", "1"]


@pytest.mark.parametrize("flag", ["--repeats", "--n", "--samples", "--batch"])
def test_bench_core_refuses_counts_below_one(bench_core, monkeypatch, capsys, flag):
    """--repeats 0 crashed after the warm-up (UnboundLocalError); --n / --samples 0 were accepted."""
    argv = list(SMALL)
    argv[argv.index(flag) + 1] = "0"
    monkeypatch.setattr(sys, "argv", ["bench_core.py", *argv])
    with pytest.raises(SystemExit) as exc:
        bench_core.main()
    assert exc.value.code == 2
    assert f"argument {flag}: must be an integer >= 1" in capsys.readouterr().err


def test_bench_core_reports_the_torch_path_childs_peak_separately(bench_core, monkeypatch, capsys):
    """RUSAGE_SELF's peak does not include the --compare-torch-path child: the last line said it did."""
    monkeypatch.setattr(bench_core.native, "disabled_by_environment", lambda: False)
    monkeypatch.setattr(bench_core, "compare_torch_path", lambda args, kernel_epoch: 4321.0)
    monkeypatch.setattr(sys, "argv", ["bench_core.py", *SMALL, "--compare-torch-path"])
    bench_core.main()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "comparisons included" not in last
    assert "of this process over the whole run, matmul peak included" in last
    assert "torch-path child process (its own peak): 4321 MiB" in last


def test_bench_core_returns_the_childs_own_figure(bench_core, monkeypatch, capsys):
    """compare_torch_path reads the child's whole-run peak from the child's last line (its own VmHWM)."""
    child = ("print('peak: 1.0 GFLOP/s wall')\nprint('[nll + kl] epoch 2.000 s wall (runs 2.00)')\n"
             "print('peak RSS of the epochs: 600 MiB (the target figure); of this process over the whole run, matmul "
             "peak included: 654 MiB; load average after: (0.1, 0.1, 0.1)')")
    monkeypatch.setattr(bench_core, "torch_path_command", lambda args: [sys.executable, "-c", child])
    assert bench_core.compare_torch_path(types.SimpleNamespace(), {"nll + kl": 0.5}) == 654.0
    assert "[nll + kl] kernels 0.500 s vs torch path 2.000 s per epoch: 4.00x" in capsys.readouterr().out


def test_bench_core_peak_is_the_processs_own_not_its_parents(bench_core):
    """ru_maxrss of a process keeps the peak of the image it exec'd from: a child of a big parent (the
    --compare-torch-path child of bench_core) read at least the parent's peak.  rss_mb() is the process's own."""
    big = bytearray(700 * 2**20)
    big[::4096] = b"x" * len(big[::4096])  # this process's peak is now >= 700 MiB
    del big
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    root = str(Path(__file__).resolve().parents[1])
    code = f"import sys\nsys.path.insert(0, {root!r})\nfrom scripts.bench_core import rss_mb\nprint(rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env=dict(os.environ)).stdout.split()[-1])
    assert parent_peak >= 700
    assert child < parent_peak - 250, (child, parent_peak)  # the child imported torch: a few hundred MiB


# ------------------------------------------------------------------------------------------------ bench_fab_install
def test_bench_fab_install_refuses_zero_calls(monkeypatch, capsys):
    """--calls 0 built and installed the FAB, then crashed in statistics.median([])."""
    from scripts import bench_fab_install

    monkeypatch.setattr(sys, "argv", ["bench_fab_install.py", "--calls", "0"])
    with pytest.raises(SystemExit) as exc:
        bench_fab_install.main()
    assert exc.value.code == 2
    assert "argument --calls: must be an integer >= 1" in capsys.readouterr().err


def _exchange(server: socket.socket, client_cmd: list[str], counter: bn.WireCounter) -> tuple[int, int]:
    """A client (``client_cmd`` runs it) connects to ``server``, waits for a line, sends 300,000 bytes and reads
    120,000; the counter is sampled once the connection stands (t=1) and once both sides have all bytes (t=2)."""
    up, down = 300_000, 120_000
    host, port = server.getsockname()[:2]
    code = (
        "import socket, sys\n"
        f"s = socket.create_connection(({host!r}, {port}))\n"
        "print('connected', flush=True); sys.stdin.readline()\n"
        f"s.sendall(b'u' * {up}); got = 0\n"
        f"while got < {down}: got += len(s.recv(65536))\n"
        "print('done', flush=True); sys.stdin.readline()\n"
    )
    client = subprocess.Popen([*client_cmd, sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        conn, _ = server.accept()
        assert client.stdout.readline().strip() == "connected"
        counter.sample(1.0)
        client.stdin.write("go\n")
        client.stdin.flush()
        got = 0
        while got < up:
            got += len(conn.recv(65536))
        conn.sendall(b"d" * down)
        assert client.stdout.readline().strip() == "done"
        time.sleep(0.3)  # the last delayed ACKs
        counter.sample(2.0)
        client.stdin.write("bye\n")
        client.stdin.flush()
        conn.close()
    finally:
        client.wait(timeout=30)
    return up, down


def test_wire_counter_counts_both_ends_on_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    counter = bn.WireCounter(server.getsockname()[1])
    with server:
        up, down = _exchange(server, [], counter)
    assert counter.between("node->link", 1.0, 2.0) == up  # the client's own socket
    assert counter.between("link->node", 1.0, 2.0) == down


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_wire_counter_counts_both_directions_from_the_server_host_of_a_lan():
    """``--netns``: only the SuperLink's ends are in the namespace it samples; they give both directions."""
    from scripts.netns import NetnsError, VirtualLan

    lan = VirtualLan(1)
    try:
        lan.create()
    except NetnsError as err:
        pytest.skip(f"network namespaces cannot be made here: {err}")
    with lan:
        server = lan.in_server(lambda: socket.create_server((lan.server_address, 0)))
        counter = bn.WireCounter(server.getsockname()[1], lan.server_prefix())
        with server:
            up, down = _exchange(server, lan.exec_prefix(0), counter)
    assert counter.between("node->link", 1.0, 2.0) == up
    assert counter.between("link->node", 1.0, 2.0) == down
    assert {d for d, _, _ in counter.series} == {"node->link", "link->node"} and len(counter.series) == 2
