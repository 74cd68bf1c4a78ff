"""client/channel_watch.py: the paced SuperNode's Fleet channel does not run grpcio's connectivity-polling thread
for Flower's DEBUG-only callback, and behaves as Flower's channel otherwise."""

from __future__ import annotations

import importlib
import logging
import time

import grpc
import pytest

from client import channel_watch as cw

FLOWER = importlib.import_module(cw.MODULE)


class FakeChannel:
    def __init__(self) -> None:
        self.subscribed: list[tuple[object, bool]] = []
        self.unsubscribed: list[object] = []
        self.closed = False

    def subscribe(self, callback, try_to_connect=False):
        self.subscribed.append((callback, try_to_connect))

    def unsubscribe(self, callback):
        self.unsubscribed.append(callback)

    def close(self):
        self.closed = True


@pytest.fixture
def restore():
    yield
    cw.uninstall()


def test_debug_logged_follows_the_handlers_not_the_logger_level():
    parent = logging.getLogger("pgvi-test-cw")
    child = logging.getLogger("pgvi-test-cw.flwr")
    parent.propagate = child.propagate = False
    child.setLevel(logging.DEBUG)  # like Flower's logger: always DEBUG
    info = logging.StreamHandler()
    info.setLevel(logging.INFO)
    child.addHandler(info)
    try:
        assert not cw.debug_logged(child)
        child.propagate = True  # a DEBUG handler up the hierarchy counts
        debug = logging.NullHandler()
        debug.setLevel(logging.DEBUG)
        parent.addHandler(debug)
        assert cw.debug_logged(child)
        parent.removeHandler(debug)
        info.setLevel(logging.DEBUG)
        assert cw.debug_logged(child)
        child.setLevel(logging.INFO)
        assert not cw.debug_logged(child)
    finally:
        child.removeHandler(info)


def test_only_flowers_log_callback_is_skipped_and_only_without_debug():
    flower_cb, mine = FLOWER.on_channel_state_change, (lambda state: None)
    fake = FakeChannel()
    shown = [False]
    quiet = cw.QuietSubscribe(fake, flower_cb, debug_shown=lambda: shown[0])
    quiet.subscribe(flower_cb)
    quiet.subscribe(mine)
    quiet.subscribe(flower_cb, try_to_connect=True)  # asks gRPC to connect: not ours to drop
    assert fake.subscribed == [(mine, False), (flower_cb, True)]
    quiet.unsubscribe(flower_cb)  # the one dropped
    quiet.unsubscribe(mine)
    assert fake.unsubscribed == [mine]
    shown[0] = True  # FLWR_LOG_LEVEL=DEBUG: the states are logged as before
    quiet.subscribe(flower_cb)
    assert fake.subscribed[-1] == (flower_cb, False)
    shown[0] = False  # unsubscribing follows what subscribe did, not the level now
    quiet.unsubscribe(flower_cb)  # the try_to_connect one, passed on
    quiet.unsubscribe(flower_cb)  # the DEBUG one, passed on
    assert fake.unsubscribed == [mine, flower_cb, flower_cb]
    quiet.close()  # everything else is the channel's
    assert fake.closed


def _polling(channel) -> bool:
    inner = channel
    while not hasattr(inner, "_connectivity_state"):  # ours and an intercepted channel wrap the real one
        inner = inner._channel
    return bool(inner._connectivity_state.polling)


def test_install_stops_the_polling_thread_of_a_real_flower_channel(restore, monkeypatch):
    monkeypatch.setattr(cw, "debug_logged", lambda logger=None: False)  # pytest's own handlers take DEBUG
    before = FLOWER.create_channel("127.0.0.1:1", insecure=True)
    before.subscribe(FLOWER.on_channel_state_change)
    assert _polling(before)  # Flower's channel: grpcio starts its polling thread
    before.unsubscribe(FLOWER.on_channel_state_change)
    deadline = time.monotonic() + 10
    while _polling(before) and time.monotonic() < deadline:  # the thread ends at its next 0.2-s wake-up; closing
        time.sleep(0.05)  # the channel before that makes it raise "Channel closed!" in its thread
    assert not _polling(before)
    before.close()
    assert cw.install() is True
    assert cw.install() is True and not getattr(FLOWER.create_channel._pgvi_original, "_pgvi_quiet", False)
    ch = FLOWER.create_channel("127.0.0.1:1", insecure=True)
    ch.subscribe(FLOWER.on_channel_state_change)
    assert not _polling(ch)
    assert isinstance(ch.unary_unary("/x/y"), grpc.UnaryUnaryMultiCallable)  # the rest is the channel's
    ch.close()
    with FLOWER.create_channel("127.0.0.1:1", insecure=True) as ctx:  # as a context manager, like grpc's
        assert isinstance(ctx, cw.QuietSubscribe)
    cw.uninstall()
    assert not getattr(FLOWER.create_channel, "_pgvi_quiet", False)


def test_install_refuses_another_flower_version(monkeypatch, caplog, restore):
    monkeypatch.setattr(cw, "version_problem", lambda: "flwr 1.40.0 is not 1.39.x")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert cw.install() is False
    assert not getattr(FLOWER.create_channel, "_pgvi_quiet", False)
    assert "keeps polling its connectivity" in caplog.text


def test_install_refuses_connection_code_without_the_subscription(monkeypatch, restore):
    monkeypatch.setattr(cw, "CALL", "channel.subscribe(something_else)")
    assert cw.incompatibility() == f"{cw.MODULE} no longer calls channel.subscribe(something_else) once"
    assert cw.install() is False
