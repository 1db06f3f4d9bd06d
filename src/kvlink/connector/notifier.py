"""A worker's second NIXL agent, for notifications only: it never moves data.

Measured on the UCX backend (CMA for data, TCP for control): a READ posted right after
a notification on the same endpoint (attached to the READ or sent on its own) does not
complete until the peer's worker progresses again, even though the CMA copy itself ran
inside the post. In vLLM the peer is a prefill engine in the middle of a forward pass,
which progresses about once per attention layer: the READ of 12 MB took 6-8 ms instead
of 1-2 ms. So the data agent's endpoints carry READs only, and `done` notifications,
heartbeats and the like leave from this agent. The peer's agent takes notifications
from any agent, named or not in its metadata; the sender name is only logged there.

Created at registration; remote agents are loaded from the metadata the data agent
got at the handshake, once per remote agent, and dropped with the remote engine.
"""

from __future__ import annotations

import logging

from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.agent_config import AgentConfig

log = logging.getLogger("kvlink.connector")


class Notifier:
    def __init__(self, name: str, agent_config: AgentConfig | None = None) -> None:
        """Creates the agent (about 20 ms after the process's first one): built at
        registration, so no request pays for it."""
        self.agent = NixlAgent(name, agent_config)
        self._loaded: set[str] = set()
        log.info("kvlink worker: notifications leave from agent %s", name)

    def prepare(self, remote_name: str, metadata: bytes) -> None:
        """Load a remote agent and start the wire-up with it, so that the first notification
        does not wait for one (it would sit queued if this worker stopped progressing)."""
        if remote_name in self._loaded:
            return
        loaded = self.agent.add_remote(metadata)
        if loaded != remote_name:
            self.agent.remove_remote(loaded)
            raise ValueError(f"metadata of {remote_name!r} names agent {loaded!r}")
        self._loaded.add(remote_name)
        self.agent.connect(remote_name)
        self.agent.progress()

    def send(self, remote_name: str, metadata: bytes, msg: bytes) -> None:
        """Send `msg` to `remote_name` (whose NIXL metadata is `metadata`). Raises
        TransferFailed if NIXL refuses it or the peer is gone."""
        self.prepare(remote_name, metadata)
        self.agent.send_notif(remote_name, msg)
        self.agent.progress()

    def forget(self, remote_names: set[str]) -> None:
        """The remote engine is gone or evicted: unload its agents."""
        for name in remote_names & self._loaded:
            self._loaded.discard(name)
            self.agent.remove_remote(name)

    def progress(self) -> None:
        """Push out notifications the transport queued (e.g. during the first wire-up).
        Nobody has this agent's metadata, so nothing should arrive; whatever does is dropped."""
        self.agent.get_notifs()

    def close(self) -> None:
        """The agent is unusable afterwards (the worker drops its notifier)."""
        self.agent.close()
        self._loaded.clear()
