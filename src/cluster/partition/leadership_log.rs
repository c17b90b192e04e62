//! The leadership changes of one iteration, logged as at most three info lines per core
//! instead of one line per shard (a member with 64 shards logged 64 lines at start, and ~150 in
//! two minutes of leader balancing).
//!
//! Deliberately not here: counting the changes (`ClusterStats::leader_changes`) or deciding
//! them; this only words what the partition did.

use std::fmt::Write;

/// What changed in one iteration, flushed at its end.
#[derive(Debug, Default)]
pub(crate) struct LeadershipLog {
    /// Shards this member started serving as leader, with their terms.
    serving: Vec<(u32, u64)>,
    /// Shards it stopped leading.
    stepped_down: Vec<u32>,
    /// Shards it handed to another member to balance leadership, with the member.
    handed: Vec<(u32, u64)>,
}

impl LeadershipLog {
    pub(crate) fn serving(&mut self, shard: u32, term: u64) {
        self.serving.push((shard, term));
    }

    pub(crate) fn stepped_down(&mut self, shard: u32) {
        self.stepped_down.push(shard);
    }

    pub(crate) fn handed(&mut self, shard: u32, to: u64) {
        self.handed.push((shard, to));
    }

    /// The lines for what was recorded since the last call, and forgets it.
    pub(crate) fn take_lines(&mut self, core: usize) -> Vec<String> {
        let mut lines = Vec::new();
        if !self.serving.is_empty() {
            let shards: Vec<u32> = self.serving.iter().map(|(shard, _)| *shard).collect();
            let low = self
                .serving
                .iter()
                .map(|(_, term)| *term)
                .min()
                .unwrap_or(0);
            let high = self
                .serving
                .iter()
                .map(|(_, term)| *term)
                .max()
                .unwrap_or(0);
            let terms = match low == high {
                true => format!("term {low}"),
                false => format!("terms {low}-{high}"),
            };
            lines.push(format!(
                "core {core}: serving as leader: {} ({terms})",
                shard_list(&shards)
            ));
        }
        if !self.stepped_down.is_empty() {
            let list = shard_list(&self.stepped_down);
            lines.push(format!("core {core}: no longer the leader: {list}"));
        }
        if !self.handed.is_empty() {
            let mut text = format!("core {core}: handing leadership over (balance):");
            for (index, (shard, to)) in self.handed.iter().enumerate() {
                let separator = if index == 0 { " " } else { ", " };
                let _ = write!(text, "{separator}shard {shard} to member {to}");
            }
            lines.push(text);
        }
        self.serving.clear();
        self.stepped_down.clear();
        self.handed.clear();
        lines
    }
}

/// `shard 5` or `shards 0-3, 7, 9` (sorted, runs collapsed).
pub(crate) fn shard_list(shards: &[u32]) -> String {
    let mut sorted = shards.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if let [only] = sorted[..] {
        return format!("shard {only}");
    }
    let mut runs: Vec<String> = Vec::new();
    let mut index = 0;
    while index < sorted.len() {
        let start = sorted[index];
        let mut end = start;
        while index + 1 < sorted.len() && sorted[index + 1] == end + 1 {
            index += 1;
            end += 1;
        }
        runs.push(match start == end {
            true => start.to_string(),
            false => format!("{start}-{end}"),
        });
        index += 1;
    }
    format!("shards {}", runs.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_lists_collapse_runs() {
        assert_eq!(shard_list(&[5]), "shard 5");
        assert_eq!(shard_list(&[3, 0, 1, 2, 9, 7]), "shards 0-3, 7, 9");
        assert_eq!(shard_list(&[4, 6]), "shards 4, 6");
        assert_eq!(shard_list(&[]), "shards ");
    }

    #[test]
    fn one_iteration_is_at_most_three_lines() {
        let mut log = LeadershipLog::default();
        assert!(log.take_lines(0).is_empty());
        for shard in 0..64 {
            log.serving(shard, 2 + u64::from(shard % 2));
        }
        log.stepped_down(70);
        log.handed(3, 2);
        log.handed(5, 3);
        let lines = log.take_lines(1);
        assert_eq!(
            lines,
            [
                "core 1: serving as leader: shards 0-63 (terms 2-3)",
                "core 1: no longer the leader: shard 70",
                "core 1: handing leadership over (balance): shard 3 to member 2, shard 5 to \
                 member 3",
            ]
        );
        assert!(log.take_lines(1).is_empty(), "forgotten once taken");
        log.serving(4, 7);
        assert_eq!(
            log.take_lines(0),
            ["core 0: serving as leader: shard 4 (term 7)"]
        );
    }
}
