"""precise_prefix through the real gateway: two fake workers on loopback sockets, each with a KV event
publisher on real ZMQ sockets. A prompt goes where its blocks are, unless it holds less than
``min_match`` of them (then where the cache has room); the workers' reported cached tokens are
checked against the prediction; a model whose predictions disagree falls back to approximate affinity and
comes back; a worker whose events are not followed makes the model fall back; one tenant's salted prompt
never matches another's blocks."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.server.app import GatewayApp
from plugins.routing.blockhash import BlockHasher
from plugins.routing.prompt_tokens import PromptTokenizer
from tests.support.dns import NAME, scripted_routing, two_addresses
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.faults import wait_for
from tests.support.gateways import REPO, GatewayFactory, base_config
from tests.support.kv_fleet import kv_sources, kv_workers
from tests.support.kv_publisher import ThreadedPublisher, stored

MODEL_DIR = REPO / "models" / "smollm2"
BLOCK = 4
ADMIN = {"authorization": "Bearer precise-admin"}
SYSTEM = "You are a careful assistant for a shipping company. Answer in one short sentence, citing the policy."

pytestmark = pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="the default model is not prepared (models/smollm2)")


def chat(question: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    return {"model": "m1", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}], **extra}  # fmt: skip


@pytest.fixture(scope="module")
def hashes_of() -> Callable[[dict[str, Any]], tuple[list[int], list[int]]]:
    """A request's (prompt tokens, block hashes), computed on the side as the workers would."""
    tokenizer = asyncio.run(PromptTokenizer.load(str(MODEL_DIR)))
    hasher = BlockHasher("sha256", None, BLOCK)

    def compute(body: dict[str, Any]) -> tuple[list[int], list[int]]:
        tokens = tokenizer.tokens("chat/completions", body)
        assert tokens is not None
        salt = body.get("cache_salt")
        return tokens, hasher.hashes(tokens, salt)

    return compute


@contextlib.contextmanager
def fleet(
    gateway_factory: GatewayFactory, followed: int = 2, **precise: Any
) -> Iterator[tuple[list[FakeUpstream], list[ThreadedPublisher], GatewayApp, ServerThread]]:
    with contextlib.ExitStack() as stack:
        fakes, servers, pubs = kv_workers(stack)
        sources = kv_sources(servers[:followed], pubs[:followed])
        routing = {
            "default": {"policy": "precise_prefix", "precise": {
                "tokenizer": str(MODEL_DIR), "block_size": BLOCK, "accuracy_min_samples": 4,
                "accuracy_window": 10, **precise}},
            "kv_events": {"sources": sources, "load_interval_s": 0.2},
        }  # fmt: skip
        config = base_config([s.url for s in servers], plugins=[{"name": "routing", "config": routing}])
        app, gw = stack.enter_context(gateway_factory(config, admin_token=ADMIN["authorization"].split()[1]))
        feed = app.state.services.workers.kv
        for server, pub in list(zip(servers, pubs, strict=True))[:followed]:  # wait until each live socket delivers
            for _ in range(100):
                pub.publish([])
                if delivered(feed, server.url):
                    break
            wait_for(lambda url=server.url: delivered(feed, url), 5, "the live socket to deliver")
        yield fakes, pubs, app, gw


def chats(fake: FakeUpstream) -> int:
    return sum(1 for seen in fake.requests if seen.path == "/v1/chat/completions")  # not the /metrics polls


def delivered(feed: Any, url: str) -> bool:
    state = feed.workers.get(url)
    if state is None or state.received == 0:
        time.sleep(0.05)
        return False
    return True


def post(gw: ServerThread, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


def placement(gw: ServerThread) -> dict[str, Any]:
    reply = httpx.post(gw.url + "/admin/plugins/routing/placement", json={}, headers=ADMIN, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]["models"][0]


def test_a_prompt_goes_to_the_worker_holding_its_prefix_and_the_prediction_is_checked(
    gateway_factory: GatewayFactory, hashes_of: Callable[[dict[str, Any]], tuple[list[int], list[int]]]
) -> None:
    with fleet(gateway_factory) as (fakes, pubs, app, gw):
        tokens, hashes = hashes_of(chat("Where is my parcel?"))
        n = len(tokens)
        shared = hashes[: (len(hashes) * 3) // 4]  # the system prompt's blocks and a little more
        # as vLLM sends it: the tokens of the stored blocks (the gateway checks its own hashes of them)
        pubs[1].publish([stored(shared, tokens[: len(shared) * BLOCK], block_size=BLOCK)])
        index = app.state.services.workers.kv.index
        wait_for(lambda: index.blocks(gw_url(fakes, 1, app)) == len(set(shared)), 5, "the blocks indexed")
        predicted = min(len(shared), (n - 1) // BLOCK) * BLOCK
        fakes[1].behavior.cached_tokens = predicted
        for question in ("Where is my parcel?", "Where is my parcel?", "Where is my parcel?", "Where is my parcel?"):
            post(gw, chat(question))
        assert [chats(f) for f in fakes] == [0, 4]
        view = placement(gw)
        assert view["degraded"] is False and view["within_one_block"] == 1.0 and view["checked"] == 4
        assert [w["blocks"] for w in view["workers"]] == [0, len(set(shared))]
        assert view["workers"][1]["hit_rate"] == pytest.approx(predicted / n)
        # the console's workers view: each worker's blocks and recent hit rate
        rows = httpx.get(gw.url + "/admin/workers", headers=ADMIN).json()["models"][0]["workers"]
        assert [(r["kv_blocks"], r["kv_hit_rate"]) for r in rows] == [
            (0, None),
            (len(set(shared)), view["workers"][1]["hit_rate"]),
        ]
        metrics = httpx.get(gw.url + "/metrics", headers=ADMIN).text
        assert 'gateway_routing_placements_total{how="precise",model="m1"} 4.0' in metrics


def test_a_repeat_follows_its_first_request_before_any_event_and_a_new_prompt_goes_where_less_is_placed(
    gateway_factory: GatewayFactory, hashes_of: Callable[[dict[str, Any]], tuple[list[int], list[int]]]
) -> None:
    with fleet(gateway_factory) as (fakes, _pubs, _app, gw):
        first = chat("Which carriers do you use?", system="Returns desk of a bookshop: answer briefly.")
        post(gw, first)
        home = next(i for i, fake in enumerate(fakes) if chats(fake))
        post(gw, first)  # no worker has published its blocks: they are on their way to the first one's worker
        assert [chats(f) for f in fakes] == [2 if i == home else 0 for i in range(2)]
        other = chat("How long do refunds take?", system="Billing for a gym chain: answer briefly.")
        post(gw, other)  # cold (no block in common with the first): the other worker has nothing placed on it
        post(gw, other)
        assert [chats(f) for f in fakes] == [2, 2]
        working_sets = [w["working_set"] for w in placement(gw)["workers"]]  # each prompt's blocks, once
        assert working_sets[home] == len(hashes_of(first)[1]) and working_sets[1 - home] == len(hashes_of(other)[1])


@pytest.mark.parametrize("precise", [{}, {"min_match": 0}], ids=["default", "min_match_0"])
def test_a_prompt_held_for_less_than_half_its_blocks_goes_where_the_cache_has_room(
    gateway_factory: GatewayFactory,
    hashes_of: Callable[[dict[str, Any]], tuple[list[int], list[int]]],
    precise: dict[str, Any],
) -> None:
    with fleet(gateway_factory, **precise) as (fakes, pubs, app, gw):
        first = chat("Which carriers do you use?", system="Returns desk of a bookshop: answer briefly. " * 3)
        post(gw, first)  # cold: it makes its worker's recent working set the larger one
        busy = next(i for i, fake in enumerate(fakes) if chats(fake))
        body = chat("Where is my parcel?")
        tokens, hashes = hashes_of(body)
        assert len(hashes_of(first)[1]) >= len(hashes)
        head = hashes[: len(hashes) // 4]  # a shared head: a quarter of the prompt's blocks, on the busy worker
        pubs[busy].publish([stored(head, tokens[: len(head) * BLOCK], block_size=BLOCK)])
        index = app.state.services.workers.kv.index
        wait_for(lambda: index.blocks(gw_url(fakes, busy, app)) == len(set(head)), 5, "the head indexed")
        post(gw, body)
        # by default the prompt brings more than it would reuse and goes where the cache has room; with
        # min_match 0 it follows the held head
        expected = [0, 0]
        expected[busy] += 1
        expected[busy if precise else 1 - busy] += 1
        assert [chats(f) for f in fakes] == expected


def test_conversations_with_cache_keys_spread_from_their_first_turn_and_stay_home(
    gateway_factory: GatewayFactory,
) -> None:
    """Four conversations after one system prompt. Without keys their first turns follow the first one's
    blocks (on their way to its worker) and all four share a worker; with a key each, a new key goes by
    the working sets, so they split 2/2, and each conversation's later turns go back to its worker."""
    system = "Support desk of a shipping company: follow the policy and answer in one short sentence."

    def turn(i: int, n: int, key: bool) -> dict[str, Any]:
        history = [{"role": "user", "content": f"Conversation {i}, turn {t}."} for t in range(n)]
        body = {"model": "m1", "max_tokens": 4, "messages": [{"role": "system", "content": system}, *history]}
        return {**body, "prompt_cache_key": f"conversation-{i}"} if key else body

    with fleet(gateway_factory) as (fakes, _pubs, _app, gw):
        for i in range(4):
            post(gw, turn(i, 1, key=False))
        assert sorted(chats(f) for f in fakes) == [0, 4]
    with fleet(gateway_factory) as (fakes, _pubs, _app, gw):
        where: dict[int, int] = {}
        for i in range(4):
            before = [chats(f) for f in fakes]
            post(gw, turn(i, 1, key=True))
            where[i] = next(w for w in range(2) if chats(fakes[w]) > before[w])
        assert sorted(where.values()) == [0, 0, 1, 1]
        for n in (2, 3):
            for i in range(4):
                before = [chats(f) for f in fakes]
                post(gw, turn(i, n, key=True))
                assert chats(fakes[where[i]]) == before[where[i]] + 1, (i, n)
        assert all(w["working_set"] > 0 for w in placement(gw)["workers"])
        metrics = httpx.get(gw.url + "/metrics", headers=ADMIN).text
        assert 'gateway_routing_placements_total{how="precise",model="m1"} 12.0' in metrics  # not the fallback


def gw_url(fakes: list[FakeUpstream], i: int, app: GatewayApp) -> str:
    """The URL of fake ``i`` as the gateway's table knows it (in config order)."""
    return app.state.holder.current.models.worker_urls["m1"][i]


def test_predictions_that_disagree_degrade_the_model_until_they_agree_again(
    gateway_factory: GatewayFactory, hashes_of: Callable[[dict[str, Any]], tuple[list[int], list[int]]]
) -> None:
    with fleet(gateway_factory) as (fakes, pubs, app, gw):
        body = chat("Can I change the delivery address?")
        tokens, hashes = hashes_of(body)
        n = len(tokens)
        pubs[0].publish([stored(hashes, block_size=BLOCK)])
        wait_for(lambda: app.state.services.workers.kv.index.blocks(gw_url(fakes, 0, app)) > 0, 5, "the blocks indexed")
        for fake in fakes:
            fake.behavior.cached_tokens = 0  # the workers say they reused nothing: our hashes are not theirs
        for _ in range(4):
            post(gw, body)
        view = placement(gw)
        assert view["degraded"] is True
        metrics = httpx.get(gw.url + "/metrics", headers=ADMIN).text
        assert 'gateway_routing_placement_degraded{model="m1"} 1.0' in metrics
        # Degraded: placed by approximate affinity, still predicted and checked. Now the workers agree.
        fakes[0].behavior.cached_tokens = min(len(hashes), (n - 1) // BLOCK) * BLOCK
        fakes[1].behavior.cached_tokens = 0
        for _ in range(10):
            post(gw, body)
        assert placement(gw)["degraded"] is False
        assert (
            'gateway_routing_placements_total{how="fallback_degraded",model="m1"}'
            in httpx.get(gw.url + "/metrics", headers=ADMIN).text
        )


def test_a_worker_whose_events_are_not_followed_makes_the_model_fall_back(gateway_factory: GatewayFactory) -> None:
    with fleet(gateway_factory, followed=1) as (fakes, _pubs, _app, gw):
        for _ in range(3):
            post(gw, chat("What are your opening hours?"))
        assert sum(chats(f) for f in fakes) == 3
        text = httpx.get(gw.url + "/metrics", headers=ADMIN).text
        assert 'gateway_routing_placements_total{how="fallback_untrusted",model="m1"} 3.0' in text


def test_one_tenants_salted_prompt_never_matches_another_tenants_blocks(
    gateway_factory: GatewayFactory, hashes_of: Callable[[dict[str, Any]], tuple[list[int], list[int]]]
) -> None:
    with fleet(gateway_factory) as (fakes, pubs, app, gw):
        plain = chat("Do you ship abroad?")
        _, hashes = hashes_of(plain)
        pubs[1].publish([stored(hashes, block_size=BLOCK)])  # another tenant's unsalted prompt lives on w1
        wait_for(lambda: app.state.services.workers.kv.index.blocks(gw_url(fakes, 1, app)) > 0, 5, "the blocks indexed")
        salted = chat("Do you ship abroad?", cache_salt="tenant-b")
        fakes[0].behavior.cached_tokens = fakes[1].behavior.cached_tokens = 0
        for _ in range(4):
            post(gw, salted)
        view = placement(gw)
        assert view["within_one_block"] == 1.0  # predicted 0 on whichever worker: the salt changes block 0
        assert hashes_of(salted)[1][0] != hashes[0]


def test_workers_found_later_by_dns_are_followed_too(gateway_factory: GatewayFactory) -> None:
    port = free_port()
    answers = {NAME: ["127.0.0.1"]}
    routing = {"discovery": {"dns_interval_s": 0.2},
               "default": {"policy": "precise_prefix", "precise": {"tokenizer": str(MODEL_DIR)}}}  # fmt: skip
    with two_addresses(port):
        cfg = base_config([f"dns://{NAME}:{port}"], plugins=[{"name": "routing", "config": routing}])
        with gateway_factory(cfg, plugins={"routing": scripted_routing(answers)}) as (app, gw):
            feed = app.state.services.workers.kv
            assert set(feed.workers) == {f"http://127.0.0.1:{port}"}
            answers[NAME] = ["127.0.0.1", "127.0.0.2"]
            wait_for(lambda: len(app.state.services.workers.expand([f"dns://{NAME}:{port}"])) == 2,
                     5, "the second address resolved")  # fmt: skip
            post(gw, chat("Hello?"))  # the model's pool is rebuilt with the new worker
            wait_for(lambda: len(feed.workers) == 2, 5, "the new worker followed")


def test_a_short_prompt_is_placed_while_another_clients_long_prompt_is_still_being_tokenized(
    gateway_factory: GatewayFactory,
) -> None:
    """The model's tokenizer serves one prompt at a time and a long one holds it for seconds: a request that
    finds it busy is placed without a prediction (approximate affinity) rather than wait its turn, and the
    long tokenization lets the event loop run meanwhile."""
    with fleet(gateway_factory) as (fakes, _, app, gw):
        tokenizer = next(iter(app.state.services.shared["routing"].tokenizers.values()))
        model_tokenizer, encode = tokenizer._tok, tokenizer._tok.encode
        started, finished = threading.Event(), threading.Event()

        def observed(text: str, add_special_tokens: bool, at_most: int | None = None) -> list[int] | None:
            long = len(text) > 1_000_000
            if long:
                started.set()
            try:
                return encode(text, add_special_tokens, at_most)
            finally:
                if long:
                    finished.set()

        model_tokenizer.encode = observed  # the real tokenizer, with a hook on the long prompt
        long_body = chat("Where is my parcel? I ordered it last week. " * 40_000)  # 1.8 MB: seconds to tokenize
        with ThreadPoolExecutor(1) as client:
            long = client.submit(httpx.post, gw.url + "/v1/chat/completions", json=long_body, timeout=300)
            assert started.wait(60)
            post(gw, chat("Where is my parcel?"))  # routed to a worker of the fleet
            assert not finished.is_set()  # it did not wait for the long prompt's tokenization
            assert long.result().status_code == 200
        assert finished.is_set() and sum(chats(f) for f in fakes) == 2
