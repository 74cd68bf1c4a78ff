"""Run the real ServerApp strategy against the real ClientApp in one process, without network or Ray.

``InProcessGrid`` implements Flower's ``Grid``: pushing a message calls the ClientApp synchronously with
that node's persistent ``Context`` and queues the reply (an exception becomes an error reply, as on a
SuperNode).  Hooks let tests lose, duplicate or tamper with replies, take nodes offline (``remove_node``: no
longer listed, so never sent anything) and kill them (``kill_node``: dead but listed, as a SIGKILLed SuperNode
is for the SuperLink until its heartbeat expires: messages to it are accepted and never answered).  It is the
fastest way to run PGVI end to end and the reference for parity with simulation and deployment.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

ReplyHook = Callable[[Message, Message], list[Message]]
"""``(request, reply) -> replies actually delivered`` (``[]`` loses it, ``[r, r]`` duplicates it)."""

SERVER_NODE_ID = 1


class InProcessGrid(Grid):
    def __init__(
        self,
        client_app: ClientApp,
        node_configs: list[dict],
        run_config: dict,
        run_id: int = 1,
        reply_hook: ReplyHook | None = None,
    ) -> None:
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SERVER_NODE_ID
        TaskIdentity.task_id = 0
        self.client_app = client_app
        self.run_config = dict(run_config)
        self.reply_hook = reply_hook
        self._run_id = run_id
        self._ids = itertools.count(1000)
        self.contexts: dict[int, Context] = {}
        self.offline: set[int] = set()
        self.dead: set[int] = set()
        self.dead_messages: list[tuple[float, Message]] = []  # (push time, message) pushed to a dead node, unanswered
        self._replies: dict[str, Message] = {}
        self.bytes_to_clients = 0
        for nc in node_configs:
            self.add_node(nc)

    # node management (test hooks) ---------------------------------------------------------------
    def add_node(self, node_config: dict, keep_state_of: int | None = None) -> int:
        node_id = next(self._ids)
        state = self.contexts[keep_state_of].state if keep_state_of is not None else RecordDict()
        self.contexts[node_id] = Context(self._run_id, node_id, dict(node_config), state, self.run_config)
        return node_id

    def remove_node(self, node_id: int) -> None:
        """The node leaves the federation: no longer listed by ``get_node_ids``, so the server sends it nothing."""
        self.offline.add(node_id)

    def kill_node(self, node_id: int) -> None:
        """The node dies but stays listed, like a SIGKILLed SuperNode that the SuperLink lists until its heartbeat
        expires (some 40-60 s in Flower 1.39): it is still in ``get_node_ids``, a message pushed to it gets an id and
        is recorded in ``dead_messages``, and no reply to it ever comes, so the server must time it out."""
        if node_id not in self.contexts:
            raise KeyError(f"no node {node_id}")
        self.dead.add(node_id)

    # Grid API -----------------------------------------------------------------------------------
    def set_run(self, run) -> None:  # noqa: ANN001 - flwr's Run
        pass

    @property
    def run(self):  # noqa: ANN201
        class _Run:
            run_id = self._run_id

        return _Run()

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.offline]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            node = msg.metadata.dst_node_id
            if node in self.dead:  # accepted, never delivered: the server times it out
                self.dead_messages.append((time.time(), msg))
                continue
            if node in self.offline or node not in self.contexts:
                continue  # lost: the node is gone; the server times out
            self.bytes_to_clients += sum(r.count_bytes() for r in msg.content.array_records.values())
            try:
                reply = self.client_app(msg, self.contexts[node])
            except Exception as err:  # a ClientApp exception becomes an error reply, as on a SuperNode
                reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
            reply.metadata.__dict__["_src_node_id"] = node
            delivered = self.reply_hook(msg, reply) if self.reply_hook else [reply]
            for i, r in enumerate(delivered):
                self._replies[f"{mid}#{i}"] = r
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = set(message_ids)
        out = []
        for key in list(self._replies):
            if key.split("#")[0] in wanted:
                out.append(self._replies.pop(key))
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
