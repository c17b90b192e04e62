//! The lock table as a core's [`Partition`] (a single node), and as the [`TokenLimit`] its
//! token keeper raises. Thin: every method is the table's own.

use super::LockTable;
use crate::partition::{
    partition_of, Answer, ClientRef, GrantRef, HeldKey, Op, Partition, SessionId, TableStats,
};
use crate::tokens::{TokenKeeper, TokenLimit};

impl Partition for LockTable {
    #[inline]
    fn core_of_key(&self, key: &[u8], cores: usize) -> usize {
        partition_of(key, cores)
    }

    #[inline]
    fn handle(&mut self, now_us: u64, session: SessionId, client: ClientRef, op: Op, key: &[u8]) {
        LockTable::handle_as(self, now_us, session, client, op, key);
    }

    #[inline]
    fn handle_timers(&mut self, now_us: u64) {
        LockTable::handle_timers(self, now_us);
    }

    #[inline]
    fn next_deadline_us(&self) -> Option<u64> {
        LockTable::next_deadline_us(self)
    }

    #[inline]
    fn take_answers(&mut self) -> Vec<Answer> {
        LockTable::take_answers(self)
    }

    #[inline]
    fn return_answers(&mut self, answers: Vec<Answer>) {
        LockTable::return_answers(self, answers);
    }

    #[inline]
    fn release_granted(&mut self, now_us: u64, grant: GrantRef, token: u64, client: ClientRef) {
        LockTable::release_granted_as(self, now_us, grant.0, token, client);
    }

    fn handle_session_closed(&mut self, session: SessionId, client: ClientRef) {
        LockTable::handle_session_closed_as(self, session, client);
    }

    fn handle_client_gone(&mut self, now_us: u64, client: ClientRef) {
        LockTable::handle_client_gone(self, now_us, client);
    }

    fn resumes_calls(&self) -> bool {
        true
    }

    fn handle_shutdown(&mut self) {
        LockTable::handle_shutdown(self);
    }

    #[inline]
    fn top_up_tokens(&mut self, keeper: &mut TokenKeeper) {
        keeper.top_up(self);
    }

    fn stats(&self) -> &TableStats {
        LockTable::stats(self)
    }

    fn key_count(&self) -> usize {
        LockTable::key_count(self)
    }

    fn waiter_count(&self) -> usize {
        LockTable::waiter_count(self)
    }

    fn scan_held(
        &self,
        now_us: u64,
        cursor: u32,
        slots: u32,
        prefix: &[u8],
        found: &mut dyn FnMut(HeldKey),
    ) -> Option<u32> {
        LockTable::scan_held(self, now_us, cursor, slots, prefix, &mut |held| found(held))
    }
}

impl TokenLimit for LockTable {
    #[inline]
    fn token_headroom(&self) -> u64 {
        LockTable::token_headroom(self)
    }

    #[inline]
    fn next_token(&self) -> u64 {
        LockTable::next_token(self)
    }

    #[inline]
    fn raise_token_limit(&mut self, limit: u64) {
        LockTable::raise_token_limit(self, limit);
    }
}
