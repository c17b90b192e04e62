"""``latchkey.aio``: the same §4 rules through coroutines (asyncio.run in each test; no plugin).
Each case names the blocking test (and the Rust test) it repeats."""

from __future__ import annotations

import asyncio
import time
from typing import List

import pytest

import latchkey
import latchkey.aio
from support import FakeMember, FakeServer, Proxy, Server, assert_between, dead_addr, leading, redirect_to, resp

LEASE = 30.0
LATE = 3.0


def aclient(addr: str, sessions: int = 1, transport: float = 2.0) -> latchkey.aio.Client:
    return latchkey.aio.Client(addr, sessions=sessions, connect_timeout=2.0, transport_timeout=transport)


def test_acquire_extend_query_release_and_lock(server: Server) -> None:
    async def main() -> None:
        async with aclient(server.text) as client:
            ticket = await client.acquire("a", wait=1.0, lease=10.0)
            assert ticket.is_valid() and ticket.key == "a" and ticket.token > 0
            assert (await client.query("a")).held
            assert await ticket.extend(20.0) is True
            with pytest.raises(latchkey.Timeout):
                await client.acquire("a", wait=0.2, lease=10.0)
            assert await ticket.release() is True
            assert await ticket.release() is False
            async with client.lock("b", wait=1.0, lease=5.0) as held:
                assert (await client.query("b")).held and held.is_valid()
            assert not (await client.query("b")).held
            assert await client.ping() < 2.0
            with pytest.raises(ValueError):
                await client.acquire("", wait=1.0, lease=1.0)
            with pytest.raises(ValueError):
                await client.acquire("k", wait=256.0, lease=1.0)

    asyncio.run(main())


def test_a_deadline_while_queued_cancels_to_timeout(server: Server, observer: latchkey.Client) -> None:
    """test_faults a_deadline_while_queued_cancels_to_timeout_and_the_session_stays_open"""
    holder = observer.acquire("queued", wait=0.1, lease=LEASE)
    proxy = Proxy(server.addr)

    async def main() -> None:
        async with aclient(proxy.addr) as client:
            start = time.monotonic()
            with pytest.raises(latchkey.Timeout):
                await client.acquire("queued", wait=1.1, lease=LEASE)
            assert_between(time.monotonic() - start, 1.1, 1.1 + LATE)
            assert list(proxy.cancels) == list(proxy.acquires())
            await client.ping()
            assert proxy.connections == 1

    asyncio.run(main())
    assert observer.query("queued").waiters == 0
    holder.release()
    proxy.stop()


def test_a_grant_held_past_the_deadline_is_indeterminate_and_released(server: Server, observer: latchkey.Client) -> None:
    """test_faults a_grant_held_past_the_deadline_is_indeterminate_and_released_promptly"""
    proxy = Proxy(server.addr)

    async def main() -> None:
        async with aclient(proxy.addr, transport=3.0) as client:
            await client.ping()
            proxy.hold()
            task = asyncio.ensure_future(client.acquire("held", wait=0.6, lease=LEASE))
            await asyncio.sleep(1.2)
            assert observer.query("held").held
            proxy.release()
            with pytest.raises(latchkey.Indeterminate):
                await task

    asyncio.run(main())
    start = time.monotonic()
    while observer.query("held").held:
        assert time.monotonic() - start < 1.5, "released well before the lease"
        time.sleep(0.01)
    proxy.stop()


def test_without_resuming_a_cut_mid_frame_is_indeterminate_and_never_resent(server: Server, observer: latchkey.Client) -> None:
    """test_faults without_resuming_a_cut_after_a_partial_frame_is_indeterminate_and_never_resent"""
    proxy = Proxy(server.addr)
    proxy.cut_after(10 + 5)

    async def main() -> None:
        async with latchkey.aio.Client(
            proxy.addr, sessions=2, connect_timeout=2.0, transport_timeout=1.0, resume=None
        ) as client:
            with pytest.raises(latchkey.Indeterminate):
                await client.acquire("cut", wait=1.0, lease=LEASE)

    asyncio.run(main())
    time.sleep(0.3)
    assert list(proxy.acquires().values()) == [1]
    assert not observer.query("cut").held
    proxy.stop()


def test_refused_everywhere_is_unavailable(server: Server) -> None:
    """test_faults a_server_refusing_every_session_is_unavailable_and_nothing_was_executed"""
    proxy = Proxy(server.addr)
    proxy.refuse_next(1 << 30, 0.05)

    async def main() -> None:
        async with aclient(proxy.addr, sessions=2, transport=1.0) as client:
            with pytest.raises(latchkey.Unavailable):
                await client.acquire("refused", wait=0.8, lease=LEASE)

    asyncio.run(main())
    assert not proxy.acquires()
    proxy.stop()


def test_wait_zero_has_its_own_transport_deadline_and_no_cancel() -> None:
    """test_deadlines wait_zero_is_one_attempt_with_its_own_transport_deadline_and_no_cancel"""
    fake = FakeServer()

    async def main() -> None:
        async with aclient(fake.addr, transport=1.0) as client:
            conn = await asyncio.get_running_loop().run_in_executor(None, fake.accept)
            task = asyncio.ensure_future(client.acquire("k", wait=0, lease=LEASE))
            frame = await asyncio.get_running_loop().run_in_executor(None, conn.frame)
            assert frame[0] == "A" and frame[2] == 0
            start = time.monotonic()
            with pytest.raises(latchkey.Indeterminate):
                await task
            assert time.monotonic() - start < 1.0 + LATE
            rest = await asyncio.get_running_loop().run_in_executor(None, conn.expect_eof, 10.0)
            assert rest == [], "no Cancel, no resend"

    asyncio.run(main())


def test_a_late_grant_after_the_cancel_is_released(server: Server) -> None:
    """test_deadlines a_grant_after_the_cancel_is_released_at_once_and_indeterminate"""
    fake = FakeServer()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with aclient(fake.addr, transport=3.0) as client:
            conn = await loop.run_in_executor(None, fake.accept)
            task = asyncio.ensure_future(client.acquire("k", wait=0.3, lease=LEASE))
            owner = (await loop.run_in_executor(None, conn.acquire))[0]
            assert (await loop.run_in_executor(None, conn.frame)) == ("C", owner, "k")
            conn.send(resp("A", owner, 91))
            with pytest.raises(latchkey.Indeterminate):
                await task
            assert (await loop.run_in_executor(None, conn.frame)) == ("R", 91, "k")

    asyncio.run(main())


def test_moved_is_followed_and_no_leader_is_unavailable() -> None:
    """test_redirects an_acquire_follows_one_moved... and an_acquire_that_met_only_no_leader..."""
    leader = FakeMember(leading(77))
    follower = FakeMember(redirect_to(leader.addr))
    electing = FakeMember(redirect_to(None))

    async def main() -> None:
        async with latchkey.aio.Client([follower.addr], sessions=1, transport_timeout=2.0) as client:
            ticket = await client.acquire("k", wait=1.0, lease=10.0)
            assert ticket.token == 77
        async with latchkey.aio.Client([electing.addr, dead_addr()], sessions=1, transport_timeout=2.0) as client:
            start = time.monotonic()
            with pytest.raises(latchkey.Unavailable):
                await client.acquire("k", wait=0.8, lease=10.0)
            assert time.monotonic() - start >= 0.8

    asyncio.run(main())


def test_a_cancelled_task_leaves_no_lock_behind(server: Server, observer: latchkey.Client) -> None:
    holder = observer.acquire("taken", wait=0, lease=LEASE)

    async def main() -> None:
        async with aclient(server.text) as client:
            task = asyncio.ensure_future(client.acquire("taken", wait=5.0, lease=LEASE))
            await asyncio.sleep(0.3)
            holder.release()  # the queued acquire is granted now...
            task.cancel()  # ...to a task that no longer wants it
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.5)

    asyncio.run(main())
    start = time.monotonic()
    while observer.query("taken").held:
        assert time.monotonic() - start < 3.0, "the grant of a cancelled task was not released"
        time.sleep(0.02)


def test_many_tasks_share_one_client(server: Server) -> None:
    """test_faults many_threads_through_a_slow_proxy_each_send_once_and_get_one_result, as tasks"""
    proxy = Proxy(server.addr)
    proxy.delay_up(0.001)
    proxy.delay_down(0.001)
    tasks, calls = 40, 10

    async def main() -> List[int]:
        async with aclient(proxy.addr, sessions=2) as client:

            async def worker(index: int) -> int:
                done = 0
                for call in range(calls):
                    try:
                        ticket = await client.acquire("m%d" % ((index * 7 + call) % 5), wait=0.2, lease=LEASE)
                        await ticket.release()
                    except latchkey.Timeout:
                        pass
                    except latchkey.Indeterminate:
                        # A grant read just before the 0.2 s deadline but delivered after it
                        # (40 tasks on 2 CPUs): released again by the client (§4.2).
                        pass
                    done += 1
                return done

            return list(await asyncio.gather(*(worker(i) for i in range(tasks))))

    results = asyncio.run(main())
    assert sum(results) == tasks * calls
    acquires = proxy.acquires()
    assert len(acquires) == tasks * calls and all(n == 1 for n in acquires.values())
    proxy.stop()


def test_a_cancelled_acquire_withdraws_its_waiter_at_once(server: Server, observer: latchkey.Client) -> None:
    """A task cancelled while its acquire waits in the server's queue: the waiter is withdrawn
    (Cancel), not left to get the key later and give it back."""
    holder = observer.acquire("ghost", wait=0, lease=LEASE)

    def waiters() -> int:
        return observer.query("ghost").waiters

    async def main() -> None:
        async with aclient(server.text) as client:
            task = asyncio.ensure_future(client.acquire("ghost", wait=60.0, lease=LEASE))
            until = time.monotonic() + 10.0
            while waiters() != 1:
                assert time.monotonic() < until, "never queued"
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled = time.monotonic()
            while waiters() != 0:
                assert time.monotonic() - cancelled < 5.0, "the cancelled task's waiter stays queued"
                await asyncio.sleep(0.02)

    asyncio.run(main())
    holder.release()
    assert not observer.query("ghost").held, "nobody was left to take it"


def test_lock_keeps_the_lock_and_a_lost_one_raises_at_the_end(server: Server) -> None:
    async def main() -> None:
        async with aclient(server.text) as client:
            async with client.lock("aio-kept", wait=1.0, lease=1.0) as ticket:
                await asyncio.sleep(2.5)
                assert (await client.query("aio-kept")).held and not ticket.lost.is_set()
            with pytest.raises(latchkey.LockLost) as raised:
                async with client.lock("aio-lost", wait=1.0, lease=1.0, keep_alive=False) as ticket:
                    await asyncio.sleep(1.5)
            assert (raised.value.key, raised.value.token) == ("aio-lost", ticket.token)

    asyncio.run(main())
