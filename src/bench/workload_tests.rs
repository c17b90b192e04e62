//! The session state machine on virtual time, with a wire that records what it is asked to
//! send and answers nothing by itself.

use super::*;
use crate::bench::cluster::{Leaders, MOVED_RETRY, REDIRECTS_MAX};
use crate::bench::stats::Stats;
use crate::bench::wire::{ParseOutcome, Reply};
use crate::bench::{parse_target, BenchConfig};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Sent {
    Acquire {
        slot: u16,
        key: Vec<u8>,
        owner: u64,
        wait_s: u8,
    },
    Release {
        slot: u16,
        key: Vec<u8>,
        token: u64,
    },
    Query {
        slot: u16,
        key: Vec<u8>,
        nonce: u64,
    },
}

#[derive(Default)]
struct FakeWire {
    sent: Vec<Sent>,
}

impl Wire for FakeWire {
    fn encode_acquire(&mut self, out: &mut Vec<u8>, slot: u16, key: &[u8], owner: u64, wait_s: u8) {
        out.push(b'a');
        self.sent.push(Sent::Acquire {
            slot,
            key: key.to_vec(),
            owner,
            wait_s,
        });
    }

    fn encode_release(&mut self, out: &mut Vec<u8>, slot: u16, key: &[u8], token: u64) {
        out.push(b'r');
        self.sent.push(Sent::Release {
            slot,
            key: key.to_vec(),
            token,
        });
    }

    fn encode_query(&mut self, out: &mut Vec<u8>, slot: u16, key: &[u8], nonce: u64) {
        out.push(b'q');
        self.sent.push(Sent::Query {
            slot,
            key: key.to_vec(),
            nonce,
        });
    }

    fn parse(&mut self, _buf: &[u8]) -> ParseOutcome {
        Ok(None)
    }
}

/// One worker with one session, on virtual time.
struct Rig {
    now: Instant,
    plan: Plan,
    stats: Stats,
    timers: Timers,
    keys: KeySource,
    clock: HandoffClock,
    wires: Vec<FakeWire>,
    outs: Vec<Vec<u8>>,
    leaders: Leaders,
    session: Session,
}

impl Rig {
    fn new(config: BenchConfig, keys: KeySource) -> Rig {
        let now = Instant::now();
        let plan = Plan::new(&config, *b"tst");
        let mut stats = Stats::new(1);
        stats.start_window();
        Rig {
            timers: Timers::new(&plan, usize::from(config.pipeline)),
            clock: HandoffClock::new(now, config.hot_keys),
            session: Session::new(0, 0, config.pipeline, now),
            now,
            plan,
            stats,
            keys,
            wires: vec![FakeWire::default()],
            outs: vec![Vec::new()],
            leaders: Leaders::new(vec!["127.0.0.1:1".parse().unwrap()], 1, None),
        }
    }

    /// A rig whose target is a cluster of `members` members (a lane each).
    fn cluster(config: BenchConfig, keys: KeySource, members: u16, key_space: u64) -> Rig {
        let mut rig = Rig::new(config, keys);
        let addrs = (1..=members).map(member).collect();
        rig.wires = (0..members).map(|_| FakeWire::default()).collect();
        rig.outs = vec![Vec::new(); usize::from(members)];
        rig.leaders = Leaders::new(addrs, key_space, None);
        rig
    }

    fn call<R>(
        &mut self,
        f: impl FnOnce(&mut Session, &mut Context, &mut Outbox<FakeWire>) -> R,
    ) -> R {
        let mut ctx = Context {
            now: self.now,
            plan: &self.plan,
            stats: &mut self.stats,
            timers: &mut self.timers,
            keys: &mut self.keys,
            clock: &self.clock,
        };
        let mut outbox = Outbox {
            wires: &mut self.wires,
            outs: &mut self.outs,
            leaders: &mut self.leaders,
        };
        f(&mut self.session, &mut ctx, &mut outbox)
    }

    fn kick(&mut self) {
        self.call(|session, ctx, outbox| session.kick(ctx, outbox));
    }

    fn answer(&mut self, answer: Answer) -> Result<(), ReplyError> {
        let reply = Reply { answer, slot: None };
        self.call(|session, ctx, outbox| session.handle_reply(reply, ctx, outbox))
    }

    fn fire_timers(&mut self) {
        let now = self.now;
        while let Some((_, slot)) = self.timers.pop_due(now) {
            self.call(|session, ctx, outbox| session.handle_timer(slot, ctx, outbox));
        }
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
    }

    fn take_sent(&mut self) -> Vec<Sent> {
        std::mem::take(&mut self.wires[0].sent)
    }

    /// What was sent to member `index` (0-based) since the last look.
    fn take_sent_to(&mut self, index: usize) -> Vec<Sent> {
        std::mem::take(&mut self.wires[index].sent)
    }
}

/// The address of member `n` (1-based) of a rig's cluster.
fn member(n: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], n))
}

fn config(target: &str, workload: Workload, pipeline: u16) -> BenchConfig {
    let mut config = BenchConfig::new(parse_target(target).unwrap(), workload);
    config.connections = 1;
    config.pipeline = pipeline;
    config.keys = 4 * u64::from(pipeline);
    config.validate().unwrap()
}

fn key(prefix: u8, index: u64) -> Vec<u8> {
    key_name(prefix, *b"tst", index).to_vec()
}

fn acquire_owner(sent: &Sent) -> u64 {
    match sent {
        Sent::Acquire { owner, .. } => *owner,
        _ => panic!("expected an acquire, got {sent:?}"),
    }
}

#[test]
fn uncontended_cycles_acquire_release_on_disjoint_keys() {
    let config = config("latchkey://127.0.0.1:1", Workload::Uncontended, 2);
    let spread = KeySource::Spread {
        stride: 2,
        per_slot: 4,
        rng: Rng::new(1),
    };
    let mut rig = Rig::new(config, spread);
    rig.kick();
    let sent = rig.take_sent();
    assert_eq!(sent.len(), 2);
    for (slot, request) in sent.iter().enumerate() {
        let Sent::Acquire {
            slot: s,
            key: name,
            wait_s,
            ..
        } = request
        else {
            panic!()
        };
        assert_eq!((usize::from(*s), *wait_s), (slot, 0));
        let index: u64 = std::str::from_utf8(&name[4..]).unwrap().parse().unwrap();
        assert_eq!(index % 2, slot as u64, "slot {slot} stays on its own keys");
        assert_eq!(name[0], b'u');
    }
    let owner = acquire_owner(&sent[1]);
    rig.advance(Duration::from_micros(30));
    rig.answer(Answer::Granted { owner, token: 500 }).unwrap();
    let Sent::Release {
        slot: 1,
        token: 500,
        ..
    } = rig.take_sent()[0]
    else {
        panic!()
    };
    rig.answer(Answer::Released { token: 500 }).unwrap();
    let next = rig.take_sent();
    assert!(
        matches!(next[..], [Sent::Acquire { slot: 1, .. }]),
        "{next:?}"
    );
    assert_ne!(
        acquire_owner(&next[0]),
        owner,
        "every acquire has a fresh owner"
    );
    assert_eq!((rig.stats.cycles, rig.stats.requests), (1, 2));
    assert_eq!(
        (rig.stats.counts.granted, rig.stats.counts.released),
        (1, 1)
    );
    assert_eq!(rig.stats.latency.len(), 2);
    assert!(rig.stats.latency.max() >= 29_000);
}

#[test]
fn answers_that_match_nothing_are_errors() {
    let config = config("latchkey://127.0.0.1:1", Workload::Uncontended, 1);
    let spread = KeySource::Spread {
        stride: 1,
        per_slot: 4,
        rng: Rng::new(1),
    };
    let mut rig = Rig::new(config, spread);
    rig.kick();
    let owner = acquire_owner(&rig.take_sent()[0]);
    let stranger = Answer::Granted {
        owner: owner + (1 << 32),
        token: 1,
    };
    assert_eq!(
        rig.answer(stranger),
        Err(ReplyError::Uncorrelated(stranger))
    );
    assert!(
        rig.answer(Answer::Released { token: 1 }).is_err(),
        "nothing is being released"
    );
    assert!(rig.answer(Answer::Refused { id: 0, code: 7 }).is_err());
    rig.answer(Answer::Refused { id: owner, code: 3 }).unwrap();
    assert_eq!(rig.stats.counts.refused, 1);
    assert_eq!(rig.stats.counts.unexpected(Workload::Uncontended), 1);
}

#[test]
fn a_timeout_in_uncontended_is_counted_and_the_slot_moves_on() {
    let config = config("redis://127.0.0.1:1", Workload::Uncontended, 1);
    let spread = KeySource::Spread {
        stride: 1,
        per_slot: 4,
        rng: Rng::new(3),
    };
    let mut rig = Rig::new(config, spread);
    rig.kick();
    let owner = acquire_owner(&rig.take_sent()[0]);
    rig.answer(Answer::Timeout { owner }).unwrap();
    assert_eq!(
        (rig.stats.counts.timeout, rig.stats.counts.retries),
        (1, 0),
        "no retry at wait 0"
    );
    assert_eq!(rig.take_sent().len(), 1, "the next cycle started");
}

#[test]
fn redis_contended_retries_every_millisecond_until_the_wait_runs_out() {
    let mut config = config("redis://127.0.0.1:1", Workload::Contended, 1);
    config.wait = Duration::from_millis(2);
    let mut rig = Rig::new(
        config,
        KeySource::Hot {
            count: 1,
            rng: Rng::new(5),
        },
    );
    rig.kick();
    let first = rig.take_sent();
    let owner = acquire_owner(&first[0]);
    for attempt in 1..=2 {
        rig.answer(Answer::Timeout { owner }).unwrap();
        assert!(
            rig.take_sent().is_empty(),
            "attempt {attempt}: waits for the retry timer"
        );
        rig.advance(Duration::from_micros(999));
        rig.fire_timers();
        assert!(rig.take_sent().is_empty(), "not before a millisecond");
        rig.advance(Duration::from_micros(1));
        rig.fire_timers();
        let retry = rig.take_sent();
        assert_eq!(retry.len(), 1);
        assert_eq!(acquire_owner(&retry[0]), owner, "a retry keeps its owner");
    }
    rig.answer(Answer::Timeout { owner }).unwrap();
    assert_eq!((rig.stats.counts.retries, rig.stats.counts.timeout), (2, 1));
    assert_eq!(rig.stats.counts.unexpected(Workload::Contended), 0);
}

#[test]
fn contended_holds_then_releases_and_measures_the_handoff() {
    let mut config = config("latchkey://127.0.0.1:1", Workload::Contended, 2);
    config.hold = Duration::from_millis(5);
    config.hot_keys = 1;
    let mut rig = Rig::new(
        config,
        KeySource::Hot {
            count: 1,
            rng: Rng::new(9),
        },
    );
    rig.kick();
    let sent = rig.take_sent();
    assert!(
        sent.iter()
            .all(|s| matches!(s, Sent::Acquire { wait_s: 5, .. })),
        "{sent:?}"
    );
    let (first, second) = (acquire_owner(&sent[0]), acquire_owner(&sent[1]));
    rig.advance(Duration::from_micros(10));
    rig.answer(Answer::Granted {
        owner: first,
        token: 1,
    })
    .unwrap();
    assert!(rig.take_sent().is_empty(), "held for --hold");
    rig.advance(Duration::from_millis(5));
    rig.fire_timers();
    assert!(matches!(
        rig.take_sent()[..],
        [Sent::Release { token: 1, .. }]
    ));
    rig.advance(Duration::from_micros(40));
    rig.answer(Answer::Granted {
        owner: second,
        token: 2,
    })
    .unwrap();
    assert_eq!(rig.stats.handoff.len(), 1);
    let handoff = rig.stats.handoff.max();
    assert!((39_000..=41_000).contains(&handoff), "handoff {handoff} ns");
    assert_eq!(rig.stats.grants_per_connection, vec![2]);
    assert!(
        rig.stats.acquire_latency.max() >= 5_000_000,
        "the second waited ~5 ms"
    );
}

#[test]
fn stop_lets_cycles_in_flight_finish_then_idles() {
    let config = config("latchkey://127.0.0.1:1", Workload::Uncontended, 2);
    let spread = KeySource::Spread {
        stride: 2,
        per_slot: 4,
        rng: Rng::new(1),
    };
    let mut rig = Rig::new(config, spread);
    rig.kick();
    let sent = rig.take_sent();
    rig.session.stop();
    rig.answer(Answer::Busy {
        owner: acquire_owner(&sent[0]),
    })
    .unwrap();
    rig.answer(Answer::Granted {
        owner: acquire_owner(&sent[1]),
        token: 8,
    })
    .unwrap();
    assert!(!rig.session.is_idle());
    assert!(matches!(
        rig.take_sent()[..],
        [Sent::Release { token: 8, .. }]
    ));
    rig.answer(Answer::Released { token: 8 }).unwrap();
    assert!(rig.session.is_idle());
    assert!(rig.take_sent().is_empty(), "no new cycle after stop");
}

/// A `hold` rig whose grant phase is over: keys 10..15 kept, every second one sampled.
fn hold_rig_granted() -> Rig {
    let mut config = config("latchkey://127.0.0.1:1", Workload::Hold, 2);
    config.lease = Duration::from_secs(2);
    let mut rig = Rig::new(config, KeySource::Hold(HoldKeys::new(10..15, 2)));
    rig.kick();
    let mut granted = Vec::new();
    for _ in 0..10 {
        let sent = rig.take_sent();
        if sent.is_empty() {
            break;
        }
        for request in sent {
            let Sent::Acquire {
                key: name,
                owner,
                wait_s: 0,
                ..
            } = request
            else {
                panic!()
            };
            granted.push(name);
            rig.answer(Answer::Granted {
                owner,
                token: owner,
            })
            .unwrap();
        }
    }
    let expected: Vec<_> = (10..15).map(|k| key(b'h', k)).collect();
    assert_eq!(granted, expected, "the range, in order, once each");
    assert!(rig.session.is_idle());
    assert_eq!(rig.stats.cycles, 5);
    let KeySource::Hold(keys) = &mut rig.keys else {
        panic!()
    };
    assert!(keys.granting_done());
    assert_eq!(keys.samples(), 3, "10, 12 and 14 are sampled");
    rig
}

#[test]
fn hold_keeps_its_range_once_each() {
    hold_rig_granted();
}

#[test]
fn hold_waiters_ask_what_is_left_then_queue() {
    let mut rig = hold_rig_granted();
    let KeySource::Hold(keys) = &mut rig.keys else {
        panic!()
    };
    keys.start_waiters(2);
    rig.kick();
    let queries = rig.take_sent();
    let asked: Vec<_> = queries
        .iter()
        .map(|s| match s {
            Sent::Query { key, nonce, .. } => (key.clone(), *nonce),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(asked.len(), 2, "one waiter per slot");
    assert_eq!((&asked[0].0, &asked[1].0), (&key(b'h', 10), &key(b'h', 12)));
    // Answered 100 us after it was asked: the lease is taken to end 1500 ms after the middle
    // of that round trip, plus half a millisecond for the rounding down.
    rig.advance(Duration::from_micros(100));
    let (first, missed) = (asked[0].1, asked[1].1);
    rig.answer(Answer::Remaining {
        nonce: first,
        lease_ms: Some(1500),
    })
    .unwrap();
    rig.answer(Answer::Remaining {
        nonce: missed,
        lease_ms: None,
    })
    .unwrap();
    assert_eq!(rig.stats.expiry_missed, 1, "a free key is a missed sample");
    let sent = rig.take_sent();
    assert!(matches!(sent[..], [Sent::Acquire { wait_s: 4, owner, .. }] if owner == first));
    rig.advance(Duration::from_millis(1503));
    rig.answer(Answer::Granted {
        owner: first,
        token: 77,
    })
    .unwrap();
    assert_eq!(rig.stats.lateness.len(), 1);
    let late = rig.stats.lateness.max();
    assert!((2_540_000..=2_560_000).contains(&late), "late by {late} ns");
    assert!(matches!(
        rig.take_sent()[..],
        [Sent::Release { token: 77, .. }]
    ));
    rig.answer(Answer::Released { token: 77 }).unwrap();
    assert!(rig.session.is_idle(), "no more samples");
}

#[test]
fn delay_queues_fire_in_order_and_not_early() {
    let start = Instant::now();
    let mut queue = DelayQueue::new(Duration::from_millis(1), 4);
    queue.push(start, 0, 1);
    queue.push(start + Duration::from_micros(10), 2, 3);
    assert_eq!(
        queue.next_deadline(),
        Some(start + Duration::from_millis(1))
    );
    assert_eq!(queue.pop_due(start + Duration::from_micros(999)), None);
    let later = start + Duration::from_millis(2);
    assert_eq!(queue.pop_due(later), Some((0, 1)));
    assert_eq!(queue.pop_due(later), Some((2, 3)));
    assert_eq!(queue.pop_due(later), None);
}

#[test]
fn the_generator_covers_its_range() {
    let mut rng = Rng::new(42);
    let mut seen = [0u32; 10];
    for _ in 0..10_000 {
        seen[rng.below(10) as usize] += 1;
    }
    assert!(
        seen.iter().all(|&count| (800..1200).contains(&count)),
        "{seen:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// A cluster target: following M.

/// A three-member rig, pipeline 1, uncontended on keys 0..4.
fn cluster_rig() -> Rig {
    let config = config(
        "latchkey://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
        Workload::Uncontended,
        1,
    );
    let spread = KeySource::Spread {
        stride: 1,
        per_slot: 4,
        rng: Rng::new(11),
    };
    Rig::cluster(config, spread, 3, 4)
}

/// Everything sent since the last look, as (member index, request).
fn sent_anywhere(rig: &mut Rig) -> Vec<(usize, Sent)> {
    let mut all = Vec::new();
    for index in 0..rig.wires.len() {
        all.extend(
            rig.take_sent_to(index)
                .into_iter()
                .map(|sent| (index, sent)),
        );
    }
    all
}

#[test]
fn an_m_naming_a_leader_sends_the_same_request_there_and_the_key_stays_there() {
    let mut rig = cluster_rig();
    rig.kick();
    let first = sent_anywhere(&mut rig);
    let [(asked, Sent::Acquire { owner, ref key, .. })] = first[..] else {
        panic!("{first:?}")
    };
    let leader = (asked + 1) % 3;
    let named = member(leader as u16 + 1);
    rig.advance(Duration::from_micros(40));
    rig.answer(Answer::Moved {
        id: owner,
        leader: Some(named),
    })
    .unwrap();
    let again = sent_anywhere(&mut rig);
    let expected = Sent::Acquire {
        slot: 0,
        key: key.clone(),
        owner,
        wait_s: 0,
    };
    assert_eq!(
        again,
        [(leader, expected)],
        "same owner, to the leader, at once"
    );
    assert_eq!(rig.stats.counts.moved, 1);
    assert_eq!(rig.stats.requests, 0, "an M is not an answered request");
    rig.advance(Duration::from_micros(40));
    rig.answer(Answer::Granted { owner, token: 9 }).unwrap();
    let release = sent_anywhere(&mut rig);
    assert!(
        matches!(release[..], [(l, Sent::Release { token: 9, .. })] if l == leader),
        "the release goes to the key's leader: {release:?}"
    );
    assert!(
        rig.stats.latency.max() >= 80_000,
        "the grant's latency counts from the first send"
    );
    rig.answer(Answer::Released { token: 9 }).unwrap();
    assert_eq!(rig.stats.counts.unexpected(Workload::Uncontended), 0);
}

#[test]
fn an_m_without_a_leader_waits_then_tries_the_next_member() {
    let mut rig = cluster_rig();
    rig.kick();
    let first = sent_anywhere(&mut rig);
    let [(asked, Sent::Acquire { owner, .. })] = first[..] else {
        panic!("{first:?}")
    };
    rig.answer(Answer::Moved {
        id: owner,
        leader: None,
    })
    .unwrap();
    assert!(sent_anywhere(&mut rig).is_empty(), "waits for an election");
    rig.advance(MOVED_RETRY - Duration::from_micros(1));
    rig.fire_timers();
    assert!(sent_anywhere(&mut rig).is_empty(), "never early");
    rig.advance(Duration::from_micros(1));
    rig.fire_timers();
    let again = sent_anywhere(&mut rig);
    assert!(
        matches!(again[..], [(next, Sent::Acquire { owner: o, .. })]
            if next == (asked + 1) % 3 && o == owner),
        "{again:?}"
    );
}

#[test]
fn a_redirected_release_keeps_its_token() {
    let mut rig = cluster_rig();
    rig.kick();
    let first = sent_anywhere(&mut rig);
    let [(asked, Sent::Acquire { owner, .. })] = first[..] else {
        panic!("{first:?}")
    };
    rig.answer(Answer::Granted { owner, token: 4 }).unwrap();
    assert!(matches!(sent_anywhere(&mut rig)[..], [(l, Sent::Release { .. })] if l == asked));
    // Leadership moved between the grant and the release.
    let new_leader = (asked + 2) % 3;
    rig.answer(Answer::Moved {
        id: 4,
        leader: Some(member(new_leader as u16 + 1)),
    })
    .unwrap();
    let again = sent_anywhere(&mut rig);
    assert!(
        matches!(again[..], [(l, Sent::Release { token: 4, .. })] if l == new_leader),
        "{again:?}"
    );
    rig.answer(Answer::Released { token: 4 }).unwrap();
    assert_eq!(rig.stats.cycles, 1);
}

#[test]
fn a_contended_acquire_sent_again_waits_what_is_left() {
    let mut config = config("latchkey://127.0.0.1:1,127.0.0.1:2", Workload::Contended, 1);
    config.wait = Duration::from_secs(5);
    let hot = KeySource::Hot {
        count: 1,
        rng: Rng::new(2),
    };
    let mut rig = Rig::cluster(config, hot, 2, 1);
    rig.kick();
    let first = sent_anywhere(&mut rig);
    let [(
        asked,
        Sent::Acquire {
            owner, wait_s: 5, ..
        },
    )] = first[..]
    else {
        panic!("{first:?}")
    };
    rig.advance(Duration::from_millis(2500));
    let other = member(((asked + 1) % 2) as u16 + 1);
    rig.answer(Answer::Moved {
        id: owner,
        leader: Some(other),
    })
    .unwrap();
    let again = sent_anywhere(&mut rig);
    assert!(
        matches!(again[..], [(_, Sent::Acquire { wait_s: 3, owner: o, .. })] if o == owner),
        "2.5 s left, rounded up: {again:?}"
    );
}

#[test]
fn a_cycle_gives_up_after_redirects_max_and_says_no_leader() {
    let mut rig = cluster_rig();
    rig.kick();
    let first = sent_anywhere(&mut rig);
    let [(_, Sent::Acquire { owner, .. })] = first[..] else {
        panic!("{first:?}")
    };
    for round in 0..usize::from(REDIRECTS_MAX) {
        rig.answer(Answer::Moved {
            id: owner,
            leader: Some(member((round % 3) as u16 + 1)),
        })
        .unwrap();
        let again = sent_anywhere(&mut rig);
        assert!(
            matches!(again[..], [(_, Sent::Acquire { owner: o, .. })] if o == owner),
            "round {round}: {again:?}"
        );
    }
    rig.answer(Answer::Moved {
        id: owner,
        leader: Some(member(1)),
    })
    .unwrap();
    assert_eq!(rig.stats.counts.no_leader, 1);
    assert_eq!(rig.stats.counts.unexpected(Workload::Uncontended), 1);
    let next = sent_anywhere(&mut rig);
    assert!(
        matches!(next[..], [(_, Sent::Acquire { owner: o, .. })] if o != owner),
        "the slot moved on to a new cycle: {next:?}"
    );
}

#[test]
fn an_m_naming_a_member_outside_the_target_is_an_error() {
    let mut rig = cluster_rig();
    rig.kick();
    let owner = acquire_owner(&sent_anywhere(&mut rig)[0].1);
    let stranger = member(99);
    assert_eq!(
        rig.answer(Answer::Moved {
            id: owner,
            leader: Some(stranger),
        }),
        Err(ReplyError::UnknownLeader(stranger))
    );
}
