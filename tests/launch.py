"""Multi-rank test launches without an interpreter start per rank: each rank is forked from one server process
that imported torch, transformers, hf_accum and the workers' helpers once (`multiprocessing`'s forkserver,
preloading `tests.workers.preload`), with the environment torchrun gives its ranks and torchrun's agent store.

Why: a fresh interpreter importing transformers' Trainer costs ~10 CPU-seconds on this machine; the suite started
~80 of them for torchrun ranks, most of the CPU its launches used. What stays torchrun's: `TORCHRUN_KEYS` and their
values are checked against a real torchrun launch (tests/test_launch.py, which fails when torchrun changes them),
and the preemption tests, which test torchrun's own signal forwarding, still launch torchrun.

What torchrun's agent does that `launch` does too: it hosts the rendezvous store (TORCHELASTIC_USE_AGENT_STORE:
the ranks connect to it as clients, so rank 0 leaving first takes no store with it), and when one rank fails it
ends the others with SIGTERM (SIGKILL 30 s later) and exits 1. A rank ends with ``os._exit`` after flushing its
output, as a forked child does: no C++ static destructors run, so gloo's "terminate called without an active
exception" at interpreter exit (the abort `run_two_ranks` once retried) cannot happen here."""

import faulthandler
import gc
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = "tests.workers.preload"
GRACE_S = 30  # torchrun's agent: SIGTERM, then SIGKILL after this long
TAIL = 6000  # a timed-out launch's message ends with this many characters of each rank's stderr

# What torchrun (torch.distributed.run, one node, no restarts) sets for each rank, beyond the caller's environment.
TORCHRUN_KEYS = ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMP_NUM_THREADS", "RANK", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_ERROR_FILE",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "WORLD_SIZE")


def torchrun_env(rank: int, world: int, port: int, error_dir: str) -> dict:
    """The variables torchrun sets for local rank ``rank`` of ``world`` on one node (`TORCHRUN_KEYS`)."""
    rank, world = str(rank), str(world)
    return {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "RANK": rank,
            "ROLE_NAME": "default", "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world,
            "TORCHELASTIC_ERROR_FILE": os.path.join(error_dir, rank, "error.json"),
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "WORLD_SIZE": world}


def child_env(**extra) -> dict:
    """The environment of a launched test process: this checkout first on the path, whatever else was there kept."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


_context = None


def _forkserver():
    """The forkserver context, its server started on first use with the preloaded modules (one per pytest process;
    it lives as long as the process)."""
    global _context
    if _context is None:
        from multiprocessing import forkserver

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([PRELOAD])
        saved = dict(os.environ)
        os.environ.update(OMP_NUM_THREADS="1", KINETO_LOG_LEVEL="3")  # read once, when torch loads
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = context
    return _context


def _rank_main(script, argv, env, out_path, err_path, cwd=None, freeze=True):
    """One rank: its output to its two files (file descriptors, so C++ output too), ``env`` as its environment,
    ``script`` run as ``python script argv...`` would run it (in ``cwd`` if given); ``freeze``: `launch`'s."""
    for fd, path in ((1, out_path), (2, err_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a launch that times out asks where each rank is
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    if freeze:
        gc.collect()
        gc.freeze()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would (torch's hook adds "[rankN]: "), and
        sys.excepthook(*sys.exc_info())  # the rank fails
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(script, *argv, nproc=2, timeout=600, env=None, cwd=None, freeze=True) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC tests/workers/SCRIPT ARGV...`` without torchrun (module doc); nproc=None
    runs ``python SCRIPT ARGV...`` (one process, no torchrun variables). Returns what `subprocess.run` would:
    returncode 0 if every rank exited 0, else 1 (torchrun's), and every rank's stdout and stderr, rank by rank.
    Raises `subprocess.TimeoutExpired` (every rank killed) past ``timeout`` seconds.

    ``freeze``: each rank starts with what it was forked with (the preload) frozen (``gc.freeze()``), as the pytest
    process does (tests/conftest.py): Python's cyclic collections, and the heap walks of DeepSpeed's CPU baseline
    (`probing.meters.all_live_tensor_bytes`: ``gc.get_objects()``), skip those ~800,000 objects. The DeepSpeed and
    DDP launches used 25-50% less CPU; the ZeRO estimate's errors (tests/probing/test_zero_real.py) moved by at
    most 0.02 points. ``freeze=False`` for a check whose real peaks moved: FSDP2 with LoRA
    (tests/probing/test_sharded_real.py, a rank's peak 10% higher at micro-batch 1), as the preload's note says
    of what it imports."""
    from torch.distributed import TCPStore

    path = script if os.path.isabs(script) else os.path.join(ROOT, "tests", "workers", script)
    argv = [str(a) for a in argv]
    base = child_env(**(env or {}))
    context = _forkserver()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if nproc else None  # the agent's
    with tempfile.TemporaryDirectory(prefix="hf_accum_launch_") as tmp:
        ranks = []
        for rank in range(nproc or 1):
            own = base if not nproc else {**base, **torchrun_env(rank, nproc, store.port, tmp)}
            files = os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")
            proc = context.Process(target=_rank_main, args=(path, argv, own, *files, cwd, freeze), name=f"rank{rank}")
            proc.start()
            ranks.append((proc, files))
        try:
            _wait(ranks, timeout, [path, *argv])
        except subprocess.TimeoutExpired:
            raise LaunchTimeout([path, *argv], timeout, stderr="".join(
                f"--- rank {i}'s stderr, its threads' stacks last ---\n{_read(files[1])[-TAIL:]}"
                for i, (_, files) in enumerate(ranks))) from None
        stdout, stderr = ("".join(_read(files[i]) for _, files in ranks) for i in (0, 1))
    code = 0 if all(proc.exitcode == 0 for proc, _ in ranks) else (ranks[0][0].exitcode if not nproc else 1)
    return subprocess.CompletedProcess([path, *argv], code, stdout, stderr)


FORK_SERVICE, FORK_KEY = "HF_ACCUM_TEST_FORK_SERVICE", "HF_ACCUM_TEST_FORK_KEY"
FORKED = os.path.join(ROOT, "tests", "workers", "forked.py")
_service = None


def fork_service() -> dict:
    """The variables a process that torchrun starts needs to run its rank as a fork of the preloaded server
    (`tests/workers/forked.py`, the command torchrun is given: ``python forked.py WORKER ARGS...``): the address and
    key of a service in this process that forks each rank it is asked for, started on first use. torchrun's agent,
    its rendezvous and its signals stay real; a rank is a fork, as `launch`'s are, instead of ~10 CPU-s of imports
    (the two-node test started 8 such interpreters: 160 CPU-s of imports in a py-spy profile of the suite)."""
    global _service
    if _service is None:
        import threading
        from multiprocessing.connection import Listener

        context = _forkserver()
        key = os.urandom(16)
        listener = Listener(family="AF_UNIX", authkey=key)
        threading.Thread(target=_serve, args=(listener, context), name="fork-service", daemon=True).start()
        _service = {FORK_SERVICE: listener.address, FORK_KEY: key.hex()}
    return dict(_service)


def _serve(listener, context):
    import threading

    while True:
        conn = listener.accept()
        threading.Thread(target=_serve_one, args=(conn, context), daemon=True).start()


def _serve_one(conn, context):
    """One rank: forked with the environment and directory of the process that asked (torchrun's rank), its pid
    sent back (that process relays its signals to it), then its exit code and output. If the asking process dies
    first (torchrun's SIGKILL), the rank is killed too."""
    with conn, tempfile.TemporaryDirectory(prefix="hf_accum_forked_") as tmp:
        script, argv, env, cwd = conn.recv()
        files = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = context.Process(target=_rank_main, args=(script, argv, env, *files, cwd), name="forked")
        proc.start()
        conn.send(proc.pid)
        while proc.exitcode is None:
            proc.join(0.2)
            if proc.exitcode is None and conn.poll():  # the asker sends nothing more: readable means it is gone
                proc.kill()
                proc.join()
                return
        try:
            conn.send((proc.exitcode, _read(files[0]), _read(files[1])))
        except OSError:  # the asker is gone
            pass


class LaunchTimeout(subprocess.TimeoutExpired):
    """A launch past its timeout; its message ends with each rank's stderr, which ends with where its threads were
    (faulthandler's stacks, asked for with SIGUSR1 before the ranks are killed): a hang says where it hangs."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr}"


def _wait(ranks, timeout, args):
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    kill_at = None
    while any(proc.exitcode is None for proc, _ in ranks):
        now = time.monotonic()
        if now > deadline:
            for proc, _ in ranks:  # each rank still running prints its threads' stacks (_rank_main), then dies
                if proc.exitcode is None:
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            for proc, _ in ranks:
                proc.kill()
                proc.join()
            raise subprocess.TimeoutExpired(args, timeout)
        if kill_at is None and any(proc.exitcode not in (None, 0) for proc, _ in ranks):
            for proc, _ in ranks:  # one rank failed: torchrun's agent ends the others
                if proc.exitcode is None:
                    os.kill(proc.pid, signal.SIGTERM)
            kill_at = now + GRACE_S
        if kill_at is not None and now > kill_at:
            for proc, _ in ranks:
                if proc.exitcode is None:
                    proc.kill()
        wait([proc.sentinel for proc, _ in ranks if proc.exitcode is None], timeout=0.2)
    for proc, _ in ranks:
        proc.join()


def _read(path):
    """A rank's output; none where it died before opening it (the forkserver printed why on our stderr)."""
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()
