//! Hierarchical timing wheel over `u64` ticks (placeholder: being written).
#![allow(missing_docs, dead_code, unused_variables)]

/// Handle to a scheduled timer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimerHandle {
    index: u32,
    generation: u32,
}

/// The wheel.
pub struct Wheel<T> {
    _p: std::marker::PhantomData<T>,
}

impl<T: Copy> Wheel<T> {
    pub fn new(now_tick: u64) -> Self {
        todo!()
    }
    pub fn now(&self) -> u64 {
        todo!()
    }
    pub fn insert(&mut self, deadline_tick: u64, payload: T) -> TimerHandle {
        todo!()
    }
    pub fn cancel(&mut self, handle: TimerHandle) -> Option<T> {
        todo!()
    }
    pub fn deadline(&self, handle: TimerHandle) -> Option<u64> {
        todo!()
    }
    pub fn advance(&mut self, now_tick: u64, expired: &mut Vec<T>) {
        todo!()
    }
    pub fn next_deadline(&self) -> Option<u64> {
        todo!()
    }
    pub fn len(&self) -> usize {
        todo!()
    }
    pub fn is_empty(&self) -> bool {
        todo!()
    }
    pub fn check_invariants(&self) {}
}
