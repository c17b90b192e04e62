//! Writing a session's requests: encoding queued frames just before the socket write, the
//! [`Output`] guard of one write attempt, and what the socket took.
//!
//! Invariant (see [`super`]): a frame is `Encoded` only while an [`Output`] lives; when it
//! ends, every frame of which no byte was handed goes back to the queue, and the output
//! buffer keeps at most the rest of one frame partly handed. Deliberately not here: reading
//! answers and deadlines.

use std::time::Instant;

use super::{Handle, Op, Pipeline, Span, Stage, OUTPUT_BYTES_MAX};
use crate::args::wire_wait_s;

/// One write attempt, from [`Pipeline::output`]: the bytes to hand to the socket.
///
/// It borrows the pipeline mutably, so nothing else (answers, deadlines, new calls) is handled
/// while it lives. Tell it how many bytes the socket took with [`handed`](Output::handed);
/// when it is dropped, every frame of which no byte was handed goes back to the queue. That is
/// what makes "encoded but not handed" a state no frame can keep past one write attempt.
#[must_use = "the bytes are offered to the socket through the guard"]
pub(crate) struct Output<'a> {
    pipeline: &'a mut Pipeline,
    now: Instant,
}

impl Output<'_> {
    /// The bytes to write: empty when there is nothing to send or the session must end.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.pipeline.offered()
    }

    /// The socket took the first `written` bytes of [`bytes`](Self::bytes); they count as
    /// sent at the instant this write attempt started.
    pub(crate) fn handed(&mut self, written: usize) {
        self.pipeline.handle_written(written, self.now);
    }
}

impl Drop for Output<'_> {
    fn drop(&mut self) {
        self.pipeline.requeue_unhanded();
    }
}

impl Pipeline {
    /// Starts one write attempt at `now`, read just before the write: encodes queued frames
    /// behind the rest of a frame already partly written, so each acquire's wire wait is the
    /// time left until its deadline at this instant, rounded up to whole seconds. Queued
    /// requests already past their deadline are expired instead of sent. The guard offers the
    /// bytes; see [`Output`].
    pub(crate) fn output(&mut self, now: Instant) -> Output<'_> {
        if self.close.is_none() && self.is_established() {
            self.compact();
            self.encode_queued(now);
            self.check_invariants();
        }
        Output {
            pipeline: self,
            now,
        }
    }

    /// Drops the frames wholly handed to the socket from the front of the output buffer. A
    /// frame partly handed keeps its handed bytes, so that its span still starts before
    /// `out_written`: that is how [`requeue_unhanded`](Self::requeue_unhanded) tells it from a
    /// frame of which no byte was handed.
    fn compact(&mut self) {
        let cut = self
            .spans
            .front()
            .map_or(self.out_written, |span| span.start);
        if cut == 0 {
            return;
        }
        self.out.drain(..cut);
        self.out_written -= cut;
        for span in &mut self.spans {
            span.start -= cut;
            span.end -= cut;
        }
    }

    /// The bytes of the current write attempt: nothing once the session must end, only the
    /// handshake ping until its pong was read.
    fn offered(&self) -> &[u8] {
        if self.close.is_some() {
            return &[];
        }
        if !self.is_established() {
            return self.hello_offered();
        }
        &self.out[self.out_written..]
    }

    fn encode_queued(&mut self, now: Instant) {
        while self.out.len() < OUTPUT_BYTES_MAX {
            let Some(handle) = self.queue.pop_front() else {
                break;
            };
            let Some(entry) = self.entries.get_mut(handle.slot) else {
                continue;
            };
            if entry.seq != handle.seq || entry.stage != Stage::Queued {
                continue;
            }
            let wait_s = match entry.call.op {
                Op::Cancel { .. } => 0,
                Op::Acquire {
                    wait_zero: false, ..
                } => match wire_wait_s(entry.call.deadline, now) {
                    Some(wait_s) => wait_s,
                    None => {
                        self.expire(handle);
                        continue;
                    }
                },
                _ if now >= entry.call.deadline => {
                    self.expire(handle);
                    continue;
                }
                _ => 0,
            };
            let start = self.out.len();
            entry.call.op.request(wait_s).encode(&mut self.out);
            entry.stage = Stage::Encoded;
            self.spans.push_back(Span {
                handle,
                start,
                end: self.out.len(),
            });
        }
    }

    /// The socket took `written` more bytes of the offered output; `now` is the instant read
    /// before that write.
    fn handle_written(&mut self, written: usize, now: Instant) {
        if self.hello_written(written) {
            return;
        }
        self.out_written += written;
        assert!(
            self.out_written <= self.out.len(),
            "socket took more bytes than offered"
        );
        while let Some(&span) = self.spans.front() {
            if span.start >= self.out_written {
                break;
            }
            let complete = span.end <= self.out_written;
            self.mark_handed(span.handle, complete, now);
            if !complete {
                break;
            }
            self.spans.pop_front();
        }
        self.check_invariants();
    }

    fn mark_handed(&mut self, handle: Handle, complete: bool, now: Instant) {
        // A hostile server may have answered a request before it was fully written.
        let Some(entry) = self.entry_mut(handle) else {
            return;
        };
        if entry.stage == Stage::Encoded {
            entry.stage = Stage::Partial;
            entry.sent_at = Some(now);
            if let Op::Release { token, .. } | Op::Extend { token, .. } = entry.call.op {
                self.tokens.entry(token).or_default().push_back(handle);
            }
            self.note_handed(handle, now);
        }
        let Some(entry) = self.entry_mut(handle) else {
            return;
        };
        if complete && entry.stage == Stage::Partial {
            entry.stage = Stage::Sent;
            if let Op::Cancel { .. } = entry.call.op {
                // A Cancel gets no answer of its own; the acquire's entry waits for the `T`.
                self.take(handle);
            }
        }
    }

    /// The write attempt is over: frames of which no byte was handed go back to the front of
    /// the queue, to be encoded again (with a fresh wire wait) when they really go out.
    fn requeue_unhanded(&mut self) {
        while let Some(&span) = self.spans.back() {
            if span.start < self.out_written {
                break;
            }
            self.spans.pop_back();
            self.out.truncate(span.start);
            if let Some(entry) = self.entry_mut(span.handle) {
                entry.stage = Stage::Queued;
                self.queue.push_front(span.handle);
            }
        }
        debug_assert!(
            self.spans.len() <= 1 && self.spans.iter().all(|s| s.start < self.out_written),
            "only the rest of a frame partly handed to the socket outlives a write attempt"
        );
        self.check_invariants();
    }
}

#[cfg(test)]
mod tests;
