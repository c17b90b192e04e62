//! Leadership balancing: which leader transfers spread the shards' leadership evenly over
//! the live members, so that each leads about `shards / live` groups.
//!
//! A pure function over one member's view (who leads each shard, who is up). It moves only
//! shards led by a live member (a dead leader cannot hand over), to live members, and never
//! the same shard twice in one plan. It does not rate-limit itself: the member calls it at
//! most every [`crate::cluster::member::BALANCE_INTERVAL_TICKS`] and performs only the moves
//! away from itself.

/// One leader transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    /// The position of the shard in the `leaders` given to [`plan`].
    pub position: usize,
    /// Its current leader.
    pub from: u64,
    /// The member to hand it to.
    pub to: u64,
}

/// Picks transfers so that every member of `live` leads `⌊n / live⌋` or `⌈n / live⌉` of the
/// `n` shards led by live members. `leaders[i]` is the leader of the i-th shard, if known.
/// Deterministic: ties go to the lower member id and the lower position. At most
/// `leaders.len()` moves.
pub fn plan(leaders: &[Option<u64>], live: &[u64]) -> Vec<Move> {
    let mut live = live.to_vec();
    live.sort_unstable();
    live.dedup();
    let mut owner: Vec<Option<u64>> = leaders
        .iter()
        .map(|leader| leader.filter(|id| live.contains(id)))
        .collect();
    let mut moved = vec![false; leaders.len()];
    let mut moves = Vec::new();
    for _ in 0..leaders.len() {
        let count = |id: u64| owner.iter().filter(|o| **o == Some(id)).count();
        let Some(most) = live
            .iter()
            .copied()
            .max_by_key(|id| (count(*id), u64::MAX - id))
        else {
            break;
        };
        let Some(least) = live.iter().copied().min_by_key(|id| (count(*id), *id)) else {
            break;
        };
        if count(most) <= count(least) + 1 {
            break;
        }
        let candidate = (0..owner.len()).find(|i| owner[*i] == Some(most) && !moved[*i]);
        let Some(position) = candidate else {
            break;
        };
        owner[position] = Some(least);
        moved[position] = true;
        moves.push(Move {
            position,
            from: most,
            to: least,
        });
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;

    fn led(leaders: &[Option<u64>], moves: &[Move], id: u64) -> usize {
        let mut owner = leaders.to_vec();
        for m in moves {
            assert_eq!(owner[m.position], Some(m.from));
            owner[m.position] = Some(m.to);
        }
        owner.iter().filter(|o| **o == Some(id)).count()
    }

    #[test]
    fn all_on_one_member_spreads_evenly() {
        let leaders = vec![Some(1); 64];
        let moves = plan(&leaders, &[1, 2, 3]);
        let counts: Vec<usize> = (1..=3).map(|id| led(&leaders, &moves, id)).collect();
        assert_eq!(counts, vec![22, 21, 21]);
        assert_eq!(moves.len(), 42);
    }

    #[test]
    fn balanced_needs_no_move() {
        let leaders = vec![Some(1), Some(2), Some(3), Some(1)];
        assert!(plan(&leaders, &[1, 2, 3]).is_empty());
    }

    #[test]
    fn a_dead_member_is_neither_source_nor_target() {
        let leaders = vec![Some(3), Some(3), Some(1), Some(1), Some(1), Some(1), None];
        let moves = plan(&leaders, &[1, 2]);
        assert!(moves.iter().all(|m| m.from == 1 && m.to == 2));
        assert_eq!(led(&leaders, &moves, 1), 2);
        assert_eq!(led(&leaders, &moves, 2), 2);
    }

    #[test]
    fn nobody_live_or_no_shards() {
        assert!(plan(&[Some(1), Some(2)], &[]).is_empty());
        assert!(plan(&[], &[1, 2, 3]).is_empty());
        assert!(plan(&[None, None], &[1, 2, 3]).is_empty());
    }

    #[test]
    fn moves_never_repeat_a_shard() {
        let leaders: Vec<Option<u64>> = (0..50).map(|i| Some(1 + (i % 2))).collect();
        let moves = plan(&leaders, &[1, 2, 3, 4, 5]);
        let mut positions: Vec<usize> = moves.iter().map(|m| m.position).collect();
        positions.sort_unstable();
        positions.dedup();
        assert_eq!(positions.len(), moves.len());
        for id in 1..=5 {
            assert_eq!(led(&leaders, &moves, id), 10);
        }
    }
}
