//! Test support: a partition whose cluster is its own member alone (its own majority), and its
//! timers run in steps. Shared by the partition's test modules (`drive_tests.rs`,
//! `resume_tests.rs`, `mirror_tests.rs`).

use super::{ClusterPartition, Peers};
use crate::cluster::member::Envelope;
use crate::cluster::writer::LogWriter;
use crate::partition::{Partition, SessionId};
use latchkey_client::protocol::Response;
use raft::eraftpb::Message;

/// No other member; `version` is the cluster version it reports (this build's by default).
pub(super) struct Alone {
    pub(super) version: u8,
}

impl Default for Alone {
    fn default() -> Alone {
        Alone {
            version: crate::cluster::peer::frame::VERSION,
        }
    }
}

impl Peers for Alone {
    fn send(&mut self, _batch: Vec<Envelope>) {}

    fn try_recv(&mut self) -> Option<(u32, Message)> {
        None
    }

    fn cluster_version(&self) -> u8 {
        self.version
    }
}

/// Runs the partition's timers every 10 ms of its clock from `*now_us` for `steps` steps;
/// returns the answers given meanwhile.
pub(super) fn run<D: LogWriter>(
    partition: &mut ClusterPartition<D, Alone>,
    now_us: &mut u64,
    steps: u64,
) -> Vec<(SessionId, Response)> {
    let mut answers = Vec::new();
    for _ in 0..steps {
        *now_us += 10_000;
        partition.handle_timers(*now_us);
        let taken = partition.take_answers().into_iter();
        answers.extend(taken.map(|answer| (answer.session, answer.response)));
    }
    answers
}
