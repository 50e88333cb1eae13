"""``vescale.debug.breakpoint(rank=0)``: pdb on chosen ranks of a torchrun job, the others parked.

Why a socket: torchrun starts every worker with ``start_new_session=True`` (no controlling
terminal, so ``/dev/tty`` cannot be opened) and all workers share the launcher's stdin (or
``/dev/null`` under a batch system), so pdb cannot read the keyboard reliably. Each debugged rank
therefore serves its pdb on a loopback TCP socket and prints one line to stderr, the command that
attaches a terminal to it (``python -m vescale.debug.attach HOST:PORT --token T``). A token keeps
other local users and stray connections out; a dropped connection can simply attach again.

Why no collective while waiting: a blocking collective (``barrier``) would fail once the process
group's timeout passes, however long the user is still reading. Every rank therefore waits by
polling the default process group's key-value store (``check`` / ``add`` never block) and goes on
when every debugged rank has said ``continue``.

``pg EXPR`` shows a DTensor as its global tensor. Gathering is a collective, so it runs only after
a two-phase agreement through the store: the asking rank posts the expression; every rank (waiting
or debugging) evaluates it *without running tensor code* (names, attributes and container indices
only; indexing a tensor is applied after the gather, on the asking rank) and posts what it found;
the asking rank alone decides "go" (every rank holds a DTensor of the same global shape and
placements) or "abort" (with the reasons, or after ``REPLY_TIMEOUT_S`` without an answer), and
only on "go" does every rank enter ``full_tensor()``. No rank can enter the collective alone.
"""

from __future__ import annotations

import ast
import builtins
import hmac
import json
import pdb
import secrets
import select
import socket
import sys
import time
from types import FrameType
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["breakpoint", "REPLY_TIMEOUT_S"]

REPLY_TIMEOUT_S = 30.0  # how long `pg` waits for every rank to say what the expression is on it
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.2  # waiting ranks poll the store, backing off while idle
# How long a debugged rank that continues waits for the waiting ranks to leave (they poll every
# _POLL_MAX_S at most; the bound only keeps a dead waiting rank from holding the others up).
_LEAVE_WAIT_S = 30.0

_calls = 0  # breakpoint() calls so far in this process: all ranks make the same calls, in order
_listener: tuple[socket.socket, str] | None = None  # (listening socket, token), made once per process


# ---------------------------------------------------------------------------------------------
# Expressions every rank can evaluate without communicating
# ---------------------------------------------------------------------------------------------

_INDEX_NODES = (ast.Constant, ast.Name, ast.Slice, ast.Tuple, ast.UnaryOp, ast.USub, ast.UAdd, ast.Load,
                ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Attribute)


class NotAReference(ValueError):
    """An expression ``pg`` cannot evaluate safely on every rank."""


def _chain(expr: str) -> tuple[ast.expr, list[ast.expr]]:
    """``a.b[0].c`` -> (tree, [Attribute b, Subscript [0], Attribute c]) with every link checked."""
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError as e:
        raise NotAReference(f"cannot parse {expr!r}: {e.msg}") from None
    links, node = [], tree
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        links.append(node)
        node = node.value
    if not isinstance(node, ast.Name):
        raise NotAReference(
            f"pg takes a variable followed by .attributes and [indices] (e.g. `pg self.q_proj.weight.grad` or "
            f"`pg out.logits[0, :4]`), not {expr!r}: every rank evaluates it, and calls or arithmetic could "
            "communicate; compute on the gathered tensor afterwards with `p _g...`"
        )
    for link in links:
        if isinstance(link, ast.Subscript):
            bad = [type(n).__name__ for n in ast.walk(link.slice) if not isinstance(n, _INDEX_NODES)]
            if bad:
                raise NotAReference(f"index [{ast.unparse(link.slice)}] in {expr!r} uses {bad[0]}; use constants and names")
    links.reverse()
    return tree, links


def _namespace(frame) -> tuple[dict, dict]:
    return frame.f_globals, dict(frame.f_locals)


def _lookup(name: str, frame):
    g, loc = _namespace(frame)
    for scope in (loc, g, vars(builtins)):
        if name in scope:
            return scope[name]
    raise NameError(f"name {name!r} is not defined here")


def _eval_with(node: ast.expr, value, frame):
    """Evaluate ``node`` (a link chain whose innermost object is replaced by ``value``)."""
    code = compile(ast.fix_missing_locations(ast.Expression(body=node)), "<pg>", "eval")
    g, loc = _namespace(frame)
    loc["__vescale_value__"] = value
    return eval(code, g, loc)


def resolve(expr: str, frame: FrameType) -> tuple[Any, Callable[[Any], Any]]:
    """What ``expr`` names in ``frame``, evaluated without tensor code.

    Returns ``(value, finish)``: ``finish(global_value)`` applies the links that come after the first
    tensor index (``x[0, :4]``), which must run on the gathered global tensor, not on a local shard.
    """
    tree, links = _chain(expr)
    root = links[0].value if links else tree
    value = _lookup(root.id, frame)
    for link in links:
        if isinstance(link, ast.Subscript) and isinstance(value, torch.Tensor):
            link.value = ast.Name("__vescale_value__", ast.Load())
            return value, lambda global_value, tree=tree: _eval_with(tree, global_value, frame)
        if isinstance(link, ast.Attribute):
            value = getattr(value, link.attr)
        else:
            value = _eval_with(ast.Subscript(ast.Name("__vescale_value__", ast.Load()), link.slice, ast.Load()), value, frame)
    return value, lambda global_value: global_value


def describe(value: object) -> dict:
    """What a rank reports about the value it found (JSON-able); ``error`` when it cannot be gathered."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        if local.numel() and local.untyped_storage().nbytes() == 0:
            return {"error": "its storage is freed (a ZeRO-3 gathered weight outside its module's forward)"}
        return {
            "kind": "DTensor", "shape": list(value.shape), "dtype": str(value.dtype),
            "placements": [repr(p) for p in value.placements], "mesh_shape": list(value.device_mesh.shape),
        }
    if isinstance(value, torch.Tensor):
        return {"kind": "Tensor", "shape": list(value.shape), "dtype": str(value.dtype)}
    return {"error": f"is a {type(value).__name__} object, not a tensor"}


# ---------------------------------------------------------------------------------------------
# The rendezvous: keys in the default store, polled, never waited on with the store's timeout
# ---------------------------------------------------------------------------------------------


class _Rendezvous:
    """One breakpoint hit, shared by all ranks through keys ``vescale/debug/bp<n>/...``."""

    def __init__(self, store, call: int, rank: int, world: int, debug_ranks: tuple[int, ...], frame):
        self.store, self.rank, self.world, self.debug_ranks = store, rank, world, debug_ranks
        self.prefix = f"vescale/debug/bp{call}/"
        self.frame = frame  # the frame that called breakpoint(): where this rank stands
        self.answered = 0  # gather requests this rank has answered (they are numbered 1, 2, ...)
        self._check_same_ranks()

    def key(self, name: str) -> str:
        return self.prefix + name

    def _check_same_ranks(self) -> None:
        mine = json.dumps(list(self.debug_ranks))
        first = self.store.compare_set(self.key("ranks"), "", mine)
        first = first.decode() if isinstance(first, bytes) else first
        if first != mine:
            problem = (
                f"rank {self.rank} called vescale.debug.breakpoint(rank={list(self.debug_ranks)}) where another rank "
                f"called it with rank={json.loads(first)}; every rank must make the same breakpoint() calls"
            )
            self.abort(problem)
            raise ValueError(problem)

    def abort(self, why: str, wait_s: float = 5.0) -> None:
        """Make every other rank raise ``why``; wait (a little) until they have read it, since the
        rank hosting the store may be this one, about to end."""
        self.store.set(self.key("abort"), why)
        deadline = time.monotonic() + wait_s
        while self.store.add(self.key("abort_seen"), 0) < self.world - 1 and time.monotonic() < deadline:
            time.sleep(_POLL_MIN_S)

    def aborted(self) -> str | None:
        if self.store.check([self.key("abort")]):
            self.store.add(self.key("abort_seen"), 1)
            return self.store.get(self.key("abort")).decode()
        return None

    def continued(self) -> int:
        return self.store.add(self.key("continued"), 0)

    def say_continue(self) -> None:
        self.store.add(self.key("continued"), 1)

    def _wait_for(self, key: str) -> bytes:
        """Poll (never block on the store's timeout) until ``key`` exists; returns its value."""
        pause = _POLL_MIN_S
        while not self.store.check([key]):
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        return self.store.get(key)

    # -- gather requests --------------------------------------------------------------------

    def serve(self) -> None:
        """Answer every gather request posted so far, in order."""
        posted = self.store.add(self.key("requests"), 0)
        for rid in range(self.answered + 1, posted + 1):
            self._answer(rid)

    def _frame_at(self, depth: int):
        frame = self.frame
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
        if frame is None:
            raise ValueError(f"this rank has no frame {depth} level(s) above its breakpoint")
        return frame

    def _answer(self, rid: int, value_and_report: tuple | None = None) -> DTensor | None:
        request = json.loads(self._wait_for(self.key(f"req{rid}")))
        if value_and_report is None:
            try:
                value, _ = resolve(request["expr"], self._frame_at(request["depth"]))
                report = describe(value)
            except Exception as e:  # any failure is reported, never raised: the asker must hear back
                value, report = None, {"error": f"{type(e).__name__}: {e}"}
        else:
            value, report = value_and_report
        self.store.set(self.key(f"req{rid}/rank{self.rank}"), json.dumps(report))
        if request["from"] == self.rank:
            decision = self._decide(rid, report)
        else:
            decision = self._wait_for(self.key(f"req{rid}/decision")).decode()
        self.answered = rid
        if decision == "go" and isinstance(value, DTensor):
            with torch.no_grad():
                return value.detach().full_tensor()
        if request["from"] == self.rank and decision != "go":
            raise RuntimeError(decision)
        return None

    def _decide(self, rid: int, mine: dict) -> str:
        keys = {r: self.key(f"req{rid}/rank{r}") for r in range(self.world)}
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not self.store.check(list(keys.values())) and time.monotonic() < deadline:
            time.sleep(_POLL_MIN_S)
        problems = []
        silent = [r for r, k in keys.items() if not self.store.check([k])]
        if silent:
            problems.append(
                f"rank(s) {silent} did not answer within {REPLY_TIMEOUT_S:.0f} s (not at this breakpoint?)"
            )
        for r, k in keys.items():
            if r in silent:
                continue
            theirs = json.loads(self.store.get(k))
            if "error" in theirs:
                problems.append(f"rank {r}: {theirs['error']}")
            elif theirs != mine and "error" not in mine:
                problems.append(f"rank {r} holds {theirs}, rank {self.rank} holds {mine}")
        decision = "go" if not problems else "cannot gather: " + "; ".join(problems[:4])
        self.store.set(self.key(f"req{rid}/decision"), decision)
        return decision

    def gather(self, expr: str, depth: int, frame: FrameType) -> tuple[torch.Tensor, dict]:
        """The global tensor ``expr`` names (asked by this rank, in ``frame`` = breakpoint frame + depth)."""
        value, finish = resolve(expr, frame)  # errors here concern this rank only: nothing is posted
        report = describe(value)
        if "error" in report:
            raise ValueError(f"{expr} {report['error']}")
        if not isinstance(value, DTensor):
            return finish(value), report  # a plain tensor is already the global tensor
        rid = self.store.add(self.key("requests"), 1)
        self.store.set(self.key(f"req{rid}"), json.dumps({"expr": expr, "depth": depth, "from": self.rank}))
        for earlier in range(self.answered + 1, rid):  # another debugged rank asked first
            self._answer(earlier)
        return finish(self._answer(rid, (value, report))), report

    # -- waiting ------------------------------------------------------------------------------

    def poll(self) -> None:
        """One round of waiting: answer gather requests; raise if the session was aborted."""
        why = self.aborted()
        if why is not None:
            raise RuntimeError(f"vescale.debug.breakpoint aborted: {why}")
        self.serve()

    def wait_until_released(self) -> None:
        """Wait, answering gather requests, until every debugged rank has continued. A waiting rank
        then says it has left; a debugged rank waits (a little) until every waiting rank has, since
        it may host the store (rank 0 without torchrun's agent) and end right after the breakpoint,
        taking the store with it before a slow waiting rank has read the release."""
        pause = _POLL_MIN_S
        try:
            while self.continued() < len(self.debug_ranks):
                before = self.answered
                self.poll()
                pause = _POLL_MIN_S if self.answered != before else min(pause * 2, _POLL_MAX_S)
                time.sleep(pause)
            if self.rank not in self.debug_ranks:
                self.store.add(self.key("left"), 1)
                return
            waiting, deadline = self.world - len(self.debug_ranks), time.monotonic() + _LEAVE_WAIT_S
            while self.store.add(self.key("left"), 0) < waiting and time.monotonic() < deadline:
                time.sleep(_POLL_MIN_S)
        except dist.DistError as e:  # the store's host (rank 0 without torchrun's agent) has ended
            raise RuntimeError(
                f"vescale.debug.breakpoint: rank {self.rank} lost the process group's store while waiting "
                f"({type(e).__name__}); the rank that hosts it has ended"
            ) from e


# ---------------------------------------------------------------------------------------------
# pdb on a loopback socket
# ---------------------------------------------------------------------------------------------


def _get_listener() -> tuple[socket.socket, str]:
    """This process's listening socket and token, made once so the attach command stays the same."""
    global _listener
    if _listener is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))  # loopback only: the debugger runs arbitrary code
        sock.listen(1)
        _listener = (sock, secrets.token_hex(8))
    return _listener


class _Terminal:
    """pdb's stdin and stdout: one authenticated connection at a time.

    While pdb waits for a line, ``idle()`` runs every few milliseconds (it answers other ranks' gather
    requests). What pdb writes while no terminal is attached is kept and sent on attaching; a
    terminal that re-attaches gets ``on_reattach()`` (where pdb stands, and the prompt).
    """

    def __init__(self, listener: socket.socket, token: str, idle: Callable[[], None], banner: str,
                 on_reattach: Callable[[], str]):
        self.listener, self.token, self.idle, self.banner, self.on_reattach = listener, token, idle, banner, on_reattach
        self.conn: socket.socket | None = None
        self.inbox = b""
        self.pending: list[str] = []  # written while detached

    def _attach(self) -> None:
        while self.conn is None:
            ready, _, _ = select.select([self.listener], [], [], 0.05)
            if not ready:
                self._idle()
                continue
            self._accept()

    def _accept(self) -> None:
        """Take a waiting connection; with the right token it replaces the attached terminal (which
        may be a dead ssh session the user cannot close)."""
        conn, _ = self.listener.accept()
        inbox = self.inbox
        if not self._authenticated(conn):
            self.inbox = inbox
            conn.close()
            return
        if self.conn is not None:
            self._send("\n*** another terminal attached to this rank; this one is detached\n")
            self._detach()
        self.conn = conn
        self._send(self.banner)
        self._send("".join(self.pending) if self.pending else self.on_reattach())
        self.pending.clear()

    def _authenticated(self, conn: socket.socket) -> bool:
        """The first line must be the token; a client has 10 s to send it."""
        conn.settimeout(10.0)
        data = b""
        try:
            while b"\n" not in data and len(data) < 256:
                chunk = conn.recv(256)
                if not chunk:
                    return False
                data += chunk
        except OSError:
            return False
        conn.settimeout(None)
        line, _, rest = data.partition(b"\n")
        if not hmac.compare_digest(line.strip(), self.token.encode()):
            try:
                conn.sendall(b"wrong token: use the command this rank printed\n")
            except OSError:
                pass
            return False
        self.inbox = rest  # anything typed right after the token
        return True

    def _idle(self) -> None:
        try:
            self.idle()
        except Exception as e:  # e.g. another debugged rank quit: tell the user, then let it end this rank
            if self.conn is not None:
                self._send(f"\n*** {e}\n")
            self._detach()
            raise

    def _detach(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def _send(self, text: str) -> None:
        try:
            self.conn.sendall(text.encode())
        except OSError:  # the terminal went away; pdb keeps waiting for the next one
            self._detach()

    # -- the file interface pdb uses ------------------------------------------------------

    def readline(self) -> str:
        while True:
            if self.conn is None:
                self._attach()
            line, newline, rest = self.inbox.partition(b"\n")
            if newline:
                self.inbox = rest
                return line.decode(errors="replace") + "\n"
            ready, _, _ = select.select([self.conn, self.listener], [], [], 0.05)
            if not ready:
                self._idle()
                continue
            if self.listener in ready:
                self._accept()
                continue
            try:
                data = self.conn.recv(4096)
            except OSError:
                data = b""
            if not data:
                self._detach()  # closed by the user (Ctrl-D) or the network: wait for a new one
                continue
            self.inbox += data

    def write(self, text: str) -> int:
        if self.conn is None:
            self.pending.append(text)
        else:
            self._send(text)
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._detach()


class DistributedPdb(pdb.Pdb):
    """pdb with ``pg`` (print a DTensor as its global tensor) and a ``continue`` that lets every rank go."""

    def __init__(self, session: _Rendezvous | None, terminal: _Terminal | None = None):
        if terminal is None:
            super().__init__(nosigint=True, readrc=False)
        else:
            super().__init__(stdin=terminal, stdout=terminal, nosigint=True, readrc=False)
        self.session, self.terminal = session, terminal
        rank = session.rank if session is not None else 0
        self.prompt = f"(Pdb rank {rank}) "

    def do_pg(self, arg: str) -> None:
        """pg EXPR
        Print the global tensor that EXPR names (a DTensor is gathered from all ranks; a plain
        tensor is printed as is). EXPR is a variable with .attributes and [indices]; indices on a
        tensor are applied after the gather. The result is kept as `_g` for further `p` commands.
        """
        if not arg.strip():
            self.error("usage: pg EXPR, e.g. `pg self.q_proj.weight.grad` or `pg out.logits[0, :4]`")
            return
        try:
            if self.session is None:
                value, finish = resolve(arg, self.curframe)
                report = describe(value)
                if "error" in report:
                    raise ValueError(f"{arg} {report['error']}")
                tensor = finish(value)
            else:
                tensor, report = self.session.gather(arg, self._depth(), self.curframe)
        except Exception as e:
            self.error(f"{type(e).__name__}: {e}")
            return
        self.curframe_locals["_g"] = tensor
        source = f"{report['kind']} of global shape {tuple(report['shape'])}, {report['dtype']}"
        if report["kind"] == "DTensor":
            source += f", placements ({', '.join(report['placements'])}) on a {tuple(report['mesh_shape'])} mesh"
        self.message(f"{arg}: from a {source}")
        self.message(repr(tensor))

    def _depth(self) -> int:
        """How many frames above the breakpoint's frame pdb stands (other ranks wait at that frame)."""
        frame, depth = self.session.frame, 0
        while frame is not None and frame is not self.curframe:
            frame, depth = frame.f_back, depth + 1
        if frame is None:
            raise ValueError(
                "pg evaluates EXPR on every rank in the frame of the breakpoint (or a caller of it); this frame "
                "is below it, where the other ranks are not: use `up` until you reach it"
            )
        return depth

    def do_continue(self, arg: str) -> bool | None:
        if self.breaks:
            self.clear_all_breaks()
            self.message("*** pdb breakpoints stop one rank only and were cleared; put vescale.debug.breakpoint() in the code")
        if self.session is not None:
            self.session.say_continue()
            if len(self.session.debug_ranks) > 1:
                self.message(f"waiting for the other debugged ranks {list(self.session.debug_ranks)} to continue")
            self.session.wait_until_released()
        if self.terminal is not None:
            self.message(f"rank {self.session.rank}: all ranks go on")
            self.terminal.close()
        self._let_go()
        return super().do_continue(arg)

    def _let_go(self) -> None:
        """Drop what this pdb holds of the run: pdb stays reachable after ``continue`` (the outermost
        frame keeps its trace function), and so would the store, the frames and pdb's snapshot of
        the frame's locals (DTensors, their mesh and process group) until interpreter exit."""
        if self.session is not None:
            self.session.store = self.session.frame = None
        self.session = self.terminal = None
        self.curframe_locals = {}

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool | None:
        if self.session is not None:
            self.session.abort(f"rank {self.session.rank} quit the debugger")
        if self.terminal is not None:
            self.terminal.close()
        return super().do_quit(arg)

    do_q = do_exit = do_quit


def _debug_ranks(rank: int | Iterable[int], world: int) -> tuple[int, ...]:
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if not ranks or not all(isinstance(r, int) for r in ranks):
        raise ValueError(f"vescale.debug.breakpoint(rank={rank!r}): give a rank or a list of ranks (ints)")
    outside = [r for r in ranks if not 0 <= r < world]
    if outside:
        raise ValueError(
            f"vescale.debug.breakpoint(rank={rank!r}): rank(s) {outside} are outside this run of {world} "
            f"rank(s); use ranks 0..{world - 1}"
        )
    return tuple(sorted(set(ranks)))


def breakpoint(rank: int | Iterable[int] = 0) -> None:
    """Stop here in pdb on ``rank`` (an int or a list); every other rank waits here.

    Every rank must call it (it is like a collective). A debugged rank prints to stderr the one-line
    command that attaches a terminal to its pdb; other ranks wait, for as long as it takes, without a
    collective (no process-group timeout applies). ``continue`` on every debugged rank lets all ranks
    go on together; ``quit`` ends the debugged rank and makes the waiting ones raise. In pdb,
    ``pg EXPR`` prints a DTensor as its global tensor. Without torch.distributed, this is plain pdb
    on the terminal (with ``pg``).
    """
    global _calls
    frame = sys._getframe(1)
    if not (dist.is_available() and dist.is_initialized()):
        _debug_ranks(rank, 1)
        DistributedPdb(None).set_trace(frame)
        return
    world, me = dist.get_world_size(), dist.get_rank()
    debug_ranks = _debug_ranks(rank, world)
    _calls += 1
    session = _Rendezvous(dist.distributed_c10d._get_default_store(), _calls, me, world, debug_ranks, frame)
    if me not in debug_ranks:
        session.wait_until_released()
        return
    listener, token = _get_listener()
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    others = "the other ranks wait" if world > len(debug_ranks) else "no other ranks"
    banner = (
        f"vescale.debug.breakpoint: rank {me} of {world} at {where} ({others}).\n"
        "`pg EXPR` prints a DTensor as its global tensor; `c` lets all ranks go on; `q` ends the run.\n"
    )
    terminal = _Terminal(listener, token, session.poll, banner,
                         on_reattach=lambda: pdb_.format_stack_entry(pdb_.stack[pdb_.curindex]) + "\n" + pdb_.prompt)
    pdb_ = DistributedPdb(session, terminal)
    host, port = listener.getsockname()
    print(
        f"vescale.debug.breakpoint: rank {me} stopped at {where}; attach with: "
        f"{sys.executable} -m vescale.debug.attach {host}:{port} --token {token}",
        file=sys.stderr, flush=True,
    )
    pdb_.set_trace(frame)  # the last statement: pdb stops at the caller's next line
