//! The steps of a run, and answers in the form they are compared in.

use latchkey::partition::SessionId;
use latchkey_client::protocol::Response;

/// One step.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    Advance {
        to_us: u64,
    },
    Acquire {
        session: SessionId,
        key: usize,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
    },
    Release {
        session: SessionId,
        key: usize,
        token: Pick,
    },
    Extend {
        session: SessionId,
        key: usize,
        lease_s: u8,
        token: Pick,
    },
    Cancel {
        session: SessionId,
        key: usize,
        owner: u64,
    },
    Query {
        session: SessionId,
        key: usize,
        nonce: u64,
    },
    Close {
        session: SessionId,
    },
    Shutdown,
}

impl Step {
    pub fn name(&self) -> &'static str {
        match self {
            Step::Advance { .. } => "advance",
            Step::Acquire { wait_s: 0, .. } => "acquire0",
            Step::Acquire { .. } => "acquire",
            Step::Release { .. } => "release",
            Step::Extend { .. } => "extend",
            Step::Cancel { .. } => "cancel",
            Step::Query { .. } => "query",
            Step::Close { .. } => "close",
            Step::Shutdown => "shutdown",
        }
    }
}

/// Which token a release or extend names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// The holder's.
    Holder,
    /// The key's last token that is not the holder's (a holder whose lease ran out, or that
    /// released already).
    Old,
    /// One that never held anything.
    Never,
}

/// An answer as compared: (session, kind, owner or nonce, ends-pending, `Q`'s fields).
pub type Said = (SessionId, char, u64, bool, Option<(bool, u32, u32)>);

/// An answer as compared (see [`Said`]); tokens are each subject's own and left out.
pub fn said_of(
    session: SessionId,
    response: &Response,
    ends_pending: bool,
) -> Result<Said, String> {
    let (kind, id, state) = match *response {
        Response::Acquired { owner, .. } => ('A', owner, None),
        Response::Timeout { owner } => ('T', owner, None),
        Response::Busy { owner } => ('B', owner, None),
        Response::Released { .. } => ('R', 0, None),
        Response::Extended { .. } => ('E', 0, None),
        Response::NotHeld { .. } => ('N', 0, None),
        Response::State {
            nonce,
            held,
            lease_ms,
            waiters,
        } => ('Q', nonce, Some((held, lease_ms, waiters))),
        other => return Err(format!("an answer the queue rules never give: {other:?}")),
    };
    Ok((session, kind, id, ends_pending, state))
}
