"""Run N processes of an example on this machine, as srun / mpirun would across hosts.

    python examples/launch.py -n 2 -- examples/train_moe.py --steps 50 --out runs/mp
    python examples/launch.py -n 2 -- examples/decode_moe.py --checkpoint runs/mp

Child i gets `--coordinator 127.0.0.1:PORT --num-processes N --process-id i` appended; its output (stdout and stderr)
comes back line by line prefixed with [i]. When a child fails, or --timeout passes, the others are killed and the
launcher exits non-zero naming the child; it exits 0 only when every child does.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Optional

from jax_moe import shm_regions

TIMEOUT_EXIT = 124  # as timeout(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds until all children are killed")
    p.add_argument("--gpu-per-process", action="store_true",
                   help="child i drives GPU i only (appends --local-device-ids i): one process per GPU")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT.py ARGS... (or any program)")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no command to run (put it after --)")
    if args.num_processes < 1:
        p.error("-n must be at least 1")
    return args


def start(command: list[str], i: int, n: int, port: int, gpu: bool) -> subprocess.Popen:
    program = [sys.executable, *command] if command[0].endswith(".py") else command
    argv = [*program, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]
    if gpu:
        argv += ["--local-device-ids", str(i)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Own session = own process group: killing it also ends whatever the child started.
    # Binary: the relay splits lines itself, keeping tqdm's carriage returns apart from its newlines.
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)


_screen = {"bar": False}  # a bar is drawn on the terminal's current line (by any child's relay; under the lock)


def relay(stream: IO[bytes], prefix: str, lock: threading.Lock) -> None:
    """Copy a child's output to our stdout, line by line, prefixed. A progress bar (tqdm redraws its line after each
    carriage return) stays one line: redrawn in place on a terminal (any other line first clears it); elsewhere only
    its last state is printed, once its line ends."""
    live = sys.stdout.isatty()
    bar = ""  # the latest redraw of this child's bar whose line has not ended

    def line(text: str) -> None:
        if live and _screen["bar"]:
            sys.stdout.write("\r\x1b[K")
            _screen["bar"] = False
        sys.stdout.write(f"{prefix} {text.rstrip()}\n")

    pending = b""
    while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(1):
        pending += chunk
        while True:
            cut = min((i for i in (pending.find(b"\r"), pending.find(b"\n")) if i >= 0), default=-1)
            if cut < 0:
                break
            text, end, pending = pending[:cut].decode(errors="replace"), pending[cut:cut + 1], pending[cut + 1:]
            with lock:
                if end == b"\r":
                    if text.strip():
                        bar = text
                        if live:
                            sys.stdout.write(f"\r{prefix} {bar}\x1b[K")
                            _screen["bar"] = True
                elif text.strip():  # a line (a bar's last redraw ends this way too): it replaces the bar
                    line(text)
                    bar = ""
                elif bar:  # the bar's line ends: keep its last state
                    line(bar)
                    bar = ""
                sys.stdout.flush()
    with lock:  # the child is gone: what it printed without a final newline, or its bar's last state
        rest = pending.decode(errors="replace")
        if rest.strip() or bar:
            line(rest if rest.strip() else bar)
        sys.stdout.flush()


def kill_all(procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    """SIGTERM every live child's process group, then SIGKILL what is left after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def wait(procs: list[subprocess.Popen], timeout_s: float) -> Optional[str]:
    """None when every child exits 0; else what went wrong first (a child's failure or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"process {i} {how}"
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.1)
    late = [str(i) for i, p in enumerate(procs) if p.poll() is None]
    return f"timeout after {timeout_s:.0f} s: process(es) {', '.join(late)} still running"


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # through main's finally, which stops the children (they have their own sessions)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    port = args.port or free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    failure: Optional[str] = "interrupted"
    try:
        for i in range(args.num_processes):
            procs.append(start(args.command, i, args.num_processes, port, args.gpu_per_process))
            threads.append(threading.Thread(target=relay, args=(procs[-1].stdout, f"[{i}]", lock), daemon=True))
            threads[-1].start()
        failure = wait(procs, args.timeout)
    finally:
        if failure is not None:
            kill_all(procs)
        for t in threads:
            t.join(timeout=5.0)
        # A child killed (here or by anyone) could not close its shm endpoints: their /dev/shm regions go with it.
        shm_regions.remove_of(p.pid for p in procs if p.poll() is not None)
    if failure is None:
        return 0
    print(f"launch: {failure}; stopped the others", file=sys.stderr)
    return TIMEOUT_EXIT if failure.startswith("timeout") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
