"""vescale.debug.breakpoint driven by a scripted terminal: commands are sent over the socket the
debugged rank announces, and the answers checked.

* 2 ranks under a real ``torchrun --standalone`` (the launcher whose stdin handling the socket works
  around): local and global (``pg``) values, refused expressions, and a wait longer than the process
  group's timeout (6 s here: short enough to wait out, long enough for a loaded machine's
  collectives) after which the waiting rank still answers and the group still works.
* 4 forked ranks (``run_on_ranks``), two of them debugged at once, a 2-D sharded DTensor: gathers from
  either debugger, a wrong token, re-attaching, one rank continued while the other still debugs
  (longer than the timeout), then all ranks go on together.
* 2 forked ranks: ``q`` on the debugged rank makes the waiting rank raise instead of hanging.
* ``examples/debug_breakpoint.py`` on 2 forked ranks, driven through the session docs/debug.md shows.

Mutation check done by hand: making waiting ranks ``dist.barrier()`` instead of polling the store
fails the first two tests (the barrier times out after the process group's timeout).
"""

from __future__ import annotations

import datetime
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import vescale.debug
from vescale.testing import run_on_ranks, run_script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PG_TIMEOUT_S = 6.0
ATTACH = re.compile(r"rank (\d+) stopped at .*attach with: .* -m vescale\.debug\.attach (\S+):(\d+) --token (\w+)")
PROMPT = re.compile(r"\(Pdb rank \d+\) $")


class Terminal:
    """A scripted user at one rank's pdb."""

    def __init__(self, host: str, port: int, token: str):
        self.sock = socket.create_connection((host, port), timeout=60)
        self.sock.sendall(token.encode() + b"\n")
        self.greeting = self.read()

    def read(self, until: re.Pattern | str = PROMPT) -> str:
        """Everything up to the next prompt, or ``until`` (or until the rank closes the connection)."""
        until = re.compile(re.escape(until)) if isinstance(until, str) else until
        data = b""
        while not until.search(data.decode(errors="replace")):
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.decode(errors="replace")

    def run(self, command: str) -> str:
        self.sock.sendall(command.encode() + b"\n")
        return self.read()

    def close(self) -> None:
        self.sock.close()


def _wait_for_attach_lines(read_text, ranks, timeout: float = 180.0) -> dict:
    found, deadline = {}, time.monotonic() + timeout
    while set(found) != set(ranks):
        assert time.monotonic() < deadline, f"no attach line from ranks {set(ranks) - set(found)}:\n{read_text()}"
        for m in ATTACH.finditer(read_text()):
            found[int(m[1])] = (m[2], int(m[3]), m[4])
        time.sleep(0.2)
    return found


# ---------------------------------------------------------------------------------------------
# 2 ranks under torchrun
# ---------------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_two_ranks_under_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node", "2", os.path.join(HERE, "breakpoint_script.py"),
         "--debug-ranks", "0", "--pg-timeout", str(PG_TIMEOUT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []

    def text() -> str:
        while not lines.empty():
            seen.append(lines.get())
        return "".join(seen)

    try:
        (host, port, token), = _wait_for_attach_lines(text, [0]).values()
        term = Terminal(host, port, token)
        # pdb stops at the line after the breakpoint, in the function that called it.
        assert "rank 0 of 2" in term.greeting and "-> total = torch.tensor([float(rank)])" in term.greeting, term.greeting
        assert re.search(r"breakpoint_script\.py\(\d+\)run\(\)", term.greeting), term.greeting
        assert term.run("p secret").startswith("100\n")  # rank 0's own local value
        out = term.run("pg x")
        assert "from a DTensor of global shape (4, 3), torch.float32, placements (Shard(dim=0))" in out, out
        assert "[ 9., 10., 11.]])" in out, out  # the last row lives on rank 1: it was gathered
        assert "tensor([ 9., 10., 11.])" in term.run("pg x[-1]")  # indexing applies to the global tensor
        time.sleep(PG_TIMEOUT_S + 1.0)  # the user reads for longer than the process group's timeout
        assert "tensor([3., 6.])" in term.run("pg layers['w'][1:3, 0]")  # rank 1 still answers
        assert "pg takes a variable followed by .attributes and [indices]" in term.run("pg x.sum()")
        assert "NameError: name 'nope' is not defined here" in term.run("pg nope")
        assert "secret is a int object, not a tensor" in term.run("pg secret")
        out = term.run("c")
        assert "rank 0: all ranks go on" in out, out
        assert proc.wait(timeout=120) == 0, text()
    finally:
        if proc.poll() is None:
            proc.kill()
    out = text()
    for rank in range(2):
        assert f"rank {rank} resumed: all_reduce=1 secret={100 + rank}" in out, out


# ---------------------------------------------------------------------------------------------
# 4 forked ranks, two debugged
# ---------------------------------------------------------------------------------------------


def _stderr_to(path: str) -> None:
    """Send this rank's stderr (where the attach command is printed) to a file the test reads
    (``sys.stderr``, not fd 2: under pytest it is pytest's capture file)."""
    sys.stderr = open(path, "w", buffering=1)


def _two_debuggers(tmp: str) -> str:
    rank = dist.get_rank()
    _stderr_to(os.path.join(tmp, f"rank{rank}.err"))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    x = distribute_tensor(torch.arange(32, dtype=torch.float32).reshape(8, 4), mesh, [Shard(0), Shard(1)])
    secret = 100 + rank
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=PG_TIMEOUT_S))
    vescale.debug.breakpoint(rank=[1, 3])
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return f"rank {rank} secret {secret} all_reduce {total.item():g} local {tuple(x.to_local().shape)}"


@pytest.mark.multiproc
def test_four_ranks_two_debugged(tmp_path):
    results: list = []
    errors: list = []

    def launch():
        try:
            results.extend(run_on_ranks(_two_debuggers, 4, str(tmp_path), timeout=90))
        except BaseException as e:  # reported by the assertions below
            errors.append(e)

    thread = threading.Thread(target=launch)
    thread.start()

    def text() -> str:
        return "".join(open(p).read() for p in sorted(tmp_path.glob("rank*.err")))

    try:
        found = _wait_for_attach_lines(text, [1, 3])
        one, three = Terminal(*found[1]), Terminal(*found[3])
        assert "rank 1 of 4" in one.greeting and "rank 3 of 4" in three.greeting
        assert one.run("p secret").startswith("101\n") and three.run("p secret").startswith("103\n")
        # Rank 3 is in its own pdb, yet rank 1's gather goes through: rank 3 answers while it waits for input.
        out = one.run("pg x")
        assert "placements (Shard(dim=0), Shard(dim=1)) on a (2, 2) mesh" in out, out
        assert "[28., 29., 30., 31.]])" in out and "[ 0.,  1.,  2.,  3.]," in out, out
        assert "tensor([28., 29., 30., 31.])" in three.run("pg x[7]")
        assert "tensor(26.)" in one.run("p _g[6, 2]") or "tensor(26.)" in three.run("p _g[6, 2]")

        # A wrong token is turned away; the rank keeps waiting for the right one.
        intruder = socket.create_connection(found[3][:2], timeout=30)
        intruder.sendall(b"guess\n")
        assert b"wrong token" in intruder.recv(1024)
        intruder.close()
        # A terminal that drops can attach again and finds pdb where it was.
        three.close()
        three = Terminal(*found[3])
        assert "test_breakpoint.py" in three.greeting and "_two_debuggers()" in three.greeting, three.greeting
        # A new terminal takes over from one that is still connected (a dead ssh session, say).
        old, three = three, Terminal(*found[3])
        assert "another terminal attached to this rank" in old.read()
        assert "_two_debuggers()" in three.greeting and three.run("p secret").startswith("103\n")

        # Rank 1 continues; nobody goes on while rank 3 still debugs, for longer than the PG timeout.
        one.sock.sendall(b"c\n")
        assert "waiting for the other debugged ranks [1, 3]" in one.read(until="waiting for the other")
        time.sleep(PG_TIMEOUT_S + 1.0)
        assert thread.is_alive() and not results and not errors
        assert "tensor([4., 5., 6., 7.])" in three.run("pg x[1]")  # rank 1 answers while it waits
        assert "rank 3: all ranks go on" in three.run("c")
    finally:
        thread.join(timeout=120)
    assert not errors, errors[0]
    assert [r.split(" local")[0] for r in results] == [f"rank {r} secret {100 + r} all_reduce 6" for r in range(4)]


# ---------------------------------------------------------------------------------------------
# quit
# ---------------------------------------------------------------------------------------------


def _quit_session(tmp: str) -> str:
    _stderr_to(os.path.join(tmp, f"rank{dist.get_rank()}.err"))
    vescale.debug.breakpoint(rank=0)
    return "went on"


@pytest.mark.multiproc
def test_quit_ends_the_waiting_ranks_too(tmp_path):
    errors: list = []
    thread = threading.Thread(
        target=lambda: errors.append(pytest.raises(RuntimeError, run_on_ranks, _quit_session, 2, str(tmp_path), timeout=60))
    )
    thread.start()
    found = _wait_for_attach_lines(lambda: "".join(open(p).read() for p in tmp_path.glob("rank*.err")), [0])
    term = Terminal(*found[0])
    term.sock.sendall(b"q\n")
    thread.join(timeout=90)
    message = str(errors[0].value)
    assert "BdbQuit" in message and "vescale.debug.breakpoint aborted: rank 0 quit the debugger" in message, message


def _disagreeing_ranks(tmp: str) -> str:
    rank = dist.get_rank()
    _stderr_to(os.path.join(tmp, f"rank{rank}.err"))
    vescale.debug.breakpoint(rank=rank)  # wrong: every rank must name the same debugged ranks
    return "went on"


@pytest.mark.multiproc
def test_ranks_that_disagree_about_rank_all_raise(tmp_path):
    with pytest.raises(RuntimeError) as failure:
        run_on_ranks(_disagreeing_ranks, 2, str(tmp_path), timeout=60)
    message = str(failure.value)
    assert "failure on 2 rank(s)" in message, message
    assert "where another rank called it with rank=" in message and "every rank must make the same breakpoint() calls" in message


# ---------------------------------------------------------------------------------------------
# examples/debug_breakpoint.py, as docs/debug.md shows it
# ---------------------------------------------------------------------------------------------


def _breakpoint_example(tmp: str) -> str:
    _stderr_to(os.path.join(tmp, f"rank{dist.get_rank()}.err"))
    return run_script(os.path.join(ROOT, "examples", "debug_breakpoint.py"))


@pytest.mark.multiproc
def test_the_breakpoint_example_answers_as_docs_debug_md_shows(tmp_path):
    results: list = []
    errors: list = []

    def launch():
        try:
            results.extend(run_on_ranks(_breakpoint_example, 2, str(tmp_path), timeout=120))
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        found = _wait_for_attach_lines(lambda: "".join(open(p).read() for p in tmp_path.glob("rank*.err")), [0])
        term = Terminal(*found[0])
        assert "rank 0 of 2" in term.greeting and "debug_breakpoint.py" in term.greeting, term.greeting
        assert term.run("p y.placements").startswith("(Shard(dim=1),)\n")
        assert term.run("p y.to_local().shape").startswith("torch.Size([4, 16])\n")
        out = term.run("pg y")
        assert "y: from a DTensor of global shape (4, 32), torch.float32, placements (Shard(dim=1)) on a (2,) mesh" in out, out
        out = term.run("pg model.up.weight.grad[:2, :3]")
        assert "global shape (32, 8), torch.float32, placements (Shard(dim=0)) on a (2,) mesh" in out, out
        assert "rank 0: all ranks go on" in term.run("c")
    finally:
        thread.join(timeout=150)
    assert not errors, errors[0]
    losses = [re.fullmatch(r"rank (\d): loss (\S+)\n", r) for r in results]
    assert all(losses) and [m.group(1) for m in losses] == ["0", "1"], results
    assert losses[0].group(2) == losses[1].group(2), results  # both ranks print the same global loss
