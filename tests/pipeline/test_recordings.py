"""``RecordingPool``: the room every stream being recorded at once may hold together. Grants, the
recording's own limit, a pool run dry, and that room always comes back, whatever the order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.pipeline.recordings import GRANT, RecordingPool, Reservation


def test_room_is_taken_in_grants_within_the_recordings_limit() -> None:
    pool = RecordingPool(10 * GRANT)
    room = pool.reserve(3 * GRANT)
    assert room.held == 0 and pool.left == 10 * GRANT  # nothing until the recording holds something
    assert room.fits(100) and room.held == GRANT  # one grant covers a short stream
    assert room.fits(GRANT) and room.held == GRANT  # within what is held: nothing more taken
    assert room.fits(GRANT + 1) and room.held == 2 * GRANT
    assert room.fits(3 * GRANT) and room.held == 3 * GRANT
    assert not room.fits(3 * GRANT + 1) and room.held == 3 * GRANT  # past its own limit
    assert pool.left == 7 * GRANT
    room.release()
    room.release()  # idempotent
    assert (room.held, pool.left) == (0, 10 * GRANT)


def test_a_large_step_takes_what_it_needs_not_one_grant() -> None:
    pool = RecordingPool(10 * GRANT)
    room = pool.reserve(10 * GRANT)
    assert room.fits(4 * GRANT + 7) and room.held == 4 * GRANT + 7


def test_a_dry_pool_refuses_and_what_is_left_is_shared() -> None:
    pool = RecordingPool(GRANT + 10)
    first, second = pool.reserve(4 * GRANT), pool.reserve(4 * GRANT)
    assert first.fits(1) and first.held == GRANT
    assert second.fits(5) and second.held == 10  # what is left, not a whole grant
    assert not second.fits(11)  # the pool is dry
    assert not first.fits(GRANT + 1)
    first.release()
    assert second.fits(GRANT) and (second.held, pool.left) == (GRANT + 10, 0)  # first's room, taken


def test_a_recording_dropped_without_release_gives_its_room_back() -> None:
    pool = RecordingPool(4 * GRANT)
    room = pool.reserve(2 * GRANT)
    assert room.fits(2 * GRANT) and pool.left == 2 * GRANT
    del room
    assert pool.left == 4 * GRANT


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(0, 6 * GRANT),
    steps=st.lists(
        st.tuples(st.sampled_from(["reserve", "fits", "release", "drop"]), st.integers(0, 7), st.integers(0, 3 * GRANT))
    ),
)
def test_the_pool_never_goes_negative_and_gets_everything_back(total: int, steps: list[tuple[str, int, int]]) -> None:
    pool = RecordingPool(total)
    rooms: list[Reservation] = []
    for action, which, size in steps:
        _step(pool, rooms, action, which, size)
        assert 0 <= pool.left <= total
        assert pool.left + sum(r.held for r in rooms) == total
    rooms.clear()  # the recordings dropped, none released: their room comes back with them, at once
    assert pool.left == total


def _step(pool: RecordingPool, rooms: list[Reservation], action: str, which: int, size: int) -> None:
    if action == "reserve" or not rooms:
        rooms.append(pool.reserve(size))
        return
    room = rooms[which % len(rooms)]
    if action == "fits":
        held, left = room.held, pool.left
        fitted = room.fits(size)
        assert fitted == (size <= held or (size <= room.limit and size - held <= left))
        assert size <= room.held <= max(room.limit, held) if fitted else room.held == held
    elif action == "release":
        room.release()
    else:
        rooms.remove(room)
