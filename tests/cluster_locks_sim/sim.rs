//! One seed's run: the event loop on virtual time, the faults, the clients' choices, and
//! where each answer goes.
//!
//! The loop jumps to the next event (a delivery, a member's wake-up, a client's turn, a
//! fault), delivers what is due, applies faults, lets clients act, runs `handle_timers` on
//! every member whose wake-up is due, then puts what members sent on the network.
//! Faults happen only before `heal_us`; then every member is up, linked and lossless. Faults:
//! a member's crash (and restart), a member's isolation, message loss and duplicates, and a
//! cut client connection (the session closes on its member; the client resolves what it had
//! in flight there).

use super::checker::{Checker, Grant};
use super::clients::{Client, Pending, Request, RESENDS_MAX};
use super::world::{World, MEMBERS, SHARDS};
use latchkey::cluster::partition::shard_of;
use latchkey::partition::{Answer, ClientRef, Op};
use latchkey::rng::Rng;
use latchkey_client::protocol::Response;
use std::collections::HashMap;

/// Simulated clients with random traffic.
pub const CLIENTS: usize = 6;
/// Keys they contend on.
pub const KEYS: usize = 5;

/// What one run counted.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// Acquires whose session died before their answer and whose Resolve got no definite
    /// answer within [`RESENDS_MAX`] tries.
    pub indeterminate: u64,
    /// Leader crash → first grant of that shard by another member, µs.
    pub failovers_us: Vec<u64>,
    /// Leader crash → another member serves that shard (barrier applied), µs.
    pub takeovers_us: Vec<u64>,
    /// Answers received, by response letter.
    pub answers: std::collections::BTreeMap<char, u64>,
    /// Resolves answered, by fate (in the wire's order): never seen, granted, queued, timed
    /// out, busy.
    pub resolves: [u64; 5],
    /// Client connections cut.
    pub cuts: u64,
}

/// One seed's world, clients and checker.
pub struct Sim {
    /// The seed.
    pub seed: u64,
    pub(crate) rng: Rng,
    /// Members and network.
    pub world: World,
    /// Clients (random ones, then probes).
    pub clients: Vec<Client>,
    /// The model and its checks.
    pub checker: Checker,
    /// Session → (client, member).
    sessions: HashMap<u64, (usize, u64)>,
    /// Sessions cut: their member may still answer on them, to nobody.
    cut_sessions: std::collections::HashSet<u64>,
    next_session: u64,
    next_id: u64,
    /// Global virtual time, µs.
    pub now_us: u64,
    /// When faults and random traffic stop.
    pub heal_us: u64,
    next_fault_us: u64,
    restart_at: Option<(u64, u64)>,
    unisolate_at: Option<u64>,
    failover_from: [Option<u64>; SHARDS as usize],
    /// Per shard: (crash time, crashed leader) until another member serves it.
    takeover_from: [Option<(u64, u64)>; SHARDS as usize],
    /// Keys.
    pub keys: Vec<Vec<u8>>,
    /// Counts.
    pub stats: RunStats,
}

impl Sim {
    /// A fresh cluster for `seed` whose faults stop at `heal_us`.
    pub fn new(seed: u64, heal_us: u64) -> Sim {
        let mut rng = Rng::new(seed);
        let world = World::new(seed, &mut rng);
        let clients = (0..CLIENTS)
            .map(|_| Client::new(300_000 + rng.below(200_000), rng.next_u64()))
            .collect();
        Sim {
            seed,
            rng,
            world,
            clients,
            checker: Checker::default(),
            sessions: HashMap::new(),
            cut_sessions: std::collections::HashSet::new(),
            next_session: 1,
            next_id: 1,
            now_us: 0,
            heal_us,
            next_fault_us: 500_000,
            restart_at: None,
            unisolate_at: None,
            failover_from: [None; SHARDS as usize],
            takeover_from: [None; SHARDS as usize],
            keys: (0..KEYS).map(|k| format!("key-{k}").into_bytes()).collect(),
            stats: RunStats::default(),
        }
    }

    /// Runs the loop until `end_us`.
    pub fn run_until(&mut self, end_us: u64) {
        while self.now_us < end_us {
            let next = self.next_event_us().min(end_us);
            self.now_us = self.now_us.max(next);
            self.world.deliver(self.now_us);
            self.faults();
            self.clients_act();
            for id in 1..=MEMBERS {
                let node = &self.world.nodes[(id - 1) as usize];
                if node.is_up() && node.wake_us <= self.now_us {
                    let jitter = self.rng.below(200);
                    let iterated = self.world.iterate(id, self.now_us, jitter);
                    for token in iterated.freed {
                        self.checker.freed(self.now_us, id, token);
                    }
                    for (token, owner) in iterated.started {
                        self.checker.executed(self.now_us, id, token, owner);
                    }
                    self.answers(iterated.answers);
                }
            }
            self.world.transmit(self.now_us, &mut self.rng);
            self.takeovers();
        }
    }

    /// Records when another member serves a shard whose serving leader crashed.
    fn takeovers(&mut self) {
        for shard in 0..SHARDS {
            let Some((from, crashed)) = self.takeover_from[shard as usize] else {
                continue;
            };
            let taken = (1..=MEMBERS).any(|id| id != crashed && self.world.serving(id, shard));
            if taken {
                self.stats.takeovers_us.push(self.now_us - from);
                self.takeover_from[shard as usize] = None;
            }
        }
    }

    fn next_event_us(&self) -> u64 {
        let wakes = self
            .world
            .nodes
            .iter()
            .filter(|n| n.is_up())
            .map(|n| n.wake_us);
        let clients = self.clients.iter().map(|c| c.next_us);
        let faults = (self.next_fault_us < self.heal_us).then_some(self.next_fault_us);
        let timers = [
            self.world.next_delivery_us(),
            faults,
            self.restart_at.map(|(_, at)| at),
            self.unisolate_at,
            Some(self.heal_us).filter(|&h| h > self.now_us),
        ];
        wakes
            .chain(clients)
            .chain(timers.into_iter().flatten())
            .min()
            .unwrap_or(u64::MAX)
    }

    fn faults(&mut self) {
        let now = self.now_us;
        if let Some((id, at)) = self.restart_at {
            if at <= now || now >= self.heal_us {
                self.restart_at = None;
                self.world.restart(id, now);
            }
        }
        if self.unisolate_at.is_some_and(|at| at <= now) || now >= self.heal_us {
            self.unisolate_at = None;
            self.world.isolated = None;
        }
        if now >= self.heal_us {
            self.world.loss_percent = 0;
            self.world.dup_percent = 0;
            return;
        }
        if self.next_fault_us > now {
            return;
        }
        self.next_fault_us = now + self.rng.between(100_000, 800_000);
        match self.rng.below(100) {
            0..30 if self.restart_at.is_none() => {
                let id = self.rng.between(1, MEMBERS);
                self.crash(id);
                let down = self.rng.between(100_000, 1_500_000);
                self.restart_at = Some((id, now + down));
            }
            30..60 if self.unisolate_at.is_none() => {
                self.world.isolated = Some(self.rng.between(1, MEMBERS));
                if trace() {
                    eprintln!("{now} isolate {:?}", self.world.isolated);
                }
                self.world.counts.isolations += 1;
                self.unisolate_at = Some(now + self.rng.between(200_000, 1_500_000));
            }
            60..75 => self.cut(),
            75..100 => {
                self.world.loss_percent = self.rng.pick(&[0, 1, 5, 10, 20]);
                self.world.dup_percent = self.rng.pick(&[0, 1, 5]);
            }
            _ => {}
        }
    }

    /// Cuts one client connection: of a client with a request in flight if there is one (an
    /// acquire's most of all), else any; its member closes the session, as a server does when
    /// the connection drops, and the client learns of it at once.
    fn cut(&mut self) {
        let in_flight: Vec<usize> = (0..self.clients.len())
            .filter(|&i| {
                let pending = self.clients[i].pending.as_ref();
                pending.is_some_and(|p| p.sent.is_some())
            })
            .collect();
        let index = if in_flight.is_empty() {
            self.rng.below(self.clients.len() as u64) as usize
        } else {
            in_flight[self.rng.below(in_flight.len() as u64) as usize]
        };
        let sent = self.clients[index].pending.as_ref().and_then(|p| p.sent);
        let (member, session) = match sent {
            Some(sent) => sent,
            None => {
                let sessions = &self.clients[index].sessions;
                let Some((&member, &session)) = sessions.iter().next() else {
                    return;
                };
                (member, session)
            }
        };
        if trace() {
            eprintln!("{} cut c{index} s{session} (m{member})", self.now_us);
        }
        self.stats.cuts += 1;
        self.clients[index].sessions.remove(&member);
        self.sessions.remove(&session);
        self.cut_sessions.insert(session);
        if self.world.up(member) {
            self.world
                .close_session(member, session, ClientRef(index as u32));
        }
        self.session_died(index, member);
    }

    /// Client `index`'s session to `member` died: a request in flight on it is resolved (an
    /// acquire, or a Resolve), or indeterminate (a release, an extend).
    fn session_died(&mut self, index: usize, member: u64) {
        let client = &mut self.clients[index];
        let on_it = client
            .pending
            .as_ref()
            .is_some_and(|p| p.sent.is_some_and(|(at, _)| at == member));
        if !on_it {
            return;
        }
        let pending = client.pending.take().expect("pending");
        match pending.request {
            Request::Acquire {
                owner,
                wait_s,
                lease_s,
            }
            | Request::Resolve {
                owner,
                wait_s,
                lease_s,
            } => {
                // Never resent: asked about (a Resolve is safe to send again).
                let resolve = Request::Resolve {
                    owner,
                    wait_s,
                    lease_s,
                };
                client.pending = Some(Pending {
                    request: resolve,
                    key: pending.key,
                    sent: None,
                    sent_us: 0,
                    resends: pending.resends + 1,
                });
                // A short wait, as a client that notices a broken connection.
                client.next_us = self.now_us + client.rng.between(1_000, 20_000);
            }
            Request::Release { token } => {
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.ended = true;
                }
            }
            Request::Extend { token, .. } => {
                // Maybe applied: the client counts on the earlier deadline for good.
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.deadline_us = belief.until_us();
                    belief.extending = None;
                }
            }
            Request::Query { .. } => {}
        }
    }

    /// Crashes member `id`: its sessions die, and what was in flight on them with them (see
    /// [`Sim::session_died`]).
    pub fn crash(&mut self, id: u64) {
        if trace() {
            eprintln!("{} crash m{id}", self.now_us);
        }
        for shard in 0..SHARDS {
            if self.world.serving(id, shard) && self.failover_from[shard as usize].is_none() {
                self.failover_from[shard as usize] = Some(self.now_us);
            }
            if self.world.serving(id, shard) && self.takeover_from[shard as usize].is_none() {
                self.takeover_from[shard as usize] = Some((self.now_us, id));
            }
        }
        self.world.crash(id);
        self.sessions.retain(|_, (_, member)| *member != id);
        for index in 0..self.clients.len() {
            self.clients[index].sessions.remove(&id);
            self.session_died(index, id);
        }
    }

    fn clients_act(&mut self) {
        for index in 0..self.clients.len() {
            if self.clients[index].next_us <= self.now_us {
                self.act(index);
            }
        }
    }

    fn act(&mut self, index: usize) {
        let now = self.now_us;
        let client = &mut self.clients[index];
        client.next_us = now + client.rng.between(1_000, 100_000);
        match &client.pending {
            Some(pending) if pending.sent.is_none() => return self.send(index),
            Some(pending) => {
                let cancel = matches!(pending.request, Request::Acquire { wait_s: 1.., .. });
                if cancel && !client.probe && client.rng.percent(10) {
                    let (member, session) = pending.sent.expect("sent");
                    let op = Op::Cancel {
                        owner: pending.request.id(),
                    };
                    let key = pending.key.clone();
                    let client = (session, ClientRef(index as u32));
                    let answers = self.world.handle(member, now, client, op, &key);
                    self.answers(answers);
                }
                return;
            }
            None => {}
        }
        if client.probe {
            if let Some(token) = client.probe_token.take() {
                let key = self.keys[index % KEYS].clone();
                self.start(index, Request::Release { token }, key);
            } else {
                client.next_us = u64::MAX;
            }
            return;
        }
        self.choose(index);
    }

    /// A random client's next request (after the heal: only releases of what it holds).
    fn choose(&mut self, index: usize) {
        let now = self.now_us;
        let held: Vec<(u64, Vec<u8>)> = self
            .checker
            .beliefs
            .iter()
            .filter(|(_, b)| b.client == index && !b.releasing && b.live(now + 20_000))
            .map(|(token, b)| (*token, b.key.clone()))
            .collect();
        if now >= self.heal_us {
            if let Some((token, key)) = held.first().cloned() {
                self.start(index, Request::Release { token }, key);
            }
            return;
        }
        let key = self.keys[self.clients[index].rng.below(KEYS as u64) as usize].clone();
        let roll = self.clients[index].rng.below(100);
        let request = if roll < 50 || held.is_empty() && roll < 85 {
            self.next_id += 1;
            Request::Acquire {
                owner: (index as u64) << 40 | self.next_id,
                wait_s: self.clients[index].rng.below(3) as u8,
                lease_s: self.clients[index].rng.between(1, 3) as u8,
            }
        } else if roll < 85 {
            let (token, key) =
                held[self.clients[index].rng.below(held.len() as u64) as usize].clone();
            let request = if roll < 68 {
                Request::Release { token }
            } else {
                let lease_s = self.clients[index].rng.between(1, 3) as u8;
                Request::Extend { token, lease_s }
            };
            return self.start(index, request, key);
        } else {
            self.next_id += 1;
            Request::Query {
                nonce: self.next_id,
            }
        };
        self.start(index, request, key);
    }

    /// Starts a new request of client `index` and sends it.
    pub fn start(&mut self, index: usize, request: Request, key: Vec<u8>) {
        self.clients[index].pending = Some(Pending {
            request,
            key,
            sent: None,
            sent_us: 0,
            resends: 0,
        });
        self.send(index);
    }

    /// Sends client `index`'s pending request to the leader it believes in (or another
    /// member that is up).
    fn send(&mut self, index: usize) {
        let now = self.now_us;
        let client = &mut self.clients[index];
        let pick = client.rng.next_u64();
        let Some(pending) = client.pending.as_mut() else {
            return;
        };
        let shard = shard_of(&pending.key, SHARDS) as usize;
        let mut target = client.leaders[shard].unwrap_or(1 + pick % MEMBERS);
        if !self.world.up(target) {
            target = Client::other_member(target, pick >> 8);
        }
        if !self.world.up(target) {
            target = Client::other_member(target, pick >> 16);
        }
        let session = *client.sessions.entry(target).or_insert_with(|| {
            self.next_session += 1;
            self.next_session
        });
        self.sessions.insert(session, (index, target));
        pending.sent = Some((target, session));
        pending.sent_us = now;
        match pending.request {
            Request::Release { token } => {
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.releasing = true;
                }
            }
            Request::Extend { token, lease_s } => {
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.extending = Some(now + u64::from(lease_s) * 1_000_000);
                }
            }
            _ => {}
        }
        let (op, key) = (pending.request.op(), pending.key.clone());
        if trace() {
            eprintln!("{now} c{index} -> m{target} s{session}: {op:?} {key:?}");
        }
        let client = (session, ClientRef(index as u32));
        let answers = self.world.handle(target, now, client, op, &key);
        self.answers(answers);
    }

    fn answers(&mut self, answers: Vec<Answer>) {
        for answer in answers {
            if answer.session == u64::MAX {
                continue; // NOBODY
            }
            self.answer(answer.session, answer.response);
        }
    }

    fn answer(&mut self, session: u64, response: Response) {
        let now = self.now_us;
        let Some(&(index, member)) = self.sessions.get(&session) else {
            if self.cut_sessions.contains(&session) {
                return; // its connection is gone
            }
            return self
                .checker
                .fail(now, format!("{response:?} for unknown session {session}"));
        };
        let id = match response {
            Response::Acquired { owner, .. }
            | Response::Timeout { owner }
            | Response::Busy { owner } => owner,
            Response::Released { token }
            | Response::Extended { token }
            | Response::NotHeld { token } => token,
            Response::State { nonce, .. } => nonce,
            Response::Moved { id, .. } | Response::Error { id, .. } => id,
            Response::Resolved { owner, .. } => owner,
            _ => 0,
        };
        let letter = match response {
            Response::Acquired { .. } => 'A',
            Response::Timeout { .. } => 'T',
            Response::Busy { .. } => 'B',
            Response::Moved { .. } => 'M',
            Response::Released { .. } => 'R',
            Response::Extended { .. } => 'E',
            Response::NotHeld { .. } => 'N',
            Response::State { .. } => 'Q',
            Response::Resolved { .. } => 'W',
            _ => 'X',
        };
        *self.stats.answers.entry(letter).or_default() += 1;
        if trace() {
            eprintln!("{now} c{index} <- m{member} s{session}: {response:?}");
        }
        let terminal = match response {
            Response::Acquired { .. } => Some('A'),
            Response::Timeout { .. } => Some('T'),
            Response::Busy { .. } => Some('B'),
            Response::Moved { .. } => Some('M'),
            _ => None,
        };
        let pending = self.clients[index].pending.clone();
        let matches = pending
            .as_ref()
            .is_some_and(|p| p.sent == Some((member, session)) && p.request.id() == id);
        let is_acquire = pending
            .as_ref()
            .is_some_and(|p| matches!(p.request, Request::Acquire { .. }));
        if let (Some(what), true) = (terminal, is_acquire && matches) {
            let attempt = pending.as_ref().map_or(0, |p| p.resends);
            self.checker.terminal(now, (session, id, attempt), what);
        }
        let Some(pending) = pending.filter(|_| matches) else {
            let what = format!("{response:?} on session {session} (member {member}) not expected");
            return self.checker.fail(now, what);
        };
        self.outcome(index, member, pending, response);
    }
}

/// Whether `LATCHKEY_LOCKS_SIM_TRACE` asks for every request and answer on stderr.
fn trace() -> bool {
    std::env::var_os("LATCHKEY_LOCKS_SIM_TRACE").is_some()
}

#[path = "outcome.rs"]
mod outcome;
