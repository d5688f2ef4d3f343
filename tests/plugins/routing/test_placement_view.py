"""``POST /admin/plugins/routing/placement`` through the real gateway: what an operator reads there of a
worker's KV event feed when placement by its cache does not work. Two fake workers, each with a KV event
publisher on real ZMQ sockets; one of them sends a batch too large to decode and then a frame too large
to take in, and the view shows both against that worker only. The model's tokenizer is a real one made
here (word level), since the view needs a precise model but no prompt is placed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.faults import wait_for
from tests.support.gateways import GatewayFactory, base_config
from tests.support.kv_publisher import ThreadedPublisher, stored

ADMIN = {"authorization": "Bearer placement-admin"}
MESSAGE_BYTES = 4096  # the feed's max_message_bytes here: the default's 16 MiB would need 16 and 64 MiB frames
UNREAD = [stored(list(range(1 << 40, (1 << 40) + 1000)))]  # ~9 kB: over the limit, under four times it
DROPPED = [stored(list(range(1 << 40, (1 << 40) + 4000)))]  # ~36 kB: over four times the limit


def word_tokenizer(directory: Path) -> Path:
    """A real tokenizer.json (word level, whitespace split), made here instead of downloaded."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "parcel": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@contextlib.contextmanager
def fleet(gateway_factory: GatewayFactory, tokenizer: Path) -> Iterator[tuple[list[ThreadedPublisher], ServerThread]]:
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(ServerThread(FakeUpstream(name=f"w{i}"))) for i in range(2)]
        pubs = [ThreadedPublisher(f"kv@w{i}") for i in range(2)]
        for pub in pubs:
            stack.callback(pub.close)
        sources = {s.url: {"endpoint": p.source.endpoint, "replay_endpoint": p.source.replay_endpoint,
                           "topic": p.source.topic} for s, p in zip(servers, pubs, strict=True)}  # fmt: skip
        routing = {
            "default": {"policy": "precise_prefix", "precise": {"tokenizer": str(tokenizer), "block_size": 4}},
            "kv_events": {"sources": sources, "replay_timeout_s": 0.2, "max_message_bytes": MESSAGE_BYTES},
        }
        config = base_config([s.url for s in servers], plugins=[{"name": "routing", "config": routing}])
        _, gw = stack.enter_context(gateway_factory(config, admin_token=ADMIN["authorization"].split()[1]))
        yield pubs, gw


def events(gw: ServerThread) -> list[dict[str, Any]]:
    """Each worker's event stream as the placement view shows it."""
    reply = httpx.post(gw.url + "/admin/plugins/routing/placement", json={}, headers=ADMIN, timeout=10)
    assert reply.status_code == 200, reply.text
    return [row["events"] for row in reply.json()["result"]["models"][0]["workers"]]


def published_until(pub: ThreadedPublisher, done: Any) -> bool:
    """Publish an empty batch, then say whether ``done()``: for what only a later batch brings about."""
    pub.publish([])
    return bool(done())


def test_the_view_shows_a_workers_batches_read_unread_and_connections_made_again(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    with fleet(gateway_factory, word_tokenizer(tmp_path)) as (pubs, gw):
        for i, pub in enumerate(pubs):  # each live socket delivers (a PUB drops what it sends before that)
            wait_for(lambda p=pub, i=i: published_until(p, lambda: events(gw)[i]["received"] > 0), 10, "delivery")
        pubs[0].publish(UNREAD)
        wait_for(lambda: events(gw)[0]["unread"] == 1, 10, "the batch over max_message_bytes counted unread")
        pubs[0].publish(DROPPED)  # ZMQ drops the connection; the gateway makes it again, then resynchronises
        wait_for(lambda: published_until(pubs[0], lambda: events(gw)[0]["resyncs"] >= 1), 20, "the resync")
        mine, other = events(gw)
        assert mine["reconnects"] >= 1 and mine["unread"] == 1 and mine["following"] is True
        assert (other["reconnects"], other["unread"], other["resyncs"]) == (0, 0, 0) and other["received"] >= 1
